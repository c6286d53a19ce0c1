//! The attention steps on Metal (`attention.metal`): the q/k norm with RoPE and the causal
//! softmax one 32-lane simdgroup per row, the output gate one thread per element.

use candle_core::backend::BackendStorage;
use candle_core::{bail, DType, Layout, MetalStorage, Result};

use super::gate::GatePart;
use crate::backend::metal::{
    as_u32, byte_offset, check_simd_width, dispatch, dtype_suffix, input, output, pipeline, Source,
    SIMD_WIDTH,
};
use crate::layout::rows::strided4;

const SOURCE: Source = Source {
    name: "attention",
    text: include_str!("attention.metal"),
};

/// Rows (simdgroups) per threadgroup of the row kernels; `ATTN_ROWS_PER_GROUP` of the source.
const ROWS_PER_GROUP: usize = 8;
/// Threads per threadgroup of the gate (one output element each).
const THREADS_PER_GROUP: usize = 256;

/// `QkNormRopeParams` of attention.metal.
#[repr(C)]
struct QkNormRopeParams {
    b: u32,
    t: u32,
    h: u32,
    hd: u32,
    rot: u32,
    sb: u32,
    st: u32,
    sh: u32,
    eps: f32,
}

/// `SoftmaxParams` of attention.metal.
#[repr(C)]
struct SoftmaxParams {
    rows: u32,
    groups: u32,
    t: u32,
    s: u32,
    scale: f32,
}

/// `GateParams` of attention.metal.
#[repr(C)]
struct GateParams {
    b: u32,
    t: u32,
    h: u32,
    hd: u32,
    sb: u32,
    st: u32,
    sh: u32,
}

// The MSL structs have the same fields; the emulation harness asserts the same sizes.
const _: () = assert!(std::mem::size_of::<QkNormRopeParams>() == 36);
const _: () = assert!(std::mem::size_of::<SoftmaxParams>() == 20);
const _: () = assert!(std::mem::size_of::<GateParams>() == 28);

/// `strides` as the kernel's 32-bit element strides.
fn strides_u32(strides: [usize; 3], what: &str) -> Result<[u32; 3]> {
    Ok([
        as_u32(strides[0], what)?,
        as_u32(strides[1], what)?,
        as_u32(strides[2], what)?,
    ])
}

pub(crate) fn qk_norm_rope(
    eps: f32,
    xs: &MetalStorage,
    xl: &Layout,
    ws: &MetalStorage,
    wl: &Layout,
    cs: &MetalStorage,
    cl: &Layout,
) -> Result<MetalStorage> {
    let (b_sz, t_len, heads, hd) = xl.shape().dims4()?;
    let rot = cl.dims().last().copied().unwrap_or(0);
    let suffix = dtype_suffix(xs.dtype(), "qk-norm-rope")?;
    if ws.dtype() != DType::F32 || cs.dtype() != xs.dtype() {
        bail!(
            "qk-norm-rope: weight {:?} (f32 expected) / rotation {:?} do not fit {:?}",
            ws.dtype(),
            cs.dtype(),
            xs.dtype()
        )
    }
    let (off, strides) = strided4(xl, "qk-norm-rope input")?;
    let [sb, st, sh] = strides_u32(strides, "qk-norm-rope: input stride")?;
    let w_off = byte_offset(wl, DType::F32, "qk-norm-rope: weight")?;
    let c_off = byte_offset(cl, cs.dtype(), "qk-norm-rope: rotation")?;
    let rows = b_sz * heads * t_len;
    let n = rows * hd;
    as_u32(n, "qk-norm-rope: output elements")?;
    let params = QkNormRopeParams {
        b: b_sz as u32,
        t: t_len as u32,
        h: heads as u32,
        hd: hd as u32,
        rot: as_u32(rot, "qk-norm-rope: rotary dims")?,
        sb,
        st,
        sh,
        eps,
    };
    let dev = xs.device().clone();
    let pipeline = pipeline(&dev, &SOURCE, &format!("qk_norm_rope_{suffix}"))?;
    check_simd_width(&pipeline, "qk-norm-rope")?;
    let out = dev.new_buffer(n.max(1), xs.dtype(), "qk-norm-rope out")?;
    dispatch(
        &dev,
        &pipeline,
        &[
            input(xs.buffer(), off * xs.dtype().size_in_bytes()),
            input(ws.buffer(), w_off),
            input(cs.buffer(), c_off),
            output(&out, 0),
        ],
        &params,
        rows.div_ceil(ROWS_PER_GROUP),
        SIMD_WIDTH * ROWS_PER_GROUP,
    )?;
    Ok(MetalStorage::new(out, dev, n, xs.dtype()))
}

