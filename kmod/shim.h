/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * The C shim's entry points, called from Rust through `extern "C"` declarations that must match
 * these prototypes, and the one Rust function the shim calls back.
 */
#ifndef LEGEND_SHIM_H
#define LEGEND_SHIM_H

#include <linux/mm_types.h>
#include <linux/types.h>

struct device;
struct file;
struct mm_struct;
struct page;
struct sg_table;
struct user_struct;
struct vm_area_struct;
struct vm_fault;
struct legend_sysfs;
struct legend_debugfs;

long legend_shim_pin_user(unsigned long uaddr, unsigned long npages, struct page **pages,
			  struct mm_struct **mm, struct user_struct **user);
void legend_shim_unpin_user(struct page **pages, unsigned long npages, struct mm_struct *mm,
			    struct user_struct *user);
u64 legend_shim_page_phys(struct page *page);
int legend_shim_dma_map_page(struct device *dev, struct page *page, int dir, u64 *bus);
void legend_shim_dma_unmap_page(struct device *dev, u64 bus, int dir);
int legend_shim_map_user(struct device *dev, struct page *const *pages, unsigned long npages,
			 u64 *bus, struct sg_table **out);
void legend_shim_unmap_user(struct device *dev, struct sg_table *sgt);
int legend_shim_doorbell_vma(struct vm_area_struct *vma, const void *ctx);
void legend_shim_insert_pfn(struct vm_fault *vmf, u64 phys, vm_fault_t *ret);
unsigned long legend_shim_vma_pgoff(struct vm_area_struct *vma);
void legend_shim_zap_file(struct file *file);
/* Most direct-mapped regions legend_shim_isolation() describes (it counts them all). */
#define LEGEND_MAX_DIRECT 8

/* Filled by legend_shim_isolation(); mirrored by `RawIsolation` in isolation.rs. */
struct legend_isolation {
	int group_id; /* -1 without an IOMMU group */
	u32 group_devices;
	u8 translated;
	u8 lazy;
	u8 isolated_msi;
	u8 ats_enabled;
	u32 direct_count;
	u64 direct[LEGEND_MAX_DIRECT][2]; /* start, length */
};

/* Bits of legend_shim_unsafe_params(); mirrored in isolation.rs. */
#define LEGEND_UNSAFE_NOIOMMU 1
#define LEGEND_UNSAFE_LAZY_IOTLB 2
#define LEGEND_UNSAFE_INTERRUPTS 4

void legend_shim_isolation(struct device *dev, struct legend_isolation *out);
bool legend_shim_msix(struct device *dev, u16 *control, u32 *table, u32 *pba);
u32 legend_shim_unsafe_params(void);
void legend_shim_taint_unsafe(void);
void legend_shim_set_master(struct device *dev, bool on);
u32 legend_shim_pci_class(struct device *dev);
void legend_shim_pci_address(struct device *dev, u32 *domain, u8 *bus, u8 *devfn);
int legend_shim_sysfs_add(struct device *dev, const void *ctx, struct legend_sysfs **out);
void legend_shim_sysfs_remove(struct legend_sysfs *s);
void legend_shim_debugfs_add(struct device *dev, const void *ctx, struct legend_debugfs **out);
void legend_shim_debugfs_remove(struct legend_debugfs *d);
void *legend_shim_symbol_get(const char *name);
void legend_shim_symbol_put(const char *name);
void legend_shim_module_get(void);
void legend_shim_module_put(void);

/* Implemented in Rust (sysfs.rs, chardev.rs). */
u64 legend_nvme_stat(const void *ctx, unsigned int which);
void legend_nvme_doorbell_fault(const void *ctx, struct vm_fault *vmf, unsigned long pgoff,
				vm_fault_t *ret);

#endif /* LEGEND_SHIM_H */
