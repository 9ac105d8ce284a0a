//! What the host code and the kernels agree on, defined here once: the numbers of the
//! decoders, losses and regularisers, the fused kernels' tile sizes (every program is compiled
//! with them as `-D` options, [`defines`]) and the shared memory the launches give.

use legend_model::{Decoder, Dtype, Loss, Penalty, Regularizer};

/// The kernels' names of the decoders; a decoder's number is its index. The one definition:
/// every program is compiled with `-D<name>=<index>` ([`defines`]). RotatE and RESCAL
/// have queries and rows-backward kernels of their own (`kernels/rotate.cu`,
/// `kernels/rescal.cu`); the shared ones never see their numbers.
const DECODER_CODES: [(Decoder, &str); 7] = [
    (Decoder::Dot, "LEGEND_DOT"),
    (Decoder::DistMult, "LEGEND_DISTMULT"),
    (Decoder::ComplEx, "LEGEND_COMPLEX"),
    (Decoder::TransEL1, "LEGEND_TRANSE_L1"),
    (Decoder::TransEL2, "LEGEND_TRANSE_L2"),
    (Decoder::RotatE, "LEGEND_ROTATE"),
    (Decoder::Rescal, "LEGEND_RESCAL"),
];

/// The kernels' names of the losses, numbered by index as [`DECODER_CODES`].
const LOSS_CODES: [&str; 4] = [
    "LEGEND_LOSS_SOFTMAX",
    "LEGEND_LOSS_LOGISTIC",
    "LEGEND_LOSS_RANKING",
    "LEGEND_LOSS_SELF_ADVERSARIAL",
];

/// The kernels' names of the regularisers, numbered by index as [`DECODER_CODES`].
const PENALTY_CODES: [(Penalty, &str); 3] = [
    (Penalty::None, "LEGEND_PENALTY_NONE"),
    (Penalty::N3, "LEGEND_PENALTY_N3"),
    (Penalty::L2, "LEGEND_PENALTY_L2"),
];

/// The `-D` options that define the decoder, loss and regulariser numbers and the fused
/// kernels' tile sizes in every program.
pub(crate) fn defines() -> Vec<String> {
    let decoders = DECODER_CODES.iter().map(|(_, name)| *name).enumerate();
    let losses = LOSS_CODES.iter().copied().enumerate();
    let penalties = PENALTY_CODES.iter().map(|(_, name)| *name).enumerate();
    let tiles = [
        ("LEGEND_FUSED_TILE", FUSED_TILE),
        ("LEGEND_FUSED_NEG_BLOCK", FUSED_NEG_BLOCK),
        ("LEGEND_FUSED_BLOCK_ROWS", FUSED_BLOCK_ROWS),
    ];
    decoders
        .chain(losses)
        .chain(penalties)
        .map(|(code, name)| (name, code))
        .chain(tiles)
        .map(|(name, value)| format!("-D{name}={value}"))
        .collect()
}

/// A node-row format's number in the kernels (`LEGEND_DTYPE_*` in `kernels/common.cuh`).
pub(crate) fn dtype_code(d: Dtype) -> u32 {
    Dtype::ALL
        .iter()
        .position(|&x| x == d)
        .expect("every dtype is listed") as u32
}

/// The regulariser's number in the kernels and its weight (none when inactive).
pub(crate) fn penalty_code(r: Option<Regularizer>) -> (i32, f32) {
    match r {
        Some(r) if r.is_active() => (
            PENALTY_CODES
                .iter()
                .position(|(p, _)| *p == r.penalty)
                .expect("every penalty has a code") as i32,
            r.weight,
        ),
        _ => (0, 0.0),
    }
}

/// The decoder's number in the kernels.
pub(crate) fn decoder_code(d: Decoder) -> i32 {
    DECODER_CODES
        .iter()
        .position(|(x, _)| *x == d)
        .expect("every decoder has a code") as i32
}

/// The loss's number in the kernels (an index of [`LOSS_CODES`]), its margin (the ranking
/// loss's, the self-adversarial loss's γ) and its temperature (the self-adversarial α).
pub(crate) fn loss_code(l: Loss) -> (i32, f32, f32) {
    match l {
        Loss::SoftmaxCe => (0, 0.0, 0.0),
        Loss::Logistic => (1, 0.0, 0.0),
        Loss::Ranking { margin } => (2, margin, 0.0),
        Loss::SelfAdversarial {
            margin,
            temperature,
        } => (3, margin, temperature),
    }
}

/// Rows of the tiles of the fused kernels' FP16 operands in device memory, and of the walked
/// tile of the mma.sync kernels (`LEGEND_FUSED_TILE`: the eight 8-column blocks of a warp's
/// score accumulators).
pub(crate) const FUSED_TILE: usize = 64;

/// Rows a block of the fused rows kernel owns (`LEGEND_FUSED_BLOCK_ROWS`): the FP16 queries,
/// G and the softmax factors hold each job's rows rounded up to it.
pub(crate) const FUSED_BLOCK_ROWS: usize = 128;

/// Negatives a block of the fused negatives kernel owns, and a column block of G
/// (`LEGEND_FUSED_NEG_BLOCK`): k is padded to it.
pub(crate) const FUSED_NEG_BLOCK: usize = 128;

/// FP16 values a row of the fused kernels' operands of width `width` holds: the width
/// rounded up to the 16 of an mma's k step (the `dim_pad` of `LegendFused`).
pub(crate) fn fused_dim_pad(width: usize) -> usize {
    width.div_ceil(16) * 16
}

/// Negatives the fused kernels' G, factors and FP16 negatives hold for `k`: whole blocks of
/// the negatives kernel (`legend_fused_k_pad`).
pub(crate) fn fused_k_pad(k: usize) -> usize {
    k.div_ceil(FUSED_NEG_BLOCK) * FUSED_NEG_BLOCK
}

/// Rows the fused kernels' FP16 queries, G and factors hold for a job of `rows` rows: whole
/// blocks of the rows kernel (`legend_fused_rows_pad`).
pub(crate) fn fused_rows_pad(rows: usize) -> usize {
    rows.div_ceil(FUSED_BLOCK_ROWS) * FUSED_BLOCK_ROWS
}

/// Dynamic shared memory of the product kernels: `LEGEND_STAGES` (4) stages of a 128-row A
/// tile and a 128-column B tile, 16 + 4 floats a row (`kernels/gemm.cu`); the 128 × 132
/// output tile staged for the stores fits in the same space.
pub(crate) const GEMM_SMEM: u32 = 4 * (128 + 128) * 20 * 4;

/// Entries of `legend_scan_select`'s shared array: a power of two, the kept keys plus a piece
/// of at least 6144 candidates.
pub(crate) const SELECT_SORT: u32 = 8192;

/// Dynamic shared memory of `legend_scan_select` (its keys are 8 bytes).
pub(crate) const SELECT_SMEM: u32 = SELECT_SORT * 8;
