//! A zeroed, 64-byte aligned byte buffer: the KV pool's and the quantized matrices' storage, so
//! every 64-byte row a kernel loads (an AVX-512 vector, an AMX tile row) lies in one cache line.
//!
//! On Linux the buffers a kernel streams live on transparent huge pages
//! (`madvise(MADV_HUGEPAGE)`, which the usual `madvise` setting of
//! `/sys/kernel/mm/transparent_hugepage/enabled` requires), so that decode, which reads every
//! quantized matrix once per token, and attention, which reads every cached position, take one
//! TLB miss per 2 MiB instead of one per 4 KiB, where the hardware prefetchers also stop:
//! - a buffer of at least [`HUGE_PAGE`] bytes is an anonymous map of its own, starting at a
//!   2 MiB boundary;
//! - a smaller one of at least [`ARENA_MIN`] bytes is carved from a shared arena chunk of
//!   [`ARENA_CHUNK`] bytes, itself such a map. A huge page cannot back less than 2 MiB of one
//!   map, and most of a model's matrices are smaller: Qwen3-0.6B's Q4_K matrices (0.6 to
//!   1.8 MB) or an MoE model's experts (0.9 MB each in Q4_K for Qwen3-30B-A3B's shape). On 4 KiB
//!   pages one thread streamed Q4_K at 19 to 21 GB/s against 26 to 27 on huge pages
//!   (`model_quant_decode`, `BENCHMARKS.md`).
//!
//! A chunk hands each of its bytes out once, in order (a bump pointer), so its buffers are zero
//! pages from the OS like a map of their own; it is unmapped when its last buffer is dropped.
//! Its pages, like a map's, become resident only when first touched (the global allocator's
//! `alloc_zeroed` at 64-byte alignment writes every byte instead). What a chunk may waste is
//! its tail when the next buffer does not fit (under 2 MiB per 32 MiB chunk, resident only if
//! touched). Smaller buffers, other systems, and `KYLIN_HUGE_PAGES=0` use the global allocator.

use std::alloc::{Layout, alloc_zeroed, dealloc, handle_alloc_error};
use std::ops::{Deref, DerefMut};
#[cfg(target_os = "linux")]
use std::sync::{Arc, Mutex, Weak};

/// Alignment of [`AlignedBytes`] (the `repr(align)` of `Line` is the same number).
pub const ALIGN: usize = 64;

/// Buffers of at least this many bytes are mapped on their own, with huge pages (on Linux).
pub const HUGE_PAGE: usize = 2 << 20;

/// Smaller buffers than this come from the global allocator: a few pages gain nothing from a
/// huge one.
pub const ARENA_MIN: usize = 16 << 10;

/// Bytes of one arena chunk, which holds buffers of [`ARENA_MIN`] up to [`HUGE_PAGE`] bytes.
pub const ARENA_CHUNK: usize = 32 << 20;

/// A type of [`ALIGN`] alignment, for an aligned dangling pointer.
#[repr(align(64))]
struct Line;

pub struct AlignedBytes {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
    storage: Storage,
}

