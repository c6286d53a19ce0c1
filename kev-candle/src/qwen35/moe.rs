//! The mixture-of-experts MLP of Qwen3.5's MoE backbones (transformers' `qwen3_5_moe`,
//! docs/BACKBONE.md §5): a router sends each token to its top-k routed SwiGLU experts, weighted
//! by their renormalised softmax probabilities, and every token also goes through one shared
//! SwiGLU expert scaled by a sigmoid gate.
//!
//! On CUDA the routed experts stay on the device as two fused `[E, 2·I, H]` and `[E, H, I]`
//! tensors, and [`kev_kernels::moe_mlp`] routes, groups and multiplies them there (no host
//! round trip, so CUDA graphs replay the layer). On the CPU and Metal the routing is decided on
//! the host ([`kev_kernels::routed_sum`]), and each chosen expert multiplies only its own tokens
//! with its own projections (gathered, then added back into place, expert by expert in index
//! order as the reference does). Tokens that no expert was chosen for cost nothing.

use candle_core::{Module, Result, Tensor};
use kev_kernels::dispatch::{self, Backend};
use kev_kernels::{swiglu, RoutedExperts, SharedExpert};

use super::config::ExpertsShape;
use super::linear::{linear, linear_cat, linear_router, Projection};
use super::mlp::Mlp;
use crate::weights::{Quantization, Weights};

/// The routed experts' weights, as the backend multiplies them.
enum Experts {
    /// Per routed expert: `[gate | up]: [2·I, H]` and `down: [H, I]` (CPU, Metal).
    Each(Vec<(Projection, Projection)>),
    /// Every expert's `[gate | up]`: `[E, 2·I, H]` and `down`: `[E, H, I]` (CUDA).
    Fused { gate_up: Tensor, down: Tensor },
}

/// One layer's experts, router and shared expert.
pub struct SparseMoe {
    /// `gate.weight: [E, H]`.
    router: Projection,
    experts: Experts,
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
        let on_gpu = dispatch::backend(w.device()) == Backend::Cuda;
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
            if on_gpu {
                Experts::Fused { gate_up, down }
            } else {
                let expert = |t: &Tensor, name: &str, x: usize| {
                    t.get(x)
                        .and_then(|t| {
                            Projection::new(t.contiguous()?, w.quantization() == Quantization::Int8)
                        })
                        .map_err(|err| {
                            kev_core::Error::backend(format!("`{name}` expert {x}"), err)
                        })
                };
                Experts::Each(
                    (0..e)
                        .map(|x| Ok((expert(&gate_up, &fused, x)?, expert(&down, &down_name, x)?)))
                        .collect::<kev_core::Result<Vec<_>>>()?,
                )
            }
        } else if on_gpu {
            fused_from_each(w, prefix, e, i, h)?
        } else {
            Experts::Each(
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
                    .collect::<kev_core::Result<Vec<_>>>()?,
            )
        };
        Ok(Self {
            router: linear_router(w, &format!("{prefix}.gate"), h, e)?,
            experts,
            shared: Mlp::new(w, &format!("{prefix}.shared_expert"), h, shape.shared_width)?,
            shared_gate: linear_router(w, &format!("{prefix}.shared_expert_gate"), h, 1)?,
            per_token: shape.per_token,
        })
    }

    /// `xs: [.., H]` (any leading dims).
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let dims = xs.dims().to_vec();
        let h = *dims.last().unwrap_or(&0);
        let x = xs.reshape(((), h))?;
        let logits = self.router.forward(&x)?;
        let output = self.shared.forward(&x)?;
        let gate = self.shared_gate.forward(&x)?;
        let shared = SharedExpert {
            output: &output,
            gate: &gate,
        };
        match &self.experts {
            Experts::Fused { gate_up, down } => {
                let experts = RoutedExperts {
                    gate_up,
                    down,
                    per_token: self.per_token,
                };
                kev_kernels::moe_mlp(&x, &logits, experts, shared)
            }
            Experts::Each(experts) => self.each(&x, &logits, experts)? + shared.gated()?,
        }?
        .reshape(dims)
    }

    /// The routed experts' sum with the routes picked on the host, each expert on its own
    /// projections.
    fn each(
        &self,
        x: &Tensor,
        logits: &Tensor,
        experts: &[(Projection, Projection)],
    ) -> Result<Tensor> {
        kev_kernels::routed_sum(x, logits, experts.len(), self.per_token, |e, rows| {
            let (gate_up, down) = &experts[e];
            down.forward(&swiglu(&gate_up.forward(rows)?)?)
        })
    }
}

/// The fused tensors the CUDA kernels read, from experts stored one by one: every expert's gate
/// and up rows, then every down, each joined by one device-to-device copy (candle's `stack`
/// would launch a kernel of its own).
fn fused_from_each(
    w: &Weights,
    prefix: &str,
    e: usize,
    i: usize,
    h: usize,
) -> kev_core::Result<Experts> {
    let dtype = w.projection_dtype();
    let get = |x: usize, part: &str, shape: [usize; 2]| {
        w.get_as(
            &format!("{prefix}.experts.{x}.{part}.weight"),
            &shape,
            dtype,
        )
    };
    let gate_up = (0..e)
        .flat_map(|x| [get(x, "gate_proj", [i, h]), get(x, "up_proj", [i, h])])
        .collect::<kev_core::Result<Vec<_>>>()?;
    let down = (0..e)
        .map(|x| get(x, "down_proj", [h, i]))
        .collect::<kev_core::Result<Vec<_>>>()?;
    let join = |parts: &[Tensor], shape: (usize, usize, usize)| {
        kev_kernels::join_rows(&parts.iter().collect::<Vec<_>>())
            .and_then(|t| t.reshape(shape))
            .map_err(|err| kev_core::Error::backend(format!("joining `{prefix}.experts`"), err))
    };
    Ok(Experts::Fused {
        gate_up: join(&gate_up, (e, 2 * i, h))?,
        down: join(&down, (e, h, i))?,
    })
}
