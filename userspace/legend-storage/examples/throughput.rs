//! Partition write and read throughput of the `file` backend.
//!
//! ```text
//! cargo run --release -p legend-storage --example throughput -- \
//!     [PATH] [TOTAL_MIB] [PARTITIONS] [QUEUE_DEPTH] [REQUEST_KIB]
//! ```
//! Writes every partition twice (one `write` per partition, as swaps do,
//! each pass ending with a commit so the `fdatasync` is timed), then reads
//! every partition back twice. Compare with
//! `dd if=/dev/zero of=PATH.dd bs=1M count=TOTAL_MIB oflag=direct conv=fdatasync`
//! and `dd if=PATH.dd of=/dev/null bs=1M iflag=direct`.

use std::path::PathBuf;
use std::time::Instant;

use legend_storage::{
    CreateOptions, DatasetId, Dtype, Expect, IoBuffer, IoConfig, Region, Store, StoreError,
    StoreSpec,
};

fn arg<T: std::str::FromStr>(args: &[String], i: usize, default: T) -> T {
    args.get(i).and_then(|s| s.parse().ok()).unwrap_or(default)
}

fn main() -> Result<(), StoreError> {
    let args: Vec<String> = std::env::args().collect();
    let path: PathBuf = arg(
        &args,
        1,
        PathBuf::from("/work/targets/storage/bench-store.bin"),
    );
    let total_mib: u64 = arg(&args, 2, 512);
    let num_partitions: u32 = arg(&args, 3, 8);
    let io = IoConfig {
        queue_depth: arg(&args, 4, 32),
        request_bytes: arg::<u32>(&args, 5, 1024) << 10,
        ..IoConfig::default()
    };
    let dim = 100;
    let spec = StoreSpec {
        dataset: DatasetId {
            id: [0xbe; 16],
            label: "throughput".into(),
        },
        num_nodes: (total_mib << 20) / (u64::from(dim) * 8),
        dim,
        dtype: Dtype::F32,
        state_width: dim,
        num_partitions,
        aux_bytes: 0,
        progress_capacity: 0,
        shadow: false,
    };
    let opts = CreateOptions {
        io: io.clone(),
        force: true,
        ..CreateOptions::default()
    };
    let mut store = Store::create(&path, &spec, &opts)?;
    let mut buf = IoBuffer::new(store.max_partition_bytes())?;
    for (i, v) in buf.as_f32_mut().iter_mut().enumerate() {
        *v = i as f32;
    }
    let bytes: u64 = store.layout().partitions.iter().map(|e| e.bytes).sum();
    let mib = bytes as f64 / f64::from(1 << 20);

    // First pass writes into freshly preallocated (unwritten) extents; the
    // second overwrites, as partition swaps during training do.
    let mut write_s = [0.0; 2];
    for w in &mut write_s {
        let t = Instant::now();
        for p in 0..num_partitions {
            store.write(Region::Partition(p), &buf)?;
        }
        store.commit(&[])?;
        *w = t.elapsed().as_secs_f64();
    }
    drop(store);

    let mut store = Store::open(&path, &Expect::default(), &io)?;
    let mut read_s = [0.0; 2];
    for r in &mut read_s {
        let t = Instant::now();
        for p in 0..num_partitions {
            store.read(Region::Partition(p), &mut buf)?;
        }
        *r = t.elapsed().as_secs_f64();
    }
    println!(
        "{}: {mib:.0} MiB in {num_partitions} partitions, direct={}, qd={}, request={} KiB",
        path.display(),
        store.is_direct(),
        io.queue_depth,
        io.request_bytes >> 10
    );
    let rate = |s: f64| mib / s;
    println!(
        "write+commit: first {:.0} MiB/s, overwrite {:.0} MiB/s",
        rate(write_s[0]),
        rate(write_s[1])
    );
    println!(
        "read: {:.0} MiB/s, {:.0} MiB/s",
        rate(read_s[0]),
        rate(read_s[1])
    );
    Ok(())
}
