//! Next-token sampling with Hugging Face `generate` semantics.
//!
//! The order is HF's: repetition penalty (over every id seen: prompt and generated), then
//! temperature, top-k, top-p, min-p, then a draw from the remaining distribution with a seeded
//! PRNG, so the same seed gives the same ids. Temperature 0 is greedy: the argmax, lowest id on
//! ties, as `torch.argmax`.
//!
//! Guarantee: [`Sampler::new`] allocates every buffer once (sized by the vocabulary);
//! [`Sampler::sample`] and [`Sampler::observe`] never allocate.

use kylin_loader::{GenerationDefaults, KylinError, Result};
use serde::Serialize;

/// How to pick the next token. `Default` is greedy with no penalty.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (ties at the boundary kept, as HF); 0 turns it off.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability mass is at least `top_p`;
    /// 1 turns it off.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the most likely one's; 0 turns it off.
    pub min_p: f32,
    /// HF's repetition penalty: a seen token's positive logit is divided by it, a negative one
    /// multiplied; 1 turns it off.
    pub repetition_penalty: f32,
    /// OpenAI's presence penalty: subtracted once from the logit of every id generated so far;
    /// 0 turns it off.
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty: subtracted from a generated id's logit once per occurrence;
    /// 0 turns it off.
    pub frequency_penalty: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams::greedy()
    }
}

/// HF's `top_k` when `do_sample` is true and the file does not set it.
pub const HF_DEFAULT_TOP_K: usize = 50;

impl SamplingParams {
    /// Argmax decoding, no penalty.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }

    /// The model's published defaults with HF `generate` semantics:
    ///
    /// * `do_sample` absent or false: greedy (temperature 0), whatever temperature/top-k/top-p
    ///   the file lists (HF ignores them too).
    /// * `do_sample: true`: sample with the file's `temperature` (default 1.0), `top_k` (HF's
    ///   default 50), `top_p` (default 1.0) and `min_p` (default off).
    /// * `repetition_penalty` applies in both modes (default 1.0, off).
    ///
    /// The seed is 0; callers set it from `--seed`.
    pub fn from_defaults(defaults: &GenerationDefaults) -> Self {
        let mut p = SamplingParams::greedy();
        p.repetition_penalty = defaults.repetition_penalty.unwrap_or(1.0);
        if defaults.do_sample == Some(true) {
            p.temperature = defaults.temperature.unwrap_or(1.0);
            p.top_k = defaults.top_k.unwrap_or(HF_DEFAULT_TOP_K);
            p.top_p = defaults.top_p.unwrap_or(1.0);
            p.min_p = defaults.min_p.unwrap_or(0.0);
        }
        p
    }

    /// True when the next token is the argmax (temperature 0 or top-k 1).
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == 1
    }

    /// Checks the values are in range; `INPUT_INVALID` naming the bad one otherwise.
    pub fn validate(&self) -> Result<()> {
        let bad = |name: &'static str, v: f32, want: &str| {
            Err(KylinError::input_invalid(format!("sampling parameter {name} = {v} is out of range; expected {want}"))
                .for_field(name))
        };
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad("temperature", self.temperature, "a finite value >= 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", self.top_p, "a value in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", self.min_p, "a value in [0, 1]");
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad("repetition_penalty", self.repetition_penalty, "a finite value > 0");
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return bad("presence_penalty", self.presence_penalty, "a value in [-2, 2]");
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return bad("frequency_penalty", self.frequency_penalty, "a value in [-2, 2]");
        }
        Ok(())
    }
}

/// A small, fast, seedable PRNG (xoshiro256**, seeded through SplitMix64).
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Rng { s: [next(), next(), next(), next()] }
    }

    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Picks tokens from logits. Owns all its scratch memory.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    vocab: usize,
    /// Working copy of the logits, modified by the penalty and the warpers.
    logits: Vec<f32>,
    /// Candidate ids; the first `n` are alive.
    idx: Vec<u32>,
    /// `seen[id]`: the id is in the prompt or the generated text (for the repetition penalty).
    seen: Vec<bool>,
    /// The ids with `seen` set, to apply the penalty without scanning the vocabulary.
    /// Its capacity is the vocabulary size, and ids are unique, so it never reallocates.
    seen_ids: Vec<u32>,
    /// `generated[id]`: how often the id was generated (for the presence and frequency penalties).
    generated: Vec<u32>,
    /// The ids with a non-zero `generated` count; capacity the vocabulary size, never reallocates.
    generated_ids: Vec<u32>,
    rng: Rng,
}

