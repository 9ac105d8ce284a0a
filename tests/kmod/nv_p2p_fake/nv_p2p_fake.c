// SPDX-License-Identifier: GPL-2.0-only
/*
 * nv_p2p_fake: a test double of NVIDIA's P2P API (nv-p2p.h) for the legend_nvme selftests.
 *
 * "GPU memory" is FAKE_CHUNKS chunks of 64 KiB host memory at fake GPU virtual addresses from
 * va_base. The entry points legend_nvme uses are exported GPL, as the open NVIDIA driver does,
 * with the prototypes of NVIDIA's own header. Parameters (/sys/module/nv_p2p_fake/parameters/):
 *   va_base (r)           first fake GPU virtual address;
 *   pinned (r)            live page tables (0 when every user released or lost its pages);
 *   persistent (rw)       0: get_pages_persistent fails with -ENOTSUPP, as on MIG or vGPU;
 *   table_version (rw)    version reported in page tables (to test the version check);
 *   revoke (w)            frees every non-persistent page table as cudaFree would: calls its
 *                         free callback, then unmaps and frees it; put_pages on it then fails;
 *   fail_put (rw)         1: put_pages fails with -EIO and keeps the page table and its free
 *                         callback, as NVIDIA may for reasons of its own (a later revoke still
 *                         calls the callback).
 */
#include <linux/dma-mapping.h>
#include <linux/list.h>
#include <linux/module.h>
#include <linux/mutex.h>
#include <linux/pci.h>
#include <linux/slab.h>
#include <linux/types.h>

#include <nv-p2p.h>

#define FAKE_CHUNK	SZ_64K
#define FAKE_CHUNKS	64
#define FAKE_VA_BASE	0x7f0000000000ULL

static struct page *chunks[FAKE_CHUNKS];

static unsigned long long va_base = FAKE_VA_BASE;
module_param(va_base, ullong, 0444);
static int pinned;
module_param(pinned, int, 0444);
static bool persistent = true;
module_param(persistent, bool, 0644);
static unsigned int table_version = NVIDIA_P2P_PAGE_TABLE_VERSION;
module_param(table_version, uint, 0644);
static bool fail_put;
module_param(fail_put, bool, 0644);

/* One page table handed out, with its DMA mapping if the caller made one. */
struct fake_pin {
	struct list_head link;
	struct nvidia_p2p_page_table table;
	struct nvidia_p2p_dma_mapping *dma;
	bool persistent;
	void (*free_callback)(void *data);
	void *data;
};

static LIST_HEAD(pins);
static DEFINE_MUTEX(pins_lock);

static struct fake_pin *find_pin(struct nvidia_p2p_page_table *table)
{
	struct fake_pin *p;

	list_for_each_entry(p, &pins, link)
		if (&p->table == table)
			return p;
	return NULL;
}

static void free_table(struct nvidia_p2p_page_table *t)
{
	u32 i;

	for (i = 0; i < t->entries; i++)
		kfree(t->pages[i]);
	kfree(t->pages);
}

static void unmap(struct nvidia_p2p_dma_mapping *m)
{
	u32 i;

	for (i = 0; i < m->entries; i++)
		dma_unmap_page(&m->pci_dev->dev, m->dma_addresses[i], FAKE_CHUNK, DMA_BIDIRECTIONAL);
	kfree(m->dma_addresses);
	kfree(m);
}

static int pin(u64 va, u64 len, struct nvidia_p2p_page_table **out, bool persist,
	       void (*cb)(void *), void *data)
{
	u64 first = (va - va_base) / FAKE_CHUNK, n = len / FAKE_CHUNK, i;
	struct fake_pin *p;

	if (va < va_base || va % FAKE_CHUNK || !len || len % FAKE_CHUNK || first + n > FAKE_CHUNKS)
		return -EINVAL;
	p = kzalloc(sizeof(*p), GFP_KERNEL);
	if (!p)
		return -ENOMEM;
	p->table.pages = kcalloc(n, sizeof(*p->table.pages), GFP_KERNEL);
	if (!p->table.pages)
		goto nomem;
	for (i = 0; i < n; i++) {
		p->table.pages[i] = kzalloc(sizeof(*p->table.pages[i]), GFP_KERNEL);
		if (!p->table.pages[i])
			goto nomem;
		p->table.pages[i]->physical_address = page_to_phys(chunks[first + i]);
		p->table.entries++;
	}
	p->table.version = table_version;
	p->table.page_size = NVIDIA_P2P_PAGE_SIZE_64KB;
	p->persistent = persist;
	p->free_callback = cb;
	p->data = data;
	mutex_lock(&pins_lock);
	list_add(&p->link, &pins);
	pinned++;
	mutex_unlock(&pins_lock);
	*out = &p->table;
	return 0;
nomem:
	free_table(&p->table);
	kfree(p);
	return -ENOMEM;
}

int nvidia_p2p_get_pages(uint64_t p2p_token, uint32_t va_space, uint64_t virtual_address,
			 uint64_t length, struct nvidia_p2p_page_table **page_table,
			 void (*free_callback)(void *data), void *data)
{
	if (!free_callback || !data)
		return -EINVAL;
	return pin(virtual_address, length, page_table, false, free_callback, data);
}
EXPORT_SYMBOL_GPL(nvidia_p2p_get_pages);

int nvidia_p2p_get_pages_persistent(uint64_t virtual_address, uint64_t length,
				    struct nvidia_p2p_page_table **page_table, uint32_t flags)
{
	if (!persistent)
		return -ENOTSUPP;
	if (flags)
		return -EINVAL;
	return pin(virtual_address, length, page_table, true, NULL, NULL);
}
EXPORT_SYMBOL_GPL(nvidia_p2p_get_pages_persistent);

