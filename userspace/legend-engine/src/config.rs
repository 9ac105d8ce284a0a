//! The training configuration: TOML sections `model`, `storage`, `training`, `optimizer`,
//! `evaluation`.
//!
//! Every key has a default, so an empty file (or none) trains a sensible model. Unknown keys and
//! bad values are errors that name the key. `Documentation/config.md` lists every key.
//!
//! The text is parsed once, at the edge: names become enums as they are read (an unknown name is
//! an error naming its key), and [`Config::parse`] then checks what spans keys. Nothing
//! downstream compares strings.

use legend_nvme_proxy::DeviceModel;
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use legend_model::{
    AdaGrad, Decoder, Distribution, Dtype, Init, Loss, Penalty, Regularizer, RelationInit,
    StateLayout,
};
use legend_planner::Order;
use serde::{Deserialize, Serialize};

use crate::store::location::{QueueBackend, QueueLocation, StoreMember};

/// The whole configuration of a training run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The model.
    pub model: ModelConfig,
    /// Where embeddings live and how partitions are swapped.
    pub storage: StorageConfig,
    /// The optimisation.
    pub training: TrainingConfig,
    /// The optimizer (AdaGrad) and its state.
    pub optimizer: OptimizerConfig,
    /// Evaluation during and after training.
    pub evaluation: EvaluationConfig,
}

/// `[model]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// `dot | distmult | complex | transe_l1 | transe_l2 | rotate`.
    #[serde(with = "by_name")]
    pub decoder: Decoder,
    /// Embedding dimension (reals; ComplEx uses dim/2 complex numbers).
    pub dim: usize,
    /// `softmax_ce | logistic | ranking | self_adversarial`.
    pub loss: LossKind,
    /// Margin of the ranking loss; γ of the self-adversarial one.
    pub margin: f32,
    /// α of the self-adversarial loss: how sharply its negatives are weighted by score.
    pub adversarial_temperature: f32,
    /// Standard deviation of the normal initialisation of node rows.
    pub init_scale: f32,
    /// How relation rows start: `identity` (the operator's identity) or `random` (like nodes).
    pub relation_init: RelationStart,
    /// Learn an inverse relation r⁻¹ for every relation: the relation table has twice the
    /// rows, source-side corruption of (s, r, d) is trained and evaluated as (d, r⁻¹, ?).
    pub reciprocal_relations: bool,
}

/// `model.loss`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossKind {
    /// Softmax cross-entropy over the positive and its negatives.
    SoftmaxCe,
    /// Logistic loss on every score.
    Logistic,
    /// Margin ranking loss (`model.margin`).
    Ranking,
    /// Self-adversarial negative sampling (Sun et al. 2019; `model.margin` is γ,
    /// `model.adversarial_temperature` α).
    SelfAdversarial,
}

/// `model.relation_init`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RelationStart {
    /// The decoder's identity operator.
    Identity,
    /// Drawn like node rows.
    Random,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            decoder: Decoder::ComplEx,
            dim: 200,
            loss: LossKind::SoftmaxCe,
            margin: legend_model::DEFAULT_MARGIN,
            adversarial_temperature: 1.0,
            init_scale: 1e-3,
            relation_init: RelationStart::Random,
            reciprocal_relations: false,
        }
    }
}

/// `[storage]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StorageConfig {
    /// Number of node partitions N.
    pub num_partitions: u32,
    /// Partitions resident at once, C (0 = all N).
    pub buffer_capacity: u32,
    /// Where partitions live outside the buffer.
    pub backend: Backend,
    /// Store path for disk backends: the file or block device (`file`), the device node (`nvme`,
    /// default `/dev/legend-nvme0`) or the proxy's backing file (`proxy`); `file` and `proxy`
    /// default to `store.bin` in the run directory.
    pub path: Option<PathBuf>,
    /// `nvme`, `proxy`: the namespace holding the store.
    pub namespace: u32,
    /// `nvme`, `proxy`: the store's first LBA (the namespace's blocks before it stay untouched).
    pub start_lba: u64,
    /// Let the `file` backend overwrite a target that carries a file system, partition table
    /// or another store.
    pub force: bool,
    /// The partition-swap ordering.
    #[serde(with = "by_name")]
    pub order: Order,
    /// Overlap each swap with the compute of the buckets that do not need it.
    pub prefetch: bool,
    /// Read each swap's partition ahead, into a spare slot (one more partition of memory on
    /// the engine: host RAM for the CPU, GPU memory for the GPU), while the buffer state before
    /// the swap trains; the evicted partition's write follows at once. Off: a swap reads into
    /// the slot its evicted partition frees, after writing it.
    pub read_ahead: bool,
    /// GPU engine: the largest share of the device's memory the train edges may take to stay
    /// on the device across epochs; above it each bucket is uploaded when it is trained.
    pub gpu_edge_fraction: f64,
    /// `proxy`: serve the store at a modelled SSD's rates and latency (a preset such as
    /// `samsung-980`, or `read=GB/s,write=GB/s,shared=true,iops=N,latency_us=N`), not as fast as
    /// the backing file allows.
    pub proxy_model: Option<String>,
    /// The number format of node embeddings at rest and in every copy (`f32`, `bf16`, `f16`):
    /// the AdaGrad step rounds to it, so the store, checkpoints and transfers narrow exactly.
    #[serde(with = "by_name")]
    pub dtype: Dtype,
    /// `[[storage.device]]`: the members of a store striped over several devices (files, block
    /// devices, device nodes or proxy backing files), in stripe order; in place of
    /// `storage.path`, `storage.namespace` and `storage.start_lba`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub device: Vec<StoreDevice>,
    /// Bytes of a stripe unit of a store over several devices: a multiple of 64 KiB.
    pub stripe_bytes: u64,
}

/// One `[[storage.device]]` table: a member of a striped store.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreDevice {
    /// The file or block device (`file`), device node (`nvme`) or backing file (`proxy`).
    pub path: PathBuf,
    /// `nvme`, `proxy`: the namespace holding this member (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<u32>,
    /// `nvme`, `proxy`: this member's first LBA (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_lba: Option<u64>,
}

impl Default for StorageConfig {
    fn default() -> Self {
        StorageConfig {
            num_partitions: 1,
            buffer_capacity: 0,
            backend: Backend::Memory,
            path: None,
            namespace: 1,
            start_lba: 0,
            force: false,
            order: Order::Auto,
            prefetch: true,
            read_ahead: true,
            gpu_edge_fraction: 0.25,
            proxy_model: None,
            dtype: Dtype::F32,
            device: Vec::new(),
            stripe_bytes: legend_storage::DEFAULT_STRIPE_BYTES,
        }
    }
}

