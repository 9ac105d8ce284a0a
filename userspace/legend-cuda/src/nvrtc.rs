//! Run-time compilation of the kernels with NVRTC, and the per-architecture cache of the
//! machine code.
//!
//! The kernels are eleven programs: the fused kernels of each padded width and decoder family
//! (most of the compile time), the NVMe I/O kernels, the query scans, and everything else. They compile in parallel, each to the device's own
//! machine code (CUBIN), so a first start waits for the slowest program rather than for all
//! of them and then for the driver to translate PTX.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

use cudarc::nvrtc::{result, sys};

use crate::GpuError;

/// The kernel sources, in the order a program concatenates them. `common.cuh` goes first,
/// so the programs need no include path.
pub const KERNEL_SOURCES: [(&str, &str); 25] = [
    ("common.cuh", include_str!("../../../kernels/common.cuh")),
    ("init.cu", include_str!("../../../kernels/init.cu")),
    ("sample.cu", include_str!("../../../kernels/sample.cu")),
    ("batch.cu", include_str!("../../../kernels/batch.cu")),
    ("gemm.cu", include_str!("../../../kernels/gemm.cu")),
    ("distance.cu", include_str!("../../../kernels/distance.cu")),
    (
        "train_queries.cu",
        include_str!("../../../kernels/train_queries.cu"),
    ),
    (
        "train_loss.cu",
        include_str!("../../../kernels/train_loss.cu"),
    ),
    (
        "train_filter.cu",
        include_str!("../../../kernels/train_filter.cu"),
    ),
    (
        "train_backward.cu",
        include_str!("../../../kernels/train_backward.cu"),
    ),
    (
        "train_adagrad.cu",
        include_str!("../../../kernels/train_adagrad.cu"),
    ),
    ("rotate.cu", include_str!("../../../kernels/rotate.cu")),
    ("rescal.cu", include_str!("../../../kernels/rescal.cu")),
    ("fused.cuh", include_str!("../../../kernels/fused.cuh")),
    (
        "fused_loss.cuh",
        include_str!("../../../kernels/fused_loss.cuh"),
    ),
    (
        "fused_ptx.cuh",
        include_str!("../../../kernels/fused_ptx.cuh"),
    ),
    (
        "fused_rows_sm80.cu",
        include_str!("../../../kernels/fused_rows_sm80.cu"),
    ),
    (
        "fused_negatives.cu",
        include_str!("../../../kernels/fused_negatives.cu"),
    ),
    (
        "fused_rows_sm90.cu",
        include_str!("../../../kernels/fused_rows_sm90.cu"),
    ),
    (
        "fused_prepare.cu",
        include_str!("../../../kernels/fused_prepare.cu"),
    ),
    (
        "fused_launch.cu",
        include_str!("../../../kernels/fused_launch.cu"),
    ),
    ("nvme_io.cuh", include_str!("../../../kernels/nvme_io.cuh")),
    ("nvme_io.cu", include_str!("../../../kernels/nvme_io.cu")),
    (
        "row_cache.cu",
        include_str!("../../../kernels/row_cache.cu"),
    ),
    ("scan.cu", include_str!("../../../kernels/scan.cu")),
];

/// One NVRTC program: the sources it concatenates (groups of file names), the fused width it defines
/// (`LEGEND_FUSED_WIDTH`; 0 for the program of the other kernels) and its entry points.
#[derive(Debug)]
pub struct Program {
    /// Names the program in logs and cache files.
    pub name: &'static str,
    sources: &'static [&'static [&'static str]],
    /// The padded width of the fused kernels it defines (`LEGEND_FUSED_WIDTH`; 0: none).
    pub fused_width: u32,
    /// Whether its fused kernels are TransE L2's (`LEGEND_FUSED_TRANSE`).
    pub transe: bool,
    /// The kernels it defines.
    pub kernels: &'static [&'static str],
}

/// The fused kernels' files, in the order they build on each other (fused.cuh describes them).
const FUSED_FILES: &[&str] = &[
    "fused.cuh",
    "fused_loss.cuh",
    "fused_ptx.cuh",
    "fused_rows_sm80.cu",
    "fused_negatives.cu",
    "fused_rows_sm90.cu",
    "fused_prepare.cu",
    "fused_launch.cu",
];

