// SPDX-License-Identifier: GPL-2.0-only
/*
 * Kernel facilities that are macros or static inlines in C and have no Rust abstraction in 7.3
 * (pinning user pages, streaming DMA mapping of pages, uncached PFN mapping, zapping a file's
 * mappings). Each wrapper is a thin call; the Rust side keeps the ownership rules.
 */
#include <linux/dma-mapping.h>
#include <linux/fs.h>
#include <linux/mm.h>
#include <linux/pci.h>

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
