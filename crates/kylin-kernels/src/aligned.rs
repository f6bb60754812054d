//! A zeroed, 64-byte aligned byte buffer: the KV pool's storage, so every 64-byte row a kernel
//! loads (an AVX-512 vector, an AMX tile row) lies in one cache line. The memory comes from
//! `alloc_zeroed`, so a large buffer's pages are zeroed lazily by the OS and only become
//! resident when first touched.

use std::alloc::{Layout, alloc_zeroed, dealloc, handle_alloc_error};
use std::ops::{Deref, DerefMut};

/// Alignment of [`AlignedBytes`] (the `repr(align)` of `Line` is the same number).
pub const ALIGN: usize = 64;

/// A type of [`ALIGN`] alignment, for an aligned dangling pointer.
#[repr(align(64))]
struct Line;

pub struct AlignedBytes {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is uniquely owned, like a `Vec<u8>`.
unsafe impl Send for AlignedBytes {}
// SAFETY: shared access only reads, like `&[u8]`.
unsafe impl Sync for AlignedBytes {}

impl AlignedBytes {
    /// `len` zero bytes; `None` if `len` rounded up to the alignment overflows a layout.
    pub fn zeroed(len: usize) -> Option<Self> {
        if len == 0 {
            return Some(AlignedBytes { ptr: std::ptr::NonNull::<Line>::dangling().cast(), len });
        }
        let layout = Layout::from_size_align(len, ALIGN).ok()?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = std::ptr::NonNull::new(ptr) else { handle_alloc_error(layout) };
        Some(AlignedBytes { ptr, len })
    }
}

impl Drop for AlignedBytes {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: allocated in `zeroed` with this layout (which was valid then).
            unsafe { dealloc(self.ptr.as_ptr(), Layout::from_size_align_unchecked(self.len, ALIGN)) };
        }
    }
}

impl Deref for AlignedBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len` initialised (zeroed) bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` is unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl std::fmt::Debug for AlignedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBytes({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_aligned_and_writable() {
        for len in [0, 1, 63, 64, 65, 1 << 20] {
            let mut b = AlignedBytes::zeroed(len).unwrap();
            assert_eq!(b.len(), len);
            assert_eq!(b.as_ptr() as usize % ALIGN, 0);
            assert!(b.iter().all(|&x| x == 0));
            if len > 0 {
                b[len - 1] = 7;
                assert_eq!(b[len - 1], 7);
            }
        }
        assert!(AlignedBytes::zeroed(usize::MAX).is_none());
    }
}