/// The fused kernels need only the shared definitions and their own files.
const FUSED_SOURCES: &[&[&str]] = &[&["common.cuh"], FUSED_FILES];

/// The program of the fused kernels of padded width `$w` (`LEGEND_FUSED_PAIR` in
/// fused_launch.cu), for the dot decoders or (`transe`) for TransE L2.
macro_rules! fused_program {
    ($w:literal) => {
        Program {
            name: concat!("fused_d", $w),
            sources: FUSED_SOURCES,
            fused_width: $w,
            transe: false,
            kernels: &[
                concat!("legend_fused_rows_d", $w),
                concat!("legend_fused_negatives_d", $w),
            ],
        }
    };
    ($w:literal, transe) => {
        Program {
            name: concat!("fused_transe_d", $w),
            sources: FUSED_SOURCES,
            fused_width: $w,
            transe: true,
            kernels: &[
                concat!("legend_fused_transe_rows_d", $w),
                concat!("legend_fused_transe_negatives_d", $w),
            ],
        }
    };
}

/// Every program, the one with the most kernels first, then the fused ones narrowest first
/// (the dot decoders', then TransE L2's), then the NVMe I/O kernels and the query scans
/// (self-contained: they share nothing with the training kernels).
pub const PROGRAMS: [Program; 11] = [
    Program {
        name: "kernels",
        sources: &[
            &[
                "common.cuh",
                "init.cu",
                "sample.cu",
                "batch.cu",
                "gemm.cu",
                "distance.cu",
                "train_queries.cu",
                "train_loss.cu",
                "train_filter.cu",
                "train_backward.cu",
                "train_adagrad.cu",
                "rotate.cu",
                "rescal.cu",
            ],
            FUSED_FILES,
        ],
        fused_width: 0,
        transe: false,
        kernels: &[
            "legend_init_rows",
            "legend_narrow_rows",
            "legend_widen_rows",
            "legend_rng_vectors",
            "legend_sample_negatives",
            "legend_remap_ids",
            "legend_gather_batch",
            "legend_gemm_nt",
            "legend_gemm_nn",
            "legend_gemm_tn",
            "legend_dist_scores",
            "legend_dist_grad_query",
            "legend_dist_grad_negatives",
            "legend_queries",
            "legend_gather_negatives",
            "legend_loss",
            "legend_rows_backward",
            "legend_rows_backward_rounded",
            "legend_rows_backward_extra",
            "legend_negatives_backward",
            "legend_adagrad",
            "legend_count_uses",
            "legend_filter_known",
            "legend_rotate_queries",
            "legend_rotate_rows_backward",
            "legend_modulus_scores",
            "legend_modulus_grad_query",
            "legend_modulus_grad_negatives",
            "legend_rescal_queries",
            "legend_rescal_rows_backward",
            "legend_fused_absmax",
            "legend_gather_negatives_half",
            "legend_fused_negative_norms",
        ],
    },
    fused_program!(32),
    fused_program!(64),
    fused_program!(104),
    fused_program!(128),
    fused_program!(32, transe),
    fused_program!(64, transe),
    fused_program!(104, transe),
    fused_program!(128, transe),
    Program {
        name: "nvme_io",
        sources: &[&["nvme_io.cuh", "nvme_io.cu", "row_cache.cu"]],
        fused_width: 0,
        transe: false,
        kernels: &[
            "legend_nvme_io",
            "legend_nvme_sqe_vectors",
            "legend_row_cache_lookup",
        ],
    },
    Program {
        name: "scan",
        sources: &[&["scan.cu"]],
        fused_width: 0,
        transe: false,
        kernels: &[
            "legend_scan_score",
            "legend_scan_select",
            "legend_scan_reset",
            "legend_scan_norms",
            "legend_scan_gather",
        ],
    },
];

/// Every kernel entry point, over all programs.
pub fn kernel_names() -> impl Iterator<Item = &'static str> {
    PROGRAMS.iter().flat_map(|p| p.kernels.iter().copied())
}

