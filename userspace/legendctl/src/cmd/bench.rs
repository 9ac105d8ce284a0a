//! `legendctl bench io`: raw I/O rate of a store target the way the backends drive it: a file
//! or block device through `io_uring` (`file`), or a namespace through NVMe I/O queue pairs of
//! the `legend_nvme` device (`nvme`) or the userspace proxy (`proxy`), submitted by CPU threads
//! or by the GPU I/O kernels (`--submitter gpu`). Several `--path`s are driven at once, as a
//! striped store drives its members: each with `--queues` of its own (the GPU I/O kernels
//! drive them all in one launch).
//!
//! Every command is checked: if any failed, or a queue stopped answering, the run reports that
//! and prints no figures.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand, ValueEnum};
use legend_engine::store::QueueBackend;
use legend_engine::store::StoreFile;
use legend_engine::store::controllers::{self, DeviceModel};
use legend_nvme_proxy::{Proxy, ProxyOptions};
use serde::Serialize;

mod cache;
mod file;
mod queues;

/// Benchmarks.
#[derive(Parser)]
pub struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(Subcommand)]
enum What {
    /// Read or write a store target and report bandwidth, operations/s and latency.
    Io(IoArgs),
    /// Look rows of a table up through the GPU row cache (or with pread) and report lookups/s,
    /// batch latency and hit rate.
    Cache(cache::CacheArgs),
}

/// Where the I/O goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BenchBackend {
    /// A file or block device through io_uring (O_DIRECT where the file system allows it).
    File,
    /// The userspace proxy controller over a file or block device, through NVMe queues.
    Proxy,
    /// An SSD bound to legend_nvme (`/dev/legend-nvmeN`), through NVMe queues.
    Nvme,
}

/// Who builds and submits the commands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Submitter {
    /// CPU threads, one queue (or ring) each.
    Cpu,
    /// GPU thread blocks, one queue pair each (the I/O kernels; `proxy` and `nvme`).
    Gpu,
}

/// Access pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pattern {
    /// Consecutive requests, each queue its own stripe.
    Seq,
    /// Uniformly random, request-aligned offsets.
    Rand,
}

/// Read or write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// Read.
    Read,
    /// Write (destroys the target's data in the span; `nvme` and block devices need --force).
    Write,
}

/// `bench io` options.
#[derive(Parser, Clone)]
pub struct IoArgs {
    /// The target's kind.
    #[arg(long, value_enum, default_value = "file")]
    pub backend: BenchBackend,
    /// A file or block device (`file`, `proxy`), or the device node (`nvme`); repeated, the
    /// targets are driven at once (CPU submitters), as the members of a striped store are.
    #[arg(long = "path", required = true)]
    pub paths: Vec<PathBuf>,
    /// CPU threads or GPU thread blocks submitting.
    #[arg(long, value_enum, default_value = "cpu")]
    pub submitter: Submitter,
    /// Access pattern.
    #[arg(long, value_enum, default_value = "seq")]
    pub pattern: Pattern,
    /// Read or write.
    #[arg(long, value_enum, default_value = "read")]
    pub op: Op,
    /// Bytes per request (a multiple of the block size).
    #[arg(long, default_value_t = 1 << 20)]
    pub size: u64,
    /// Queues (CPU threads or GPU blocks) a target, each with its own queue pair or ring.
    #[arg(long, default_value_t = 1)]
    pub queues: u32,
    /// Requests in flight per queue.
    #[arg(long, default_value_t = 32)]
    pub depth: u32,
    /// How long to run.
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Bytes of the target the requests fall in, from `--offset` (default: all of it).
    #[arg(long)]
    pub span: Option<u64>,
    /// First byte of the span.
    #[arg(long, default_value_t = 0)]
    pub offset: u64,
    /// Namespace (`proxy`, `nvme`).
    #[arg(long, default_value_t = 1)]
    pub namespace: u32,
    /// `proxy`: serve at a modelled SSD's rates and latency: a preset (`samsung-980`) or
    /// `read=GB/s,write=GB/s,shared=true,iops=N,latency_us=N`, e.g. `samsung-980,latency_us=0`.
    #[arg(long, value_name = "MODEL")]
    pub ssd_model: Option<DeviceModel>,
    /// `proxy`: controller threads (default: a quarter of the cores, 1 to 4).
    #[arg(long)]
    pub proxy_threads: Option<u16>,
    /// `proxy`: commands it runs against the file at once, shared by its threads.
    #[arg(long, default_value_t = ProxyOptions::default().io_depth)]
    pub proxy_depth: u16,
    /// `--submitter gpu`: bytes of the I/O kernels' staging slots in host memory (commands up
    /// to this size go through them, see GpuIoOptions::staging); 0: none. Default: the request
    /// size for the proxy when it is at most 64 KiB, else 0.
    #[arg(long)]
    pub staging: Option<u32>,
    /// Allow writes to a device (`nvme`, block devices): they destroy its data in the span.
    #[arg(long)]
    pub force: bool,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// What one queue measured.
#[derive(Default)]
pub struct Samples {
    /// When its first request was submitted (its set-up done): the figures' clock starts at the
    /// earliest queue's, so that opening targets and allocating buffers is not counted as I/O.
    pub started: Option<Instant>,
    /// Requests completed.
    pub ops: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Latency of each request, submission to completion, in nanoseconds.
    pub latencies_ns: Vec<u64>,
}

impl Samples {
    /// Samples whose I/O starts now.
    pub fn starting_now() -> Samples {
        Samples {
            started: Some(Instant::now()),
            ..Samples::default()
        }
    }