int nvidia_p2p_dma_map_pages(struct pci_dev *peer, struct nvidia_p2p_page_table *page_table,
			     struct nvidia_p2p_dma_mapping **dma_mapping)
{
	struct nvidia_p2p_dma_mapping *m;
	struct fake_pin *p;
	int ret = -EINVAL;
	u32 i;

	mutex_lock(&pins_lock);
	p = find_pin(page_table);
	if (!p || p->dma)
		goto out;
	ret = -ENOMEM;
	m = kzalloc(sizeof(*m), GFP_KERNEL);
	if (!m)
		goto out;
	m->dma_addresses = kcalloc(page_table->entries, sizeof(u64), GFP_KERNEL);
	if (!m->dma_addresses) {
		kfree(m);
		goto out;
	}
	m->version = NVIDIA_P2P_DMA_MAPPING_VERSION;
	m->page_size_type = NVIDIA_P2P_PAGE_SIZE_64KB;
	m->pci_dev = peer;
	for (i = 0; i < page_table->entries; i++) {
		dma_addr_t a = dma_map_page(&peer->dev, phys_to_page(page_table->pages[i]->physical_address),
					    0, FAKE_CHUNK, DMA_BIDIRECTIONAL);

		if (dma_mapping_error(&peer->dev, a)) {
			unmap(m);
			goto out;
		}
		m->dma_addresses[m->entries++] = a;
	}
	p->dma = m;
	*dma_mapping = m;
	ret = 0;
out:
	mutex_unlock(&pins_lock);
	return ret;
}
EXPORT_SYMBOL_GPL(nvidia_p2p_dma_map_pages);

int nvidia_p2p_dma_unmap_pages(struct pci_dev *peer, struct nvidia_p2p_page_table *page_table,
			       struct nvidia_p2p_dma_mapping *dma_mapping)
{
	struct fake_pin *p;
	int ret = -EINVAL;

	mutex_lock(&pins_lock);
	p = find_pin(page_table);
	if (p && p->dma == dma_mapping && dma_mapping->pci_dev == peer) {
		unmap(dma_mapping);
		p->dma = NULL;
		ret = 0;
	}
	mutex_unlock(&pins_lock);
	return ret;
}
EXPORT_SYMBOL_GPL(nvidia_p2p_dma_unmap_pages);

static int put(struct nvidia_p2p_page_table *page_table, bool persist)
{
	struct fake_pin *p;

	if (READ_ONCE(fail_put))
		return -EIO;
	mutex_lock(&pins_lock);
	p = find_pin(page_table);
	if (!p || p->persistent != persist) {
		mutex_unlock(&pins_lock);
		return -EINVAL;
	}
	list_del(&p->link);
	pinned--;
	mutex_unlock(&pins_lock);
	/* As NVIDIA does, a mapping still present is torn down with the pages. */
	if (p->dma)
		unmap(p->dma);
	free_table(&p->table);
	kfree(p);
	return 0;
}

int nvidia_p2p_put_pages(uint64_t p2p_token, uint32_t va_space, uint64_t virtual_address,
			 struct nvidia_p2p_page_table *page_table)
{
	return put(page_table, false);
}
EXPORT_SYMBOL_GPL(nvidia_p2p_put_pages);

int nvidia_p2p_put_pages_persistent(uint64_t virtual_address,
				    struct nvidia_p2p_page_table *page_table, uint32_t flags)
{
	return put(page_table, true);
}
EXPORT_SYMBOL_GPL(nvidia_p2p_put_pages_persistent);

/* Frees every non-persistent pin: callback first (without the lock, as NVIDIA), then teardown. */
static int revoke_set(const char *val, const struct kernel_param *kp)
{
	struct fake_pin *p;

	for (;;) {
		mutex_lock(&pins_lock);
		p = NULL;
		list_for_each_entry(p, &pins, link)
			if (!p->persistent)
				break;
		if (list_entry_is_head(p, &pins, link)) {
			mutex_unlock(&pins_lock);
			return 0;
		}
		list_del(&p->link);
		pinned--;
		mutex_unlock(&pins_lock);
		p->free_callback(p->data);
		/* The user stopped all use before the callback returned. */
		if (p->dma)
			unmap(p->dma);
		free_table(&p->table);
		kfree(p);
	}
}

static const struct kernel_param_ops revoke_ops = {
	.set = revoke_set,
};
module_param_cb(revoke, &revoke_ops, NULL, 0200);

static int __init fake_init(void)
{
	int i;

	for (i = 0; i < FAKE_CHUNKS; i++) {
		chunks[i] = alloc_pages(GFP_KERNEL | __GFP_ZERO, get_order(FAKE_CHUNK));
		if (!chunks[i]) {
			while (i--)
				__free_pages(chunks[i], get_order(FAKE_CHUNK));
			return -ENOMEM;
		}
	}
	return 0;
}

static void __exit fake_exit(void)
{
	int i;

	/* Users hold references to the exported symbols, so no pin is left here. */
	for (i = 0; i < FAKE_CHUNKS; i++)
		__free_pages(chunks[i], get_order(FAKE_CHUNK));
}

module_init(fake_init);
module_exit(fake_exit);
MODULE_DESCRIPTION("Test double of NVIDIA's P2P API for the legend_nvme selftests");
MODULE_LICENSE("GPL");