impl Program {
    /// The program's source: its files, each preceded by a `#line` marker so that NVRTC's
    /// messages name the original file and line. The files are the ones built into the
    /// binary, or, when `LEGEND_KERNELS_DIR` names a folder, that folder's files of the same
    /// names: kernel work on a GPU machine that has no Rust toolchain to rebuild with.
    pub fn source(&self) -> Result<String, GpuError> {
        let dir = std::env::var_os("LEGEND_KERNELS_DIR").filter(|d| !d.is_empty());
        let mut src = String::new();
        for (name, text) in KERNEL_SOURCES
            .iter()
            .filter(|(name, _)| self.sources.iter().any(|group| group.contains(name)))
        {
            src.push_str(&format!("#line 1 \"kernels/{name}\"\n"));
            match &dir {
                Some(dir) => {
                    let path = Path::new(dir).join(name);
                    let text = std::fs::read_to_string(&path)
                        .map_err(|source| GpuError::KernelSource { path, source })?;
                    src.push_str(&text);
                }
                None => src.push_str(text),
            }
            src.push('\n');
        }
        Ok(src)
    }

    /// NVRTC options: warnings on, standard C++17, line info for the profilers, the fused
    /// width, the decoder, loss and regulariser numbers and the fused tile sizes (defined in
    /// Rust only, [`crate::kernel_abi`]). No fast math: the kernels are checked against the CPU to 1e-3 and the losses
    /// need accurate exp/log.
    fn options(&self, arch: &str) -> Vec<String> {
        let mut options = vec![
            format!("--gpu-architecture={arch}"),
            "--std=c++17".into(),
            "--generate-line-info".into(),
            "--restrict".into(),
            "-default-device".into(),
            format!("-DLEGEND_FUSED_WIDTH={}", self.fused_width),
            format!("-DLEGEND_FUSED_TRANSE={}", u8::from(self.transe)),
        ];
        options.extend(crate::kernel_abi::defines());
        options
    }
}

/// Whether `libnvrtc` can be loaded (checked before any NVRTC call, which would panic).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library by its candidate names.
    unsafe { sys::is_culib_present() }
}

/// The NVRTC version, as (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32), GpuError> {
    if !nvrtc_present() {
        return Err(GpuError::NoNvrtc);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: both pointers are to live locals; the library is present (checked above).
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| GpuError::Compile {
            arch: String::new(),
            message: format!("nvrtcVersion: {e:?}"),
        })?;
    Ok((major, minor))
}

/// A compiled program.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// The program's name ([`Program::name`]).
    pub program: &'static str,
    /// PTX text (NUL-free).
    pub ptx: String,
    /// Machine code for the architecture it was compiled for.
    pub cubin: Vec<u8>,
    /// NVRTC's log (empty when there was nothing to say).
    pub log: String,
}

/// Compiles every program for `arch` (`sm_80`, `sm_90a`, ...), in parallel, in the order of
/// [`PROGRAMS`]. Fails on an error; warnings come back in each [`Compiled::log`].
pub fn compile(arch: &str) -> Result<Vec<Compiled>, GpuError> {
    compile_all(arch, &[])
}

/// Runs `compile_source` for every program.
fn compile_all(arch: &str, extra: &[&str]) -> Result<Vec<Compiled>, GpuError> {
    let sources = sources()?;
    per_program(&sources, |p, src| compile_source(arch, p, src, extra))
}

/// Every program's source, read once ([`Program::source`]).
fn sources() -> Result<Vec<String>, GpuError> {
    PROGRAMS.iter().map(Program::source).collect()
}

