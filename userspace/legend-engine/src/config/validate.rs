//! What [`Config::parse`] checks once the text is read: ranges, and what spans keys.

use legend_model::{Decoder, Dtype, Penalty};
use legend_nvme_proxy::DeviceModel;

use super::{Backend, Config, ConfigError, DeviceChoice, bad};

impl Config {
    /// Checks what spans keys (the types and names were checked as they were read).
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        self.validate_model()?;
        self.validate_limits()?;
        self.validate_storage()?;
        self.validate_devices()?;
        self.validate_training()?;
        self.validate_optimizer()?;
        self.validate_schedule()?;
        self.validate_relations()?;
        self.validate_negatives()
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

    /// `[model]`'s numbers.
    fn validate_model(&self) -> Result<(), ConfigError> {
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
        positive_f32("model.init_scale", self.model.init_scale, false)
    }

    /// Upper bounds of the sizes.
    fn validate_limits(&self) -> Result<(), ConfigError> {
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
        )
    }

    /// `[storage]` but its devices ([`Config::validate_devices`]).
    fn validate_storage(&self) -> Result<(), ConfigError> {
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
        Ok(())
    }

    /// `[training]` but its negatives.
    fn validate_training(&self) -> Result<(), ConfigError> {
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
        if !(0.0..=1.0).contains(&t.replay) {
            return Err(bad(
                "training.replay",
                format!("must lie in [0, 1], got {}", t.replay),
            ));
        }
        if t.freeze == super::Freeze::Existing && t.replay != 1.0 {
            return Err(bad(
                "training.replay",
                "has no use with training.freeze = \"existing\": only the edges touching a new row or relation train then (an old edge, both of its ends frozen, would change nothing)",
            ));
        }
        Ok(())
    }

    /// `[optimizer]`'s numbers, and a regulariser set by both of its keys.
    fn validate_optimizer(&self) -> Result<(), ConfigError> {
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
        Ok(())
    }

    /// What happens on validation evaluations (a plateau, early stopping) needs them.
    fn validate_schedule(&self) -> Result<(), ConfigError> {
        let o = &self.optimizer;
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
        Ok(())
    }

    /// What the decoder's relation rows allow.
    fn validate_relations(&self) -> Result<(), ConfigError> {
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
        Ok(())
    }

    /// `[training.negatives]`.
    fn validate_negatives(&self) -> Result<(), ConfigError> {
        let t = &self.training;
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
/// Largest `training.hosts` (N = 2·H·K stays within [`MAX_PARTITIONS`]'s order).
const MAX_HOSTS: u32 = 1024;

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
    /// With `training.gpus` = K and `training.hosts` = H, K·H > 1: N = 2·K·H partitions (each
    /// GPU holds two, handed between GPUs; a configuration recorded with another layout follows
    /// the new one), in host memory between epochs (and, on several hosts, negatives drawn
    /// unfiltered: a host holds only its buckets); refused otherwise, naming the key.
    pub(super) fn resolve_workers(&mut self) -> Result<(), ConfigError> {
        let (k, hosts) = (self.training.gpus, self.training.hosts);
        if k == 0 {
            return Err(bad("training.gpus", "must be at least 1"));
        }
        if hosts == 0 {
            return Err(bad("training.hosts", "must be at least 1"));
        }
        if k > MAX_GPUS {
            return Err(bad(
                "training.gpus",
                format!("{k}: at most {MAX_GPUS} GPUs a host train one run"),
            ));
        }
        if hosts > MAX_HOSTS {
            return Err(bad(
                "training.hosts",
                format!("{hosts}: at most {MAX_HOSTS} hosts train one run"),
            ));
        }
        if hosts > 1 && self.training.negatives.filtered {
            return Err(bad(
                "training.negatives.filtered",
                format!(
                    "a run on {hosts} hosts draws unfiltered negatives: each host holds only the edges its GPUs train, not the whole graph a filter needs"
                ),
            ));
        }
        // Both ≤ their maximum: no overflow.
        let k = k * hosts;
        if k == 1 {
            return Ok(());
        }
        // N = 2K keeps the table in the GPUs; N ≥ 3K parks partitions in host memory between
        // rounds (one host: a parked partition waits in that host's memory).
        let asked = self.storage.num_partitions;
        let n = if hosts == 1 && asked >= 3 * k {
            asked
        } else {
            2 * k
        };
        if n > legend_planner::MAX_PARKED_PARTITIONS && n != 2 * k {
            return Err(bad(
                "storage.num_partitions",
                format!(
                    "{n}: {k} GPUs park partitions in host memory between rounds with at most {} partitions (each GPU then holds 3 of them)",
                    legend_planner::MAX_PARKED_PARTITIONS
                ),
            ));
        }
        if n as usize > MAX_PARTITIONS {
            return Err(bad(
                "training.hosts",
                format!(
                    "{hosts} hosts of {gpus} GPUs need {n} partitions, more than the {MAX_PARTITIONS} a run may have",
                    gpus = self.training.gpus
                ),
            ));
        }
        let s = &mut self.storage;
        if s.num_partitions != n {
            // A resumed run keeps its N where it can; else (a new K) the partitions are laid
            // out anew.
            if asked != 1 {
                tracing::info!(
                    "{k} GPUs: storage.num_partitions = {n} (the table in their memory together) instead of {asked}{}",
                    if hosts == 1 {
                        format!(
                            "; {} or more park partitions in host memory between rounds",
                            3 * k
                        )
                    } else {
                        String::new()
                    }
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
        let gpus = self.training.gpus;
        if let DeviceChoice::Cuda(d) = self.training.device
            && d != 0
        {
            return Err(bad(
                "training.gpus",
                format!(
                    "the workers take the first {gpus} devices (cuda:0 .. cuda:{}): set training.device = \"cuda:0\" (or auto) and choose the GPUs with CUDA_VISIBLE_DEVICES, not cuda:{d}",
                    gpus - 1
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
