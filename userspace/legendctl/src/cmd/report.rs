//! `legendctl report`: a timeline of compute vs I/O per swap, from a run's `metrics.jsonl`.
//!
//! The SVG is written by hand: lanes on one time axis, like Figures 8 and 9 of the Legend
//! paper. The compute lane shows, per swap, the compute overlapped with the swap's I/O, the time
//! compute waited for it and the compute after it; the I/O lane shows the swap's write-back and
//! read from its start; for swaps the GPU I/O kernels moved, a third lane shows each of their
//! launches (commands submitted to the last completion). An epoch trained on K GPUs
//! (`training.gpus`) draws a lane a GPU instead: per round, its hand-over, its training and its
//! wait at the round gate. A table gives every epoch's loss, time, I/O time, wait and hidden
//! I/O share, and two charts every epoch's loss and training rate.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use legend_engine::workers::WorkersReport;
use legend_engine::{EpochReport as Epoch, IoDirection};

/// Arguments of `legendctl report`.
#[derive(clap::Args)]
pub struct Args {
    /// Training run directory (the one holding metrics.jsonl).
    #[arg(value_name = "RUN")]
    run: PathBuf,
    /// Output file: .svg, or .html for a page with the SVG inline [default: RUN/report.svg].
    #[arg(short = 'o', long = "out", value_name = "FILE")]
    out: Option<PathBuf>,
    /// Epoch to draw [default: the last one recorded].
    #[arg(long, value_name = "K")]
    epoch: Option<u32>,
}

/// The report's view of an epoch record (legend-engine's `EpochReport`, read back).
trait EpochView {
    fn check(&self) -> anyhow::Result<()>;
    fn hidden(&self) -> Option<f64>;
    fn fill(&self) -> (f64, f64);
    fn summary(&self) -> String;
}

impl EpochView for Epoch {
    fn check(&self) -> anyhow::Result<()> {
        let mut times = vec![self.seconds, self.io_s, self.io_wait_s];
        for s in &self.swaps {
            times.extend([
                s.start_s,
                s.io_s,
                s.overlap_compute_s,
                s.wait_s,
                s.after_compute_s,
            ]);
            times.extend(s.io_kernels.iter().flat_map(|k| [k.start_s, k.seconds]));
        }
        match times.iter().find(|t| !(t.is_finite() && **t >= 0.0)) {
            Some(t) => bail!(
                "epoch {}: time {t} is not a non-negative number",
                self.epoch
            ),
            None => Ok(()),
        }
    }

    /// Share of the I/O time that compute did not wait for; `None` without I/O.
    fn hidden(&self) -> Option<f64> {
        (self.io_s > 0.0).then(|| (1.0 - self.io_wait_s / self.io_s).clamp(0.0, 1.0))
    }

    /// I/O and wait outside the swaps: the initial buffer fill.
    fn fill(&self) -> (f64, f64) {
        let io: f64 = self.swaps.iter().map(|s| s.io_s).sum();
        let wait: f64 = self.swaps.iter().map(|s| s.wait_s).sum();
        ((self.io_s - io).max(0.0), (self.io_wait_s - wait).max(0.0))
    }

