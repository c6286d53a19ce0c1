//! The MoE MLP on CUDA (`moe.cu`, `moe_mm.cu`): five launches per chunk of tokens, no
//! host round trip, nothing uploaded.

use candle_core::cuda_backend::cudarc::driver::{CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Device, Layout, Result, Shape, Tensor};

use super::{RoutedExperts, SharedExpert, CHUNK_TOKENS};
use crate::backend::cuda::gpu::gpu;
use crate::backend::cuda::kernel::{contiguous, cuda_of, rows_grid, tag, Kernel};
use crate::backend::cuda::sources::{
    MOE, MOE_ALIGN_THREADS, MOE_BM, MOE_BN, MOE_MAX_EXPERTS, MOE_MAX_K, MOE_MM, MOE_THREADS,
};

/// Warps per block of `moe_route_*`, a token each.
const ROUTE_WARPS: usize = 4;
/// Threads per block and columns per block of `moe_mm_simt_*`.
const SIMT_THREADS: u32 = 256;
const SIMT_COLUMNS: usize = 64;

/// [`super::moe_mlp`] on `x`'s GPU (shapes checked by the caller), a chunk of
/// [`CHUNK_TOKENS`] tokens at a time.
pub(crate) fn moe_mlp(
    x: &Tensor,
    logits: &Tensor,
    experts: RoutedExperts,
    shared: SharedExpert,
) -> Result<Tensor> {
    let k = experts.per_token;
    let Device::Cuda(dev) = x.device() else {
        bail!("routed experts: not on a CUDA device")
    };
    let (t, _) = x.dims2()?;
    let e = logits.dim(1)?;
    if e > MOE_MAX_EXPERTS || k > MOE_MAX_K {
        bail!(
            "routed experts on CUDA: {e} experts, {k} per token (at most {MOE_MAX_EXPERTS} and \
             {MOE_MAX_K})"
        )
    }
    let (gate_up, down) = (experts.gate_up.contiguous()?, experts.down.contiguous()?);
    let experts = RoutedExperts {
        gate_up: &gate_up,
        down: &down,
        per_token: k,
    };
    let chunks = (0..t)
        .step_by(CHUNK_TOKENS)
        .map(|start| {
            let len = CHUNK_TOKENS.min(t - start);
            let x = x.narrow(0, start, len)?.contiguous()?;
            let logits = logits.narrow(0, start, len)?.contiguous()?;
            let output = shared.output.narrow(0, start, len)?.contiguous()?;
            let gate = shared.gate.narrow(0, start, len)?.contiguous()?;
            let shared = SharedExpert {
                output: &output,
                gate: &gate,
            };
            chunk(dev, &x, &logits, experts, shared)
        })
        .collect::<Result<Vec<_>>>()?;
    match chunks.as_slice() {
        [one] => Ok(one.clone()),
        // Device-to-device copies: candle's `cat` would launch a kernel of its own.
        _ => crate::join_rows(&chunks.iter().collect::<Vec<_>>()),
    }
}

/// The operand of a contiguous tensor as a view of its storage.
fn view<'a, T: candle_core::cuda_backend::CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
    what: &str,
) -> Result<CudaView<'a, T>> {
    let (a, b) = contiguous(l, what)?;
    Ok(s.as_cuda_slice::<T>()?.slice(a..b))
}

