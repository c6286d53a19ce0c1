//! A MoE layer's routed experts (docs/BACKBONE.md §5): each token goes to its `k` most probable
//! experts under the router's softmax, weighted by those probabilities renormalised over the
//! `k`, and the experts' SwiGLU outputs are summed.
//!
//! On CUDA [`routed_experts`] never leaves the device (`moe.cu`, `moe_mm.cu`): the routing, the
//! grouping of the (token, expert) slots by expert, one launch for every expert's `[gate | up]`
//! product with SwiGLU and one for every expert's down product (tensor cores for bf16 and f16),
//! and the combine; so a CUDA graph replays a MoE layer like any other. Elsewhere
//! [`routed_experts_ref`] composes the same from candle ops, the routes picked on the host
//! ([`Routes`]): kev-candle runs that form on the CPU and Metal with its own projections.

#[cfg(feature = "cuda")]
mod cuda;

use candle_core::{bail, DType, Result, Tensor};

use crate::dispatch;

/// Each expert's tokens and their routing weights, picked on the host.
pub struct Routes {
    /// Per expert: its tokens in ascending order and their weights.
    pub by_expert: Vec<(Vec<u32>, Vec<f32>)>,
}

impl Routes {
    /// Per token (a row of router logits): the softmax over the experts, the `k` most probable
    /// (the lower index first among equals), their probabilities divided by their sum.
    pub fn pick(logits: &[Vec<f32>], experts: usize, k: usize) -> Self {
        let mut by_expert = vec![(Vec::new(), Vec::new()); experts];
        let mut order: Vec<usize> = Vec::with_capacity(experts);
        for (token, row) in logits.iter().enumerate() {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exp: Vec<f32> = row.iter().map(|&l| (l - max).exp()).collect();
            let sum: f32 = exp.iter().sum();
            order.clear();
            order.extend(0..experts);
            order.sort_by(|&a, &b| exp[b].total_cmp(&exp[a]).then(a.cmp(&b)));
            let top = &order[..k.min(experts)];
            let total: f32 = top.iter().map(|&x| exp[x] / sum).sum();
            for &x in top {
                by_expert[x].0.push(token as u32);
                by_expert[x].1.push(exp[x] / sum / total);
            }
        }
        Self { by_expert }
    }
}

/// The shapes of one call, checked: tokens, hidden size, experts, expert width.
fn check(
    x: &Tensor,
    logits: &Tensor,
    gate_up: &Tensor,
    down: &Tensor,
    k: usize,
) -> Result<(usize, usize, usize, usize)> {
    let (t, h) = x.dims2()?;
    let (lt, e) = logits.dims2()?;
    let (ge, two_i, gh) = gate_up.dims3()?;
    let i = two_i / 2;
    if lt != t || ge != e || gh != h || two_i % 2 != 0 || down.dims() != [e, h, i] {
        bail!(
            "routed experts: x {:?}, logits {:?}, gate_up {:?} and down {:?} do not fit \
             ([T, H], [T, E], [E, 2I, H], [E, H, I])",
            x.dims(),
            logits.dims(),
            gate_up.dims(),
            down.dims()
        )
    }
    if k == 0 || k > e {
        bail!("routed experts: {k} experts per token of {e}")
    }
    if gate_up.dtype() != x.dtype() || down.dtype() != x.dtype() {
        bail!("routed experts: weights and activations differ in dtype")
    }
    Ok((t, h, e, i))
}

/// The routed experts' sum `[T, H]` for `x: [T, H]` with router logits `logits: [T, E]` (in
/// the activations' dtype, as the router's product gives them) and the experts' fused weights
/// `gate_up: [E, 2·I, H]` (gate rows, then up rows) and `down: [E, H, I]`, `k` experts per
/// token. Rounded where transformers' eager loop rounds in the dtype; the weights are the
/// renormalised probabilities rounded to the dtype, and each token's experts are added in
/// ascending order. CUDA runs its kernels; any other device runs [`routed_experts_ref`].
pub fn routed_experts(
    x: &Tensor,
    logits: &Tensor,
    gate_up: &Tensor,
    down: &Tensor,
    k: usize,
) -> Result<Tensor> {
    let (t, h, _, _) = check(x, logits, gate_up, down, k)?;
    if t == 0 {
        return Tensor::zeros((0, h), x.dtype(), x.device());
    }
    if dispatch::backend(x.device()) != dispatch::Backend::Cuda {
        return routed_experts_ref(x, logits, gate_up, down, k);
    }
    let chunks = x.dim(0)?.div_ceil(CHUNK_TOKENS).max(1);
    dispatch::launch(
        "moe",
        5 * chunks,
        x.device(),
        || {
            #[cfg(feature = "cuda")]
            {
                cuda::routed_experts(x, logits, gate_up, down, k)
            }
            #[cfg(not(feature = "cuda"))]
            bail!("routed experts: built without CUDA")
        },
        || routed_experts_ref(x, logits, gate_up, down, k),
    )
}

/// Tokens per launch sequence on CUDA: bounds the slot buffers (16,384 tokens of k = 8 at
/// H = 2048 in bf16: 0.5 GB of expert outputs) and keeps the tiles within a grid's 65,535 rows.
pub const CHUNK_TOKENS: usize = 16384;

/// [`routed_experts`] composed from candle ops on any device: the routes picked on the host
/// ([`Routes`] on the logits as f32), each chosen expert's tokens gathered, multiplied, weighted
/// and added back into place expert by expert in index order, as transformers' eager loop does.
pub fn routed_experts_ref(
    x: &Tensor,
    logits: &Tensor,
    gate_up: &Tensor,
    down: &Tensor,
    k: usize,
) -> Result<Tensor> {
    let (t, h, e, _) = check(x, logits, gate_up, down, k)?;
    let rows = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let routes = Routes::pick(&rows, e, k);
    let mut out = Tensor::zeros((t, h), x.dtype(), x.device())?;
    for (expert, (tokens, weights)) in routes.by_expert.iter().enumerate() {
        if tokens.is_empty() {
            continue;
        }
        let index = Tensor::new(tokens.as_slice(), x.device())?;
        let picked = x.index_select(&index, 0)?;
        let gu = picked.matmul(&gate_up.get(expert)?.t()?)?;
        let y = crate::swiglu(&gu)?.matmul(&down.get(expert)?.t()?)?;
        let weights =
            Tensor::from_slice(weights, (weights.len(), 1), x.device())?.to_dtype(x.dtype())?;
        out = out.index_add(&index, &y.broadcast_mul(&weights)?, 0)?;
    }
    Ok(out)
}
