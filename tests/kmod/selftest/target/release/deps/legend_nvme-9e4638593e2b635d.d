/work/main/tests/kmod/selftest/target/release/deps/legend_nvme-9e4638593e2b635d.d: /work/main/userspace/legend-nvme/src/lib.rs /work/main/userspace/legend-nvme/src/device.rs /work/main/userspace/legend-nvme/src/sysfs.rs

/work/main/tests/kmod/selftest/target/release/deps/liblegend_nvme-9e4638593e2b635d.rlib: /work/main/userspace/legend-nvme/src/lib.rs /work/main/userspace/legend-nvme/src/device.rs /work/main/userspace/legend-nvme/src/sysfs.rs

/work/main/tests/kmod/selftest/target/release/deps/liblegend_nvme-9e4638593e2b635d.rmeta: /work/main/userspace/legend-nvme/src/lib.rs /work/main/userspace/legend-nvme/src/device.rs /work/main/userspace/legend-nvme/src/sysfs.rs

/work/main/userspace/legend-nvme/src/lib.rs:
/work/main/userspace/legend-nvme/src/device.rs:
/work/main/userspace/legend-nvme/src/sysfs.rs:
