//! The per-sequence state of the recurrent mixers (Gated DeltaNet, short convolutions), beside
//! the paged KV cache: live slots for running sequences and snapshots for the prefix cache.
//!
//! A recurrent layer's state does not grow with the context, so it is not paged: each running
//! sequence holds one **live slot** with, per recurrent layer,
//!
//! - Gated DeltaNet: the anchor `S₀` (`(key_head_dim, value_head_dim)` per value head) at the
//!   sequence's last chunk boundary, the chunk in progress (per value head up to `chunk` keys,
//!   corrected values and decays: `kylin_kernels::delta`), the convolution's last `kernel - 1`
//!   input rows, and those rows as they were at the anchor;
//! - short convolution: its last `kernel - 1` input rows, and those at the anchor;
//! - with speculative decoding, per layer with a convolution, its **log**: the `kernel - 1`
//!   rows before the first position that may be rejected, then the input rows from there (one
//!   speculative segment of the target, or a draft model's proposals fed one pass at a time),
//!   so that the rows after any of those positions can be put back ([`StatePool::roll_back`]).
//!
//! No position that may be rejected completes a chunk (the engine caps the proposals there,
//! `batch::proposals_before_chunk_end`), so rejecting them leaves `S₀` and the anchor as they
//! were: the chunk in progress is indexed by position, and the next call overwrites the
//! rejected tokens' keys, values and decays. Only the convolution rows have moved past the
//! accepted tokens, and the log puts them back.
//!
//! Chunks start at multiples of `chunk`, itself a multiple of the KV block size, so every
//! anchor is a block boundary. A **snapshot** is a copy of a live slot's anchor (`S₀` and the
//! convolution rows at the anchor) registered under the chained hash of the KV block that ends
//! there (the prefix cache's key, `kv_pool.rs`): a later sequence whose prefix matches those
//! blocks starts from the snapshot and computes only what follows it. Snapshots live in a
//! fixed number of slots, evicted least recently used first.
//!
//! Guarantees: all memory is allocated once in [`StatePool::new`] (zeroed lazily by the OS);
//! nothing here allocates afterwards (the snapshot index has room for every slot); a live slot
//! is owned by one sequence at a time (allocated at admission, released when the sequence
//! ends, is cancelled or preempted).

use std::collections::HashMap;

use kylin_loader::{KylinError, Result};

/// The state one recurrent layer keeps per sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecurrentShape {
    /// Gated DeltaNet: `heads` value heads of `(dk, dv)` states, a convolution of `taps` over
    /// `channels`.
    DeltaNet { heads: usize, dk: usize, dv: usize, channels: usize, taps: usize },
    /// A short convolution of `taps` over `channels`.
    ShortConv { channels: usize, taps: usize },
}

impl RecurrentShape {
    fn conv(&self) -> (usize, usize) {
        match *self {
            RecurrentShape::DeltaNet { channels, taps, .. } | RecurrentShape::ShortConv { channels, taps } => {
                (channels, taps)
            }
        }
    }

    /// Floats of the convolution's rows (live, or at the anchor).
    fn conv_len(&self) -> usize {
        let (channels, taps) = self.conv();
        channels * (taps - 1)
    }

    /// Floats of the convolution's log for speculative segments of up to `rows` tokens (none
    /// without speculation).
    fn conv_log_len(&self, rows: usize) -> usize {
        if rows == 0 {
            return 0;
        }
        let (channels, taps) = self.conv();
        channels * (taps - 1 + rows)
    }

    /// Floats of `S₀` (0 for a short convolution).
    fn state_len(&self) -> usize {
        match *self {
            RecurrentShape::DeltaNet { heads, dk, dv, .. } => heads * dk * dv,
            RecurrentShape::ShortConv { .. } => 0,
        }
    }

    /// Floats of the chunk in progress (0 for a short convolution).
    fn tail_len(&self, chunk: usize) -> usize {
        match *self {
            RecurrentShape::DeltaNet { heads, dk, dv, .. } => heads * chunk * (dk + dv + 1),
            RecurrentShape::ShortConv { .. } => 0,
        }
    }
}

