use super::*;
use legend_model::StateLayout;

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
    // A recorded `storage.device = "cpu"` still moves to training.device.
    let old = Config::parse_recorded("[storage]\ndevice = \"cpu\"\n", &[]).unwrap();
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
            "set training.device = \"cpu\"",
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
fn the_old_device_key_is_refused_in_new_configurations_and_read_in_recorded_ones() {
    let old = "[storage]\ndevice = \"auto\"\n";
    for e in [
        Config::parse(old, &[]).unwrap_err(),
        Config::parse("", &["storage.device=cuda:1".into()]).unwrap_err(),
        Config::parse_recorded("", &["storage.device=cuda:1".into()]).unwrap_err(),
    ] {
        let e = e.to_string();
        assert!(
            e.starts_with("storage.device: ") && e.contains("set training.device = "),
            "{e}"
        );
    }
    let e = Config::parse("[storage]\ndevice = 3\n", &[]).unwrap_err();
    assert!(e.to_string().contains("training.device"), "{e}");
    // A run recorded before the move still resumes, with the engine it recorded.
    let c = Config::parse_recorded(old, &[]).unwrap();
    assert_eq!(c.device(), DeviceChoice::Auto);
    assert!(c.to_toml().contains("[training]") && !c.to_toml().contains("[storage]\ndevice"));
    let both = "[storage]\ndevice = \"auto\"\n[training]\ndevice = \"cpu\"\n";
    assert!(Config::parse_recorded(both, &[]).is_err());
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

#[test]
fn several_gpus_take_two_k_partitions_or_keep_three_k_and_more_on_one_host() {
    let partitions = |sets: &[&str]| {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        Config::parse("", &sets).unwrap().storage.num_partitions
    };
    assert_eq!(partitions(&["training.gpus=3"]), 6);
    // Between 2K and 3K no partition could be read ahead: 2K.
    assert_eq!(
        partitions(&["training.gpus=3", "storage.num_partitions=8"]),
        6
    );
    // At least 3K: parked in host memory between rounds, kept (and a resumed run's N kept).
    for n in [9, 10, 31] {
        let set = format!("storage.num_partitions={n}");
        assert_eq!(partitions(&["training.gpus=3", &set]), n);
    }
    let err = Config::parse(
        "",
        &[
            "training.gpus=3".into(),
            "storage.num_partitions=300".into(),
        ],
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("storage.num_partitions") && err.contains("at most 256"),
        "{err}"
    );
    // Several hosts hold the table in their GPUs: 2HK.
    assert_eq!(
        partitions(&[
            "training.gpus=2",
            "training.hosts=2",
            "storage.num_partitions=12",
            "training.negatives.filtered=false"
        ]),
        8
    );
}