/// `work` on every program (with its source from `sources`) on a thread of its own, the
/// results in the order of [`PROGRAMS`]: NVRTC compiles one program on one thread.
fn per_program<T: Send>(
    sources: &[String],
    work: impl Fn(&'static Program, &str) -> Result<T, GpuError> + Sync,
) -> Result<Vec<T>, GpuError> {
    let work = &work;
    std::thread::scope(|s| {
        let handles: Vec<_> = PROGRAMS
            .iter()
            .zip(sources)
            .map(|(p, src)| s.spawn(move || work(p, src)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("NVRTC threads do not panic"))
            .collect()
    })
}

/// What ptxas gave one kernel: registers a thread and the bytes it spills (stores and
/// loads per thread).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelResources {
    /// The entry point.
    pub name: String,
    /// Registers a thread.
    pub registers: u32,
    /// Bytes a thread spills to local memory, and loads back.
    pub spill_stores: u32,
    /// See `spill_stores`.
    pub spill_loads: u32,
}

/// Compiles the programs for `arch` with ptxas's report and returns each kernel's
/// resources, in the report's order: register pressure and spills (which decide how many
/// blocks a multiprocessor holds) are visible without a GPU. Call it before any other
/// compile for `arch`: some NVRTC builds (the GPU machines' CUDA 13) answer a compile they
/// have done before from a cache, without ptxas and so without a report (then empty).
pub fn resource_usage(arch: &str) -> Result<Vec<KernelResources>, GpuError> {
    Ok(compile_all(arch, &["--ptxas-options=-v"])?
        .iter()
        .flat_map(|c| parse_ptxas_report(&c.log))
        .collect())
}

/// The per-kernel figures of a ptxas `-v` report: a "Compiling entry function 'NAME'" line,
/// then "N bytes stack frame, S bytes spill stores, L bytes spill loads" and "Used R
/// registers".
fn parse_ptxas_report(log: &str) -> Vec<KernelResources> {
    let number_before = |line: &str, word: &str| -> Option<u32> {
        let at = line.find(word)?;
        line[..at].split_whitespace().last()?.parse().ok()
    };
    let mut out: Vec<KernelResources> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default().to_string();
            out.push(KernelResources {
                name,
                registers: 0,
                spill_stores: 0,
                spill_loads: 0,
            });
        } else if let Some(k) = out.last_mut() {
            if let Some(n) = number_before(line, "registers") {
                k.registers = n;
            }
            if let Some(n) = number_before(line, "bytes spill stores") {
                k.spill_stores = n;
            }
            if let Some(n) = number_before(line, "bytes spill loads") {
                k.spill_loads = n;
            }
        }
    }
    out
}

/// Compiles `source` (`program`'s [`Program::source`]) for `arch`, with `extra` options.
fn compile_source(
    arch: &str,
    program: &'static Program,
    source: &str,
    extra: &[&str],
) -> Result<Compiled, GpuError> {
    if !nvrtc_present() {
        return Err(GpuError::NoNvrtc);
    }
    let fail = |message: String| GpuError::Compile {
        arch: arch.to_string(),
        message: format!("program {}: {message}", program.name),
    };
    let src = CString::new(source).map_err(|_| fail("a source holds a NUL".into()))?;
    let name = CString::new(format!("legend_{}.cu", program.name)).expect("no NUL in names");
    let prog = result::create_program(&src, Some(&name))
        .map_err(|e| fail(format!("nvrtcCreateProgram: {e:?}")))?;
    let mut opts = program.options(arch);
    opts.extend(extra.iter().map(|o| o.to_string()));
    // SAFETY: `prog` was just created and is destroyed once, below.
    let status = unsafe { result::compile_program(prog, &opts) };
    // SAFETY: `prog` is live.
    let log = unsafe { result::get_program_log(prog) }
        .map(|raw| c_chars_to_string(&raw))
        .unwrap_or_default();
    let outputs = match status {
        // SAFETY: `prog` is live and compiled.
        Ok(()) => unsafe { result::get_ptx(prog) }
            .map(|raw| c_chars_to_string(&raw))
            .map_err(|e| fail(format!("nvrtcGetPTX: {e:?}")))
            .and_then(|ptx| {
                // SAFETY: as above.
                let cubin = unsafe { cubin(prog) };
                Ok((ptx, cubin.map_err(|e| fail(e.to_string()))?))
            }),
        Err(e) => Err(fail(format!("{e:?}\n{log}"))),
    };
    // SAFETY: `prog` is live and not used after this.
    let destroyed = unsafe { result::destroy_program(prog) };
    let (ptx, cubin) = outputs?;
    destroyed.map_err(|e| fail(format!("nvrtcDestroyProgram: {e:?}")))?;
    Ok(Compiled {
        program: program.name,
        ptx,
        cubin,
        log: log.trim().to_string(),
    })
}

