//! The Metal layer under the ops' Metal implementations: MSL sources compiled at run time, once
//! per device, and their pipelines cached; the helpers the implementations share. It knows no op.
//!
//! Each op's MSL source lies beside it (`<op>/<op>.metal`, opening with its grid and buffer
//! contract). Every buffer a kernel writes is declared with `set_output_buffer` (the in-place
//! state included): since candle 0.11 the compute encoder dispatches concurrently and inserts
//! barriers only from those declarations (docs/DESIGN.md §4). Outputs are allocated before taking
//! the command encoder, which holds candle's command mutex.
//!
//! The kernels' logic is tested on Linux by the emulation harness (`tests/metal_emu/`); on a Mac,
//! `tests/metal_ops.rs` runs them against the CPU ops.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock, PoisonError};

use candle_core::metal_backend::DeviceId;
use candle_core::{bail, DType, Layout, MetalDevice, MetalError, Result};
use candle_metal_kernels::metal::{Buffer, ComputePipeline, Library};
use objc2_metal::{MTLComputePipelineState, MTLSize};

/// One MSL source file, compiled into one library per device.
pub(crate) struct Source {
    pub(crate) name: &'static str,
    pub(crate) text: &'static str,
}

/// Metal's limit for `setBytes`; larger per-row lengths go through a buffer.
pub(crate) const SET_BYTES_LIMIT: usize = 4096;

type LibraryCache = HashMap<(DeviceId, &'static str), Library>;
type PipelineCache = HashMap<(DeviceId, String), ComputePipeline>;

/// The pipeline of entry point `function` of `source` on `dev`, compiled on first use.
pub(crate) fn pipeline(
    dev: &MetalDevice,
    source: &Source,
    function: &str,
) -> Result<ComputePipeline> {
    static LIBRARIES: OnceLock<Mutex<LibraryCache>> = OnceLock::new();
    static PIPELINES: OnceLock<Mutex<PipelineCache>> = OnceLock::new();
    let key = (dev.id(), function.to_string());
    // A panic while holding a cache lock cannot leave a half-inserted entry: keep using it.
    let mut pipelines = PIPELINES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if let Some(p) = pipelines.get(&key) {
        return Ok(p.clone());
    }
    let library = {
        let mut libraries = LIBRARIES
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match libraries.get(&(dev.id(), source.name)) {
            Some(l) => l.clone(),
            None => {
                let l = dev
                    .metal_device()
                    .new_library_with_source(source.text, None)
                    .map_err(MetalError::from)?;
                libraries.insert((dev.id(), source.name), l.clone());
                l
            }
        }
    };
    let f = library
        .get_function(function, None)
        .map_err(MetalError::from)?;
    let p = dev
        .metal_device()
        .new_compute_pipeline_state_with_function(&f)
        .map_err(MetalError::from)?;
    pipelines.insert(key, p.clone());
    Ok(p)
}

/// The suffix of the entry points for an element type (bf16 is read as ushort in MSL).
pub(crate) fn dtype_suffix(dtype: DType, what: &str) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => bail!("{what}: unsupported dtype {other:?} on Metal"),
    })
}

/// The byte offset of a contiguous layout's first element.
pub(crate) fn byte_offset(l: &Layout, dtype: DType, what: &str) -> Result<usize> {
    if !l.is_contiguous() {
        bail!("{what} must be contiguous on Metal")
    }
    Ok(l.start_offset() * dtype.size_in_bytes())
}

/// `x` as a kernel's 32-bit index, or an error naming `what`.
pub(crate) fn as_u32(x: usize, what: &str) -> Result<u32> {
    match u32::try_from(x) {
        Ok(v) => Ok(v),
        Err(_) => bail!("{what} = {x} does not fit the kernel's 32-bit indices"),
    }
}

/// One buffer of a dispatch: the buffer, the byte offset of its first element, and whether the
/// kernel writes it (declared so, candle orders later readers after the dispatch).
pub(crate) struct Binding<'a> {
    pub(crate) buffer: &'a Buffer,
    pub(crate) offset: usize,
    pub(crate) written: bool,
}

/// A buffer the kernel only reads.
pub(crate) fn input(buffer: &Buffer, offset: usize) -> Binding<'_> {
    Binding {
        buffer,
        offset,
        written: false,
    }
}

/// A buffer the kernel writes.
pub(crate) fn output(buffer: &Buffer, offset: usize) -> Binding<'_> {
    Binding {
        buffer,
        offset,
        written: true,
    }
}

/// Simdgroup width the row kernels (one simdgroup per row) are written for.
pub(crate) const SIMD_WIDTH: usize = 32;

/// Encodes one dispatch of `pipeline` over `groups` threadgroups of `threads` threads (1-d):
/// `bindings` at buffer indices 0.., then `params` (set_bytes) at the next index. Allocate every
/// buffer before calling: the encoder holds candle's command mutex.
pub(crate) fn dispatch<P>(
    dev: &MetalDevice,
    pipeline: &ComputePipeline,
    bindings: &[Binding<'_>],
    params: &P,
    groups: usize,
    threads: usize,
) -> Result<()> {
    if groups == 0 {
        return Ok(());
    }
    let guard = dev.command_encoder()?;
    let enc: &candle_metal_kernels::metal::ComputeCommandEncoder = guard.as_ref();
    enc.set_compute_pipeline_state(pipeline);
    for (index, b) in bindings.iter().enumerate() {
        if b.written {
            enc.set_output_buffer(index, Some(b.buffer), b.offset);
        } else {
            enc.set_input_buffer(index, Some(b.buffer), b.offset);
        }
    }
    enc.set_bytes(bindings.len(), params);
    enc.dispatch_thread_groups(
        MTLSize {
            width: groups,
            height: 1,
            depth: 1,
        },
        MTLSize {
            width: threads,
            height: 1,
            depth: 1,
        },
    );
    Ok(())
}

/// Fails unless `pipeline` runs `SIMD_WIDTH`-wide simdgroups (the row kernels assume it).
pub(crate) fn check_simd_width(pipeline: &ComputePipeline, what: &str) -> Result<()> {
    let width = pipeline.as_ref().threadExecutionWidth();
    if width != SIMD_WIDTH {
        bail!("{what}: the kernel needs {SIMD_WIDTH}-wide simdgroups, this GPU runs {width}")
    }
    Ok(())
}
