//! The paged KV cache: one pool of fixed-size blocks shared by every sequence, a block
//! allocator with reference counts, and a prefix cache over full blocks.
//!
//! - **Storage** ([`KvPool`]): keys and values of `block_size` positions of every layer and KV
//!   head per block, laid out block, layer, head, slot, `head_dim` (what
//!   [`kylin_kernels::paged::KvView`] reads), in f32, f16 or bf16. Allocated once; the pages are
//!   zeroed lazily by the OS, so memory is touched only as blocks are first used.
//! - **Allocation** ([`BlockAllocator`]): a reference count per block and one free list in
//!   least-recently-used order (a doubly linked list over block ids, so any block can leave it
//!   in O(1)). Free blocks that still hold a cached prefix stay in that list and are evicted
//!   (their hash forgotten) only when they are handed out again.
//! - **Prefix cache**: a full block is registered under a hash chained from the previous
//!   block's hash and its own token ids (vLLM's scheme); a later sequence whose tokens begin the
//!   same way finds the block, checks the ids, and shares it instead of computing it.
//!
//! Guarantees: nothing here allocates after construction (the hash table is created with room
//! for every block); reference counts never underflow (a double release panics: an engine bug);
//! a block with a non-zero count is never handed out.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use kylin_kernels::aligned::AlignedBytes;
use kylin_kernels::paged::{KvLayout, KvView};
use kylin_kernels::{ThreadPool, WeightDType};
use kylin_loader::{KylinError, Result};

use crate::shared_mut::SharedMut;

/// "No block" in the free list links.
const NIL: u32 = u32::MAX;

/// Reference counts, the LRU free list and the prefix-cache index of a pool of blocks.
#[derive(Debug)]
pub struct BlockAllocator {
    block_size: usize,
    ref_count: Vec<u32>,
    /// Free-list links; `head` is the least recently freed block.
    prev: Vec<u32>,
    next: Vec<u32>,
    in_free: Vec<bool>,
    head: u32,
    tail: u32,
    free: usize,
    /// Hash of each registered (cached) block.
    hash: Vec<Option<u64>>,
    /// The hash of the block before it in its sequence (0 for the first), to check a match.
    parent: Vec<u64>,
    /// The token ids of each registered block, `(n_blocks, block_size)`, to check a match.
    tokens: Vec<u32>,
    /// Registered blocks by hash.
    index: HashMap<u64, u32>,
    /// Unreferenced blocks that are registered.
    cached_free: usize,
    /// What the prefix cache gained and lost since the last drain, when recorded.
    events: Option<KvEventLog>,
}

impl BlockAllocator {
    /// `n_blocks` free blocks of `block_size` positions.
    pub fn new(n_blocks: usize, block_size: usize) -> Self {
        let n = n_blocks as u32;
        BlockAllocator {
            block_size,
            ref_count: vec![0; n_blocks],
            prev: (0..n).map(|i| if i == 0 { NIL } else { i - 1 }).collect(),
            next: (0..n).map(|i| if i + 1 == n { NIL } else { i + 1 }).collect(),
            in_free: vec![true; n_blocks],
            head: if n_blocks == 0 { NIL } else { 0 },
            tail: if n_blocks == 0 { NIL } else { n - 1 },
            free: n_blocks,
            hash: vec![None; n_blocks],
            parent: vec![0; n_blocks],
            tokens: vec![0; n_blocks * block_size],
            index: HashMap::with_capacity(n_blocks),
            cached_free: 0,
            events: None,
        }
    }

    /// Starts recording what the prefix cache gains and loses ([`KvEventLog`]), for routers
    /// that follow the cache; the log is planned for `per_drain` events between two drains.
    pub fn record_events(&mut self, per_drain: usize) {
        self.events = Some(KvEventLog::with_capacity(per_drain, self.block_size));
    }

