//! Gated DeltaNet (docs/BACKBONE.md §3): projections, causal depthwise conv + SiLU on [q | k | v],
//! gates in f32, the gated delta rule over an f32 recurrent matrix (kev-kernels), gated RMSNorm,
//! `out_proj`.

use candle_core::{DType, Module, Result, Tensor, D};
use kev_kernels::dispatch::{counted_cat, counted_zeros, CountedTensor};
use kev_kernels::{
    causal_conv1d_cached, conv_gated_delta_rule_split, conv_gated_delta_rule_split_keeping,
    deltanet_gates, gated_delta_rule, gather_rows, GdrDims, SplitBatch,
};

use super::config::Config;
use super::linear::{linear, linear_cat, Projection};
use super::norm::GatedRmsNorm;
use super::split::{Outputs, SplitRows};
use crate::weights::{on_host, Weights};

/// One Gated DeltaNet layer.
pub struct GatedDeltaNet {
    /// `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` stacked: `[C + Hv·Dv + 2·Hv, H]`.
    in_proj: Projection,
    /// `[C, K]` (the checkpoint's `[C, 1, K]` squeezed).
    conv1d: Tensor,
    /// `-exp(A_log)` in f32, `[Hv]`.
    neg_a: Tensor,
    /// f32 `[Hv]`.
    dt_bias: Tensor,
    norm: GatedRmsNorm,
    out_proj: Projection,
    dims: GdrDims,
}

impl GatedDeltaNet {
    /// Loads `layers.{i}.linear_attn.*`.
    pub fn new(cfg: &Config, w: &Weights, prefix: &str) -> kev_core::Result<Self> {
        let h = cfg.hidden_size;
        let (hv, dv) = (cfg.linear_num_value_heads, cfg.linear_value_head_dim);
        let c = cfg.linear_conv_dim();
        let k = cfg.linear_conv_kernel_dim;
        let ctx = |what: &str| {
            let key = format!("{prefix}.{what}");
            move |e| kev_core::Error::backend(format!("`{key}`"), e)
        };
        let conv1d = w.get(&format!("{prefix}.conv1d.weight"), &[c, 1, k])?;
        let conv1d = conv1d.squeeze(1).map_err(ctx("conv1d.weight"))?;
        // HF computes `-A_log.float().exp()` from the parameter as held in the backbone dtype.
        let a_log = w.get(&format!("{prefix}.A_log"), &[hv])?;
        let neg_a = on_host(&a_log, |a| a.to_dtype(DType::F32)?.exp()?.neg());
        let dt_bias = on_host(&w.get(&format!("{prefix}.dt_bias"), &[hv])?, |b| {
            b.to_dtype(DType::F32)
        });
        Ok(Self {
            in_proj: linear_cat(
                w,
                &[
                    (&format!("{prefix}.in_proj_qkv"), c),
                    (&format!("{prefix}.in_proj_z"), hv * dv),
                    (&format!("{prefix}.in_proj_b"), hv),
                    (&format!("{prefix}.in_proj_a"), hv),
                ],
                h,
            )?,
            conv1d,
            neg_a: neg_a.map_err(ctx("A_log"))?,
            dt_bias: dt_bias.map_err(ctx("dt_bias"))?,
            norm: GatedRmsNorm::new(
                w.get(&format!("{prefix}.norm.weight"), &[dv])?,
                cfg.rms_norm_eps,
            ),
            out_proj: linear(w, &format!("{prefix}.out_proj"), hv * dv, h)?,
            dims: GdrDims {
                num_k_heads: cfg.linear_num_key_heads,
                num_v_heads: hv,
                head_k_dim: cfg.linear_key_head_dim,
                head_v_dim: dv,
            },
        })
    }

