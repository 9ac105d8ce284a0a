//! `legendctl import`.

use std::path::PathBuf;

use anyhow::bail;
use legend_dataset::{Columns, Delimiter, Header, ImportInput, ImportOptions, import};

/// Arguments of `legendctl import`.
#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["train", "split", "marius", "add"])))]
pub struct Args {
    /// Output dataset directory (must not exist).
    #[arg(short = 'o', long = "out")]
    out: PathBuf,
    /// Training edges (text, optionally gzip).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["split", "marius"])]
    train: Option<PathBuf>,
    /// Validation edges (with --add: the added ones).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["split", "marius"])]
    valid: Option<PathBuf>,
    /// Test edges (with --add: the added ones).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["split", "marius"])]
    test: Option<PathBuf>,
    /// A day's new training edges, added to the dataset --extend names (as a new dataset
    /// directory --out): every entity and relation keeps its id, new labels get the ids after
    /// them, and the added edges follow the base's in each split (so that `legendctl train
    /// --init-from` carries a base run's rows over).
    #[arg(long, value_name = "FILE", requires = "extend", conflicts_with_all = ["train", "split", "marius"])]
    add: Option<PathBuf>,
    /// The dataset directory --add extends (only read).
    #[arg(long, value_name = "DIR", requires = "add")]
    extend: Option<PathBuf>,
    /// Split FILEs at random into train,valid,test by these fractions, e.g. 0.9,0.05,0.05.
    #[arg(long, value_name = "FRACTIONS", value_parser = super::parse_fractions, requires = "files", conflicts_with = "marius")]
    split: Option<[f64; 3]>,
    /// A directory preprocessed by Marius (dataset.yaml, edges/*_edges.bin).
    #[arg(long, value_name = "DIR")]
    marius: Option<PathBuf>,
    /// Seed of the node-id permutation and of --split.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Field delimiter: tab, comma, whitespace or one character (default: detected).
    #[arg(long)]
    delimiter: Option<Delimiter>,
    /// Column order: hrt (= srd), htr, or sd for graphs without relation types.
    #[arg(long, default_value = "hrt")]
    columns: Columns,
    /// Keep valid/test edges whose entity or relation never occurs in train.
    #[arg(long)]
    keep_unseen: bool,
    /// Whether text files start with a header line: `auto` skips a first line of column names
    /// (`head relation tail`, `subject predicate object`, ...) and warns about a first line
    /// whose labels occur nowhere else; `yes` skips every file's first line; `no` imports
    /// every line. Each skipped line is named in a warning.
    #[arg(long, default_value = "auto")]
    header: Header,
    /// Print a JSON summary on stdout.
    #[arg(long)]
    json: bool,
    /// Files to split (with --split).
    #[arg(value_name = "FILE")]
    files: Vec<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let input = match (args.train, args.split, args.marius) {
        _ if args.add.is_some() => {
            if !args.files.is_empty() {
                bail!("positional FILEs are only used with --split; use --add/--valid/--test");
            }
            ImportInput::Extend {
                base: args.extend.expect("--add requires --extend"),
                train: args.add.expect("matched"),
                valid: args.valid,
                test: args.test,
            }
        }
        (Some(train), None, None) => {
            if !args.files.is_empty() {
                bail!("positional FILEs are only used with --split; use --train/--valid/--test");
            }
            ImportInput::Files {
                train,
                valid: args.valid,
                test: args.test,
            }
        }
        (None, Some(fractions), None) => ImportInput::Split {
            files: args.files,
            fractions,
        },
        (None, None, Some(dir)) => ImportInput::Marius { dir },
        _ => bail!("give exactly one of --train, --split, --marius or --add"),
    };
    let cancel = super::stop_staging_on_signals("the import", "importing")?;
    let options = ImportOptions {
        input,
        delimiter: args.delimiter,
        columns: args.columns,
        seed: args.seed,
        keep_unseen: args.keep_unseen,
        header: args.header,
        progress: true,
        cancel: Some(cancel),
    };
    let summary = import(&options, &args.out)?;
    if args.json {
        super::print_json(&summary)?;
    } else {
        outln!(
            "imported {} entities, {} relations, {} train / {} valid / {} test edges into {} in {:.1} s",
            summary.entities,
            summary.relations,
            summary.train,
            summary.valid,
            summary.test,
            summary.output.display(),
            summary.seconds
        )?;
        if let Some(base) = &summary.extends {
            outln!(
                "of them {} entities, {} relations and {} / {} / {} edges are new (ids from {} and {} on; the rest are {}'s)",
                summary.entities - base.entities,
                summary.relations - base.relations,
                summary.train - base.splits.train,
                summary.valid - base.splits.valid,
                summary.test - base.splits.test,
                base.entities,
                base.relations,
                base.base
            )?;
        }
        if summary.unseen_dropped > 0 {
            outln!(
                "dropped {} valid/test edges whose entity or relation is not in train (--keep-unseen keeps them)",
                summary.unseen_dropped
            )?;
        }
    }
    Ok(())
}