    fn summary(&self) -> String {
        let hidden = self.hidden().map_or("no I/O".into(), |h| {
            format!("{:.1}% of I/O hidden", 100.0 * h)
        });
        format!(
            "epoch {}: {:.3} s, {} swaps, I/O {:.3} s ({}), compute waited {:.3} s, {hidden}",
            self.epoch,
            self.seconds,
            self.swaps.len(),
            self.io_s,
            bytes(self.bytes_read + self.bytes_written),
            self.io_wait_s
        )
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let path = args.run.join("metrics.jsonl");
    let epochs = read_metrics(&path)?;
    let chosen = match args.epoch {
        // A resumed run may repeat an epoch; its last record is the one that counted.
        Some(k) => epochs
            .iter()
            .rev()
            .find(|e| e.epoch == k)
            .with_context(|| {
                let have: Vec<String> = epochs.iter().map(|e| e.epoch.to_string()).collect();
                format!(
                    "{}: no epoch {k} (recorded: {})",
                    path.display(),
                    have.join(", ")
                )
            })?,
        None => epochs
            .last()
            .expect("read_metrics returns at least one epoch"),
    };
    let out = args.out.unwrap_or_else(|| args.run.join("report.svg"));
    let html = match out.extension().and_then(|e| e.to_str()) {
        Some("svg") => false,
        Some("html" | "htm") => true,
        _ => bail!("{}: the output must end in .svg or .html", out.display()),
    };
    let title = format!("{}: epoch {}", args.run.display(), chosen.epoch);
    let svg = render(&title, chosen, &epochs)?;
    let text = if html {
        format!(
            "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{}</title></head>\n<body>\n{svg}</body></html>\n",
            escape(&title)
        )
    } else {
        svg
    };
    std::fs::write(&out, text).with_context(|| format!("writing {}", out.display()))?;
    outln!("{}", headline(chosen))?;
    outln!("wrote {}", out.display())?;
    Ok(())
}

/// Epoch records in file order; the final-evaluation line is skipped.
fn read_metrics(path: &Path) -> anyhow::Result<Vec<Epoch>> {
    let text = std::fs::read_to_string(path).with_context(|| {
        format!(
            "reading {} (is {} a training run directory?)",
            path.display(),
            path.parent().unwrap_or(path).display()
        )
    })?;
    let mut epochs = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{}:{}", path.display(), i + 1);
        let value: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("{}: not JSON", at()))?;
        if value.get("final").and_then(serde_json::Value::as_bool) == Some(true) {
            continue;
        }
        let epoch: Epoch = serde_json::from_value(value)
            .with_context(|| format!("{}: not an epoch record of legendctl train", at()))?;
        epoch.check().with_context(at)?;
        epochs.push(epoch);
    }
    if epochs.is_empty() {
        bail!(
            "{}: no epoch records (empty, or no epoch has finished yet)",
            path.display()
        );
    }
    Ok(epochs)
}

const WIDTH: f64 = 1200.0;
const LEFT: f64 = 110.0;
const RIGHT: f64 = 30.0;
const LANE: f64 = 36.0;
const COMPUTE_Y: f64 = 78.0;
const IO_Y: f64 = COMPUTE_Y + LANE + 10.0;
const ROW: f64 = 18.0;

/// The lanes (name and top) and where the parts below them go.
struct Layout {
    lanes: Vec<(String, f64)>,
    kernels_y: Option<f64>,
    axis_y: f64,
    legend_y: f64,
    table_y: f64,
}

impl Layout {
    /// One trainer's lanes: compute, I/O, and the I/O kernels' with `kernels`.
    fn new(kernels: bool) -> Layout {
        let mut lanes = vec![("compute".to_owned(), COMPUTE_Y), ("I/O".to_owned(), IO_Y)];
        let kernels_y = kernels.then_some(IO_Y + LANE + 10.0);
        if let Some(y) = kernels_y {
            lanes.push(("I/O kernels".to_owned(), y));
        }
        Layout::below(lanes, kernels_y, if kernels { 3 } else { 2 })
    }

    /// A lane a worker of `workers`, named by its device.
    fn workers(workers: &WorkersReport) -> Layout {
        let lanes = (0..workers.gpus as usize)
            .map(|g| {
                let device = workers.devices.get(g).map_or("?", String::as_str);
                // The ordinal only: the model is in the summary line.
                let name = device.split(" (").next().unwrap_or(device);
                (format!("{g}: {name}"), COMPUTE_Y + g as f64 * (LANE + 10.0))
            })
            .collect();
        Layout::below(lanes, None, 1)
    }

    fn below(lanes: Vec<(String, f64)>, kernels_y: Option<f64>, legend_rows: usize) -> Layout {
        let last = lanes.last().map_or(COMPUTE_Y, |(_, y)| *y);
        let axis_y = last + LANE + 8.0;
        let legend_y = axis_y + 44.0;
        Layout {
            lanes,
            kernels_y,
            axis_y,
            legend_y,
            table_y: legend_y + 20.0 * legend_rows as f64 + 16.0,
        }
    }
}
/// Epochs listed in the table; a long run shows its latest ones.
const TABLE_ROWS: usize = 30;

