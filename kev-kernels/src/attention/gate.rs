//! The geometry of the attention gate's kernel runs, shared by the CUDA and Metal launchers:
//! which rows of `o` each run gates and where its gate rows lie in the gate storage.

use candle_core::{bail, Layout, Result};

use crate::layout::rows::strided4;

/// One gate kernel run's inputs: `o` (contiguous `[B, H, T, hd]`, in `storage`), its `(B, T)`,
/// and where its gate rows start in the gate storage, with their strides (b, t, h).
pub(crate) struct GatePart<'a, S> {
    pub(crate) storage: &'a S,
    pub(crate) o: &'a Layout,
    pub(crate) rows: (usize, usize),
    pub(crate) gate_at: usize,
    pub(crate) strides: [usize; 3],
}

/// The runs of one gate op, with the heads and head dim they share.
pub(crate) struct GateRuns<'a, S, const N: usize> {
    pub(crate) parts: [GatePart<'a, S>; N],
    pub(crate) heads: usize,
    pub(crate) hd: usize,
}

/// [`crate::attention_gate`]: `o` gated by the strided gate `gl` `[B, T, H, hd]`, one run.
pub(crate) fn single<'a, S>(os: &'a S, ol: &'a Layout, gl: &Layout) -> Result<GateRuns<'a, S, 1>> {
    let (b_sz, t_len, heads, hd) = gl.shape().dims4()?;
    let (gate_at, strides) = strided4(gl, "attention-gate gate")?;
    let part = GatePart {
        storage: os,
        o: ol,
        rows: (b_sz, t_len),
        gate_at,
        strides,
    };
    Ok(GateRuns {
        parts: [part],
        heads,
        hd,
    })
}

/// [`crate::attention_gate_join`]: the states' part, then the branches', gated by the packed
/// gate `gl` `[R·S + B·T, H, hd]` (last dim contiguous), into one output.
pub(crate) fn join<'a, S>(
    ss: &'a S,
    sl: &'a Layout,
    bs: &'a S,
    bl: &'a Layout,
    gl: &Layout,
) -> Result<GateRuns<'a, S, 2>> {
    let (r, heads, s_len, hd) = sl.shape().dims4()?;
    let (b, _, t_len, _) = bl.shape().dims4()?;
    let g = gl.stride();
    if gl.dims().len() != 3 || (hd > 1 && g[2] != 1) {
        bail!("attention-gate-join: the gate must be [N, H, hd] with a contiguous last dim, got {gl:?}")
    }
    let (sn, sh) = (g[0], g[1]);
    let parts = [
        GatePart {
            storage: ss,
            o: sl,
            rows: (r, s_len),
            gate_at: gl.start_offset(),
            strides: [s_len * sn, sn, sh],
        },
        GatePart {
            storage: bs,
            o: bl,
            rows: (b, t_len),
            gate_at: gl.start_offset() + r * s_len * sn,
            strides: [t_len * sn, sn, sh],
        },
    ];
    Ok(GateRuns { parts, heads, hd })
}
