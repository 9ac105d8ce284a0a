//! Rows of a table on the namespace, looked up by GPU threads through a software cache in GPU
//! memory whose misses the threads read through the queue pairs themselves (issue 32, the
//! AGILE row): `kernels/row_cache.cu`'s `legend_row_cache_lookup`, which says how it works and
//! why it cannot deadlock on SQ space.
//!
//! A [`RowCache`] owns a [`GpuIo`] (its queue pairs: one thread block each, whose first warp
//! is the queue's only submitter) and the cache: `lines` slots of `line_bytes` in GPU memory,
//! set associative with a clock per set, hit/miss/coalesced counters. It lives across calls:
//! what one lookup read, the next finds. Its table is a [`CachedTable`]: rows in one piece, or
//! cut into partitions each at its own place on the namespace (a run's store: legend-query
//! gives the partitions' committed copies); rows of f32 or of a 16-bit format, returned as
//! they are stored.

use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
use legend_nvme_protocol::MAX_DEPTH;

use super::GpuIo;
use super::abi::IoResult;
use super::run::BlocksRunning;
use crate::error::DriverContext;
use crate::{Gpu, GpuError};

/// `LegendCacheTable` of `kernels/row_cache.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct CacheTable {
    lines: u64,
    line_pages: u64,
    tags: u64,
    state: u64,
    pins: u64,
    refs: u64,
    locks: u64,
    hands: u64,
    stats: u64,
    abort: u64,
    part_at: u64,
    rows_per_part: u64,
    lines_per_part: u64,
    rows: u64,
    namespace_bytes: u64,
    line_page_shift: u32,
    line_bytes: u32,
    sets: u32,
    ways: u32,
    row_bytes: u32,
    lba_shift: u32,
    nsid: u32,
    ahead: u32,
    flops_per_byte: f32,
    overlap: u32,
}

// SAFETY: a plain `repr(C)` struct of integers, laid out as its CUDA twin.
unsafe impl DeviceRepr for CacheTable {}

/// `LEGEND_CACHE_RING`: a block's outstanding misses.
const RING: u32 = 4096;
/// `LEGEND_CACHE_MAX_AHEAD`.
const MAX_AHEAD: u32 = 8;

/// Where the table lies on the namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CachedTable {
    /// The byte of the namespace each partition's first row starts at (multiples of the LBA
    /// size); one for a table in one piece.
    pub partitions: Vec<u64>,
    /// Rows of each partition but the last, which holds the rest (at least one).
    pub rows_per_partition: u64,
    /// Rows.
    pub rows: u64,
    /// Bytes a row (a multiple of 2: f32 or 16-bit values).
    pub row_bytes: u32,
}

impl CachedTable {
    /// `rows` rows of `row_bytes` in one piece from namespace byte `at`.
    pub fn contiguous(at: u64, rows: u64, row_bytes: u32) -> CachedTable {
        CachedTable {
            partitions: vec![at],
            rows_per_partition: rows,
            rows,
            row_bytes,
        }
    }

    /// The namespace byte row `row` (below `rows`) starts at.
    pub fn byte_of(&self, row: u64) -> u64 {
        let p = row / self.rows_per_partition;
        self.partitions[p as usize]
            + (row - p * self.rows_per_partition) * u64::from(self.row_bytes)
    }
}

/// How a [`RowCache`] is laid out and driven.
#[derive(Clone, Debug)]
pub struct RowCacheOptions {
    /// Smallest bytes a line: a line is the fewest whole rows that make a multiple of the LBA
    /// size and at least this many bytes.
    pub line_bytes: u32,
    /// Lines the cache holds (rounded down to whole sets).
    pub lines: u32,
    /// Ways a set.
    pub ways: u32,
    /// Requesting threads a block, beside its I/O warp (a multiple of 32).
    pub requesters: u32,
    /// Requests a thread issues before it waits for them (1: synchronous; at most 8).
    pub ahead: u32,
    /// Computation each looked-up row costs its thread, in FLOP a byte of the row (AGILE's
    /// computation-to-communication ratio; 0 for plain lookups).
    pub flops_per_byte: f32,
    /// Whether that computation runs between the issues and the waits (asynchronous), rather
    /// than after the waits (synchronous).
    pub overlap: bool,
}

impl Default for RowCacheOptions {
    fn default() -> Self {
        RowCacheOptions {
            line_bytes: 4096,
            lines: 1 << 16,
            ways: 8,
            requesters: 256,
            ahead: 4,
            flops_per_byte: 0.0,
            overlap: true,
        }
    }
}