/// Fill colours by segment class; wait is the only warm colour so a glance finds it.
const STYLE: &str = "text{font-family:sans-serif;font-size:13px;fill:#222}\
.title{font-size:16px;font-weight:bold}.small{font-size:11px;fill:#555}\
.mono{font-family:monospace;font-size:12px}.chosen{font-weight:bold}\
.overlap{fill:#4f9d69}.after{fill:#2f6db5}.initial{fill:#a9b7c6}\
.wait,.fill-wait{fill:#d9453d}.io{fill:#f0a43a}.fill{fill:#f6d19b}\
.kwrite{fill:#a0522d}.kread{fill:#7b5ea7}.handover{fill:#8e6bbf}\
.sep{stroke:#fff;stroke-width:1}.grid{stroke:#ddd;stroke-width:1}.axis{stroke:#444;stroke-width:1}\
.frame{fill:none;stroke:#bbb;stroke-width:1}.line{fill:none;stroke-width:2}\
.loss{stroke:#2f6db5}.rate{stroke:#4f9d69}.pt{fill:#222}";

/// Where a swap's I/O began on the timeline: its read ran ahead of the swap with
/// `storage.read_ahead` (runs recorded before it have no such field: the swap's start).
fn io_start(sw: &legend_engine::SwapReport) -> f64 {
    sw.io_start_s.unwrap_or(sw.start_s)
}