/// Where one layer's parts sit inside a live slot (offsets in floats).
#[derive(Debug, Clone, Copy)]
pub struct LiveLayout {
    pub shape: RecurrentShape,
    /// `S₀`, `(heads, dk, dv)`.
    pub state: usize,
    /// The chunk's keys `(heads, chunk, dk)`, values `(heads, chunk, dv)`, decays `(heads, chunk)`.
    pub keys: usize,
    pub values: usize,
    pub decay: usize,
    /// The convolution's rows now, and at the anchor, `(taps - 1, channels)` each.
    pub conv: usize,
    pub conv_anchor: usize,
    /// The convolution's log for speculative decoding: the rows before the last speculative
    /// segment, then its input rows, `(taps - 1 + speculative_rows, channels)` (empty without
    /// speculation).
    pub conv_log: usize,
    /// The layer's first float in a snapshot (`S₀`, then the anchor's convolution rows).
    pub snapshot: usize,
}

/// The state of every recurrent layer of a model, for every running sequence, and snapshots of
/// anchors for the prefix cache (see the module documentation).
#[derive(Debug)]
pub struct StatePool {
    layers: Vec<LiveLayout>,
    /// Positions between two updates of a DeltaNet state (a multiple of the KV block size).
    chunk: usize,
    /// The longest speculative segment (the last sampled token and the proposals) the
    /// convolution logs hold; 0 without speculative decoding.
    speculative_rows: usize,
    live_stride: usize,
    snapshot_stride: usize,
    live: Vec<f32>,
    free_live: Vec<u32>,
    live_slots: usize,
    snapshots: Vec<f32>,
    /// Per snapshot slot: its hash and position when it holds one.
    snapshot_key: Vec<Option<(u64, usize)>>,
    /// Per snapshot slot: the use counter of its last store or restore (least recent is evicted).
    snapshot_used: Vec<u64>,
    index: HashMap<u64, u32>,
    clock: u64,
}

/// "No live slot": a segment of a model without recurrent layers.
pub const NO_SLOT: u32 = u32::MAX;

impl StatePool {
    /// The bytes of one live slot and of one snapshot for `layers` at `chunk`, with
    /// convolution logs for speculative segments of up to `speculative_rows` tokens (0 for
    /// none).
    pub fn slot_bytes(layers: &[RecurrentShape], chunk: usize, speculative_rows: usize) -> (u64, u64) {
        let live: usize = layers
            .iter()
            .map(|l| l.state_len() + l.tail_len(chunk) + 2 * l.conv_len() + l.conv_log_len(speculative_rows))
            .sum();
        let snapshot: usize = layers.iter().map(|l| l.state_len() + l.conv_len()).sum();
        (4 * live as u64, 4 * snapshot as u64)
    }

    /// `live_slots` live slots and `snapshot_slots` snapshots of `layers`' state, with
    /// convolution logs for speculative segments of up to `speculative_rows` tokens (0 for
    /// none). `CONFIG_INVALID` if the sizes overflow.
    pub fn new(
        layers: &[RecurrentShape],
        chunk: usize,
        live_slots: usize,
        snapshot_slots: usize,
        speculative_rows: usize,
    ) -> Result<Self> {
        let overflow = || {
            KylinError::config_invalid(format!(
                "a state pool of {live_slots} sequences and {snapshot_slots} snapshots overflows; pass a smaller --max-seqs or --state-snapshots"
            ))
        };
        let mut offset = 0usize;
        let mut snapshot = 0usize;
        let mut layout = Vec::with_capacity(layers.len());
        for &shape in layers {
            let (state, tail, conv) = (shape.state_len(), shape.tail_len(chunk), shape.conv_len());
            let log = shape.conv_log_len(speculative_rows);
            let (dk, dv, heads) = match shape {
                RecurrentShape::DeltaNet { heads, dk, dv, .. } => (dk, dv, heads),
                RecurrentShape::ShortConv { .. } => (0, 0, 0),
            };
            let l = LiveLayout {
                shape,
                state: offset,
                keys: offset + state,
                values: offset + state + heads * chunk * dk,
                decay: offset + state + heads * chunk * (dk + dv),
                conv: offset + state + tail,
                conv_anchor: offset + state + tail + conv,
                conv_log: offset + state + tail + 2 * conv,
                snapshot,
            };
            offset = offset.checked_add(state + tail + 2 * conv + log).ok_or_else(overflow)?;
            snapshot = snapshot.checked_add(state + conv).ok_or_else(overflow)?;
            layout.push(l);
        }
        let live_len = offset.checked_mul(live_slots).ok_or_else(overflow)?;
        let snapshot_len = snapshot.checked_mul(snapshot_slots).ok_or_else(overflow)?;
        if live_slots >= u32::MAX as usize || snapshot_slots >= u32::MAX as usize {
            return Err(overflow());
        }
        Ok(StatePool {
            layers: layout,
            chunk,
            speculative_rows,
            live_stride: offset,
            snapshot_stride: snapshot,
            live: vec![0.0; live_len],
            free_live: (0..live_slots as u32).rev().collect(),
            live_slots,
            snapshots: vec![0.0; snapshot_len],
            snapshot_key: vec![None; snapshot_slots],
            snapshot_used: vec![0; snapshot_slots],
            index: HashMap::with_capacity(snapshot_slots),
            clock: 0,
        })
    }

