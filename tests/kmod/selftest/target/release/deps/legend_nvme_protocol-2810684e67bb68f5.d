/work/main/tests/kmod/selftest/target/release/deps/legend_nvme_protocol-2810684e67bb68f5.d: /work/main/userspace/legend-nvme-protocol/src/lib.rs /work/main/userspace/legend-nvme-protocol/src/doorbell.rs /work/main/userspace/legend-nvme-protocol/src/prp.rs /work/main/userspace/legend-nvme-protocol/src/queue.rs /work/main/userspace/legend-nvme-protocol/src/status.rs

/work/main/tests/kmod/selftest/target/release/deps/liblegend_nvme_protocol-2810684e67bb68f5.rlib: /work/main/userspace/legend-nvme-protocol/src/lib.rs /work/main/userspace/legend-nvme-protocol/src/doorbell.rs /work/main/userspace/legend-nvme-protocol/src/prp.rs /work/main/userspace/legend-nvme-protocol/src/queue.rs /work/main/userspace/legend-nvme-protocol/src/status.rs

/work/main/tests/kmod/selftest/target/release/deps/liblegend_nvme_protocol-2810684e67bb68f5.rmeta: /work/main/userspace/legend-nvme-protocol/src/lib.rs /work/main/userspace/legend-nvme-protocol/src/doorbell.rs /work/main/userspace/legend-nvme-protocol/src/prp.rs /work/main/userspace/legend-nvme-protocol/src/queue.rs /work/main/userspace/legend-nvme-protocol/src/status.rs

/work/main/userspace/legend-nvme-protocol/src/lib.rs:
/work/main/userspace/legend-nvme-protocol/src/doorbell.rs:
/work/main/userspace/legend-nvme-protocol/src/prp.rs:
/work/main/userspace/legend-nvme-protocol/src/queue.rs:
/work/main/userspace/legend-nvme-protocol/src/status.rs:
