//! A modelled SSD: the rates and latency the proxy serves commands at, whatever its backing
//! file could do (tmpfs is RAM, not an SSD).
//!
//! Each command is given the time it would finish on the modelled device, on a virtual clock
//! per budget (a token bucket that starts empty and earns no credit while idle): a transfer of
//! `n` bytes occupies its bandwidth budget for `n / rate`, every command takes `1 / iops` of the
//! command budget, and its completion is posted no earlier than when both are through, plus the
//! device's latency (which overlaps across commands, as a device's many flash dies do). Reads
//! and writes either share one budget, as on a consumer SSD whose flash channels serve both,
//! or have one each. The proxy's controller threads hold a command back until then: its backing
//! I/O runs at once, only the completion waits, so a backing file faster than the model serves
//! exactly the model's rates.

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant};

/// The performance of a modelled SSD.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceModel {
    /// Sequential read bandwidth, bytes per second.
    pub read_bytes_per_s: f64,
    /// Sequential write bandwidth, bytes per second.
    pub write_bytes_per_s: f64,
    /// Whether reads and writes share one bandwidth budget (a consumer SSD) or have one each.
    pub shared: bool,
    /// Commands per second at most (0: no cap beyond bandwidth).
    pub iops: f64,
    /// Time from a command's fetch to its completion on an idle device.
    pub latency: Duration,
}

impl DeviceModel {
    /// The Samsung 980 (1 TB, PCIe 3.0 x4) of the Legend paper's experiments: 3.19 GB/s read,
    /// 2.24 GB/s write (the paper's measurement), one budget for both, 500 k IOPS (the
    /// datasheet's 4 KiB random read at queue depth 32), 70 µs latency (its 4 KiB read at
    /// queue depth 1).
    pub const SAMSUNG_980: DeviceModel = DeviceModel {
        read_bytes_per_s: 3.19e9,
        write_bytes_per_s: 2.24e9,
        shared: true,
        iops: 500_000.0,
        latency: Duration::from_micros(70),
    };

    /// Seconds of bandwidth budget `bytes` take.
    fn transfer_s(&self, bytes: u64, write: bool) -> f64 {
        let rate = if write {
            self.write_bytes_per_s
        } else {
            self.read_bytes_per_s
        };
        bytes as f64 / rate
    }
}

/// Presets by name, for [`DeviceModel::from_str`].
const PRESETS: &[(&str, DeviceModel)] = &[("samsung-980", DeviceModel::SAMSUNG_980)];

/// Why a model description was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelError(String);

impl fmt::Display for ModelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ModelError {}

impl FromStr for DeviceModel {
    type Err = ModelError;

    /// A preset (`samsung-980`), optionally followed by changes, or a full description:
    /// `read=3.19,write=2.24,shared=true,iops=500000,latency_us=70` (rates in GB/s; `iops=0`
    /// for no command cap), e.g. `samsung-980,latency_us=0`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |what: String| ModelError(format!("SSD model {s:?}: {what}"));
        let mut parts = s.split(',').map(str::trim);
        let first = parts.next().unwrap_or_default();
        let (mut model, rest): (DeviceModel, Vec<&str>) =
            match PRESETS.iter().find(|(name, _)| *name == first) {
                Some((_, m)) => (*m, parts.collect()),
                None => (
                    DeviceModel {
                        read_bytes_per_s: f64::NAN,
                        write_bytes_per_s: f64::NAN,
                        shared: true,
                        iops: 0.0,
                        latency: Duration::ZERO,
                    },
                    std::iter::once(first).chain(parts).collect(),
                ),
            };
        for kv in rest {
            let (key, value) = kv.split_once('=').ok_or_else(|| {
                err(format!(
                    "{kv:?} is neither a preset ({}) nor key=value",
                    preset_names()
                ))
            })?;
            let number = || -> Result<f64, ModelError> {
                value
                    .parse::<f64>()
                    .ok()
                    .filter(|v| v.is_finite() && *v >= 0.0)
                    .ok_or_else(|| err(format!("{key} = {value:?} is not a number ≥ 0")))
            };
            match key {
                "read" => model.read_bytes_per_s = number()? * 1e9,
                "write" => model.write_bytes_per_s = number()? * 1e9,
                "iops" => model.iops = number()?,
                "latency_us" => model.latency = Duration::from_secs_f64(number()? * 1e-6),
                "shared" => {
                    model.shared = value
                        .parse()
                        .map_err(|_| err(format!("shared = {value:?} is not true or false")))?
                }
                _ => {
                    return Err(err(format!(
                        "unknown key {key:?} (read, write in GB/s; shared; iops; latency_us)"
                    )));
                }
            }
        }
        for (name, rate) in [
            ("read", model.read_bytes_per_s),
            ("write", model.write_bytes_per_s),
        ] {
            if rate.is_nan() {
                return Err(err(format!(
                    "no {name} rate (give {name}=GB/s or a preset)"
                )));
            }
            if rate <= 0.0 {
                return Err(err(format!("{name} rate must be above 0")));
            }
        }
        Ok(model)
    }
}

