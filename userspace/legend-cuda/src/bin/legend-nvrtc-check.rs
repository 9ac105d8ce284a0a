//! Compiles every Legend kernel with NVRTC for each architecture named on the command line
//! (default: sm_80, sm_90 and sm_90a) and fails on any error or warning. With `--resources`, also
//! prints each kernel's registers and spills as ptxas reports them. Needs `libnvrtc.so.13`
//! on the library path, no GPU and no driver.

use std::process::ExitCode;

use legend_cuda::nvrtc;

/// Prints ptxas's registers and spill bytes for every kernel built for `arch`.
fn print_resources(arch: &str) -> Result<(), legend_cuda::GpuError> {
    println!("{arch}: registers a thread, spill stores / loads (bytes a thread)");
    for k in nvrtc::resource_usage(arch)? {
        println!(
            "  {:<32} {:>3}  {:>4} / {:<4}",
            k.name, k.registers, k.spill_stores, k.spill_loads
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let resources = args.iter().any(|a| a == "--resources");
    args.retain(|a| a != "--resources");
    let archs = if args.is_empty() {
        vec!["sm_80".into(), "sm_90".into(), "sm_90a".into()]
    } else {
        args
    };
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
        if resources && let Err(e) = print_resources(arch) {
            eprintln!("error: {e}");
            failed = true;
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