/// The timeline of `epoch` and the table of `all`, as a standalone SVG document.
fn render(title: &str, epoch: &Epoch, all: &[Epoch]) -> anyhow::Result<String> {
    let workers = epoch.workers.as_ref().filter(|w| w.gpus > 1);
    let span = match workers {
        Some(w) => rounds_span(w).max(epoch.seconds),
        None => epoch.swaps.iter().fold(epoch.seconds, |m, s| {
            let kernels = s.io_kernels.iter().map(|k| k.start_s + k.seconds);
            kernels
                .fold(m, f64::max)
                .max(io_start(s) + s.io_s)
                .max(s.start_s + s.overlap_compute_s + s.wait_s + s.after_compute_s)
        }),
    };
    let span = if span > 0.0 { span } else { 1.0 };
    let scale = Scale((WIDTH - LEFT - RIGHT) / span);
    let shown = &all[all.len().saturating_sub(TABLE_ROWS)..];
    let kernels = epoch.swaps.iter().any(|sw| !sw.io_kernels.is_empty());
    let layout = match workers {
        Some(w) => Layout::workers(w),
        None => Layout::new(kernels),
    };
    let charts_y = layout.table_y + ROW * (shown.len() as f64 + 1.0) + 36.0;
    let height = charts_y + CHART_H + 40.0;
    let mut s = String::new();
    writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}">"#
    )?;
    writeln!(s, "<style>{STYLE}</style>")?;
    writeln!(s, r##"<rect width="100%" height="100%" fill="#fff"/>"##)?;
    let what = match workers {
        Some(w) => format!("{} GPUs per round", w.gpus),
        None => "compute vs I/O per swap".to_owned(),
    };
    let summary = headline(epoch);
    writeln!(
        s,
        r#"<text class="title" x="16" y="26">{}: {what}</text>"#,
        escape(title)
    )?;
    writeln!(s, r#"<text x="16" y="48">{}</text>"#, escape(&summary))?;
    // Grid and axis first, so the lanes draw over the grid lines.
    axis(&mut s, &scale, span, &layout)?;
    match workers {
        Some(w) => {
            workers_timeline(&mut s, w, &scale, &layout)?;
            workers_legend(&mut s, layout.legend_y)?;
        }
        None => {
            timeline(&mut s, epoch, &scale, layout.kernels_y)?;
            legend(&mut s, kernels, layout.legend_y)?;
        }
    }
    table(&mut s, epoch, all, shown, layout.table_y)?;
    epoch_charts(&mut s, all, charts_y)?;
    writeln!(s, "</svg>")?;
    Ok(s)
}

/// The epoch in a line: its workers' figures when K GPUs trained it, its swaps' otherwise.
fn headline(epoch: &Epoch) -> String {
    match epoch.workers.as_ref().filter(|w| w.gpus > 1) {
        Some(w) => format!(
            "epoch {}: {:.3} s; {}",
            epoch.epoch,
            epoch.seconds,
            w.describe()
        ),
        None => epoch.summary(),
    }
}

/// Seconds of the workers' rounds end to end: each round ends when its last GPU passes the
/// gate.
fn rounds_span(w: &WorkersReport) -> f64 {
    w.rounds
        .iter()
        .map(|round| {
            round
                .iter()
                .map(|g| g.handover_s + g.compute_s + g.wait_s)
                .fold(0.0, f64::max)
        })
        .sum()
}

/// A lane a GPU: per round, its hand-over, its training and its wait at the round gate; the
/// rounds' boundaries across the lanes.
fn workers_timeline(
    s: &mut String,
    w: &WorkersReport,
    scale: &Scale,
    layout: &Layout,
) -> std::fmt::Result {
    let mut start = 0.0;
    for (r, round) in w.rounds.iter().enumerate() {
        let mut end: f64 = start;
        for (g, gpu) in round.iter().enumerate() {
            let Some((name, y)) = layout.lanes.get(g) else {
                break;
            };
            writeln!(
                s,
                "<g><title>round {}, {}: moved partitions {:.3} s, trained {:.3} s ({} edges), waited {:.3} s at the gate</title>",
                r + 1,
                escape(name),
                gpu.handover_s,
                gpu.compute_s,
                gpu.edges,
                gpu.wait_s
            )?;
            let mut t = start;
            for (class, dt) in [
                ("handover", gpu.handover_s),
                ("after", gpu.compute_s),
                ("wait", gpu.wait_s),
            ] {
                scale.rect(s, class, t, dt, *y)?;
                t += dt;
            }
            writeln!(s, "</g>")?;
            end = end.max(t);
        }
        start = end;
        writeln!(
            s,
            r#"<line class="sep" x1="{0:.2}" y1="{COMPUTE_Y}" x2="{0:.2}" y2="{1}"/>"#,
            scale.x(start),
            layout.axis_y - 8.0
        )?;
    }
    Ok(())
}

/// The key of the workers' lanes.
fn workers_legend(s: &mut String, legend_y: f64) -> std::fmt::Result {
    key_row(
        s,
        "each GPU",
        &[
            ("handover", "handing partitions over (NCCL)"),
            ("after", "training its buckets"),
            ("wait", "waiting at the round gate"),
        ],
        legend_y,
    )
}

/// The timeline's scale: pixels a second, from [`LEFT`].
struct Scale(f64);

impl Scale {
    /// The x of time `t`.
    fn x(&self, t: f64) -> f64 {
        LEFT + t * self.0
    }

    /// A lane's segment of class `class` from `t0` for `dt` seconds, at height `y`.
    fn rect(&self, s: &mut String, class: &str, t0: f64, dt: f64, y: f64) -> std::fmt::Result {
        writeln!(
            s,
            r#"<rect class="{class}" x="{:.2}" y="{y}" width="{:.2}" height="{LANE}"/>"#,
            self.x(t0),
            dt * self.0
        )
    }
}

/// The time axis with its grid, and the lanes' names.
fn axis(s: &mut String, scale: &Scale, span: f64, layout: &Layout) -> std::fmt::Result {
    let axis_y = layout.axis_y;
    let step = tick_step(span);
    let decimals = (-step.log10()).ceil().max(0.0) as usize;
    let ticks = (span / step).floor() as u32;
    for k in 0..=ticks {
        let t = f64::from(k) * step;
        writeln!(
            s,
            r#"<line class="grid" x1="{0:.2}" y1="{1}" x2="{0:.2}" y2="{axis_y}"/><text class="small" x="{0:.2}" y="{2}" text-anchor="middle">{t:.decimals$}</text>"#,
            scale.x(t),
            COMPUTE_Y - 6.0,
            axis_y + 16.0
        )?;
    }
    writeln!(
        s,
        r#"<line class="axis" x1="{LEFT}" y1="{axis_y}" x2="{}" y2="{axis_y}"/><text class="small" x="{}" y="{}" text-anchor="end">seconds from the epoch start</text>"#,
        WIDTH - RIGHT,
        WIDTH - RIGHT,
        axis_y + 32.0
    )?;
    for (label, y) in &layout.lanes {
        writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="end">{}</text>"#,
            LEFT - 10.0,
            y + LANE / 2.0 + 5.0,
            escape(label)
        )?;
    }
    Ok(())
}