pub(crate) fn causal_softmax(
    scale: f32,
    ss: &MetalStorage,
    sl: &Layout,
    ms: &MetalStorage,
    ml: &Layout,
) -> Result<MetalStorage> {
    let (b_sz, groups, t_len, s_len) = sl.shape().dims4()?;
    let suffix = dtype_suffix(ss.dtype(), "causal-softmax")?;
    if ms.dtype() != DType::F32 {
        bail!(
            "causal-softmax: the key bias must be f32, got {:?}",
            ms.dtype()
        )
    }
    let s_off = byte_offset(sl, ss.dtype(), "causal-softmax: scores")?;
    let m_off = byte_offset(ml, DType::F32, "causal-softmax: key bias")?;
    let rows = b_sz * groups * t_len;
    let n = rows * s_len;
    as_u32(n, "causal-softmax: score elements")?;
    let params = SoftmaxParams {
        rows: rows as u32,
        groups: groups as u32,
        t: t_len as u32,
        s: s_len as u32,
        scale,
    };
    let dev = ss.device().clone();
    let pipeline = pipeline(&dev, &SOURCE, &format!("causal_softmax_{suffix}"))?;
    check_simd_width(&pipeline, "causal-softmax")?;
    let out = dev.new_buffer(n.max(1), ss.dtype(), "causal-softmax out")?;
    dispatch(
        &dev,
        &pipeline,
        &[
            input(ss.buffer(), s_off),
            input(ms.buffer(), m_off),
            output(&out, 0),
        ],
        &params,
        rows.div_ceil(ROWS_PER_GROUP),
        SIMD_WIDTH * ROWS_PER_GROUP,
    )?;
    Ok(MetalStorage::new(out, dev, n, ss.dtype()))
}

/// `attention_gate_*` once per part, into one output holding each part's `[B·T, H·hd]` rows in
/// turn (each dispatch writes its own range of the buffer).
pub(super) fn gate_dispatches(
    gs: &MetalStorage,
    parts: &[GatePart<MetalStorage>],
    heads: usize,
    hd: usize,
) -> Result<MetalStorage> {
    let dtype = gs.dtype();
    let suffix = dtype_suffix(dtype, "attention-gate")?;
    let row = heads * hd;
    let total: usize = parts.iter().map(|p| p.rows.0 * p.rows.1 * row).sum();
    as_u32(total, "attention-gate: output elements")?;
    let dev = gs.device().clone();
    let pipeline = pipeline(&dev, &SOURCE, &format!("attention_gate_{suffix}"))?;
    let out = dev.new_buffer(total.max(1), dtype, "attention-gate out")?;
    let mut at = 0;
    for part in parts {
        if part.storage.dtype() != dtype {
            bail!(
                "attention-gate: input {:?} is not {dtype:?}",
                part.storage.dtype()
            )
        }
        let o_off = byte_offset(part.o, dtype, "attention-gate: input")?;
        let (b_sz, t_len) = part.rows;
        let n = b_sz * t_len * row;
        if part.o.shape().elem_count() != n {
            bail!(
                "attention-gate: input {:?} does not hold {b_sz} × {t_len} rows",
                part.o
            )
        }
        let [sb, st, sh] = strides_u32(part.strides, "attention-gate: gate stride")?;
        let params = GateParams {
            b: b_sz as u32,
            t: t_len as u32,
            h: heads as u32,
            hd: hd as u32,
            sb,
            st,
            sh,
        };
        dispatch(
            &dev,
            &pipeline,
            &[
                input(part.storage.buffer(), o_off),
                input(gs.buffer(), part.gate_at * dtype.size_in_bytes()),
                output(&out, at * dtype.size_in_bytes()),
            ],
            &params,
            n.div_ceil(THREADS_PER_GROUP),
            THREADS_PER_GROUP,
        )?;
        at += n;
    }
    Ok(MetalStorage::new(out, dev, total, dtype))
}