fn chunk(
    dev: &CudaDevice,
    x: &Tensor,
    logits: &Tensor,
    experts: RoutedExperts,
    shared: SharedExpert,
) -> Result<Tensor> {
    let RoutedExperts {
        gate_up,
        down,
        per_token: k,
    } = experts;
    let (t, h) = x.dims2()?;
    let (e, i) = (logits.dim(1)?, down.dim(2)?);
    let dtype = x.dtype();
    let slots = t * k;
    // Each expert wastes at most one partial tile: Σ⌈c_e / BM⌉ ≤ ⌈slots / BM⌉ + experts used.
    let tiles = slots.div_ceil(MOE_BM) + e.min(slots);
    let (xs, xl) = x.storage_and_layout();
    let (ls, ll) = logits.storage_and_layout();
    let (gs, gl) = gate_up.storage_and_layout();
    let (ds, dl) = down.storage_and_layout();
    let (ss, sl) = shared.output.storage_and_layout();
    let (gts, gtl) = shared.gate.storage_and_layout();
    let (xs, ls) = (cuda_of(&xs, "moe x")?, cuda_of(&ls, "moe logits")?);
    let (gs, ds) = (cuda_of(&gs, "moe gate_up")?, cuda_of(&ds, "moe down")?);
    let (ss, gts) = (
        cuda_of(&ss, "moe shared")?,
        cuda_of(&gts, "moe shared gate")?,
    );
    let (t_, e_, k_, h_, slots_, tiles_) = (
        t as i32,
        e as i32,
        k as i32,
        h as i32,
        slots as i32,
        tiles as i32,
    );
    // The tensor-core products copy 16-byte pieces: rows and operands on 8-element boundaries.
    let aligned = [&xl, &gl, &dl].iter().all(|l| l.start_offset() % 8 == 0);
    let tensor_cores =
        dtype != DType::F32 && gpu(dev)?.tensor_cores && h % 8 == 0 && i % 8 == 0 && aligned;
    let tag = tag(dtype, "moe")?;
    let out = by_dtype!(dtype, "moe", |T| {
        let xv = view::<T>(xs, xl, "moe x")?;
        let lv = view::<T>(ls, ll, "moe logits")?;
        let gv = view::<T>(gs, gl, "moe gate_up")?;
        let dv = view::<T>(ds, dl, "moe down")?;
        let sv = view::<T>(ss, sl, "moe shared")?;
        let gtv = view::<T>(gts, gtl, "moe shared gate")?;

        let route = Kernel::for_dtype(&MOE, dev, "moe_route", dtype, "moe")?;
        let ids = route.output::<u32>(slots)?;
        let weights = route.output::<f32>(slots)?;
        let mut b = route.stream.launch_builder(&route.func);
        b.arg(&lv)
            .arg(&ids)
            .arg(&weights)
            .arg(&t_)
            .arg(&e_)
            .arg(&k_);
        let cfg = LaunchConfig {
            grid_dim: (t.div_ceil(ROUTE_WARPS).clamp(1, 4096) as u32, 1, 1),
            block_dim: (32 * ROUTE_WARPS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument types and order match `moe_route_*` in moe.cu; warps stride over
        // the tokens; k ≤ MOE_MAX_K (checked above).
        unsafe { b.launch(cfg) }.w()?;

        let align = Kernel::load(&MOE, dev, "moe_align")?;
        // Scratch (with `z` and `y` below): rows of padding are written and read by no kernel.
        let order = align.output::<u32>(tiles * MOE_BM)?;
        let tile_expert = align.output::<i32>(tiles)?;
        let mut b = align.stream.launch_builder(&align.func);
        b.arg(&ids)
            .arg(&slots_)
            .arg(&e_)
            .arg(&order)
            .arg(&tile_expert)
            .arg(&tiles_);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (MOE_ALIGN_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument types and order match `moe_align` in moe.cu; one block; `tiles`
        // bounds every routing (above), e ≤ MOE_MAX_EXPERTS.
        unsafe { b.launch(cfg) }.w()?;

        let z = align.output::<T>(tiles * MOE_BM * i)?;
        let y = align.output::<T>(slots * h)?;
        for (gate_up, a, w, c, n, kdim) in [
            (true, &xv, &gv, &z, i, h),
            (false, &z.slice(..), &dv, &y, h, i),
        ] {
            let part = if gate_up { "gu" } else { "down" };
            let (kernel, cfg) = if tensor_cores {
                let columns = if gate_up { MOE_BN / 2 } else { MOE_BN };
                (
                    Kernel::load(&MOE_MM, dev, &format!("moe_mm_{tag}_{part}"))?,
                    LaunchConfig {
                        grid_dim: (n.div_ceil(columns) as u32, tiles as u32, 1),
                        block_dim: (MOE_THREADS, 1, 1),
                        shared_mem_bytes: 0,
                    },
                )
            } else {
                let columns = if gate_up {
                    SIMT_COLUMNS / 2
                } else {
                    SIMT_COLUMNS
                };
                (
                    Kernel::load(&MOE, dev, &format!("moe_mm_simt_{tag}_{part}"))?,
                    LaunchConfig {
                        grid_dim: (n.div_ceil(columns) as u32, tiles as u32, 1),
                        block_dim: (SIMT_THREADS, 1, 1),
                        shared_mem_bytes: 0,
                    },
                )
            };
            let (n_, kdim_) = (n as i32, kdim as i32);
            let mut b = kernel.stream.launch_builder(&kernel.func);
            b.arg(a).arg(w).arg(c).arg(&order).arg(&tile_expert);
            b.arg(&n_).arg(&kdim_).arg(&k_);
            // SAFETY: argument types and order match `moe_mm_*` / `moe_mm_simt_*` (moe_mm.cu,
            // moe.cu); the tensor-core kernels need kdim % 8 == 0 (h and i, checked above);
            // tiles ≤ 65,535 rows of the grid (CHUNK_TOKENS).
            unsafe { b.launch(cfg) }.w()?;
        }

        let combine = Kernel::for_dtype(&MOE, dev, "moe_combine", dtype, "moe")?;
        let out = combine.output::<T>(t * h)?;
        let mut b = combine.stream.launch_builder(&combine.func);
        b.arg(&y)
            .arg(&ids)
            .arg(&weights)
            .arg(&sv)
            .arg(&gtv)
            .arg(&out);
        b.arg(&t_).arg(&k_).arg(&h_);
        // SAFETY: argument types and order match `moe_combine_*` in moe.cu; the grid strides
        // over the tokens and the columns.
        unsafe { b.launch(rows_grid(h, t)) }.w()?;
        Ok::<_, candle_core::Error>(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    })?;
    Ok(Tensor::from((
        candle_core::Storage::Cuda(out),
        Shape::from((t, h)),
    )))
}
