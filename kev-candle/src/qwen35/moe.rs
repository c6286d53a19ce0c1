//! The mixture-of-experts MLP of Qwen3.5's MoE backbones (transformers' `qwen3_5_moe`,
//! docs/BACKBONE.md §5): a router sends each token to its top-k routed SwiGLU experts, weighted
//! by their renormalised softmax probabilities, and every token also goes through one shared
//! SwiGLU expert scaled by a sigmoid gate.
//!
//! The routing is decided on the host: the router's logits come back, each token's experts are
//! picked there, and each chosen expert multiplies only its own tokens (gathered, then added back
//! into place, expert by expert in index order as the reference does). Tokens that no expert
//! was chosen for cost nothing.

use candle_core::{DType, Device, Module, Result, Tensor};
use kev_kernels::swiglu;

use super::config::ExpertsShape;
use super::linear::{linear, linear_cat, Projection};
use super::mlp::Mlp;
use crate::weights::Weights;

/// One layer's experts, router and shared expert.
pub struct SparseMoe {
    /// `gate.weight: [E, H]`.
    router: Projection,
    /// Per routed expert: `[gate | up]: [2·I, H]` and `down: [H, I]`.
    experts: Vec<(Projection, Projection)>,
    shared: Mlp,
    /// `shared_expert_gate.weight: [1, H]`.
    shared_gate: Projection,
    per_token: usize,
}

impl SparseMoe {
    /// Loads `{prefix}.*` (`layers.{i}.mlp`). The routed experts may be stored per expert
    /// (`experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`: the published checkpoints) or
    /// fused (`experts.gate_up_proj: [E, 2·I, H]`, `experts.down_proj: [E, H, I]`: what
    /// transformers holds in memory); a missing tensor is named in the per-expert layout.
    pub fn new(
        shape: &ExpertsShape,
        hidden: usize,
        w: &Weights,
        prefix: &str,
    ) -> kev_core::Result<Self> {
        let (e, i, h) = (shape.experts, shape.width, hidden);
        let fused = format!("{prefix}.experts.gate_up_proj");
        let experts = if w.contains(&fused) {
            let dtype = w.projection_dtype();
            let Some(two_i) = i.checked_mul(2) else {
                return Err(kev_core::Error::Tensor {
                    name: fused,
                    message: format!("an expert width of {i} has no [gate | up] of 2 x {i} rows"),
                });
            };
            let gate_up = w.get_as(&fused, &[e, two_i, h], dtype)?;
            let down_name = format!("{prefix}.experts.down_proj");
            let down = w.get_as(&down_name, &[e, h, i], dtype)?;
            let expert = |t: &Tensor, name: &str, x: usize| {
                t.get(x)
                    .and_then(|t| Projection::new(t.contiguous()?, w.int8_projections()))
                    .map_err(|err| kev_core::Error::backend(format!("`{name}` expert {x}"), err))
            };
            (0..e)
                .map(|x| Ok((expert(&gate_up, &fused, x)?, expert(&down, &down_name, x)?)))
                .collect::<kev_core::Result<Vec<_>>>()?
        } else {
            (0..e)
                .map(|x| {
                    let p = format!("{prefix}.experts.{x}");
                    let gate_up = linear_cat(
                        w,
                        &[(&format!("{p}.gate_proj"), i), (&format!("{p}.up_proj"), i)],
                        h,
                    )?;
                    Ok((gate_up, linear(w, &format!("{p}.down_proj"), i, h)?))
                })
                .collect::<kev_core::Result<Vec<_>>>()?
        };
        Ok(Self {
            router: linear(w, &format!("{prefix}.gate"), h, e)?,
            experts,
            shared: Mlp::new(w, &format!("{prefix}.shared_expert"), h, shape.shared_width)?,
            shared_gate: linear(w, &format!("{prefix}.shared_expert_gate"), h, 1)?,
            per_token: shape.per_token,
        })
    }

    /// `xs: [.., H]` (any leading dims).
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let dims = xs.dims().to_vec();
        let h = *dims.last().unwrap_or(&0);
        let x = xs.reshape(((), h))?;
        let n = x.dim(0)?;
        let logits = self
            .router
            .forward(&x)?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?;
        let routes = Routes::pick(&logits, self.experts.len(), self.per_token);
        let mut out = Tensor::zeros((n, h), x.dtype(), x.device())?;
        for (expert, (gate_up, down)) in self.experts.iter().enumerate() {
            let (tokens, weights) = &routes.by_expert[expert];
            if tokens.is_empty() {
                continue;
            }
            let index = Tensor::new(tokens.as_slice(), x.device())?;
            let picked = x.index_select(&index, 0)?;
            let y = down.forward(&swiglu(&gate_up.forward(&picked)?)?)?;
            let weights = column(weights, x.dtype(), x.device())?;
            out = out.index_add(&index, &y.broadcast_mul(&weights)?, 0)?;
        }
        let gate = candle_nn::ops::sigmoid(&self.shared_gate.forward(&x)?)?;
        let shared = self.shared.forward(&x)?.broadcast_mul(&gate)?;
        (out + shared)?.reshape(dims)
    }
}

/// `values` as a `[N, 1]` column in `dtype` (the routing weights rounded to the activations'
/// dtype, as the reference rounds them to the router's).
fn column(values: &[f32], dtype: DType, device: &Device) -> Result<Tensor> {
    Tensor::from_slice(values, (values.len(), 1), device)?.to_dtype(dtype)
}

/// Each expert's tokens and their routing weights.
struct Routes {
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
            let top = &order[..k];
            let total: f32 = top.iter().map(|&x| exp[x] / sum).sum();
            for &x in top {
                by_expert[x].0.push(token as u32);
                by_expert[x].1.push(exp[x] / sum / total);
            }
        }
        Self { by_expert }
    }
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