/// `storage.backend`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// All partitions in RAM; swaps move them between the buffer and RAM.
    Memory,
    /// A store on a file or block device (`O_DIRECT` + io_uring).
    File,
    /// A store on a namespace of an SSD bound to `legend_nvme`, through I/O queue pairs.
    Nvme,
    /// The same through queue pairs of the userspace proxy controller over a file.
    Proxy,
}

impl Backend {
    /// The configuration name.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Memory => "memory",
            Backend::File => "file",
            Backend::Nvme => "nvme",
            Backend::Proxy => "proxy",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where `training.device` asks to train.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The CPU engine.
    Cpu,
    /// The GPU engine on CUDA device N.
    Cuda(usize),
    /// CUDA device 0 when a driver is present and the device opens (and the configuration
    /// runs on the GPU), else the CPU.
    Auto,
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceChoice::Cpu => f.write_str("cpu"),
            DeviceChoice::Cuda(n) => write!(f, "cuda:{n}"),
            DeviceChoice::Auto => f.write_str("auto"),
        }
    }
}

impl FromStr for DeviceChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cpu" => Ok(DeviceChoice::Cpu),
            "auto" => Ok(DeviceChoice::Auto),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceChoice::Cuda)
                .ok_or_else(|| format!("unknown device {s:?}: expected cpu, cuda:N or auto")),
        }
    }
}

/// `[training]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainingConfig {
    /// Epochs.
    pub num_epochs: u32,
    /// Positive edges per batch; parameters are updated after every batch.
    pub batch_size: usize,
    /// Seed of initialisation, shuffling and sampling.
    pub seed: u64,
    /// Worker threads (0 = one per core).
    pub threads: usize,
    /// Also write a checkpoint every this many epochs (0 = none by count).
    pub checkpoint_every: u32,
    /// Write a checkpoint before the first batch (or at the epoch end) this many minutes
    /// after the last one (0 = none by time); spaced further when checkpoints are slow (see
    /// [`crate::session::checkpoint_due`]).
    pub checkpoint_minutes: f64,
    /// The engine: `cpu`, `cuda:N` (the GPU engine on device N) or `auto` (`cuda:0` when a GPU
    /// opens). Was `storage.device`, still accepted with a warning.
    #[serde(with = "by_name")]
    pub device: DeviceChoice,
    /// GPUs trained on at once, one worker each (`training.device` then names the first: the
    /// workers take `cuda:0 .. cuda:K-1` of the devices `CUDA_VISIBLE_DEVICES` shows). With
    /// `training.device = "cpu"`, K workers of the CPU engine run the same schedule (the
    /// coordinator's reference, tested without GPUs). More than one sets
    /// `storage.num_partitions` to 2K (see `crate::workers`).
    pub gpus: u32,
    /// Negative sampling.
    pub negatives: NegativesConfig,
}

impl Default for TrainingConfig {
    fn default() -> Self {
        TrainingConfig {
            num_epochs: 50,
            batch_size: 100,
            seed: 0,
            threads: 0,
            checkpoint_every: 0,
            checkpoint_minutes: 30.0,
            device: DeviceChoice::Cpu,
            gpus: 1,
            negatives: NegativesConfig::default(),
        }
    }
}

/// `[optimizer]`: AdaGrad's settings and the layout of its state. Was `training.learning_rate`
/// and `training.adagrad_eps`, still read with a warning.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerConfig {
    /// The learning rate.
    pub learning_rate: f32,
    /// Added to the root of the state so that a zero state does not divide by zero.
    pub eps: f32,
    /// One accumulator per element (`element`) or per row (`row`, PyTorch-BigGraph's default:
    /// a row's state is 4 bytes instead of 4 × dim).
    #[serde(with = "by_name")]
    pub state: StateLayout,
    /// Weight penalty of the rows a batch's positives use: `none`, `n3` or `l2`.
    #[serde(with = "by_name")]
    pub regularizer: Penalty,
    /// λ of the regularizer, per occurrence of a row among a batch's positives.
    pub regularization_weight: f32,
    /// Epochs over which the learning rate climbs linearly to `learning_rate` (0 = none).
    pub warmup_epochs: u32,
    /// After the warm-up, the learning rate is multiplied by this every epoch (1 = constant).
    pub decay: f32,
    /// Reduce on plateau: the learning rate is multiplied by this after `plateau_patience`
    /// validation evaluations without a better MRR (1 = off; needs
    /// `evaluation.epochs_per_eval`).
    pub plateau_factor: f32,
    /// Evaluations without improvement before `plateau_factor` applies.
    pub plateau_patience: u32,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        let AdaGrad { lr, eps, state } = AdaGrad::default();
        OptimizerConfig {
            learning_rate: lr,
            eps,
            state,
            regularizer: Penalty::None,
            regularization_weight: 0.0,
            warmup_epochs: 0,
            decay: 1.0,
            plateau_factor: 1.0,
            plateau_patience: 2,
        }
    }
}

/// `[training.negatives]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NegativesConfig {
    /// Chunks per batch; the positives of a chunk share their negatives.
    pub num_chunks: usize,
    /// Negatives per positive and corrupted side, shared by the chunk.
    pub negatives_per_positive: usize,
    /// Fraction of negatives drawn proportionally to degree (the rest uniformly).
    pub degree_fraction: f64,
    /// Exclude sampled negatives that form a true train triple.
    pub filtered: bool,
}

impl Default for NegativesConfig {
    fn default() -> Self {
        NegativesConfig {
            num_chunks: 1,
            negatives_per_positive: 100,
            degree_fraction: 0.0,
            filtered: false,
        }
    }
}

/// `[evaluation]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvaluationConfig {
    /// How ranks are computed.
    pub protocol: Protocol,
    /// Split evaluated after training.
    pub split: EvalSplit,
    /// Evaluate on `valid` every this many epochs (0 = never during training).
    pub epochs_per_eval: u32,
    /// The protocol of those evaluations (default: `protocol`): `sampled` keeps them cheap on
    /// a large graph whose final evaluation is filtered.
    pub valid_protocol: Option<Protocol>,
    /// Early stopping: stop after this many validation evaluations without a better MRR
    /// (0 = train every epoch). With evaluations, the best epoch's tables are kept in `best/`
    /// and the final evaluation ranks them.
    pub patience: u32,
    /// With `epochs_per_eval`, write the best validated epoch's tables into the run's `best/`
    /// at each improvement and rank them (not the last epoch's) in the final evaluation.
    pub keep_best: bool,
    /// Uniform negatives of the sampled protocol.
    pub uniform_negatives: usize,
    /// Degree-based negatives of the sampled protocol.
    pub degree_negatives: usize,
    /// Seed of the sampled protocol.
    pub seed: u64,
}

