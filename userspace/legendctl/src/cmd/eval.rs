//! `legendctl eval`, and the evaluation shared with `legendctl train`.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use legend_dataset::{Dataset, Split};
use legend_engine::run::{self, RunMeta};
use legend_eval::{Embeddings, FilterIndex, Metrics, Protocol, SampledNegatives};
use legend_model::Decoder;

/// Arguments of `legendctl eval`.
#[derive(clap::Args)]
pub struct Args {
    /// The run directory (or use --embeddings for embeddings trained elsewhere).
    #[arg(required_unless_present = "embeddings")]
    run: Option<PathBuf>,
    /// A directory with `entities.npy` and `relations.npy` (float32, rows in this dataset's id
    /// order, ComplEx rows as [real | imaginary]): evaluate embeddings trained by another system.
    #[arg(long, conflicts_with = "run", requires_all = ["dataset", "decoder"])]
    embeddings: Option<PathBuf>,
    /// The score function of --embeddings: dot, distmult, complex, transe_l1, transe_l2.
    #[arg(long)]
    decoder: Option<Decoder>,
    /// `filtered` (full ranking, known triples removed) or `sampled` (uniform + degree negatives).
    #[arg(long, default_value = "filtered")]
    protocol: String,
    /// The split to rank: `test` or `valid`.
    #[arg(long, default_value = "test")]
    split: Split,
    /// Sampled protocol: uniform negatives.
    #[arg(long, default_value_t = 1000)]
    uniform_negatives: usize,
    /// Sampled protocol: degree-proportional negatives.
    #[arg(long, default_value_t = 1000)]
    degree_negatives: usize,
    /// Sampled protocol: seed (default: a fixed seed, so runs are comparable).
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

/// What to evaluate and how.
pub struct EvalRequest<'a> {
    /// `filtered` or `sampled`.
    pub protocol: &'a str,
    /// Split to rank.
    pub split: Split,
    /// Sampled-protocol negatives.
    pub negatives: SampledNegatives,
    /// Threads.
    pub threads: usize,
}

/// Evaluates `entities`/`relations` of `decoder` on `dataset`.
pub fn evaluate(
    dataset: &Dataset,
    decoder: Decoder,
    dim: usize,
    entities: &[f32],
    relations: &[f32],
    request: &EvalRequest<'_>,
) -> anyhow::Result<Metrics> {
    let triples = dataset.edges(request.split)?;
    if triples.is_empty() {
        bail!(
            "{}: the {} split has no edges to evaluate",
            dataset.dir().display(),
            request.split.name()
        );
    }
    let embeddings = Embeddings {
        decoder,
        entities,
        relations,
        dim,
    };
    let ne = dataset.meta().entities as usize;
    let metrics = match request.protocol {
        "filtered" => {
            let parts: Vec<Vec<[u32; 3]>> = Split::ALL
                .iter()
                .map(|&s| dataset.edges(s))
                .collect::<Result<_, _>>()?;
            let refs: Vec<&[[u32; 3]]> = parts.iter().map(Vec::as_slice).collect();
            let filter = FilterIndex::build(ne, &refs)?;
            legend_eval::evaluate(
                &embeddings,
                &triples,
                &Protocol::Filtered { filter: &filter },
                request.threads,
            )?
        }
        "sampled" => {
            let degrees = legend_dataset::degrees(ne, &dataset.edges(Split::Train)?);
            let protocol = Protocol::Sampled {
                negatives: request.negatives,
                degrees: &degrees,
            };
            legend_eval::evaluate(&embeddings, &triples, &protocol, request.threads)?
        }
        other => bail!("unknown protocol {other:?}: expected filtered or sampled"),
    };
    Ok(metrics)
}

/// Opens the dataset a run was trained on and checks that it is the same data.
pub fn open_run_dataset(meta: &RunMeta, override_dir: Option<&Path>) -> anyhow::Result<Dataset> {
    let dir = override_dir.unwrap_or(&meta.dataset);
    let dataset = Dataset::open(dir)
        .with_context(|| "opening the run's dataset (use --dataset if it moved)")?;
    let identity = format!("{:032x}", dataset.meta().identity());
    if identity != meta.dataset_identity {
        bail!(
            "{} is not the dataset this run was trained on (identity {identity}, run has {})",
            dir.display(),
            meta.dataset_identity
        );
    }
    Ok(dataset)
}

/// One line of human-readable metrics.
pub fn describe(m: &Metrics) -> String {
    let protocol = match m.protocol {
        legend_eval::ProtocolKind::Filtered => "filtered".to_string(),
        legend_eval::ProtocolKind::Sampled => format!(
            "sampled ({} uniform + {} degree negatives)",
            m.uniform_negatives.unwrap_or(0),
            m.degree_negatives.unwrap_or(0)
        ),
    };
    format!(
        "{protocol} MRR {:.4}  Hits@1 {:.4}  Hits@3 {:.4}  Hits@10 {:.4}  mean rank {:.1}  ({} queries, both sides; realistic ties)",
        m.mrr, m.hits_at_1, m.hits_at_3, m.hits_at_10, m.mean_rank, m.count
    )
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let (label, dataset, decoder, dim, entities, relations) = match (&args.run, &args.embeddings) {
        (Some(run_dir), _) => {
            let meta = run::read_meta(run_dir)?;
            let dataset = open_run_dataset(&meta, args.dataset.as_deref())?;
            let tables = run::load_tables(run_dir, &meta)?;
            let decoder: Decoder = meta.decoder.parse().map_err(anyhow::Error::msg)?;
            (
                run_dir.display().to_string(),
                dataset,
                decoder,
                meta.dim,
                tables.entities,
                tables.relations,
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
                if rrows as u64 != dataset.meta().relations || rdim != dim {
                    bail!(
                        "{}: shape ({rrows}, {rdim}), expected ({}, {dim})",
                        path.display(),
                        dataset.meta().relations
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
            )
        }
        (None, None) => bail!("give a run directory or --embeddings"),
    };
    let request = EvalRequest {
        protocol: &args.protocol,
        split: args.split,
        negatives: SampledNegatives {
            uniform: args.uniform_negatives,
            degree: args.degree_negatives,
            seed: args.seed.unwrap_or(legend_eval::DEFAULT_SEED),
        },
        threads: args.threads,
    };
    let m = evaluate(&dataset, decoder, dim, &entities, &relations, &request)?;
    if args.json {
        super::print_json(&m)?;
    } else {
        println!("{label} {}: {}", args.split.name(), describe(&m));
    }
    Ok(())
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
