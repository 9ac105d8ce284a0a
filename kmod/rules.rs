// SPDX-License-Identifier: GPL-2.0-only OR MIT

//! The arithmetic and decisions behind the module's isolation rules, on plain integers: which of
//! the platform's gaps refuse a bind ([`gaps`]), where the doorbell mapping must end so that it
//! never covers the MSI-X table or PBA ([`doorbell_window`]), and whether two rings share memory
//! ([`overlap`]).
//!
//! This file uses `core` only and no kernel type: the module compiles it, and so do the host
//! unit tests of `legend-nvme` (through `#[path]`), which check it on layouts and platforms that
//! no emulated controller produces.

/// Bytes `[start, end)` of an address space (a BAR, physical memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Span {
    pub(crate) start: u64,
    pub(crate) end: u64,
}

impl Span {
    /// `len` bytes from `start`, cut at the end of the address space.
    pub(crate) fn at(start: u64, len: u64) -> Self {
        Self {
            start,
            end: start.saturating_add(len),
        }
    }

    /// Whether the two spans share a byte.
    pub(crate) fn overlaps(self, other: Self) -> bool {
        self.start < other.end && other.start < self.end
    }

    /// The whole pages of `page` bytes that hold a byte of this span.
    fn pages(self, page: u64) -> Self {
        Self {
            start: self.start / page * page,
            end: self.end.div_ceil(page).saturating_mul(page),
        }
    }
}

/// What the platform provides a controller's DMA, as probe finds it.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Platform {
    /// DMA goes through a translating IOMMU domain (`DMA` or `DMA-FQ`; not none, not identity).
    pub(crate) translated: bool,
    /// Devices in the controller's IOMMU group, the controller included.
    pub(crate) group_devices: u32,
    /// The domain invalidates the IOTLB lazily (`DMA-FQ`).
    pub(crate) lazy: bool,
    /// The group's interrupt messages are isolated (interrupt remapping, or an Arm ITS): a DMA
    /// write to the MSI window can raise only the interrupts the device was given.
    pub(crate) isolated_msi: bool,
    /// ATS is enabled on the controller: it may send requests it translated itself, which the
    /// IOMMU does not translate again.
    pub(crate) ats: bool,
    /// Regions the firmware maps 1:1 in the controller's domain (RMRR, IVMD).
    pub(crate) direct_regions: u32,
}

/// The administrator's overrides (the module's `enable_unsafe_*` parameters).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Overrides {
    /// `enable_unsafe_noiommu_mode`: no translating IOMMU, or a shared group.
    pub(crate) noiommu: bool,
    /// `enable_unsafe_lazy_iotlb`: a `DMA-FQ` domain.
    pub(crate) lazy_iotlb: bool,
    /// `enable_unsafe_interrupts`: interrupt messages not isolated.
    pub(crate) interrupts: bool,
}

/// Something that would let a queue writer's DMA reach beyond its own mappings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Gap {
    /// No translating IOMMU domain: the writer reaches all memory.
    NoTranslation,
    /// The IOMMU group holds other devices, whose mappings the writer reaches (and they its).
    SharedGroup,
    /// Unmapped memory stays reachable until the lazy flush.
    LazyIotlb,
    /// A write to the MSI window sends the host any interrupt.
    SharedInterrupts,
    /// ATS: translated requests bypass the IOMMU.
    Ats,
    /// Memory the firmware maps 1:1 for the device is reachable.
    DirectRegions,
}

