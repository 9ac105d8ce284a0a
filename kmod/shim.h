/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * The C shim's entry points, called from Rust through `extern "C"` declarations that must match
 * these prototypes, and the one Rust function the shim calls back.
 */
#ifndef LEGEND_SHIM_H
#define LEGEND_SHIM_H

#include <linux/types.h>

struct device;
struct file;
struct page;
struct vm_area_struct;
struct legend_sysfs;

long legend_shim_pin_user(unsigned long uaddr, unsigned long npages, struct page **pages);
void legend_shim_unpin_user(struct page **pages, unsigned long npages);
int legend_shim_dma_map_page(struct device *dev, struct page *page, u64 *bus);
void legend_shim_dma_unmap_page(struct device *dev, u64 bus);
int legend_shim_mmap_uncached(struct vm_area_struct *vma, u64 phys);
unsigned long legend_shim_vma_pgoff(struct vm_area_struct *vma);
void legend_shim_zap_file(struct file *file);
void legend_shim_pci_address(struct device *dev, u32 *domain, u8 *bus, u8 *devfn);
int legend_shim_sysfs_add(struct device *dev, const void *ctx, struct legend_sysfs **out);
void legend_shim_sysfs_remove(struct legend_sysfs *s);
void *legend_shim_symbol_get(const char *name);
void legend_shim_symbol_put(const char *name);

/* Implemented in Rust (sysfs.rs). */
u64 legend_nvme_stat(const void *ctx, unsigned int which);

#endif /* LEGEND_SHIM_H */
