//! Each job's log in the state directory (`jobs/ID.log`, private to the daemon: it may name
//! paths), bounded however long the job runs, and read back from its end.

use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Bytes of a job's log before it moves aside (the `logs` call answers with at most this).
pub const MAX_LOG_BYTES: u64 = 512 << 10;

/// The longest line a job's process may add to its log (longer ones are cut).
pub const MAX_LINE_BYTES: usize = 4 << 10;

/// Where job `id`'s log is, and its older part.
pub fn paths(dir: &Path, id: u64) -> (PathBuf, PathBuf) {
    (
        dir.join(format!("{id}.log")),
        dir.join(format!("{id}.log.1")),
    )
}

/// Appends `text` (one line, cut to [`MAX_LINE_BYTES`]) to job `id`'s log in `dir`, stamped
/// with the time. Past [`MAX_LOG_BYTES`] the log moves to `ID.log.1` (the older part goes) and
/// starts again, so a job's log takes at most twice that.
pub fn append(dir: &Path, id: u64, text: &str) {
    let text = crate::paths::clipped(text.trim_end(), MAX_LINE_BYTES);
    let line = format!("{} {}\n", utc(crate::handover::file_clock_secs()), text);
    let (path, old) = paths(dir, id);
    let full = std::fs::metadata(&path).is_ok_and(|m| m.len() + line.len() as u64 > MAX_LOG_BYTES);
    if full && let Err(e) = std::fs::rename(&path, old) {
        tracing::warn!("job {id}: moving its full log aside: {e}");
    }
    let appended = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(&path)
        .and_then(|mut f| f.write_all(line.as_bytes()));
    if let Err(e) = appended {
        tracing::warn!("job {id}: writing its log: {e}");
    }
}

/// The last `max` bytes of the file at `path` (from a line start), or nothing: only they are
/// read, however long the log has grown.
pub fn tail(path: &Path, max: usize) -> String {
    let Ok(mut file) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = file.metadata().map_or(0, |m| m.len());
    let start = len.saturating_sub(max as u64);
    let mut bytes = Vec::new();
    if file.seek(SeekFrom::Start(start)).is_err()
        || file.take(max as u64).read_to_end(&mut bytes).is_err()
    {
        return String::new();
    }
    let text = String::from_utf8_lossy(&bytes);
    match (start, text.find('\n')) {
        (0, _) | (_, None) => text.into_owned(),
        (_, Some(nl)) => text[nl + 1..].to_owned(),
    }
}

/// Unix time `secs` as `YYYY-MM-DD HH:MM:SS UTC`, for the job logs people read.
pub fn utc(secs: u64) -> String {
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Days since 1970-01-01 to a civil date, in 400-year eras of 146097 days that start on
    // 1 March (so the leap day ends a year).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let mp = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_times_read_as_dates() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(utc(1_795_737_599), "2026-11-26 23:59:59 UTC");
    }

    #[test]
    fn a_log_tail_starts_at_a_line_and_reads_only_the_end() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("1.log");
        let lines: String = (0..100_000).map(|i| format!("line {i}\n")).collect();
        std::fs::write(&path, &lines).unwrap();
        let text = tail(&path, 30);
        assert_eq!(text, "line 99998\nline 99999\n");
        assert_eq!(tail(&path, 1 << 30), lines);
        assert_eq!(tail(&dir.path().join("none"), 30), "");
    }
}