impl Default for EvaluationConfig {
    fn default() -> Self {
        EvaluationConfig {
            protocol: Protocol::Filtered,
            split: EvalSplit::Test,
            epochs_per_eval: 0,
            valid_protocol: None,
            patience: 0,
            keep_best: true,
            uniform_negatives: 1000,
            degree_negatives: 1000,
            // `legendctl eval`'s default, so that it reproduces a run's own sampled figures.
            seed: legend_eval::DEFAULT_SEED,
        }
    }
}

/// `evaluation.protocol`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Protocol {
    /// Every entity is a candidate; true triples other than the one ranked are skipped.
    Filtered,
    /// Candidates are sampled (`uniform_negatives` + `degree_negatives`).
    Sampled,
}

impl Protocol {
    /// The configuration name.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Filtered => "filtered",
            Protocol::Sampled => "sampled",
        }
    }
}

impl FromStr for Protocol {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "filtered" => Ok(Protocol::Filtered),
            "sampled" => Ok(Protocol::Sampled),
            _ => Err(format!(
                "unknown protocol {s:?}: expected filtered or sampled"
            )),
        }
    }
}

/// `evaluation.split`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EvalSplit {
    /// The test edges.
    Test,
    /// The validation edges.
    Valid,
}

impl EvalSplit {
    /// The dataset's split.
    pub fn split(self) -> legend_dataset::Split {
        match self {
            EvalSplit::Test => legend_dataset::Split::Test,
            EvalSplit::Valid => legend_dataset::Split::Valid,
        }
    }
}

/// Serde through `FromStr` and `Display`, for the library types the configuration names.
pub(crate) mod by_name {
    use std::fmt::Display;
    use std::str::FromStr;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<T: Display, S: Serializer>(value: &T, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(value)
    }

