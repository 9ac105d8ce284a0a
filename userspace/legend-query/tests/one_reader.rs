//! A queried run reads its rows through one reader: its store opened once, and so its queue
//! pairs created once. Counted on the proxy controller of a proxy-backed run (it counts the
//! queue pairs its users create): the CPU's one pair (the store's), plus on a GPU the row
//! cache's, and nothing new however many queries follow.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use legend_dataset::{GenerateOptions, generate};
use legend_engine::config::DeviceChoice;
use legend_engine::run;
use legend_engine::session::{Outcome, Session};
use legend_engine::store::controllers::{self, SharedController};
use legend_engine::store::{QueueBackend, StoreFile};
use legend_fs::Unguarded;
use legend_query::{GpuOptions, Query, QueryRun, Residency};

/// Trains a proxy-backed run on the CPU, one epoch: 3000 entities in 3 partitions. Returns the
/// run and its store's backing file.
fn proxy_run(dir: &Path) -> (PathBuf, PathBuf) {
    let ds = dir.join("ds");
    let mut o = GenerateOptions::new(3000, 9000);
    o.relations = 3;
    generate(&o, &ds).unwrap();
    let sets: Vec<String> = [
        "training.device=cpu",
        "training.num_epochs=1",
        "model.decoder=distmult",
        "model.dim=8",
        "storage.backend=proxy",
        "storage.num_partitions=3",
        "storage.buffer_capacity=2",
        "evaluation.protocol=sampled",
    ]
    .map(String::from)
    .to_vec();
    let config = legend_engine::Config::parse("", &sets).unwrap();
    let out = dir.join("run");
    let mut session = Session::create(&out, &ds, config, &Unguarded).unwrap();
    let outcome = session.run(&AtomicBool::new(false), &mut |_| {}).unwrap();
    assert!(matches!(outcome, Outcome::Finished(_)), "{outcome:?}");
    let meta = run::read_meta(&run::open(&out).unwrap()).unwrap();
    (out, meta.store.expect("a proxy-backed run has a store"))
}

/// The queries of a call: predictions (a scan each kind, and the anchors looked up), scores
/// and a row (lookups).
fn queries() -> Vec<Query> {
    let mut asked: Vec<Query> = (0..4)
        .map(|i| Query::Predict {
            head: Some((i * 701).to_string()),
            relation: (i % 3).to_string(),
            tail: None,
            top: 5,
            filtered: false,
        })
        .collect();
    asked.push(Query::Score {
        head: "17".into(),
        relation: "1".into(),
        tail: "2900".into(),
    });
    asked.push(Query::Lookup {
        entity: "2999".into(),
    });
    asked
}

/// The queue pairs of the proxy serving `backing` in this process (the run's reader holds it,
/// so this is its): (created since it started, existing now).
fn proxy_pairs(backing: &Path) -> (u64, u64) {
    let file = StoreFile::open(backing, &Unguarded).unwrap();
    match controllers::open(QueueBackend::Proxy, &file, None).unwrap() {
        SharedController::Proxy(p) => {
            let c = p.queue_pairs();
            (c.created, c.live)
        }
        SharedController::Device(_) => unreachable!("a proxy-backed run"),
    }
}

/// Opens the run as `gpu` says, its rows streamed (scans and lookups read the store), answers
/// two calls of predictions, and checks that the proxy's queue pairs were all made at the
/// open: `live` of them, none deleted, none new after. Returns the answers.
fn two_calls(run: &Path, backing: &Path, gpu: &GpuOptions, live: u64) -> Vec<legend_query::Answer> {
    let q = QueryRun::open_on(run, None, &Unguarded, Residency::Streamed, gpu).unwrap();
    assert!(q.streamed().is_some(), "{}", q.placement());
    let opened = proxy_pairs(backing);
    assert_eq!(
        opened,
        (live, live),
        "queue pairs (created, existing) after the open ({}): more created than exist means \
         the store was opened more than once",
        q.placement()
    );
    let at = |i: usize| format!("query {}", i + 1);
    let first = q.answer(&queries(), 10, &at).unwrap();
    let second = q.answer(&queries(), 10, &at).unwrap();
    assert_eq!(first, second);
    assert_eq!(
        proxy_pairs(backing),
        opened,
        "the calls made queue pairs: a scan or a lookup opened the store again"
    );
    first
}

#[test]
fn a_queried_run_opens_its_store_and_queue_pairs_once() {
    let dir = tempfile::tempdir().unwrap();
    let (run, backing) = proxy_run(dir.path());
    // On the CPU: the store's one queue pair.
    let answers = two_calls(&run, &backing, &GpuOptions::cpu(), 1);
    // The run, closed, holds nothing: the proxy stopped with its last user, and the answers
    // are those of the run's rows read whole.
    let resident = QueryRun::open(&run, None, &Unguarded, Residency::Resident).unwrap();
    let at = |i: usize| format!("query {}", i + 1);
    assert_eq!(resident.answer(&queries(), 10, &at).unwrap(), answers);
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu/run-all.sh does)"]
fn a_queried_run_on_a_gpu_opens_its_store_and_queue_pairs_once() {
    let dir = tempfile::tempdir().unwrap();
    let (run, backing) = proxy_run(dir.path());
    // The table (3000 rows of 8 floats and a norm: 108 kB) does not fit a budget of a scan's
    // buffers and 64 KiB: rows are looked up through the row cache over the store, whose GPU
    // queue pairs join the store's CPU one.
    let gpu = GpuOptions {
        device: DeviceChoice::Cuda(0),
        budget: Some(legend_cuda::scan::SCAN_WORKING_BYTES + (64 << 10)),
        cache_fraction: 0.25,
    };
    let gpu_pairs = u64::from(legend_cuda::nvme_io::GpuIoOptions::default().queues);
    let on_gpu = two_calls(&run, &backing, &gpu, 1 + gpu_pairs);
    let on_cpu = QueryRun::open(&run, None, &Unguarded, Residency::Resident).unwrap();
    let at = |i: usize| format!("query {}", i + 1);
    assert_eq!(on_cpu.answer(&queries(), 10, &at).unwrap(), on_gpu);
}
