//! The multi-token-prediction proposer of speculative decoding: the MTP head a Qwen3.5,
//! Qwen3.5-MoE or Qwen3-Next checkpoint ships (`mtp.*`, bound by [`kylin_loader::mtp`], run
//! by [`crate::model::MtpHead`]) with keys and values of its own for every sequence.
//!
//! The head's position `i` reads the token at `i + 1` and the target's final-normed hidden
//! state at `i`, so it holds one position fewer than the target has computed plus one: after
//! the target computes positions `..p` and samples the token at `p`, the head can compute
//! positions `..p`, and its row at `p - 1` proposes the token at `p + 1`. Each further
//! proposal is one more head pass at the next position, fed the previous proposal and the
//! head's own output row in place of the target's hidden state.
//!
//! Guarantees: the pool, the batch plan and the buffers are planned up front (a sequence that
//! finds no free block does not propose), so proposing allocates nothing; the head's rows for
//! proposals are cut back after verification like the target's.

use kylin_kernels::ThreadPool;
use kylin_loader::{KylinError, Result};

use crate::batch::{Allocs, EngineOptions, KvGeometry, SeqKv, kv_geometry};
use crate::kv_pool::KvPool;
use crate::model::{BatchPlan, MtpHead, MtpScratch};
use crate::rope::Ropes;
use crate::sampler::argmax;
use crate::state_pool::NO_SLOT;

/// Proposals per step when `--mtp` is given without `--speculative-tokens` (what Qwen's own
/// instructions for Qwen3.5 and Qwen3-Next ask of vLLM and SGLang).
pub const DEFAULT_MTP_TOKENS: usize = 2;

/// An MTP head ready to propose: its weights and its own planned KV pool, activations and
/// batch plan.
pub struct MtpDraft {
    head: MtpHead,
    kv: KvPool,
    rope: Ropes,
    scratch: MtpScratch,
    plan: BatchPlan,
    /// The hidden row of each token of the pass being built, `(max_tokens, hidden)`.
    hidden: Vec<f32>,
    /// Positions the head computes.
    context: usize,
    /// Tokens in one head pass.
    max_tokens: usize,
    /// Passes run so far.
    passes: u64,
}

impl std::fmt::Debug for MtpDraft {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MtpDraft")
            .field("head", &self.head)
            .field("context", &self.context)
            .field("kv_blocks", &self.kv.alloc.total())
            .finish()
    }
}

/// One sequence's state in the head: its block table in the head's pool and how many of its
/// positions the head holds (always a prefix).
#[derive(Debug, Default)]
pub struct MtpSeq {
    kv: SeqKv,
    computed: usize,
}

impl MtpSeq {
    /// The positions the head holds.
    pub fn computed(&self) -> usize {
        self.computed
    }
}

impl MtpDraft {
    /// Plans the head's pool and passes for `max_seqs` sequences of `context` positions and
    /// passes of `max_tokens` tokens, with `kv_tokens` positions in its pool (the target's,
    /// plus one step's proposals per sequence, is what the engine gives), with the KV dtype
    /// and block size options of the target (`opts`).
    pub fn new(
        head: &kylin_loader::mtp::MtpHead,
        opts: &EngineOptions,
        context: usize,
        max_seqs: usize,
        max_tokens: usize,
        kv_tokens: usize,
    ) -> Result<Self> {
        let mut head = MtpHead::new(head)?;
        let threads = opts.threads.max(1);
        // The head runs in the target's weight format and precision; the engine then gives it
        // the target's own prepared head (`share_lm_head`).
        let decoder = head.model_mut();
        if let Some(format) = opts.quantize {
            decoder.quantize(format, threads, &|_, _| {})?;
        }
        decoder.prepare_published(opts.precision, threads)?;
        decoder.set_precision(opts.precision)?;
        let model = head.model();
        let context = context.min(model.max_position_embeddings()).max(1);
        let KvGeometry { dtype: kv_dtype, block_size, layout } = kv_geometry(model, opts);
        let max_tokens = max_tokens.max(max_seqs).max(1);
        let scratch = head.plan_scratch(max_tokens, max_seqs, context)?;
        let per_seq = context.div_ceil(block_size) + 1;
        let overflow = || KylinError::config_invalid("the MTP head's KV pool overflows; pass a smaller --max-seqs");
        let most = per_seq.checked_mul(max_seqs).ok_or_else(overflow)?;
        let blocks = kv_tokens.div_ceil(block_size).max(per_seq).min(most);
        let kv = KvPool::new(kv_dtype, layout, blocks, block_size, &model.kv_groups().full)?;
        let hidden = vec![0.0; max_tokens.checked_mul(model.dims().hidden).ok_or_else(overflow)?];
        let mut draft = MtpDraft {
            rope: model.rope(context)?,
            plan: BatchPlan::with_capacity(max_tokens, max_seqs, max_seqs * per_seq),
            head,
            kv,
            scratch,
            hidden,
            context,
            max_tokens,
            passes: 0,
        };
        if opts.prefault {
            draft.kv.prefault();
            draft.scratch.prefault();
        }
        Ok(draft)
    }

