//! Batch time of one training step on the GPU: B = 10⁵ positives in 10 chunks of 10⁴, 10³
//! negatives per positive and side shared by a chunk, d = 100, softmax cross-entropy,
//! negatives sampled on the GPU. Prints one JSON object per configuration (and writes them to
//! the file named by the first argument, if any).
//!
//! `LEGEND_BENCH_GROUPS` (default `2,4,20`) lists the jobs per launch to try,
//! `LEGEND_BENCH_DECODERS` (default `complex,dot`) the models (`model.decoder` names, so
//! `transe_l1` and `transe_l2` too), `LEGEND_BENCH_ROWS` (default `element`) the node rows'
//! layouts as `state[/dtype]` (`optimizer.state` and `storage.dtype` values, e.g. `row/bf16`:
//! one AdaGrad float a row, every updated row rounded to bfloat16 by the step).
//! `LEGEND_BENCH_EXTRA=1` trains reciprocal relations with an N3 regulariser (weight 10⁻³) on
//! the decoders with relations (the rows backward's `legend_rows_backward_extra`).
//!
//! `LEGEND_BENCH_FILTERED=EDGES` filters the negatives against that many known edges (the
//! benchmark's batches and random ones: `training.negatives.filtered`, which runs the unfused
//! products and probes a table of EDGES edges for every score).
//!
//! `LEGEND_BENCH_BESIDE_IO=FILE` also times the steps again while the GPU I/O kernels read
//! FILE without pause through the proxy controller on their own stream (the paper's Fig. 9:
//! how much the I/O kernels slow training down), and reports the I/O rate they kept;
//! `LEGEND_BENCH_IO_QUEUES` (default 8) sets their queue pairs, a thread block each, and
//! `LEGEND_BENCH_IO_THREADS` (default `GpuIoOptions`'s) the blocks' threads;
//! `LEGEND_BENCH_IO_MODEL` (e.g. `samsung-980`) has the proxy serve FILE at a modelled SSD's
//! rates, so the step is timed beside the traffic one such SSD gives.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use cudarc::driver::sys::CUevent_flags;
use legend_cuda::nvme_io::{CudaDeviceMemory, GpuIo, GpuIoJob, GpuIoOptions};
use legend_cuda::{BatchShape, DeviceTable, Gpu, GpuBatchEngine, init_rows, negative_keys};
use legend_model::rng::mix;
use legend_model::{
    AdaGrad, BatchKey, ChunkModel, Decoder, Distribution, Dtype, Loss, Penalty, Regularizer,
    StateLayout, StepRounding, Table,
};
use legend_nvme_proxy::{DeviceModel, Proxy, ProxyOptions};

const ENTITIES: usize = 1_000_000;
const RELATIONS: usize = 1_000;
const BATCH: usize = 100_000;
const CHUNKS: usize = 10;
const NEGATIVES: usize = 1_000;
const DIM: usize = 100;
const WARMUP: usize = 3;
const TIMED: usize = 20;
/// Distinct batches cycled through, so repeated steps do not hit the same rows in L2.
const BATCHES: u64 = 4;

/// Node rows of one configuration: their AdaGrad state and their format at rest.
#[derive(Clone, Copy)]
struct Rows {
    state: StateLayout,
    dtype: Dtype,
}

impl std::str::FromStr for Rows {
    type Err = Box<dyn std::error::Error>;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (state, dtype) = s.split_once('/').unwrap_or((s, "f32"));
        let bad = |e: &dyn std::fmt::Display| format!("LEGEND_BENCH_ROWS entry {s:?}: {e}");
        Ok(Rows {
            state: state.parse().map_err(|e| bad(&e))?,
            dtype: dtype.parse().map_err(|e| bad(&e))?,
        })
    }
}

impl std::fmt::Display for Rows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.state, self.dtype)
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Batch times of `TIMED` steps after `WARMUP`, in ms.
struct Timing {
    total: Vec<f64>,
    sample: Vec<f64>,
    steps: Vec<f64>,
    loss: f64,
    unique_rows: usize,
}