    pub fn deserialize<'de, T, D>(d: D) -> Result<T, D::Error>
    where
        T: FromStr,
        T::Err: Display,
        D: Deserializer<'de>,
    {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// A configuration error; the message names the key.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

fn bad(key: &str, why: impl std::fmt::Display) -> ConfigError {
    ConfigError(format!("{key}: {why}"))
}

impl Config {
    /// Parses a TOML configuration and applies `key=value` overrides (dotted keys, TOML values;
    /// a value that is not valid TOML is taken as a string).
    pub fn parse(text: &str, overrides: &[String]) -> Result<Config, ConfigError> {
        let mut table: toml::Table =
            toml::from_str(text).map_err(|e| ConfigError(format!("invalid configuration: {e}")))?;
        for o in overrides {
            let (key, value) = o
                .split_once('=')
                .ok_or_else(|| ConfigError(format!("--set {o:?}: expected section.key=value")))?;
            set_dotted(&mut table, key.trim(), parse_value(value.trim()))?;
        }
        move_deprecated_keys(&mut table)?;
        // Deserialize from text, not from the table, so that an error carries a position from
        // which the offending key can be named.
        let resolved = toml::to_string(&table).expect("a TOML table always serializes");
        let mut config: Config =
            toml::from_str(&resolved).map_err(|e| ConfigError(name_key(&resolved, &e)))?;
        config.resolve_workers()?;
        config.validate()?;
        Ok(config)
    }

    /// The resolved configuration as TOML (written into the run directory).
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("configuration always serializes")
    }

    /// `model.decoder`.
    pub fn decoder(&self) -> Decoder {
        self.model.decoder
    }

    /// The loss of `model.loss` (with `model.margin` for the ranking loss).
    pub fn loss(&self) -> Loss {
        match self.model.loss {
            LossKind::SoftmaxCe => Loss::SoftmaxCe,
            LossKind::Logistic => Loss::Logistic,
            LossKind::Ranking => Loss::Ranking {
                margin: self.model.margin,
            },
            LossKind::SelfAdversarial => Loss::SelfAdversarial {
                margin: self.model.margin,
                temperature: self.model.adversarial_temperature,
            },
        }
    }

    /// The optimizer of `[optimizer]`.
    pub fn adagrad(&self) -> AdaGrad {
        let o = &self.optimizer;
        AdaGrad {
            lr: o.learning_rate,
            eps: o.eps,
            state: o.state,
        }
    }

    /// An entity row: `model.dim` in `storage.dtype` and the state of `optimizer.state`.
    pub fn entity_shape(&self) -> crate::rows::RowShape {
        crate::rows::RowShape::new(self.model.dim, self.optimizer.state)
            .with_dtype(self.storage.dtype)
    }

    /// The regularizer of `[optimizer]`, for rows of `model.decoder`.
    pub fn regularizer(&self) -> Regularizer {
        Regularizer::new(
            self.optimizer.regularizer,
            self.optimizer.regularization_weight,
            self.model.decoder,
        )
    }

    /// Rows of the relation table for a dataset of `relations` relation types: none for Dot,
    /// twice as many with reciprocal relations (r⁻¹ of relation r is row `relations + r`).
    pub fn relation_rows(&self, relations: u64) -> u64 {
        match (
            self.model.decoder.uses_relations(),
            self.model.reciprocal_relations,
        ) {
            (false, _) => 0,
            (true, false) => relations,
            (true, true) => 2 * relations,
        }
    }

    /// Floats of the relation table for a dataset of `relations` relation types: its
    /// [`Config::relation_rows`] times the decoder's relation row width (RESCAL's `dim²`
    /// matrices, `dim` for the others).
    pub fn relation_floats(&self, relations: u64) -> u64 {
        self.relation_rows(relations) * self.model.decoder.relation_width(self.model.dim) as u64
    }

    /// The initialisation of all tables.
    pub fn init(&self) -> Init {
        let node = Distribution::Normal {
            std: self.model.init_scale,
        };
        Init {
            seed: self.training.seed,
            node,
            relation: match self.model.relation_init {
                RelationStart::Random => RelationInit::Random(node),
                RelationStart::Identity => RelationInit::Identity,
            },
            node_dtype: self.storage.dtype,
        }
    }

    /// Whether partitions live in a store (`file`, `nvme`, `proxy`) rather than in RAM.
    pub fn uses_store(&self) -> bool {
        self.storage.backend != Backend::Memory
    }

    /// The proxy's modelled SSD (`storage.proxy_model`, checked when the configuration was read).
    pub fn proxy_model(&self) -> Option<DeviceModel> {
        self.storage
            .proxy_model
            .as_deref()
            .and_then(|m| m.parse().ok())
    }

    /// How the `nvme` and `proxy` backends reach their store (`None` for the others).
    pub fn queue_location(&self) -> Option<QueueLocation> {
        let backend = match self.storage.backend {
            Backend::Nvme => QueueBackend::Nvme,
            Backend::Proxy => QueueBackend::Proxy,
            Backend::Memory | Backend::File => return None,
        };
        Some(QueueLocation {
            backend,
            namespace: self.storage.namespace,
            start_lba: self.storage.start_lba,
        })
    }

    /// Where a new run's store goes: one member at [`Config::store_path`], or the members of
    /// `[[storage.device]]`.
    pub fn store_members(&self, run_dir: &std::path::Path) -> Vec<StoreMember> {
        if self.storage.device.is_empty() {
            return vec![StoreMember {
                path: self.store_path(run_dir),
                queue: self.queue_location(),
            }];
        }
        self.storage
            .device
            .iter()
            .map(|d| StoreMember {
                path: d.path.clone(),
                queue: self.queue_location().map(|q| QueueLocation {
                    namespace: d.namespace.unwrap_or(1),
                    start_lba: d.start_lba.unwrap_or(0),
                    ..q
                }),
            })
            .collect()
    }

    /// The store path: `storage.path`, else the backend's default (`run_dir/store.bin`, or
    /// `/dev/legend-nvme0` for `nvme`); the first member of a striped store.
    pub fn store_path(&self, run_dir: &std::path::Path) -> PathBuf {
        match (&self.storage.path, self.storage.backend) {
            (_, _) if !self.storage.device.is_empty() => self.storage.device[0].path.clone(),
            (Some(p), _) => p.clone(),
            (None, Backend::Nvme) => PathBuf::from("/dev/legend-nvme0"),
            (None, _) => run_dir.join("store.bin"),
        }
    }

    /// `storage.order`.
    pub fn order(&self) -> Order {
        self.storage.order
    }

    /// `training.device`.
    pub fn device(&self) -> DeviceChoice {
        self.training.device
    }

    /// Buffer capacity with 0 resolved to N.
    pub fn capacity(&self) -> u32 {
        match self.storage.buffer_capacity {
            0 => self.storage.num_partitions,
            c => c.min(self.storage.num_partitions),
        }
    }

    /// Whether each swap's partition is read ahead, into a spare slot, while the buffer state
    /// before it trains (`storage.read_ahead`, which needs `storage.prefetch`'s overlap).
    pub fn read_ahead(&self) -> bool {
        self.storage.read_ahead && self.storage.prefetch
    }

    /// Slots the engine holds partitions in: the C resident ones, and a spare one for the
    /// partition read ahead when there are swaps ([`Config::read_ahead`]).
    pub fn slots(&self) -> u32 {
        let c = self.capacity();
        if c < self.storage.num_partitions && self.read_ahead() {
            c + 1
        } else {
            c
        }
    }

    /// Refuses what a new run may not set but a run made before the check may hold in its
    /// `config.toml`, which must stay readable (resume, eval): a buffer larger than the
    /// partitions (it holds them all, as 0 does, so the setting misleads).
    pub fn check_new_run(&self) -> Result<(), ConfigError> {
        let s = &self.storage;
        if s.buffer_capacity > s.num_partitions {
            return Err(bad(
                "storage.buffer_capacity",
                format!(
                    "{} is more than storage.num_partitions = {}: the buffer holds at most every partition (0 = all of them); to keep only some in memory, raise storage.num_partitions",
                    s.buffer_capacity, s.num_partitions
                ),
            ));
        }
        Ok(())
    }

    /// Checks what spans keys (the types and names were checked as they were read).
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        self.model
            .decoder
            .check_dim(self.model.dim)
            .map_err(|e| bad("model.dim", e))?;
        positive_f32("model.margin", self.model.margin, true)?;
        positive_f32(
            "model.adversarial_temperature",
            self.model.adversarial_temperature,
            true,
        )?;
        positive_f32("model.init_scale", self.model.init_scale, false)?;
        // Upper bounds far beyond any useful run, so that no setting makes an allocation or
        // its size arithmetic overflow before the memory estimate can refuse the run (a daemon
        // runs its users' jobs in its own process).
        at_most("model.dim", self.model.dim, MAX_DIM)?;
        at_most("training.batch_size", self.training.batch_size, MAX_BATCH)?;
        at_most(
            "training.negatives.negatives_per_positive",
            self.training.negatives.negatives_per_positive,
            MAX_NEGATIVES,
        )?;
        at_most("training.threads", self.training.threads, MAX_THREADS)?;
        at_most(
            "storage.num_partitions",
            self.storage.num_partitions as usize,
            MAX_PARTITIONS,
        )?;
        let s = &self.storage;
        if s.num_partitions == 0 {
            return Err(bad("storage.num_partitions", "must be at least 1"));
        }
        if s.buffer_capacity == 1 && s.num_partitions > 1 {
            return Err(bad(
                "storage.buffer_capacity",
                "must be at least 2 when there are several partitions",
            ));
        }
        if s.namespace == 0 {
            return Err(bad("storage.namespace", "namespace ids start at 1"));
        }
        if !(0.0..=1.0).contains(&s.gpu_edge_fraction) {
            return Err(bad("storage.gpu_edge_fraction", "must be between 0 and 1"));
        }
        // The initial draw is at most 6.8 standard deviations from 0 (legend-model's
        // Box-Muller takes u1 ≥ 2^-33), so this keeps every initial f16 row finite.
        if s.dtype == Dtype::F16 && f64::from(self.model.init_scale) * 6.8 > 65504.0 {
            return Err(bad(
                "model.init_scale",
                "initial rows would overflow storage.dtype = \"f16\" (at most 9600)",
            ));
        }
        if let Some(model) = &s.proxy_model {
            if s.backend != Backend::Proxy {
                return Err(bad(
                    "storage.proxy_model",
                    "models the proxy's device: set storage.backend = \"proxy\" or remove it",
                ));
            }
            model
                .parse::<DeviceModel>()
                .map_err(|e| bad("storage.proxy_model", e))?;
        }
        self.validate_devices()?;
        let t = &self.training;
        if t.num_epochs == 0 {
            return Err(bad("training.num_epochs", "must be at least 1"));
        }
        if t.batch_size == 0 {
            return Err(bad("training.batch_size", "must be at least 1"));
        }
        if !(t.checkpoint_minutes.is_finite() && t.checkpoint_minutes >= 0.0) {
            return Err(bad(
                "training.checkpoint_minutes",
                format!("must be a finite number ≥ 0, got {}", t.checkpoint_minutes),
            ));
        }
        positive_f32(
            "optimizer.learning_rate",
            self.optimizer.learning_rate,
            false,
        )?;
        positive_f32("optimizer.eps", self.optimizer.eps, true)?;
        let o = &self.optimizer;
        positive_f32(
            "optimizer.regularization_weight",
            o.regularization_weight,
            true,
        )?;
        // Either half of a regulariser alone would silently do nothing.
        match (o.regularizer, o.regularization_weight > 0.0) {
            (Penalty::None, true) => {
                return Err(bad(
                    "optimizer.regularizer",
                    "optimizer.regularization_weight is set but no regularizer is: choose n3 or l2",
                ));
            }
            (Penalty::N3 | Penalty::L2, false) => {
                return Err(bad(
                    "optimizer.regularization_weight",
                    format!("must be > 0 with optimizer.regularizer = {}", o.regularizer),
                ));
            }
            _ => {}
        }
        if !(o.decay.is_finite() && o.decay > 0.0 && o.decay <= 1.0) {
            return Err(bad("optimizer.decay", "must be in (0, 1]"));
        }
        if !(o.plateau_factor.is_finite() && o.plateau_factor > 0.0 && o.plateau_factor <= 1.0) {
            return Err(bad("optimizer.plateau_factor", "must be in (0, 1]"));
        }
        let evaluates = self.evaluation.epochs_per_eval > 0;
        if o.plateau_factor < 1.0 && !evaluates {
            return Err(bad(
                "optimizer.plateau_factor",
                "reduces on a validation plateau: set evaluation.epochs_per_eval too",
            ));
        }
        if o.plateau_factor < 1.0 && o.plateau_patience == 0 {
            return Err(bad("optimizer.plateau_patience", "must be at least 1"));
        }
        if self.evaluation.patience > 0 && !evaluates {
            return Err(bad(
                "evaluation.patience",
                "stops on validation MRR: set evaluation.epochs_per_eval too",
            ));
        }
        if self.model.decoder == Decoder::RotatE && self.regularizer().is_active() {
            return Err(bad(
                "optimizer.regularizer",
                "rotate's relation rows are phases, which a norm penalty does not suit: use none",
            ));
        }
        if self.model.reciprocal_relations && !self.model.decoder.uses_relations() {
            return Err(bad(
                "model.reciprocal_relations",
                "dot has no relation parameters to invert",
            ));
        }
        let n = &t.negatives;
        if n.num_chunks == 0 || n.num_chunks > t.batch_size {
            return Err(bad(
                "training.negatives.num_chunks",
                format!(
                    "must be between 1 and training.batch_size ({})",
                    t.batch_size
                ),
            ));
        }
        if n.negatives_per_positive == 0 {
            return Err(bad(
                "training.negatives.negatives_per_positive",
                "must be at least 1",
            ));
        }
        if !(0.0..=1.0).contains(&n.degree_fraction) {
            return Err(bad(
                "training.negatives.degree_fraction",
                "must be between 0 and 1",
            ));
        }
        Ok(())
    }
}

