//! `dataset.toml`: the description of a dataset directory.

use std::path::Path;

use legend_fs::Dir;
use serde::{Deserialize, Serialize};

use crate::error::{IoContext, Result, invalid};

/// The dataset format version this crate writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// File name of the metadata inside a dataset directory.
pub const META_FILE: &str = "dataset.toml";

/// One of the three edge splits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    /// Training edges.
    Train,
    /// Validation edges.
    Valid,
    /// Test edges.
    Test,
}

impl Split {
    /// All splits in file order.
    pub const ALL: [Split; 3] = [Split::Train, Split::Valid, Split::Test];

    /// The split's name, also its file stem under `edges/`.
    pub fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Valid => "valid",
            Split::Test => "test",
        }
    }
}

impl std::str::FromStr for Split {
    type Err = legend_model::UnknownName;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        Split::ALL
            .into_iter()
            .find(|x| x.name() == s)
            .ok_or_else(|| {
                legend_model::UnknownName::new("split", s, "expected train, valid or test")
            })
    }
}

/// Edge counts per split.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SplitCounts {
    /// Training edges.
    pub train: u64,
    /// Validation edges.
    pub valid: u64,
    /// Test edges.
    pub test: u64,
}

impl SplitCounts {
    /// The count of one split.
    pub fn get(&self, split: Split) -> u64 {
        match split {
            Split::Train => self.train,
            Split::Valid => self.valid,
            Split::Test => self.test,
        }
    }

    pub(crate) fn get_mut(&mut self, split: Split) -> &mut u64 {
        match split {
            Split::Train => &mut self.train,
            Split::Valid => &mut self.valid,
            Split::Test => &mut self.test,
        }
    }
}

/// The contents of `dataset.toml`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetMeta {
    /// Format version; see [`FORMAT_VERSION`].
    pub format_version: u32,
    /// Number of entities (node ids are `0..entities`).
    pub entities: u64,
    /// Number of relation types (1 for graphs without relation types).
    pub relations: u64,
    /// Whether the input had a relation column (`false` for `--columns sd`).
    pub has_relations: bool,
    /// Bytes per id in the edge files: 4 (u32).
    pub id_width: u32,
    /// Edges per split.
    pub splits: SplitCounts,
    /// CRC-32 of each split's edge file, so stores and runs can tell datasets apart.
    pub checksums: SplitCounts,
    /// Seed of the id permutation (and of the split, when splitting by fraction).
    pub seed: u64,
    /// Input files, as given.
    pub sources: Vec<String>,
    /// Valid/test edges dropped because an entity or relation never occurs in train.
    pub unseen_dropped: u64,
    /// Valid/test edges kept despite unseen entities or relations (`--keep-unseen`).
    pub unseen_kept: u64,
    /// The dataset this one extends (`legendctl import --extend`), absent in one imported
    /// whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extends: Option<crate::Extension>,
}

impl DatasetMeta {
    /// Reads and checks `dataset.toml` in `dir`.
    pub fn read(dir: &Path) -> Result<Self> {
        Self::read_in(&Dir::open(dir).at(dir)?)
    }

    /// Reads and checks `dataset.toml` in the opened `dir`.
    pub fn read_in(dir: &Dir) -> Result<Self> {
        let path = dir.join(META_FILE);
        let text = dir.read_to_string(META_FILE).at(&path)?;
        let meta: DatasetMeta = toml::from_str(&text)
            .map_err(|e| invalid(&path, format!("not a dataset description: {e}")))?;
        if meta.format_version != FORMAT_VERSION {
            return Err(invalid(
                &path,
                format!(
                    "format version {} is not supported (this build reads version {FORMAT_VERSION})",
                    meta.format_version
                ),
            ));
        }
        if meta.id_width != 4 {
            return Err(invalid(
                &path,
                format!("id width {} is not supported (expected 4)", meta.id_width),
            ));
        }
        Ok(meta)
    }

    pub(crate) fn write(&self, dir: &Path) -> Result<()> {
        let path = dir.join(META_FILE);
        let mut text = toml::to_string_pretty(self).expect("dataset metadata always serializes");
        // The pretty printer ends on the `sources` array's `]`, without a line end.
        if !text.ends_with('\n') {
            text.push('\n');
        }
        std::fs::write(&path, text).at(&path)
    }

    /// A 128-bit fingerprint of the dataset's content, for stores and checkpoints to check against.
    ///
    /// Four CRC-32 lanes with different initial values over the counts, edge checksums and seed.
    pub fn identity(&self) -> u128 {
        let words = [
            self.entities,
            self.relations,
            self.splits.train,
            self.splits.valid,
            self.splits.test,
            self.checksums.train,
            self.checksums.valid,
            self.checksums.test,
            self.seed,
        ];
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        (0..4u32).fold(0u128, |id, lane| {
            let mut h = crc32fast::Hasher::new_with_initial(0x9e37_79b9u32.wrapping_mul(lane + 1));
            h.update(&bytes);
            id | (u128::from(h.finalize()) << (32 * lane))
        })
    }
}
