//! Partial rotary position embedding (docs/BACKBONE.md §10 pitfall 3): only the first `rotary_dim`
//! dims of each head rotate, NeoX style (`rotate_half`). For text, the interleaved mRoPE of the
//! checkpoint reduces to plain 1-D RoPE because all three position axes are equal.

use std::sync::{Arc, Mutex, RwLock};

use candle_core::{DType, Device, Result, Shape, Tensor};
use kev_kernels::dispatch::{self, Backend, CountedTensor};
use kev_kernels::uploads::{upload, Upload};
use kev_kernels::{gather_rows, RowIndex};
use rayon::prelude::*;

/// Inverse frequencies for the rotary dims, and the cos and sin of every position asked for so
/// far.
pub struct Rope {
    inv_freq: Vec<f32>,
    rotary_dim: usize,
    /// cos and sin of positions `0..len` (`[len, rotary_dim]` each), grown on demand. A batch's
    /// rows repeat the same positions (every state starts at 0): computing cos and sin per row
    /// and step held back a 64-record batch's first kernel on the H200 by ~18 ms (1/8 of it).
    table: RwLock<Arc<Table>>,
    /// The table on a GPU, for [`Rope::at`] to gather rows from there: a 64-record batch's
    /// rows are ~12 MB, whose copy from pageable memory held back its first kernel by ~3.5 ms
    /// on the H200, against ~0.4 MB of row indices.
    on_device: Mutex<DeviceTables>,
}

/// The table on the devices (and in the dtypes) asked for, and the copies growth replaced.
#[derive(Default)]
struct DeviceTables {
    tables: Vec<DeviceTable>,
    /// Kept alive: a captured CUDA graph reads the table it was captured with. Tables grow by
    /// doubling, so the copies one replaced add up to less than it.
    retired: Vec<Tensor>,
}

/// The table in a dtype on a device, `[2·len, rotary_dim]`, interleaved: row 2p the cos of
/// position p, row 2p + 1 its sin. A forward's row indices then do not depend on `len`, so a
/// table grown by another thread between a graph's recording and its capture leaves the
/// recorded index upload valid.
struct DeviceTable {
    len: usize,
    dtype: DType,
    device: Device,
    rows: Tensor,
}