fn timed_steps(
    gpu: &Gpu,
    engine: &mut GpuBatchEngine,
    nodes: &mut DeviceTable,
    rels: &mut DeviceTable,
    batches: &[Vec<[u32; 3]>],
    dtype: Dtype,
) -> Result<Timing, Box<dyn std::error::Error>> {
    let ctx = gpu.context().clone();
    let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let all = 0..ENTITIES as u64;
    let mut t = Timing {
        total: Vec::new(),
        sample: Vec::new(),
        steps: Vec::new(),
        loss: 0.0,
        unique_rows: 0,
    };
    for it in 0..WARMUP + TIMED {
        let b = it as u64 % BATCHES;
        engine.set_batch(gpu, &batches[b as usize])?;
        let keys = negative_keys(BatchKey::new(11, 1, 0, it as u64), engine.chunks());
        let ev: Vec<_> = (0..3)
            .map(|_| ctx.new_event(timing))
            .collect::<Result<_, _>>()?;
        ev[0].record(gpu.stream())?;
        engine.sample_negatives(gpu, std::slice::from_ref(&all), &keys, 0.0)?;
        ev[1].record(gpu.stream())?;
        engine.set_rounding(Some(StepRounding {
            dtype,
            batch: BatchKey::new(11, 1, 0, it as u64),
        }));
        engine.step(gpu, nodes, Some(rels))?;
        ev[2].record(gpu.stream())?;
        t.loss = engine.loss(gpu)?;
        gpu.synchronize()?;
        if it >= WARMUP {
            t.total.push(f64::from(ev[0].elapsed_ms(&ev[2])?));
            t.sample.push(f64::from(ev[0].elapsed_ms(&ev[1])?));
            t.steps.push(f64::from(ev[1].elapsed_ms(&ev[2])?));
        }
        if it == WARMUP {
            let mut ids: Vec<u32> = engine.negatives(gpu)?;
            ids.extend(batches[b as usize].iter().flat_map(|e| [e[0], e[2]]));
            ids.sort_unstable();
            ids.dedup();
            t.unique_rows = ids.len();
        }
    }
    Ok(t)
}

/// The GPU I/O kernels reading a file through the proxy without pause, in a thread of their
/// own: 256 MiB a launch into GPU memory.
struct BackgroundIo {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Result<(u64, f64), legend_cuda::GpuError>>,
}

impl BackgroundIo {
    const CHUNK: usize = 256 << 20;

    fn start(
        gpu: &Gpu,
        path: &Path,
        opts: &GpuIoOptions,
        model: Option<DeviceModel>,
    ) -> Result<BackgroundIo, Box<dyn std::error::Error>> {
        let options = ProxyOptions {
            model,
            ..ProxyOptions::default()
        };
        let proxy = Arc::new(Proxy::open(path, &options)?);
        proxy.attach_device(Arc::new(CudaDeviceMemory::new(gpu)?))?;
        let chunks = (proxy.blocks() << 9) / Self::CHUNK as u64;
        if chunks == 0 {
            return Err(format!("{}: smaller than 256 MiB", path.display()).into());
        }
        let mut io = GpuIo::open(gpu, proxy, opts)?;
        let region = io.alloc(gpu, Self::CHUNK)?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let (start, mut bytes, mut k) = (Instant::now(), 0u64, 0u64);
            while !flag.load(Ordering::Relaxed) {
                let job = GpuIoJob {
                    region,
                    offset: 0,
                    bytes: Self::CHUNK as u64,
                    at: (k % chunks) * Self::CHUNK as u64,
                    write: false,
                };
                bytes += io.run(&[job], false)?.bytes;
                k += 1;
            }
            Ok((bytes, start.elapsed().as_secs_f64()))
        });
        Ok(BackgroundIo { stop, thread })
    }

    /// Stops the reads; the bytes moved and the seconds they took.
    fn stop(self) -> Result<(u64, f64), Box<dyn std::error::Error>> {
        self.stop.store(true, Ordering::Relaxed);
        let r = self.thread.join().map_err(|_| "the I/O thread panicked")?;
        Ok(r?)
    }
}

/// The benchmark's settings, from its arguments and `LEGEND_BENCH_*` variables.
struct Settings {
    out_path: Option<String>,
    groups: Vec<usize>,
    decoders: Vec<Decoder>,
    extra: bool,
    row_layouts: Vec<Rows>,
    beside_io: Option<PathBuf>,
    io_opts: GpuIoOptions,
    io_model: Option<DeviceModel>,
    filtered: Option<usize>,
}