/// The machine code of a program compiled for a real architecture.
///
/// # Safety
/// `prog` must be a live, successfully compiled program.
unsafe fn cubin(prog: sys::nvrtcProgram) -> Result<Vec<u8>, CubinError> {
    let mut size = 0usize;
    // SAFETY: the caller's contract; `size` is a live local.
    unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }
        .result()
        .map_err(|e| CubinError::Call("nvrtcGetCUBINSize", e))?;
    if size == 0 {
        return Err(CubinError::Empty);
    }
    let mut out = vec![0u8; size];
    // SAFETY: `out` holds the `size` bytes NVRTC reported.
    unsafe { sys::nvrtcGetCUBIN(prog, out.as_mut_ptr().cast()) }
        .result()
        .map_err(|e| CubinError::Call("nvrtcGetCUBIN", e))?;
    Ok(out)
}

/// Why a compiled program gave no machine code.
#[derive(Debug, thiserror::Error)]
enum CubinError {
    /// An NVRTC call failed: its name and status.
    #[error("{0}: {1:?}")]
    Call(&'static str, cudarc::nvrtc::result::NvrtcError),
    /// The program has none (compiled for a virtual architecture?).
    #[error("no machine code (not a real architecture?)")]
    Empty,
}

fn c_chars_to_string(raw: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = raw.iter().map(|&c| c as u8).collect();
    CStr::from_bytes_until_nul(&bytes)
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned())
}

