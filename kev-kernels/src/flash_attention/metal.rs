//! Flash attention on Metal (`flash_attention.metal`): one 32-lane simdgroup per query row, an
//! online softmax over the row's keys, eight rows a threadgroup.

use candle_core::backend::BackendStorage;
use candle_core::{bail, DType, Layout, MetalStorage, Result, Tensor};

use super::FLASH_METAL_MAX_HEAD_DIM;
use crate::backend::metal::{
    as_u32, check_simd_width, dispatch, dtype_suffix, input, output, pipeline, Binding, Source,
    SIMD_WIDTH,
};

const SOURCE: Source = Source {
    name: "flash_attention",
    text: include_str!("flash_attention.metal"),
};

/// Rows (simdgroups) per threadgroup; `FLASH_ROWS_PER_GROUP` of the source.
const ROWS_PER_GROUP: usize = 8;

/// `FlashParams` of flash_attention.metal.
#[repr(C)]
struct FlashParams {
    b: u32,
    hq: u32,
    hkv: u32,
    t: u32,
    l: u32,
    s: u32,
    hd: u32,
    k_strides: [u32; 3],
    v_strides: [u32; 3],
    k_past_strides: [u32; 3],
    v_past_strides: [u32; 3],
    scale: f32,
}

// The MSL struct has the same fields; the emulation harness asserts the same size.
const _: () = assert!(std::mem::size_of::<FlashParams>() == 80);

/// The three leading strides of a 4-d layout with a contiguous last dim, as 32-bit strides.
fn strides(l: &Layout, what: &str) -> Result<[u32; 3]> {
    let s = l.stride();
    if l.dims().len() != 4 || (l.dims()[3] > 1 && s[3] != 1) {
        bail!("{what}: expected a 4-d view with a contiguous last dim, got {l:?}")
    }
    Ok([
        as_u32(s[0], what)?,
        as_u32(s[1], what)?,
        as_u32(s[2], what)?,
    ])
}

/// The Metal storage of a tensor the op reads beside its operands.
fn metal_storage<'a>(storage: &'a candle_core::Storage, what: &str) -> Result<&'a MetalStorage> {
    match storage {
        candle_core::Storage::Metal(s) => Ok(s),
        _ => bail!("flash-attention: {what} is not on the Metal device"),
    }
}

/// `q`, `k`, `v` as the op hands them; `past` = (k_past, v_past, owners), `bias` `[B, S + L]`.
pub(crate) fn flash_attention(
    (qs, ql): (&MetalStorage, &Layout),
    (ks, kl): (&MetalStorage, &Layout),
    (vs, vl): (&MetalStorage, &Layout),
    past: Option<[&Tensor; 3]>,
    bias: &Tensor,
    scale: f32,
) -> Result<MetalStorage> {
    let (b_sz, hq, t_len, hd) = ql.shape().dims4()?;
    let (_, hkv, l_len, _) = kl.shape().dims4()?;
    let dtype = qs.dtype();
    let suffix = dtype_suffix(dtype, "flash-attention")?;
    if ks.dtype() != dtype
        || vs.dtype() != dtype
        || !ql.is_contiguous()
        || hd > FLASH_METAL_MAX_HEAD_DIM
    {
        bail!("flash-attention: q must be contiguous, k and v of its dtype, hd ≤ {FLASH_METAL_MAX_HEAD_DIM}")
    }
    let size = dtype.size_in_bytes();
    let (bias_guard, bias_layout) = bias.storage_and_layout();
    let bias_storage = metal_storage(&bias_guard, "the key bias")?;
    if bias.dtype() != DType::F32 || !bias_layout.is_contiguous() {
        bail!("flash-attention: the key bias must be contiguous f32")
    }
    let past_guards = past.map(|[k, v, owners]| {
        (
            k.storage_and_layout(),
            v.storage_and_layout(),
            owners.storage_and_layout(),
        )
    });
    let n = b_sz * hq * t_len * hd;
    as_u32(n, "flash-attention: output elements")?;
    let mut params = FlashParams {
        b: as_u32(b_sz, "flash-attention: batch")?,
        hq: as_u32(hq, "flash-attention: query heads")?,
        hkv: as_u32(hkv, "flash-attention: kv heads")?,
        t: as_u32(t_len, "flash-attention: queries")?,
        l: as_u32(l_len, "flash-attention: keys")?,
        s: 0,
        hd: hd as u32,
        k_strides: strides(kl, "flash-attention: k")?,
        v_strides: strides(vl, "flash-attention: v")?,
        k_past_strides: [0; 3],
        v_past_strides: [0; 3],
        scale,
    };
    let dev = qs.device().clone();
    let pipeline = pipeline(&dev, &SOURCE, &format!("flash_attention_{suffix}"))?;
    check_simd_width(&pipeline, "flash-attention")?;
    let out = dev.new_buffer(n.max(1), dtype, "flash-attention out")?;
    let q_bind = || input(qs.buffer(), ql.start_offset() * size);
    let mut bindings: Vec<Binding> = vec![
        q_bind(),
        input(ks.buffer(), kl.start_offset() * size),
        input(vs.buffer(), vl.start_offset() * size),
    ];
    match &past_guards {
        Some(((kg, kpl), (vg, vpl), (og, ol))) => {
            let (kp, vp) = (metal_storage(kg, "past k")?, metal_storage(vg, "past v")?);
            let owners = metal_storage(og, "the owners")?;
            if kp.dtype() != dtype || vp.dtype() != dtype || owners.dtype() != DType::U32 {
                bail!("flash-attention: the past must be in the dtype of q, its owners u32")
            }
            params.s = as_u32(kpl.dims()[2], "flash-attention: past keys")?;
            params.k_past_strides = strides(kpl, "flash-attention: past k")?;
            params.v_past_strides = strides(vpl, "flash-attention: past v")?;
            bindings.extend([
                input(kp.buffer(), kpl.start_offset() * size),
                input(vp.buffer(), vpl.start_offset() * size),
                input(
                    owners.buffer(),
                    ol.start_offset() * DType::U32.size_in_bytes(),
                ),
            ]);
        }
        None => bindings.extend([q_bind(), q_bind(), q_bind()]),
    }
    bindings.extend([
        input(
            bias_storage.buffer(),
            bias_layout.start_offset() * DType::F32.size_in_bytes(),
        ),
        output(&out, 0),
    ]);
    let rows = b_sz * hq * t_len;
    dispatch(
        &dev,
        &pipeline,
        &bindings,
        &params,
        rows.div_ceil(ROWS_PER_GROUP),
        SIMD_WIDTH * ROWS_PER_GROUP,
    )?;
    Ok(MetalStorage::new(out, dev, n, dtype))
}