    /// Hands the recorded events to `f` in order and clears the log (nothing when not
    /// recording).
    pub fn drain_events(&mut self, f: &mut dyn FnMut(KvEvent<'_>)) {
        if let Some(log) = &mut self.events {
            log.drain(f);
        }
    }

    pub fn total(&self) -> usize {
        self.ref_count.len()
    }

    /// Blocks with no reference (never used, or holding an evictable cached prefix).
    pub fn free(&self) -> usize {
        self.free
    }

    /// Free blocks that still hold a cached prefix.
    pub fn cached_free(&self) -> usize {
        self.cached_free
    }

    pub fn ref_count(&self, block: u32) -> u32 {
        self.ref_count[block as usize]
    }

    fn unlink(&mut self, b: u32) {
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        if p == NIL {
            self.head = n
        } else {
            self.next[p as usize] = n
        }
        if n == NIL {
            self.tail = p
        } else {
            self.prev[n as usize] = p
        }
        self.in_free[b as usize] = false;
        self.free -= 1;
        if self.hash[b as usize].is_some() {
            self.cached_free -= 1;
        }
    }

    fn push_back(&mut self, b: u32) {
        self.prev[b as usize] = self.tail;
        self.next[b as usize] = NIL;
        if self.tail == NIL {
            self.head = b
        } else {
            self.next[self.tail as usize] = b
        }
        self.tail = b;
        self.in_free[b as usize] = true;
        self.free += 1;
        if self.hash[b as usize].is_some() {
            self.cached_free += 1;
        }
    }

    /// Takes the least recently used free block (evicting its cached prefix), with one reference.
    pub fn allocate(&mut self) -> Option<u32> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.unlink(b);
        if let Some(h) = self.hash[b as usize].take()
            && self.index.get(&h) == Some(&b)
        {
            self.index.remove(&h);
            if let Some(log) = &mut self.events {
                log.removed(h);
            }
        }
        self.ref_count[b as usize] = 1;
        Some(b)
    }

    /// Adds a reference to a block (taking it out of the free list if it was there).
    pub fn retain(&mut self, b: u32) {
        if self.in_free[b as usize] {
            self.unlink(b);
        }
        self.ref_count[b as usize] += 1;
    }

    /// Drops a reference; an unreferenced block joins the free list as the most recently used.
    pub fn release(&mut self, b: u32) {
        let count = &mut self.ref_count[b as usize];
        assert!(*count > 0, "block {b} released more often than retained");
        *count -= 1;
        if *count == 0 {
            self.push_back(b);
        }
    }

    /// The chained hash of a full block of `tokens` that follows a block hashed `parent`.
    pub fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        parent.hash(&mut h);
        tokens.hash(&mut h);
        // Never 0, which stands for "no parent".
        h.finish() | 1
    }

    /// The cached block holding `tokens` after a block hashed `parent`, with a reference added;
    /// None when there is none.
    pub fn lookup(&mut self, parent: u64, tokens: &[u32]) -> Option<(u32, u64)> {
        let h = Self::chain_hash(parent, tokens);
        let &b = self.index.get(&h)?;
        let bs = self.block_size;
        let stored = &self.tokens[b as usize * bs..(b as usize + 1) * bs];
        if self.parent[b as usize] != parent || stored != tokens {
            return None;
        }
        self.retain(b);
        Some((b, h))
    }

    /// Whether a cached block holds `tokens` after a block hashed `parent` (no reference taken).
    pub fn peek(&self, parent: u64, tokens: &[u32]) -> bool {
        let h = Self::chain_hash(parent, tokens);
        let Some(&b) = self.index.get(&h) else { return false };
        let bs = self.block_size;
        self.parent[b as usize] == parent && &self.tokens[b as usize * bs..(b as usize + 1) * bs] == tokens
    }

    /// Registers a referenced, full block holding `tokens` after a block hashed `parent`;
    /// returns its hash. A block with the same contents already registered keeps its place.
    pub fn register(&mut self, b: u32, parent: u64, tokens: &[u32]) -> u64 {
        let h = Self::chain_hash(parent, tokens);
        if self.hash[b as usize].is_none() && !self.index.contains_key(&h) {
            let bs = self.block_size;
            self.tokens[b as usize * bs..(b as usize + 1) * bs].copy_from_slice(tokens);
            self.parent[b as usize] = parent;
            self.hash[b as usize] = Some(h);
            self.index.insert(h, b);
            if let Some(log) = &mut self.events {
                log.stored(h, parent, tokens);
            }
        }
        h
    }
}

/// One change of the prefix cache, in the terms of vLLM's KV-cache events: a full block
/// registered under its chained hash (with its parent's hash, 0 for none, and its token ids),
/// a registered block evicted, or everything forgotten (the log overflowed between drains, so
/// a follower must start over).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvEvent<'a> {
    Stored { hash: u64, parent: u64, tokens: &'a [u32] },
    Removed { hash: u64 },
    Cleared,
}

