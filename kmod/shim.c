// SPDX-License-Identifier: GPL-2.0-only
/*
 * Kernel facilities that are macros or static inlines in C and have no Rust abstraction in 7.3
 * (pinning and accounting user pages, streaming DMA mapping of pages, fault-time PFN mappings,
 * zapping a file's mappings, IOMMU and interrupt isolation checks, bus mastering, sysfs attribute
 * groups) and the module's parameters. Each wrapper is a thin call; the Rust side keeps the
 * ownership rules.
 */
#include <linux/capability.h>
#include <linux/debugfs.h>
#include <linux/dma-mapping.h>
#include <linux/fs.h>
#include <linux/iommu.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/moduleparam.h>
#include <linux/panic.h>
#include <linux/pci.h>
#include <linux/scatterlist.h>
#include <linux/sched/mm.h>
#include <linux/sched/signal.h>
#include <linux/sched/user.h>
#include <linux/slab.h>
#include <linux/sysfs.h>

#include "shim.h"

/* Gives back a charge of npages to user's locked memory (none where user is NULL). */
static void legend_uncharge(struct user_struct *user, unsigned long npages)
{
	if (!user)
		return;
	atomic_long_sub(npages, &user->locked_vm);
	free_uid(user);
}

/*
 * Pins npages user pages at uaddr for long-term DMA. They are charged, as io_uring's registered
 * buffers and iommufd's pins are, to the calling user's locked memory (user->locked_vm, limited
 * by the caller's RLIMIT_MEMLOCK unless it has CAP_IPC_LOCK): one limit bounds all the pins of a
 * user, in every process and of both kinds. They also count in the caller's VmPin
 * (mm->pinned_vm), as they do for io_uring. On success *mm and *user (NULL with CAP_IPC_LOCK:
 * nothing charged) hold references that legend_shim_unpin_user() drops with the charge.
 */
long legend_shim_pin_user(unsigned long uaddr, unsigned long npages, struct page **pages,
			  struct mm_struct **mm, struct user_struct **user)
{
	struct mm_struct *me = current->mm;
	struct user_struct *who = NULL;
	long got;

	if (!me)
		return -EFAULT;
	if (!capable(CAP_IPC_LOCK)) {
		unsigned long limit = rlimit(RLIMIT_MEMLOCK) >> PAGE_SHIFT;
		long cur;

		who = get_uid(current_user());
		cur = atomic_long_read(&who->locked_vm);
		do {
			if (npages > limit || cur > limit - npages) {
				free_uid(who);
				return -ENOMEM;
			}
		} while (!atomic_long_try_cmpxchg(&who->locked_vm, &cur, cur + npages));
	}
	/* LONGTERM: the device may access these pages for as long as the mapping lives. */
	got = pin_user_pages_fast(uaddr, npages, FOLL_WRITE | FOLL_LONGTERM, pages);
	if (got != (long)npages) {
		if (got > 0)
			unpin_user_pages(pages, got);
		legend_uncharge(who, npages);
		return got < 0 ? got : -EFAULT;
	}
	atomic64_add(npages, &me->pinned_vm);
	mmgrab(me);
	*mm = me;
	*user = who;
	return got;
}

void legend_shim_unpin_user(struct page **pages, unsigned long npages, struct mm_struct *mm,
			    struct user_struct *user)
{
	unpin_user_pages_dirty_lock(pages, npages, true);
	atomic64_sub(npages, &mm->pinned_vm);
	mmdrop(mm);
	legend_uncharge(user, npages);
}

/* The physical address of page, which the caller keeps pinned or allocated. */
u64 legend_shim_page_phys(struct page *page)
{
	return page_to_phys(page);
}

/*
 * Streaming mapping of one page. Refused where the DMA API would need sync calls (SWIOTLB bounce
 * buffers, non-coherent DMA): the device reads and writes these pages for as long as they are
 * mapped, with no point at which a sync could run. dir is the device's access: DMA_TO_DEVICE
 * makes the IOMMU mapping read-only for the device, DMA_FROM_DEVICE write-only where the IOMMU
 * can express it. In the strict domain probe requires, unmapping invalidates the IOTLB before it
 * returns, so the page may be freed or unpinned right after.
 */