    /// Computes the head's logits with the target's own head (see [`MtpHead::share_lm_head`]).
    pub fn share_lm_head(&mut self, target: &crate::model::Model) {
        self.head.share_lm_head(target);
    }

    /// The head.
    #[cfg(test)]
    pub(crate) fn head(&self) -> &MtpHead {
        &self.head
    }

    /// Positions the head computes.
    pub fn context(&self) -> usize {
        self.context
    }

    /// Tokens in one head pass.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// Bytes of the head's KV pool.
    pub fn kv_bytes(&self) -> u64 {
        self.kv.bytes()
    }

    /// Blocks of the head's pool in use.
    pub fn blocks_in_use(&self) -> usize {
        self.kv.alloc.total() - self.kv.alloc.free()
    }

    /// A fresh sequence state with room for a sequence of the full context.
    pub fn new_seq(&self) -> MtpSeq {
        MtpSeq { kv: SeqKv::with_capacity(self.context.div_ceil(self.kv.block_size) + 1), computed: 0 }
    }

    /// Makes `seq`'s table cover positions `0..len`; false (nothing allocated) when the pool
    /// has too few free blocks.
    pub fn grow(&mut self, seq: &mut MtpSeq, len: usize) -> bool {
        let bs = self.kv.block_size;
        seq.kv.grow(&mut Allocs { full: &mut self.kv.alloc, sliding: None }, len, bs)
    }

    /// Cuts `seq` back to its first `keep` positions and releases the blocks past them.
    pub fn truncate(&mut self, seq: &mut MtpSeq, keep: usize) {
        seq.computed = seq.computed.min(keep);
        let blocks = seq.computed.div_ceil(self.kv.block_size);
        while seq.kv.blocks.len() > blocks {
            if let Some(b) = seq.kv.blocks.pop() {
                self.kv.alloc.release(b);
            }
        }
    }

    /// Releases every block of `seq` (the sequence ends or is preempted).
    pub fn release(&mut self, seq: &mut MtpSeq) {
        self.truncate(seq, 0);
    }

    /// Starts a new head pass.
    pub fn begin(&mut self) {
        self.plan.clear();
    }

    /// Adds positions `seq.computed..` of `seq` to the pass (its table must cover them): each
    /// reads the token that follows it (`next_ids`) and a hidden row (`hidden`, `(len,
    /// hidden)`); counts them as computed and returns the logits row of the last one when
    /// asked.
    pub fn push(&mut self, seq: &mut MtpSeq, next_ids: &[u32], hidden: &[f32], logits: bool) -> Option<usize> {
        let h = self.head.model().dims().hidden;
        debug_assert_eq!(hidden.len(), next_ids.len() * h);
        self.push_rows(seq, next_ids, logits, |i, out| out.copy_from_slice(&hidden[i * h..(i + 1) * h]))
    }

    /// [`MtpDraft::push`] with the hidden row of the `i`-th position written by `fill(i, row)`
    /// (from the target's activations, or zeros where the target's hidden state is not known).
    pub fn push_rows(
        &mut self,
        seq: &mut MtpSeq,
        next_ids: &[u32],
        logits: bool,
        mut fill: impl FnMut(usize, &mut [f32]),
    ) -> Option<usize> {
        let h = self.head.model().dims().hidden;
        let t0 = self.plan.tokens();
        for (i, out) in self.hidden[t0 * h..(t0 + next_ids.len()) * h].chunks_exact_mut(h).enumerate() {
            fill(i, out);
        }
        let row = self.plan.push(next_ids, seq.computed, &seq.kv.blocks, &seq.kv.sliding, NO_SLOT, logits);
        seq.computed += next_ids.len();
        row
    }

    /// Adds the next position of `seq` fed `id` (a proposal) and the head's own output row for
    /// logits row `from_row` of the last pass; returns its logits row. Call before the pass's
    /// [`MtpDraft::forward`] overwrites the last pass's rows.
    pub fn push_chained(&mut self, seq: &mut MtpSeq, id: u32, from_row: usize) -> usize {
        let h = self.head.model().dims().hidden;
        let t0 = self.plan.tokens();
        self.hidden[t0 * h..(t0 + 1) * h].copy_from_slice(self.head.output(&self.scratch, from_row));
        let row = self.plan.push(&[id], seq.computed, &seq.kv.blocks, &seq.kv.sliding, NO_SLOT, true);
        seq.computed += 1;
        row.unwrap_or(0)
    }

    /// Passes run so far: a logits row of a pass is readable until the next one.
    pub fn passes(&self) -> u64 {
        self.passes
    }

    /// Tokens in the pass being built.
    pub fn planned_tokens(&self) -> usize {
        self.plan.tokens()
    }

    /// Runs the pass built since [`MtpDraft::begin`] on `pool` (nothing when it is empty).
    pub fn forward(&mut self, pool: &ThreadPool) {
        if self.plan.segments.is_empty() {
            return;
        }
        let n = self.plan.tokens() * self.head.model().dims().hidden;
        self.passes += 1;
        self.head.forward(pool, &mut self.kv, &mut self.rope, &mut self.scratch, &self.plan, &self.hidden[..n]);
    }

    /// The greedy token of logits row `row` of the last pass.
    pub fn greedy(&self, row: usize) -> u32 {
        argmax(self.head.logits(&self.scratch, row))
    }

    /// The logits of row `row` of the last pass.
    pub fn logits(&self, row: usize) -> &[f32] {
        self.head.logits(&self.scratch, row)
    }

    /// The head's output hidden row for logits row `row` of the last pass: the hidden row of
    /// the next position's pass.
    pub fn output(&self, row: usize) -> &[f32] {
        self.head.output(&self.scratch, row)
    }
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::*;
    use crate::draft::{DraftModel, DraftTarget};

    const REPO: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures");

    fn fixture(name: &str) -> PathBuf {
        Path::new(REPO).join("families/fixtures").join(name)
    }

    /// The largest absolute difference between `got` and the reference's row.
    fn max_diff(got: &[f32], want: &serde_json::Value) -> f32 {
        let want = want.as_array().expect("a row of logits");
        assert_eq!(got.len(), want.len(), "logits row width");
        got.iter().zip(want).map(|(g, w)| (g - w.as_f64().expect("a number") as f32).abs()).fold(0.0, f32::max)
    }