/// `section.key: message` for a deserialization error in `text`, found from the error's span.
fn name_key(text: &str, e: &toml::de::Error) -> String {
    let key = e.span().and_then(|span| {
        let line_start = text[..span.start.min(text.len())]
            .rfind('\n')
            .map_or(0, |i| i + 1);
        let line = text[line_start..].lines().next()?.trim();
        if let Some(header) = line.strip_prefix('[') {
            return Some(header.trim_end_matches(']').to_owned());
        }
        let key = line.split('=').next()?.trim();
        let section = text[..line_start]
            .lines()
            .rev()
            .find_map(|l| l.trim().strip_prefix('['))
            .map(|h| h.trim_end_matches(']'));
        Some(match section {
            Some(section) => format!("{section}.{key}"),
            None => key.to_owned(),
        })
    });
    match key {
        Some(key) => format!("{key}: {}", in_words(&key, e.message())),
        None => format!("invalid configuration: {}", e.message()),
    }
}

/// Serde's Rust type names in a message about `key` said in words: `expected usize` becomes
/// `expected a whole number ≥ 1` (or `≥ 0` where the key takes 0, as the checks decide).
fn in_words(key: &str, message: &str) -> String {
    let whole = || {
        let floor = u8::from(Config::parse("", &[format!("{key}=0")]).is_err());
        format!("expected a whole number ≥ {floor}")
    };
    let mut out = message.to_owned();
    for ty in ["usize", "u64", "u32", "u16", "u8"] {
        let rust = format!("expected {ty}");
        if out.contains(&rust) {
            out = out.replace(&rust, &whole());
        }
    }
    for ty in ["f64", "f32"] {
        out = out.replace(&format!("expected {ty}"), "expected a number");
    }
    out
}

/// Largest `model.dim`: rows of 2^28 floats (1 GiB a row); with at most 2^32 entities every
/// table size stays within a u64.
const MAX_DIM: usize = 1 << 28;
/// Largest `training.batch_size`.
const MAX_BATCH: usize = 1 << 26;
/// Largest `training.negatives.negatives_per_positive` (PyTorch-BigGraph's largest published
/// settings use thousands).
const MAX_NEGATIVES: usize = 1 << 20;
/// Largest `training.threads`.
const MAX_THREADS: usize = 4096;
/// Largest `training.gpus`: one host's GPUs.
const MAX_GPUS: u32 = 64;

/// Largest `storage.num_partitions`: N² edge buckets (the Legend paper's largest N is 32).
const MAX_PARTITIONS: usize = 4096;

fn at_most(key: &str, v: usize, max: usize) -> Result<(), ConfigError> {
    if v > max {
        return Err(bad(
            key,
            format!("{v} is more than the largest allowed, {max}"),
        ));
    }
    Ok(())
}

fn positive_f32(key: &str, v: f32, zero_ok: bool) -> Result<(), ConfigError> {
    if !v.is_finite() || v < 0.0 || (!zero_ok && v == 0.0) {
        let want = if zero_ok {
            "a finite number ≥ 0"
        } else {
            "a finite number > 0"
        };
        return Err(bad(key, format!("must be {want}, got {v}")));
    }
    Ok(())
}