/// The lanes of `epoch`: the buffer fill, each swap's compute and I/O (and its I/O kernels'
/// launches, in the lane at `kernels_y`), the swap boundaries.
fn timeline(
    s: &mut String,
    epoch: &Epoch,
    scale: &Scale,
    kernels_y: Option<f64>,
) -> std::fmt::Result {
    // Before the first swap: the buffer fill (its I/O and the wait for it) and the initial buckets.
    let (fill_io, fill_wait) = epoch.fill();
    let first = epoch.swaps.first().map_or(epoch.seconds, |sw| sw.start_s);
    writeln!(
        s,
        "<g><title>before the first swap: buffer fill {fill_io:.3} s of I/O, waited {fill_wait:.3} s; initial buckets until {first:.3} s</title>"
    )?;
    scale.rect(s, "fill-wait", 0.0, fill_wait.min(first), COMPUTE_Y)?;
    scale.rect(
        s,
        "initial",
        fill_wait.min(first),
        (first - fill_wait).max(0.0),
        COMPUTE_Y,
    )?;
    scale.rect(s, "fill", 0.0, fill_io, IO_Y)?;
    writeln!(s, "</g>")?;
    for (i, sw) in epoch.swaps.iter().enumerate() {
        swap(s, i, sw, scale, kernels_y)?;
    }
    // Swap boundaries, where they are far enough apart to tell from the segments.
    if epoch.swaps.len() as f64 * 4.0 <= WIDTH - LEFT - RIGHT {
        for sw in &epoch.swaps {
            writeln!(
                s,
                r#"<line class="sep" x1="{0:.2}" y1="{COMPUTE_Y}" x2="{0:.2}" y2="{1}"/>"#,
                scale.x(sw.start_s),
                COMPUTE_Y + LANE
            )?;
        }
    }
    Ok(())
}

/// Swap `i`'s segments: its compute, its I/O, its I/O kernels' launches.
fn swap(
    s: &mut String,
    i: usize,
    sw: &legend_engine::SwapReport,
    scale: &Scale,
    kernels_y: Option<f64>,
) -> std::fmt::Result {
    writeln!(
        s,
        "<g><title>swap {}: write back p{}, read p{} ({}) from {:.3} s; I/O {:.3} s; compute {:.3} s overlapped, waited {:.3} s, {:.3} s after</title>",
        i + 1,
        sw.evicted,
        sw.loaded,
        bytes(sw.bytes),
        sw.start_s,
        sw.io_s,
        sw.overlap_compute_s,
        sw.wait_s,
        sw.after_compute_s
    )?;
    let mut t = sw.start_s;
    for (class, dt) in [
        ("overlap", sw.overlap_compute_s),
        ("wait", sw.wait_s),
        ("after", sw.after_compute_s),
    ] {
        scale.rect(s, class, t, dt, COMPUTE_Y)?;
        t += dt;
    }
    scale.rect(s, "io", io_start(sw), sw.io_s, IO_Y)?;
    if let Some(y) = kernels_y {
        for k in &sw.io_kernels {
            let (class, op) = match k.op {
                IoDirection::Write => ("kwrite", "write"),
                IoDirection::Read => ("kread", "read"),
            };
            writeln!(
                s,
                "<g><title>I/O kernels: {} p{}, {} commands, {} in {:.3} s ({:.2} GB/s) from {:.3} s</title>",
                op,
                k.partition,
                k.commands,
                bytes(k.bytes),
                k.seconds,
                k.bytes as f64 / k.seconds.max(1e-9) / 1e9,
                k.start_s
            )?;
            scale.rect(s, class, k.start_s, k.seconds, y)?;
            writeln!(s, "</g>")?;
        }
    }
    // Label the swap where there is room: the partition read and the one written back.
    if sw.io_s * scale.0 >= 64.0 {
        writeln!(
            s,
            r#"<text class="small" x="{:.2}" y="{}" text-anchor="middle">+p{} −p{}</text>"#,
            scale.x(sw.start_s + sw.io_s / 2.0),
            IO_Y + LANE / 2.0 + 4.0,
            sw.loaded,
            sw.evicted
        )?;
    }
    writeln!(s, "</g>")
}

