//! What the CPU's packed matmuls (`bf16_gemm`, `int8_gemm`) share: an f32 output of 32-column
//! blocks, filled by rayon tasks that each own a range of blocks (so each block of the packed
//! weight is read once while the input's rows stream past it) and walk the rows in tiles.

#[cfg(target_arch = "x86_64")]
use rayon::prelude::*;

/// Output columns per packed block: two 16-lane vectors.
pub(crate) const COLS: usize = 32;

/// The `m × n` f32 output of `tile(block, r0, rows, c)` over every column block and every tile
/// of at most `tile_rows` rows, `c` pointing at the tile's first element (row pitch `n`); a
/// task takes at most `max_blocks` column blocks, a few tasks per thread for balance.
///
/// # Safety
/// `tile` stores all `rows × min(32, n − 32·block)` elements at `c` (they are not zeroed first)
/// and writes nothing else.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn column_tiles(
    m: usize,
    n: usize,
    tile_rows: usize,
    max_blocks: usize,
    tile: impl Fn(usize, usize, usize, *mut f32) + Sync,
) -> Vec<f32> {
    let mut out: Vec<f32> = Vec::with_capacity(m * n);
    let blocks = n.div_ceil(COLS);
    if m > 0 {
        let base = OutPtr(out.as_mut_ptr());
        let per_task = (blocks / (4 * rayon::current_num_threads())).clamp(1, max_blocks);
        (0..blocks.div_ceil(per_task))
            .into_par_iter()
            .for_each(|t| {
                for block in t * per_task..((t + 1) * per_task).min(blocks) {
                    let mut r0 = 0;
                    while r0 < m {
                        let rows = tile_rows.min(m - r0);
                        // SAFETY: within the m × n output; the tasks own disjoint column blocks.
                        tile(block, r0, rows, unsafe { base.at(r0 * n + block * COLS) });
                        r0 += rows;
                    }
                }
            });
    }
    // SAFETY: the tiles stored all m × n elements (this fn's contract).
    unsafe { out.set_len(m * n) };
    out
}

/// The output's base pointer, shared by tasks that write disjoint column blocks.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: each task writes only its own column blocks (`column_tiles`).
#[cfg(target_arch = "x86_64")]
unsafe impl Send for OutPtr {}
#[cfg(target_arch = "x86_64")]
unsafe impl Sync for OutPtr {}

#[cfg(target_arch = "x86_64")]
impl OutPtr {
    /// The element `offset` floats past the base.
    ///
    /// # Safety
    /// `offset` is within the output.
    unsafe fn at(self, offset: usize) -> *mut f32 {
        self.0.add(offset)
    }
}

/// Stores a tile row's two vectors (32 columns) at `row`, its first `cols` only.
///
/// # Safety
/// The CPU has AVX-512F; `row` has room for `cols` ≤ 32 floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn store_row(row: *mut f32, acc: [std::arch::x86_64::__m512; 2], cols: usize) {
    use std::arch::x86_64::*;
    if cols == COLS {
        _mm512_storeu_ps(row, acc[0]);
        _mm512_storeu_ps(row.add(16), acc[1]);
    } else {
        let mut tmp = [0f32; COLS];
        _mm512_storeu_ps(tmp.as_mut_ptr(), acc[0]);
        _mm512_storeu_ps(tmp.as_mut_ptr().add(16), acc[1]);
        std::ptr::copy_nonoverlapping(tmp.as_ptr(), row, cols);
    }
}
