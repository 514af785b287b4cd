//! `contig`'s copies of large strided views, shared among threads: a view whose innermost dim
//! runs long (a broadcast operand: a per-channel vector expanded over an image) by runs of that
//! dim; a transposed view with short rows (a `[2, n]` matrix's transpose, an image's channels
//! moved last) by tiles whose reads follow the dim the view reads at unit stride. Each writes
//! its buffer once, from the threads (`alloc::filled`).

use super::alloc;
use crate::shape::Layout;
use crate::storage::StorageElement;

/// Shortest innermost run `rows` takes: each run's start is found by dividing its row number by
/// the outer extents, which costs more than the copy of a shorter run.
const MIN_RUN: usize = 16;

/// Rows of a transposed view one tile of `transposed` covers.
const TILE_ROWS: usize = 256;

/// The view copied by runs of its innermost dim, when that dim is at least `MIN_RUN` long.
pub(super) fn rows<T: StorageElement + Send + Sync>(data: &[T], layout: &Layout) -> Option<Vec<T>> {
    let rank = layout.shape.len();
    let (inner, istride) = (*layout.shape.last()?, *layout.strides.last()?);
    if inner < MIN_RUN {
        return None;
    }
    let outer = &layout.shape[..rank - 1];
    let rows_per_task = (4096 / inner).max(1);
    Some(alloc::filled(
        layout.numel(),
        rows_per_task * inner,
        |task, chunk| {
            for (k, run) in chunk.chunks_mut(inner).enumerate() {
                let at = row_start(layout, outer, task * rows_per_task + k);
                for (j, v) in run.iter_mut().enumerate() {
                    v.write(data[at + j * istride]);
                }
            }
        },
    ))
}

/// The view copied in tiles when its innermost dim is shorter than `MIN_RUN` and read at a
/// stride while the dim before it is read at unit stride (a transpose into few columns: a
/// `[2, n]` matrix's, an image's three channels moved last): a tile is `TILE_ROWS` consecutive
/// rows (positions of the outer dims), written as one contiguous piece of the output (a few KB,
/// in cache) column by column, so that each column's reads are contiguous runs of the input.
/// Longer rows go to `rows`, whose writes are contiguous.
pub(super) fn transposed<T: StorageElement + Send + Sync>(
    data: &[T],
    layout: &Layout,
) -> Option<Vec<T>> {
    let rank = layout.shape.len();
    let short = layout.shape.last().is_some_and(|&cols| cols < MIN_RUN);
    if rank < 2 || !short || layout.strides[rank - 2] != 1 || layout.strides[rank - 1] <= 1 {
        return None;
    }
    let (cols, cstride) = (layout.shape[rank - 1], layout.strides[rank - 1]);
    let outer = &layout.shape[..rank - 1];
    let unit = layout.shape[rank - 2];
    Some(alloc::filled(
        layout.numel(),
        TILE_ROWS * cols,
        |task, tile| {
            let (first, rows) = (task * TILE_ROWS, tile.len() / cols);
            let mut k = 0;
            while k < rows {
                // rows that differ only in the unit-stride dim: consecutive in the input
                let row = first + k;
                let len = (unit - row % unit).min(rows - k);
                let at = row_start(layout, outer, row);
                for j in 0..cols {
                    let column = &data[at + j * cstride..][..len];
                    for (m, &v) in column.iter().enumerate() {
                        tile[(k + m) * cols + j].write(v);
                    }
                }
                k += len;
            }
        },
    ))
}

/// Where row `row` (a position of the dims `outer`, counted row-major) starts in the view's
/// buffer.
fn row_start(layout: &Layout, outer: &[usize], mut row: usize) -> usize {
    let mut at = layout.offset;
    for (d, &extent) in outer.iter().enumerate().rev() {
        at += (row % extent) * layout.strides[d];
        row /= extent;
    }
    at
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The elements a view addresses, one by one in row-major order (what `contig` does for a
    /// small view): the reference both copies are checked against.
    fn one_by_one(data: &[i32], layout: &Layout) -> Vec<i32> {
        let mut out = Vec::new();
        layout.for_each_offset(|o| out.push(data[o]));
        out
    }

    /// Transposes (a matrix's, NCHW read as NHWC, at an offset, with a row count that is no
    /// multiple of a tile) copy element for element what the view addresses; views that are no
    /// transposes are left to the other paths.
    #[test]
    fn transposed_views_copy_every_element_in_order() {
        let data: Vec<i32> = (0..300_000).collect();
        let t = |shape: &[usize], perm: &[usize], offset: usize| {
            let mut l = Layout::contiguous(shape).permute(perm);
            l.offset = offset;
            l
        };
        let views = [
            t(&[2, 65_536], &[1, 0], 0),
            t(&[3, 15, 2_049], &[0, 2, 1], 0),
            t(&[5, 7, 1_000], &[0, 2, 1], 17),
            t(&[3, 4_097], &[1, 0], 1),
        ];
        for l in &views {
            let got = transposed(&data, l).expect("a transpose");
            assert_eq!(got, one_by_one(&data, l), "{l:?}");
        }
        // a broadcast row and a view read at unit stride innermost are not transposes
        let row = Layout {
            shape: [64, 1_000][..].into(),
            strides: [0, 1][..].into(),
            offset: 0,
        };
        assert!(transposed(&data, &row).is_none());
        let rows_copy = rows(&data, &row).expect("long runs");
        assert_eq!(rows_copy, one_by_one(&data, &row));
    }
}
