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
struct vm_area_struct;
struct vm_fault;
struct legend_sysfs;
struct legend_debugfs;

long legend_shim_pin_user(unsigned long uaddr, unsigned long npages, struct page **pages,
			  struct mm_struct **mm);
void legend_shim_unpin_user(struct page **pages, unsigned long npages, struct mm_struct *mm);
int legend_shim_dma_map_page(struct device *dev, struct page *page, int dir, u64 *bus);
void legend_shim_dma_unmap_page(struct device *dev, u64 bus, int dir);
int legend_shim_map_user(struct device *dev, struct page *const *pages, unsigned long npages,
			 u64 *bus, struct sg_table **out);
void legend_shim_unmap_user(struct device *dev, struct sg_table *sgt);
int legend_shim_doorbell_vma(struct vm_area_struct *vma, const void *ctx);
void legend_shim_insert_pfn(struct vm_fault *vmf, u64 phys, vm_fault_t *ret);
unsigned long legend_shim_vma_pgoff(struct vm_area_struct *vma);
void legend_shim_zap_file(struct file *file);
int legend_shim_iommu_isolated(struct device *dev, int *group_id);
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
