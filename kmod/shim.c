// SPDX-License-Identifier: GPL-2.0-only
/*
 * Kernel facilities that are macros or static inlines in C and have no Rust abstraction in 7.3
 * (pinning user pages, streaming DMA mapping of pages, uncached PFN mapping, zapping a file's
 * mappings, sysfs attribute groups). Each wrapper is a thin call; the Rust side keeps the
 * ownership rules.
 */
#include <linux/dma-mapping.h>
#include <linux/fs.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/pci.h>
#include <linux/slab.h>
#include <linux/sysfs.h>

#include "shim.h"

long legend_shim_pin_user(unsigned long uaddr, unsigned long npages, struct page **pages)
{
	/* LONGTERM: the device may access these pages for as long as the mapping lives. */
	return pin_user_pages_fast(uaddr, npages, FOLL_WRITE | FOLL_LONGTERM, pages);
}

void legend_shim_unpin_user(struct page **pages, unsigned long npages)
{
	unpin_user_pages_dirty_lock(pages, npages, true);
}

int legend_shim_dma_map_page(struct device *dev, struct page *page, u64 *bus)
{
	dma_addr_t addr = dma_map_page(dev, page, 0, PAGE_SIZE, DMA_BIDIRECTIONAL);

	if (dma_mapping_error(dev, addr))
		return -ENOMEM;
	*bus = addr;
	return 0;
}

void legend_shim_dma_unmap_page(struct device *dev, u64 bus)
{
	dma_unmap_page(dev, bus, PAGE_SIZE, DMA_BIDIRECTIONAL);
}

int legend_shim_mmap_uncached(struct vm_area_struct *vma, u64 phys)
{
	vma->vm_page_prot = pgprot_noncached(vma->vm_page_prot);
	return io_remap_pfn_range(vma, vma->vm_start, phys >> PAGE_SHIFT,
				  vma->vm_end - vma->vm_start, vma->vm_page_prot);
}

unsigned long legend_shim_vma_pgoff(struct vm_area_struct *vma)
{
	return vma->vm_pgoff;
}

void legend_shim_zap_file(struct file *file)
{
	unmap_mapping_range(file->f_mapping, 0, 0, 1);
}

void legend_shim_pci_address(struct device *dev, u32 *domain, u8 *bus, u8 *devfn)
{
	struct pci_dev *pdev = to_pci_dev(dev);

	*domain = pci_domain_nr(pdev->bus);
	*bus = pdev->bus->number;
	*devfn = pdev->devfn;
}

/*
 * Per-controller attributes under /sys/bus/pci/devices/<BDF>/legend_nvme/. The values live on the
 * Rust side; each show() asks legend_nvme_stat() for one of them. The group is allocated per
 * device because each attribute carries the controller's context.
 */
static const char *const legend_stat_names[] = {
	"queue_pairs",
	"bytes_pinned",
	"admin_commands",
	"index",
};

struct legend_stat_attr {
	struct device_attribute attr;
	const void *ctx;
	unsigned int which;
};

struct legend_sysfs {
	struct device *dev;
	struct legend_stat_attr attrs[ARRAY_SIZE(legend_stat_names)];
	struct attribute *list[ARRAY_SIZE(legend_stat_names) + 1];
	struct attribute_group group;
};

static ssize_t legend_stat_show(struct device *dev, struct device_attribute *attr, char *buf)
{
	struct legend_stat_attr *a = container_of(attr, struct legend_stat_attr, attr);

	return sysfs_emit(buf, "%llu\n", legend_nvme_stat(a->ctx, a->which));
}

int legend_shim_sysfs_add(struct device *dev, const void *ctx, struct legend_sysfs **out)
{
	struct legend_sysfs *s = kzalloc(sizeof(*s), GFP_KERNEL);
	unsigned int i;
	int ret;

	if (!s)
		return -ENOMEM;
	for (i = 0; i < ARRAY_SIZE(legend_stat_names); i++) {
		sysfs_attr_init(&s->attrs[i].attr.attr);
		s->attrs[i].attr.attr.name = legend_stat_names[i];
		s->attrs[i].attr.attr.mode = 0444;
		s->attrs[i].attr.show = legend_stat_show;
		s->attrs[i].ctx = ctx;
		s->attrs[i].which = i;
		s->list[i] = &s->attrs[i].attr.attr;
	}
	s->group.name = "legend_nvme";
	s->group.attrs = s->list;
	s->dev = dev;
	ret = sysfs_create_group(&dev->kobj, &s->group);
	if (ret) {
		kfree(s);
		return ret;
	}
	*out = s;
	return 0;
}

/* Returns once no show() runs any more (kernfs drains active readers). */
void legend_shim_sysfs_remove(struct legend_sysfs *s)
{
	sysfs_remove_group(&s->dev->kobj, &s->group);
	kfree(s);
}

/*
 * Run-time resolution of another module's GPL exports (NVIDIA's nvidia_p2p_*), so this module
 * loads without it. A successful get pins the exporting module until the matching put.
 */
void *legend_shim_symbol_get(const char *name)
{
	return __symbol_get(name);
}

void legend_shim_symbol_put(const char *name)
{
	__symbol_put(name);
}