impl Sampler {
    /// Allocates the scratch buffers for `vocab_size` logits.
    pub fn new(vocab_size: usize, params: SamplingParams) -> Self {
        Sampler {
            params,
            vocab: vocab_size,
            logits: vec![0.0; vocab_size],
            idx: vec![0; vocab_size],
            seen: vec![false; vocab_size],
            seen_ids: Vec::with_capacity(vocab_size),
            generated: vec![0; vocab_size],
            generated_ids: Vec::with_capacity(vocab_size),
            rng: Rng::new(params.seed),
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Forgets the seen ids (the repetition penalty's history).
    pub fn clear_history(&mut self) {
        for &id in &self.seen_ids {
            self.seen[id as usize] = false;
        }
        self.seen_ids.clear();
        for &id in &self.generated_ids {
            self.generated[id as usize] = 0;
        }
        self.generated_ids.clear();
    }

    /// Records `id` as seen (prompt or generated). Ids outside the vocabulary are ignored.
    pub fn observe(&mut self, id: u32) {
        if let Some(s) = self.seen.get_mut(id as usize)
            && !*s
        {
            *s = true;
            self.seen_ids.push(id);
        }
    }

    /// Records a generated `id`: seen (repetition penalty) and counted (presence and frequency
    /// penalties). Ids outside the vocabulary are ignored.
    pub fn observe_generated(&mut self, id: u32) {
        self.observe(id);
        if let Some(count) = self.generated.get_mut(id as usize) {
            if *count == 0 {
                self.generated_ids.push(id);
            }
            *count = count.saturating_add(1);
        }
    }

    pub fn observe_all(&mut self, ids: &[u32]) {
        for &id in ids {
            self.observe(id);
        }
    }

    /// Picks the next token from `logits` (one row of `vocab_size` values).
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        self.sample_with(logits, |_| Ok(()))
    }

    /// Picks the next token after `adjust` has changed the sampler's copy of the logits (a
    /// logit bias, a grammar's mask setting forbidden ids to `-inf`); `logits` itself is not
    /// changed. Allocates nothing.
    pub fn sample_with(&mut self, logits: &[f32], adjust: impl FnOnce(&mut [f32]) -> Result<()>) -> Result<u32> {
        if logits.len() != self.vocab {
            return Err(KylinError::input_invalid(format!(
                "the sampler was built for {} logits but got {}",
                self.vocab,
                logits.len()
            )));
        }
        if self.vocab == 0 {
            return Err(KylinError::input_invalid("cannot sample from an empty vocabulary"));
        }
        let p = self.params;
        // NaN never wins: it becomes -inf.
        for (dst, &src) in self.logits.iter_mut().zip(logits) {
            *dst = if src.is_nan() { f32::NEG_INFINITY } else { src };
        }
        adjust(&mut self.logits)?;

        // 1. Repetition penalty (HF RepetitionPenaltyLogitsProcessor), once per distinct id.
        if p.repetition_penalty != 1.0 {
            for &id in &self.seen_ids {
                let l = &mut self.logits[id as usize];
                *l = if *l < 0.0 { *l * p.repetition_penalty } else { *l / p.repetition_penalty };
            }
        }

        // 1b. OpenAI's presence and frequency penalties over the generated ids.
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for &id in &self.generated_ids {
                let count = self.generated[id as usize] as f32;
                self.logits[id as usize] -= p.presence_penalty + p.frequency_penalty * count;
            }
        }

        if p.is_greedy() {
            return Ok(argmax(&self.logits));
        }

        // 2. Temperature.
        if p.temperature != 1.0 {
            for l in &mut self.logits {
                *l /= p.temperature;
            }
        }

        let logits = &self.logits;
        let desc = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then_with(|| a.cmp(b));
        for (i, slot) in self.idx.iter_mut().enumerate() {
            *slot = i as u32;
        }
        let mut n = self.vocab;

        // 3. Top-k: keep every token whose logit is >= the k-th largest (HF keeps ties).
        if p.top_k > 0 && p.top_k < n {
            let k = p.top_k;
            self.idx.select_nth_unstable_by(k - 1, desc);
            let threshold = logits[self.idx[k - 1] as usize];
            let mut kept = k;
            for j in k..n {
                if logits[self.idx[j] as usize] >= threshold {
                    self.idx.swap(kept, j);
                    kept += 1;
                }
            }
            n = kept;
        }

        let alive = &mut self.idx[..n];
        let max = alive.iter().map(|&i| logits[i as usize]).fold(f32::NEG_INFINITY, f32::max);
        if max == f32::NEG_INFINITY {
            // Every logit is -inf or NaN: there is no distribution; fall back to the argmax.
            return Ok(argmax(logits));
        }

        // Normaliser of the distribution after top-k (what top-p measures mass against).
        let z: f64 = alive.iter().map(|&i| f64::from(logits[i as usize] - max).exp()).sum();

        // 5 (done first, same result). Min-p keeps tokens with p >= min_p * p_max, i.e.
        // exp(l - max) >= min_p. Top-p and min-p each keep a prefix of the sorted candidates, so
        // their intersection does not depend on the order; top-p still measures mass against the
        // distribution before min-p, as HF does. Filtering first keeps the sort below short.
        if p.min_p > 0.0 {
            let min_p = f64::from(p.min_p);
            let mut kept = 0;
            for j in 0..n {
                let id = alive[j];
                if f64::from(logits[id as usize] - max).exp() >= min_p {
                    alive.swap(kept, j);
                    kept += 1;
                }
            }
            n = kept;
        }

        // 4. Top-p: the smallest prefix of the sorted candidates whose mass reaches top_p.
        if p.top_p < 1.0 {
            let alive = &mut self.idx[..n];
            alive.sort_unstable_by(desc);
            let top_p = f64::from(p.top_p);
            let mut cumulative = 0.0f64;
            let mut kept = n;
            for (j, &id) in alive.iter().enumerate() {
                cumulative += f64::from(logits[id as usize] - max).exp() / z;
                if cumulative >= top_p {
                    kept = j + 1;
                    break;
                }
            }
            n = kept.max(1);
        }

        // 6. Draw from the remaining tokens, renormalised.
        let alive = &self.idx[..n];
        let total: f64 = alive.iter().map(|&i| f64::from(logits[i as usize] - max).exp()).sum();
        let target = self.rng.next_f64() * total;
        let mut cumulative = 0.0f64;
        for &id in alive {
            cumulative += f64::from(logits[id as usize] - max).exp();
            if cumulative > target {
                return Ok(id);
            }
        }
        // Rounding left the target at the very end: the last candidate.
        Ok(alive[n - 1])
    }
}

/// Index of the largest value, lowest index on ties (as `torch.argmax`).
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_value = f32::NEG_INFINITY;
    for (i, &v) in values.iter().enumerate() {
        if v > best_value {
            best = i;
            best_value = v;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
        SamplingParams { temperature, top_k, top_p, min_p, seed: 7, ..SamplingParams::greedy() }
    }

    /// Logits whose softmax is exactly `probs`.
    fn logits_of(probs: &[f64]) -> Vec<f32> {
        probs.iter().map(|p| p.ln() as f32).collect()
    }

    /// The set of ids drawn over many samples.
    fn support(sampler: &mut Sampler, logits: &[f32], draws: usize) -> Vec<u32> {
        let mut seen = vec![false; logits.len()];
        for _ in 0..draws {
            seen[sampler.sample(logits).unwrap() as usize] = true;
        }
        (0..logits.len() as u32).filter(|&i| seen[i as usize]).collect()
    }

    #[test]
    fn greedy_is_argmax_with_lowest_id_on_ties() {
        let mut s = Sampler::new(5, SamplingParams::greedy());
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 3.0, 2.9]).unwrap(), 1);
        assert_eq!(s.sample(&[f32::NAN, -2.0, -1.0, -1.0, -5.0]).unwrap(), 2);
    }

    #[test]
    fn top_k_one_is_argmax_even_at_high_temperature() {
        let mut s = Sampler::new(4, params(5.0, 1, 1.0, 0.0));
        for _ in 0..50 {
            assert_eq!(s.sample(&[1.0, 2.0, 4.0, 3.9]).unwrap(), 2);
        }
    }

    #[test]
    fn top_k_keeps_the_k_best() {
        let logits = logits_of(&[0.1, 0.4, 0.2, 0.3]);
        let mut s = Sampler::new(4, params(1.0, 2, 1.0, 0.0));
        assert_eq!(support(&mut s, &logits, 500), vec![1, 3]);
    }

    #[test]
    fn top_p_keeps_smallest_set_reaching_the_mass() {
        // Sorted: 0.5 (id 2), 0.3 (id 0), 0.15 (id 3), 0.05 (id 1).
        let logits = logits_of(&[0.3, 0.05, 0.5, 0.15]);
        // p = 0.75: 0.5 < 0.75, 0.8 >= 0.75 → {2, 0}.
        let mut s = Sampler::new(4, params(1.0, 0, 0.75, 0.0));
        assert_eq!(support(&mut s, &logits, 500), vec![0, 2]);
        // p = 0.85: needs 0.95 → {2, 0, 3}.
        let mut s = Sampler::new(4, params(1.0, 0, 0.85, 0.0));
        assert_eq!(support(&mut s, &logits, 1000), vec![0, 2, 3]);
        // p tiny: the best token alone.
        let mut s = Sampler::new(4, params(1.0, 0, 0.01, 0.0));
        assert_eq!(support(&mut s, &logits, 100), vec![2]);
    }

    #[test]
    fn min_p_drops_tokens_below_a_fraction_of_the_best() {
        // p_max = 0.5; min_p 0.35 → threshold 0.175: keeps 0.5 and 0.3.
        let logits = logits_of(&[0.3, 0.05, 0.5, 0.15]);
        let mut s = Sampler::new(4, params(1.0, 0, 1.0, 0.35));
        assert_eq!(support(&mut s, &logits, 500), vec![0, 2]);
        // min_p 0.25 → threshold 0.125: keeps 0.15 too.
        let mut s = Sampler::new(4, params(1.0, 0, 1.0, 0.25));
        assert_eq!(support(&mut s, &logits, 1000), vec![0, 2, 3]);
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative() {
        let mut p = SamplingParams::greedy();
        p.repetition_penalty = 2.0;
        let mut s = Sampler::new(3, p);
        // Id 0 seen: 3.0 → 1.5, loses to id 1 (2.0).
        s.observe(0);
        assert_eq!(s.sample(&[3.0, 2.0, -1.0]).unwrap(), 1);
        // Id 1 seen too (once or twice, same effect): -1.0 → -2.0 and 2.0 → 1.0; 1.5 wins.
        s.observe_all(&[1, 1]);
        assert_eq!(s.sample(&[3.0, 2.0, -1.0]).unwrap(), 0);
        // Negative logits get more negative: id 0 at -1 → -2 loses to id 2 at -1.5.
        assert_eq!(s.sample(&[-1.0, -3.0, -1.5]).unwrap(), 2);
        s.clear_history();
        assert_eq!(s.sample(&[-1.0, -3.0, -1.5]).unwrap(), 0);
    }

    #[test]
    fn same_seed_same_ids_other_seed_differs() {
        let logits = logits_of(&[0.2, 0.2, 0.2, 0.2, 0.2]);
        let run = |seed| {
            let mut p = params(1.0, 0, 1.0, 0.0);
            p.seed = seed;
            let mut s = Sampler::new(5, p);
            (0..64).map(|_| s.sample(&logits).unwrap()).collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
    }

    #[test]
    fn temperature_one_frequencies_follow_softmax() {
        let probs = [0.1, 0.2, 0.3, 0.4];
        let logits = logits_of(&probs);
        let mut s = Sampler::new(4, params(1.0, 0, 1.0, 0.0));
        let draws = 20_000;
        let mut counts = [0usize; 4];
        for _ in 0..draws {
            counts[s.sample(&logits).unwrap() as usize] += 1;
        }
        let chi2: f64 = counts
            .iter()
            .zip(probs)
            .map(|(&c, p)| {
                let e = p * draws as f64;
                (c as f64 - e).powi(2) / e
            })
            .sum();
        // 3 degrees of freedom: p = 0.001 at 16.27.
        assert!(chi2 < 16.27, "chi-square {chi2} for counts {counts:?}");
    }

    #[test]
    fn temperature_sharpens_the_distribution() {
        // At T = 0.5, p ∝ p^2: [0.01, 0.04, 0.09, 0.16] / 0.30.
        let probs = [0.1, 0.2, 0.3, 0.4];
        let logits = logits_of(&probs);
        let mut s = Sampler::new(4, params(0.5, 0, 1.0, 0.0));
        let draws = 20_000;
        let mut counts = [0usize; 4];
        for _ in 0..draws {
            counts[s.sample(&logits).unwrap() as usize] += 1;
        }
        let expected = [0.01 / 0.3, 0.04 / 0.3, 0.09 / 0.3, 0.16 / 0.3];
        let chi2: f64 =
            counts.iter().zip(expected).map(|(&c, p)| (c as f64 - p * draws as f64).powi(2) / (p * draws as f64)).sum();
        assert!(chi2 < 16.27, "chi-square {chi2} for counts {counts:?}");
    }

    #[test]
    fn defaults_follow_hf_do_sample_rule() {
        let mut g =
            GenerationDefaults { temperature: Some(0.6), top_k: Some(20), top_p: Some(0.95), ..Default::default() };
        // No do_sample: greedy even though temperature is listed.
        assert!(SamplingParams::from_defaults(&g).is_greedy());
        g.do_sample = Some(true);
        let p = SamplingParams::from_defaults(&g);
        assert_eq!((p.temperature, p.top_k, p.top_p, p.min_p), (0.6, 20, 0.95, 0.0));
        let p = SamplingParams::from_defaults(&GenerationDefaults { do_sample: Some(true), ..Default::default() });
        assert_eq!((p.temperature, p.top_k, p.top_p), (1.0, 50, 1.0));
    }

    #[test]
    fn wrong_length_is_an_error_not_a_panic() {
        let mut s = Sampler::new(3, SamplingParams::greedy());
        assert!(s.sample(&[1.0, 2.0]).is_err());
    }
}
