//! The linear-attention kernels (`kylin_kernels::delta`): the chunked delta rule against the
//! token-by-token recurrence in f64, on odd head widths and chunk sizes; the same bits for every
//! split of a sequence into calls (one token at a time, one call, random pieces), on the
//! dispatched and the portable path; the two paths within rounding of each other; the causal
//! convolution against its definition, continued across calls, with its anchors.

use kylin_kernels::delta::{
    DeltaDims, DeltaState, DeltaTokens, causal_conv1d, delta_rule, delta_rule_portable, l2_normalize,
};
use kylin_kernels::{WeightDType, WeightMatrix, WeightVector, reference};

/// A small deterministic generator (xorshift64*), values in [-1, 1).
struct Rng(u64);

impl Rng {
    fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let v = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
        v as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next_f32()).collect()
    }

    fn below(&mut self, n: usize) -> usize {
        ((self.next_f32() + 1.0) * 0.5 * n as f32) as usize % n.max(1)
    }
}

/// One head's inputs for `n` tokens: normalised queries (scaled) and keys, values, decays in
/// (-3, 0) and write strengths in (0, 1), as the mixer prepares them.
struct Inputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
}

fn inputs(rng: &mut Rng, n: usize, dk: usize, dv: usize) -> Inputs {
    let mut q = rng.vec(n * dk);
    let mut k = rng.vec(n * dk);
    for t in 0..n {
        l2_normalize(&mut q[t * dk..(t + 1) * dk], 1e-6);
        l2_normalize(&mut k[t * dk..(t + 1) * dk], 1e-6);
        for x in &mut q[t * dk..(t + 1) * dk] {
            *x /= (dk as f32).sqrt();
        }
    }
    let v = rng.vec(n * dv);
    let g: Vec<f32> = (0..n).map(|_| -1.5 * (rng.next_f32() + 1.0)).collect();
    let beta: Vec<f32> = (0..n).map(|_| 0.5 * (rng.next_f32() + 1.0)).collect();
    Inputs { q, k, v, g, beta }
}

/// A head's state buffers: `S₀`, the tail's keys, values and decays.
struct State {
    s: Vec<f32>,
    keys: Vec<f32>,
    values: Vec<f32>,
    decay: Vec<f32>,
}

impl State {
    fn new(d: DeltaDims) -> State {
        State {
            s: vec![0.0; d.dk * d.dv],
            keys: vec![0.0; d.chunk * d.dk],
            values: vec![0.0; d.chunk * d.dv],
            decay: vec![0.0; d.chunk],
        }
    }
}

type Kernel = fn(DeltaDims, usize, &DeltaTokens<'_>, &mut DeltaState<'_>, &mut [f32]);

/// Runs the kernel over the inputs in calls of the given lengths; returns the outputs and
/// the final state.
fn run_split(kernel: Kernel, d: DeltaDims, x: &Inputs, pieces: &[usize]) -> (Vec<f32>, State) {
    let n = x.g.len();
    let mut st = State::new(d);
    let mut out = vec![0.0f32; n * d.dv];
    // The kernel takes one stride for q, k and v: interleave them as the mixer's rows are.
    let stride = 2 * d.dk + d.dv;
    let mut rows = vec![0.0f32; n * stride];
    for t in 0..n {
        rows[t * stride..t * stride + d.dk].copy_from_slice(&x.q[t * d.dk..(t + 1) * d.dk]);
        rows[t * stride + d.dk..t * stride + 2 * d.dk].copy_from_slice(&x.k[t * d.dk..(t + 1) * d.dk]);
        rows[t * stride + 2 * d.dk..(t + 1) * stride].copy_from_slice(&x.v[t * d.dv..(t + 1) * d.dv]);
    }
    let mut start = 0;
    for &len in pieces {
        let base = start * stride;
        let tokens = DeltaTokens {
            n: len,
            q: &rows[base..],
            k: &rows[base + d.dk..],
            v: &rows[base + 2 * d.dk..],
            qkv_stride: stride,
            g: &x.g[start..],
            beta: &x.beta[start..],
            gate_stride: 1,
        };
        let mut state = DeltaState { s: &mut st.s, keys: &mut st.keys, values: &mut st.values, decay: &mut st.decay };
        kernel(d, start, &tokens, &mut state, &mut out[start * d.dv..(start + len) * d.dv]);
        start += len;
    }
    assert_eq!(start, n);
    (out, st)
}

fn recurrent(d: DeltaDims, x: &Inputs) -> Vec<f32> {
    let mut s = vec![0.0f64; d.dk * d.dv];
    let mut out = vec![0.0f32; x.g.len() * d.dv];
    reference::delta_rule_recurrent(d.dk, d.dv, &x.q, &x.k, &x.v, &x.g, &x.beta, &mut s, &mut out);
    out
}

const SHAPES: [(usize, usize, usize); 6] =
    [(13, 19, 1), (13, 19, 3), (16, 16, 16), (24, 9, 7), (128, 128, 32), (64, 96, 16)];

#[test]
fn chunked_delta_rule_matches_the_recurrence() {
    let mut rng = Rng(0x5eed);
    for (dk, dv, chunk) in SHAPES {
        let d = DeltaDims { dk, dv, chunk };
        for n in [1usize, 5, 37, 100] {
            let x = inputs(&mut rng, n, dk, dv);
            let want = recurrent(d, &x);
            for kernel in [delta_rule as Kernel, delta_rule_portable as Kernel] {
                let (got, _) = run_split(kernel, d, &x, &[n]);
                let diff = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
                assert!(diff < 2e-5, "dk {dk} dv {dv} chunk {chunk} n {n}: max difference {diff}");
            }
        }
    }
}