int legend_shim_dma_map_page(struct device *dev, struct page *page, int dir, u64 *bus)
{
	dma_addr_t addr = dma_map_page(dev, page, 0, PAGE_SIZE, dir);

	if (dma_mapping_error(dev, addr))
		return -ENOMEM;
	if (dma_need_sync(dev, addr)) {
		dma_unmap_page(dev, addr, PAGE_SIZE, dir);
		return -EOPNOTSUPP;
	}
	*bus = addr;
	return 0;
}

void legend_shim_dma_unmap_page(struct device *dev, u64 bus, int dir)
{
	dma_unmap_page(dev, bus, PAGE_SIZE, dir);
}

/*
 * Maps npages pinned user pages for dev as one scatter-gather table (*out) and writes each
 * page's bus address to bus[]. Behind an IOMMU the DMA API allocates one IOVA range for the whole
 * table, so the addresses are consecutive; without one they are the pages' physical addresses.
 * Refused (-EOPNOTSUPP) where the mapping would need sync calls, as for single pages.
 */
int legend_shim_map_user(struct device *dev, struct page *const *pages, unsigned long npages,
			 u64 *bus, struct sg_table **out)
{
	struct sg_table *sgt = kzalloc(sizeof(*sgt), GFP_KERNEL);
	struct sg_dma_page_iter iter;
	unsigned long i = 0;
	int ret;

	if (!sgt)
		return -ENOMEM;
	/* Physically contiguous pages merge into entries no longer than the device takes. */
	ret = sg_alloc_table_from_pages_segment(sgt, (struct page **)pages, npages, 0,
						npages << PAGE_SHIFT,
						dma_get_max_seg_size(dev) & PAGE_MASK, GFP_KERNEL);
	if (ret)
		goto free;
	ret = dma_map_sgtable(dev, sgt, DMA_BIDIRECTIONAL, 0);
	if (ret)
		goto table;
	for_each_sgtable_dma_page(sgt, &iter, 0) {
		if (i == npages || dma_need_sync(dev, sg_page_iter_dma_address(&iter))) {
			ret = i == npages ? -EIO : -EOPNOTSUPP;
			goto unmap;
		}
		bus[i++] = sg_page_iter_dma_address(&iter);
	}
	if (i != npages) {
		ret = -EIO;
		goto unmap;
	}
	*out = sgt;
	return 0;
unmap:
	dma_unmap_sgtable(dev, sgt, DMA_BIDIRECTIONAL, 0);
table:
	sg_free_table(sgt);
free:
	kfree(sgt);
	return ret == -EINVAL ? -ENOMEM : ret;
}

/* Undoes legend_shim_map_user(); in a strict domain the IOTLB is flushed when this returns. */
void legend_shim_unmap_user(struct device *dev, struct sg_table *sgt)
{
	dma_unmap_sgtable(dev, sgt, DMA_BIDIRECTIONAL, 0);
	sg_free_table(sgt);
	kfree(sgt);
}

/*
 * Doorbell mappings are filled on fault, by legend_nvme_doorbell_fault() under the controller's
 * doorbell lock, so none can be created after unbind revoked them (as VFIO maps BARs).
 */
static vm_fault_t legend_doorbell_fault(struct vm_fault *vmf)
{
	vm_fault_t ret = VM_FAULT_SIGBUS;

	legend_nvme_doorbell_fault(vmf->vma->vm_private_data, vmf, vmf->pgoff, &ret);
	return ret;
}

static const struct vm_operations_struct legend_doorbell_ops = {
	.fault = legend_doorbell_fault,
};

int legend_shim_doorbell_vma(struct vm_area_struct *vma, const void *ctx)
{
	if (!(vma->vm_flags & VM_SHARED))
		return -EINVAL;
	vm_flags_set(vma, VM_IO | VM_PFNMAP | VM_DONTEXPAND | VM_DONTDUMP | VM_DONTCOPY);
	vma->vm_page_prot = pgprot_noncached(vma->vm_page_prot);
	vma->vm_ops = &legend_doorbell_ops;
	vma->vm_private_data = (void *)ctx;
	return 0;
}

