/work/main/tests/kmod/selftest/target/release/deps/legend_uapi-b17e347df1e7da4d.d: /work/main/userspace/legend-uapi/src/lib.rs /work/main/userspace/legend-uapi/src/../../../kmod/uapi.rs

/work/main/tests/kmod/selftest/target/release/deps/liblegend_uapi-b17e347df1e7da4d.rlib: /work/main/userspace/legend-uapi/src/lib.rs /work/main/userspace/legend-uapi/src/../../../kmod/uapi.rs

/work/main/tests/kmod/selftest/target/release/deps/liblegend_uapi-b17e347df1e7da4d.rmeta: /work/main/userspace/legend-uapi/src/lib.rs /work/main/userspace/legend-uapi/src/../../../kmod/uapi.rs

/work/main/userspace/legend-uapi/src/lib.rs:
/work/main/userspace/legend-uapi/src/../../../kmod/uapi.rs:
