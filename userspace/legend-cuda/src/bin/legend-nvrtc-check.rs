//! Compiles every Legend kernel with NVRTC for each architecture named on the command line
//! (default: sm_80, sm_90 and sm_90a) and fails on any error or warning. With `--resources`, also
//! prints each kernel's registers and spills as ptxas reports them; with `--dump DIR`, writes
//! each program's PTX and machine code to `DIR/<program>.<arch>.ptx` and `.cubin` (ptxas's
//! notes name lines of the PTX; nvdisasm reads the machine code). Needs
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
    let dump_dir = args
        .iter()
        .position(|a| a == "--dump")
        .map(|i| args.drain(i..(i + 2).min(args.len())).nth(1));
    let dump_dir = match dump_dir {
        Some(Some(dir)) => Some(std::path::PathBuf::from(dir)),
        Some(None) => {
            eprintln!("legend-nvrtc-check: --dump needs a folder");
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
        // A compile takes tens of seconds on a busy machine: say what is being waited for.
        eprintln!(
            "compiling {} programs for {arch} with NVRTC",
            nvrtc::PROGRAMS.len()
        );
        let started = std::time::Instant::now();
        match nvrtc::compile(arch) {
            Ok(programs) => {
                for (p, c) in nvrtc::PROGRAMS.iter().zip(&programs) {
                    if let Some(dir) = &dump_dir {
                        for (ext, bytes) in [("ptx", c.ptx.as_bytes()), ("cubin", &c.cubin[..])] {
                            let path = dir.join(format!("{}.{arch}.{ext}", p.name));
                            if let Err(e) = std::fs::write(&path, bytes) {
                                eprintln!("error: writing {}: {e}", path.display());
                                failed = true;
                            }
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
                    "{}: {arch}, NVRTC {}.{}, {} programs, {kernels} kernels, {code} bytes of machine code, {:.0} s",
                    if failed && !failed_before {
                        "checked"
                    } else {
                        "ok"
                    },
                    version.0,
                    version.1,
                    programs.len(),
                    started.elapsed().as_secs_f64(),
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
