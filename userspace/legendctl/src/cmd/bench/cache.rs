//! `legendctl bench cache`: rows of a table looked up in batches, the ids drawn from a power law
//! (Zipf with exponent 1: id rank k has weight 1/k, the ranks scattered over the table), three
//! ways: `gpu`, GPU threads through the row cache in GPU memory whose misses they read through
//! the proxy's queues (legend-cuda's `RowCache`); `resident`, the same with a cache that holds
//! the whole table, filled before the timing; `pread`, CPU threads reading each row with
//! `pread`. The table is a file of rows from byte 0 (`--path`), or a trained run's entity rows
//! in its store (`--run`: its partitions and dtype, through the store's own proxy, as a served
//! run reads them). Reports lookups/s, each batch's time (p50, p99) and the hit rate.

use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Parser, ValueEnum};
use legend_cuda::nvme_io::{
    CachedTable, GpuIo, GpuIoOptions, RingPlacement, RowCache, RowCacheOptions,
};
use legend_engine::run;
use legend_engine::store::controllers::{DeviceModel, SharedController};
use legend_nvme_proxy::{Proxy, ProxyOptions};
use serde::Serialize;

/// How rows are looked up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheMode {
    /// GPU threads through the row cache, misses read through the proxy's queues.
    Gpu,
    /// The row cache holding the whole table (filled first): every lookup a hit.
    Resident,
    /// CPU threads, one `pread` a row.
    Pread,
}

/// `bench cache` options.
#[derive(Parser, Clone)]
pub struct CacheArgs {
    /// The table's file: rows from byte 0.
    #[arg(long, required_unless_present = "run", conflicts_with = "run")]
    pub path: Option<PathBuf>,
    /// A trained run whose store holds the table (storage.backend file or proxy): its entity
    /// rows as stored; `--row-bytes` and `--rows` come from it, the modelled SSD from its
    /// `storage.proxy_model` unless `--ssd-model` names one.
    #[arg(long)]
    pub run: Option<PathBuf>,
    /// How rows are looked up.
    #[arg(long, value_enum, default_value = "gpu")]
    pub mode: CacheMode,
    /// Bytes a row (a multiple of 4).
    #[arg(long, default_value_t = 400)]
    pub row_bytes: u32,
    /// Rows (default: as many as the file holds).
    #[arg(long)]
    pub rows: Option<u64>,
    /// The cache's size as a fraction of the table (`gpu`).
    #[arg(long, default_value_t = 0.1)]
    pub cache_fraction: f64,
    /// Smallest bytes a cache line (a line is whole rows and whole LBAs).
    #[arg(long, default_value_t = 4096)]
    pub line_bytes: u32,
    /// Ways a set.
    #[arg(long, default_value_t = 8)]
    pub ways: u32,
    /// Queue pairs, a thread block each (`gpu`, `resident`); CPU threads (`pread`).
    #[arg(long, default_value_t = 8)]
    pub queues: u32,
    /// Requesting threads a block.
    #[arg(long, default_value_t = 256)]
    pub requesters: u32,
    /// Requests a thread issues before it waits for them (1: synchronous).
    #[arg(long, default_value_t = 4)]
    pub ahead: u32,
    /// Computation a looked-up row costs, in FLOP a byte (AGILE's ratio).
    #[arg(long, default_value_t = 0.0)]
    pub flops_per_byte: f32,
    /// Run that computation after the waits (synchronous) instead of between issue and wait.
    #[arg(long)]
    pub no_overlap: bool,
    /// Lookups a batch.
    #[arg(long, default_value_t = 1 << 16)]
    pub batch: usize,
    /// Batches timed (after one untimed).
    #[arg(long, default_value_t = 20)]
    pub batches: usize,
    /// The proxy serves at a modelled SSD's rates and latency (see `bench io`).
    #[arg(long, value_name = "MODEL")]
    pub ssd_model: Option<DeviceModel>,
    /// The proxy's controller threads.
    #[arg(long)]
    pub proxy_threads: Option<u16>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct Report {
    mode: CacheMode,
    path: PathBuf,
    run: Option<PathBuf>,
    rows: u64,
    row_bytes: u32,
    table_bytes: u64,
    cache_bytes: u64,
    line_bytes: u32,
    queues: u32,
    requesters: u32,
    ahead: u32,
    flops_per_byte: f32,
    overlap: bool,
    ssd_model: Option<String>,
    batch: usize,
    batches: usize,
    lookups_per_s: f64,
    batch_ms_p50: f64,
    batch_ms_p99: f64,
    hit_rate: Option<f64>,
    misses: Option<u64>,
    coalesced: Option<u64>,
    retries: Option<u64>,
}

/// Zipf(1) ranks over `rows` (inverse CDF of the continuous 1/x law), scattered by a
/// multiplication with an odd constant coprime to `rows`.
struct PowerLaw {
    rows: u64,
    state: u64,
    scatter: u64,
}

impl PowerLaw {
    fn new(rows: u64, seed: u64) -> PowerLaw {
        let mut scatter = (0x9e37_79b9_7f4a_7c15u64 % rows.max(2)) | 1;
        while gcd(scatter, rows) != 1 {
            scatter += 2;
        }
        PowerLaw {
            rows,
            state: seed | 1,
            scatter,
        }
    }

