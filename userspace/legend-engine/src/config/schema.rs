//! The configuration's sections and the names its keys take, with their defaults.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use legend_model::{AdaGrad, Decoder, Dtype, Penalty, StateLayout, UnknownName};
use legend_planner::Order;
use serde::{Deserialize, Serialize};

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
    type Err = UnknownName;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cpu" => Ok(DeviceChoice::Cpu),
            "auto" => Ok(DeviceChoice::Auto),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceChoice::Cuda)
                .ok_or_else(|| UnknownName::new("device", s, "expected cpu, cuda:N or auto")),
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
    /// `storage.num_partitions` to 2K (the table in the GPUs' memory together) unless it is at
    /// least 3K on one host (partitions parked in host memory between rounds, read ahead; see
    /// `crate::workers`).
    pub gpus: u32,
    /// Hosts H the run spreads over, `training.gpus` GPUs each (one process a host, launched
    /// with `legendctl train --hosts` or by torchrun or Slurm, which set it): N = 2·H·K.
    pub hosts: u32,
    /// Negative sampling.
    pub negatives: NegativesConfig,
    /// A run seeded from another (`--init-from`): which rows train. `none` (all of them) or
    /// `existing` (the rows and relations the init run had stay fixed, only the new ones and
    /// the edges touching them train).
    pub freeze: Freeze,
    /// A run seeded from another: the fraction of the base dataset's train edges trained each
    /// epoch with the added ones (1: every edge; 0: only the added edges). A sample drawn once
    /// with `training.seed`.
    pub replay: f64,
    /// A run seeded from another: whether the init run's AdaGrad state comes with its rows
    /// (else the carried rows start with fresh state, and take larger steps at first).
    pub carry_state: bool,
    /// A run seeded from another: how the new entities' rows start.
    pub new_rows: NewRows,
}

/// `training.freeze`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Freeze {
    /// Every row trains.
    #[default]
    None,
    /// The init run's rows and relations stay as they were (ids below its counts).
    Existing,
}

/// `training.new_rows`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NewRows {
    /// Drawn as a new run's rows are (`model.init_scale`).
    #[default]
    Init,
    /// The mean of the rows of the entity's neighbours in the added train edges that the init
    /// run trained (drawn as `init` when it has none).
    Neighbours,
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
            hosts: 1,
            negatives: NegativesConfig::default(),
            freeze: Freeze::None,
            replay: 1.0,
            carry_state: true,
            new_rows: NewRows::Init,
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
    type Err = UnknownName;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "filtered" => Ok(Protocol::Filtered),
            "sampled" => Ok(Protocol::Sampled),
            _ => Err(UnknownName::new(
                "protocol",
                s,
                "expected filtered or sampled",
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