    /// The chunk length of the DeltaNet layers (anchors are at its multiples).
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// The longest speculative segment the convolution logs hold (0 without speculation).
    pub fn speculative_rows(&self) -> usize {
        self.speculative_rows
    }

    /// The layout of recurrent layer `layer` (in layer order) inside a live slot.
    pub fn layer(&self, layer: usize) -> &LiveLayout {
        &self.layers[layer]
    }

    /// Floats per live slot.
    pub fn live_stride(&self) -> usize {
        self.live_stride
    }

    /// Every live slot's floats, `(live_slots, live_stride)` (the forward pass splits them).
    pub fn live_mut(&mut self) -> &mut [f32] {
        &mut self.live
    }

    /// Bytes of the live slots and the snapshots.
    pub fn bytes(&self) -> u64 {
        4 * (self.live.len() + self.snapshots.len()) as u64
    }

    pub fn live_slots(&self) -> usize {
        self.live_slots
    }

    pub fn snapshot_slots(&self) -> usize {
        self.snapshot_key.len()
    }

    /// Live slots held by sequences now.
    pub fn live_in_use(&self) -> usize {
        self.live_slots - self.free_live.len()
    }

    /// Snapshots held now.
    pub fn snapshots_held(&self) -> usize {
        self.index.len()
    }

    /// Touches every page now (a server wants its memory resident from the start).
    pub fn prefault(&mut self) {
        for buffer in [&mut self.live, &mut self.snapshots] {
            for page in buffer.chunks_mut(1024) {
                // SAFETY: `page` is a non-empty slice, so its first element is valid for writes;
                // a volatile write keeps the compiler from dropping a store of zero.
                unsafe { std::ptr::write_volatile(page.as_mut_ptr(), 0.0) };
            }
        }
    }

    /// A live slot for a sequence starting from nothing (its state zeroed), or `None` when every
    /// slot is held (the engine holds at most `live_slots` running sequences, so it never is).
    pub fn allocate(&mut self) -> Option<u32> {
        let slot = self.free_live.pop()?;
        self.reset(slot);
        Some(slot)
    }

    /// Returns a live slot.
    pub fn release(&mut self, slot: u32) {
        debug_assert!(!self.free_live.contains(&slot), "state slot {slot} released twice");
        self.free_live.push(slot);
    }

    /// Zeroes what a sequence at position 0 reads: `S₀` and the convolution rows (the chunk in
    /// progress is empty at position 0).
    pub fn reset(&mut self, slot: u32) {
        let base = slot as usize * self.live_stride;
        for l in &self.layers {
            let (state, conv) = (l.shape.state_len(), l.shape.conv_len());
            self.live[base + l.state..base + l.state + state].fill(0.0);
            self.live[base + l.conv..base + l.conv + conv].fill(0.0);
            self.live[base + l.conv_anchor..base + l.conv_anchor + conv].fill(0.0);
        }
    }

