//! The causal conv1d on Metal (`causal_conv1d.metal`): one thread per output element, the plain
//! conv over a window and the cached form (window read from the cache and the input in place,
//! the next cache written beside the output), and the split form over records' state and branch
//! rows in one dispatch.

use candle_core::backend::BackendStorage;
use candle_core::{bail, Layout, MetalStorage, Result, Shape};
use objc2_metal::MTLSize;

use crate::backend::metal::{
    as_u32, byte_offset, dispatch, dtype_suffix, input, output, pipeline, Source,
};
use crate::layout::rows::row_view;
use crate::layout::split::SplitBatch;

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

/// `ConvSplitParams` of causal_conv1d.metal.
#[repr(C)]
struct ConvSplitParams {
    r: u32,
    s: u32,
    b: u32,
    t: u32,
    c: u32,
    k: u32,
    s_stride: u32,
    b_stride: u32,
}

// The MSL struct has the same fields; the emulation harness asserts the same size.
const _: () = assert!(std::mem::size_of::<ConvSplitParams>() == 32);

/// The records' convs in one dispatch (`causal_conv1d_split_*`): the state rows `xs` from zeros,
/// the branch rows `xb` from their state rows' last K−1 real inputs, read in place; packed
/// `[R·S + B·T, C]` in the dtype of the inputs.
pub(crate) fn causal_conv1d_split(
    split: &SplitBatch,
    ss: &MetalStorage,
    sl: &Layout,
    bs: &MetalStorage,
    bl: &Layout,
    ws: &MetalStorage,
    wl: &Layout,
) -> Result<MetalStorage> {
    let channels = sl.dims()[2];
    let k = wl.dims()[1];
    if bs.dtype() != ss.dtype() {
        bail!(
            "causal-conv1d-split: branches {:?} are not the states' {:?} on Metal",
            bs.dtype(),
            ss.dtype()
        )
    }
    let x_suffix = dtype_suffix(ss.dtype(), "causal-conv1d-split x")?;
    let w_suffix = dtype_suffix(ws.dtype(), "causal-conv1d-split weight")?;
    let (state_rows, branch_rows) = (
        row_view(sl, "causal-conv1d-split states")?,
        row_view(bl, "causal-conv1d-split branches")?,
    );
    let w_off = byte_offset(wl, ws.dtype(), "causal-conv1d-split: weight")?;
    let n = split.tokens() * channels;
    as_u32(n, "causal-conv1d-split: output elements")?;
    as_u32(state_rows.span().end, "causal-conv1d-split: state elements")?;
    as_u32(
        branch_rows.span().end,
        "causal-conv1d-split: branch elements",
    )?;
    let params = ConvSplitParams {
        r: as_u32(split.states(), "causal-conv1d-split: state rows")?,
        s: as_u32(split.state_width(), "causal-conv1d-split: state steps")?,
        b: as_u32(split.branches(), "causal-conv1d-split: branch rows")?,
        t: as_u32(split.branch_width(), "causal-conv1d-split: branch steps")?,
        c: channels as u32,
        k: as_u32(k, "causal-conv1d-split: K")?,
        s_stride: as_u32(state_rows.stride, "causal-conv1d-split: state row stride")?,
        b_stride: as_u32(branch_rows.stride, "causal-conv1d-split: branch row stride")?,
    };
    // Metal has no empty buffers: an empty part still gets one (unread) entry.
    let as_buffer_data = |v: &[usize]| -> Vec<u32> {
        let v: Vec<u32> = v.iter().map(|&x| x as u32).collect();
        if v.is_empty() {
            vec![0]
        } else {
            v
        }
    };
    let dev = ss.device().clone();
    let pipeline = pipeline(
        &dev,
        &SOURCE,
        &format!("causal_conv1d_split_{x_suffix}_{w_suffix}"),
    )?;
    let lengths_buf = dev.new_buffer_with_data(&as_buffer_data(split.state_lengths()))?;
    let owners_buf = dev.new_buffer_with_data(&as_buffer_data(split.owners()))?;
    let out = dev.new_buffer(n.max(1), ss.dtype(), "causal-conv1d-split out")?;
    let elem = ss.dtype().size_in_bytes();
    dispatch(
        &dev,
        &pipeline,
        &[
            input(ss.buffer(), state_rows.offset * elem),
            input(bs.buffer(), branch_rows.offset * elem),
            input(ws.buffer(), w_off),
            input(&lengths_buf, 0),
            input(&owners_buf, 0),
            output(&out, 0),
        ],
        &params,
        n.div_ceil(CONV_THREADS_PER_GROUP),
        CONV_THREADS_PER_GROUP,
    )?;
    Ok(MetalStorage::new(out, dev, n, ss.dtype()))
}
