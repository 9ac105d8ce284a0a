//! `legendctl eval`: ranks a run's tables, or embeddings trained elsewhere.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use legend_dataset::{Dataset, Split};
use legend_engine::config::Protocol;
use legend_engine::evaluation::{EvalRequest, describe, evaluate, open_run_dataset};
use legend_engine::run;
use legend_engine::which_tables::{self, Tables};
use legend_eval::SampledNegatives;
use legend_fs::Unguarded;
use legend_model::Decoder;

/// Arguments of `legendctl eval`.
#[derive(clap::Args)]
pub struct Args {
    /// The run directory (or use --embeddings for embeddings trained elsewhere): its best
    /// validated epoch's tables when it kept them (`RUN/best`, what `legendctl train` printed),
    /// else its last checkpoint's.
    #[arg(required_unless_present = "embeddings")]
    run: Option<PathBuf>,
    /// Rank the run's last checkpoint even when it kept a best epoch in `RUN/best`.
    #[arg(long, conflicts_with = "embeddings")]
    last: bool,
    /// A directory with `entities.npy` and `relations.npy` (float32, rows in this dataset's id
    /// order, ComplEx rows as [real | imaginary]): evaluate embeddings trained by another system.
    #[arg(long, conflicts_with = "run", requires_all = ["dataset", "decoder"])]
    embeddings: Option<PathBuf>,
    /// The score function of --embeddings: dot, distmult, complex, transe_l1, transe_l2.
    #[arg(long)]
    decoder: Option<Decoder>,
    /// --embeddings were trained with reciprocal relations: `relations.npy` has twice the
    /// dataset's relations, the inverse of relation r at row R + r, and source queries are
    /// answered through the inverses.
    #[arg(long, requires = "embeddings")]
    reciprocal: bool,
    /// `filtered` (full ranking, known triples removed) or `sampled` (uniform + degree negatives,
    /// unfiltered; for graphs too large to rank fully).
    ///
    /// With `sampled`, uniform + degree negatives never exceed the graph's entities: on a smaller
    /// graph both are reduced, in proportion, to the entity count, with a warning naming the
    /// numbers (the metrics report the numbers used).
    #[arg(long, default_value = "filtered")]
    protocol: Protocol,
    /// The split to rank: `test` or `valid`.
    #[arg(long, default_value = "test")]
    split: Split,
    /// Sampled protocol: uniform negatives per side and chunk of 1000 triples (reduced on graphs
    /// with fewer entities than uniform + degree negatives; see --protocol). Default: the run's
    /// `evaluation.uniform_negatives`, so that eval reproduces its figures; 1000 for
    /// --embeddings.
    #[arg(long)]
    uniform_negatives: Option<usize>,
    /// Sampled protocol: degree-proportional negatives per side and chunk of 1000 triples
    /// (reduced like --uniform-negatives). Default: the run's `evaluation.degree_negatives`;
    /// 1000 for --embeddings.
    #[arg(long)]
    degree_negatives: Option<usize>,
    /// Sampled protocol: seed. Default: the run's `evaluation.seed`; a fixed seed for
    /// --embeddings, so that runs are comparable.
    #[arg(long)]
    seed: Option<u64>,
    /// The dataset (for a run: only if it moved since training).
    #[arg(long)]
    dataset: Option<PathBuf>,
    /// Threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Print the metrics as one JSON object.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let mut chosen: Option<Tables> = None;
    let (label, dataset, decoder, dim, entities, relations, reciprocal, negatives) =
        match (&args.run, &args.embeddings) {
            (Some(run_dir), _) => {
                let tables = which_tables::choose(run_dir, super::pick(args.last))?;
                let run = run::open(&tables.dir)?;
                chosen = Some(tables);
                let meta = run::read_meta(&run)?;
                let dataset = open_run_dataset(&meta, args.dataset.as_deref(), &Unguarded)?;
                let (entities, relations) = run::load_embeddings(&run, &meta, &Unguarded)?;
                let decoder: Decoder = meta.decoder.parse().map_err(anyhow::Error::msg)?;
                (
                    run_dir.display().to_string(),
                    dataset,
                    decoder,
                    meta.dim,
                    entities,
                    relations,
                    meta.reciprocal_relations,
                    run::evaluation_negatives(&run)?,
                )
            }
            (None, Some(dir)) => {
                let dataset = Dataset::open(args.dataset.as_ref().expect("required by clap"))?;
                let decoder = args.decoder.expect("required by clap");
                let (entities, rows, dim) = read_npy(&dir.join("entities.npy"))?;
                if rows as u64 != dataset.meta().entities {
                    bail!(
                        "{}: {rows} rows, but the dataset has {} entities",
                        dir.join("entities.npy").display(),
                        dataset.meta().entities
                    );
                }
                let relations = if decoder.uses_relations() {
                    let path = dir.join("relations.npy");
                    let (r, rrows, rdim) = read_npy(&path)?;
                    let want = dataset.meta().relations * if args.reciprocal { 2 } else { 1 };
                    // A row of the decoder's width: RESCAL's dim × dim matrices, row-major.
                    let width = decoder.relation_width(dim);
                    if rrows as u64 != want || rdim != width {
                        bail!(
                            "{}: shape ({rrows}, {rdim}), expected ({want}, {width}){}",
                            path.display(),
                            if args.reciprocal {
                                " (--reciprocal: the relations, then their inverses)"
                            } else {
                                ""
                            }
                        );
                    }
                    r
                } else {
                    Vec::new()
                };
                (
                    dir.display().to_string(),
                    dataset,
                    decoder,
                    dim,
                    entities,
                    relations,
                    args.reciprocal,
                    SampledNegatives::default(),
                )
            }
            (None, None) => bail!("give a run directory or --embeddings"),
        };
    let request = EvalRequest {
        protocol: args.protocol,
        split: args.split,
        negatives: SampledNegatives {
            uniform: args.uniform_negatives.unwrap_or(negatives.uniform),
            degree: args.degree_negatives.unwrap_or(negatives.degree),
            seed: args.seed.unwrap_or(negatives.seed),
        },
        threads: args.threads,
    };
    let m = evaluate(
        &dataset, decoder, dim, &entities, &relations, reciprocal, &request,
    )?;
    match &chosen {
        // The metrics' keys, and the tables ranked.
        Some(tables) if args.json => {
            let mut line = serde_json::to_value(&m)?;
            line["tables"] = serde_json::to_value(tables)?;
            super::print_json(&line)
        }
        _ if args.json => super::print_json(&m),
        Some(tables) => outln!(
            "{label} {}, {}: {}",
            args.split.name(),
            tables.describe(),
            describe(&m)
        ),
        None => outln!("{label} {}: {}", args.split.name(), describe(&m)),
    }
}

