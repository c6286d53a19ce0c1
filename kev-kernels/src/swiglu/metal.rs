//! SwiGLU on Metal (`swiglu.metal`): one thread per output element.

use candle_core::backend::BackendStorage;
use candle_core::{Layout, MetalStorage, Result};

use crate::backend::metal::{
    as_u32, byte_offset, dispatch, dtype_suffix, input, output, pipeline, Source,
};

const SOURCE: Source = Source {
    name: "swiglu",
    text: include_str!("swiglu.metal"),
};

/// Threads per threadgroup (one output element each); a common Metal default.
const THREADS_PER_GROUP: usize = 256;

/// `SwigluParams` of swiglu.metal.
#[repr(C)]
struct SwigluParams {
    rows: u32,
    inter: u32,
}

// The MSL struct has the same fields; the emulation harness asserts the same size.
const _: () = assert!(std::mem::size_of::<SwigluParams>() == 8);

pub(crate) fn swiglu(s: &MetalStorage, l: &Layout) -> Result<MetalStorage> {
    let suffix = dtype_suffix(s.dtype(), "swiglu")?;
    let off = byte_offset(l, s.dtype(), "swiglu: input")?;
    let width = l.dims().last().copied().unwrap_or(0);
    let inter = width / 2;
    let n = l.shape().elem_count() / 2;
    let rows = n.checked_div(inter).unwrap_or(0);
    as_u32(2 * n, "swiglu: input elements")?;
    let params = SwigluParams {
        rows: rows as u32,
        inter: inter as u32,
    };
    let dev = s.device().clone();
    let pipeline = pipeline(&dev, &SOURCE, &format!("swiglu_{suffix}"))?;
    let out = dev.new_buffer(n.max(1), s.dtype(), "swiglu out")?;
    dispatch(
        &dev,
        &pipeline,
        &[input(s.buffer(), off), output(&out, 0)],
        &params,
        n.div_ceil(THREADS_PER_GROUP),
        THREADS_PER_GROUP,
    )?;
    Ok(MetalStorage::new(out, dev, n, s.dtype()))
}