/// Where an [`AlignedBytes`]' bytes live, which says how they are given back.
enum Storage {
    /// An allocation of the global allocator (or no bytes at all).
    Global,
    /// An anonymous map of its own, unmapped on drop.
    #[cfg(target_os = "linux")]
    Mapped,
    /// A part of an arena chunk, which is unmapped when its last part is dropped.
    #[cfg(target_os = "linux")]
    Arena(#[allow(dead_code)] Arc<ArenaChunk>),
}

// SAFETY: the buffer is uniquely owned, like a `Vec<u8>`.
unsafe impl Send for AlignedBytes {}
// SAFETY: shared access only reads, like `&[u8]`.
unsafe impl Sync for AlignedBytes {}

impl AlignedBytes {
    /// `len` zero bytes; `None` if `len` rounded up to the alignment overflows a layout.
    pub fn zeroed(len: usize) -> Option<Self> {
        if len == 0 {
            return Some(AlignedBytes {
                ptr: std::ptr::NonNull::<Line>::dangling().cast(),
                len,
                storage: Storage::Global,
            });
        }
        let layout = Layout::from_size_align(len, ALIGN).ok()?;
        #[cfg(target_os = "linux")]
        if huge_page_maps_enabled() {
            if len >= HUGE_PAGE
                && let Some(ptr) = map_huge(len)
            {
                return Some(AlignedBytes { ptr, len, storage: Storage::Mapped });
            }
            if (ARENA_MIN..HUGE_PAGE).contains(&len)
                && let Some((chunk, ptr)) = arena_part(len)
            {
                return Some(AlignedBytes { ptr, len, storage: Storage::Arena(chunk) });
            }
        }
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = std::ptr::NonNull::new(ptr) else { handle_alloc_error(layout) };
        Some(AlignedBytes { ptr, len, storage: Storage::Global })
    }
}

/// One arena chunk: an anonymous map of [`ARENA_CHUNK`] bytes on huge pages
/// ([`map_huge`]), whose parts are buffers of [`ARENA_MIN`] up to [`HUGE_PAGE`] bytes.
#[cfg(target_os = "linux")]
struct ArenaChunk {
    base: std::ptr::NonNull<u8>,
}

// SAFETY: the chunk only owns its map; its parts are handed out once each, to one
// `AlignedBytes` apiece, which give the usual `Vec<u8>`-like access.
#[cfg(target_os = "linux")]
unsafe impl Send for ArenaChunk {}
// SAFETY: as for `Send`; the chunk itself is never read or written through.
#[cfg(target_os = "linux")]
unsafe impl Sync for ArenaChunk {}

#[cfg(target_os = "linux")]
impl Drop for ArenaChunk {
    fn drop(&mut self) {
        // SAFETY: mapped in `arena_part` with this length, and every part of it has been
        // dropped (each holds the chunk alive).
        unsafe { libc::munmap(self.base.as_ptr() as *mut libc::c_void, ARENA_CHUNK) };
    }
}

/// The chunk that new parts are carved from (held weakly: a chunk whose parts are all gone is
/// unmapped at once) and the offset of its first free byte.
#[cfg(target_os = "linux")]
struct Arena {
    chunk: Weak<ArenaChunk>,
    next: usize,
}

#[cfg(target_os = "linux")]
static ARENA: Mutex<Arena> = Mutex::new(Arena { chunk: Weak::new(), next: 0 });

/// An arena part of `len` bytes ([`Arena::part`]) from the process's arena.
#[cfg(target_os = "linux")]
fn arena_part(len: usize) -> Option<(Arc<ArenaChunk>, std::ptr::NonNull<u8>)> {
    // A poisoned lock only means another thread panicked between two plain assignments; the
    // state is still a chunk and an offset inside it.
    ARENA.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).part(len)
}

#[cfg(target_os = "linux")]
impl Arena {
    /// `len` (less than [`HUGE_PAGE`]) zero bytes at a 64-byte boundary of a chunk: the
    /// current chunk's next free bytes, or a fresh chunk's first when they do not fit or the
    /// chunk is gone. `None` if a fresh chunk cannot be mapped.
    fn part(&mut self, len: usize) -> Option<(Arc<ArenaChunk>, std::ptr::NonNull<u8>)> {
        debug_assert!(len < HUGE_PAGE);
        let current = self.chunk.upgrade().filter(|_| self.next + len <= ARENA_CHUNK);
        let chunk = match current {
            Some(chunk) => chunk,
            None => {
                let chunk = Arc::new(ArenaChunk { base: map_huge(ARENA_CHUNK)? });
                self.chunk = Arc::downgrade(&chunk);
                self.next = 0;
                chunk
            }
        };
        let at = self.next;
        self.next = (at + len).next_multiple_of(ALIGN);
        // SAFETY: `at + len <= ARENA_CHUNK`, so the part lies inside the chunk's map.
        let ptr = unsafe { chunk.base.add(at) };
        Some((chunk, ptr))
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
        match self.storage {
            Storage::Global if self.len > 0 => {
                // SAFETY: allocated in `zeroed` with this layout (which was valid then).
                unsafe { dealloc(self.ptr.as_ptr(), Layout::from_size_align_unchecked(self.len, ALIGN)) };
            }
            Storage::Global => {}
            #[cfg(target_os = "linux")]
            Storage::Mapped => {
                // SAFETY: mapped in `zeroed` with this length, and unmapped only here.
                unsafe { libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.len) };
            }
            // The chunk's reference is dropped with `storage`.
            #[cfg(target_os = "linux")]
            Storage::Arena(_) => {}
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
        if !huge_page_maps_enabled() {
            return;
        }
        assert!(!matches!(AlignedBytes::zeroed(HUGE_PAGE - 1).unwrap().storage, Storage::Mapped));
        let len = 16 * HUGE_PAGE;
        let mut b = AlignedBytes::zeroed(len).unwrap();
        assert!(matches!(b.storage, Storage::Mapped));
        assert_eq!(b.as_ptr() as usize % HUGE_PAGE, 0, "the map starts at a huge page boundary");
        assert!(resident(&b) < HUGE_PAGE, "a fresh map is not written: {} bytes resident", resident(&b));
        b[len / 2] = 1;
        assert!(resident(&b) < 2 * HUGE_PAGE + page_size());
        assert_eq!(b.iter().map(|&x| x as usize).sum::<usize>(), 1);
    }

