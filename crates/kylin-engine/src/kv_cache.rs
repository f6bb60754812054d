//! The key/value cache: f32 keys and values of every layer for every position processed so far.
//!
//! Layout per layer: `[kv_head][position][head_dim]`, so the keys (and values) of one KV head are
//! one contiguous `(len, head_dim)` block, which is what attention reads in decode.
//!
//! Guarantees: the whole cache is allocated once, from the model's dimensions and the planned
//! context size; appending and reading never allocate. The pages are zeroed lazily by the
//! operating system, so memory is only touched for positions actually used.

use kylin_loader::{KylinError, Result};

/// Keys and values for `n_layers` layers, `n_kv_heads` heads, `capacity` positions.
#[derive(Debug)]
pub struct KvCache {
    n_kv_heads: usize,
    head_dim: usize,
    capacity: usize,
    /// Elements per layer: `n_kv_heads * capacity * head_dim`.
    layer_stride: usize,
    /// Elements per KV head: `capacity * head_dim`.
    head_stride: usize,
    keys: Vec<f32>,
    values: Vec<f32>,
}

impl KvCache {
    /// Plans the cache; `CONFIG_INVALID` if its size overflows.
    pub fn new(n_layers: usize, n_kv_heads: usize, head_dim: usize, capacity: usize) -> Result<Self> {
        let overflow = || {
            KylinError::config_invalid(format!(
                "KV cache of {n_layers} layers x {n_kv_heads} KV heads x {capacity} positions x {head_dim} overflows; \
                 pass a smaller --ctx-size"
            ))
        };
        let head_stride = capacity.checked_mul(head_dim).ok_or_else(overflow)?;
        let layer_stride = head_stride.checked_mul(n_kv_heads).ok_or_else(overflow)?;
        let total = layer_stride.checked_mul(n_layers).ok_or_else(overflow)?;
        Ok(KvCache {
            n_kv_heads,
            head_dim,
            capacity,
            layer_stride,
            head_stride,
            keys: vec![0.0; total],
            values: vec![0.0; total],
        })
    }

    /// Positions the cache holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes allocated for keys and values together.
    pub fn bytes(&self) -> usize {
        (self.keys.len() + self.values.len()) * std::mem::size_of::<f32>()
    }

    /// Stores the keys and values of `n` consecutive positions starting at `start` for `layer`.
    ///
    /// `k` and `v` are `(n, n_kv_heads * head_dim)` row-major, as the projections produce them;
    /// they are scattered to `(n_kv_heads, position, head_dim)`. The caller guarantees
    /// `start + n <= capacity`.
    pub fn store(&mut self, layer: usize, start: usize, k: &[f32], v: &[f32]) {
        let hd = self.head_dim;
        let row = self.n_kv_heads * hd;
        let base = layer * self.layer_stride;
        for (t, (k_row, v_row)) in k.chunks_exact(row).zip(v.chunks_exact(row)).enumerate() {
            let pos = start + t;
            for h in 0..self.n_kv_heads {
                let dst = base + h * self.head_stride + pos * hd;
                self.keys[dst..dst + hd].copy_from_slice(&k_row[h * hd..(h + 1) * hd]);
                self.values[dst..dst + hd].copy_from_slice(&v_row[h * hd..(h + 1) * hd]);
            }
        }
    }

    /// Keys of `layer`, KV head `head`, positions `0..len`: `(len, head_dim)` row-major.
    #[inline]
    pub fn keys(&self, layer: usize, head: usize, len: usize) -> &[f32] {
        let start = layer * self.layer_stride + head * self.head_stride;
        &self.keys[start..start + len * self.head_dim]
    }

    /// Values of `layer`, KV head `head`, positions `0..len`: `(len, head_dim)` row-major.
    #[inline]
    pub fn values(&self, layer: usize, head: usize, len: usize) -> &[f32] {
        let start = layer * self.layer_stride + head * self.head_stride;
        &self.values[start..start + len * self.head_dim]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_scatters_heads_to_contiguous_blocks() {
        let mut cache = KvCache::new(2, 2, 3, 4).unwrap();
        // Two positions of layer 1: (2 tokens, 2 heads * 3).
        let k = [1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12.];
        let v: Vec<f32> = k.iter().map(|x| -x).collect();
        cache.store(1, 1, &k, &v);
        assert_eq!(cache.keys(1, 0, 3), &[0., 0., 0., 1., 2., 3., 7., 8., 9.]);
        assert_eq!(cache.keys(1, 1, 3), &[0., 0., 0., 4., 5., 6., 10., 11., 12.]);
        assert_eq!(cache.values(1, 1, 3)[3..], [-4., -5., -6., -10., -11., -12.]);
        assert!(cache.keys(0, 0, 4).iter().all(|&x| x == 0.0), "layer 0 untouched");
    }

    #[test]
    fn oversized_cache_is_an_error_not_a_panic() {
        let err = KvCache::new(usize::MAX, 2, 64, 4096).unwrap_err();
        assert_eq!(err.code(), kylin_loader::ErrorCode::ConfigInvalid);
    }
}