void legend_shim_insert_pfn(struct vm_fault *vmf, u64 phys, vm_fault_t *ret)
{
	*ret = vmf_insert_pfn(vmf->vma, vmf->address, phys >> PAGE_SHIFT);
}

unsigned long legend_shim_vma_pgoff(struct vm_area_struct *vma)
{
	return vma->vm_pgoff;
}

void legend_shim_zap_file(struct file *file)
{
	unmap_mapping_range(file->f_mapping, 0, 0, 1);
}

/*
 * What the platform provides dev, for the bind-time isolation rules (isolation.rs): whether its
 * DMA goes through a translating IOMMU domain (DMA or DMA-FQ, not none or identity) and the
 * domain's flush mode, the devices of its IOMMU group, whether the group's interrupt messages
 * are isolated (interrupt remapping, the check VFIO makes), whether ATS is enabled on it, and
 * the regions the firmware maps 1:1 in its domain (RMRR, IVMD: IOMMU_RESV_DIRECT*).
 */
static int legend_count_dev(struct device *dev, void *count)
{
	(*(u32 *)count)++;
	return 0;
}

void legend_shim_isolation(struct device *dev, struct legend_isolation *out)
{
	struct iommu_domain *domain = iommu_get_domain_for_dev(dev);
	struct pci_dev *pdev = to_pci_dev(dev);
	struct iommu_resv_region *region;
	struct iommu_group *group;
	LIST_HEAD(regions);
	int ats;

	memset(out, 0, sizeof(*out));
	out->group_id = -1;
	ats = pci_find_ext_capability(pdev, PCI_EXT_CAP_ID_ATS);
	if (ats) {
		u16 ctrl = 0;

		pci_read_config_word(pdev, ats + PCI_ATS_CTRL, &ctrl);
		out->ats_enabled = !!(ctrl & PCI_ATS_CTRL_ENABLE);
	}
	group = iommu_group_get(dev);
	if (!group)
		return;
	out->group_id = iommu_group_id(group);
	iommu_group_for_each_dev(group, &out->group_devices, legend_count_dev);
	out->isolated_msi = iommu_group_has_isolated_msi(group);
	iommu_group_put(group);
	out->translated = domain && iommu_is_dma_domain(domain);
	out->lazy = domain && domain->type == IOMMU_DOMAIN_DMA_FQ;
	iommu_get_resv_regions(dev, &regions);
	list_for_each_entry(region, &regions, list) {
		if (region->type != IOMMU_RESV_DIRECT && region->type != IOMMU_RESV_DIRECT_RELAXABLE)
			continue;
		if (out->direct_count < LEGEND_MAX_DIRECT) {
			out->direct[out->direct_count][0] = region->start;
			out->direct[out->direct_count][1] = region->length;
		}
		out->direct_count++;
	}
	iommu_put_resv_regions(dev, &regions);
}

/* The MSI-X capability's Message Control, Table and PBA registers; false without MSI-X. */
bool legend_shim_msix(struct device *dev, u16 *control, u32 *table, u32 *pba)
{
	struct pci_dev *pdev = to_pci_dev(dev);
	int cap = pci_find_capability(pdev, PCI_CAP_ID_MSIX);

	if (!cap)
		return false;
	pci_read_config_word(pdev, cap + PCI_MSIX_FLAGS, control);
	pci_read_config_dword(pdev, cap + PCI_MSIX_TABLE, table);
	pci_read_config_dword(pdev, cap + PCI_MSIX_PBA, pba);
	return true;
}

/*
 * The administrator's overrides of the isolation rules. Declared here rather than through the
 * Rust module macro, whose parameters do not appear in sysfs: `legendctl device bind` reads
 * /sys/module/legend_nvme/parameters/ to apply the same rules before it unbinds nvme.
 */
static bool enable_unsafe_noiommu_mode;
module_param(enable_unsafe_noiommu_mode, bool, 0444);
MODULE_PARM_DESC(enable_unsafe_noiommu_mode,
		 "Bind controllers that no translating IOMMU isolates (taints the kernel): whoever opens the device can then DMA to any memory");