/// The cache's counters since it was opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Requests whose line was in the cache.
    pub hits: u64,
    /// Requests that read their line.
    pub misses: u64,
    /// Requests whose line another request was reading: they waited for that read.
    pub coalesced: u64,
    /// Times a request found its set full of lines in use and tried again.
    pub retries: u64,
}

impl CacheStats {
    /// Hits (coalesced ones included) over all requests.
    pub fn hit_rate(&self) -> f64 {
        let all = self.hits + self.misses + self.coalesced;
        if all == 0 {
            0.0
        } else {
            (self.hits + self.coalesced) as f64 / all as f64
        }
    }
}

/// A software cache of a table's rows in GPU memory, filled by the GPU through NVMe queues.
pub struct RowCache {
    io: GpuIo,
    table: CachedTable,
    opts: RowCacheOptions,
    line_bytes: u32,
    lines_per_partition: u64,
    sets: u32,
    region: usize,
    /// Each partition's namespace byte (`CachedTable::partitions`), for the kernel.
    partitions: CudaSlice<u64>,
    tags: CudaSlice<u64>,
    /// State, pins and reference bits of each slot, then each set's lock and hand, then the
    /// abort flag (u32 words).
    words: CudaSlice<u32>,
    stats: CudaSlice<u64>,
}

impl RowCache {
    /// A cache of `table` over `io`'s queue pairs, empty.
    ///
    /// # Errors
    ///
    /// [`GpuError::Shape`] for a table outside the namespace or not aligned, or options the
    /// kernel cannot run with (named); driver errors.
    pub fn open(
        gpu: &Gpu,
        mut io: GpuIo,
        table: CachedTable,
        opts: &RowCacheOptions,
    ) -> Result<RowCache, GpuError> {
        let shape = |what: String| Err(GpuError::Shape(format!("row cache: {what}")));
        if io.members() != 1 {
            return shape(format!(
                "over a GPU I/O of {} controllers (one drives a cache)",
                io.members()
            ));
        }
        let lba = io.block_size();
        if table.row_bytes == 0 || !table.row_bytes.is_multiple_of(2) {
            return shape(format!(
                "rows of {} bytes (a positive multiple of 2)",
                table.row_bytes
            ));
        }
        let per_part = table.rows_per_partition;
        if table.rows == 0
            || per_part == 0
            || table.partitions.len() as u64 != table.rows.div_ceil(per_part)
        {
            return shape(format!(
                "{} rows in {} partitions of {per_part} rows",
                table.rows,
                table.partitions.len()
            ));
        }
        for (p, &at) in table.partitions.iter().enumerate() {
            let rows = per_part.min(table.rows - p as u64 * per_part);
            let end = rows
                .checked_mul(u64::from(table.row_bytes))
                .and_then(|b| b.checked_add(at));
            if !at.is_multiple_of(lba) || end.is_none_or(|e| e > io.namespace_bytes()) {
                return shape(format!(
                    "partition {p}: {rows} rows of {} bytes from byte {at} do not lie in the \
                     {}-byte namespace at an LBA boundary",
                    table.row_bytes,
                    io.namespace_bytes()
                ));
            }
        }
        let line_bytes = Self::line_bytes_for(table.row_bytes, opts.line_bytes, lba);
        if line_bytes > io.members[0].max_command || line_bytes > u64::from(u32::MAX) {
            return shape(format!(
                "lines of {line_bytes} bytes (whole rows of {} bytes, a multiple of the \
                 {lba}-byte LBA) exceed the largest command ({} bytes)",
                table.row_bytes, io.members[0].max_command
            ));
        }
        let line_bytes = line_bytes as u32;
        let lines_per_partition = per_part.div_ceil(u64::from(line_bytes / table.row_bytes));
        if opts.ways == 0 || opts.lines < opts.ways {
            return shape(format!(
                "{} lines of {} ways: at least one set",
                opts.lines, opts.ways
            ));
        }
        let sets = opts.lines / opts.ways;
        let slots = sets as usize * opts.ways as usize;
        if opts.requesters == 0
            || !opts.requesters.is_multiple_of(32)
            || opts.requesters + 32 > 1024
            || opts.ahead == 0
            || opts.ahead > MAX_AHEAD
            || opts.requesters * opts.ahead > RING
            || !(0.0..=1e6).contains(&opts.flops_per_byte)
        {
            return shape(format!(
                "{} requesters a block issuing {} ahead, {} FLOP a byte: requesters a multiple \
                 of 32 up to 992, ahead 1 to {MAX_AHEAD}, their product at most {RING}, FLOP \
                 0 to 10^6",
                opts.requesters, opts.ahead, opts.flops_per_byte
            ));
        }
        if u32::from(io.depth()) > u32::from(MAX_DEPTH) {
            return shape(format!("queues of {} entries", io.depth()));
        }
        let region = io.alloc(gpu, slots * line_bytes as usize)?;
        let stream = io.stream.clone();
        let partitions = stream
            .clone_htod(&table.partitions)
            .during("uploading the table's partitions")?;
        let tags = stream
            .alloc_zeros::<u64>(slots)
            .during("allocating the cache's tags")?;
        let words = stream
            .alloc_zeros::<u32>(3 * slots + 2 * sets as usize + 1)
            .during("allocating the cache's state")?;
        let stats = stream
            .alloc_zeros::<u64>(4)
            .during("allocating the cache's counters")?;
        Ok(RowCache {
            io,
            table,
            opts: opts.clone(),
            line_bytes,
            lines_per_partition,
            sets,
            region,
            partitions,
            tags,
            words,
            stats,
        })
    }

