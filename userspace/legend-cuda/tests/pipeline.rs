//! The data path around the step: batches gathered on the device in legend-model's
//! `Permutation` order, and copies through pinned staging on their own stream, overlapping
//! compute.
//! Needs a GPU: the tests are `#[ignore]`d, so a plain `cargo test` reports them skipped;
//! `--include-ignored` runs them (scripts/gpu/run-all.sh).

use cudarc::driver::DevicePtr;
use cudarc::driver::sys::CUevent_flags;
use legend_cuda::scan::EntityRows;
use legend_cuda::{
    BatchShape, CudaEvent, DeviceTable, Gpu, GpuBatchEngine, Transfer, gather_batch, negative_keys,
};
use legend_model::{AdaGrad, BatchKey, ChunkModel, Decoder, Loss, Permutation, StateLayout};

mod common;

use common::{Rng, gpu, seed};

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn gathered_batches_follow_the_rust_permutation() {
    let gpu = gpu();
    let mut rng = Rng(seed("gather"));
    for n in [1u64, 2, 3, 4, 5, 255, 256, 257, 65_535, 65_537, 1_000_003] {
        let key = rng.next();
        let order = Permutation::new(n, key);
        // Edge i holds i, a tag of i and n − i, so any misplaced id shows.
        let bucket: Vec<u32> = (0..n as u32)
            .flat_map(|i| [i, i ^ 0x5a5a_5a5a, n as u32 - i])
            .collect();
        let dev = gpu.upload(&bucket).unwrap();
        let batch = 1000u32.min(n as u32).max(1);
        let mut out = gpu.zeros::<u32>(3 * batch as usize).unwrap();
        let mut got = Vec::with_capacity(bucket.len());
        for first in (0..n).step_by(batch as usize) {
            let count = batch.min((n - first) as u32);
            gather_batch(&gpu, &dev.slice(..), &order, first, count, &mut out).unwrap();
            got.extend_from_slice(&gpu.download(&out).unwrap()[..3 * count as usize]);
        }
        let want: Vec<u32> = (0..n)
            .flat_map(|i| {
                let e = 3 * order.at(i) as usize;
                [bucket[e], bucket[e + 1], bucket[e + 2]]
            })
            .collect();
        assert!(
            got == want,
            "n = {n}, key = {key:#x}: the GPU's order differs"
        );
    }
    // Positions past the end are refused, not read.
    let dev = gpu.upload(&[0u32; 30]).unwrap();
    let mut out = gpu.zeros::<u32>(30).unwrap();
    let order = Permutation::new(10, 1);
    assert!(gather_batch(&gpu, &dev.slice(..), &order, 5, 6, &mut out).is_err());
    assert!(gather_batch(&gpu, &dev.slice(..27), &order, 0, 1, &mut out).is_err());
}