impl Config {
    /// With `training.gpus` = K > 1: N = 2K partitions (each GPU holds two, handed between
    /// GPUs; a configuration recorded with another K follows the new one), in host memory
    /// between epochs; refused otherwise, naming the key.
    fn resolve_workers(&mut self) -> Result<(), ConfigError> {
        let k = self.training.gpus;
        if k == 0 {
            return Err(bad("training.gpus", "must be at least 1"));
        }
        if k == 1 {
            return Ok(());
        }
        if k > MAX_GPUS {
            return Err(bad(
                "training.gpus",
                format!("{k}: at most {MAX_GPUS} GPUs train one run"),
            ));
        }
        let n = 2 * k;
        let s = &mut self.storage;
        if s.num_partitions != n {
            if s.num_partitions != 1 {
                tracing::info!(
                    "training.gpus = {k}: storage.num_partitions = {n} (two partitions a GPU) instead of {}",
                    s.num_partitions
                );
            }
            s.num_partitions = n;
        }
        s.buffer_capacity = 0;
        if s.backend != Backend::Memory {
            return Err(bad(
                "training.gpus",
                format!(
                    "{k} GPUs train a table held in their memory together, with storage.backend = \"memory\" (not {}): stores on disk or an SSD per GPU are not supported on several GPUs yet",
                    s.backend
                ),
            ));
        }
        if let DeviceChoice::Cuda(d) = self.training.device
            && d != 0
        {
            return Err(bad(
                "training.gpus",
                format!(
                    "the workers take the first {k} devices (cuda:0 .. cuda:{}): set training.device = \"cuda:0\" (or auto) and choose the GPUs with CUDA_VISIBLE_DEVICES, not cuda:{d}",
                    k - 1
                ),
            ));
        }
        Ok(())
    }

    /// Checks `[[storage.device]]` and `storage.stripe_bytes`.
    fn validate_devices(&self) -> Result<(), ConfigError> {
        let s = &self.storage;
        if s.stripe_bytes == 0 || !s.stripe_bytes.is_multiple_of(legend_storage::BASE_ALIGN) {
            return Err(bad(
                "storage.stripe_bytes",
                format!(
                    "{} bytes: must be a positive multiple of 65536 (64 KiB)",
                    s.stripe_bytes
                ),
            ));
        }
        if s.device.is_empty() {
            return Ok(());
        }
        if s.backend == Backend::Memory {
            return Err(bad(
                "storage.device",
                "lists the devices of a store: set storage.backend to file, nvme or proxy",
            ));
        }
        if s.path.is_some() {
            return Err(bad(
                "storage.path",
                "set either storage.path or [[storage.device]] tables, not both",
            ));
        }
        if s.device.len() > MAX_STORE_DEVICES {
            return Err(bad(
                "storage.device",
                format!(
                    "{} devices: a store is striped over at most {MAX_STORE_DEVICES}",
                    s.device.len()
                ),
            ));
        }
        for (i, d) in s.device.iter().enumerate() {
            let key = |k: &str| format!("storage.device[{i}].{k}");
            if s.backend == Backend::File && (d.namespace.is_some() || d.start_lba.is_some()) {
                let k = if d.namespace.is_some() {
                    "namespace"
                } else {
                    "start_lba"
                };
                return Err(bad(
                    &key(k),
                    "only for the nvme and proxy backends (a file member has no LBAs)",
                ));
            }
            if d.namespace == Some(0) {
                return Err(bad(&key("namespace"), "namespace ids start at 1"));
            }
            if let Some(j) = s.device[..i]
                .iter()
                .position(|e| e.path == d.path && e.namespace == d.namespace)
            {
                return Err(bad(
                    &key("path"),
                    format!("{} is also device {j}", d.path.display()),
                ));
            }
        }
        Ok(())
    }
}

/// Most `[[storage.device]]` tables (the store's limit on members).
const MAX_STORE_DEVICES: usize = 64;

/// Keys that moved: (old section, old key, new section, new key).
const MOVED_KEYS: [(&str, &str, &str, &str); 3] = [
    ("storage", "device", "training", "device"),
    ("training", "learning_rate", "optimizer", "learning_rate"),
    ("training", "adagrad_eps", "optimizer", "eps"),
];

/// Moves the keys of [`MOVED_KEYS`] to their new names, with a warning; both set is an error.
fn move_deprecated_keys(table: &mut toml::Table) -> Result<(), ConfigError> {
    for (old_section, old_key, new_section, new_key) in MOVED_KEYS {
        let Some(section) = table
            .get_mut(old_section)
            .and_then(toml::Value::as_table_mut)
        else {
            continue;
        };
        // `storage.device` as a string is the old `training.device`; as tables, the devices of
        // a striped store.
        let old = match section.get(old_key) {
            Some(v) if !v.is_array() => section.remove(old_key).expect("present"),
            _ => continue,
        };
        let section = table
            .entry(new_section)
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            .as_table_mut()
            .ok_or_else(|| bad(new_section, "must be a section"))?;
        if section.contains_key(new_key) {
            return Err(bad(
                &format!("{old_section}.{old_key}"),
                format!(
                    "the old name of {new_section}.{new_key}; set only {new_section}.{new_key}"
                ),
            ));
        }
        tracing::warn!("{old_section}.{old_key} is deprecated: it is now {new_section}.{new_key}");
        section.insert(new_key.into(), old);
    }
    Ok(())
}

