//! Rows to and from their format at rest (`storage.dtype`), on every core: a 16-bit partition
//! of millions of rows is narrowed or widened by the I/O thread on every swap.

use legend_model::Dtype;
use rayon::prelude::*;

/// Elements a worker converts at once.
const BLOCK: usize = 1 << 16;

/// `values` (representable in `dtype`: the engine rounds) into `out` in `dtype`.
pub(crate) fn narrow(dtype: Dtype, values: &[f32], out: &mut [u8]) {
    values
        .par_chunks(BLOCK)
        .zip(out.par_chunks_mut(BLOCK * dtype.bytes()))
        .for_each(|(v, o)| dtype.narrow(v, o));
}

/// `bytes` in `dtype` back into `values`.
pub(crate) fn widen(dtype: Dtype, bytes: &[u8], values: &mut [f32]) {
    bytes
        .par_chunks(BLOCK * dtype.bytes())
        .zip(values.par_chunks_mut(BLOCK))
        .for_each(|(b, v)| dtype.widen(b, v));
}
