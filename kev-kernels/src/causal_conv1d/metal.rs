//! The causal conv1d on Metal (`causal_conv1d.metal`): one thread per output element, the plain
//! conv over a window and the cached form (window read from the cache and the input in place,
//! the next cache written beside the output).

use candle_core::backend::BackendStorage;
use candle_core::{bail, Layout, MetalStorage, Result, Shape};
use objc2_metal::MTLSize;

use crate::backend::metal::{
    as_u32, byte_offset, dispatch, dtype_suffix, input, output, pipeline, Source,
};
use crate::layout::rows::row_view;

const SOURCE: Source = Source {
    name: "causal_conv1d",
    text: include_str!("causal_conv1d.metal"),
};

/// Threads per causal-conv1d threadgroup (one output element each); a common Metal default.
const CONV_THREADS_PER_GROUP: usize = 256;

/// `ConvParams` of causal_conv1d.metal.
#[repr(C)]
struct ConvParams {
    b: u32,
    t: u32,
    c: u32,
    k: u32,
}

// The MSL struct has the same fields; the emulation harness asserts the same size.
const _: () = assert!(std::mem::size_of::<ConvParams>() == 16);

pub(crate) fn causal_conv1d(
    kernel: usize,
    xs: &MetalStorage,
    xl: &Layout,
    ws: &MetalStorage,
    wl: &Layout,
) -> Result<(MetalStorage, Shape)> {
    let (b_sz, padded_len, channels) = xl.shape().dims3()?;
    let k = kernel;
    if k == 0 || padded_len < k || wl.shape().dims2()? != (channels, k) {
        bail!(
            "causal-conv1d: input {:?} does not fit weight {:?}",
            xl.shape().dims(),
            wl.shape().dims()
        )
    }
    let seq_len = padded_len + 1 - k;
    let x_suffix = dtype_suffix(xs.dtype(), "causal-conv1d x")?;
    let w_suffix = dtype_suffix(ws.dtype(), "causal-conv1d weight")?;
    let x_off = byte_offset(xl, xs.dtype(), "causal-conv1d: x")?;
    let w_off = byte_offset(wl, ws.dtype(), "causal-conv1d: weight")?;
    let n = b_sz * seq_len * channels;
    as_u32(b_sz * padded_len * channels, "causal-conv1d: x elements")?;
    let params = ConvParams {
        b: b_sz as u32,
        t: seq_len as u32,
        c: channels as u32,
        k: as_u32(k, "causal-conv1d: K")?,
    };

    let dev = xs.device().clone();
    let pipeline = pipeline(
        &dev,
        &SOURCE,
        &format!("causal_conv1d_{x_suffix}_{w_suffix}"),
    )?;
    let y = dev.new_buffer(n.max(1), xs.dtype(), "causal-conv1d y")?;
    if n > 0 {
        let guard = dev.command_encoder()?;
        let enc: &candle_metal_kernels::metal::ComputeCommandEncoder = guard.as_ref();
        enc.set_compute_pipeline_state(&pipeline);
        enc.set_input_buffer(0, Some(xs.buffer()), x_off);
        enc.set_input_buffer(1, Some(ws.buffer()), w_off);
        enc.set_output_buffer(2, Some(&y), 0);
        enc.set_bytes(3, &params);
        enc.dispatch_thread_groups(
            MTLSize {
                width: n.div_ceil(CONV_THREADS_PER_GROUP),
                height: 1,
                depth: 1,
            },
            MTLSize {
                width: CONV_THREADS_PER_GROUP,
                height: 1,
                depth: 1,
            },
        );
    }
    let storage = MetalStorage::new(y, dev, n, xs.dtype());
    Ok((storage, Shape::from((b_sz, seq_len, channels))))
}

/// `ConvCachedParams` of causal_conv1d.metal.
#[repr(C)]
struct ConvCachedParams {
    b: u32,
    t: u32,
    c: u32,
    k: u32,
    x_stride: u32,
}

// The MSL struct has the same fields; the emulation harness asserts the same size.
const _: () = assert!(std::mem::size_of::<ConvCachedParams>() == 20);

/// The conv over `[cache; x]` and the next cache, packed `[y: B·T·C | next: B·(K−1)·C]` in the
/// dtype of `x`; `lengths` the real steps per row (`None`: all T).
pub(crate) fn causal_conv1d_cached(
    lengths: Option<&[u32]>,
    xs: &MetalStorage,
    xl: &Layout,
    cs: &MetalStorage,
    cl: &Layout,
    ws: &MetalStorage,
    wl: &Layout,
) -> Result<MetalStorage> {
    let (b_sz, seq_len, channels) = xl.shape().dims3()?;
    let k = wl.dims()[1];
    if cs.dtype() != xs.dtype() {
        bail!(
            "causal-conv1d: cache {:?} is not the input's {:?} on Metal",
            cs.dtype(),
            xs.dtype()
        )
    }
    let x_suffix = dtype_suffix(xs.dtype(), "causal-conv1d x")?;
    let w_suffix = dtype_suffix(ws.dtype(), "causal-conv1d weight")?;
    let xv = row_view(xl, "causal-conv1d x")?;
    let c_off = byte_offset(cl, cs.dtype(), "causal-conv1d: cache")?;
    let w_off = byte_offset(wl, ws.dtype(), "causal-conv1d: weight")?;
    let n = b_sz * (seq_len + k - 1) * channels;
    as_u32(n, "causal-conv1d: output elements")?;
    as_u32(xv.span().end, "causal-conv1d: x elements")?;
    let params = ConvCachedParams {
        b: b_sz as u32,
        t: seq_len as u32,
        c: channels as u32,
        k: as_u32(k, "causal-conv1d: K")?,
        x_stride: as_u32(xv.stride, "causal-conv1d: x row stride")?,
    };
    let all = vec![seq_len as u32; b_sz];
    let lengths = lengths.unwrap_or(&all);
    let dev = xs.device().clone();
    let pipeline = pipeline(
        &dev,
        &SOURCE,
        &format!("causal_conv1d_cached_{x_suffix}_{w_suffix}"),
    )?;
    // Metal has no empty buffers: an empty batch still gets one (unread) length.
    let lengths_buf = dev.new_buffer_with_data(if lengths.is_empty() { &[0] } else { lengths })?;
    let out = dev.new_buffer(n.max(1), xs.dtype(), "causal-conv1d cached out")?;
    dispatch(
        &dev,
        &pipeline,
        &[
            input(xs.buffer(), xv.offset * xs.dtype().size_in_bytes()),
            input(cs.buffer(), c_off),
            input(ws.buffer(), w_off),
            input(&lengths_buf, 0),
            output(&out, 0),
        ],
        &params,
        n.div_ceil(CONV_THREADS_PER_GROUP),
        CONV_THREADS_PER_GROUP,
    )?;
    Ok(MetalStorage::new(out, dev, n, xs.dtype()))
}