/// FNV-1a, 64 bits: a hash that stays the same across Rust releases, for cache file names.
fn fnv1a(data: &[u8], mut h: u64) -> u64 {
    for &b in data {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The cache directory: `$XDG_CACHE_HOME/legend/kernels`, else `~/.cache/legend/kernels`;
/// `None` when neither variable is set (then nothing is cached).
pub fn cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")))?;
    Some(base.join("legend").join("kernels"))
}

/// The machine code of every program for `arch`, in the order of [`PROGRAMS`]: from the
/// cache where present, the others compiled in parallel and stored there. A program's key
/// covers its sources, options and the NVRTC version, so any change recompiles it.
pub fn cached_programs(arch: &str) -> Result<Vec<Vec<u8>>, GpuError> {
    let (major, minor) = nvrtc_version()?;
    // One read of the sources for the key and the compile, so that the code stored under a
    // key is the code of those sources even while LEGEND_KERNELS_DIR's files change.
    let sources = sources()?;
    per_program(&sources, |p, source| {
        let mut h = fnv1a(source.as_bytes(), 0xcbf2_9ce4_8422_2325);
        h = fnv1a(p.options(arch).join(" ").as_bytes(), h);
        h = fnv1a(format!("nvrtc {major}.{minor}").as_bytes(), h);
        let path = cache_dir().map(|d| d.join(arch).join(format!("{}-{h:016x}.cubin", p.name)));
        if let Some(path) = &path
            && let Ok(code) = std::fs::read(path)
        {
            return Ok(code);
        }
        let compiled = compile_source(arch, p, source, &[])?;
        if let Some(path) = &path {
            store(path, &compiled.cubin)?;
        }
        Ok(compiled.cubin)
    })
}

/// Writes `data` to the cache file `path`: to a temporary name, then renamed, so that a
/// concurrent reader never sees half a file.
fn store(path: &Path, data: &[u8]) -> Result<(), GpuError> {
    let io = |source| GpuError::Cache {
        path: path.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(path.parent().expect("the path has a parent")).map_err(io)?;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, data).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_is_defined_by_exactly_one_program() {
        // The fused entry points are made by a macro: its instantiations name them. So are the
        // rows backward's variants (`LEGEND_ROWS_BACKWARD(name, X, R)` lines).
        let defines = |src: &str, name: &str| {
            src.contains(&format!("void {name}("))
                || src.contains(&format!(") {name}("))
                || src
                    .lines()
                    .any(|l| l.starts_with("LEGEND_") && l.contains(&format!("({name},")))
        };
        for p in &PROGRAMS {
            let src = p.source().unwrap();
            for name in p.kernels {
                let kind = if p.transe {
                    "legend_fused_transe_"
                } else {
                    "legend_fused_"
                };
                let pair = (name.strip_prefix(kind)).and_then(|n| {
                    n.strip_prefix("rows_d")
                        .or_else(|| n.strip_prefix("negatives_d"))
                });
                match pair {
                    Some(w) => {
                        assert_eq!(p.fused_width.to_string(), w, "{name} in {}", p.name);
                        assert!(src.contains(&format!("LEGEND_FUSED_PAIR({w},")), "{name}");
                    }
                    None => assert!(defines(&src, name), "{name} in {}", p.name),
                }
            }
        }
        let mut names: Vec<&str> = kernel_names().collect();
        let all = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), all, "a kernel listed by two programs");
    }

    #[test]
    fn resource_usage_covers_every_kernel_where_nvrtc_is_present() {
        if !nvrtc_present() {
            println!("skip: libnvrtc.so.13 not found (set LD_LIBRARY_PATH)");
            return;
        }
        for arch in ["sm_90", "sm_90a"] {
            let usage = resource_usage(arch).unwrap_or_else(|e| panic!("{e}"));
            if usage.is_empty() {
                // The NVRTC of the GPU machines answers a compile it has done before (another
                // test's, or an earlier run's) from a cache, without ptxas, so without a report.
                println!("skip: NVRTC gave no ptxas report for {arch} (a repeated compile)");
                continue;
            }
            assert_eq!(usage.len(), kernel_names().count(), "{arch}: {usage:?}");
            for name in kernel_names() {
                let k = usage.iter().find(|k| k.name == name);
                let k = k.unwrap_or_else(|| panic!("{name} missing from the {arch} report"));
                // Every kernel needs some registers. The fused ones are capped at 128 by their
                // launch bounds (256 threads, two blocks a multiprocessor), but for the
                // warp-specialised rows kernel of sm_90a: 384 threads, one block, 168 at
                // entry (setmaxnreg moves them between its warpgroups), and no spills, which
                // its design depends on (TransE L2's, with its distances in the loss, spill a
                // few bytes at d ≤ 104 and more at 128: Documentation/gpu.md).
                assert!(k.registers > 0, "{arch}: {k:?}");
                let rows = name.starts_with("legend_fused_") && name.contains("rows_d");
                if rows && arch == "sm_90a" {
                    let spills_allowed = if name.contains("transe") { 256 } else { 0 };
                    assert!(
                        k.registers <= 168 && k.spill_stores <= spills_allowed,
                        "{arch}: {k:?}"
                    );
                } else if name.starts_with("legend_fused_") && name != "legend_fused_absmax" {
                    assert!(k.registers <= 128, "{arch}: {k:?}");
                }
            }
        }
    }

    #[test]
    fn ptxas_reports_parse() {
        let log = "ptxas info    : Compiling entry function 'legend_a' for 'sm_90'\n\
                   ptxas info    : Function properties for legend_a\n\
                   ptxas         .     40 bytes stack frame, 32 bytes spill stores, 68 bytes spill loads\n\
                   ptxas info    : Used 128 registers, used 1 barriers, 40 bytes cumulative stack size\n\
                   ptxas info    : Compiling entry function 'legend_b' for 'sm_90'\n\
                   ptxas info    : Used 25 registers, used 0 barriers";
        let got = parse_ptxas_report(log);
        assert_eq!(
            got,
            vec![
                KernelResources {
                    name: "legend_a".into(),
                    registers: 128,
                    spill_stores: 32,
                    spill_loads: 68
                },
                KernelResources {
                    name: "legend_b".into(),
                    registers: 25,
                    spill_stores: 0,
                    spill_loads: 0
                },
            ]
        );
    }

    #[test]
    fn compiles_without_warnings_where_nvrtc_is_present() {
        if !nvrtc_present() {
            println!("skip: libnvrtc.so.13 not found (set LD_LIBRARY_PATH)");
            return;
        }
        for arch in ["sm_80", "sm_90", "sm_90a"] {
            let compiled = compile(arch).unwrap_or_else(|e| panic!("{e}"));
            for (p, c) in PROGRAMS.iter().zip(&compiled) {
                assert_eq!(c.program, p.name);
                assert!(c.log.is_empty(), "{arch} {}: {}", p.name, c.log);
                assert!(!c.cubin.is_empty(), "{arch} {}: no machine code", p.name);
                // Exactly its own entry points.
                assert_eq!(c.ptx.matches(".entry ").count(), p.kernels.len(), "{arch}");
                for name in p.kernels {
                    assert!(c.ptx.contains(&format!(".entry {name}(")), "{arch}: {name}");
                }
            }
        }
    }
}