static bool enable_unsafe_lazy_iotlb;
module_param(enable_unsafe_lazy_iotlb, bool, 0444);
MODULE_PARM_DESC(enable_unsafe_lazy_iotlb,
		 "Bind controllers whose IOMMU domain invalidates lazily (DMA-FQ; taints the kernel): unmapped and unpinned memory then stays reachable by the queue writer's DMA for up to ~10 ms");

static bool enable_unsafe_interrupts;
module_param(enable_unsafe_interrupts, bool, 0444);
MODULE_PARM_DESC(enable_unsafe_interrupts,
		 "Bind controllers whose interrupt messages are not isolated (no interrupt remapping; taints the kernel): the queue writer's DMA can then send the host any interrupt");

u32 legend_shim_unsafe_params(void)
{
	return (enable_unsafe_noiommu_mode ? LEGEND_UNSAFE_NOIOMMU : 0) |
	       (enable_unsafe_lazy_iotlb ? LEGEND_UNSAFE_LAZY_IOTLB : 0) |
	       (enable_unsafe_interrupts ? LEGEND_UNSAFE_INTERRUPTS : 0);
}

/* An unsafe parameter runs the device without full isolation: the kernel is no longer sound. */
void legend_shim_taint_unsafe(void)
{
	add_taint(TAINT_USER, LOCKDEP_STILL_OK);
}

void legend_shim_set_master(struct device *dev, bool on)
{
	if (on)
		pci_set_master(to_pci_dev(dev));
	else
		pci_clear_master(to_pci_dev(dev));
}

u32 legend_shim_pci_class(struct device *dev)
{
	return to_pci_dev(dev)->class;
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
	"failed",
	"resets",
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
 * Read-only files under /sys/kernel/debug/legend_nvme-<BDF>/ with the admin queue's bus
 * addresses and positions, for root (the selftests aim DMA at them to show that the writer
 * cannot use them). Each read asks legend_nvme_stat() for one value, numbered after the sysfs
 * ones.
 */
static const char *const legend_debug_names[] = {
	"admin_sq_bus",
	"admin_cq_bus",
	"admin_data_bus",
	"admin_sq_tail",
	"admin_cq_head",
	"admin_cq_phase",
	"admin_next_cid",
};

struct legend_debug_file {
	const void *ctx;
	unsigned int which;
};

struct legend_debugfs {
	struct dentry *dir;
	struct legend_debug_file files[ARRAY_SIZE(legend_debug_names)];
};

static int legend_debug_get(void *data, u64 *val)
{
	struct legend_debug_file *f = data;

	*val = legend_nvme_stat(f->ctx, f->which);
	return 0;
}
DEFINE_DEBUGFS_ATTRIBUTE(legend_debug_fops, legend_debug_get, NULL, "0x%llx\n");

/* Debugfs is optional: without it, or on failure, *out is NULL and nothing else changes. */
void legend_shim_debugfs_add(struct device *dev, const void *ctx, struct legend_debugfs **out)
{
	struct legend_debugfs *d = kzalloc(sizeof(*d), GFP_KERNEL);
	char name[64];
	unsigned int i;

	*out = NULL;
	if (!d)
		return;
	snprintf(name, sizeof(name), "legend_nvme-%s", dev_name(dev));
	d->dir = debugfs_create_dir(name, NULL);
	if (IS_ERR(d->dir)) {
		kfree(d);
		return;
	}
	for (i = 0; i < ARRAY_SIZE(legend_debug_names); i++) {
		d->files[i].ctx = ctx;
		d->files[i].which = ARRAY_SIZE(legend_stat_names) + i;
		debugfs_create_file_unsafe(legend_debug_names[i], 0400, d->dir, &d->files[i],
					   &legend_debug_fops);
	}
	*out = d;
}

/* Returns once no read runs any more (debugfs_remove drains them). */
void legend_shim_debugfs_remove(struct legend_debugfs *d)
{
	if (!d)
		return;
	debugfs_remove(d->dir);
	kfree(d);
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

/*
 * A reference to this module, held while another module (NVIDIA's) may call into its code; the
 * caller holds one already (it runs in an ioctl of an open file).
 */
void legend_shim_module_get(void)
{
	__module_get(THIS_MODULE);
}

void legend_shim_module_put(void)
{
	module_put(THIS_MODULE);
}
