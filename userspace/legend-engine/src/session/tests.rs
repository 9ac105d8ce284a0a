use std::time::Duration;

use super::*;
use legend_model::StateLayout;

#[test]
fn an_epochs_store_writes_are_its_swaps_partitions() {
    // The Twitter-shaped run from a modelled SSD (benchmarks.md): N = 8, C = 3, the Legend
    // order's 16 buffer states; epoch 2 measured 62.48 GB written.
    let plan = legend_planner::plan(8, 3, legend_planner::Order::Legend).unwrap();
    assert_eq!(plan.io_count, 16);
    let element = RowShape::new(100, StateLayout::Element);
    let bytes = store_bytes_per_epoch(41_652_230, element, &plan);
    assert_eq!(bytes, 15 * 5_206_529 * 800);
    assert!((bytes as f64 / 1e9 - 62.48).abs() < 0.01);
    // Row-wise state: 404 bytes a row.
    let row = RowShape::new(100, StateLayout::Row);
    assert_eq!(
        store_bytes_per_epoch(41_652_230, row, &plan),
        15 * 5_206_529 * 404
    );
    // One partition: nothing moves.
    let one = legend_planner::plan(1, 1, legend_planner::Order::Auto).unwrap();
    assert_eq!(store_bytes_per_epoch(1000, element, &one), 0);
}

#[test]
fn the_wear_line_says_percent_used_and_bytes_written() {
    let h = legend_nvme::Health {
        critical_warning: 0,
        temperature_kelvin: 300,
        available_spare: 100,
        percentage_used: 3,
        data_units_read: 0,
        // 1.5 TB in 1000 × 512-byte units.
        data_units_written: 2_929_688,
        power_on_hours: 0,
        unsafe_shutdowns: 0,
        media_errors: 0,
    };
    assert_eq!(
        describe_wear(&h),
        "; the device reports 3% of its rated endurance used, 1.50 TB written in its life"
    );
}

#[test]
fn timed_checkpoints_bound_the_work_lost_and_their_own_cost() {
    let min = |m: u64| Duration::from_secs(60 * m);
    let half_hour = min(30);
    // The first one half an hour in (no cost known yet), not before.
    assert!(!checkpoint_due(min(29), Duration::ZERO, half_hour));
    assert!(checkpoint_due(min(30), Duration::ZERO, half_hour));
    // A 16 s checkpoint (33 GB at 2 GB/s) keeps the half hour: 0.9 % of the time.
    assert!(checkpoint_due(min(30), Duration::from_secs(16), half_hour));
    // A 165 s one (33 GB at 200 MB/s) waits 55 minutes: 5 % of the time.
    assert!(!checkpoint_due(
        min(54),
        Duration::from_secs(165),
        half_hour
    ));
    assert!(checkpoint_due(min(55), Duration::from_secs(165), half_hour));
    // 0 minutes: never by time.
    assert!(!checkpoint_due(min(600), Duration::ZERO, Duration::ZERO));
}

#[test]
fn the_default_checkpoints_every_half_hour() {
    let c = Config::default();
    assert_eq!(
        (c.training.checkpoint_minutes, c.training.checkpoint_every),
        (30.0, 0)
    );
    let c = Config::parse("[training]\ncheckpoint_minutes = 5\n", &[]).unwrap();
    assert_eq!(
        c.training.checkpoint_minutes, 5.0,
        "a whole number of minutes"
    );
}