    fn merge(&mut self, other: Samples) {
        self.started = match (self.started, other.started) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self.ops += other.ops;
        self.bytes += other.bytes;
        self.latencies_ns.extend(other.latencies_ns);
    }
}

/// The report.
#[derive(Serialize)]
struct Report {
    backend: BenchBackend,
    submitter: Submitter,
    pattern: Pattern,
    op: Op,
    paths: Vec<PathBuf>,
    request_bytes: u64,
    queues: u32,
    depth: u32,
    /// The modelled SSD the proxy served at, if any.
    ssd_model: Option<String>,
    /// The proxy's controller threads and the commands it ran at once (`proxy`).
    proxy_threads: Option<u16>,
    proxy_depth: Option<u16>,
    /// The GPU I/O kernels' staging slot bytes (`--submitter gpu`; 0: none).
    staging_bytes: Option<u32>,
    elapsed_s: f64,
    ops: u64,
    bytes: u64,
    ops_per_s: f64,
    /// Decimal units: 10^9 bytes per second.
    gb_per_s: f64,
    /// Binary units: 2^30 bytes per second.
    gib_per_s: f64,
    latency_us: Percentiles,
    /// What each target moved, in `paths` order.
    targets: Vec<TargetFigures>,
}

/// One target's share of a run over several.
#[derive(Serialize)]
struct TargetFigures {
    path: PathBuf,
    ops: u64,
    bytes: u64,
    /// Over the target's own time, from its first request to its last completion: targets
    /// set up one after the other still report their device's rate.
    elapsed_s: f64,
    gb_per_s: f64,
}

#[derive(Serialize)]
struct Percentiles {
    p50: f64,
    p90: f64,
    p99: f64,
    p999: f64,
    max: f64,
}

fn percentiles(mut ns: Vec<u64>) -> Percentiles {
    ns.sort_unstable();
    let at = |q: f64| {
        if ns.is_empty() {
            return 0.0;
        }
        let i = ((ns.len() as f64 * q).ceil() as usize).clamp(1, ns.len()) - 1;
        ns[i] as f64 / 1000.0
    };
    Percentiles {
        p50: at(0.5),
        p90: at(0.9),
        p99: at(0.99),
        p999: at(0.999),
        max: at(1.0),
    }
}

/// The span of the target requests fall in, checked against its size and block size.
pub struct Span {
    /// First byte.
    pub start: u64,
    /// Bytes.
    pub len: u64,
}

impl Span {
    /// `args`' span of the target `path` of `size` bytes with `block`-byte blocks.
    fn of(args: &IoArgs, path: &Path, size: u64, block: u64) -> anyhow::Result<Span> {
        if args.size == 0 || !args.size.is_multiple_of(block) {
            bail!(
                "--size {} is not a positive multiple of the {block}-byte block of {}",
                args.size,
                path.display()
            );
        }
        if !args.offset.is_multiple_of(block) || args.offset >= size {
            bail!(
                "--offset {} is not a block-aligned offset inside {} ({size} bytes)",
                args.offset,
                path.display()
            );
        }
        let len = args.span.unwrap_or(size - args.offset);
        if len < args.size || args.offset + len > size {
            bail!(
                "the span of {len} bytes from {} does not fit {} ({size} bytes) or is smaller than one request",
                args.offset,
                path.display()
            );
        }
        Ok(Span {
            start: args.offset,
            len: len / args.size * args.size,
        })
    }