fn parse_value(text: &str) -> toml::Value {
    // Parse as the right-hand side of a TOML assignment; fall back to a bare string.
    toml::from_str::<toml::Table>(&format!("v = {text}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(text.to_owned()))
}

/// Sets `key` (dotted: `section.key`, `training.negatives.num_chunks`) to `value`. Every part but
/// the last must be a section of the configuration's schema, checked before anything is built:
/// a key of any length never nests the table deeper than the schema does (a submitted key of
/// thousands of parts once built a table too deep to serialise or drop on a thread's stack).
fn set_dotted(table: &mut toml::Table, key: &str, value: toml::Value) -> Result<(), ConfigError> {
    let mut parts: Vec<&str> = key.split('.').collect();
    let last = parts
        .pop()
        .filter(|l| !l.is_empty())
        .ok_or_else(|| ConfigError(format!("--set: empty key in {key:?}")))?;
    let schema = toml::Table::try_from(Config::default()).expect("the defaults serialise");
    let mut section = &schema;
    for (i, p) in parts.iter().enumerate() {
        section = section
            .get(*p)
            .and_then(toml::Value::as_table)
            .ok_or_else(|| {
                let known: Vec<&str> = section
                    .iter()
                    .filter(|(_, v)| v.is_table())
                    .map(|(k, _)| k.as_str())
                    .collect();
                let path = parts[..=i].join(".");
                let known = if known.is_empty() {
                    format!("{} has no sections", parts[..i].join("."))
                } else {
                    format!("sections there: {}", known.join(", "))
                };
                // Quote at most the unknown part, not the whole (submitted) key.
                ConfigError(format!(
                    "--set: {}: not a section of the configuration ({known})",
                    shorten(&path)
                ))
            })?;
    }
    let mut t = table;
    for p in parts {
        t = t
            .entry(p)
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            .as_table_mut()
            .ok_or_else(|| ConfigError(format!("--set {key}: {p} is not a section")))?;
    }
    t.insert(last.to_owned(), value);
    Ok(())
}

/// `text`, cut to its first 80 characters with `…` when longer (for messages).
fn shorten(text: &str) -> String {
    match text.char_indices().nth(80) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_parse_from_nothing() {
        let c = Config::parse("", &[]).unwrap();
        assert_eq!(c, Config::default());
        assert_eq!(c.decoder(), Decoder::ComplEx);
        assert_eq!(
            c.evaluation.seed,
            legend_eval::DEFAULT_SEED,
            "as `legendctl eval`'s"
        );
    }

    #[test]
    fn overrides_and_file_values() {
        let c = Config::parse(
            "[model]\ndecoder = \"distmult\"\n[training.negatives]\nnum_chunks = 2\n",
            &[
                "model.dim=64".into(),
                "storage.order=beta".into(),
                "optimizer.learning_rate=0.05".into(),
            ],
        )
        .unwrap();
        assert_eq!(
            (c.decoder(), c.model.dim, c.storage.order),
            (Decoder::DistMult, 64, Order::Beta)
        );
        assert_eq!(c.training.negatives.num_chunks, 2);
        assert_eq!(c.optimizer.learning_rate, 0.05);
    }

    #[test]
    fn storage_devices_list_the_members_of_a_striped_store() {
        let text = "[storage]\nbackend = \"proxy\"\nstripe_bytes = 131072\n\
                    [[storage.device]]\npath = \"/a\"\n\
                    [[storage.device]]\npath = \"/b\"\nnamespace = 2\nstart_lba = 2048\n";
        let c = Config::parse(text, &[]).unwrap();
        let members = c.store_members(std::path::Path::new("/run"));
        let got: Vec<(String, u32, u64)> = members
            .iter()
            .map(|m| {
                let q = m.queue.unwrap();
                (m.path.display().to_string(), q.namespace, q.start_lba)
            })
            .collect();
        assert_eq!(got, [("/a".into(), 1, 0), ("/b".into(), 2, 2048)]);
        assert_eq!(c.storage.stripe_bytes, 128 << 10);
        // It survives the run's record of its configuration.
        assert_eq!(Config::parse(&c.to_toml(), &[]).unwrap(), c);
        let file = "[storage]\nbackend = \"file\"\n[[storage.device]]\npath = \"/a\"\n\
                    [[storage.device]]\npath = \"/b\"\n";
        let members = Config::parse(file, &[])
            .unwrap()
            .store_members("/run".as_ref());
        assert!(members.iter().all(|m| m.queue.is_none()) && members.len() == 2);
        // The old `storage.device = "cpu"` still moves to training.device.
        let old = Config::parse("[storage]\ndevice = \"cpu\"\n", &[]).unwrap();
        assert!(old.storage.device.is_empty() && old.training.device == DeviceChoice::Cpu);
        let refused: &[(&str, &str)] = &[
            (
                "[storage]\n[[storage.device]]\npath = \"/a\"\n",
                "storage.device: lists the devices of a store",
            ),
            (
                "[storage]\nbackend = \"file\"\npath = \"/x\"\n[[storage.device]]\npath = \"/a\"\n",
                "storage.path: set either storage.path or [[storage.device]]",
            ),
            (
                "[storage]\nbackend = \"file\"\n[[storage.device]]\npath = \"/a\"\nstart_lba = 8\n",
                "storage.device[0].start_lba: only for the nvme and proxy backends",
            ),
            (
                "[storage]\nbackend = \"nvme\"\n[[storage.device]]\npath = \"/a\"\nnamespace = 0\n",
                "storage.device[0].namespace: namespace ids start at 1",
            ),
            (
                "[storage]\nbackend = \"file\"\n[[storage.device]]\npath = \"/a\"\n[[storage.device]]\npath = \"/a\"\n",
                "storage.device[1].path: /a is also device 0",
            ),
            (
                "[storage]\nbackend = \"file\"\nstripe_bytes = 1000\n",
                "storage.stripe_bytes: 1000 bytes: must be a positive multiple of 65536",
            ),
            (
                "[storage]\nbackend = \"file\"\n[[storage.device]]\npat = \"/a\"\n",
                "pat",
            ),
        ];
        for (text, want) in refused {
            let err = Config::parse(text, &[]).unwrap_err().to_string();
            assert!(err.contains(want), "{text:?}: {err}");
        }
    }

    #[test]
    fn errors_name_the_key() {
        let cases: &[(&str, &[&str], &str)] = &[
            ("[model]\ndimension = 3\n", &[], "dimension"),
            ("[modle]\n", &[], "modle"),
            ("", &["model.decoder=linear"], "model.decoder"),
            ("", &["model.decoder=complex", "model.dim=7"], "model.dim"),
            ("", &["model.dim=\"big\""], "dim"),
            (
                "",
                &["model.dim=\"big\""],
                "model.dim: invalid type: string \"big\", expected a whole number ≥ 1",
            ),
            (
                "",
                &["storage.num_partitions=-2"],
                "storage.num_partitions: invalid value: integer `-2`, expected a whole number ≥ 1",
            ),
            (
                "",
                &["training.threads=1.5"],
                "training.threads: invalid type: floating point `1.5`, expected a whole number ≥ 0",
            ),
            (
                "",
                &["optimizer.learning_rate=\"fast\""],
                "optimizer.learning_rate: invalid type: string \"fast\", expected a number",
            ),
            (
                "",
                &["optimizer.learning_rate=-1"],
                "optimizer.learning_rate",
            ),
            (
                "",
                &["training.learning_rate=-1"],
                "optimizer.learning_rate",
            ),
            ("", &["optimizer.state=column"], "optimizer.state"),
            (
                "",
                &["training.adagrad_eps=0", "optimizer.eps=0"],
                "set only optimizer.eps",
            ),
            (
                "",
                &["training.checkpoint_minutes=-5"],
                "training.checkpoint_minutes: must be a finite number ≥ 0",
            ),
            (
                "",
                &["training.negatives.degree_fraction=2"],
                "training.negatives.degree_fraction",
            ),
            ("", &["training.device=\"gpu\""], "training.device"),
            ("", &["training.device=\"cuda:x\""], "training.device"),
            (
                "",
                &["storage.device=cpu", "training.device=cpu"],
                "set only training.device",
            ),
            ("", &["storage.backend=tape"], "storage.backend"),
            (
                "",
                &["storage.dtype=fp16"],
                "storage.dtype: unknown dtype \"fp16\": one of f32, bf16, f16",
            ),
            (
                "",
                &["storage.dtype=f16", "model.init_scale=10000"],
                "initial rows would overflow storage.dtype",
            ),
            ("", &["model.loss=hinge"], "model.loss"),
            ("", &["model.relation_init=zero"], "model.relation_init"),
            ("", &["evaluation.split=train"], "evaluation.split"),
            ("", &["storage.order=random"], "storage.order"),
            ("", &["evaluation.protocol=raw"], "evaluation.protocol"),
            ("", &["training.batch_size"], "section.key=value"),
            (
                "",
                &["training.negatives.negatives_per_positive=1000000000000"],
                "training.negatives.negatives_per_positive: 1000000000000 is more than the largest",
            ),
            (
                "",
                &["model.dim=4611686018427387904"],
                "model.dim: 4611686018427387904 is more",
            ),
            (
                "",
                &["training.threads=20000"],
                "training.threads: 20000 is more",
            ),
            (
                "",
                &["storage.num_partitions=4294967295"],
                "storage.num_partitions: 4294967295 is more",
            ),
            (
                "",
                &["training.batch_size=4611686018427387904"],
                "training.batch_size",
            ),
            (
                "",
                &["storage.proxy_model=\"samsung-980\""],
                "storage.proxy_model: models the proxy's device",
            ),
            (
                "",
                &[
                    "storage.backend=proxy",
                    "storage.proxy_model=\"read=1,write=fast\"",
                ],
                "storage.proxy_model: SSD model \"read=1,write=fast\": write = \"fast\"",
            ),
            ("[model\n", &[], "invalid configuration"),
            ("", &["modle.dim=3"], "modle: not a section"),
            ("", &["model.dim.x=3"], "model.dim: not a section"),
        ];
        for (text, sets, needle) in cases {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            let err = Config::parse(text, &sets).unwrap_err().to_string();
            assert!(
                err.contains(needle),
                "{text:?} {sets:?}: {err:?} lacks {needle:?}"
            );
        }
    }

    #[test]
    fn every_decoder_but_rotate_and_filtered_negatives_run_on_cuda() {
        for decoder in Decoder::ALL {
            if decoder == Decoder::RotatE {
                continue;
            }
            let sets = [
                "training.device=\"cuda:0\"".to_string(),
                format!("model.decoder={decoder}"),
                "training.negatives.filtered=true".to_string(),
            ];
            let c = Config::parse("", &sets).unwrap_or_else(|e| panic!("{decoder}: {e}"));
            assert_eq!(c.decoder(), decoder);
        }
    }

    #[test]
    fn quality_keys_are_checked() {
        let parse = |sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            Config::parse("", &sets)
        };
        let c = parse(&["model.reciprocal_relations=true", "model.decoder=distmult"]).unwrap();
        assert_eq!(c.relation_rows(5), 10);
        for (sets, key) in [
            (
                &["model.decoder=dot", "model.reciprocal_relations=true"][..],
                "model.reciprocal_relations",
            ),
            (&["optimizer.regularizer=n1"], "optimizer.regularizer"),
            (
                &["optimizer.regularizer=n3"],
                "optimizer.regularization_weight",
            ),
            (
                &["optimizer.regularization_weight=0.1"],
                "optimizer.regularizer",
            ),
            (
                &["optimizer.regularization_weight=-1"],
                "optimizer.regularization_weight",
            ),
            (&["optimizer.decay=1.5"], "optimizer.decay"),
            (
                &["optimizer.plateau_factor=0.5"],
                "optimizer.plateau_factor",
            ),
            (&["evaluation.patience=3"], "evaluation.patience"),
            (
                &[
                    "optimizer.plateau_factor=0.5",
                    "optimizer.plateau_patience=0",
                    "evaluation.epochs_per_eval=1",
                ],
                "optimizer.plateau_patience",
            ),
        ] {
            let err = parse(sets).unwrap_err().to_string();
            assert!(err.starts_with(key), "{sets:?}: {err}");
        }
    }

    #[test]
    fn a_proxy_models_an_ssd() {
        let sets = [
            "storage.backend=proxy".into(),
            "storage.proxy_model=\"samsung-980\"".into(),
        ];
        let c = Config::parse("", &sets).unwrap();
        assert_eq!(c.proxy_model(), Some(DeviceModel::SAMSUNG_980));
        assert_eq!(Config::default().proxy_model(), None);
    }

    #[test]
    fn the_old_device_key_still_works() {
        let c = Config::parse("[storage]\ndevice = \"auto\"\n", &[]).unwrap();
        assert_eq!(c.device(), DeviceChoice::Auto);
        let c = Config::parse("", &["storage.device=cuda:1".into()]).unwrap();
        assert_eq!(c.device(), DeviceChoice::Cuda(1));
        assert!(c.to_toml().contains("[training]") && !c.to_toml().contains("[storage]\ndevice"));
    }

    #[test]
    fn the_old_optimizer_keys_still_work() {
        let c = Config::parse(
            "[training]\nlearning_rate = 0.3\nadagrad_eps = 1e-6\n",
            &["optimizer.state=row".into()],
        )
        .unwrap();
        let opt = c.adagrad();
        assert_eq!((opt.lr, opt.eps, opt.state), (0.3, 1e-6, StateLayout::Row));
        let toml = c.to_toml();
        assert!(
            toml.contains("[optimizer]") && !toml.contains("adagrad_eps"),
            "{toml}"
        );
    }

    #[test]
    fn set_keys_deeper_than_the_schema_are_refused_before_anything_is_built() {
        for parts in [3, 2_000, 100_000] {
            let key = vec!["a"; parts].join(".");
            let err = Config::parse("", &[format!("{key}.b=1")])
                .unwrap_err()
                .to_string();
            assert!(err.contains("a: not a section"), "{parts}: {err}");
            assert!(
                err.len() < 200,
                "{parts}: the message quotes the key: {err}"
            );
        }
        let deep = format!("training.negatives.{}=1", vec!["x"; 50_000].join("."));
        let err = Config::parse("", &[deep]).unwrap_err().to_string();
        assert!(err.contains("training.negatives.x: not a section"), "{err}");
        assert!(err.contains("no sections"), "{err}");
    }

    #[test]
    fn resolved_config_round_trips() {
        let c = Config::parse("", &["storage.num_partitions=4".into()]).unwrap();
        assert_eq!(Config::parse(&c.to_toml(), &[]).unwrap(), c);
    }
}