fn engine(gpu: &Gpu, entities: usize, max_batch: usize, k: usize, dim: usize) -> GpuBatchEngine {
    let model = ChunkModel {
        decoder: Decoder::ComplEx,
        loss: Loss::SoftmaxCe,
        dim,
    };
    let shape = BatchShape {
        max_batch,
        num_chunks: 2,
        negatives: k,
        group: 4,
    };
    let degrees = vec![1u32; entities];
    let opt = AdaGrad {
        lr: 0.1,
        eps: 1e-10,
        ..AdaGrad::default()
    };
    GpuBatchEngine::new(gpu, model, opt, shape, &degrees, 5).unwrap()
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn a_batch_gathered_on_the_device_trains_like_one_uploaded() {
    let gpu = gpu();
    let mut rng = Rng(seed("set_batch_from_device"));
    let (entities, dim, k) = (4000usize, 32usize, 64usize);
    // A bucket of partition pair (0, 1) of two partitions of 2000 rows.
    let n = 5000u64;
    let bucket: Vec<[u32; 3]> = (0..n)
        .map(|_| {
            [
                (rng.next() % 2000) as u32,
                (rng.next() % 5) as u32,
                2000 + (rng.next() % 2000) as u32,
            ]
        })
        .collect();
    let order = Permutation::new(n, rng.next());
    let ids: Vec<u32> = bucket.iter().flatten().copied().collect();
    let dev = gpu.upload(&ids).unwrap();
    let rows: Vec<f32> = (0..entities * dim)
        .map(|_| (rng.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
        .collect();
    let rel_rows: Vec<f32> = (0..5 * dim)
        .map(|_| (rng.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
        .collect();
    let zeros = vec![0.0f32; rows.len()];
    let mut results = Vec::new();
    for on_device in [false, true] {
        let mut e = engine(&gpu, entities, 1000, k, dim);
        let mut nodes = DeviceTable::from_host(&gpu, dim, &rows, &zeros).unwrap();
        let mut rels = DeviceTable::from_host(&gpu, dim, &rel_rows, &vec![0.0; 5 * dim]).unwrap();
        let mut losses = Vec::new();
        for (b, first) in (0..n).step_by(1000).enumerate() {
            let len = 1000.min(n - first) as usize;
            if on_device {
                // SAFETY: every edge has its source in 0..2000 and destination in 2000..4000
                // (built above) and a relation below 5.
                unsafe {
                    e.set_batch_from_device(
                        &gpu,
                        &dev.slice(..),
                        &order,
                        first,
                        len,
                        0..2000,
                        2000..4000,
                    )
                }
                .unwrap();
            } else {
                let batch: Vec<[u32; 3]> = (first..first + len as u64)
                    .map(|i| bucket[order.at(i) as usize])
                    .collect();
                e.set_batch(&gpu, &batch).unwrap();
            }
            let keys = negative_keys(BatchKey::new(7, 1, 0, b as u64), e.chunks());
            let all = 0..4000u64;
            e.sample_negatives(&gpu, std::slice::from_ref(&all), &keys, 0.0)
                .unwrap();
            e.step(&gpu, &mut nodes, Some(&mut rels)).unwrap();
            losses.push(e.loss(&gpu).unwrap());
        }
        results.push((losses, nodes.download(&gpu).unwrap().0));
    }
    let (host, device) = (&results[0], &results[1]);
    println!("losses uploaded {:?} gathered {:?}", host.0, device.0);
    for (a, b) in host.0.iter().zip(&device.0) {
        // The same batches: only the order of atomic additions differs.
        assert!((a - b).abs() <= 1e-5 * b.abs(), "loss {a} vs {b}");
    }
    // AdaGrad's first step is ±lr whatever the gradient's size, so a tiny gradient whose sign
    // the order of atomic additions flips moves a coordinate by 2·lr: compare norms.
    let (num, den) = host
        .1
        .iter()
        .zip(&device.1)
        .fold((0.0, 0.0), |(n, d), (a, b)| {
            (n + f64::from(a - b).powi(2), d + f64::from(*b).powi(2))
        });
    let err = (num / den).sqrt();
    assert!(err < 1e-2, "parameters differ: relative error {err:.2e}");
    // Rows outside the entities are refused before any launch.
    let mut e = engine(&gpu, entities, 1000, k, dim);
    // SAFETY: refused before the kernels run.
    let r =
        unsafe { e.set_batch_from_device(&gpu, &dev.slice(..), &order, 0, 10, 0..2000, 0..5000) };
    assert!(r.is_err());
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn staged_copies_round_trip_in_many_chunks() {
    let gpu = gpu();
    let mut rng = Rng(seed("transfer round trip"));
    // 4 KiB chunks: a partition of 777 rows of 33 floats takes 26 chunks each way.
    let mut t = Transfer::new(&gpu, 4096).unwrap();
    let (rows, dim) = (777usize, 33usize);
    let mut table = DeviceTable::zeros(&gpu, 3 * rows, dim, StateLayout::Element).unwrap();
    let emb: Vec<f32> = (0..rows * dim).map(|_| rng.next() as f32).collect();
    let state: Vec<f32> = (0..rows * dim).map(|_| -(rng.next() as f32)).collect();
    t.upload_rows(&mut table, rows, &emb, &state).unwrap();
    let (mut e2, mut s2) = (vec![0.0; emb.len()], vec![0.0; state.len()]);
    t.download_rows(&table, rows, &mut e2, &mut s2).unwrap();
    assert!(e2 == emb && s2 == state);
    // The other slots stayed zero.
    let (all, _) = table.download(&gpu).unwrap();
    assert!(all[..rows * dim].iter().all(|&x| x == 0.0));
    assert!(all[2 * rows * dim..].iter().all(|&x| x == 0.0));
    // A span past the table is refused.
    assert!(
        t.download_rows(&table, 2 * rows + 1, &mut e2, &mut s2)
            .is_err()
    );
}

/// Why the fill of [`an_upload_filled_by_its_caller_lands_in_order_and_stops_at_its_error`]
/// stopped.
#[derive(Debug)]
enum Filled {
    Source(usize),
    Gpu(legend_cuda::GpuError),
}

impl From<legend_cuda::GpuError> for Filled {
    fn from(e: legend_cuda::GpuError) -> Filled {
        Filled::Gpu(e)
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn an_upload_filled_by_its_caller_lands_in_order_and_stops_at_its_error() {
    let gpu = gpu();
    let mut rng = Rng(seed("filled upload"));
    // 4 KiB chunks: 777 rows of 33 floats (102 564 bytes) take 26 chunks, the last short.
    let mut t = Transfer::new(&gpu, 4096).unwrap();
    let (rows, dim) = (777usize, 33usize);
    let src: Vec<f32> = (0..rows * dim).map(|_| rng.next() as f32).collect();
    let bytes: &[u8] = bytemuck::cast_slice(&src);
    let mut table = EntityRows::new(&gpu, rows, dim).unwrap();
    let mut asked = Vec::new();
    let mut fill = |at: usize, chunk: &mut [u8]| {
        asked.push((at, chunk.len()));
        chunk.copy_from_slice(&bytes[at..at + chunk.len()]);
        Ok::<(), Filled>(())
    };
    table.fill(&mut t, &mut fill).unwrap();
    assert_eq!(table.read(&gpu, 0, rows).unwrap(), src);
    // Every byte asked for once, in order, a chunk at a time.
    let want: Vec<(usize, usize)> = (0..bytes.len())
        .step_by(4096)
        .map(|at| (at, 4096.min(bytes.len() - at)))
        .collect();
    assert_eq!(asked, want);
    assert_eq!(want.len(), 26);
    // A fill that fails at its fourth chunk: its error, and no chunk asked after it.
    let mut calls = 0;
    let mut failing = |at: usize, chunk: &mut [u8]| {
        calls += 1;
        if calls == 4 {
            return Err(Filled::Source(at));
        }
        chunk.fill(0);
        Ok(())
    };
    match table.fill(&mut t, &mut failing) {
        Err(Filled::Source(at)) => assert_eq!(at, 3 * 4096),
        Err(Filled::Gpu(e)) => panic!("the GPU failed: {e}"),
        Ok(()) => panic!("filled though the fill failed"),
    }
    assert_eq!(calls, 4);
}

fn timed_event(gpu: &Gpu) -> CudaEvent {
    gpu.context()
        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap()
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn copies_on_the_transfer_stream_overlap_compute() {
    let gpu = gpu();
    let mut rng = Rng(seed("overlap"));
    // Compute: training steps on the compute stream (200 take about 0.1 s on an H100).
    let (entities, dim, k, b) = (100_000usize, 128usize, 1000usize, 20_000usize);
    let mut e = engine(&gpu, entities, b, k, dim);
    let mut nodes = DeviceTable::zeros(&gpu, entities, dim, StateLayout::Element).unwrap();
    let mut rels = DeviceTable::zeros(&gpu, 5, dim, StateLayout::Element).unwrap();
    let batch: Vec<[u32; 3]> = (0..b)
        .map(|_| {
            [
                (rng.next() % entities as u64) as u32,
                (rng.next() % 5) as u32,
                (rng.next() % entities as u64) as u32,
            ]
        })
        .collect();
    e.set_batch(&gpu, &batch).unwrap();
    // Copies: 256 MB up on the transfer stream (about 30 ms), into a buffer compute does not
    // use.
    let mut t = Transfer::new(&gpu, legend_cuda::DEFAULT_CHUNK_BYTES).unwrap();
    let host = vec![1.5f32; 64 << 20];
    let dst = gpu.zeros::<f32>(host.len()).unwrap();
    // One run: `steps` steps queued on the compute stream by this thread and, when `copy`, the
    // upload queued meanwhile by another; returns the compute's end and the copy's start and
    // end, in ms from the compute's start.
    let all = 0..entities as u64;
    let mut run = |steps: u64, copy: bool| {
        gpu.synchronize().unwrap();
        let [c0, c1, t0, t1] = std::array::from_fn(|_| timed_event(&gpu));
        c0.record(gpu.stream()).unwrap();
        std::thread::scope(|scope| {
            if copy {
                scope.spawn(|| {
                    let (at, _) = dst.device_ptr(gpu.stream());
                    t0.record(t.stream()).unwrap();
                    // SAFETY: `dst` holds host.len() floats and outlives the copy (the stream is
                    // synchronised below); no compute uses it.
                    unsafe { t.upload_raw(&host, at) }.unwrap();
                    t1.record(t.stream()).unwrap();
                });
            }
            for s in 0..steps {
                let keys = negative_keys(BatchKey::new(1, 1, 0, s), e.chunks());
                e.sample_negatives(&gpu, std::slice::from_ref(&all), &keys, 0.0)
                    .unwrap();
                e.step(&gpu, &mut nodes, Some(&mut rels)).unwrap();
            }
            c1.record(gpu.stream()).unwrap();
        });
        gpu.synchronize().unwrap();
        t.stream().synchronize().unwrap();
        let ms = |ev: &CudaEvent| f64::from(c0.elapsed_ms(ev).unwrap());
        if copy {
            (ms(&c1), ms(&t0), ms(&t1))
        } else {
            (ms(&c1), 0.0, 0.0)
        }
    };
    run(2, true);
    let (compute_alone, _, _) = run(200, false);
    let (_, s0, s1) = run(0, true);
    let copy_alone = s1 - s0;
    let (compute, start, end) = run(200, true);
    let overlap = end.min(compute) - start.max(0.0);
    let span = compute.max(end);
    println!(
        "alone: compute {compute_alone:.1} ms, copy of {} MB {copy_alone:.1} ms ({:.1} GB/s); \
         together: compute 0 .. {compute:.1} ms, copy {start:.1} .. {end:.1} ms, overlap \
         {overlap:.1} ms",
        (host.len() * 4) >> 20,
        (host.len() * 4) as f64 / copy_alone / 1e6
    );
    assert!(
        overlap > 0.8 * (end - start) && span < compute_alone + 0.5 * copy_alone,
        "the copy should run while compute runs, not after it"
    );
    // And back, timed on the host.
    let mut back = vec![0.0f32; host.len()];
    let (at, _) = dst.device_ptr(gpu.stream());
    let started = std::time::Instant::now();
    // SAFETY: `dst` holds back.len() floats; nothing else runs.
    unsafe { t.download_raw(at, &mut back) }.unwrap();
    let secs = started.elapsed().as_secs_f64();
    println!(
        "download of {} MB: {:.1} ms ({:.1} GB/s)",
        (back.len() * 4) >> 20,
        secs * 1e3,
        (back.len() * 4) as f64 / secs / 1e9
    );
    assert!(back.iter().all(|&x| x == 1.5));
}