impl Settings {
    fn from_env() -> Result<Settings, Box<dyn std::error::Error>> {
        let out_path = std::env::args().nth(1);
        let groups: Vec<usize> = std::env::var("LEGEND_BENCH_GROUPS")
            .unwrap_or_else(|_| "2,4,20".into())
            .split(',')
            .map(|g| g.trim().parse())
            .collect::<Result<_, _>>()?;
        let decoders: Vec<Decoder> = std::env::var("LEGEND_BENCH_DECODERS")
            .unwrap_or_else(|_| "complex,dot".into())
            .split(',')
            .map(|d| d.trim().parse())
            .collect::<Result<_, _>>()?;
        let extra = std::env::var_os("LEGEND_BENCH_EXTRA").is_some_and(|v| v == "1");
        let row_layouts: Vec<Rows> = std::env::var("LEGEND_BENCH_ROWS")
            .unwrap_or_else(|_| "element".into())
            .split(',')
            .map(|r| r.trim().parse())
            .collect::<Result<_, _>>()?;
        let beside_io = std::env::var_os("LEGEND_BENCH_BESIDE_IO").map(PathBuf::from);
        let io_queues: u32 = match std::env::var("LEGEND_BENCH_IO_QUEUES") {
            Ok(q) => q.parse()?,
            Err(_) => 8,
        };
        let io_opts = GpuIoOptions {
            queues: io_queues,
            threads: match std::env::var("LEGEND_BENCH_IO_THREADS") {
                Ok(t) => t.parse()?,
                Err(_) => GpuIoOptions::default().threads,
            },
            ..GpuIoOptions::default()
        };
        let io_model: Option<DeviceModel> = match std::env::var("LEGEND_BENCH_IO_MODEL") {
            Ok(m) => Some(m.parse()?),
            Err(_) => None,
        };
        let filtered: Option<usize> = match std::env::var("LEGEND_BENCH_FILTERED") {
            Ok(v) => Some(
                v.parse()
                    .map_err(|e| format!("LEGEND_BENCH_FILTERED={v}: {e}"))?,
            ),
            Err(_) => None,
        };
        Ok(Settings {
            out_path,
            groups,
            decoders,
            extra,
            row_layouts,
            beside_io,
            io_opts,
            io_model,
            filtered,
        })
    }
}

/// The edge a hash names: source, relation and destination from its bits.
fn edge_of(h: u64) -> [u32; 3] {
    [
        (h % ENTITIES as u64) as u32,
        ((h >> 20) % RELATIONS as u64) as u32,
        ((h >> 40) % ENTITIES as u64) as u32,
    ]
}

