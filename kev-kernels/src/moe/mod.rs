//! A MoE layer's MLP past its router and shared expert (docs/BACKBONE.md §5.3): each token goes to
//! its `k` most probable experts under the router's softmax, weighted by those probabilities
//! renormalised over the `k`; the experts' SwiGLU outputs are summed, and the shared expert's
//! output behind its sigmoid gate is added.
//!
//! On CUDA [`moe_mlp`] never leaves the device (`moe.cu`, `moe_mm.cu`): the routing, the
//! grouping of the (token, expert) slots by expert, one launch for every expert's `[gate | up]`
//! product with SwiGLU and one for every expert's down product (tensor cores for bf16 and f16),
//! and the combine with the shared expert; so a CUDA graph replays a MoE layer like any other.
//! Elsewhere [`moe_mlp_ref`] composes the same from candle ops, the routes picked on the host
//! ([`routed_sum`]), which kev-candle runs on the CPU and Metal with its own projections.

#[cfg(feature = "cuda")]
mod cuda;

use candle_core::{bail, DType, Result, Tensor};

use crate::dispatch;

/// Each expert's tokens and their routing weights, picked on the host.
struct Routes {
    /// Per expert: its tokens in ascending order and their weights.
    by_expert: Vec<(Vec<u32>, Vec<f32>)>,
}

impl Routes {
    /// Per token (a row of router logits): the softmax over the experts, the `k` most probable
    /// (the lower index first among equals), their probabilities divided by their sum.
    fn pick(logits: &[Vec<f32>], experts: usize, k: usize) -> Self {
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

/// The routed experts' sum `[T, H]` with the routes picked on the host ([`Routes`] on
/// `logits: [T, experts]` as f32): each chosen expert's tokens (rows of `x: [T, H]`) gathered,
/// `expert(e, rows)` giving their outputs, weighted (the weights rounded to the activations'
/// dtype, as the reference rounds them to the router's) and added back into place expert by
/// expert in index order, as transformers' eager loop does. Tokens no expert was chosen for
/// cost nothing.
pub fn routed_sum(
    x: &Tensor,
    logits: &Tensor,
    experts: usize,
    k: usize,
    expert: impl Fn(usize, &Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let rows = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let routes = Routes::pick(&rows, experts, k);
    let mut out = Tensor::zeros(x.dims(), x.dtype(), x.device())?;
    for (e, (tokens, weights)) in routes.by_expert.iter().enumerate() {
        if tokens.is_empty() {
            continue;
        }
        let index = Tensor::new(tokens.as_slice(), x.device())?;
        let y = expert(e, &x.index_select(&index, 0)?)?;
        let weights =
            Tensor::from_slice(weights, (weights.len(), 1), x.device())?.to_dtype(x.dtype())?;
        out = out.index_add(&index, &y.broadcast_mul(&weights)?, 0)?;
    }
    Ok(out)
}

/// A MoE layer's shared expert, as computed: its output `[T, H]` and its gate's logit `[T, 1]`.
#[derive(Clone, Copy)]
pub struct SharedExpert<'a> {
    pub output: &'a Tensor,
    pub gate: &'a Tensor,
}

impl SharedExpert<'_> {
    /// `sigmoid(gate) · output` from candle ops: the sigmoid in f32 rounded once to the dtype,
    /// as torch's is, then the product in the dtype.
    pub fn gated(&self) -> Result<Tensor> {
        let gate = ((self.gate.to_dtype(DType::F32)?.neg()?.exp()? + 1.0)?.recip()?)
            .to_dtype(self.output.dtype())?;
        self.output.broadcast_mul(&gate)
    }
}

/// A MoE layer's routed experts: their fused weights `gate_up: [E, 2·I, H]` (each expert's gate
/// rows, then its up rows) and `down: [E, H, I]`, and the experts each token goes to.
#[derive(Clone, Copy)]
pub struct RoutedExperts<'a> {
    pub gate_up: &'a Tensor,
    pub down: &'a Tensor,
    pub per_token: usize,
}