    /// `xs: [B, T, H]` whose first `lengths[b]` steps are real. `conv` (`[B, K−1, C]`) is
    /// replaced by the window at each row's end; `recurrent` (`[B, Hv, Dk, Dv]` f32) is updated in place.
    pub fn forward(
        &self,
        xs: &Tensor,
        conv: &mut Tensor,
        recurrent: &Tensor,
        lengths: &[usize],
    ) -> Result<Tensor> {
        let proj = self.in_proj.forward(xs)?; // [B, T, C + Hv·Dv + 2·Hv]
        let gates = self.gates(&proj)?;
        let (mixed, next) =
            causal_conv1d_cached(&self.qkv(&proj)?, conv, &self.conv1d, Some(lengths))?;
        *conv = next;
        let o = gated_delta_rule(&mixed, &gates, recurrent, self.dims, Some(lengths))?;
        self.out(&o, &self.z(&proj)?)
    }

    /// State rows and their branch rows as the layers hold them ([`SplitRows`]): each branch
    /// row continues from its state row's conv window and recurrent matrix of this layer.
    /// Returns all rows' outputs, or with `Outputs::Branches` the branch rows' only.
    pub fn forward_split(&self, xs: &Tensor, rows: SplitRows, outputs: Outputs) -> Result<Tensor> {
        let split = rows.split;
        let proj = self.in_proj.forward(xs)?; // [N, C + Hv·Dv + 2·Hv]
        let gates = rows.padded(&self.gates(&proj)?)?; // [R·S + B·T, Hv, 2]
        let (proj_s, proj_b) = rows.parts(&proj)?;
        let (qkv_s, qkv_b) = (self.qkv(&proj_s)?, self.qkv(&proj_b)?);
        let (w, dims) = (&self.conv1d, self.dims);
        let o = conv_gated_delta_rule_split(&qkv_s, &qkv_b, w, &gates, dims, split)?;
        let z = self.z(&proj)?;
        self.out(&rows.kept_of_padded(outputs, &o)?, &rows.kept(outputs, &z)?)
    }

    /// [`GatedDeltaNet::forward_split`] where branch rows may also continue `given` state rows
    /// (a cached prefix's conv windows `[G, K−1, C]` and recurrent matrices, rows `R..R+G` of
    /// the split's owners) and where, with `keep`, the states' own conv windows and final
    /// recurrent matrices come back (their rows of a cache).
    pub fn forward_split_with(
        &self,
        xs: &Tensor,
        rows: SplitRows,
        outputs: Outputs,
        given: Option<(&Tensor, &Tensor)>,
        keep: bool,
    ) -> Result<(Tensor, Option<(Tensor, Tensor)>)> {
        let split = rows.split;
        let proj = self.in_proj.forward(xs)?; // [N, C + Hv·Dv + 2·Hv]
        let gates = rows.padded(&self.gates(&proj)?)?; // [R·S + B·T, Hv, 2]
        let (proj_s, proj_b) = rows.parts(&proj)?;
        let (raw_s, raw_b) = (self.qkv(&proj_s)?, self.qkv(&proj_b)?);
        let window = self.conv1d.dim(1)? - 1;
        let (o, kept) = match given {
            // Kept states only, each at least a conv window long: the split kernels, which
            // hand back the states' final matrices, and the windows cut from the raw rows.
            None if split.state_lengths().iter().all(|&l| l >= window) => {
                let (w, d) = (&self.conv1d, self.dims);
                let (o, recurrent) =
                    conv_gated_delta_rule_split_keeping(&raw_s, &raw_b, w, &gates, d, split)?;
                let conv = self.windows(&proj_s, split, window)?;
                (o, (conv, recurrent))
            }
            _ => self.composed_split(&raw_s, &raw_b, &gates, split, given)?,
        };
        let z = self.z(&proj)?;
        let out = self.out(&rows.kept_of_padded(outputs, &o)?, &rows.kept(outputs, &z)?)?;
        Ok((out, keep.then_some(kept)))
    }

    /// Each state row's last `window` raw `[q | k | v]` inputs (its conv window at its end),
    /// `[R, window, C]` of their own storage, from the states' projection rows `proj_s: [R, S, ..]`
    /// (every state at least `window` long).
    fn windows(&self, proj_s: &Tensor, split: &SplitBatch, window: usize) -> Result<Tensor> {
        let r = proj_s.dim(0)?;
        let index = split.state_ends(window, proj_s.device())?;
        let tails = gather_rows(&proj_s.counted_flatten(0, 1)?, &index)?;
        self.qkv(&tails)?
            .counted_contiguous()?
            .counted_reshape((r, window, self.dims.channels()))
    }