    fn next(&mut self) -> u64 {
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        let u = (self.state >> 11) as f64 / (1u64 << 53) as f64;
        let rank = ((self.rows as f64).powf(u) as u64).clamp(1, self.rows) - 1;
        ((u128::from(rank) * u128::from(self.scatter)) % u128::from(self.rows)) as u64
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// The table a run looks rows up in: the file, where its rows lie, and a run's store.
struct Source {
    file: PathBuf,
    table: CachedTable,
    /// `--run`'s reader (its store opened once), and the modelled SSD its proxy serves at.
    store: Option<run::RunReader>,
    ssd_model: Option<DeviceModel>,
}

/// `--path` (rows of `--row-bytes` from byte 0) or `--run` (its store's committed rows).
fn source(args: &CacheArgs) -> anyhow::Result<Source> {
    if let Some(path) = &args.run {
        let dir = run::open(path)?;
        let meta = run::read_meta(&dir)?;
        let ssd_model = args.ssd_model.or(run::read_config(&dir)?.proxy_model());
        let reader = run::RunReader::open(&dir, &meta, &legend_fs::Unguarded, ssd_model)?;
        let Some(layout) = reader.store_layout() else {
            bail!(
                "{}: the run keeps its checkpoint in files, not in a store (storage.backend = \
                 \"memory\"): look rows up in its entities.bin with --path",
                path.display()
            );
        };
        let table = legend_query::store_table(layout)?;
        return Ok(Source {
            file: layout.members[0].file.path(),
            table,
            store: Some(reader),
            ssd_model,
        });
    }
    let path = args.path.clone().expect("clap: --path or --run");
    if args.row_bytes == 0 || !args.row_bytes.is_multiple_of(4) {
        bail!(
            "--row-bytes {} is not a positive multiple of 4",
            args.row_bytes
        );
    }
    let file_bytes = std::fs::metadata(&path)
        .with_context(|| format!("{}", path.display()))?
        .len();
    let fits = file_bytes / u64::from(args.row_bytes);
    let rows = args.rows.unwrap_or(fits);
    if rows == 0 || rows > fits {
        bail!(
            "{} holds {fits} rows of {} bytes, not {rows}",
            path.display(),
            args.row_bytes
        );
    }
    Ok(Source {
        table: CachedTable::contiguous(0, rows, args.row_bytes),
        file: path,
        store: None,
        ssd_model: args.ssd_model,
    })
}

pub fn run(args: CacheArgs) -> anyhow::Result<()> {
    if args.batch == 0 || args.batches == 0 || args.queues == 0 {
        bail!("--batch, --batches and --queues must be positive");
    }
    if !(args.cache_fraction > 0.0 && args.cache_fraction <= 1.0) {
        bail!("--cache-fraction {} is not in (0, 1]", args.cache_fraction);
    }
    let src = source(&args)?;
    let (rows, row_bytes) = (src.table.rows, src.table.row_bytes);
    let mut law = PowerLaw::new(rows, 0x2545_f491_4f6c_dd1d);
    let batches: Vec<Vec<u64>> = (0..=args.batches)
        .map(|_| (0..args.batch).map(|_| law.next()).collect())
        .collect();
    let table_bytes = rows * u64::from(row_bytes);
    let mut times = Vec::with_capacity(args.batches);
    let (cache_bytes, line_bytes, stats) = match args.mode {
        CacheMode::Pread => {
            let file = std::fs::File::open(&src.file)
                .with_context(|| format!("opening {}", src.file.display()))?;
            for (i, ids) in batches.iter().enumerate() {
                let t = pread_batch(&file, ids, &src.table, args.queues)?;
                if i > 0 {
                    times.push(t);
                }
            }
            (0, 0, None)
        }
        CacheMode::Gpu | CacheMode::Resident => gpu_batches(&args, &src, &batches, &mut times)?,
    };
    let total: Duration = times.iter().sum();
    times.sort_unstable();
    let pct = |q: f64| {
        let i = ((times.len() as f64 * q).ceil() as usize).clamp(1, times.len()) - 1;
        times[i].as_secs_f64() * 1e3
    };
    let report = Report {
        mode: args.mode,
        path: src.file.clone(),
        run: args.run.clone(),
        rows,
        row_bytes,
        table_bytes,
        cache_bytes,
        line_bytes,
        queues: args.queues,
        requesters: args.requesters,
        ahead: args.ahead,
        flops_per_byte: args.flops_per_byte,
        overlap: !args.no_overlap,
        ssd_model: src.ssd_model.map(|m| m.to_string()),
        batch: args.batch,
        batches: args.batches,
        lookups_per_s: (args.batch * args.batches) as f64 / total.as_secs_f64(),
        batch_ms_p50: pct(0.5),
        batch_ms_p99: pct(0.99),
        hit_rate: stats.map(|s| s.hit_rate()),
        misses: stats.map(|s| s.misses),
        coalesced: stats.map(|s| s.coalesced),
        retries: stats.map(|s| s.retries),
    };
    if args.json {
        super::super::print_json(&report)?;
    } else {
        outln!(
            "{:?} lookups of {}-byte rows ({} rows, cache {} of {} bytes): {:.0} lookups/s, \
             batch of {} p50 {:.2} ms p99 {:.2} ms, hit rate {}",
            report.mode,
            report.row_bytes,
            report.rows,
            report.cache_bytes,
            report.table_bytes,
            report.lookups_per_s,
            report.batch,
            report.batch_ms_p50,
            report.batch_ms_p99,
            report
                .hit_rate
                .map_or_else(|| "-".to_string(), |h| format!("{h:.3}"))
        )?;
    }
    Ok(())
}

/// The timed batches of lookups through the GPU row cache (all but the first, a warm-up, in
/// `times`); the cache's bytes, its line size and its counters over them.
fn gpu_batches(
    args: &CacheArgs,
    src: &Source,
    batches: &[Vec<u64>],
    times: &mut Vec<Duration>,
) -> anyhow::Result<(u64, u32, Option<legend_cuda::nvme_io::CacheStats>)> {
    let (rows, row_bytes) = (src.table.rows, src.table.row_bytes);
    let table_bytes = rows * u64::from(row_bytes);
    let gpu = legend_cuda::Gpu::new(0).context("opening cuda:0")?;
    let mut cache = open_cache(args, src, &gpu, table_bytes)?;
    if args.mode == CacheMode::Resident {
        // Every line once, untimed: all later lookups hit.
        let per_line = u64::from(cache.line_bytes() / row_bytes);
        let table = &src.table;
        let all: Vec<u64> = (0..rows)
            .filter(|&r| (r % table.rows_per_partition).is_multiple_of(per_line))
            .collect();
        for chunk in all.chunks(1 << 20) {
            cache.lookup(chunk)?;
        }
    }
    let before = cache.stats()?;
    for (i, ids) in batches.iter().enumerate() {
        let t = Instant::now();
        cache.lookup(ids)?;
        if i > 0 {
            times.push(t.elapsed());
        }
    }
    let after = cache.stats()?;
    let delta = legend_cuda::nvme_io::CacheStats {
        hits: after.hits - before.hits,
        misses: after.misses - before.misses,
        coalesced: after.coalesced - before.coalesced,
        retries: after.retries - before.retries,
    };
    Ok((cache.capacity_bytes(), cache.line_bytes(), Some(delta)))
}

/// The row cache of `args` over `src` on `gpu`: over a run's store through its own
/// controller, or over a file through a proxy started here.
fn open_cache(
    args: &CacheArgs,
    src: &Source,
    gpu: &legend_cuda::Gpu,
    table_bytes: u64,
) -> anyhow::Result<RowCache> {
    let row_bytes = src.table.row_bytes;
    let mut opts = RowCacheOptions {
        line_bytes: args.line_bytes,
        lines: 0,
        ways: args.ways,
        requesters: args.requesters,
        ahead: args.ahead,
        flops_per_byte: args.flops_per_byte,
        overlap: !args.no_overlap,
    };
    let fraction = match args.mode {
        CacheMode::Resident => 1.0,
        _ => args.cache_fraction,
    };
    let cache = match &src.store {
        Some(reader) => {
            let layout = reader.store_layout().expect("a store's reader");
            let mut bytes = (table_bytes as f64 * fraction) as u64;
            if args.mode == CacheMode::Resident {
                // A partition's last line may be partly past its rows: room for one
                // more line (at most 1 MiB) a partition.
                bytes += src.table.partitions.len() as u64 * (1 << 20);
            }
            legend_query::store_row_cache(gpu, layout, src.ssd_model, bytes, (args.queues, &opts))?
        }
        None => {
            let default = ProxyOptions::default();
            let proxy = Proxy::open(
                &src.file,
                &ProxyOptions {
                    model: src.ssd_model,
                    threads: args.proxy_threads.unwrap_or(default.threads),
                    ..default
                },
            )
            .with_context(|| format!("starting the proxy over {}", src.file.display()))?;
            let proxy = Arc::new(proxy);
            SharedController::Proxy(proxy.clone()).gpu_placement(gpu)?;
            // The line size the cache will use, to size it in lines.
            let line = RowCache::line_bytes_for(row_bytes, args.line_bytes, proxy.block_size());
            let table_lines = table_bytes.div_ceil(line);
            let lines = match args.mode {
                CacheMode::Resident => table_lines.next_multiple_of(u64::from(args.ways)),
                _ => ((table_lines as f64 * fraction) as u64).max(u64::from(args.ways)),
            };
            opts.lines = u32::try_from(lines).context("too many cache lines")?;
            let io_opts = GpuIoOptions {
                queues: args.queues,
                threads: 64,
                placement: RingPlacement::Host,
                staging: if line <= 64 << 10 { line as u32 } else { 0 },
                timeout: Duration::from_secs(10),
                ..GpuIoOptions::default()
            };
            let io = GpuIo::open(gpu, proxy.clone(), &io_opts)?;
            RowCache::open(gpu, io, src.table.clone(), &opts)?
        }
    };
    Ok(cache)
}

/// One batch by `threads` CPU threads, one `pread` a row of `table`.
fn pread_batch(
    file: &std::fs::File,
    ids: &[u64],
    table: &CachedTable,
    threads: u32,
) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let per = ids.len().div_ceil(threads as usize);
    std::thread::scope(|s| {
        let handles: Vec<_> = ids
            .chunks(per)
            .map(|chunk| {
                s.spawn(move || -> std::io::Result<u64> {
                    let mut buf = vec![0u8; table.row_bytes as usize];
                    let mut sum = 0u64;
                    for &id in chunk {
                        file.read_exact_at(&mut buf, table.byte_of(id))?;
                        sum = sum.wrapping_add(u64::from(buf[0]));
                    }
                    Ok(sum)
                })
            })
            .collect();
        for h in handles {
            h.join()
                .map_err(|_| anyhow::anyhow!("a pread thread panicked"))??;
        }
        anyhow::Ok(())
    })?;
    Ok(start.elapsed())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_power_law_stays_in_the_table_and_favours_few_rows() {
        let rows = 100_000;
        let mut law = PowerLaw::new(rows, 42);
        let mut counts = std::collections::HashMap::new();
        for _ in 0..200_000 {
            let id = law.next();
            assert!(id < rows);
            *counts.entry(id).or_insert(0u32) += 1;
        }
        let mut c: Vec<u32> = counts.values().copied().collect();
        c.sort_unstable_by(|a, b| b.cmp(a));
        // Zipf(1): the top 1% of rows take far more than 1% of the lookups.
        let top: u32 = c.iter().take(1000).sum();
        assert!(top > 200_000 / 3, "top 1% drew {top}");
    }
}
