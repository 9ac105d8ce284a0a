//! A read-only two-dimensional table that NumPy reads through Python's buffer protocol
//! (`numpy.asarray(table)`) without a copy: rows memory-mapped from a checkpoint file, or rows
//! this module made (streamed from a store, widened from 16 bits, edges of a dataset). The array
//! keeps the table alive (the buffer's owner), so a mapping outlives the run it came from: a
//! checkpoint replaced by a later one is unlinked, and its pages stay readable.

use std::ffi::{CStr, c_int, c_void};
use std::ptr;

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

/// What the rows are held in.
pub enum Rows {
    /// A file mapped read-only: little-endian f32, row-major.
    Mapped(memmap2::Mmap),
    /// f32 rows in memory.
    F32(Vec<f32>),
    /// u32 rows in memory (edges: `[head, relation, tail]`).
    U32(Vec<u32>),
}

impl Rows {
    fn bytes(&self) -> &[u8] {
        match self {
            Rows::Mapped(map) => map,
            Rows::F32(v) => bytemuck::cast_slice(v),
            Rows::U32(v) => bytemuck::cast_slice(v),
        }
    }

    /// The buffer protocol's format: little-endian f32 or u32 (the files' order; legend-dataset
    /// refuses big-endian hosts).
    fn format(&self) -> &'static CStr {
        match self {
            Rows::Mapped(_) | Rows::F32(_) => c"<f",
            Rows::U32(_) => c"<I",
        }
    }
}

/// A table of `rows × cols` values of 4 bytes, read-only.
#[pyclass(frozen, module = "legend._legend")]
pub struct Table {
    data: Rows,
    /// `[rows, cols]` and `[cols × 4, 4]`: the buffer's shape and strides point here.
    shape: [ffi::Py_ssize_t; 2],
    strides: [ffi::Py_ssize_t; 2],
    /// Whether the rows are a mapping of the run's file (no copy) rather than this process's.
    mapped: bool,
}

impl Table {
    /// `data` as `cols` columns; its length must be a multiple of them.
    pub fn new(data: Rows, cols: usize) -> Table {
        let values = data.bytes().len() / 4;
        let rows = values.checked_div(cols).unwrap_or(0);
        assert_eq!(rows * cols, values, "a table of whole rows");
        Table {
            mapped: matches!(data, Rows::Mapped(_)),
            data,
            shape: [rows as ffi::Py_ssize_t, cols as ffi::Py_ssize_t],
            strides: [(cols * 4) as ffi::Py_ssize_t, 4],
        }
    }
}

#[pymethods]
impl Table {
    /// `(rows, columns)`.
    #[getter]
    fn shape(&self) -> (usize, usize) {
        (self.shape[0] as usize, self.shape[1] as usize)
    }

    /// Whether the values are the run's checkpoint file mapped into memory (no copy was made).
    #[getter]
    fn mapped(&self) -> bool {
        self.mapped
    }

    /// Exports the rows read-only: NumPy's array then refers to them.
    ///
    /// # Safety
    ///
    /// Python calls this with `view` a `Py_buffer` to fill (or null).
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("no buffer view to fill"));
        }
        if flags & ffi::PyBUF_WRITABLE == ffi::PyBUF_WRITABLE {
            return Err(PyBufferError::new_err(
                "the table is read-only (copy the array to change it)",
            ));
        }
        let table = slf.get();
        let bytes = table.data.bytes();
        let (buf, len) = (bytes.as_ptr().cast::<c_void>().cast_mut(), bytes.len());
        let format = if flags & ffi::PyBUF_FORMAT == ffi::PyBUF_FORMAT {
            table.data.format().as_ptr().cast_mut()
        } else {
            ptr::null_mut()
        };
        let shape = if flags & ffi::PyBUF_ND == ffi::PyBUF_ND {
            table.shape.as_ptr().cast_mut()
        } else {
            ptr::null_mut()
        };
        let strides = if flags & ffi::PyBUF_STRIDES == ffi::PyBUF_STRIDES {
            table.strides.as_ptr().cast_mut()
        } else {
            ptr::null_mut()
        };
        // SAFETY: `view` is the caller's `Py_buffer` (checked non-null). The pointers stored in
        // it (the rows, shape, strides and the static format string) live as long as the table,
        // whose reference `obj` takes; the table is frozen, so none of them changes, and a
        // consumer never writes through a view marked read-only.
        unsafe {
            (*view).buf = buf;
            (*view).len = len as ffi::Py_ssize_t;
            (*view).readonly = 1;
            (*view).itemsize = 4;
            (*view).format = format;
            // Without a shape the consumer reads bytes (the protocol's simple view).
            (*view).ndim = if shape.is_null() { 1 } else { 2 };
            (*view).shape = shape;
            (*view).strides = strides;
            (*view).suboffsets = ptr::null_mut();
            (*view).internal = ptr::null_mut();
            (*view).obj = slf.into_any().into_ptr();
        }
        Ok(())
    }
}