impl Gap {
    /// What is missing, and what it lets a queue writer do (a clause for messages).
    pub(crate) fn what(self) -> &'static str {
        match self {
            Self::NoTranslation => {
                "it is not behind a translating IOMMU (none, or an identity/passthrough domain): \
                 whoever opens the device could DMA to any memory"
            }
            Self::SharedGroup => {
                "its IOMMU group holds other devices: whoever opens the device could DMA to any \
                 memory theirs can reach"
            }
            Self::LazyIotlb => {
                "its IOMMU domain invalidates lazily (DMA-FQ): memory it unmapped stays reachable \
                 for milliseconds after it is unpinned"
            }
            Self::SharedInterrupts => {
                "its interrupt messages are not isolated (no interrupt remapping): a queue \
                 writer's DMA into the MSI window could send the host any interrupt"
            }
            Self::Ats => "ATS is enabled on it: the requests it translates itself bypass the IOMMU",
            Self::DirectRegions => {
                "the firmware maps memory 1:1 in its IOMMU domain (RMRR/IVMD): a queue writer's \
                 DMA would reach it"
            }
        }
    }

    /// How the administrator provides what is missing.
    pub(crate) fn fix(self) -> &'static str {
        match self {
            Self::NoTranslation => "boot with intel_iommu=on or amd_iommu=on and without iommu=pt",
            Self::SharedGroup => "move it to a slot with an IOMMU group of its own (ACS)",
            Self::LazyIotlb => {
                "make the group strict while no driver is bound: echo DMA > \
                 /sys/kernel/iommu_groups/N/type (legendctl device bind does), or boot with \
                 iommu.strict=1"
            }
            Self::SharedInterrupts => {
                "enable interrupt remapping: boot with intremap=on (and without intremap=off or \
                 nointremap), with VT-d / AMD-Vi interrupt remapping on in the firmware"
            }
            Self::Ats => "boot with pci=noats",
            Self::DirectRegions => "use a slot for which the firmware reserves no memory",
        }
    }

    /// The module parameter that accepts the gap (tainting the kernel), if one does.
    pub(crate) fn parameter(self) -> Option<&'static str> {
        match self {
            Self::NoTranslation | Self::SharedGroup => Some("enable_unsafe_noiommu_mode"),
            Self::LazyIotlb => Some("enable_unsafe_lazy_iotlb"),
            Self::SharedInterrupts => Some("enable_unsafe_interrupts"),
            Self::Ats | Self::DirectRegions => None,
        }
    }

    /// How the module runs once the gap is accepted (a clause for its `UNSAFE` log line).
    pub(crate) fn accepted(self) -> &'static str {
        match self {
            Self::NoTranslation | Self::SharedGroup => {
                "without DMA isolation: access to /dev/legend-nvme* now equals root"
            }
            Self::LazyIotlb => {
                "with lazy IOTLB invalidation: the queue writer can reach memory for milliseconds \
                 after it was unpinned"
            }
            Self::SharedInterrupts => {
                "with interrupt messages not isolated: the queue writer can send the host any \
                 interrupt"
            }
            Self::Ats | Self::DirectRegions => "",
        }
    }
}

/// The gaps of a platform, each with whether an override accepts it.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Gaps {
    found: [Option<(Gap, bool)>; 5],
}

impl Gaps {
    fn push(&mut self, gap: Gap, accepted: bool) {
        if let Some(slot) = self.found.iter_mut().find(|s| s.is_none()) {
            *slot = Some((gap, accepted));
        }
    }

    /// Each gap, and whether it is accepted.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (Gap, bool)> + '_ {
        self.found.iter().flatten().copied()
    }

    /// Whether a gap is left that no override accepts: the bind is refused.
    pub(crate) fn refused(&self) -> bool {
        self.iter().any(|(_, accepted)| !accepted)
    }
}

/// What keeps a writer's DMA from reaching beyond its mappings, and is missing on `p`.
///
/// Without translation or with a shared group the writer reaches memory that is not its own
/// anyway, so that gap alone is reported (and `noiommu` alone accepts it). Otherwise every
/// missing requirement is reported, so that one refusal names all the fixes. ATS and
/// direct-mapped regions have no override.
pub(crate) fn gaps(p: &Platform, o: &Overrides) -> Gaps {
    let mut g = Gaps::default();
    if !p.translated {
        g.push(Gap::NoTranslation, o.noiommu);
        return g;
    }
    if p.group_devices != 1 {
        g.push(Gap::SharedGroup, o.noiommu);
        if o.noiommu {
            return g;
        }
    }
    if p.lazy {
        g.push(Gap::LazyIotlb, o.lazy_iotlb);
    }
    if !p.isolated_msi {
        g.push(Gap::SharedInterrupts, o.interrupts);
    }
    if p.ats {
        g.push(Gap::Ats, false);
    }
    if p.direct_regions > 0 {
        g.push(Gap::DirectRegions, false);
    }
    g
}

/// Where a function's MSI-X capability puts its table and Pending Bit Array (PCI Express Base
/// Specification, section 7.7.2): each in a BAR, at an offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Msix {
    table: (u8, Span),
    pba: (u8, Span),
}