/// The prefix cache's events between two drains, in buffers planned up front: recording never
/// allocates. When more events come than were planned for, the log keeps none of them and its
/// next drain says [`KvEvent::Cleared`] (the caches a follower tracks are then unknown to it,
/// which costs routing quality, never correctness).
#[derive(Debug)]
pub struct KvEventLog {
    /// `(hash, parent, offset of its tokens in tokens, or u32::MAX for a removal)`.
    entries: Vec<(u64, u64, u32)>,
    tokens: Vec<u32>,
    block_size: usize,
    overflowed: bool,
}

impl KvEventLog {
    pub fn with_capacity(events: usize, block_size: usize) -> Self {
        KvEventLog {
            entries: Vec::with_capacity(events),
            tokens: Vec::with_capacity(events * block_size),
            block_size,
            overflowed: false,
        }
    }

    fn full(&self, tokens: usize) -> bool {
        self.entries.len() == self.entries.capacity() || self.tokens.len() + tokens > self.tokens.capacity()
    }

    fn overflow(&mut self) {
        self.overflowed = true;
        self.entries.clear();
        self.tokens.clear();
    }

    fn stored(&mut self, hash: u64, parent: u64, tokens: &[u32]) {
        if self.overflowed {
            return;
        }
        if self.full(tokens.len()) {
            return self.overflow();
        }
        self.entries.push((hash, parent, self.tokens.len() as u32));
        self.tokens.extend_from_slice(tokens);
    }

    fn removed(&mut self, hash: u64) {
        if self.overflowed {
            return;
        }
        if self.full(0) {
            return self.overflow();
        }
        self.entries.push((hash, 0, u32::MAX));
    }