/// The key of the segment colours, a row a lane (the I/O kernels' with `kernels`).
fn legend(s: &mut String, kernels: bool, legend_y: f64) -> std::fmt::Result {
    let mut legend = vec![
        (
            "compute",
            &[
                ("overlap", "overlapped with the swap's I/O"),
                ("wait", "waiting for I/O"),
                ("after", "after the swap"),
                ("initial", "before the first swap"),
            ][..],
        ),
        (
            "I/O",
            &[
                ("io", "swap I/O: write back + read"),
                ("fill", "buffer fill"),
            ][..],
        ),
    ];
    if kernels {
        legend.push((
            "I/O kernels",
            &[
                ("kwrite", "launch writing a partition"),
                ("kread", "launch reading a partition"),
            ][..],
        ));
    }
    for (row, (lane, entries)) in legend.iter().enumerate() {
        key_row(s, lane, entries, legend_y + 20.0 * row as f64)?;
    }
    Ok(())
}

/// One row of the key: the lane's name, then each colour and what it means.
fn key_row(s: &mut String, lane: &str, entries: &[(&str, &str)], y: f64) -> std::fmt::Result {
    writeln!(
        s,
        r#"<text class="small" x="{}" y="{y}" text-anchor="end">{lane}</text>"#,
        LEFT - 10.0
    )?;
    let mut lx = LEFT;
    for (class, label) in entries {
        writeln!(
            s,
            r#"<rect class="{class} key" x="{lx}" y="{}" width="14" height="14"/><text x="{}" y="{y}">{}</text>"#,
            y - 11.0,
            lx + 20.0,
            escape(label)
        )?;
        lx += 20.0 + 7.0 * label.len() as f64 + 28.0;
    }
    Ok(())
}

/// The table of the epochs `shown` (the latest of `all`), `epoch`'s row in bold.
fn table(
    s: &mut String,
    epoch: &Epoch,
    all: &[Epoch],
    shown: &[Epoch],
    table_y: f64,
) -> std::fmt::Result {
    let columns = [
        "epoch",
        "loss",
        "time (s)",
        "I/O (s)",
        "waited (s)",
        "I/O hidden",
        "swaps",
        "moved",
        "edges/s",
    ];
    let col_x = |c: usize| 16.0 + 104.0 * c as f64;
    for (c, name) in columns.iter().enumerate() {
        writeln!(
            s,
            r#"<text class="mono chosen" x="{}" y="{table_y}">{name}</text>"#,
            col_x(c)
        )?;
    }
    if shown.len() < all.len() {
        writeln!(
            s,
            r#"<text class="small" x="{}" y="{table_y}">({} earlier epochs not listed)</text>"#,
            col_x(columns.len()),
            all.len() - shown.len()
        )?;
    }
    for (r, e) in shown.iter().enumerate() {
        let class = if std::ptr::eq(e, epoch) {
            "mono chosen"
        } else {
            "mono"
        };
        let cells = [
            e.epoch.to_string(),
            format!("{:.4}", e.loss),
            format!("{:.3}", e.seconds),
            format!("{:.3}", e.io_s),
            format!("{:.3}", e.io_wait_s),
            e.hidden()
                .map_or("—".into(), |h| format!("{:.1}%", 100.0 * h)),
            e.swaps.len().to_string(),
            bytes(e.bytes_read + e.bytes_written),
            format!("{:.0}", e.edges_per_sec),
        ];
        let y = table_y + ROW * (r as f64 + 1.0);
        for (c, cell) in cells.iter().enumerate() {
            writeln!(
                s,
                r#"<text class="{class}" x="{}" y="{y}">{cell}</text>"#,
                col_x(c)
            )?;
        }
    }
    Ok(())
}