impl Msix {
    /// From the capability's Message Control word and its Table and PBA dwords (BAR indicator in
    /// bits 2:0, offset above).
    pub(crate) fn from_config(control: u16, table: u32, pba: u32) -> Self {
        let entries = u64::from(control & 0x7ff) + 1;
        // CAST: the BAR indicator is 3 bits.
        let bar = |dword: u32| (dword & 7) as u8;
        let offset = |dword: u32| u64::from(dword & !7);
        Self {
            table: (bar(table), Span::at(offset(table), entries * 16)),
            pba: (bar(pba), Span::at(offset(pba), entries.div_ceil(64) * 8)),
        }
    }

    /// The structures that lie in BAR `bar`, as spans of it.
    pub(crate) fn in_bar(&self, bar: u8) -> impl Iterator<Item = Span> {
        [self.table, self.pba]
            .into_iter()
            .filter(move |&(b, _)| b == bar)
            .map(|(_, span)| span)
    }
}

/// Offset in BAR0 of the first doorbell (the admin SQ tail).
pub(crate) const DOORBELL_OFFSET: u64 = 0x1000;

/// The doorbell mapping: BAR0 bytes `[base, base + len)`, holding the doorbells of I/O queue
/// pairs `1..=queue_pairs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DoorbellWindow {
    pub(crate) base: u64,
    pub(crate) len: u64,
    pub(crate) queue_pairs: u32,
}

/// Why no I/O queue pair's doorbells can be mapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NoWindow {
    /// BAR0 ends before the doorbells of queue pair 1.
    BarTooSmall,
    /// The page of queue pair 1's doorbells holds this MSI-X structure (bytes of BAR0).
    Msix(Span),
}

/// The doorbell mapping of a controller whose BAR0 is `bar_len` bytes, with doorbells `stride`
/// bytes apart, that granted `granted` I/O queue pairs, in pages of `page` bytes.
///
/// It starts at the page of queue pair 1's SQ tail doorbell (where the stride puts the I/O
/// doorbells on pages of their own, the admin queue's are then out of reach) and holds as many
/// pairs as fit in BAR0 before the first page that holds a byte of an `msix` structure (spans of
/// BAR0): a writer that could store to the MSI-X table could rewrite the messages the controller
/// sends.
pub(crate) fn doorbell_window(
    bar_len: u64,
    stride: u64,
    granted: u32,
    page: u64,
    msix: impl IntoIterator<Item = Span>,
) -> Result<DoorbellWindow, NoWindow> {
    let base = (DOORBELL_OFFSET + 2 * stride) / page * page;
    let mut limit = bar_len / page * page;
    for span in msix {
        let pages = span.pages(page);
        if pages.overlaps(Span::at(base, page)) {
            return Err(NoWindow::Msix(span));
        }
        if pages.start >= base {
            limit = limit.min(pages.start);
        }
    }
    // The doorbells of queues 0..=p end at DOORBELL_OFFSET + (2p + 2) * stride.
    let fit = limit.saturating_sub(DOORBELL_OFFSET) / (2 * stride);
    let pairs = fit.saturating_sub(1).min(u64::from(granted));
    if pairs == 0 {
        return Err(NoWindow::BarTooSmall);
    }
    let end = (DOORBELL_OFFSET + (2 * pairs + 2) * stride).div_ceil(page) * page;
    Ok(DoorbellWindow {
        base,
        len: end - base,
        // CAST: at most `granted`.
        queue_pairs: pairs as u32,
    })
}

/// The physical spans of `bytes` bytes at `offset` of a mapping whose page `i` (of `page` bytes)
/// starts at physical address `frame(i)`: one span per page touched.
pub(crate) fn ring_spans(
    offset: u64,
    bytes: u64,
    page: u64,
    frame: impl Fn(usize) -> u64,
) -> impl Iterator<Item = Span> {
    let end = offset + bytes;
    let pages = if bytes == 0 {
        0..0
    } else {
        offset / page..(end - 1) / page + 1
    };
    pages.map(move |i| {
        let from = (i * page).max(offset);
        let to = ((i + 1) * page).min(end);
        // CAST: a page index of a mapping, which the caller holds in memory.
        Span::at(frame(i as usize) + from % page, to - from)
    })
}