    /// Copies live slot `from` to `to` (a sibling forked from a sequence shares its state).
    pub fn copy_live(&mut self, from: u32, to: u32) {
        let stride = self.live_stride;
        let src = from as usize * stride;
        self.live.copy_within(src..src + stride, to as usize * stride);
    }

    /// Whether a snapshot is registered under `hash` at `position`.
    pub fn has_snapshot(&self, hash: u64, position: usize) -> bool {
        self.index.get(&hash).is_some_and(|&s| self.snapshot_key[s as usize] == Some((hash, position)))
    }

    /// Stores live slot `slot`'s anchor, at `position`, as the snapshot of the prefix whose last
    /// block hashes to `hash`, evicting the least recently used snapshot if none is free. Does
    /// nothing when that snapshot is already held or there are no snapshot slots.
    pub fn store_snapshot(&mut self, slot: u32, hash: u64, position: usize) {
        if self.snapshot_key.is_empty() || self.has_snapshot(hash, position) {
            return;
        }
        // A free slot, else the least recently used.
        let target = match self.snapshot_key.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                let i = (0..self.snapshot_used.len()).min_by_key(|&i| self.snapshot_used[i]).unwrap_or(0);
                if let Some((old, _)) = self.snapshot_key[i].take() {
                    self.index.remove(&old);
                }
                i
            }
        };
        let live = slot as usize * self.live_stride;
        let snap = target * self.snapshot_stride;
        for l in &self.layers {
            let (state, conv) = (l.shape.state_len(), l.shape.conv_len());
            let at = snap + l.snapshot;
            self.snapshots[at..at + state].copy_from_slice(&self.live[live + l.state..live + l.state + state]);
            self.snapshots[at + state..at + state + conv]
                .copy_from_slice(&self.live[live + l.conv_anchor..live + l.conv_anchor + conv]);
        }
        self.clock += 1;
        self.snapshot_used[target] = self.clock;
        self.snapshot_key[target] = Some((hash, position));
        self.index.insert(hash, target as u32);
    }

    /// Puts the snapshot registered under `hash` at `position` into live slot `slot` (its
    /// anchor and its current state, with no chunk in progress); false when there is none.
    pub fn restore_snapshot(&mut self, hash: u64, position: usize, slot: u32) -> bool {
        if !self.has_snapshot(hash, position) {
            return false;
        }
        let Some(&target) = self.index.get(&hash) else { return false };
        let live = slot as usize * self.live_stride;
        let snap = target as usize * self.snapshot_stride;
        for l in &self.layers {
            let (state, conv) = (l.shape.state_len(), l.shape.conv_len());
            let at = snap + l.snapshot;
            self.live[live + l.state..live + l.state + state].copy_from_slice(&self.snapshots[at..at + state]);
            let rows = &self.snapshots[at + state..at + state + conv];
            self.live[live + l.conv..live + l.conv + conv].copy_from_slice(rows);
            self.live[live + l.conv_anchor..live + l.conv_anchor + conv].copy_from_slice(rows);
        }
        self.clock += 1;
        self.snapshot_used[target as usize] = self.clock;
        true
    }

    /// Puts live slot `slot`'s convolution rows back to where they were after the first `kept`
    /// positions its log holds (those from the log's start, `Segment::log_from`; at most the
    /// positions logged). `S₀` and the anchor need nothing: the engine lets no position that
    /// may be rejected complete a chunk.
    pub fn roll_back(&mut self, slot: u32, kept: usize) {
        debug_assert!(kept <= self.speculative_rows, "kept {kept} of a log of {}", self.speculative_rows);
        let live = slot as usize * self.live_stride;
        for l in &self.layers {
            let (channels, _) = l.shape.conv();
            let conv = l.shape.conv_len();
            let from = live + l.conv_log + kept * channels;
            self.live.copy_within(from..from + conv, live + l.conv);
        }
    }

    /// Puts live slot `slot` back to its own anchor (a rewind within the chunk in progress):
    /// the convolution rows at the anchor become the current ones; `S₀` is the anchor already.
    pub fn rewind_to_anchor(&mut self, slot: u32) {
        let live = slot as usize * self.live_stride;
        for l in &self.layers {
            let conv = l.shape.conv_len();
            self.live.copy_within(live + l.conv_anchor..live + l.conv_anchor + conv, live + l.conv);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shapes() -> Vec<RecurrentShape> {
        vec![
            RecurrentShape::DeltaNet { heads: 2, dk: 3, dv: 4, channels: 5, taps: 4 },
            RecurrentShape::ShortConv { channels: 6, taps: 3 },
        ]
    }

    #[test]
    fn sizes_add_up() {
        let (live, snap) = StatePool::slot_bytes(&shapes(), 8, 0);
        // DeltaNet: S 2·3·4, tail 2·8·(3+4+1), conv 2·3·5; short conv: 2·2·6.
        assert_eq!(live, 4 * (24 + 128 + 30 + 24));
        assert_eq!(snap, 4 * (24 + 15 + 12));
        let pool = StatePool::new(&shapes(), 8, 3, 5, 0).unwrap();
        assert_eq!(pool.bytes(), 3 * live + 5 * snap);
        // Logs for segments of 5 tokens: (3 + 5) rows of 5 and (2 + 5) rows of 6.
        let (spec_live, spec_snap) = StatePool::slot_bytes(&shapes(), 8, 5);
        assert_eq!((spec_live, spec_snap), (live + 4 * (40 + 42), snap));
        assert_eq!(StatePool::new(&shapes(), 8, 3, 5, 5).unwrap().bytes(), 3 * spec_live + 5 * snap);
    }

    #[test]
    fn roll_back_restores_the_rows_after_the_kept_tokens() {
        // Taps 4 (3 rows) over 5 channels, and taps 3 (2 rows) over 6; segments of up to 4.
        let mut pool = StatePool::new(&shapes(), 8, 1, 0, 4).unwrap();
        let slot = pool.allocate().unwrap();
        let stride = pool.live_stride();
        let base = slot as usize * stride;
        for layer in 0..2 {
            let l = *pool.layer(layer);
            let (channels, taps) = l.shape.conv();
            // The log: rows before the segment are 100, 101, 102 (row r filled with r), then the
            // segment's four input rows 103..=106.
            for r in 0..taps - 1 + 4 {
                pool.live[base + l.conv_log + r * channels..][..channels].fill(100.0 + r as f32);
            }
            pool.live[base + l.conv..base + l.conv + (taps - 1) * channels].fill(-1.0);
        }
        pool.roll_back(slot, 2);
        for layer in 0..2 {
            let l = *pool.layer(layer);
            let (channels, taps) = l.shape.conv();
            // Two kept tokens: the last taps - 1 rows up to the second input row (log row
            // taps - 1 + 1).
            let rows: Vec<f32> = (0..taps - 1).map(|r| pool.live[base + l.conv + r * channels]).collect();
            let want: Vec<f32> = (0..taps - 1).map(|r| 100.0 + (2 + r) as f32).collect();
            assert_eq!(rows, want, "layer {layer}");
        }
    }

    #[test]
    fn snapshots_round_trip_and_are_evicted_least_recent_first() {
        let mut pool = StatePool::new(&shapes(), 8, 2, 2, 0).unwrap();
        let a = pool.allocate().unwrap();
        let b = pool.allocate().unwrap();
        assert!(pool.allocate().is_none());
        let l0 = *pool.layer(0);
        let stride = pool.live_stride();
        pool.live[a as usize * stride + l0.state] = 1.5;
        pool.live[a as usize * stride + l0.conv_anchor] = 2.5;
        pool.store_snapshot(a, 11, 16);
        assert!(pool.has_snapshot(11, 16) && !pool.has_snapshot(11, 32));
        assert!(pool.restore_snapshot(11, 16, b));
        assert_eq!(pool.live[b as usize * stride + l0.state], 1.5);
        assert_eq!(pool.live[b as usize * stride + l0.conv], 2.5);
        pool.store_snapshot(a, 12, 32);
        // 11 was used (restored) before 12 was stored: a third evicts 11.
        pool.store_snapshot(a, 13, 48);
        assert!(!pool.has_snapshot(11, 16) && pool.has_snapshot(12, 32) && pool.has_snapshot(13, 48));
        pool.release(a);
        pool.release(b);
        assert_eq!(pool.live_in_use(), 0);
    }
}