/// Reads a 2-D little-endian float32 C-order `.npy` file: (values, rows, columns).
pub fn read_npy(path: &Path) -> anyhow::Result<(Vec<f32>, usize, usize)> {
    let bytes = std::fs::read(path).with_context(|| path.display().to_string())?;
    let bad = |why: &str| anyhow::anyhow!("{}: {why}", path.display());
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(bad("not a .npy file"));
    }
    let (header_len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
        v => return Err(bad(&format!("unsupported .npy version {v}"))),
    };
    let header = std::str::from_utf8(
        bytes
            .get(start..start + header_len)
            .ok_or_else(|| bad("truncated header"))?,
    )
    .map_err(|_| bad("header is not text"))?;
    if !header.contains("'descr': '<f4'") || !header.contains("'fortran_order': False") {
        return Err(bad(&format!(
            "expected little-endian float32 in C order, header {header:?}"
        )));
    }
    let shape = header
        .split("'shape': (")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .ok_or_else(|| bad("no shape in header"))?;
    let dims: Vec<usize> = shape
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().map_err(|_| bad("bad shape")))
        .collect::<anyhow::Result<_>>()?;
    let [rows, cols] = dims[..] else {
        return Err(bad(&format!("expected a 2-D array, shape ({shape})")));
    };
    let data = &bytes[start + header_len..];
    if data.len() != rows * cols * 4 {
        return Err(bad(&format!(
            "{} data bytes for shape ({rows}, {cols})",
            data.len()
        )));
    }
    Ok((bytemuck::pod_collect_to_vec(data), rows, cols))
}
