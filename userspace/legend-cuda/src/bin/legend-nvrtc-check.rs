//! Compiles every Legend kernel with NVRTC for each architecture named on the command line
//! (default: sm_80 and sm_90) and fails on any error or warning. Needs `libnvrtc.so.13` on
//! the library path, no GPU and no driver.

use std::process::ExitCode;

use legend_cuda::nvrtc;

fn main() -> ExitCode {
    let mut archs: Vec<String> = std::env::args().skip(1).collect();
    if archs.is_empty() {
        archs = vec!["sm_80".into(), "sm_90".into()];
    }
    let version = match nvrtc::nvrtc_version() {
        Ok(v) => v,
        Err(e) => {
            eprintln!("legend-nvrtc-check: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut failed = false;
    for arch in &archs {
        match nvrtc::compile(arch) {
            Ok(c) if c.log.is_empty() => {
                let entries = nvrtc::KERNEL_NAMES
                    .iter()
                    .filter(|n| c.ptx.contains(&format!(".entry {n}(")))
                    .count();
                if entries == nvrtc::KERNEL_NAMES.len() {
                    println!(
                        "ok: {arch}, NVRTC {}.{}, {entries} kernels, {} bytes of PTX",
                        version.0,
                        version.1,
                        c.ptx.len()
                    );
                } else {
                    eprintln!(
                        "error: {arch}: {entries} of {} kernels in the PTX",
                        nvrtc::KERNEL_NAMES.len()
                    );
                    failed = true;
                }
            }
            Ok(c) => {
                eprintln!("error: {arch}: NVRTC warnings:\n{}", c.log);
                failed = true;
            }
            Err(e) => {
                eprintln!("error: {e}");
                failed = true;
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