    /// Offset of request `n` of queue `q` of `queues`.
    pub fn offset(&self, args: &IoArgs, q: u32, n: u64, rng: &mut u64) -> u64 {
        let slots = self.len / args.size;
        let slot = match args.pattern {
            // Each queue walks its own stripe of the span.
            Pattern::Seq => (u64::from(q) * (slots / u64::from(args.queues)).max(1) + n) % slots,
            Pattern::Rand => {
                *rng ^= *rng << 13;
                *rng ^= *rng >> 7;
                *rng ^= *rng << 17;
                *rng % slots
            }
        };
        self.start + slot * args.size
    }
}

/// Zeroed, page-aligned memory a submitter's requests or queues live in, freed on drop.
struct PageMemory {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl PageMemory {
    /// `bytes` (non-zero) of memory for `what`, which a failure names.
    fn new(bytes: usize, what: &str) -> anyhow::Result<PageMemory> {
        let layout = std::alloc::Layout::from_size_align(bytes, 4096)?;
        // SAFETY: a non-zero size (checked by the caller's arguments).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            bail!("cannot allocate {bytes} bytes of {what}");
        }
        Ok(PageMemory { ptr, layout })
    }
}

impl Drop for PageMemory {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match args.what {
        What::Io(a) => io(a),
        What::Cache(a) => cache::run(a),
    }
}

fn io(args: IoArgs) -> anyhow::Result<()> {
    if args.queues == 0 || args.depth == 0 || args.seconds.is_nan() || args.seconds <= 0.0 {
        bail!("--queues, --depth and --seconds must be positive");
    }
    for path in &args.paths {
        if !path.exists() {
            bail!(
                "{}: no such file or device{}",
                path.display(),
                if args.backend == BenchBackend::Nvme {
                    " (is the controller bound to legend_nvme? `legendctl device list`)"
                } else {
                    ""
                }
            );
        }
        if let Some(other) = args.paths.iter().filter(|p| *p == path).nth(1) {
            bail!("--path {} is given twice", other.display());
        }
    }
    if (args.ssd_model.is_some() || args.proxy_threads.is_some())
        && args.backend != BenchBackend::Proxy
    {
        bail!("--ssd-model and --proxy-threads set up the proxy: use them with --backend proxy");
    }
    if args.proxy_threads == Some(0) || args.proxy_depth == 0 {
        bail!("--proxy-threads and --proxy-depth must be positive");
    }
    if args.staging.is_some() && args.submitter != Submitter::Gpu {
        bail!("--staging sets up the GPU I/O kernels: use it with --submitter gpu");
    }
    if args.submitter == Submitter::Gpu && args.backend == BenchBackend::File {
        bail!("--submitter gpu drives NVMe queues: use --backend proxy or nvme");
    }
    let duration = Duration::from_secs_f64(args.seconds);
    let started = Instant::now();
    let per_target: Vec<(Samples, Instant)> = if args.submitter == Submitter::Gpu {
        // Every target's queue pairs in each launch: they end together.
        let samples = gpu(&args, duration)?;
        let ended = Instant::now();
        samples.into_iter().map(|s| (s, ended)).collect()
    } else {
        std::thread::scope(|s| {
            let running: Vec<_> = args
                .paths
                .iter()
                .map(|path| {
                    let args = &args;
                    s.spawn(move || {
                        one_target(args, path, duration).map(|samples| (samples, Instant::now()))
                    })
                })
                .collect();
            running
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| bail!("a target's thread panicked"))
                })
                .collect::<anyhow::Result<_>>()
        })?
    };
    let mut samples = Samples::default();
    let mut targets = Vec::with_capacity(args.paths.len());
    for (path, (r, ended)) in args.paths.iter().zip(per_target) {
        let secs = ended
            .duration_since(r.started.unwrap_or(started))
            .as_secs_f64();
        targets.push(TargetFigures {
            path: path.clone(),
            ops: r.ops,
            bytes: r.bytes,
            elapsed_s: secs,
            gb_per_s: r.bytes as f64 / secs / 1e9,
        });
        samples.merge(r);
    }
    let elapsed = samples
        .started
        .unwrap_or(started)
        .elapsed()
        .min(duration.max(Duration::from_millis(1)) * 2);
    let secs = elapsed.as_secs_f64();
    let report = Report {
        backend: args.backend,
        submitter: args.submitter,
        pattern: args.pattern,
        op: args.op,
        paths: args.paths.clone(),
        request_bytes: args.size,
        queues: args.queues,
        depth: args.depth,
        ssd_model: args.ssd_model.map(|m| m.to_string()),
        proxy_threads: (args.backend == BenchBackend::Proxy).then(|| proxy_options(&args).threads),
        proxy_depth: (args.backend == BenchBackend::Proxy).then_some(args.proxy_depth),
        staging_bytes: (args.submitter == Submitter::Gpu).then(|| staging(&args)),
        elapsed_s: secs,
        ops: samples.ops,
        bytes: samples.bytes,
        ops_per_s: samples.ops as f64 / secs,
        gb_per_s: samples.bytes as f64 / secs / 1e9,
        gib_per_s: samples.bytes as f64 / secs / f64::from(1u32 << 30),
        latency_us: percentiles(samples.latencies_ns),
        targets,
    };
    if args.json {
        super::print_json(&serde_json::to_value(&report)?)?;
    } else {
        let l = &report.latency_us;
        outln!(
            "{} {} {} of {} B requests on {} ({} submitter, {} queues x {} deep): \
             {} ops, {} bytes in {:.2} s: {:.0} ops/s, {:.3} GB/s ({:.3} GiB/s); latency \
             p50 {:.1} us, p90 {:.1} us, p99 {:.1} us, p99.9 {:.1} us, max {:.1} us",
            name(&report.backend),
            name(&report.pattern),
            name(&report.op),
            report.request_bytes,
            report
                .paths
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(" + "),
            name(&report.submitter),
            report.queues,
            report.depth,
            report.ops,
            report.bytes,
            secs,
            report.ops_per_s,
            report.gb_per_s,
            report.gib_per_s,
            l.p50,
            l.p90,
            l.p99,
            l.p999,
            l.max
        )?;
    }
    Ok(())
}

/// The proxy `--backend proxy` starts.
fn proxy_options(args: &IoArgs) -> ProxyOptions {
    let default = ProxyOptions::default();
    ProxyOptions {
        model: args.ssd_model,
        threads: args.proxy_threads.unwrap_or(default.threads),
        io_depth: args.proxy_depth,
        ..default
    }
}

/// The staging slot bytes of `--submitter gpu`.
fn staging(args: &IoArgs) -> u32 {
    args.staging.unwrap_or(
        if args.backend == BenchBackend::Proxy && args.size <= 64 << 10 {
            args.size as u32
        } else {
            0
        },
    )
}

/// Runs the benchmark on one target with CPU submitters.
fn one_target(args: &IoArgs, path: &Path, duration: Duration) -> anyhow::Result<Samples> {
    match args.backend {
        BenchBackend::File => file::run(args, path, duration),
        BenchBackend::Proxy | BenchBackend::Nvme => {
            let ctrl = controller(args, path)?;
            queues::run(args, path, ctrl.controller(), duration)
        }
    }
}

/// The controller of target `path` (`--backend proxy` or `nvme`).
fn controller(args: &IoArgs, path: &Path) -> anyhow::Result<controllers::SharedController> {
    if args.backend == BenchBackend::Proxy {
        // Its own proxy, with the asked-for threads and depth (no other user of the file in
        // this process to share one with).
        let proxy = Proxy::open(path, &proxy_options(args))
            .with_context(|| format!("starting the proxy over {}", path.display()))?;
        Ok(controllers::SharedController::Proxy(Arc::new(proxy)))
    } else {
        StoreFile::open(path, &legend_fs::Unguarded)
            .and_then(|file| controllers::open(QueueBackend::Nvme, &file, None))
            .with_context(|| format!("opening {}", path.display()))
    }
}

/// The lower-case name an option value has on the command line.
fn name(v: &impl std::fmt::Debug) -> String {
    format!("{v:?}").to_lowercase()
}

/// The GPU I/O kernels against every target's controller (`legend-cuda`; one member of a
/// `GpuIo` each): `--queues` thread blocks of `--depth` threads a target, each block a queue
/// pair with two batches in flight; each launch moves a few batches a block on every target at
/// once, until the time is up. What each target moved, in `paths` order.
fn gpu(args: &IoArgs, duration: Duration) -> anyhow::Result<Vec<Samples>> {
    use legend_cuda::nvme_io::{GpuIo, GpuIoJob, GpuIoOptions, IoMember, MemberJob, RingPlacement};
    let device = legend_cuda::Gpu::new(0).context("opening cuda:0")?;
    // Kept open while the queues use them.
    let mut ctrls = Vec::with_capacity(args.paths.len());
    let mut members = Vec::with_capacity(args.paths.len());
    for path in &args.paths {
        let ctrl = controller(args, path)?;
        let placement = ctrl.gpu_placement(&device)?;
        check_write(args, path, placement == RingPlacement::Device)?;
        members.push(IoMember {
            controller: ctrl.controller(),
            options: GpuIoOptions {
                queues: args.queues,
                threads: args.depth,
                namespace: args.namespace,
                placement,
                timeout: Duration::from_secs(10),
                staging: staging(args),
            },
        });
        ctrls.push(ctrl);
    }
    let mut io = GpuIo::open_members(&device, &members)?;
    let spans = (args.paths.iter().enumerate())
        .map(|(m, path)| {
            let info = io.member(m).context("a member of the GPU I/O")?;
            Span::of(args, path, info.namespace_bytes, info.block_size)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    // Four batches a block a launch on every target, within 1 GiB of GPU memory.
    let targets = args.paths.len() as u64;
    let per_launch = spans
        .iter()
        .map(|span| span.len / args.size)
        .min()
        .unwrap_or(0)
        .min(u64::from(args.queues) * u64::from(args.depth) * 4)
        .min((1 << 30) / args.size / targets)
        .max(1);
    let region = io.alloc(&device, (per_launch * targets * args.size) as usize)?;
    let deadline = Instant::now() + duration;
    let mut samples: Vec<Samples> = args.paths.iter().map(|_| Samples::starting_now()).collect();
    let (mut n, mut rngs) = (0u64, vec![0x9e37_79b9_7f4a_7c15u64; args.paths.len()]);
    while Instant::now() < deadline {
        // One job a request (`--size` bytes), at each target's pattern's next offsets.
        let mut jobs = Vec::with_capacity((per_launch * targets) as usize);
        for (m, (span, rng)) in spans.iter().zip(&mut rngs).enumerate() {
            for i in 0..per_launch {
                jobs.push(MemberJob {
                    member: m,
                    job: GpuIoJob {
                        region,
                        offset: (m as u64 * per_launch + i) * args.size,
                        bytes: args.size,
                        at: span.offset(args, 0, n + i, rng),
                        write: args.op == Op::Write,
                    },
                });
            }
        }
        n += per_launch;
        let run = io.run_members(&jobs, true)?;
        // The latencies come member by member.
        let mut latencies = run.latencies_ns.into_iter();
        for (s, (&ops, &bytes)) in samples
            .iter_mut()
            .zip(run.member_commands.iter().zip(&run.member_bytes))
        {
            s.ops += ops;
            s.bytes += bytes;
            s.latencies_ns.extend(latencies.by_ref().take(ops as usize));
        }
    }
    drop(io);
    drop(ctrls);
    Ok(samples)
}

/// Refuses writes to the device `path` unless forced.
pub fn check_write(args: &IoArgs, path: &Path, is_device: bool) -> anyhow::Result<()> {
    if args.op == Op::Write && is_device && !args.force {
        bail!(
            "--op write would overwrite {} bytes of {} from byte {}: pass --force to allow it",
            args.span.map_or_else(|| "all".into(), |s| s.to_string()),
            path.display(),
            args.offset
        );
    }
    Ok(())
}
