//! Row gathers on Metal (`gather.metal`): one thread per 4-byte unit where every row and start
//! allows it, else per 2-byte unit; any float dtype.

use candle_core::backend::BackendStorage;
use candle_core::{bail, DType, Layout, MetalStorage, Result};

use crate::backend::metal::{as_u32, byte_offset, dispatch, input, output, pipeline, Source};

const SOURCE: Source = Source {
    name: "gather",
    text: include_str!("gather.metal"),
};

/// Threads per threadgroup (one unit each); a common Metal default.
const THREADS_PER_GROUP: usize = 256;

/// `GatherRowsParams` of gather.metal.
#[repr(C)]
struct GatherRowsParams {
    n: u32,
    units: u32,
    src_rows: u32,
}

/// `GatherCatParams` of gather.metal.
#[repr(C)]
struct GatherCatParams {
    n: u32,
    heads: u32,
    us: u32,
    ut: u32,
    src_rows: u32,
}

// The MSL structs have the same fields; the emulation harness asserts the same sizes.
const _: () = assert!(std::mem::size_of::<GatherRowsParams>() == 12);
const _: () = assert!(std::mem::size_of::<GatherCatParams>() == 20);

/// The unit (bytes) that divides every one of `byte_counts`: 4, else 2.
fn unit_bytes(byte_counts: &[usize]) -> usize {
    if byte_counts.iter().all(|b| b.is_multiple_of(4)) {
        4
    } else {
        2
    }
}

fn unit_name(unit: usize) -> &'static str {
    if unit == 4 {
        "u32"
    } else {
        "u16"
    }
}

fn index_offset(il: &Layout) -> Result<usize> {
    byte_offset(il, DType::U32, "gather: row index")
}

/// Rows `is` of `ts` (the wrapper checked the dtype, the contiguity and the indices).
pub(crate) fn gather_rows(
    ts: &MetalStorage,
    tl: &Layout,
    is: &MetalStorage,
    il: &Layout,
) -> Result<MetalStorage> {
    let dtype = ts.dtype();
    let t_off = byte_offset(tl, dtype, "gather-rows: input")?;
    let src_rows = tl.dims()[0];
    let n = il.shape().elem_count();
    let row_bytes = tl.shape().elem_count() / src_rows.max(1) * dtype.size_in_bytes();
    if !row_bytes.is_multiple_of(2) {
        bail!("gather-rows: rows of {row_bytes} bytes are no whole 2-byte units")
    }
    let unit = unit_bytes(&[row_bytes, t_off]);
    let units = row_bytes / unit;
    let params = GatherRowsParams {
        n: as_u32(n, "gather-rows: rows")?,
        units: as_u32(units, "gather-rows: units a row")?,
        src_rows: as_u32(src_rows, "gather-rows: source rows")?,
    };
    as_u32(n * units, "gather-rows: output units")?;
    let out_elems = n * row_bytes / dtype.size_in_bytes();
    let dev = ts.device().clone();
    let pipeline = pipeline(&dev, &SOURCE, &format!("gather_rows_{}", unit_name(unit)))?;
    let out = dev.new_buffer(out_elems.max(1), dtype, "gather-rows out")?;
    dispatch(
        &dev,
        &pipeline,
        &[
            input(ts.buffer(), t_off),
            input(is.buffer(), index_offset(il)?),
            output(&out, 0),
        ],
        &params,
        (n * units).div_ceil(THREADS_PER_GROUP),
        THREADS_PER_GROUP,
    )?;
    Ok(MetalStorage::new(out, dev, out_elems, dtype))
}

/// `src` `[R, H, S, d]` rows picked by `is`, each followed by its `tail` `[B, H, T, d]` row along
/// the steps: `[B, H, S + T, d]`.
pub(crate) fn gather_cat(
    ss: &MetalStorage,
    sl: &Layout,
    is: &MetalStorage,
    il: &Layout,
    ts: &MetalStorage,
    tl: &Layout,
) -> Result<MetalStorage> {
    let dtype = ss.dtype();
    if ts.dtype() != dtype {
        bail!("gather-cat: tail {:?} is not {dtype:?}", ts.dtype())
    }
    let s_off = byte_offset(sl, dtype, "gather-cat: source")?;
    let t_off = byte_offset(tl, dtype, "gather-cat: tail")?;
    let (src_rows, heads, s_len, d) = sl.shape().dims4()?;
    let (n, _, t_len, _) = tl.shape().dims4()?;
    let size = dtype.size_in_bytes();
    let (s_bytes, t_bytes) = (s_len * d * size, t_len * d * size);
    if !s_bytes.is_multiple_of(2) || !t_bytes.is_multiple_of(2) {
        bail!("gather-cat: rows of {s_bytes} and {t_bytes} bytes are no whole 2-byte units")
    }
    let unit = unit_bytes(&[s_bytes, t_bytes, s_off, t_off]);
    let (us, ut) = (s_bytes / unit, t_bytes / unit);
    let params = GatherCatParams {
        n: as_u32(n, "gather-cat: rows")?,
        heads: as_u32(heads, "gather-cat: heads")?,
        us: as_u32(us, "gather-cat: source units")?,
        ut: as_u32(ut, "gather-cat: tail units")?,
        src_rows: as_u32(src_rows, "gather-cat: source rows")?,
    };
    let total_units = n * heads * (us + ut);
    as_u32(total_units, "gather-cat: output units")?;
    let out_elems = n * heads * (s_len + t_len) * d;
    let dev = ss.device().clone();
    let pipeline = pipeline(&dev, &SOURCE, &format!("gather_cat_{}", unit_name(unit)))?;
    let out = dev.new_buffer(out_elems.max(1), dtype, "gather-cat out")?;
    dispatch(
        &dev,
        &pipeline,
        &[
            input(ss.buffer(), s_off),
            input(is.buffer(), index_offset(il)?),
            input(ts.buffer(), t_off),
            output(&out, 0),
        ],
        &params,
        total_units.div_ceil(THREADS_PER_GROUP),
        THREADS_PER_GROUP,
    )?;
    Ok(MetalStorage::new(out, dev, out_elems, dtype))
}