/// Every split of a sequence into calls gives the same outputs and the same final state, bit
/// for bit, on both paths.
#[test]
fn every_split_gives_the_same_bits() {
    let mut rng = Rng(0xc0ffee);
    for (dk, dv, chunk) in SHAPES {
        let d = DeltaDims { dk, dv, chunk };
        let n = 90;
        let x = inputs(&mut rng, n, dk, dv);
        for kernel in [delta_rule as Kernel, delta_rule_portable as Kernel] {
            let (whole, whole_state) = run_split(kernel, d, &x, &[n]);
            let ones = vec![1usize; n];
            let mut random = Vec::new();
            let mut left = n;
            while left > 0 {
                let len = 1 + rng.below(left.min(23));
                random.push(len);
                left -= len;
            }
            for pieces in [ones, random, vec![40, 50], vec![chunk.min(n), n - chunk.min(n)]] {
                let pieces: Vec<usize> = pieces.into_iter().filter(|&p| p > 0).collect();
                let (got, state) = run_split(kernel, d, &x, &pieces);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&whole), "dk {dk} dv {dv} chunk {chunk}: outputs of split {pieces:?}");
                assert_eq!(bits(&state.s), bits(&whole_state.s), "state of split {pieces:?}");
                let tail = n % chunk;
                assert_eq!(bits(&state.values[..tail * dv]), bits(&whole_state.values[..tail * dv]));
            }
        }
    }
}

/// The dispatched (AVX2 where the CPU has it) and portable paths agree within rounding.
#[test]
fn dispatched_and_portable_paths_agree() {
    let mut rng = Rng(42);
    for (dk, dv, chunk) in SHAPES {
        let d = DeltaDims { dk, dv, chunk };
        let x = inputs(&mut rng, 77, dk, dv);
        let (a, _) = run_split(delta_rule, d, &x, &[77]);
        let (b, _) = run_split(delta_rule_portable, d, &x, &[77]);
        let diff = a.iter().zip(&b).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(diff < 1e-5, "dk {dk} dv {dv} chunk {chunk}: paths differ by {diff}");
    }
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect()
}

/// The convolution against its definition over a zero history, continued across calls of odd
/// lengths (the state carries the history), with the anchor at a row inside a call.
#[test]
fn causal_conv_matches_its_definition_across_calls() {
    let mut rng = Rng(7);
    for (channels, taps, silu) in [(13usize, 4usize, true), (70, 3, false), (129, 1, true), (5, 6, false)] {
        let n = 29;
        let x = rng.vec(n * channels);
        let w = rng.vec(channels * taps);
        let bias = rng.vec(channels);
        let wb = bf16_bytes(&w);
        let bb = bf16_bytes(&bias);
        let weight = WeightMatrix { dtype: WeightDType::BF16, rows: channels, cols: taps, data: &wb };
        let bias_v = WeightVector { dtype: WeightDType::BF16, data: &bb };
        let wf = |c: usize, j: usize| reference::load_f32(WeightDType::BF16, &wb, c * taps + j);
        let mut want = vec![0.0f32; n * channels];
        for t in 0..n {
            for c in 0..channels {
                let mut acc = bias_v.get(c);
                for j in 0..taps {
                    let r = t as isize - (taps as isize - 1) + j as isize;
                    let input = if r < 0 { 0.0 } else { x[r as usize * channels + c] };
                    acc += wf(c, j) * input;
                }
                want[t * channels + c] = if silu { acc / (1.0 + (-acc).exp()) } else { acc };
            }
        }
        let hist = taps - 1;
        let mut state = vec![0.0f32; hist * channels];
        let mut out = vec![0.0f32; n * channels];
        let mut anchor = vec![0.0f32; hist * channels];
        let mut start = 0;
        for len in [1usize, 2, 7, 19] {
            let r = 1.min(len);
            let a = (start == 3).then_some((r, anchor.as_mut_slice()));
            causal_conv1d(
                &x[start * channels..],
                len,
                channels,
                weight,
                Some(bias_v),
                silu,
                &mut state,
                a,
                &mut out[start * channels..(start + len) * channels],
            );
            start += len;
        }
        assert_eq!(start, n);
        // The sums are the definition's operations in its order; SiLU's exponential is the
        // kernels' (within 2 ulp of the reference's).
        for (i, (got, want)) in out.iter().zip(&want).enumerate() {
            let tol = if silu { 4.0 * f32::EPSILON * want.abs().max(1.0) } else { 0.0 };
            assert!((got - want).abs() <= tol, "channels {channels} taps {taps}: element {i}: {got} against {want}");
        }
        // The state holds the last taps - 1 inputs; the anchor the taps - 1 inputs before
        // position 4 (row 1 of the call starting at 3).
        for i in 0..hist {
            assert_eq!(
                &state[i * channels..(i + 1) * channels],
                &x[(n - hist + i) * channels..(n - hist + i + 1) * channels]
            );
            let p = 4 - hist as isize + i as isize;
            let expected: Vec<f32> = if p < 0 {
                vec![0.0; channels]
            } else {
                x[p as usize * channels..(p as usize + 1) * channels].to_vec()
            };
            assert_eq!(&anchor[i * channels..(i + 1) * channels], expected.as_slice());
        }
    }
}
