//! The causal conv1d on Metal (`causal_conv1d.metal`): one thread per output element.

use candle_core::backend::BackendStorage;
use candle_core::{bail, Layout, MetalStorage, Result, Shape};
use objc2_metal::MTLSize;

use crate::backend::metal::{as_u32, byte_offset, dtype_suffix, pipeline, Source};

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
