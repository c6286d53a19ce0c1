//! The norms on Metal (`norm.metal`): one 32-lane simdgroup per row, eight rows a threadgroup.

use candle_core::backend::BackendStorage;
use candle_core::{bail, DType, Layout, MetalStorage, Result};

use crate::backend::metal::{
    as_u32, byte_offset, check_simd_width, dispatch, dtype_suffix, input, output, pipeline, Source,
    SIMD_WIDTH,
};
use crate::layout::rows::row_view;

const SOURCE: Source = Source {
    name: "norm",
    text: include_str!("norm.metal"),
};

/// Rows (simdgroups) per threadgroup; `NORM_ROWS_PER_GROUP` of norm.metal.
const ROWS_PER_GROUP: usize = 8;

/// `RmsNormParams` of norm.metal.
#[repr(C)]
struct RmsNormParams {
    rows: u32,
    cols: u32,
    x_stride: u32,
    h_stride: u32,
    residual: u32,
    eps: f32,
}

/// `GatedNormParams` of norm.metal.
#[repr(C)]
struct GatedNormParams {
    groups: u32,
    heads: u32,
    dv: u32,
    z_stride: u32,
    eps: f32,
}

// The MSL structs have the same fields; the emulation harness asserts the same sizes.
const _: () = assert!(std::mem::size_of::<RmsNormParams>() == 24);
const _: () = assert!(std::mem::size_of::<GatedNormParams>() == 20);

/// The storage byte offset of element `offset` of `s`.
fn element_bytes(s: &MetalStorage, offset: usize) -> usize {
    offset * s.dtype().size_in_bytes()
}

/// `rms_norm`, or with a residual `add_rms_norm`'s packed `[2, ..]` output; `n_out` elements.
pub(crate) fn rms_norm(
    eps: f32,
    xs: &MetalStorage,
    xl: &Layout,
    residual: Option<(&MetalStorage, &Layout)>,
    ws: &MetalStorage,
    wl: &Layout,
) -> Result<MetalStorage> {
    let xv = row_view(xl, "rms-norm input")?;
    let hv = residual
        .map(|(_, l)| row_view(l, "rms-norm residual"))
        .transpose()?;
    if ws.dtype() != DType::F32 {
        bail!(
            "rms-norm: the weight must be f32 on Metal, got {:?}",
            ws.dtype()
        )
    }
    let suffix = dtype_suffix(xs.dtype(), "rms-norm")?;
    let w_off = byte_offset(wl, DType::F32, "rms-norm: weight")?;
    let n_out = xv.rows * xv.cols * if residual.is_some() { 2 } else { 1 };
    as_u32(xv.span().end, "rms-norm: input elements")?;
    as_u32(n_out, "rms-norm: output elements")?;
    let params = RmsNormParams {
        rows: xv.rows as u32,
        cols: xv.cols as u32,
        x_stride: as_u32(xv.stride, "rms-norm: row stride")?,
        h_stride: as_u32(hv.map_or(0, |v| v.stride), "rms-norm: residual row stride")?,
        residual: u32::from(residual.is_some()),
        eps,
    };
    let dev = xs.device().clone();
    let pipeline = pipeline(&dev, &SOURCE, &format!("rms_norm_{suffix}"))?;
    check_simd_width(&pipeline, "rms-norm")?;
    let out = dev.new_buffer(n_out.max(1), xs.dtype(), "rms-norm out")?;
    let x_bind = input(xs.buffer(), element_bytes(xs, xv.offset));
    let h_bind = match (residual, hv) {
        (Some((hs, _)), Some(hv)) => {
            if hs.dtype() != xs.dtype() {
                bail!(
                    "add-rms-norm: residual {:?} is not {:?}",
                    hs.dtype(),
                    xs.dtype()
                )
            }
            input(hs.buffer(), element_bytes(hs, hv.offset))
        }
        _ => input(xs.buffer(), element_bytes(xs, xv.offset)),
    };
    dispatch(
        &dev,
        &pipeline,
        &[x_bind, h_bind, input(ws.buffer(), w_off), output(&out, 0)],
        &params,
        xv.rows.div_ceil(ROWS_PER_GROUP),
        SIMD_WIDTH * ROWS_PER_GROUP,
    )?;
    Ok(MetalStorage::new(out, dev, n_out, xs.dtype()))
}

pub(crate) fn gated_rms_norm(
    eps: f32,
    xs: &MetalStorage,
    xl: &Layout,
    zs: &MetalStorage,
    zl: &Layout,
    ws: &MetalStorage,
    wl: &Layout,
) -> Result<MetalStorage> {
    let suffix = dtype_suffix(xs.dtype(), "gated-rms-norm")?;
    if zs.dtype() != xs.dtype() || ws.dtype() != xs.dtype() {
        bail!(
            "gated-rms-norm: gate {:?} / weight {:?} are not {:?}",
            zs.dtype(),
            ws.dtype(),
            xs.dtype()
        )
    }
    let x_off = byte_offset(xl, xs.dtype(), "gated-rms-norm: input")?;
    let w_off = byte_offset(wl, ws.dtype(), "gated-rms-norm: weight")?;
    let zv = row_view(zl, "gated-rms-norm gate")?;
    let (n, dv) = (xl.shape().elem_count(), wl.shape().elem_count());
    if dv == 0 || n % dv != 0 || zv.cols % dv != 0 || zv.rows * zv.cols != n {
        bail!(
            "gated-rms-norm: input {:?} / gate {:?} do not divide into groups of {dv}",
            xl.dims(),
            zl.dims()
        )
    }
    let groups = n / dv;
    as_u32(zv.span().end, "gated-rms-norm: gate elements")?;
    let params = GatedNormParams {
        groups: as_u32(groups, "gated-rms-norm: groups")?,
        heads: as_u32(zv.cols / dv, "gated-rms-norm: heads")?,
        dv: as_u32(dv, "gated-rms-norm: Dv")?,
        z_stride: as_u32(zv.stride, "gated-rms-norm: gate row stride")?,
        eps,
    };
    let dev = xs.device().clone();
    let pipeline = pipeline(&dev, &SOURCE, &format!("gated_rms_norm_{suffix}"))?;
    check_simd_width(&pipeline, "gated-rms-norm")?;
    let out = dev.new_buffer(n.max(1), xs.dtype(), "gated-rms-norm out")?;
    dispatch(
        &dev,
        &pipeline,
        &[
            input(xs.buffer(), x_off),
            input(zs.buffer(), element_bytes(zs, zv.offset)),
            input(ws.buffer(), w_off),
            output(&out, 0),
        ],
        &params,
        groups.div_ceil(ROWS_PER_GROUP),
        SIMD_WIDTH * ROWS_PER_GROUP,
    )?;
    Ok(MetalStorage::new(out, dev, n, xs.dtype()))
}