/// cos and sin of positions `0..len`, `[len, rotary_dim]` each.
#[derive(Default)]
struct Table {
    len: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Rope {
    /// `inv_freq[i] = 1 / theta^(2i / rotary_dim)`, computed in f32 like HF.
    pub fn new(theta: f64, rotary_dim: usize) -> Self {
        let inv_freq = (0..rotary_dim / 2)
            .map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / rotary_dim as f32))
            .collect();
        Self {
            inv_freq,
            rotary_dim,
            table: RwLock::default(),
            on_device: Mutex::default(),
        }
    }

    /// The table, holding at least positions `0..len`.
    fn table(&self, len: usize) -> Arc<Table> {
        let have = Arc::clone(&self.table.read().unwrap_or_else(|e| e.into_inner()));
        if have.len >= len {
            return have;
        }
        let mut slot = self.table.write().unwrap_or_else(|e| e.into_inner());
        if slot.len >= len {
            return Arc::clone(&slot);
        }
        // Doubling, so a growing stream of lengths computes each position a few times at most
        // (and the device copies it leaves behind add up to less than the last).
        let len = len.max(2 * slot.len).max(64);
        let rd = self.rotary_dim;
        let (mut cos, mut sin) = (vec![0f32; len * rd], vec![0f32; len * rd]);
        // (`max(1)`: a head with no rotary dims has empty tables, and chunks must not be empty.)
        cos.par_chunks_mut(rd.max(1))
            .zip(sin.par_chunks_mut(rd.max(1)))
            .enumerate()
            .for_each(|(pos, (c, s))| {
                // HF concatenates the frequencies twice: cos/sin cover both rotate halves.
                let freqs = self.inv_freq.iter().chain(&self.inv_freq);
                for ((c, s), f) in c.iter_mut().zip(s.iter_mut()).zip(freqs) {
                    let angle = pos as f32 * f;
                    (*c, *s) = (angle.cos(), angle.sin());
                }
            });
        *slot = Arc::new(Table { len, cos, sin });
        Arc::clone(&slot)
    }

    /// cos and sin for per-row positions `start[b] + t`, t < `seq_len`, computed in f32 and
    /// held in `dtype` (HF rotates in the activation dtype): `[2, B, T, rotary_dim]`, the layout
    /// [`kev_kernels::qk_norm_rope`] reads. Rounded on the host (to nearest, ties to even, as
    /// candle's casts round), so the device runs no cast kernel for them; on a GPU gathered
    /// from the device's table ([`Rope::index`], [`Rope::gathered`]).
    pub fn at(
        &self,
        start: &[usize],
        seq_len: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        if let Some(index) = self.index(start, seq_len, dtype, device) {
            let index: Vec<usize> = index.into_iter().map(|i| i as usize).collect();
            let index = RowIndex::new(&index, device)?;
            return self.gathered(&index, start.len(), seq_len, 0, dtype, device);
        }
        let end = start.iter().map(|&s| s + seq_len).max().unwrap_or(0);
        let table = self.table(end);
        let shape = (2, start.len(), seq_len, self.rotary_dim);
        in_dtype(
            self.rows(&table, start, seq_len),
            shape,
            dtype,
            device,
            true,
        )
    }

    /// Where [`Rope::at`]'s rows sit in the device's table, cos rows then sin rows, where it
    /// gathers them from there (a GPU, whole rows of 16-byte words); `None` where the host
    /// computes them. A CUDA graph of a forward has this index as an input.
    pub fn index(
        &self,
        start: &[usize],
        seq_len: usize,
        dtype: DType,
        device: &Device,
    ) -> Option<Vec<u32>> {
        // Whole rows move as 16-byte words in Kev's gather (other widths would fall back to a
        // candle kernel).
        let rd = self.rotary_dim;
        let words = rd > 0 && (rd * dtype.size_in_bytes()).is_multiple_of(16);
        let gathers = dispatch::backend(device) != Backend::Cpu && words;
        (gathers && seq_len > 0 && !start.is_empty()).then(|| {
            [0, 1]
                .iter()
                .flat_map(|&part| {
                    start
                        .iter()
                        .flat_map(move |&s| (s..s + seq_len).map(move |p| (2 * p + part) as u32))
                })
                .collect()
        })
    }

    /// [`Rope::at`]'s rows for `rows` rows of `seq_len` positions, gathered by `index` (from
    /// [`Rope::index`]) from the device's table, which first grows to hold at least positions
    /// `0..bound` and those `index` reads: a graph replayed with other indices of the same
    /// bound reads the table it was captured with (replaced tables are kept).
    pub fn gathered(
        &self,
        index: &RowIndex,
        rows: usize,
        seq_len: usize,
        bound: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let end = index.max().map_or(0, |m| m / 2 + 1).max(bound);
        let table = self.table(end);
        let rows_on_device = self.device_rows(&table, end, dtype, device)?;
        gather_rows(&rows_on_device, index)?.counted_reshape((2, rows, seq_len, self.rotary_dim))
    }

    /// The [`DeviceTable`] in `dtype` on `device`, holding at least positions `0..end` (copied
    /// from `table`, which does, when it holds fewer).
    fn device_rows(
        &self,
        table: &Table,
        end: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let mut slot = self.on_device.lock().unwrap_or_else(|e| e.into_inner());
        let at = slot
            .tables
            .iter()
            .position(|t| t.dtype == dtype && t.device.same_device(device));
        if let Some(t) = at.map(|i| &slot.tables[i]).filter(|t| t.len >= end) {
            return Ok(t.rows.clone());
        }
        let rd = self.rotary_dim;
        let mut host = Vec::with_capacity(2 * table.len * rd);
        for (c, s) in table.cos.chunks(rd).zip(table.sin.chunks(rd)) {
            host.extend_from_slice(c);
            host.extend_from_slice(s);
        }
        // Not through `upload`: the table outlives any one forward and its graph's memo.
        let rows = in_dtype(host, (2 * table.len, rd), dtype, device, false)?;
        // Each thread issues on its own stream, with no ordering between streams: the copy
        // must have landed before another thread's forward gathers from it.
        device.synchronize()?;
        let fresh = DeviceTable {
            len: table.len,
            dtype,
            device: device.clone(),
            rows: rows.clone(),
        };
        match at {
            Some(i) => {
                let old = std::mem::replace(&mut slot.tables[i], fresh);
                slot.retired.push(old.rows);
            }
            None => slot.tables.push(fresh),
        }
        Ok(rows)
    }

    /// The cos rows of positions `start[b]..start[b] + seq_len` for every b, then the sin rows
    /// (filled on rayon's threads).
    fn rows(&self, table: &Table, start: &[usize], seq_len: usize) -> Vec<f32> {
        let row = seq_len * self.rotary_dim;
        let mut out = vec![0f32; 2 * start.len() * row];
        if row == 0 {
            return out;
        }
        let (cos, sin) = out.split_at_mut(start.len() * row);
        for (part, src) in [(cos, &table.cos), (sin, &table.sin)] {
            part.par_chunks_mut(row).zip(start).for_each(|(dst, &s)| {
                dst.copy_from_slice(&src[s * self.rotary_dim..][..row]);
            });
        }
        out
    }
}

