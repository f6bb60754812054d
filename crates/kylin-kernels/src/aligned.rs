//! A zeroed, 64-byte aligned byte buffer: the KV pool's and the quantized matrices' storage, so
//! every 64-byte row a kernel loads (an AVX-512 vector, an AMX tile row) lies in one cache line.
//!
//! On Linux a buffer of at least [`HUGE_PAGE`] bytes is its own anonymous map, asked to be
//! backed by transparent huge pages (`madvise(MADV_HUGEPAGE)`, which the usual `madvise` setting
//! of `/sys/kernel/mm/transparent_hugepage/enabled` requires). Its pages are zero from the OS and
//! become resident only when first touched (the global allocator's `alloc_zeroed` at 64-byte
//! alignment writes every byte instead), and the kernels that stream it (decode reads every
//! quantized matrix, attention every cached position) take one TLB miss per 2 MiB instead of
//! one per 4 KiB, where the hardware prefetchers also stop. Smaller buffers, and other systems,
//! use the global allocator.

use std::alloc::{Layout, alloc_zeroed, dealloc, handle_alloc_error};
use std::ops::{Deref, DerefMut};

/// Alignment of [`AlignedBytes`] (the `repr(align)` of `Line` is the same number).
pub const ALIGN: usize = 64;

/// Buffers of at least this many bytes are mapped on their own, with huge pages (on Linux).
pub const HUGE_PAGE: usize = 2 << 20;

/// A type of [`ALIGN`] alignment, for an aligned dangling pointer.
#[repr(align(64))]
struct Line;

pub struct AlignedBytes {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
    /// Whether the bytes are an anonymous map of their own (`munmap` on drop) rather than an
    /// allocation of the global allocator.
    mapped: bool,
}

// SAFETY: the buffer is uniquely owned, like a `Vec<u8>`.
unsafe impl Send for AlignedBytes {}
// SAFETY: shared access only reads, like `&[u8]`.
unsafe impl Sync for AlignedBytes {}

impl AlignedBytes {
    /// `len` zero bytes; `None` if `len` rounded up to the alignment overflows a layout.
    pub fn zeroed(len: usize) -> Option<Self> {
        if len == 0 {
            return Some(AlignedBytes { ptr: std::ptr::NonNull::<Line>::dangling().cast(), len, mapped: false });
        }
        let layout = Layout::from_size_align(len, ALIGN).ok()?;
        #[cfg(target_os = "linux")]
        if len >= HUGE_PAGE
            && huge_page_maps_enabled()
            && let Some(ptr) = map_huge(len)
        {
            return Some(AlignedBytes { ptr, len, mapped: true });
        }
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = std::ptr::NonNull::new(ptr) else { handle_alloc_error(layout) };
        Some(AlignedBytes { ptr, len, mapped: false })
    }
}

/// Whether large buffers get maps of their own with huge pages: on by default;
/// `KYLIN_HUGE_PAGES=0` turns it off (every buffer from the global allocator), for comparisons.
#[cfg(target_os = "linux")]
fn huge_page_maps_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::env_switch(&ON, &["KYLIN_HUGE_PAGES"])
}

/// The size of a base page (4 KiB on x86-64, up to 64 KiB elsewhere).
#[cfg(target_os = "linux")]
fn page_size() -> usize {
    // SAFETY: `sysconf` only reads a system constant.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).ok().filter(|&s| s > 0).unwrap_or(4096)
}

/// `len` zero bytes in a private anonymous map that starts at a 2 MiB boundary and asks for
/// transparent huge pages; `None` if the map fails (the caller then uses the global
/// allocator). The advice is a hint: where huge pages are off or short, the map keeps 4 KiB
/// pages. The map is made [`HUGE_PAGE`] longer than asked, then trimmed to start at a
/// boundary, so that every whole 2 MiB of the buffer can be one huge page.
#[cfg(target_os = "linux")]
fn map_huge(len: usize) -> Option<std::ptr::NonNull<u8>> {
    let page = page_size();
    let mapped = len.checked_add(HUGE_PAGE)?;
    // SAFETY: a fresh private anonymous map at an address the kernel chooses aliases nothing.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            mapped,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return None;
    }
    let start = raw as usize;
    let aligned = start.next_multiple_of(HUGE_PAGE);
    let end = aligned + len.next_multiple_of(page);
    // SAFETY: the head `start..aligned` and the tail `end..start + mapped` are page-aligned
    // parts of the map just made, outside the buffer; the advice changes no content, and its
    // failure (a kernel without transparent huge pages) leaves 4 KiB pages.
    unsafe {
        if aligned > start {
            libc::munmap(raw, aligned - start);
        }
        if start + mapped > end {
            libc::munmap(end as *mut libc::c_void, start + mapped - end);
        }
        libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
    }
    std::ptr::NonNull::new(aligned as *mut u8)
}

impl Drop for AlignedBytes {
    fn drop(&mut self) {
        if self.mapped {
            // SAFETY: mapped in `zeroed` with this length, and unmapped only here.
            #[cfg(target_os = "linux")]
            unsafe {
                libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.len)
            };
        } else if self.len > 0 {
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
        for len in [0, 1, 63, 64, 65, 1 << 20, HUGE_PAGE, 3 * HUGE_PAGE + 65] {
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

    /// A large buffer is a map of its own on Linux, and its pages become resident only when
    /// touched.
    #[cfg(target_os = "linux")]
    #[test]
    fn large_buffers_are_lazily_zeroed_maps() {
        assert!(!AlignedBytes::zeroed(HUGE_PAGE - 1).unwrap().mapped);
        let len = 16 * HUGE_PAGE;
        let mut b = AlignedBytes::zeroed(len).unwrap();
        assert!(b.mapped);
        assert_eq!(b.as_ptr() as usize % HUGE_PAGE, 0, "the map starts at a huge page boundary");
        // Resident bytes of the buffer: `mincore` over its pages.
        let resident = |b: &AlignedBytes| {
            let page = page_size();
            let mut vec = vec![0u8; len.div_ceil(page)];
            // SAFETY: the range is the buffer's map; `vec` has one byte per page.
            let rc = unsafe { libc::mincore(b.as_ptr() as *mut libc::c_void, len, vec.as_mut_ptr()) };
            assert_eq!(rc, 0);
            vec.iter().filter(|&&v| v & 1 == 1).count() * page
        };
        assert!(resident(&b) < HUGE_PAGE, "a fresh map is not written: {} bytes resident", resident(&b));
        b[len / 2] = 1;
        assert!(resident(&b) < 2 * HUGE_PAGE + page_size());
        assert_eq!(b.iter().map(|&x| x as usize).sum::<usize>(), 1);
    }
}