/// Sorts `spans` by start and merges those that touch or overlap; returns how many are left, at
/// the front.
///
/// An insertion sort: a ring's spans number at most a few thousand, mostly in order already, and
/// `core`'s sorts do not pass the kernel's object checks (objtool).
pub(crate) fn normalize(spans: &mut [Span]) -> usize {
    for i in 1..spans.len() {
        let mut j = i;
        while j > 0 && spans[j - 1].start > spans[j].start {
            spans.swap(j - 1, j);
            j -= 1;
        }
    }
    let mut n = 0;
    for i in 0..spans.len() {
        let s = spans[i];
        if n > 0 && s.start <= spans[n - 1].end {
            spans[n - 1].end = spans[n - 1].end.max(s.end);
        } else {
            spans[n] = s;
            n += 1;
        }
    }
    n
}

/// Whether `a` and `b`, each sorted and merged ([`normalize`]), share a byte.
pub(crate) fn overlap(a: &[Span], b: &[Span]) -> bool {
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        if a[i].overlaps(b[j]) {
            return true;
        }
        if a[i].end <= b[j].start {
            i += 1;
        } else {
            j += 1;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: u64 = 4096;

    fn good() -> Platform {
        Platform {
            translated: true,
            group_devices: 1,
            isolated_msi: true,
            ..Platform::default()
        }
    }

    fn list(p: &Platform, o: &Overrides) -> ([(Gap, bool); 5], usize, bool) {
        let g = gaps(p, o);
        let mut out = [(Gap::Ats, false); 5];
        let mut n = 0;
        for (i, x) in g.iter().enumerate() {
            out[i] = x;
            n += 1;
        }
        (out, n, g.refused())
    }

    #[test]
    fn an_isolated_platform_has_no_gap() {
        let (_, n, refused) = list(&good(), &Overrides::default());
        assert_eq!((n, refused), (0, false));
    }

    #[test]
    fn without_translation_only_that_is_reported_and_noiommu_alone_accepts_it() {
        let p = Platform {
            translated: false,
            isolated_msi: false,
            ats: true,
            ..good()
        };
        let (g, n, refused) = list(&p, &Overrides::default());
        assert_eq!((g[0], n, refused), ((Gap::NoTranslation, false), 1, true));
        let o = Overrides {
            noiommu: true,
            ..Overrides::default()
        };
        let (g, n, refused) = list(&p, &o);
        assert_eq!((g[0], n, refused), ((Gap::NoTranslation, true), 1, false));
    }

    #[test]
    fn a_shared_group_accepted_as_noiommu_hides_the_rest_refused_lists_all() {
        let p = Platform {
            group_devices: 2,
            lazy: true,
            isolated_msi: false,
            ..good()
        };
        let (g, n, refused) = list(&p, &Overrides::default());
        assert!(refused);
        assert_eq!(
            &g[..n],
            &[
                (Gap::SharedGroup, false),
                (Gap::LazyIotlb, false),
                (Gap::SharedInterrupts, false)
            ]
        );
        let o = Overrides {
            noiommu: true,
            ..Overrides::default()
        };
        let (g, n, refused) = list(&p, &o);
        assert_eq!((&g[..n], refused), (&[(Gap::SharedGroup, true)][..], false));
    }

    #[test]
    fn each_override_accepts_its_own_gap_only() {
        let p = Platform {
            lazy: true,
            isolated_msi: false,
            ..good()
        };
        let lazy_only = Overrides {
            lazy_iotlb: true,
            ..Overrides::default()
        };
        let (g, n, refused) = list(&p, &lazy_only);
        assert_eq!(
            (&g[..n], refused),
            (
                &[(Gap::LazyIotlb, true), (Gap::SharedInterrupts, false)][..],
                true
            )
        );
        let both = Overrides {
            interrupts: true,
            ..lazy_only
        };
        assert!(!list(&p, &both).2);
        // The interrupt override does not stand for a lazy domain.
        let interrupts_only = Overrides {
            interrupts: true,
            ..Overrides::default()
        };
        assert!(list(&p, &interrupts_only).2);
    }

    #[test]
    fn each_gap_names_its_fix_and_the_parameters_follow_the_overrides() {
        let all = [
            Gap::NoTranslation,
            Gap::SharedGroup,
            Gap::LazyIotlb,
            Gap::SharedInterrupts,
            Gap::Ats,
            Gap::DirectRegions,
        ];
        for gap in all {
            assert!(!gap.what().is_empty() && !gap.fix().is_empty(), "{gap:?}");
            // Exactly the overridable gaps have a parameter and an `UNSAFE` clause.
            assert_eq!(
                gap.parameter().is_some(),
                !gap.accepted().is_empty(),
                "{gap:?}"
            );
        }
        assert!(Gap::SharedInterrupts.fix().contains("intremap=on"));
        assert!(Gap::NoTranslation.fix().contains("iommu=pt"));
        assert_eq!(Gap::Ats.parameter(), None);
    }

    #[test]
    fn ats_and_direct_regions_have_no_override() {
        let all = Overrides {
            noiommu: true,
            lazy_iotlb: true,
            interrupts: true,
        };
        for p in [
            Platform {
                ats: true,
                ..good()
            },
            Platform {
                direct_regions: 1,
                ..good()
            },
        ] {
            let (g, n, refused) = list(&p, &all);
            assert!(refused && n == 1 && !g[0].1, "{p:?}");
        }
    }

    #[test]
    fn msix_registers_decode_to_bar_spans() {
        // 65 vectors: 1040-byte table at 0x2000 of BAR0, two PBA qwords at 0x3000 of BAR4.
        let m = Msix::from_config(64 | 0xc000, 0x2000, 0x3004);
        assert_eq!(m.in_bar(0).collect::<Vec<_>>(), [Span::at(0x2000, 1040)]);
        assert_eq!(m.in_bar(4).collect::<Vec<_>>(), [Span::at(0x3000, 16)]);
        assert_eq!(m.in_bar(2).count(), 0);
    }

    /// QEMU's controller: 4-byte stride, 64 pairs, the table and PBA in BAR0 after the doorbells.
    #[test]
    fn msix_after_the_doorbell_page_leaves_the_window_whole() {
        let m = Msix::from_config(64, 0x2000, 0x3000);
        let w = doorbell_window(0x4000, 4, 64, PAGE, m.in_bar(0)).unwrap();
        assert_eq!(
            w,
            DoorbellWindow {
                base: 0x1000,
                len: 0x1000,
                queue_pairs: 64
            }
        );
    }

    #[test]
    fn msix_in_the_first_doorbell_page_refuses_the_window() {
        for table in [0x1000, 0x1800, 0x1ff8] {
            let m = Msix::from_config(0, table, 0x8000);
            assert_eq!(
                doorbell_window(0x10000, 4, 64, PAGE, m.in_bar(0)),
                Err(NoWindow::Msix(Span::at(u64::from(table), 16))),
                "table at {table:#x}"
            );
        }
        // A table that starts in register page 0 and runs into the doorbell page.
        let m = Msix::from_config(255, 0xf00, 0x8000);
        assert!(matches!(
            doorbell_window(0x10000, 4, 64, PAGE, m.in_bar(0)),
            Err(NoWindow::Msix(_))
        ));
    }

    #[test]
    fn msix_after_some_doorbells_cuts_the_queue_pairs() {
        // 4-byte stride: 1023 pairs would need doorbells up to 0x3000; the PBA sits at 0x2000.
        let m = Msix::from_config(0, 0x8000, 0x2000);
        let w = doorbell_window(0x10000, 4, 1023, PAGE, m.in_bar(0)).unwrap();
        assert_eq!((w.base, w.len, w.queue_pairs), (0x1000, 0x1000, 511));
        // A table not page aligned forbids its whole page.
        let m = Msix::from_config(1, 0x2ff0, 0x9000);
        let w = doorbell_window(0x10000, 4, 1023, PAGE, m.in_bar(0)).unwrap();
        assert_eq!((w.len, w.queue_pairs), (0x1000, 511));
        // Spanning two pages: both are forbidden.
        let m = Msix::from_config(1, 0x3ff0, 0x9000);
        let w = doorbell_window(0x10000, 4, 2047, PAGE, m.in_bar(0)).unwrap();
        assert_eq!((w.len, w.queue_pairs), (0x2000, 1023));
    }

    #[test]
    fn msix_below_the_window_is_not_in_it() {
        // A 4 KiB stride puts queue 1's SQ doorbell at 0x3000; the table sits between the admin
        // doorbells at 0x2000, below the window.
        let m = Msix::from_config(0, 0x2000, 0x2800);
        let w = doorbell_window(0x100000, 4096, 8, PAGE, m.in_bar(0)).unwrap();
        assert_eq!(
            w,
            DoorbellWindow {
                base: 0x3000,
                len: 0x10000,
                queue_pairs: 8
            }
        );
        // And in the register page.
        let m = Msix::from_config(0, 0x800, 0x900);
        let w = doorbell_window(0x4000, 4, 64, PAGE, m.in_bar(0)).unwrap();
        assert_eq!(w.queue_pairs, 64);
    }

    #[test]
    fn the_bar_bounds_the_window() {
        // 8 KiB BAR0, 4 KiB stride: queue 1's doorbells would be at 0x3000.
        assert_eq!(
            doorbell_window(0x2000, 4096, 8, PAGE, []),
            Err(NoWindow::BarTooSmall)
        );
        // 16 KiB BAR0, 512-byte stride: the doorbells of queues 0..=11 end at 0x4000.
        let w = doorbell_window(0x4000, 512, 64, PAGE, []).unwrap();
        assert_eq!((w.base, w.len, w.queue_pairs), (0x1000, 0x3000, 11));
    }

    #[test]
    fn ring_spans_follow_the_frames_of_each_page() {
        let frames = [0x9000u64, 0x3000, 0x7000];
        assert_eq!(
            ring_spans(0x800, 0x1000, PAGE, |i| frames[i]).collect::<Vec<_>>(),
            [Span::at(0x9800, 0x800), Span::at(0x3000, 0x800)]
        );
        assert_eq!(
            ring_spans(0x1000, 0x1800, PAGE, |i| frames[i]).collect::<Vec<_>>(),
            [Span::at(0x3000, 0x1000), Span::at(0x7000, 0x800)]
        );
        assert_eq!(
            ring_spans(0, 1024, PAGE, |i| frames[i]).collect::<Vec<_>>(),
            [Span::at(0x9000, 1024)]
        );
        assert_eq!(ring_spans(0, 0, PAGE, |i| frames[i]).count(), 0);
    }

    fn normalized(mut v: Vec<Span>) -> Vec<Span> {
        let n = normalize(&mut v);
        v.truncate(n);
        v
    }

    #[test]
    fn normalize_sorts_and_merges_touching_spans() {
        let v = normalized(vec![
            Span::at(0x5000, 0x1000),
            Span::at(0x1000, 0x800),
            Span::at(0x4000, 0x1000),
            Span::at(0x1200, 0x100),
        ]);
        assert_eq!(v, [Span::at(0x1000, 0x800), Span::at(0x4000, 0x2000)]);
    }

    /// The same memory mapped twice has other bus addresses but the same frames: a second ring
    /// on the first's pages overlaps, whatever mapping (handle) it came through.
    #[test]
    fn rings_on_the_same_frames_overlap_through_any_mapping() {
        let first = [0x7000u64, 0x2000];
        let second_mapping = [0x2000u64, 0x7000];
        let sq = normalized(ring_spans(0, 0x2000, PAGE, |i| first[i]).collect());
        let cq = normalized(ring_spans(0, 0x400, PAGE, |i| second_mapping[i]).collect());
        assert!(overlap(&sq, &cq));
        let cq = normalized(ring_spans(0, 0x400, PAGE, |_| 0x8000).collect());
        assert!(!overlap(&sq, &cq));
        // Touching is not overlapping.
        assert!(!overlap(
            &[Span::at(0, 0x1000)],
            &[Span::at(0x1000, 0x1000)]
        ));
        assert!(overlap(&[Span::at(0, 0x1001)], &[Span::at(0x1000, 0x1000)]));
        assert!(!overlap(&[], &sq));
    }

    #[test]
    fn overlap_walks_interleaved_lists() {
        let a = [Span::at(0, 10), Span::at(100, 10), Span::at(300, 10)];
        let b = [Span::at(20, 10), Span::at(200, 10), Span::at(305, 1)];
        assert!(overlap(&a, &b) && overlap(&b, &a));
        let b = [Span::at(20, 10), Span::at(200, 10), Span::at(310, 1)];
        assert!(!overlap(&a, &b) && !overlap(&b, &a));
    }
}