/// Height of the per-epoch charts below the table.
const CHART_H: f64 = 150.0;

/// Two charts over every epoch of the run, side by side: the mean loss and the training rate
/// (what a run without swaps, whose timeline is one bar, is watched for). A resumed run's
/// repeated epoch counts with its last record.
fn epoch_charts(s: &mut String, all: &[Epoch], top: f64) -> std::fmt::Result {
    let mut by_epoch = std::collections::BTreeMap::new();
    for e in all {
        by_epoch.insert(e.epoch, (e.loss, e.edges_per_sec));
    }
    let points: Vec<(u32, f64, f64)> = by_epoch.into_iter().map(|(k, (l, r))| (k, l, r)).collect();
    let gap = 70.0;
    let width = (WIDTH - LEFT - RIGHT - gap) / 2.0;
    // (title, class, the value, its decimals)
    let charts: [(&str, &str, Vec<f64>, usize); 2] = [
        (
            "mean loss per epoch",
            "loss",
            points.iter().map(|p| p.1).collect(),
            4,
        ),
        (
            "edges/s per epoch",
            "rate",
            points.iter().map(|p| p.2).collect(),
            0,
        ),
    ];
    let (first, last) = (points[0].0, points[points.len() - 1].0);
    for (i, (title, class, values, decimals)) in charts.into_iter().enumerate() {
        let show = |v: f64| format!("{v:.decimals$}");
        let x0 = LEFT + i as f64 * (width + gap);
        let lo = values.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let range = if hi > lo { hi - lo } else { 1.0 };
        let x = |k: u32| {
            x0 + if last > first {
                f64::from(k - first) / f64::from(last - first) * width
            } else {
                width / 2.0
            }
        };
        let y = |v: f64| top + CHART_H - (v - lo) / range * CHART_H;
        writeln!(
            s,
            r#"<text x="{x0}" y="{}">{title}</text><rect class="frame" x="{x0}" y="{top}" width="{width:.2}" height="{CHART_H}"/>"#,
            top - 8.0
        )?;
        for (v, anchor_y) in [(hi, top + 10.0), (lo, top + CHART_H)] {
            writeln!(
                s,
                r#"<text class="small" x="{}" y="{anchor_y}" text-anchor="end">{}</text>"#,
                x0 - 4.0,
                show(v)
            )?;
        }
        let line: Vec<String> = points
            .iter()
            .zip(&values)
            .map(|(p, &v)| format!("{:.2},{:.2}", x(p.0), y(v)))
            .collect();
        writeln!(
            s,
            r#"<polyline class="line {class}" points="{}"/>"#,
            line.join(" ")
        )?;
        for (p, &v) in points.iter().zip(&values) {
            writeln!(
                s,
                r#"<circle class="pt" cx="{:.2}" cy="{:.2}" r="2"><title>epoch {}: {}</title></circle>"#,
                x(p.0),
                y(v),
                p.0,
                show(v)
            )?;
        }
        writeln!(
            s,
            r#"<text class="small" x="{x0}" y="{0}">epoch {first}</text><text class="small" x="{1:.2}" y="{0}" text-anchor="end">epoch {last}</text>"#,
            top + CHART_H + 16.0,
            x0 + width
        )?;
    }
    Ok(())
}

/// A tick spacing of 1, 2 or 5 × 10^k giving about 10 ticks over `span`.
fn tick_step(span: f64) -> f64 {
    let raw = span / 10.0;
    let base = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0]
        .into_iter()
        .map(|m| m * base)
        .find(|&step| step >= raw)
        .unwrap_or(10.0 * base)
}

/// Bytes in binary units.
fn bytes(n: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", units[u])
    }
}

/// Escapes text for XML content and attributes.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c => out.push(c),
        }
    }
    out
}
