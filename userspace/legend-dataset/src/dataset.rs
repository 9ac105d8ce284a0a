//! Reading a dataset directory.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use legend_fs::{Access, Dir, ReadCheck};

use rayon::prelude::*;

use crate::buckets::{Buckets, PartitionScheme, read_pod};
use crate::error::{IoContext, RecordError, Result, invalid};
use crate::meta::{DatasetMeta, Split};
use crate::{ENTITIES_FILE, Edge, RELATIONS_FILE, edge_file, edge_name};

/// An imported dataset directory.
#[derive(Clone, Debug)]
pub struct Dataset {
    dir: PathBuf,
    /// The directory, opened once: every file is read beneath it (legend-fs).
    root: Arc<Dir>,
    meta: DatasetMeta,
}

impl Dataset {
    /// Opens the dataset in `dir`, reading and checking `dataset.toml`.
    pub fn open(dir: impl AsRef<Path>) -> Result<Dataset> {
        Self::open_checked(dir, None)
    }

    /// [`Dataset::open`] on someone's behalf: `check` (when given) must allow each directory
    /// on the way and each file read (legend-fs's [`Dir::open_checked`]).
    pub fn open_checked(dir: impl AsRef<Path>, check: Option<ReadCheck>) -> Result<Dataset> {
        let dir = dir.as_ref().to_owned();
        let root = match check {
            // Looked up only as the reader could: nothing is asked with the caller's rights
            // first, which could tell what lies in a directory the reader may not search.
            Some(check) => Dir::open_checked(&dir, check).at(&dir)?,
            // A directory the caller may not reach says so (a permission error is not "no
            // dataset there").
            None => match std::fs::metadata(&dir) {
                Ok(m) if m.is_dir() => Dir::open(&dir).at(&dir)?,
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e).at(&dir),
                _ => {
                    return Err(invalid(
                        &dir,
                        "not a dataset directory (run `legendctl import` first)",
                    ));
                }
            },
        };
        let meta = DatasetMeta::read_in(&root)?;
        Ok(Dataset {
            dir,
            root: Arc::new(root),
            meta,
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The metadata.
    pub fn meta(&self) -> &DatasetMeta {
        &self.meta
    }

    /// Loads the edges of `split`, checking their count and id ranges.
    pub fn edges(&self, split: Split) -> Result<Vec<Edge>> {
        let path = edge_file(&self.dir, split);
        let edges: Vec<Edge> = read_pod(&self.root, &edge_name(split))?;
        let want = self.meta.splits.get(split);
        if edges.len() as u64 != want {
            return Err(invalid(
                &path,
                format!("holds {} edges, dataset.toml says {want}", edges.len()),
            ));
        }
        if let Some(i) = edges
            .par_iter()
            .position_first(|e| self.check_edge(e).is_err())
        {
            let e = edges[i];
            let why = self.check_edge(&e).unwrap_err();
            return Err(invalid(&path, format!("edge {i} {e:?} {why}")));
        }
        Ok(edges)
    }

    /// The edges of `split` added to the dataset this one extends (`legendctl import
    /// --extend`): those after the base's count, read alone and checked; every edge of a
    /// dataset that extends none.
    pub fn added_edges(&self, split: Split) -> Result<Vec<Edge>> {
        use std::io::{Read, Seek, SeekFrom};
        let Some(base) = &self.meta.extends else {
            return self.edges(split);
        };
        let path = edge_file(&self.dir, split);
        let mut file = self
            .root
            .open_file(edge_name(split), Access::Read)
            .at(&path)?;
        let edge_bytes = std::mem::size_of::<Edge>() as u64;
        let (want, first) = (self.meta.splits.get(split), base.splits.get(split));
        let have = file.metadata().at(&path)?.len();
        if have != want * edge_bytes || first > want {
            return Err(invalid(
                &path,
                format!(
                    "holds {have} bytes, dataset.toml says {want} edges of {edge_bytes} bytes, {first} of them the base's"
                ),
            ));
        }
        let mut edges = vec![[0u32; 3]; (want - first) as usize];
        file.seek(SeekFrom::Start(first * edge_bytes))
            .and_then(|_| file.read_exact(bytemuck::cast_slice_mut(&mut edges)))
            .at(&path)?;
        if let Some(i) = edges.iter().position(|e| self.check_edge(e).is_err()) {
            let e = edges[i];
            let why = self.check_edge(&e).unwrap_err();
            let at = first + i as u64;
            return Err(invalid(&path, format!("edge {at} {e:?} {why}")));
        }
        Ok(edges)
    }

    /// Whether `e`'s ids lie within the dataset's entities and relations (the engines index
    /// their tables with them unchecked); the error says what is wrong.
    fn check_edge(&self, e: &Edge) -> std::result::Result<(), RecordError> {
        let (ne, nr) = (self.meta.entities, self.meta.relations);
        if u64::from(e[0]) >= ne || u64::from(e[2]) >= ne || u64::from(e[1]) >= nr {
            return Err(RecordError::OutOfRange {
                entities: ne,
                relations: nr,
            });
        }
        Ok(())
    }

    /// Degree (in + out) of every entity over the edges of `split`, read from the file in
    /// blocks rather than loaded whole (a caller that needs degrees only, such as sampled
    /// evaluation, should not hold a billion-edge split in memory to count them).
    pub fn degrees(&self, split: Split) -> Result<Vec<u32>> {
        use std::io::Read;
        const BLOCK_EDGES: usize = 1 << 14;
        let path = edge_file(&self.dir, split);
        let mut file = self
            .root
            .open_file(edge_name(split), Access::Read)
            .at(&path)?;
        let want = self.meta.splits.get(split);
        let have = file.metadata().at(&path)?.len();
        let edge_bytes = std::mem::size_of::<Edge>() as u64;
        if have != want * edge_bytes {
            return Err(invalid(
                &path,
                format!("holds {have} bytes, dataset.toml says {want} edges of {edge_bytes} bytes"),
            ));
        }
        let mut deg = vec![0u32; self.meta.entities as usize];
        let mut block = vec![[0u32; 3]; BLOCK_EDGES];
        let mut done = 0u64;
        while done < want {
            let n = (want - done).min(BLOCK_EDGES as u64) as usize;
            file.read_exact(bytemuck::cast_slice_mut(&mut block[..n]))
                .at(&path)?;
            for (i, e) in block[..n].iter().enumerate() {
                if let Err(why) = self.check_edge(e) {
                    let at = done + i as u64;
                    return Err(invalid(&path, format!("edge {at} {e:?} {why}")));
                }
                deg[e[0] as usize] += 1;
                deg[e[2] as usize] += 1;
            }
            done += n as u64;
        }
        Ok(deg)
    }

    /// The partition scheme for `num_partitions`.
    pub fn scheme(&self, num_partitions: u32) -> Result<PartitionScheme> {
        PartitionScheme::new(self.meta.entities, num_partitions)
            .map_err(|e| invalid(&self.dir, e.to_string()))
    }

    /// Train edges in N×N buckets: the saved ones if `legendctl partition` wrote them for this N,
    /// else sorted now in memory.
    pub fn buckets(&self, num_partitions: u32) -> Result<Buckets> {
        let scheme = self.scheme(num_partitions)?;
        if let Some(saved) = Buckets::load(&self.root, scheme, self.meta.splits.train)? {
            return Ok(saved);
        }
        self.sort_train_edges(scheme)
    }

    /// The edge counts of the N×N train buckets (row-major): from the saved offsets when
    /// `legendctl partition` wrote them for this N, else one checked pass over the train edges
    /// that keeps none.
    pub fn bucket_counts(&self, num_partitions: u32) -> Result<Vec<u64>> {
        let scheme = self.scheme(num_partitions)?;
        if let Some(saved) = Buckets::load_counts(&self.root, scheme, self.meta.splits.train)? {
            return Ok(saved);
        }
        Buckets::count(
            &self.root,
            &edge_name(Split::Train),
            scheme,
            self.meta.splits.train,
            |e| self.check_edge(e),
        )
    }

    /// The train edges of the N×N buckets `keep` selects (row-major index), the others empty:
    /// what one host of several trains. From the saved buckets when `legendctl partition` wrote
    /// them for this N (only the selected buckets' runs are read), else from one pass over the
    /// train edges that keeps the selected ones.
    pub fn buckets_selected(
        &self,
        num_partitions: u32,
        keep: &(dyn Fn(usize) -> bool + Sync),
    ) -> Result<Buckets> {
        let scheme = self.scheme(num_partitions)?;
        let train = self.meta.splits.train;
        if let Some(saved) = Buckets::load_selected(&self.root, scheme, train, keep)? {
            return Ok(saved);
        }
        Buckets::read_selected(
            &self.root,
            &edge_name(Split::Train),
            scheme,
            train,
            |e| self.check_edge(e),
            keep,
        )
    }

    /// The train edges, checked and sorted into `scheme`'s buckets.
    fn sort_train_edges(&self, scheme: PartitionScheme) -> Result<Buckets> {
        if scheme.num_partitions == 1 {
            return Ok(Buckets::build(self.edges(Split::Train)?, scheme));
        }
        Buckets::read(
            &self.root,
            &edge_name(Split::Train),
            scheme,
            self.meta.splits.train,
            |e| self.check_edge(e),
        )
    }

    /// Sorts train edges into N×N buckets and saves them next to the edges.
    pub fn partition(&self, num_partitions: u32) -> Result<Buckets> {
        let scheme = self.scheme(num_partitions)?;
        let buckets = self.sort_train_edges(scheme)?;
        buckets.save(&self.dir)?;
        Ok(buckets)
    }

    /// Entity labels indexed by id.
    pub fn entity_labels(&self) -> Result<Vec<String>> {
        self.labels(LabelTable::Entities)
    }

    /// Relation labels indexed by id.
    pub fn relation_labels(&self) -> Result<Vec<String>> {
        self.labels(LabelTable::Relations)
    }

    fn labels(&self, table: LabelTable) -> Result<Vec<String>> {
        let path = self.dir.join(table.file());
        let text = self.root.read(table.file()).at(&path)?;
        let labels: Vec<String> = text
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| String::from_utf8_lossy(label_in_line(l)).into_owned())
            .collect();
        self.check_label_count(table, labels.len() as u64)?;
        Ok(labels)
    }

    /// The label file of `table` opened to read, for a reader that maps or indexes it itself
    /// (lines as [`label_in_line`] reads them; [`Dataset::check_label_count`] checks their
    /// count), with its path.
    pub fn open_labels(&self, table: LabelTable) -> Result<(std::fs::File, PathBuf)> {
        let path = self.dir.join(table.file());
        let file = self.root.open_file(table.file(), Access::Read).at(&path)?;
        Ok((file, path))
    }

    /// Refuses a label file of `table` that holds `found` labels (non-empty lines), not the
    /// count dataset.toml gives.
    pub fn check_label_count(&self, table: LabelTable, found: u64) -> Result<()> {
        let want = match table {
            LabelTable::Entities => self.meta.entities,
            LabelTable::Relations => self.meta.relations,
        };
        if found != want {
            return Err(invalid(
                self.dir.join(table.file()),
                format!("holds {found} labels, dataset.toml says {want}"),
            ));
        }
        Ok(())
    }
}

/// One of a dataset's label files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LabelTable {
    /// `entities.tsv`.
    Entities,
    /// `relations.tsv`.
    Relations,
}

impl LabelTable {
    /// The file, relative to the dataset directory.
    pub fn file(self) -> &'static str {
        match self {
            LabelTable::Entities => ENTITIES_FILE,
            LabelTable::Relations => RELATIONS_FILE,
        }
    }
}

/// The label a line of a label file holds (`id<TAB>label`): what follows its first tab, nothing
/// in a line without one. Empty lines hold no label: they are skipped, and ids count the others.
pub fn label_in_line(line: &[u8]) -> &[u8] {
    line.iter()
        .position(|&b| b == b'\t')
        .map_or(&[], |tab| &line[tab + 1..])
}

/// Degree (in + out) of every entity over `edges`, counted on every core.
pub fn degrees(num_entities: usize, edges: &[Edge]) -> Vec<u32> {
    let deg: Vec<AtomicU32> = (0..num_entities).map(|_| AtomicU32::new(0)).collect();
    edges.par_chunks(1 << 16).for_each(|chunk| {
        for e in chunk {
            deg[e[0] as usize].fetch_add(1, Ordering::Relaxed);
            deg[e[2] as usize].fetch_add(1, Ordering::Relaxed);
        }
    });
    deg.into_iter().map(AtomicU32::into_inner).collect()
}