/// `values` rounded to `dtype` on the host (to nearest, ties to even, as candle's casts round)
/// and put on `device`: through [`upload`] (`memo`: a forward's tensor, which a graph capture
/// finds in its record) or as a plain copy. The device runs no cast kernel for them.
fn in_dtype(
    values: Vec<f32>,
    shape: impl Into<Shape>,
    dtype: DType,
    device: &Device,
    memo: bool,
) -> Result<Tensor> {
    fn put<T: Upload>(values: Vec<T>, shape: Shape, device: &Device, memo: bool) -> Result<Tensor> {
        if memo {
            upload(values, shape, device)
        } else {
            Tensor::from_vec(values, shape, device)
        }
    }
    let shape = shape.into();
    match dtype {
        DType::F32 => put(values, shape, device, memo),
        DType::BF16 => put(
            values.into_iter().map(half::bf16::from_f32).collect(),
            shape,
            device,
            memo,
        ),
        DType::F16 => put(
            values.into_iter().map(half::f16::from_f32).collect(),
            shape,
            device,
            memo,
        ),
        other => candle_core::bail!("rotary tables in {other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rows a GPU gathers from its table (counted as CUDA, the CPU stands in for the
    /// gather) are the host's rows, bit for bit, as the table grows (the same positions asked
    /// for again after growth too) and in every dtype.
    #[test]
    fn device_rows_equal_host_rows() -> Result<()> {
        let rope = Rope::new(10_000_000.0, 64);
        let dev = Device::Cpu;
        let shapes: [(&[usize], usize); 5] = [
            (&[0, 0], 5),
            (&[3, 40, 0], 30),
            (&[0], 300),
            (&[700, 2], 9),
            (&[0, 0], 5),
        ];
        for (start, len) in shapes {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let host = rope.at(start, len, dtype, &dev)?;
                let (gathered, tally) =
                    dispatch::count(Backend::Cuda, || rope.at(start, len, dtype, &dev));
                let gathered = gathered?;
                assert_eq!(tally.total(), 1, "one gather: {tally:?}");
                assert_eq!(gathered.dims(), [2, start.len(), len, 64]);
                let (h, g) = (host.to_dtype(DType::F32)?, gathered.to_dtype(DType::F32)?);
                let (h, g) = (
                    h.flatten_all()?.to_vec1::<f32>()?,
                    g.flatten_all()?.to_vec1::<f32>()?,
                );
                assert!(
                    h.iter().zip(&g).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{start:?} {len} {dtype:?}"
                );
            }
        }
        // One table per dtype, each replaced on growth only: 64, 128, 300, then 709 positions.
        let tables = rope.on_device.lock().unwrap();
        assert_eq!(tables.tables.len(), 3);
        assert!(tables.tables.iter().all(|t| t.len == 709));
        assert_eq!(tables.retired.len(), 9);
        Ok(())
    }
}
