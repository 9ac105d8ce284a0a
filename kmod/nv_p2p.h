/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * Input of bindgen (see Kbuild): NVIDIA's nv-p2p.h, found at build time, plus the pointer types
 * of the entry points the module resolves at run time with __symbol_get(), so Rust gets their
 * exact signatures without linking to them. The header uses fixed-width types without including
 * their definitions; Kbuild supplies those on the command line.
 */
#include <nv-p2p.h>

typedef __typeof__(nvidia_p2p_get_pages) *legend_get_pages_fn;
typedef __typeof__(nvidia_p2p_get_pages_persistent) *legend_get_pages_persistent_fn;
typedef __typeof__(nvidia_p2p_put_pages) *legend_put_pages_fn;
typedef __typeof__(nvidia_p2p_put_pages_persistent) *legend_put_pages_persistent_fn;
typedef __typeof__(nvidia_p2p_dma_map_pages) *legend_dma_map_pages_fn;
typedef __typeof__(nvidia_p2p_dma_unmap_pages) *legend_dma_unmap_pages_fn;
