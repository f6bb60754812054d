//! A mutable buffer shared by the tasks of one pool run, each writing its own part.

/// A buffer that pool tasks write disjoint parts of.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut<T> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: a `SharedMut` is only built from a `&mut [T]` that outlives the pool run using it,
// and every task only forms slices that no other task forms (see `slice`).
unsafe impl<T: Send> Send for SharedMut<T> {}
// SAFETY: as above; shared access only hands out disjoint sub-slices.
unsafe impl<T: Send> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    pub(crate) fn new(buffer: &mut [T]) -> Self {
        SharedMut { ptr: buffer.as_mut_ptr(), len: buffer.len() }
    }

    /// `len` elements from `start`.
    ///
    /// # Safety
    /// No two slices obtained from the same buffer may be alive at the same time and overlap,
    /// and the buffer must outlive them.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice(&self, start: usize, len: usize) -> &mut [T] {
        assert!(start <= self.len && len <= self.len - start, "SharedMut slice out of bounds");
        // SAFETY: in bounds (checked above); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }
}
