//! A small deterministic generator (xorshift64*) for the kernel tests.
#![allow(dead_code)]

use kylin_kernels::WeightDType;

pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Mixed signs and magnitudes: a value in [-1, 1) scaled by 2^e, e in -8..8.
    pub fn next_f32(&mut self) -> f32 {
        let bits = self.next_u64();
        let unit = (bits >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
        let exp = (bits & 15) as i32 - 8;
        unit * 2f32.powi(exp)
    }

    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next_f32()).collect()
    }

    /// `n` values encoded as little-endian `dtype` bytes.
    pub fn weights(&mut self, dtype: WeightDType, n: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(n * dtype.size_in_bytes());
        for _ in 0..n {
            let v = self.next_f32();
            match dtype {
                WeightDType::F32 => out.extend_from_slice(&v.to_le_bytes()),
                WeightDType::F16 => out.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
                WeightDType::BF16 => out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
            }
        }
        out
    }

    /// `n` BF16 values as little-endian bytes.
    pub fn bf16_weights(&mut self, n: usize) -> Vec<u8> {
        self.weights(WeightDType::BF16, n)
    }
}
