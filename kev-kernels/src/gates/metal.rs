//! The DeltaNet gates on Metal (`gates.metal`): one thread per (row, value head).

use candle_core::backend::BackendStorage;
use candle_core::{bail, DType, Layout, MetalStorage, Result};

use crate::backend::metal::{
    as_u32, byte_offset, dispatch, dtype_suffix, input, output, pipeline, Source,
};
use crate::layout::rows::row_view;

const SOURCE: Source = Source {
    name: "gates",
    text: include_str!("gates.metal"),
};

/// Threads per threadgroup (one (row, head) each); a common Metal default.
const THREADS_PER_GROUP: usize = 256;

/// `GatesParams` of gates.metal.
#[repr(C)]
struct GatesParams {
    rows: u32,
    hv: u32,
    stride: u32,
}

// The MSL struct has the same fields; the emulation harness asserts the same size.
const _: () = assert!(std::mem::size_of::<GatesParams>() == 12);

pub(crate) fn gates(
    bas: &MetalStorage,
    bal: &Layout,
    ds: &MetalStorage,
    dl: &Layout,
    ns: &MetalStorage,
    nl: &Layout,
) -> Result<MetalStorage> {
    let suffix = dtype_suffix(bas.dtype(), "deltanet-gates")?;
    if ds.dtype() != DType::F32 || ns.dtype() != DType::F32 {
        bail!("deltanet-gates: dt_bias and neg_a must be f32")
    }
    let v = row_view(bal, "deltanet-gates input")?;
    let d_off = byte_offset(dl, DType::F32, "deltanet-gates: dt_bias")?;
    let n_off = byte_offset(nl, DType::F32, "deltanet-gates: neg_a")?;
    let hv = dl.shape().elem_count();
    let n = v.rows * hv;
    as_u32(v.span().end, "deltanet-gates: input elements")?;
    as_u32(2 * n, "deltanet-gates: output elements")?;
    let params = GatesParams {
        rows: v.rows as u32,
        hv: hv as u32,
        stride: as_u32(v.stride, "deltanet-gates: row stride")?,
    };
    let dev = bas.device().clone();
    let pipeline = pipeline(&dev, &SOURCE, &format!("deltanet_gates_{suffix}"))?;
    let out = dev.new_buffer((2 * n).max(1), DType::F32, "deltanet-gates out")?;
    let ba_off = v.offset * bas.dtype().size_in_bytes();
    dispatch(
        &dev,
        &pipeline,
        &[
            input(bas.buffer(), ba_off),
            input(ds.buffer(), d_off),
            input(ns.buffer(), n_off),
            output(&out, 0),
        ],
        &params,
        n.div_ceil(THREADS_PER_GROUP),
        THREADS_PER_GROUP,
    )?;
    Ok(MetalStorage::new(out, dev, 2 * n, DType::F32))
}