/// The shapes of one call, checked: tokens, hidden size, experts, expert width.
fn check(
    x: &Tensor,
    logits: &Tensor,
    experts: RoutedExperts,
    shared: SharedExpert,
) -> Result<(usize, usize, usize, usize)> {
    let RoutedExperts {
        gate_up,
        down,
        per_token: k,
    } = experts;
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
    if h == 0 || i == 0 {
        bail!("routed experts: a hidden size of {h} and an expert width of {i} (both must be > 0)")
    }
    if shared.output.dims() != [t, h] || shared.gate.dims() != [t, 1] {
        bail!(
            "routed experts: the shared expert's output {:?} and gate {:?} do not fit [{t}, {h}] \
             and [{t}, 1]",
            shared.output.dims(),
            shared.gate.dims()
        )
    }
    let dtypes = [logits, gate_up, down, shared.output, shared.gate].map(|w| w.dtype());
    if dtypes.iter().any(|&d| d != x.dtype()) {
        bail!("routed experts: logits, weights, shared expert and activations differ in dtype")
    }
    Ok((t, h, e, i))
}

/// The MoE MLP's output `[T, H]` for `x: [T, H]` with router logits `logits: [T, E]` (in the
/// activations' dtype, as the router's product gives them), the routed `experts` and the
/// `shared` one. Rounded where transformers rounds in the dtype: the weights
/// are the renormalised probabilities rounded to the dtype, each token's experts are added in
/// ascending order (its eager loop's `index_add_`), then the gated shared expert. CUDA runs its
/// kernels; any other device runs [`moe_mlp_ref`].
pub fn moe_mlp(
    x: &Tensor,
    logits: &Tensor,
    experts: RoutedExperts,
    shared: SharedExpert,
) -> Result<Tensor> {
    let (t, h, _, _) = check(x, logits, experts, shared)?;
    if t == 0 {
        return Tensor::zeros((0, h), x.dtype(), x.device());
    }
    if dispatch::backend(x.device()) != dispatch::Backend::Cuda {
        return moe_mlp_ref(x, logits, experts, shared);
    }
    dispatch::launch(
        "moe",
        5 * t.div_ceil(CHUNK_TOKENS),
        x.device(),
        || {
            #[cfg(feature = "cuda")]
            {
                cuda::moe_mlp(x, logits, experts, shared)
            }
            #[cfg(not(feature = "cuda"))]
            bail!("routed experts: built without CUDA")
        },
        || moe_mlp_ref(x, logits, experts, shared),
    )
}

/// Tokens per launch sequence on CUDA: bounds the slot buffers (16,384 tokens of k = 8 at
/// H = 2048 in bf16: 0.5 GB of expert outputs) and keeps the tiles within a grid's 65,535 rows.
pub const CHUNK_TOKENS: usize = 16384;

/// [`moe_mlp`] composed from candle ops on any device: [`routed_sum`] with each expert's
/// products on its slice of the fused weights, then the gated shared expert.
pub fn moe_mlp_ref(
    x: &Tensor,
    logits: &Tensor,
    experts: RoutedExperts,
    shared: SharedExpert,
) -> Result<Tensor> {
    let (_, _, e, _) = check(x, logits, experts, shared)?;
    let RoutedExperts {
        gate_up,
        down,
        per_token,
    } = experts;
    let routed = routed_sum(x, logits, e, per_token, |expert, rows| {
        let gu = rows.matmul(&gate_up.get(expert)?.t()?)?;
        crate::swiglu(&gu)?.matmul(&down.get(expert)?.t()?)
    })?;
    routed + shared.gated()?
}

#[cfg(test)]
mod tests {
    use super::Routes;

    /// The top k by probability, weights renormalised over them; ties to the lower index.
    #[test]
    fn routes_pick_the_top_k_and_renormalise() {
        let logits = vec![vec![0.0, 2.0, 1.0, -1.0], vec![3.0, 3.0, 0.0, 0.0]];
        let routes = Routes::pick(&logits, 4, 2);
        let tokens: Vec<&Vec<u32>> = routes.by_expert.iter().map(|r| &r.0).collect();
        assert_eq!(tokens, [&vec![1], &vec![0, 1], &vec![0], &vec![]]);
        let (p1, p2) = (2f32.exp(), 1f32.exp());
        let w = &routes.by_expert;
        assert!((w[1].1[0] - p1 / (p1 + p2)).abs() < 1e-6);
        assert!((w[2].1[0] - p2 / (p1 + p2)).abs() < 1e-6);
        // Equal logits: lower index first, half each.
        assert!((w[0].1[0] - 0.5).abs() < 1e-6 && (w[1].1[1] - 0.5).abs() < 1e-6);
    }
}