fn preset_names() -> String {
    PRESETS
        .iter()
        .map(|(n, _)| *n)
        .collect::<Vec<_>>()
        .join(", ")
}

impl fmt::Display for DeviceModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "read={},write={},shared={},iops={},latency_us={}",
            self.read_bytes_per_s / 1e9,
            self.write_bytes_per_s / 1e9,
            self.shared,
            self.iops,
            self.latency.as_secs_f64() * 1e6
        )
    }
}

/// The modelled device's budgets: when each is next free.
#[derive(Debug)]
pub(crate) struct DeviceClock {
    model: DeviceModel,
    /// Bandwidth budgets: reads (and writes when shared), writes.
    bandwidth_free: [Instant; 2],
    commands_free: Instant,
}

impl DeviceClock {
    pub(crate) fn new(model: DeviceModel) -> DeviceClock {
        let now = Instant::now();
        DeviceClock {
            model,
            bandwidth_free: [now; 2],
            commands_free: now,
        }
    }

    /// When a command there to take since `now` (first seen in its SQ) that moves `bytes` (0 for
    /// a Flush) completes on the modelled device; it takes its share of the budgets.
    pub(crate) fn complete_at(&mut self, now: Instant, bytes: u64, write: bool) -> Instant {
        let mut done = now;
        if bytes > 0 {
            let budget = &mut self.bandwidth_free[usize::from(write && !self.model.shared)];
            let start = (*budget).max(now);
            *budget = start + Duration::from_secs_f64(self.model.transfer_s(bytes, write));
            done = *budget;
        }
        if self.model.iops > 0.0 {
            let start = self.commands_free.max(now);
            self.commands_free = start + Duration::from_secs_f64(1.0 / self.model.iops);
            done = done.max(self.commands_free);
        }
        done + self.model.latency
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_and_descriptions_parse_and_bad_ones_say_why() {
        let m: DeviceModel = "samsung-980".parse().unwrap();
        assert_eq!(m, DeviceModel::SAMSUNG_980);
        let m: DeviceModel = "samsung-980, latency_us=0, shared=false".parse().unwrap();
        assert_eq!(m.latency, Duration::ZERO);
        assert!(!m.shared);
        let m: DeviceModel = "read=1.5,write=0.5".parse().unwrap();
        assert_eq!((m.read_bytes_per_s, m.write_bytes_per_s), (1.5e9, 0.5e9));
        assert_eq!(m.to_string().parse::<DeviceModel>().unwrap(), m);
        for (bad, why) in [
            ("samsung-990", "neither a preset (samsung-980)"),
            ("read=1", "no write rate"),
            ("read=1,write=0", "write rate must be above 0"),
            ("read=x,write=1", "read = \"x\" is not a number"),
            ("read=1,write=1,speed=3", "unknown key \"speed\""),
            ("read=1,write=1,shared=yes", "not true or false"),
        ] {
            let e = bad.parse::<DeviceModel>().unwrap_err().to_string();
            assert!(e.contains(why) && e.contains(bad), "{bad}: {e}");
        }
    }

    #[test]
    fn budgets_serialise_transfers_and_commands() {
        let model = DeviceModel {
            read_bytes_per_s: 1e9,
            write_bytes_per_s: 0.5e9,
            shared: true,
            iops: 1000.0,
            latency: Duration::from_micros(10),
        };
        let t0 = Instant::now();
        let mut c = DeviceClock::new(model);
        c.bandwidth_free = [t0; 2];
        c.commands_free = t0;
        // 1 MB read: 1 ms of bandwidth; a second right after queues behind it.
        let us = |t: Instant| t.duration_since(t0).as_micros();
        assert_eq!(us(c.complete_at(t0, 1_000_000, false)), 1_010);
        assert_eq!(us(c.complete_at(t0, 1_000_000, false)), 2_010);
        // A write shares the budget at its own rate: 2 ms more.
        assert_eq!(us(c.complete_at(t0, 1_000_000, true)), 4_010);
        // Small commands are bound by the command rate (1 ms each here).
        let mut small = DeviceClock::new(model);
        small.bandwidth_free = [t0; 2];
        small.commands_free = t0;
        assert_eq!(us(small.complete_at(t0, 512, false)), 1_010);
        assert_eq!(us(small.complete_at(t0, 512, false)), 2_010);
        // Separate budgets: a write does not wait for reads.
        let mut split = DeviceClock::new(DeviceModel {
            shared: false,
            iops: 0.0,
            ..model
        });
        split.bandwidth_free = [t0; 2];
        assert_eq!(us(split.complete_at(t0, 1_000_000, false)), 1_010);
        assert_eq!(us(split.complete_at(t0, 1_000_000, true)), 2_010);
        // Idle time earns no credit: a command after a pause starts then.
        let later = t0 + Duration::from_secs(1);
        assert_eq!(us(split.complete_at(later, 1_000_000, false)), 1_001_010);
    }
}
