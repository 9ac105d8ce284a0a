//! A serve job: a run's tables held in this process (the host's memory, or a GPU's), answering
//! the queries the daemon forwards until it is stopped. At most [`MAX_IN_FLIGHT`] requests are
//! answered at once; each is read one query at a time (never past [`MAX_QUERIES`]) and refused
//! before anything is computed when its answers could not fit a frame.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use legend_daemon_api::{
    ErrorCode, JobSpec, MAX_ANSWER_HITS, MAX_FRAME, MAX_QUERIES, MAX_TOP, Queries, Reply,
};
use legend_engine::config::DeviceChoice;
use legend_query::{GpuOptions, Query, QueryRun};

use super::read::open_run;
use super::{Outbox, chain, check_store};
use crate::access::JobGuard;
use crate::channel::{Ended, FromJob, JobStart, Serving};

/// Requests answered at once; more are `unavailable` (each already uses every core).
pub const MAX_IN_FLIGHT: usize = 8;

/// Bytes one query of a request may take.
const MAX_QUERY_BYTES: usize = 64 << 10;

/// Bytes an answer takes besides its hits and rows (its names, kind, score).
const ANSWER_BYTES: usize = 256;

/// Bytes a hit takes besides its label (`{"id":4294967295,"label":"","score":-1.2345678e-38},`).
const HIT_BYTES: usize = 64;

/// Bytes a float of a looked-up row takes at most in JSON.
const FLOAT_BYTES: usize = 16;

/// How large answers can get: from the run's longest label and its rows' width.
struct AnswerBound {
    label: usize,
    dim: usize,
}

impl AnswerBound {
    /// The most bytes the answers to `queries` can take.
    fn bytes(&self, queries: &[Query]) -> usize {
        let names = 3 * (self.label + 32);
        queries
            .iter()
            .map(|q| {
                ANSWER_BYTES
                    + names
                    + match q {
                        Query::Predict { top, .. } | Query::Neighbors { top, .. } => {
                            top.saturating_mul(HIT_BYTES + self.label)
                        }
                        Query::Score { .. } => 0,
                        Query::Lookup { .. } => self.dim * FLOAT_BYTES,
                    }
            })
            .fold(0, usize::saturating_add)
    }
}

/// The entities `queries` ask for together.
fn hits_asked(queries: &[Query]) -> usize {
    queries
        .iter()
        .map(|q| match q {
            Query::Predict { top, .. } | Query::Neighbors { top, .. } => *top,
            _ => 0,
        })
        .fold(0, usize::saturating_add)
}

fn error(code: ErrorCode, message: impl Into<String>) -> Reply {
    Reply::Error {
        code,
        message: message.into(),
    }
}

/// Loads the run and answers until stopped.
pub fn serve(
    start: &JobStart,
    guard: &JobGuard,
    out: &Outbox,
    stop: &AtomicBool,
    asked: Receiver<(u64, Queries)>,
) -> Result<Ended, String> {
    let JobSpec::Serve { run, .. } = &start.spec else {
        unreachable!("a serve job");
    };
    let placed = start
        .serve
        .as_ref()
        .ok_or("a serve job without its placement")?;
    open_run(run, start, guard)?;
    let started = Instant::now();
    let device: DeviceChoice = placed.device.parse()?;
    let options = GpuOptions {
        budget: placed.gpu_budget,
        cache_fraction: placed.cache_fraction,
        ..GpuOptions::on(device)
    };
    // The run keeps the guard: a streamed run reads through it for as long as it serves.
    let reads: Arc<dyn legend_fs::Guard> = Arc::new(guard.clone());
    // The record the run is opened by is the one checked: read once (a submitter's rewrite
    // after `open_run`'s check could otherwise point the store elsewhere).
    let expect = |meta: &legend_engine::run::RunMeta| check_store(meta, start.expect.as_ref());
    let loaded = QueryRun::open_served(run, None, reads, &options, placed.host_limit, &expect)
        .map_err(|e| chain(&e))?;
    let model = loaded.model();
    let gpu_bytes = model.gpu_bytes();
    let on = match (gpu_bytes, device) {
        (0, _) | (_, DeviceChoice::Cpu) => "cpu".to_owned(),
        (_, DeviceChoice::Cuda(n)) => format!("cuda:{n}"),
        (_, DeviceChoice::Auto) => "cuda:0".to_owned(),
    };
    // Mapped where only the job's own user could change a file; what others may write is
    // read, checked and kept as read (legend-query's `QueryRun::open_served`).
    let copied = loaded.copied();
    let files = if copied.is_empty() {
        "no file copied (mapped where their layout allows)".to_owned()
    } else {
        format!("read into memory, not mapped: {}", copied.join("; "))
    };
    out.log(format!(
        "serving {}: {} MiB of tables in host memory (and at most {} MiB while streaming), {} \
         MiB on the GPU; answering on {}; {files}; loaded in {:.1} s",
        run.display(),
        model.resident_bytes() >> 20,
        model.stream_bytes() >> 20,
        gpu_bytes >> 20,
        loaded.placement(),
        started.elapsed().as_secs_f64()
    ));
    let serving = |loaded: &QueryRun| Serving {
        placement: loaded.placement().to_owned(),
        streamed: loaded.streamed().map(str::to_owned),
        host_bytes: loaded.model().resident_bytes() as u64,
        stream_bytes: loaded.model().stream_bytes(),
        gpu_bytes,
        device: on.clone(),
        cache: loaded
            .model()
            .cache_stats()
            .map(|c| (c.hit_rate(), c.misses)),
    };
    out.send(&FromJob::Serving(Box::new(serving(&loaded))));
    let bound = AnswerBound {
        label: loaded.longest_label(),
        dim: model.dim(),
    };
    let in_flight = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        loop {
            let (id, queries) = match asked.recv_timeout(Duration::from_millis(200)) {
                Ok(q) => q,
                Err(RecvTimeoutError::Timeout) if !stop.load(Ordering::Relaxed) => continue,
                Err(_) => break,
            };
            if stop.load(Ordering::Relaxed) {
                break;
            }
            if in_flight.fetch_add(1, Ordering::Relaxed) >= MAX_IN_FLIGHT {
                in_flight.fetch_sub(1, Ordering::Relaxed);
                let why = format!("the run answers {MAX_IN_FLIGHT} requests at once; try again");
                send_reply(out, id, 0, &error(ErrorCode::Unavailable, why));
                continue;
            }
            let (loaded, bound, in_flight) = (&loaded, &bound, &in_flight);
            scope.spawn(move || {
                let (n, reply) = answer(loaded, bound, queries.text());
                send_reply(out, id, n, &reply);
                if loaded.model().cache_stats().is_some() {
                    out.send(&FromJob::Serving(Box::new(serving(loaded))));
                }
                in_flight.fetch_sub(1, Ordering::Relaxed);
            });
        }
    });
    Ok(Ended::Done(None))
}

