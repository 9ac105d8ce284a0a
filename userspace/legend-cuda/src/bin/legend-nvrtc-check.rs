//! Compiles every Legend kernel with NVRTC for each architecture named on the command line
//! (default: sm_80, sm_90 and sm_90a) and fails on any error or warning. With `--resources`, also
//! prints each kernel's registers and spills as ptxas reports them; with `--ptx DIR`, writes
//! each program's PTX to `DIR/<program>.<arch>.ptx` (ptxas's notes name lines of it). Needs
//! `libnvrtc.so.13` on the library path, no GPU and no driver.

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
    let ptx_dir = args
        .iter()
        .position(|a| a == "--ptx")
        .map(|i| args.drain(i..(i + 2).min(args.len())).nth(1));
    let ptx_dir = match ptx_dir {
        Some(Some(dir)) => Some(std::path::PathBuf::from(dir)),
        Some(None) => {
            eprintln!("legend-nvrtc-check: --ptx needs a folder");
            return ExitCode::FAILURE;
        }
        None => None,
    };
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
        let failed_before = failed;
        // The report first: a repeated compile may come from NVRTC's cache, without one.
        if resources && let Err(e) = print_resources(arch) {
            eprintln!("error: {e}");
            failed = true;
        }
        match nvrtc::compile(arch) {
            Ok(programs) => {
                for (p, c) in nvrtc::PROGRAMS.iter().zip(&programs) {
                    if let Some(dir) = &ptx_dir {
                        let path = dir.join(format!("{}.{arch}.ptx", p.name));
                        if let Err(e) = std::fs::write(&path, &c.ptx) {
                            eprintln!("error: writing {}: {e}", path.display());
                            failed = true;
                        }
                    }
                    if !c.log.is_empty() {
                        eprintln!("error: {arch} {}: NVRTC warnings:\n{}", p.name, c.log);
                        failed = true;
                    }
                    let missing: Vec<&str> = p
                        .kernels
                        .iter()
                        .copied()
                        .filter(|n| !c.ptx.contains(&format!(".entry {n}(")))
                        .collect();
                    if !missing.is_empty() {
                        eprintln!("error: {arch} {}: missing {missing:?}", p.name);
                        failed = true;
                    }
                }
                let kernels = nvrtc::kernel_names().count();
                let code: usize = programs.iter().map(|c| c.cubin.len()).sum();
                println!(
                    "{}: {arch}, NVRTC {}.{}, {} programs, {kernels} kernels, {code} bytes of machine code",
                    if failed && !failed_before {
                        "checked"
                    } else {
                        "ok"
                    },
                    version.0,
                    version.1,
                    programs.len(),
                );
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
