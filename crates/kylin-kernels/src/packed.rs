//! The view every packed weight format shares: a `[rows, cols]` matrix held as two planes,
//! quants and scales, each a run of groups of 16 rows ([`GROUP_ROWS`]) one after another, the
//! last group padded with zero rows. The formats differ only in how many bytes a group takes
//! in each plane ([`PlaneLayout`]): Q8_0 ([`crate::quant::Q8Matrix`]), Q4_K
//! ([`crate::q4k::Q4KMatrix`]), Q4_G ([`crate::q4g::Q4GMatrix`]) and FP8
//! ([`crate::w16::F8Matrix`]); each module documents what is inside a group.

use std::marker::PhantomData;

use crate::matmul::MatrixRows;
use crate::quant::GROUP_ROWS;

/// How one packed format lays out a group of 16 rows.
pub trait PlaneLayout: Copy + std::fmt::Debug + Send + Sync {
    /// Bytes of one group's quants and of its scales for rows of `cols` columns; `None` if the
    /// format cannot hold rows of `cols` columns or a size overflows.
    fn group_lens(cols: usize) -> Option<(usize, usize)>;
}

/// Bytes of the quants and scales planes of a `[rows, cols]` matrix in layout `L` (rows
/// rounded up to a group of 16); `None` if `L` cannot hold `cols` columns or a size overflows.
pub(crate) fn plane_lens<L: PlaneLayout>(rows: usize, cols: usize) -> Option<(usize, usize)> {
    let (q, s) = L::group_lens(cols)?;
    let groups = rows.div_ceil(GROUP_ROWS);
    Some((groups.checked_mul(q)?, groups.checked_mul(s)?))
}

/// A weight matrix `[rows, cols]` in layout `L`: a view of its two planes.
///
/// Invariant (checked by [`PackedMatrix::new`]): the planes have the lengths
/// `L` gives for `(rows, cols)`, so every group the products read lies inside them.
#[derive(Debug, Clone, Copy)]
pub struct PackedMatrix<'a, L> {
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) quants: &'a [u8],
    pub(crate) scales: &'a [u8],
    layout: PhantomData<L>,
}

impl<'a, L: PlaneLayout> PackedMatrix<'a, L> {
    /// A view of the two planes; `None` if `L` cannot hold `cols` columns or a length is not
    /// what the layout gives for `(rows, cols)`.
    pub fn new(rows: usize, cols: usize, quants: &'a [u8], scales: &'a [u8]) -> Option<Self> {
        (plane_lens::<L>(rows, cols) == Some((quants.len(), scales.len()))).then_some(PackedMatrix {
            rows,
            cols,
            quants,
            scales,
            layout: PhantomData,
        })
    }

    /// The planes of a `[rows, cols]` matrix whose lengths the caller sized with the layout
    /// ([`crate::quant::QuantBuffer`]).
    pub(crate) fn from_planes(rows: usize, cols: usize, quants: &'a [u8], scales: &'a [u8]) -> Self {
        debug_assert_eq!(plane_lens::<L>(rows, cols), Some((quants.len(), scales.len())));
        PackedMatrix { rows, cols, quants, scales, layout: PhantomData }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The quants plane (the format's module documents its bytes).
    pub fn quants(&self) -> &'a [u8] {
        self.quants
    }

    /// The scales plane (the format's module documents its bytes).
    pub fn scales(&self) -> &'a [u8] {
        self.scales
    }

    /// Bytes the products read.
    pub fn byte_len(&self) -> usize {
        self.quants.len() + self.scales.len()
    }

    /// Group `g`'s quants and scales.
    pub(crate) fn group(&self, g: usize) -> (&'a [u8], &'a [u8]) {
        let (q, s) = L::group_lens(self.cols).expect("the layout held `cols` when the view was made");
        (&self.quants[g * q..(g + 1) * q], &self.scales[g * s..(g + 1) * s])
    }
}

impl<L: PlaneLayout> MatrixRows for PackedMatrix<'_, L> {
    fn rows(&self) -> usize {
        self.rows
    }
}