    #[test]
    fn the_mtp_head_computes_the_reference_logits_and_greedy_chain() {
        // The reference (scripts/make_mtp_fixtures.py) runs the head with transformers' own
        // decoder layer and norms in float32: teacher-forced rows (position i reads token i + 1
        // and the target's hidden state at i) and a greedy chain of proposals after the prompt.
        let pool = ThreadPool::new(2);
        for name in ["tiny-qwen3.5-mtp", "tiny-qwen3.5-moe-mtp", "tiny-qwen3-next-mtp", "tiny-glm4-moe-mtp"] {
            let dir = fixture(name);
            let text = std::fs::read_to_string(Path::new(REPO).join("mtp").join(format!("{name}.json"))).unwrap();
            let reference: serde_json::Value = serde_json::from_str(&text).unwrap();
            let opts = kylin_loader::LoadOptions { mtp: true, ..Default::default() };
            let loaded = kylin_loader::load(&dir, &opts).unwrap();
            let head = loaded.mtp.as_ref().expect("the fixture has an MTP head");
            assert!(loaded.not_run.iter().all(|p| !p.part.contains("mtp")), "{name}: the head's tensors are bound");
            let engine = EngineOptions { threads: 2, ..EngineOptions::default() };
            let mut mtp = MtpDraft::new(head, &engine, 256, 1, 256, 4096).unwrap();
            let target_of =
                DraftTarget { path: None, vocab: loaded.config.vocab_size, tokenizer: None, kv_tokens: 4096 };
            let mut target = DraftModel::load(&dir, &target_of, &engine, 256, 1, 256).unwrap();
            let h = loaded.config.hidden_size;
            let cases = reference["cases"].as_array().unwrap();
            assert!(cases.len() >= 3);
            for case in cases {
                let ids: Vec<u32> =
                    case["input_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
                let len = ids.len();
                // The target over the prompt gives transformers' greedy next token. The head reads
                // transformers' own hidden rows (the reference's `hidden`), so that what is
                // compared is the head alone.
                let mut seq = target.new_seq();
                assert!(target.grow(&mut seq, len));
                target.begin();
                let row = target.push(&mut seq, &ids, true).unwrap();
                target.forward(&pool);
                let next = target.greedy(row);
                assert_eq!(next as u64, case["next_token"].as_u64().unwrap(), "{name}: the target's next token");
                target.release(&mut seq);
                let hidden: Vec<f32> = case["hidden"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .flat_map(|row| row.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32))
                    .collect();
                assert_eq!(hidden.len(), len * h);

                // Teacher forced, one position per pass: position i reads ids[i + 1] and h_i.
                let forced = case["teacher_forced_logits"].as_array().unwrap();
                assert_eq!(forced.len(), len - 1);
                let mut s = mtp.new_seq();
                assert!(mtp.grow(&mut s, len + 4));
                for i in 0..len - 1 {
                    mtp.begin();
                    let row = mtp.push(&mut s, &ids[i + 1..i + 2], &hidden[i * h..(i + 1) * h], true).unwrap();
                    mtp.forward(&pool);
                    let diff = max_diff(mtp.logits(row), &forced[i]);
                    assert!(diff < 1e-3, "{name}: {len} tokens, position {i}: logits differ by {diff}");
                }
                // The same positions again in one pass (a prompt's chunk), then the chain.
                mtp.truncate(&mut s, 0);
                assert!(mtp.grow(&mut s, len + 4));
                let mut next_ids = ids[1..].to_vec();
                next_ids.push(next);
                mtp.begin();
                let mut row = mtp.push(&mut s, &next_ids, &hidden, true).unwrap();
                mtp.forward(&pool);
                let chain_ids = case["chain_ids"].as_array().unwrap();
                let chain_logits = case["chain_logits"].as_array().unwrap();
                assert_eq!(chain_ids.len(), 4);
                for (j, want) in chain_ids.iter().enumerate() {
                    let diff = max_diff(mtp.logits(row), &chain_logits[j]);
                    assert!(diff < 1e-3, "{name}: {len} tokens, proposal {j}: logits differ by {diff}");
                    let proposal = mtp.greedy(row);
                    assert_eq!(proposal as u64, want.as_u64().unwrap(), "{name}: {len} tokens, proposal {j}");
                    if j + 1 < chain_ids.len() {
                        let own = mtp.output(row).to_vec();
                        mtp.begin();
                        row = mtp.push(&mut s, &[proposal], &own, true).unwrap();
                        mtp.forward(&pool);
                    }
                }
                assert_eq!(s.computed, len + 3);
                mtp.release(&mut s);
                assert_eq!(mtp.blocks_in_use(), 0);
            }
        }
    }
}
