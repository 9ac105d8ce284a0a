//! The SQE test vectors shared with the CUDA I/O kernels: this crate's builders must produce
//! exactly the bytes in `kernels/testdata/sqe_vectors.txt` (the GPU test in legend-cuda checks
//! `kernels/nvme_io.cu` against the same file). `LEGEND_BLESS=1` rewrites the file from the
//! builders.

use legend_nvme_protocol::{Opcode, Sqe, prp};

const FILE: &str = include_str!("../../../kernels/testdata/sqe_vectors.txt");

/// The inputs of one vector.
#[derive(Clone, Copy, Debug)]
struct Input {
    opcode: u8,
    nsid: u32,
    lba: u64,
    blocks: u32,
    lba_shift: u32,
    page_shift: u32,
    offset: u64,
    cid: u16,
    list_bus: u64,
}

/// Page `k` of vector `i`'s buffer (the file's header says the same).
fn page(i: usize, k: u64, page_shift: u32) -> u64 {
    0x7f00_0000_0000 + (((k * 7919 + i as u64) % 509) << page_shift)
}

fn inputs() -> Vec<Input> {
    let mut v = Vec::new();
    let mut cid = 0u16;
    for (opcode, lba_shift, page_shift) in [(2u8, 9u32, 16u32), (1, 12, 16), (2, 9, 12), (1, 9, 12)]
    {
        for (offset, bytes) in [
            (0u64, 512u64),
            (512, 3584),
            (0, 4096),
            (0, 8192),
            (2048, 4096),
            (4092 & !511, 8192),
            (0, 65536),
            (65536 - 4096, 131072),
            (12288, 1 << 20),
            (0, 2 << 20),
        ] {
            if bytes % (1 << lba_shift) != 0 || offset % 4 != 0 {
                continue;
            }
            cid += 3;
            v.push(Input {
                opcode,
                nsid: 1 + u32::from(cid % 3),
                lba: 0x1_2345_0000 + u64::from(cid) * 77,
                blocks: (bytes >> lba_shift) as u32,
                lba_shift,
                page_shift,
                offset: offset + if page_shift == 16 { 3 << 16 } else { 0 },
                cid,
                list_bus: 0x1000_0000 + u64::from(cid) * 4096,
            });
        }
    }
    v
}

/// The SQE and PRP list entries this crate builds for vector `i`.
fn build(i: usize, x: &Input) -> (Sqe, Vec<u64>) {
    let len = u64::from(x.blocks) << x.lba_shift;
    let first = x.offset & !(prp::PAGE - 1);
    let bus =
        |at: u64| page(i, at >> x.page_shift, x.page_shift) + (at & ((1 << x.page_shift) - 1));
    let mut list = vec![0u64; 512];
    let p = prp::build(
        x.offset % prp::PAGE,
        len,
        |k| bus(first + k as u64 * prp::PAGE),
        &mut list,
        x.list_bus,
    )
    .unwrap();
    let mut s = Sqe::read_write(
        Opcode::from_u8(x.opcode).unwrap(),
        x.nsid,
        x.lba,
        x.blocks,
        p,
    );
    s.set_cid(x.cid);
    let entries = prp::pages(x.offset % prp::PAGE, len);
    list.truncate(if entries > 2 { entries - 1 } else { 0 });
    (s, list)
}

fn render() -> String {
    let mut out = String::from(
        "# SQE test vectors: legend-nvme-protocol (Rust) and kernels/nvme_io.cu (CUDA) build these bytes.\n\
         # Page k of vector i's buffer is at 0x7f0000000000 + (((k * 7919 + i) mod 509) << page_shift).\n\
         # opcode nsid lba blocks lba_shift page_shift offset cid list_bus | 16 SQE dwords | PRP list entries\n",
    );
    for (i, x) in inputs().iter().enumerate() {
        let (s, list) = build(i, x);
        let dwords: &[u32; 16] = bytemuck::cast_ref(&s);
        out += &format!(
            "{} {} {:#x} {} {} {} {:#x} {} {:#x} |",
            x.opcode,
            x.nsid,
            x.lba,
            x.blocks,
            x.lba_shift,
            x.page_shift,
            x.offset,
            x.cid,
            x.list_bus
        );
        for d in dwords {
            out += &format!(" {d:08x}");
        }
        out += " |";
        for e in &list {
            out += &format!(" {e:x}");
        }
        out += "\n";
    }
    out
}

#[test]
fn the_builders_produce_the_shared_vectors() {
    let now = render();
    if std::env::var_os("LEGEND_BLESS").is_some() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../kernels/testdata/sqe_vectors.txt"
        );
        std::fs::write(path, &now).unwrap();
        return;
    }
    assert!(
        FILE == now,
        "kernels/testdata/sqe_vectors.txt differs from what the builders produce; if the \
         protocol changed on purpose, LEGEND_BLESS=1 rewrites it (and the CUDA side must follow)"
    );
    assert!(FILE.lines().count() > 30, "too few vectors");
}