    /// Hands the events to `f` in order and clears the log.
    pub fn drain(&mut self, f: &mut dyn FnMut(KvEvent<'_>)) {
        if self.overflowed {
            f(KvEvent::Cleared);
            self.overflowed = false;
        }
        for &(hash, parent, offset) in &self.entries {
            if offset == u32::MAX {
                f(KvEvent::Removed { hash });
            } else {
                let start = offset as usize;
                f(KvEvent::Stored { hash, parent, tokens: &self.tokens[start..start + self.block_size] });
            }
        }
        self.entries.clear();
        self.tokens.clear();
    }
}

/// The keys and values one layer keeps per position: `n_kv_heads` heads of `head_dim`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl KvShape {
    /// Elements per position (keys, or values).
    pub fn width(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// Keys and values of every block, in one element type. Layers may differ in heads and head
/// width (Gemma 4's global layers); each layer's tiles sit at its own offset in a block.
#[derive(Debug)]
pub struct KvPool {
    pub dtype: WeightDType,
    pub block_size: usize,
    /// Per layer of the pool: its heads and their width.
    pub layers: Vec<KvShape>,
    /// Per layer: the element offset of its first tile inside a block.
    layer_offsets: Vec<usize>,
    /// Elements per block for keys (and for values): `block_size · Σ n_kv_heads · head_dim`.
    pub block_stride: usize,
    /// How each (block, layer, head) tile is laid out: the layout of the attention path that
    /// reads the pool (`kylin_kernels::paged::attention_path`).
    pub layout: KvLayout,
    /// 64-byte aligned, so a kernel's 64-byte rows never straddle two cache lines.
    keys: AlignedBytes,
    values: AlignedBytes,
    pub alloc: BlockAllocator,
}

impl KvPool {
    /// Bytes one block takes (keys and values) for `layers`.
    pub fn block_bytes(dtype: WeightDType, layers: &[KvShape], block_size: usize) -> Option<u64> {
        let mut per_position = 0u64;
        for l in layers {
            per_position = per_position.checked_add((l.n_kv_heads as u64).checked_mul(l.head_dim as u64)?)?;
        }
        per_position.checked_mul(block_size as u64)?.checked_mul(2 * dtype.size_in_bytes() as u64)
    }

    /// Allocates `n_blocks` blocks. `CONFIG_INVALID` if the size overflows.
    pub fn new(
        dtype: WeightDType,
        layout: KvLayout,
        n_blocks: usize,
        block_size: usize,
        layers: &[KvShape],
    ) -> Result<Self> {
        let overflow = || {
            KylinError::config_invalid(format!("a KV pool of {n_blocks} blocks overflows; pass a smaller --kv-memory"))
        };
        let mut layer_offsets = Vec::with_capacity(layers.len());
        let mut block_stride = 0usize;
        for l in layers {
            layer_offsets.push(block_stride);
            let tiles = l.n_kv_heads.checked_mul(block_size).and_then(|x| x.checked_mul(l.head_dim));
            block_stride = tiles.and_then(|t| block_stride.checked_add(t)).ok_or_else(overflow)?;
        }
        let bytes = block_stride
            .checked_mul(n_blocks)
            .and_then(|x| x.checked_mul(dtype.size_in_bytes()))
            .ok_or_else(overflow)?;
        if n_blocks >= u32::MAX as usize {
            return Err(overflow());
        }
        Ok(KvPool {
            dtype,
            block_size,
            layers: layers.to_vec(),
            layer_offsets,
            block_stride,
            layout,
            keys: AlignedBytes::zeroed(bytes).ok_or_else(overflow)?,
            values: AlignedBytes::zeroed(bytes).ok_or_else(overflow)?,
            alloc: BlockAllocator::new(n_blocks, block_size),
        })
    }

    /// Touches every page of the pool now, so its memory is resident from the start and the
    /// process's footprint does not grow with traffic (a server wants its memory up front).
    pub fn prefault(&mut self) {
        for data in [&mut self.keys, &mut self.values] {
            for page in data.chunks_mut(4096) {
                // A volatile write, so the compiler cannot drop it as a store of zero into
                // memory it knows to be zeroed.
                // SAFETY: `page` is a non-empty slice, so its first byte is valid for writes.
                unsafe { std::ptr::write_volatile(page.as_mut_ptr(), 0) };
            }
        }
    }

    /// Bytes of keys and values together.
    pub fn bytes(&self) -> u64 {
        (self.keys.len() + self.values.len()) as u64
    }

    /// Element offset of (`layer`, `head`) inside a block.
    #[inline]
    pub fn head_offset(&self, layer: usize, head: usize) -> usize {
        self.layer_offsets[layer] + head * self.block_size * self.layers[layer].head_dim
    }

    /// The keys and values of `layer` as views for the attention kernel.
    pub fn views(&self, layer: usize) -> (KvView<'_>, KvView<'_>) {
        let geometry = KvView {
            dtype: self.dtype,
            layout: self.layout,
            data: &self.keys,
            block_stride: self.block_stride,
            block_size: self.block_size,
            head_dim: self.layers[layer].head_dim,
        };
        (geometry, KvView { data: &self.values, ..geometry })
    }

    /// Stores the keys and values of `n` tokens for `layer`: token `t`'s are rows `t` of `k`
    /// and `v` `(n, n_kv_heads * head_dim)`, and go to position `place(t).1` of the sequence
    /// whose block table is `place(t).0`, each head's to its (block, layer, head) tile in the
    /// pool's layout. With many tokens the KV heads are split over `pool`: each tile is a span
    /// of its own, so no two tasks write the same bytes, and no element depends on the split.
    ///
    /// In the pair layout the AMX kernel loads whole 16-position chunks, slots past the
    /// sequence's length included (their scores are masked and their values multiplied by
    /// zero), so those slots must hold finite numbers: a block's tile is zeroed when its first
    /// slot is written (unless this call writes all its slots), and a stale NaN of an earlier
    /// sequence can never reach a later one.
    pub fn store_tokens<'t>(
        &mut self,
        pool: &ThreadPool,
        layer: usize,
        n: usize,
        place: &(dyn Fn(usize) -> (&'t [u32], usize) + Sync),
        k: &[f32],
        v: &[f32],
    ) {
        let KvShape { n_kv_heads, head_dim: hd } = self.layers[layer];
        let kv_dim = n_kv_heads * hd;
        assert!(k.len() >= n * kv_dim && v.len() >= n * kv_dim, "store_tokens: rows too short");
        let parts = if n.saturating_mul(kv_dim) >= STORE_PARALLEL_MIN { pool.threads().min(n_kv_heads) } else { 1 };
        let (bs, dtype, layout, stride) = (self.block_size, self.dtype, self.layout, self.block_stride);
        let size = dtype.size_in_bytes();
        let tile_bytes = bs * hd * size;
        let first_head = self.layer_offsets[layer];
        let (keys, values) = (SharedMut::new(&mut self.keys), SharedMut::new(&mut self.values));
        // Whether tokens `t..t + bs` are positions `pos..pos + bs` of one sequence (its block
        // table `blocks`): then this call writes every slot of the block, and none needs zeroing.
        let fills_block = |t: usize, blocks: &[u32], pos: usize| {
            t + bs <= n
                && (1..bs).all(|i| {
                    let (next_blocks, next_pos) = place(t + i);
                    std::ptr::eq(next_blocks, blocks) && next_pos == pos + i
                })
        };
        let heads = |p: usize| {
            for h in p * n_kv_heads / parts..(p + 1) * n_kv_heads / parts {
                for t in 0..n {
                    let (blocks, pos) = place(t);
                    let (block, slot) = (blocks[pos / bs] as usize, pos % bs);
                    let tile = block * stride + first_head + h * bs * hd;
                    // SAFETY: head `h`'s tiles belong to this task alone (each task has its own
                    // heads), and the buffers outlive the call.
                    let (kd, vd) =
                        unsafe { (keys.slice(tile * size, tile_bytes), values.slice(tile * size, tile_bytes)) };
                    if slot == 0 && layout == KvLayout::Pairs && !fills_block(t, blocks, pos) {
                        kd.fill(0);
                        vd.fill(0);
                    }
                    let row = t * kv_dim + h * hd;
                    kylin_kernels::paged::store_key(layout, dtype, kd, 0, bs, slot, &k[row..row + hd]);
                    kylin_kernels::paged::store_value(layout, dtype, vd, 0, bs, slot, &v[row..row + hd]);
                }
            }
        };
        if parts <= 1 {
            heads(0);
        } else {
            pool.run(parts, &heads);
        }
    }

    /// Copies block `from` to block `to` (a partly filled block before two sequences diverge).
    /// The whole block is copied: keys are stored transposed, so the filled positions are not
    /// one span, and the slots past the filled ones are never read before they are written.
    pub fn copy_block(&mut self, from: u32, to: u32) {
        let bytes = self.block_stride * self.dtype.size_in_bytes();
        for data in [&mut self.keys, &mut self.values] {
            let src = from as usize * bytes;
            data.copy_within(src..src + bytes, to as usize * bytes);
        }
    }
}

/// Elements of keys below which [`KvPool::store_tokens`] stores on the calling thread alone.
const STORE_PARALLEL_MIN: usize = 1 << 14;

#[cfg(test)]
mod tests {
    use super::*;

    /// In the pair layout, the slots of a block that a call leaves unwritten hold zeros, never a
    /// stale NaN of the block's previous sequence, whether the call's other tokens belong to the
    /// same sequence or to another; a block one call fills holds exactly what it wrote.
    #[test]
    fn pair_tiles_hold_no_stale_numbers_past_the_written_slots() {
        let (bs, hd, heads) = (16, 4, 2);
        let kv_dim = heads * hd;
        let pool = ThreadPool::new(1);
        let mut kv =
            KvPool::new(WeightDType::BF16, KvLayout::Pairs, 3, bs, &[KvShape { n_kv_heads: heads, head_dim: hd }])
                .expect("a small pool");
        // A first sequence fills all three blocks with NaN.
        let first_table = [0u32, 1, 2];
        let nan = vec![f32::NAN; 3 * bs * kv_dim];
        kv.store_tokens(&pool, 0, 3 * bs, &|t| (&first_table[..], t), &nan, &nan);
        // Then one call stores 3 positions of x (block 0), 2 of y (block 1) and all 16 of z
        // (block 2), each value nonzero.
        let (x, y, z) = ([0u32], [1u32], [2u32]);
        let place = |t: usize| -> (&[u32], usize) {
            match t {
                0..3 => (&x[..], t),
                3..5 => (&y[..], t - 3),
                _ => (&z[..], t - 5),
            }
        };
        let n = 3 + 2 + bs;
        let rows: Vec<f32> = (0..n * kv_dim).map(|i| 1.0 + i as f32 / 64.0).collect();
        kv.store_tokens(&pool, 0, n, &place, &rows, &rows);
        for (block, written) in [(0usize, 3usize), (1, 2), (2, bs)] {
            for data in [&kv.keys, &kv.values] {
                let bytes = &data[block * kv.block_stride * 2..(block + 1) * kv.block_stride * 2];
                let elements: Vec<f32> =
                    bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect();
                assert!(elements.iter().all(|v| v.is_finite()), "block {block} keeps a stale NaN: {elements:?}");
                let nonzero = elements.iter().filter(|&&v| v != 0.0).count();
                assert_eq!(nonzero, written * kv_dim, "block {block}: {elements:?}");
            }
        }
    }

    #[test]
    fn allocation_is_lru_and_release_returns_blocks() {
        let mut a = BlockAllocator::new(3, 2);
        let b0 = a.allocate().unwrap();
        let b1 = a.allocate().unwrap();
        let b2 = a.allocate().unwrap();
        assert_eq!((b0, b1, b2), (0, 1, 2));
        assert!(a.allocate().is_none());
        a.release(b1);
        a.release(b0);
        assert_eq!(a.free(), 2);
        // b1 was freed first, so it is handed out first.
        assert_eq!(a.allocate(), Some(b1));
        a.release(b1);
        a.release(b2);
        assert_eq!(a.free(), 3);
    }

    #[test]
    fn prefix_blocks_are_found_by_chained_hash_and_evicted_when_reused() {
        let mut a = BlockAllocator::new(2, 2);
        let b = a.allocate().unwrap();
        let h = a.register(b, 0, &[7, 8]);
        a.release(b);
        assert_eq!(a.cached_free(), 1);
        // Same tokens after a different parent: no hit.
        assert!(a.lookup(5, &[7, 8]).is_none());
        let (hit, hash) = a.lookup(0, &[7, 8]).unwrap();
        assert_eq!((hit, hash), (b, h));
        assert_eq!(a.ref_count(b), 1);
        a.release(b);
        // Allocating both blocks evicts the cached one.
        let x = a.allocate().unwrap();
        let y = a.allocate().unwrap();
        assert!(a.lookup(0, &[7, 8]).is_none());
        assert_eq!(a.cached_free(), 0);
        a.release(x);
        a.release(y);
    }

    #[test]
    fn the_event_log_reports_stored_and_evicted_blocks_and_says_cleared_after_an_overflow() {
        let mut a = BlockAllocator::new(2, 2);
        a.record_events(3);
        let b0 = a.allocate().unwrap();
        let h0 = a.register(b0, 0, &[1, 2]);
        let b1 = a.allocate().unwrap();
        let h1 = a.register(b1, h0, &[3, 4]);
        // The same contents registered again are not a new event.
        a.register(b1, h0, &[3, 4]);
        a.release(b0);
        a.release(b1);
        let mut seen: Vec<String> = Vec::new();
        a.drain_events(&mut |e| seen.push(format!("{e:?}")));
        assert_eq!(
            seen,
            [
                format!("Stored {{ hash: {h0}, parent: 0, tokens: [1, 2] }}"),
                format!("Stored {{ hash: {h1}, parent: {h0}, tokens: [3, 4] }}")
            ]
        );
        seen.clear();
        // Handing out the least recently freed block evicts its cached prefix.
        let again = a.allocate().unwrap();
        assert_eq!(again, b0);
        a.drain_events(&mut |e| seen.push(format!("{e:?}")));
        assert_eq!(seen, [format!("Removed {{ hash: {h0} }}")]);
        seen.clear();
        // More events than the three planned: the log keeps none and says cleared.
        a.release(again);
        for ids in [[5, 6], [7, 8], [9, 10]] {
            let block = a.allocate().unwrap();
            a.register(block, 0, &ids);
            a.release(block);
        }
        a.drain_events(&mut |e| seen.push(format!("{e:?}")));
        assert_eq!(seen, ["Cleared"]);
        seen.clear();
        a.drain_events(&mut |e| seen.push(format!("{e:?}")));
        assert!(seen.is_empty());
    }

    #[test]
    #[should_panic(expected = "released more often")]
    fn double_release_is_caught() {
        let mut a = BlockAllocator::new(1, 2);
        let b = a.allocate().unwrap();
        a.release(b);
        a.release(b);
    }
}
