//! The training configuration: TOML sections `model`, `storage`, `training`, `optimizer`,
//! `evaluation`.
//!
//! Every key has a default, so an empty file (or none) trains a sensible model. Unknown keys and
//! bad values are errors that name the key. `Documentation/config.md` lists every key.
//!
//! The text is parsed once, at the edge: names become enums as they are read (an unknown name is
//! an error naming its key), and [`Config::parse`] then checks what spans keys. Nothing
//! downstream compares strings.

use std::path::PathBuf;

use legend_model::{AdaGrad, Decoder, Distribution, Init, Loss, Regularizer, RelationInit};
use legend_nvme_proxy::DeviceModel;
use legend_planner::Order;
use serde::{Deserialize, Serialize};

use crate::store::location::{QueueBackend, QueueLocation, StoreMember};

mod schema;
mod text;
mod validate;

pub(crate) use schema::by_name;
pub use schema::{
    Backend, DeviceChoice, EvalSplit, EvaluationConfig, Freeze, LossKind, ModelConfig,
    NegativesConfig, NewRows, OptimizerConfig, Protocol, RelationStart, StorageConfig, StoreDevice,
    TrainingConfig,
};
use text::{Written, move_deprecated_keys, name_key, parse_value, refuse_retired_keys, set_dotted};

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
    /// The rows that stay fixed (`training.freeze = "existing"` in a run seeded by
    /// `--init-from`): not a key, set by the session from the run's record, for the engines.
    #[serde(skip)]
    pub frozen: Option<crate::incremental::Frozen>,
}

/// A configuration error; the message names the key.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

fn bad(key: &str, why: impl std::fmt::Display) -> ConfigError {
    ConfigError(format!("{key}: {why}"))
}

impl Config {
    /// Parses a new TOML configuration and applies `key=value` overrides (dotted keys, TOML
    /// values; a value that is not valid TOML is taken as a string). The retired string form
    /// of `storage.device` (now `training.device`) is refused, naming the key to use.
    pub fn parse(text: &str, overrides: &[String]) -> Result<Config, ConfigError> {
        Self::parse_as(text, overrides, Written::Now)
    }

    /// Parses a run's recorded configuration (its `config.toml`) with new `overrides`: as
    /// [`Config::parse`], but a configuration recorded before `storage.device` moved to
    /// `training.device` still reads (with a warning), so that its run resumes; the overrides
    /// are new, and held to [`Config::parse`]'s rules.
    pub fn parse_recorded(text: &str, overrides: &[String]) -> Result<Config, ConfigError> {
        Self::parse_as(text, overrides, Written::Recorded)
    }

    fn parse_as(text: &str, overrides: &[String], written: Written) -> Result<Config, ConfigError> {
        let mut table: toml::Table =
            toml::from_str(text).map_err(|e| ConfigError(format!("invalid configuration: {e}")))?;
        if written == Written::Now {
            refuse_retired_keys(&table)?;
        }
        for o in overrides {
            let (key, value) = o
                .split_once('=')
                .ok_or_else(|| ConfigError(format!("--set {o:?}: expected section.key=value")))?;
            let mut set = toml::Table::new();
            set_dotted(&mut set, key.trim(), parse_value(value.trim()))?;
            refuse_retired_keys(&set)?;
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
}

#[cfg(test)]
mod tests;