    /// The bytes of a line of rows of `row_bytes` on LBAs of `lba` bytes when at least
    /// `min_bytes` are asked for ([`RowCacheOptions::line_bytes`]): the fewest rows whose bytes
    /// are a multiple of the LBA size, times enough of them.
    pub fn line_bytes_for(row_bytes: u32, min_bytes: u32, lba: u64) -> u64 {
        let unit = lcm(u64::from(row_bytes), lba);
        u64::from(min_bytes.max(1)).div_ceil(unit) * unit
    }

    /// Bytes of a line.
    pub fn line_bytes(&self) -> u32 {
        self.line_bytes
    }

    /// Bytes of GPU memory the lines take.
    pub fn capacity_bytes(&self) -> u64 {
        u64::from(self.sets) * u64::from(self.opts.ways) * u64::from(self.line_bytes)
    }

    /// The queue pairs' depth.
    pub fn queue_depth(&self) -> u16 {
        self.io.depth()
    }

    /// The table.
    pub fn table(&self) -> &CachedTable {
        &self.table
    }

    /// Rows `ids` (each below the table's row count), in order, `row_bytes` each, as stored;
    /// and the launch's seconds.
    ///
    /// # Errors
    ///
    /// [`GpuError::Shape`] for an id beyond the table; [`GpuError::NvmeCommand`] for a line the
    /// controller failed to read; [`GpuError::NvmeTimeout`] when a queue stopped answering
    /// (the cache is then unusable, as its [`GpuIo`]).
    pub fn lookup(&mut self, ids: &[u64]) -> Result<(Vec<u8>, f64), GpuError> {
        if let Some(bad) = ids.iter().find(|&&id| id >= self.table.rows) {
            return Err(GpuError::Shape(format!(
                "row cache: row {bad} asked for; the table has {} rows",
                self.table.rows
            )));
        }
        if ids.is_empty() {
            return Ok((Vec::new(), 0.0));
        }
        let stream = self.io.stream.clone();
        let ids_dev = stream.clone_htod(ids).during("uploading the row ids")?;
        let mut out = stream
            .alloc_zeros::<u8>(ids.len() * self.table.row_bytes as usize)
            .during("allocating the looked-up rows")?;
        let seconds = self.launch(&ids_dev, ids.len() as u64, &mut out)?;
        let rows = stream.clone_dtoh(&out).during("downloading the rows")?;
        Ok((rows, seconds))
    }

    /// The counters so far.
    ///
    /// # Errors
    ///
    /// Driver errors.
    pub fn stats(&self) -> Result<CacheStats, GpuError> {
        let s = self
            .io
            .stream
            .clone_dtoh(&self.stats)
            .during("reading the cache's counters")?;
        Ok(CacheStats {
            hits: s[0],
            misses: s[1],
            coalesced: s[2],
            retries: s[3],
        })
    }