    /// The split's conv and delta rule as their parts' calls: the states' from zero windows and
    /// matrices, then the branches' from copies of their owners' (computed or `given`). Returns
    /// the output (the split's padded rows) and the states' conv windows and final matrices.
    fn composed_split(
        &self,
        raw_s: &Tensor,
        raw_b: &Tensor,
        gates: &Tensor,
        split: &SplitBatch,
        given: Option<(&Tensor, &Tensor)>,
    ) -> Result<(Tensor, (Tensor, Tensor))> {
        let (r, _, c) = raw_s.dims3()?;
        let window = self.conv1d.dim(1)? - 1;
        let zero = counted_zeros((r, window, c), raw_s.dtype(), raw_s.device())?;
        let lengths_s = Some(split.state_lengths());
        let (qkv_s, conv_s) = causal_conv1d_cached(raw_s, &zero, &self.conv1d, lengths_s)?;
        let (gates_s, gates_b) = split.parts(gates)?;
        let d = self.dims;
        let shape = (r, d.num_v_heads, d.head_k_dim, d.head_v_dim);
        let recurrent_s = counted_zeros(shape, DType::F32, raw_s.device())?;
        let o_s = gated_delta_rule(&qkv_s, &gates_s, &recurrent_s, d, lengths_s)?;
        // Each branch row's conv window and recurrent matrix: its owner's, copied (the given
        // ones are a shared prefix's: only read, never handed to the delta rule, which updates
        // its matrices in place).
        let rows = |computed: &Tensor, given: Option<&Tensor>| match given {
            Some(g) => split.to_branches(&counted_cat(&[computed, g], 0)?),
            None => split.to_branches(computed),
        };
        let conv_b = rows(&conv_s, given.map(|g| g.0))?;
        let recurrent_b = rows(&recurrent_s, given.map(|g| g.1))?;
        let lengths_b = Some(split.branch_lengths());
        let (qkv_b, _) = causal_conv1d_cached(raw_b, &conv_b, &self.conv1d, lengths_b)?;
        let o_b = gated_delta_rule(&qkv_b, &gates_b, &recurrent_b, d, lengths_b)?;
        Ok((split.join(&o_s, &o_b)?, (conv_s, recurrent_s)))
    }

    /// g = −exp(A_log)·softplus(a + dt_bias) in f32, β = sigmoid(b) in the activation dtype (as
    /// HF), from projection rows `proj: [.., C + Hv·Dv + 2·Hv]`: `[.., Hv, 2]`.
    fn gates(&self, proj: &Tensor) -> Result<Tensor> {
        let (hv, dv) = (self.dims.num_v_heads, self.dims.head_v_dim);
        let ba = proj.narrow(D::Minus1, self.dims.channels() + hv * dv, 2 * hv)?;
        deltanet_gates(&ba, &self.dt_bias, &self.neg_a)
    }

    /// The output gate's columns of `proj`.
    fn z(&self, proj: &Tensor) -> Result<Tensor> {
        let (hv, dv) = (self.dims.num_v_heads, self.dims.head_v_dim);
        proj.narrow(D::Minus1, self.dims.channels(), hv * dv)
    }

    /// The `[q | k | v]` columns of `proj`.
    fn qkv(&self, proj: &Tensor) -> Result<Tensor> {
        proj.narrow(D::Minus1, 0, self.dims.channels())
    }

    /// The gated norm of `o` (`[.., Hv, Dv]`) by `z`, then `out_proj`: `[.., H]`.
    fn out(&self, o: &Tensor, z: &Tensor) -> Result<Tensor> {
        let o = self.norm.forward(o, z)?;
        let o = o.counted_flatten(o.rank() - 2, o.rank() - 1)?;
        self.out_proj.forward(&o)
    }
}