fn send_reply(out: &Outbox, id: u64, queries: u32, reply: &Reply) {
    let bytes = serde_json::to_vec(reply).expect("replies serialise");
    if bytes.len() > MAX_FRAME {
        let why = format!(
            "the answers take {} bytes, over the {MAX_FRAME}-byte frame limit: ask fewer \
             queries or fewer entities at once",
            bytes.len()
        );
        let small = serde_json::to_vec(&error(ErrorCode::Refused, why)).expect("serialises");
        out.answer(id, 0, &small);
    } else {
        out.answer(id, queries, &bytes);
    }
}

/// Answers a request's queries (a JSON list): how many were answered, and the reply.
fn answer(run: &QueryRun, bound: &AnswerBound, text: &str) -> (u32, Reply) {
    let raw = match legend_daemon_api::fields::raw_list(text, MAX_QUERIES) {
        Ok(raw) if !raw.is_empty() => raw,
        Ok(_) => {
            let why = format!("no queries: send 1 to {MAX_QUERIES} in a request");
            return (0, error(ErrorCode::BadRequest, why));
        }
        Err(e) => {
            let why = format!("queries: {e} (send 1 to {MAX_QUERIES} in a request)");
            return (0, error(ErrorCode::BadRequest, why));
        }
    };
    let mut asked = Vec::with_capacity(raw.len());
    for (i, q) in raw.iter().enumerate() {
        if q.get().len() > MAX_QUERY_BYTES {
            let why = format!(
                "query {}: {} bytes (at most {MAX_QUERY_BYTES})",
                i + 1,
                q.get().len()
            );
            return (0, error(ErrorCode::BadRequest, why));
        }
        match serde_json::from_str::<Query>(q.get()) {
            Ok(q) => asked.push(q),
            Err(e) => {
                return (
                    0,
                    error(ErrorCode::BadRequest, format!("query {}: {e}", i + 1)),
                );
            }
        }
    }
    drop(raw);
    let hits = hits_asked(&asked);
    let bytes = bound.bytes(&asked);
    if hits > MAX_ANSWER_HITS || bytes > MAX_FRAME - 1024 {
        let why = format!(
            "these {} queries ask for {hits} entities, whose answers could take {} KiB (labels of \
             up to {} bytes): at most {MAX_ANSWER_HITS} entities and {} KiB of answers go in a \
             request; ask fewer queries or fewer entities (top) at once",
            asked.len(),
            bytes >> 10,
            bound.label,
            MAX_FRAME >> 10
        );
        return (0, error(ErrorCode::Refused, why));
    }
    let started = Instant::now();
    match run.answer(&asked, MAX_TOP, &|i| format!("query {}", i + 1)) {
        Ok(answers) => (
            answers.len() as u32,
            Reply::Answers {
                answers: answers
                    .iter()
                    .map(|a| serde_json::to_value(a).expect("answers serialise"))
                    .collect(),
                seconds: started.elapsed().as_secs_f64(),
            },
        ),
        // The chain: a store's failure ends at the OS's words (its reason is the source).
        Err(e) => (0, error(ErrorCode::Refused, chain(&e))),
    }
}
