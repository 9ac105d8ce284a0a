/work/main/tests/kmod/selftest/target/release/deps/legend_kmod_selftest-782be4d382fe3941.d: src/main.rs src/basic.rs src/bind.rs src/dev.rs src/failure.rs src/gpu.rs src/legendctl.rs src/rules.rs

/work/main/tests/kmod/selftest/target/release/deps/legend_kmod_selftest-782be4d382fe3941: src/main.rs src/basic.rs src/bind.rs src/dev.rs src/failure.rs src/gpu.rs src/legendctl.rs src/rules.rs

src/main.rs:
src/basic.rs:
src/bind.rs:
src/dev.rs:
src/failure.rs:
src/gpu.rs:
src/legendctl.rs:
src/rules.rs:
