//! A job as the state directory keeps it (`jobs/ID.json`): its size bounded for every field,
//! written durably, read back within that bound, and records of the earlier format upgraded
//! (or set aside, saying why, when they cannot be).

use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;

use legend_daemon_api::JobInfo;
use serde::{Deserialize, Serialize};

use super::table::{GPU_SET_QUEUE, gpu_queue};
use crate::extents::RecordedStore;
use crate::paths::{DirId, clipped, normalise_spec};

/// The format of the job records this daemon writes: 2 added the submitter's gid and group
/// standing, the run's identity, the store recorded at submission, the job's process. Records
/// without one are of the first format, which lacked those (they are read with them empty);
/// a record of a later format is refused at start, naming it.
pub const RECORD_FORMAT: u32 = 2;

/// The most a record may take on disk. Its fields are bounded each: a configuration and its
/// `--set` values 64 KiB, three paths of 4 KiB, an error of [`MAX_ERROR_BYTES`], a result of
/// [`MAX_RESULT_BYTES`]; JSON's escapes and the rest fit the remainder.
pub const MAX_RECORD_BYTES: u64 = 256 << 10;

/// The longest error a record keeps.
pub const MAX_ERROR_BYTES: usize = 4 << 10;

/// The largest result (metrics) a record keeps, serialised.
pub const MAX_RESULT_BYTES: usize = 16 << 10;

/// A job as the state directory keeps it.
#[derive(Clone, Serialize, Deserialize)]
pub struct Record {
    /// [`RECORD_FORMAT`] when written.
    #[serde(default = "first_format")]
    pub format: u32,
    /// The job as reported.
    pub info: JobInfo,
    /// `cpu`, `cuda:N`, `serve`, or `cuda` for a job on several GPUs ([`GPU_SET_QUEUE`]).
    ///
    /// [`GPU_SET_QUEUE`]: super::table::GPU_SET_QUEUE
    pub queue: String,
    /// GPUs the job trains on at once (`training.gpus`; 1 for every job outside the `cuda`
    /// queue).
    #[serde(default = "one_gpu")]
    pub gpus: u32,
    /// The GPUs (the daemon's ordinals) a job of the `cuda` queue was given when it started;
    /// empty while it is queued.
    #[serde(default)]
    pub devices: Vec<u32>,
    /// A train job's run directory has been made: after a restart the job continues it (the
    /// spec stays as submitted, `resume` included).
    #[serde(default)]
    pub run_made: bool,
    /// Daemon starts that found this job running: the daemon died under it (killed, a crash,
    /// a power cut). After a few it is failed instead of started again, so a job that is
    /// itself what kills the daemon cannot keep it down.
    #[serde(default)]
    pub interruptions: u32,
    /// The gid the submitter submitted with (their process's; a job runs with it).
    #[serde(default)]
    pub gid: Option<u32>,
    /// The submitter was in the admin group (their jobs may take the reserved slots).
    #[serde(default)]
    pub admin: bool,
    /// The run directory the job works on, by device and inode: one run whatever path reaches
    /// it (none yet for a new run).
    #[serde(default)]
    pub run_id: Option<DirId>,
    /// The store on a namespace the run names, as recorded at submission (none: no such
    /// store): its `run.toml` must still say so when the job starts.
    #[serde(default)]
    pub expect: Option<RecordedStore>,
    /// The NVMe device node the job holds (one job at a time per controller).
    #[serde(default)]
    pub device_node: Option<String>,
}

fn first_format() -> u32 {
    1
}

fn one_gpu() -> u32 {
    1
}

impl Record {
    /// The queues the job takes a slot of while it runs: its own, or each of its GPUs'.
    pub fn running_queues(&self) -> Vec<String> {
        if self.devices.is_empty() {
            vec![self.queue.clone()]
        } else {
            self.devices.iter().map(|&d| gpu_queue(d)).collect()
        }
    }

    /// Where the job runs, as `jobs` and `status` show it: its queue, its GPUs once it has
    /// them (`cuda:0,2`), or how many it waits for (`2 GPUs`).
    pub fn device_label(&self) -> String {
        match (self.queue == GPU_SET_QUEUE, self.devices.as_slice()) {
            (false, _) => self.queue.clone(),
            (true, []) => format!("{} GPUs", self.gpus),
            (true, devices) => {
                let ordinals: Vec<String> = devices.iter().map(u32::to_string).collect();
                format!("cuda:{}", ordinals.join(","))
            }
        }
    }

    /// Bounds every field that a job's process or an old record could have made long, and
    /// normalises the paths of the spec (a record written before paths were normalised).
    pub fn bound(&mut self) -> Result<(), String> {
        self.gpus = self.gpus.max(1);
        let info = &mut self.info;
        normalise_spec(&mut info.spec)?;
        if let Some(e) = &mut info.error {
            *e = clipped(e, MAX_ERROR_BYTES);
        }
        if let Some(d) = &mut info.device {
            *d = clipped(d, 128);
        }
        if let Some(r) = &info.result
            && serde_json::to_vec(r).map_or(0, |b| b.len()) > MAX_RESULT_BYTES
        {
            info.result = Some(serde_json::json!({
                "note": format!("the job's result took more than {MAX_RESULT_BYTES} bytes: not kept")
            }));
        }
        Ok(())
    }

    /// Reads the record at `path`: its size checked before it is read, its format and its
    /// fields' bounds after. `Err` names what is wrong.
    pub fn read(path: &Path) -> Result<Record, String> {
        let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
        let len = file.metadata().map_err(|e| e.to_string())?.len();
        if len > MAX_RECORD_BYTES {
            return Err(format!(
                "{len} bytes, more than a record may take ({MAX_RECORD_BYTES})"
            ));
        }
        let mut bytes = Vec::new();
        file.take(MAX_RECORD_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| e.to_string())?;
        let mut record: Record =
            serde_json::from_slice(&bytes).map_err(|e| format!("not a job record: {e}"))?;
        if record.format > RECORD_FORMAT {
            return Err(format!(
                "a job record of format {}, written by a newer legendd; this one reads formats \
                 up to {RECORD_FORMAT} (run the newer legendd, or move the record away)",
                record.format
            ));
        }
        record.bound()?;
        record.format = RECORD_FORMAT;
        Ok(record)
    }

    /// The record serialised, as it is written.
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec_pretty(self).expect("a job record serializes")
    }
}

/// Creates (or truncates) `path`, private to the daemon whatever the umask, with `bytes` in it,
/// on disk when this returns.
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

/// Writes `bytes` to `path` through a synced temporary file and a rename, then syncs the
/// directory: a crash keeps the old contents or the new, and the new are durable.
pub fn write_durably(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    write_private(&tmp, bytes)?;
    std::fs::rename(&tmp, path)?;
    std::fs::File::open(path.parent().unwrap_or(Path::new(".")))?.sync_all()
}

/// Makes `dir` (and its parents) if missing, private to the daemon (0700) whatever the umask.
pub fn private_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}