    /// Resident bytes of a buffer's pages (`mincore`).
    #[cfg(target_os = "linux")]
    fn resident(b: &AlignedBytes) -> usize {
        let page = page_size();
        let start = b.as_ptr() as usize / page * page;
        let len = b.as_ptr() as usize + b.len() - start;
        let mut vec = vec![0u8; len.div_ceil(page)];
        // SAFETY: the range covers the buffer's pages, which are mapped; `vec` has one byte per
        // page.
        let rc = unsafe { libc::mincore(start as *mut libc::c_void, len, vec.as_mut_ptr()) };
        assert_eq!(rc, 0);
        vec.iter().filter(|&&v| v & 1 == 1).count() * page
    }

    /// Buffers from `ARENA_MIN` up to a huge page are parts of shared chunks: each aligned,
    /// zero, inside its chunk and apart from every other, also across a chunk's end; a chunk
    /// lives as long as its last part.
    #[cfg(target_os = "linux")]
    #[test]
    fn middle_sized_buffers_are_disjoint_zeroed_arena_parts() {
        if !huge_page_maps_enabled() {
            return;
        }
        assert!(matches!(AlignedBytes::zeroed(ARENA_MIN - 1).unwrap().storage, Storage::Global));
        // 40 buffers of 1 MiB and a little fill more than one chunk.
        let lens: Vec<usize> = (0..40).map(|i| (1 << 20) + 64 * i + i % 3).collect();
        let mut parts: Vec<AlignedBytes> = lens.iter().map(|&len| AlignedBytes::zeroed(len).unwrap()).collect();
        let mut chunks: Vec<usize> = Vec::new();
        for (i, part) in parts.iter_mut().enumerate() {
            let Storage::Arena(chunk) = &part.storage else { panic!("buffer {i} is not an arena part") };
            let base = chunk.base.as_ptr() as usize;
            let at = part.as_ptr() as usize;
            assert_eq!(at % ALIGN, 0);
            assert!(at >= base && at + part.len() <= base + ARENA_CHUNK, "buffer {i} lies outside its chunk");
            assert_eq!(base % HUGE_PAGE, 0, "a chunk starts at a huge page boundary");
            if !chunks.contains(&base) {
                chunks.push(base);
            }
            assert!(part.iter().all(|&x| x == 0), "buffer {i} is not zero");
            part.fill(i as u8 + 1);
        }
        assert!(chunks.len() >= 2, "40 MiB of parts fill more than one chunk");
        let mut spans: Vec<(usize, usize)> = parts.iter().map(|p| (p.as_ptr() as usize, p.len())).collect();
        spans.sort();
        assert!(spans.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0), "two parts overlap");
        for (i, part) in parts.iter().enumerate() {
            assert!(part.iter().all(|&x| x == i as u8 + 1), "buffer {i} was written by another");
        }
        // Parts are never handed out twice: a new one is zero although its neighbours were
        // written.
        let fresh = AlignedBytes::zeroed(3 * ARENA_MIN).unwrap();
        assert!(fresh.iter().all(|&x| x == 0));
    }

    /// A chunk stays mapped while one of its parts lives, and is unmapped with its last; a
    /// part that does not fit the current chunk's rest starts a new chunk. (An arena of the
    /// test's own: the process's is shared with the tests running beside this one.)
    #[cfg(target_os = "linux")]
    #[test]
    fn an_arena_chunk_lives_as_long_as_its_parts() {
        let mut arena = Arena { chunk: Weak::new(), next: 0 };
        let mut part = |len: usize| {
            let (chunk, ptr) = arena.part(len).expect("a fresh chunk maps");
            AlignedBytes { ptr, len, storage: Storage::Arena(chunk) }
        };
        let chunk_of = |b: &AlignedBytes| match &b.storage {
            Storage::Arena(chunk) => Arc::downgrade(chunk),
            _ => unreachable!("an arena part"),
        };
        let a = part(HUGE_PAGE - 1);
        let parts: Vec<AlignedBytes> = (1..ARENA_CHUNK / HUGE_PAGE).map(|_| part(HUGE_PAGE - 1)).collect();
        let first = chunk_of(&a);
        assert!(parts.iter().all(|p| chunk_of(p).ptr_eq(&first)), "16 parts under 2 MiB fit one chunk");
        assert_eq!(a.as_ptr() as usize + HUGE_PAGE, parts[0].as_ptr() as usize, "parts are packed at 64-byte steps");
        let next = part(HUGE_PAGE - 1);
        assert!(!chunk_of(&next).ptr_eq(&first), "a part past the chunk's end starts a new one");
        drop(a);
        assert!(first.upgrade().is_some(), "the chunk lives while parts of it do");
        drop(parts);
        assert!(first.upgrade().is_none(), "a chunk whose parts are all dropped is unmapped");
    }
}