    /// One launch of the lookup kernel over `n` ids on the device into `out`.
    fn launch(
        &mut self,
        ids: &CudaSlice<u64>,
        n: u64,
        out: &mut CudaSlice<u8>,
    ) -> Result<f64, GpuError> {
        if let Some((label, state)) = &self.io.broken {
            return Err(GpuError::NvmeTimeout {
                label: label.clone(),
                state: state.clone(),
            });
        }
        // One member (checked by `open`).
        let member = &self.io.members[0];
        let slots = (self.sets * self.opts.ways) as u64;
        let region = &self.io.regions[self.region];
        let words = self.io.addr(&self.words);
        let table = CacheTable {
            lines: region.start,
            line_pages: self.io.addr(&region.maps[0].pages),
            tags: self.io.addr(&self.tags),
            state: words,
            pins: words + 4 * slots,
            refs: words + 8 * slots,
            locks: words + 12 * slots,
            hands: words + 12 * slots + 4 * u64::from(self.sets),
            abort: words + 12 * slots + 8 * u64::from(self.sets),
            stats: self.io.addr(&self.stats),
            part_at: self.io.addr(&self.partitions),
            rows_per_part: self.table.rows_per_partition,
            lines_per_part: self.lines_per_partition,
            rows: self.table.rows,
            namespace_bytes: self.io.namespace_bytes(),
            line_page_shift: region.maps[0].mapping.page_size.trailing_zeros(),
            line_bytes: self.line_bytes,
            sets: self.sets,
            ways: self.opts.ways,
            row_bytes: self.table.row_bytes,
            lba_shift: member.lba_shift,
            nsid: member.opts.namespace,
            ahead: self.opts.ahead,
            flops_per_byte: self.opts.flops_per_byte,
            overlap: u32::from(self.opts.overlap),
        };
        let timeout = member.opts.timeout.as_nanos() as u64;
        let blocks = member.qids.len();
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (self.opts.requesters + 32, 1, 1),
            shared_mem_bytes: 0,
        };
        let stream = self.io.stream.clone();
        let start = std::time::Instant::now();
        let running = BlocksRunning::new(&self.io.io_blocks, blocks);
        let mut b = stream.launch_builder(&self.io.cache_kernel);
        b.arg(&mut self.io.queues)
            .arg(&mut self.io.results)
            .arg(&table)
            .arg(ids)
            .arg(&n)
            .arg(out)
            .arg(&timeout);
        // SAFETY: the queues, reports, cache arrays (sized above for `slots` and `sets`), the
        // partitions' bytes (one each, checked against the row count), ids (`n`, each checked
        // below the row count) and `out` (`n` rows) are live device memory;
        // the controller's rings, doorbells and the line region stay mapped while `io` lives.
        unsafe { b.launch(cfg) }.during("launching legend_row_cache_lookup")?;
        stream
            .synchronize()
            .during("waiting for the row cache kernel")?;
        drop(running);
        let seconds = start.elapsed().as_secs_f64();
        let reports: Vec<IoResult> = stream
            .clone_dtoh(&self.io.results)
            .during("reading the row cache's reports")?;
        self.io.check(&reports)?;
        Ok(seconds)
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

fn lcm(a: u64, b: u64) -> u64 {
    a / gcd(a, b) * b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_whole_rows_and_whole_lbas() {
        assert_eq!(RowCache::line_bytes_for(400, 4096, 512), 12_800);
        assert_eq!(RowCache::line_bytes_for(512, 4096, 512), 4096);
        assert_eq!(RowCache::line_bytes_for(400, 1, 4096), 102_400);
        // 16-bit rows of an odd width (d = 101, bf16).
        assert_eq!(RowCache::line_bytes_for(202, 4096, 512), 51_712);
    }

    #[test]
    fn a_line_is_whole_rows_and_whole_lbas() {
        // 400-byte rows (d = 100 floats) on 512-byte LBAs: 32 rows, 12 800 bytes.
        assert_eq!(lcm(400, 512), 12_800);
        assert_eq!(lcm(512, 512), 512);
        assert_eq!(lcm(4096, 512), 4096);
        let unit = lcm(400, 4096);
        assert_eq!(unit % 400, 0);
        assert_eq!(unit % 4096, 0);
    }

    #[test]
    fn the_hit_rate_counts_coalesced_requests_as_hits() {
        let s = CacheStats {
            hits: 6,
            misses: 2,
            coalesced: 2,
            retries: 5,
        };
        assert!((s.hit_rate() - 0.8).abs() < 1e-12);
        assert_eq!(CacheStats::default().hit_rate(), 0.0);
    }
}