/// The benchmark's batches (fixed, from their indices) and, with `filtered`, that many known
/// edges: the batches' own and more.
fn batches_and_known(filtered: Option<usize>) -> (Vec<Vec<[u32; 3]>>, Vec<[u32; 3]>) {
    let batches: Vec<Vec<[u32; 3]>> = (0..BATCHES)
        .map(|b| {
            (0..BATCH as u64)
                .map(|i| edge_of(mix(b << 40 ^ i)))
                .collect()
        })
        .collect();
    let known: Vec<[u32; 3]> = match filtered {
        Some(total) => {
            let mut known: Vec<[u32; 3]> = batches.iter().flatten().copied().collect();
            let extra = total.saturating_sub(known.len()) as u64;
            known.extend((0..extra).map(|i| edge_of(mix(0x6b6e_6f77 ^ i))));
            known
        }
        None => Vec::new(),
    };
    (batches, known)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Settings {
        out_path,
        groups,
        decoders,
        extra,
        row_layouts,
        beside_io,
        io_opts,
        io_model,
        filtered,
    } = Settings::from_env()?;
    let t = Instant::now();
    let gpu = Gpu::new(0)?;
    eprintln!(
        "device {} ({}), kernels ready in {:.2} s",
        gpu.name(),
        gpu.arch(),
        t.elapsed().as_secs_f64()
    );
    let (batches, known) = batches_and_known(filtered);
    let degrees = vec![1u32; ENTITIES];
    let mut json = String::new();
    for &decoder in &decoders {
        for (&group, &rows) in groups
            .iter()
            .flat_map(|g| row_layouts.iter().map(move |r| (g, r)))
        {
            let model = ChunkModel {
                decoder,
                loss: Loss::SoftmaxCe,
                dim: DIM,
            };
            let shape = BatchShape {
                max_batch: BATCH,
                num_chunks: CHUNKS,
                negatives: NEGATIVES,
                group,
            };
            let optimizer = AdaGrad {
                state: rows.state,
                ..AdaGrad::default()
            };
            // Reciprocal relations double the relation rows (the inverses follow).
            let extra = extra && decoder.uses_relations();
            let relation_rows = if extra { 2 * RELATIONS } else { RELATIONS };
            let mut engine =
                GpuBatchEngine::new(&gpu, model, optimizer, shape, &degrees, relation_rows)?;
            if extra {
                engine.set_reciprocal_relations(true)?;
                engine.set_regularizer(Some(Regularizer::new(Penalty::N3, 1e-3, decoder)));
            }
            if filtered.is_some() {
                engine.set_known_edges(&gpu, &known)?;
            }
            let dist = Distribution::Uniform { bound: 0.5 };
            let mut nodes = DeviceTable::zeros(&gpu, ENTITIES, DIM, rows.state)?;
            init_rows(
                &gpu,
                nodes.emb_mut(),
                DIM,
                0,
                ENTITIES,
                7,
                Table::Node,
                dist,
            )?;
            let mut rels =
                DeviceTable::init(&gpu, relation_rows, DIM, 0, 7, Table::Relation, dist)?;
            let dtype = rows.dtype;
            let mut alone = timed_steps(&gpu, &mut engine, &mut nodes, &mut rels, &batches, dtype)?;
            let beside = match &beside_io {
                Some(path) => {
                    let io = BackgroundIo::start(&gpu, path, &io_opts, io_model)?;
                    let with_io =
                        timed_steps(&gpu, &mut engine, &mut nodes, &mut rels, &batches, dtype);
                    let (bytes, seconds) = io.stop()?;
                    Some((with_io?, bytes as f64 / seconds / 1e9))
                }
                None => None,
            };
            // One more step with an event after every kernel, for the breakdown.
            engine.set_profiling(true);
            engine.set_batch(&gpu, &batches[0])?;
            let keys = negative_keys(BatchKey::new(11, 2, 0, 0), engine.chunks());
            engine.sample_negatives(
                &gpu,
                std::slice::from_ref(&(0..ENTITIES as u64)),
                &keys,
                0.0,
            )?;
            engine.set_rounding(Some(StepRounding {
                dtype,
                batch: BatchKey::new(11, 2, 0, 0),
            }));
            engine.step(&gpu, &mut nodes, Some(&mut rels))?;
            let phases = engine.take_profile(&gpu)?;
            engine.set_profiling(false);
            let profile: Vec<String> = phases
                .iter()
                .map(|(n, ms)| format!("\"{n}\":{ms:.4}"))
                .collect();
            let loss = alone.loss;
            if !loss.is_finite() {
                return Err(format!("{decoder}: loss {loss}").into());
            }
            let unique_rows = alone.unique_rows;
            // Fewest bytes a step must move: each touched entity row's parameters and state
            // read and written once, plus the edges.
            let bytes = unique_rows as f64 * DIM as f64 * 4.0 * 4.0 + BATCH as f64 * 12.0;
            let line = format!(
                "{{\"engine\":\"legend-cuda\",\"device\":\"{}\",\"decoder\":\"{decoder}\",\"rows\":\"{rows}{}\",\"group\":{group},\"filtered_edges\":{},\"batch\":{BATCH},\"chunks\":{CHUNKS},\"negatives\":{NEGATIVES},\"dim\":{DIM},\"median_ms\":{:.4},\"sample_ms\":{:.4},\"step_ms\":{:.4},\"flops\":{:.4e},\"min_bytes\":{:.4e},\"unique_rows\":{unique_rows},\"loss_per_edge\":{:.6},\"phases_ms\":{{{}}}}}",
                gpu.name(),
                if extra { "+reciprocal+n3" } else { "" },
                known.len(),
                median(&mut alone.total),
                median(&mut alone.sample),
                median(&mut alone.steps),
                engine.step_flops(),
                bytes,
                loss / BATCH as f64,
                profile.join(","),
            );
            let line = match beside {
                Some((mut with_io, gb_per_s)) => format!(
                    "{},\"median_ms_beside_io\":{:.4},\"io_queues\":{},\"io_threads\":{},\"io_gb_per_s_beside\":{gb_per_s:.3}}}",
                    line.strip_suffix('}').unwrap_or(&line),
                    median(&mut with_io.total),
                    io_opts.queues,
                    io_opts.threads
                ),
                None => line,
            };
            println!("{line}");
            writeln!(json, "{line}")?;
        }
    }
    if let Some(path) = out_path {
        std::fs::write(path, json)?;
    }
    Ok(())
}
