//! The draft-model proposer of speculative decoding: a smaller model with the target's
//! vocabulary (`--draft-model DIR`), loaded through the same loader and registry and run by the
//! same native code, guesses the next tokens of every speculating sequence greedily.
//!
//! The draft keeps keys and values of its own for every running sequence ([`DraftSeq`]: a
//! block table in the draft's own [`KvPool`] and how many of the sequence's tokens it holds).
//! While a prompt is computed, the draft computes the same chunks. Each step, for the
//! sequences that speculate, the batching engine ([`crate::batch`]) first lets the draft catch
//! up on the tokens it has not seen (usually those sampled since the last step; all in one
//! forward pass over every such sequence), which gives the first proposal, then runs
//! one batched one-token forward pass per further proposal, each fed the previous greedy
//! proposal. The proposals go to the same verification as the n-gram proposer's: the output is
//! the target's own, token for token. After the verification the draft's cache is cut back to
//! the longest prefix it shares with the sequence's tokens (the accepted proposals stay).
//!
//! A draft with recurrent layers (a small Qwen3.5 for a large one: the family's tokenizer is
//! its own) keeps a live state slot per sequence in a state pool of its own, without
//! snapshots. The proposals it is fed are logged (`Segment::log_from`) and cut back like the
//! target's (`StatePool::roll_back`); the engine lets no proposal complete one of its
//! delta-rule chunks ([`DraftModel::proposal_room`]). A cut below what the log holds (a rare
//! rewind of a token it had computed) starts the sequence's draft state over from nothing.
//!
//! Guarantees: the draft is validated while loading (the same vocabulary size as the target,
//! the same tokenizer when either has one: `VOCAB_MISMATCH` naming both directories and the
//! expected and found values); its pool holds as many positions as the
//! target's, plus one step's proposals per sequence; a sequence that finds no free draft
//! block does not speculate in that step, and the draft never preempts; its activations,
//! batch plan and block tables are planned up front, so proposing allocates nothing.

use std::path::{Path, PathBuf};

use kylin_kernels::ThreadPool;
use kylin_loader::tokenizer::TokenizerBundle;
use kylin_loader::{KylinError, Result};

use crate::batch::{
    Allocs, EngineOptions, KvGeometry, SeqKv, SlidingPool, kv_geometry, proposals_before_chunk_end, state_chunk,
};
use crate::kv_pool::KvPool;
use crate::model::{BatchPlan, Model, Scratch};
use crate::rope::Ropes;
use crate::sampler::argmax;
use crate::state_pool::{NO_SLOT, StatePool};

/// Proposals per step when `--draft-model` is given without `--speculative-tokens`.
pub const DEFAULT_DRAFT_TOKENS: usize = 4;

/// A draft model ready to propose: its weights and its own planned KV pool, activations and
/// batch plan.
pub struct DraftModel {
    model: Model,
    kv: KvPool,
    swa: Option<SlidingPool>,
    /// The recurrent layers' live states, one slot per sequence (no snapshots), when the draft
    /// has recurrent layers.
    states: Option<StatePool>,
    rope: Ropes,
    scratch: Scratch,
    plan: BatchPlan,
    /// Positions the draft computes: the target's context, or less when the draft's
    /// `max_position_embeddings` is smaller (sequences past it are not proposed for).
    context: usize,
    /// Tokens in one draft forward pass.
    max_tokens: usize,
    path: PathBuf,
}

impl std::fmt::Debug for DraftModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraftModel")
            .field("path", &self.path)
            .field("dims", self.model.dims())
            .field("context", &self.context)
            .field("kv_blocks", &self.kv.alloc.total())
            .finish()
    }
}

/// One sequence's state in the draft: its block tables in the draft's pools and the number of
/// the sequence's tokens whose keys and values they hold (always a prefix of its tokens), and
/// with recurrent layers its live state slot and where the log of its proposals starts.
#[derive(Debug)]
pub(crate) struct DraftSeq {
    pub kv: SeqKv,
    pub computed: usize,
    /// Its live slot in the draft's state pool (`NO_SLOT` until it computes something, and
    /// always without recurrent layers).
    state: u32,
    /// The position of the first proposal fed since the last cut (the start of its
    /// convolution log), if any was.
    log_from: Option<usize>,
}

impl Default for DraftSeq {
    fn default() -> Self {
        DraftSeq { kv: SeqKv::default(), computed: 0, state: NO_SLOT, log_from: None }
    }
}

/// What the draft is compared against and sized from: the target's directory (for messages),
/// vocabulary size and tokenizer, and the positions its KV pool holds.
pub struct DraftTarget<'a> {
    pub path: Option<&'a Path>,
    pub vocab: usize,
    pub tokenizer: Option<&'a TokenizerBundle>,
    pub kv_tokens: usize,
}

impl DraftModel {
    /// Loads the draft model at `dir` and plans its pool and passes for `max_seqs` sequences of
    /// `context` positions and forward passes of `max_tokens` tokens, with the precision,
    /// quantization, KV dtype and block size options of the target (`opts`). The pool holds
    /// `opts.draft_kv_tokens` positions, by default as many as the target's pool plus one
    /// step's proposals per sequence (at most `max_seqs` whole contexts).
    ///
    /// `VOCAB_MISMATCH` when its vocabulary size or tokenizer differs from the target's;
    /// `CONFIG_INVALID` for a draft with recurrent layers or a precision it cannot run; the
    /// loader's and binder's errors for a malformed directory.
    pub fn load(
        dir: &Path,
        target: &DraftTarget<'_>,
        opts: &EngineOptions,
        context: usize,
        max_seqs: usize,
        max_tokens: usize,
    ) -> Result<Self> {
        let target_name = target.path.map_or_else(|| "the target model".to_string(), |p| p.display().to_string());
        let in_draft = |e: KylinError| KylinError {
            message: format!("draft model {}: {}", dir.display(), e.message),
            path: e.path.or_else(|| Some(dir.to_path_buf())),
            ..e
        };
        let loaded = kylin_loader::load(dir, &kylin_loader::LoadOptions { prefetch: true, ..Default::default() })
            .map_err(in_draft)?;
        check_vocabulary(dir, &target_name, target, loaded.config.vocab_size, loaded.tokenizer.as_ref())?;
        let mut model = Model::new(&loaded.config, &loaded.weights).map_err(in_draft)?;
        let threads = opts.threads.max(1);
        if let Some(format) = opts.quantize {
            model.quantize(format, threads, &|_, _| {}).map_err(in_draft)?;
        }
        model.prepare_published(opts.precision, threads).map_err(in_draft)?;
        model.set_precision(opts.precision).map_err(in_draft)?;
        let context = context.min(model.max_position_embeddings()).max(1);
        let KvGeometry { dtype: kv_dtype, block_size, layout } = kv_geometry(&model, opts);
        let max_tokens = max_tokens.max(max_seqs).max(1);
        let scratch = model.plan_scratch(max_tokens, max_seqs, context).map_err(in_draft)?;
        // What the target's pool holds, plus the proposals: the running sequences' tokens fit
        // unless they share prompt blocks in the target (forks, prefix hits), which the draft
        // does not. A sequence that finds no free draft block does not speculate in that step
        // (its output is the same). The sliding layers' blocks are kept too (the draft
        // registers nothing in a prefix cache to take them back from after a rollback), so
        // their pool is as large.
        let per_seq = context.div_ceil(block_size) + 1;
        let overflow = || KylinError::config_invalid("the draft model's KV pool overflows; pass a smaller --max-seqs");
        let most = per_seq.checked_mul(max_seqs).ok_or_else(overflow)?;
        let slack = (opts.speculative_tokens + 1).div_ceil(block_size) + 1;
        let blocks = match opts.draft_kv_tokens {
            Some(tokens) => tokens.div_ceil(block_size).max(1),
            None => target.kv_tokens.div_ceil(block_size).saturating_add(slack.saturating_mul(max_seqs)),
        }
        .min(most);
        let groups = model.kv_groups();
        let kv = KvPool::new(kv_dtype, layout, blocks, block_size, &groups.full).map_err(in_draft)?;
        let swa = match groups.window {
            Some(window) if !groups.sliding.is_empty() => {
                let kv = KvPool::new(kv_dtype, layout, blocks, block_size, &groups.sliding).map_err(in_draft)?;
                Some(SlidingPool { kv, window })
            }
            _ => None,
        };
        let plan = BatchPlan::with_capacity(max_tokens, max_seqs, max_seqs * per_seq);
        // A live state per sequence, with a log of the proposals fed (at most one fewer than
        // the speculative tokens; one more keeps the sizes simple).
        let recurrent = model.recurrent_layers();
        let states = if recurrent.is_empty() {
            None
        } else {
            let chunk = state_chunk(block_size).map_err(in_draft)?;
            Some(StatePool::new(&recurrent, chunk, max_seqs, 0, opts.speculative_tokens.max(1)).map_err(in_draft)?)
        };
        let mut draft = DraftModel {
            states,
            rope: model.rope(context).map_err(in_draft)?,
            model,
            kv,
            swa,
            scratch,
            plan,
            context,
            max_tokens,
            path: dir.to_path_buf(),
        };
        if opts.prefault {
            draft.kv.prefault();
            if let Some(swa) = &mut draft.swa {
                swa.kv.prefault();
            }
            draft.scratch.prefault();
            if let Some(states) = &mut draft.states {
                states.prefault();
            }
        }
        Ok(draft)
    }

    /// The draft's directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The draft's model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Positions the draft computes.
    pub fn context(&self) -> usize {
        self.context
    }

    /// Tokens in one draft forward pass.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// Bytes of the draft's KV pools and its recurrent layers' states.
    pub fn kv_bytes(&self) -> u64 {
        self.kv.bytes()
            + self.swa.as_ref().map_or(0, |s| s.kv.bytes())
            + self.states.as_ref().map_or(0, StatePool::bytes)
    }

    /// The most proposals a sequence whose last sampled token sits at `first` may take from
    /// this draft in one step: the draft computes all but the last, and none of those may
    /// complete one of its delta-rule chunks (no limit without recurrent layers).
    pub fn proposal_room(&self, first: usize) -> usize {
        self.states.as_ref().map_or(usize::MAX, |s| proposals_before_chunk_end(first, s.chunk()) + 1)
    }

    /// Live state slots sequences hold now (0 without recurrent layers).
    pub fn states_in_use(&self) -> usize {
        self.states.as_ref().map_or(0, StatePool::live_in_use)
    }

    /// Blocks of the draft's pool that sequences hold now.
    pub fn blocks_in_use(&self) -> usize {
        self.kv.alloc.total() - self.kv.alloc.free()
    }

    /// Blocks of the draft's pool.
    pub fn total_blocks(&self) -> usize {
        self.kv.alloc.total()
    }

    /// A fresh sequence state with room for a sequence of the full context.
    pub(crate) fn new_seq(&self) -> DraftSeq {
        DraftSeq { kv: SeqKv::with_capacity(self.context.div_ceil(self.kv.block_size) + 1), ..DraftSeq::default() }
    }

    fn allocs(&mut self) -> Allocs<'_> {
        Allocs { full: &mut self.kv.alloc, sliding: self.swa.as_mut().map(|s| (&mut s.kv.alloc, s.window)) }
    }

    /// Makes `seq`'s tables cover positions `0..len` (and gives it a live state slot with
    /// recurrent layers); false (nothing allocated) when the pool has too few free blocks (it is
    /// planned so that it does not happen).
    pub(crate) fn grow(&mut self, seq: &mut DraftSeq, len: usize) -> bool {
        if let Some(states) = &mut self.states
            && seq.state == NO_SLOT
        {
            // Slots are planned for every running sequence; a fresh one is zeroed.
            let Some(slot) = states.allocate() else { return false };
            seq.state = slot;
            seq.computed = 0;
            seq.kv.release_all(&mut Allocs {
                full: &mut self.kv.alloc,
                sliding: self.swa.as_mut().map(|s| (&mut s.kv.alloc, s.window)),
            });
        }
        let bs = self.kv.block_size;
        seq.kv.grow(&mut self.allocs(), len, bs)
    }

    /// Cuts `seq` back to its first `keep` tokens (the prefix it shares with the sequence)
    /// and releases the blocks past them. With recurrent layers the state follows: rolled back
    /// from the log of the proposals fed, or, for a cut below the log's start, started over.
    pub(crate) fn truncate(&mut self, seq: &mut DraftSeq, tokens: &[u32], keep: usize) {
        let bs = self.kv.block_size;
        if let Some(states) = &mut self.states
            && keep < seq.computed
        {
            match seq.log_from {
                Some(from) if from <= keep => states.roll_back(seq.state, keep - from),
                _ => {
                    states.reset(seq.state);
                    seq.computed = 0;
                }
            }
        }
        seq.log_from = None;
        seq.computed = seq.computed.min(keep);
        let kept = seq.kv.truncate(&mut self.allocs(), tokens, seq.computed.div_ceil(bs), bs);
        if kept * bs < seq.computed
            && let Some(states) = &mut self.states
        {
            // The sliding window's released blocks cut the prefix below the state: start over.
            states.reset(seq.state);
            seq.computed = 0;
        }
        seq.computed = seq.computed.min(kept * bs);
    }

    /// Releases every block of `seq` and its state slot (the sequence ends or is preempted).
    pub(crate) fn release(&mut self, seq: &mut DraftSeq) {
        seq.kv.release_all(&mut self.allocs());
        if let Some(states) = &mut self.states
            && seq.state != NO_SLOT
        {
            states.release(seq.state);
        }
        seq.state = NO_SLOT;
        seq.log_from = None;
        seq.computed = 0;
    }

    /// Starts a new draft forward pass.
    pub(crate) fn begin(&mut self) {
        self.plan.clear();
    }

    /// Adds `ids` at positions `seq.computed..` of `seq` to the pass (its tables must cover
    /// them) and counts them as computed; returns the logits row of the last one when asked.
    /// These are the sequence's own tokens, never rejected.
    pub(crate) fn push(&mut self, seq: &mut DraftSeq, ids: &[u32], logits: bool) -> Option<usize> {
        debug_assert!(seq.log_from.is_none(), "tokens pushed after proposals without a cut");
        let row = self.plan.push(ids, seq.computed, &seq.kv.blocks, &seq.kv.sliding, seq.state, logits);
        seq.computed += ids.len();
        row
    }

    /// Adds a proposal at position `seq.computed` (which verification may reject) to the pass,
    /// logged for a rollback; returns the logits row of its next proposal.
    pub(crate) fn push_proposal(&mut self, seq: &mut DraftSeq, id: u32) -> usize {
        let from = *seq.log_from.get_or_insert(seq.computed);
        let row = self.plan.push(&[id], seq.computed, &seq.kv.blocks, &seq.kv.sliding, seq.state, true);
        if self.states.is_some() {
            self.plan.log_last_from(from);
        }
        seq.computed += 1;
        row.unwrap_or(0)
    }

    /// Tokens in the pass being built.
    pub(crate) fn planned_tokens(&self) -> usize {
        self.plan.tokens()
    }

    /// Runs the pass built since [`DraftModel::begin`] on `pool` (nothing when it is empty).
    pub(crate) fn forward(&mut self, pool: &ThreadPool) {
        if self.plan.segments.is_empty() {
            return;
        }
        let sliding = self.swa.as_mut().map(|s| &mut s.kv);
        self.model.forward_plan(
            pool,
            &mut self.kv,
            sliding,
            self.states.as_mut(),
            &mut self.rope,
            &mut self.scratch,
            &self.plan,
            None,
        );
    }

    /// Keeps every token's final hidden row after each pass (for reading them with
    /// [`Model::final_hidden`]).
    #[cfg(test)]
    pub(crate) fn keep_every_hidden_row(&mut self) {
        self.scratch.keep_every_hidden_row();
    }

    /// The activations of the last pass (a test reads the target's hidden rows from them).
    #[cfg(test)]
    pub(crate) fn scratch(&self) -> &Scratch {
        &self.scratch
    }

    /// The greedy token of logits row `row` of the last pass.
    pub(crate) fn greedy(&self, row: usize) -> u32 {
        argmax(self.scratch.logits(row, self.model.dims().vocab))
    }
}

/// `VOCAB_MISMATCH` unless the draft's vocabulary is the target's: the same number of ids
/// (`vocab_size` of both `config.json`s), and, when either has a tokenizer, both have one
/// with the same ids for the same token strings.
fn check_vocabulary(
    dir: &Path,
    target_name: &str,
    target: &DraftTarget<'_>,
    draft_vocab: usize,
    draft_tokenizer: Option<&TokenizerBundle>,
) -> Result<()> {
    let mismatch = |what: String| {
        Err(KylinError::vocab_mismatch(format!(
            "draft model {} does not share the vocabulary of the target model {target_name}: {what}; a draft model \
             must use the target's tokenizer",
            dir.display()
        ))
        .at(dir))
    };
    if draft_vocab != target.vocab {
        return mismatch(format!("vocab_size expected {} (the target's), got {draft_vocab}", target.vocab));
    }
    match (target.tokenizer, draft_tokenizer) {
        (None, None) => Ok(()),
        (Some(_), None) => mismatch("the target has a tokenizer, the draft has none to compare".into()),
        (None, Some(_)) => mismatch("the draft has a tokenizer, the target has none to compare".into()),
        (Some(t), Some(d)) => {
            if t.vocab_size != d.vocab_size {
                return mismatch(format!(
                    "tokenizer ids expected {} (the target's), got {}",
                    t.vocab_size, d.vocab_size
                ));
            }
            let (tv, dv) = (t.tokenizer.get_vocab(true), d.tokenizer.get_vocab(true));
            if tv.len() != dv.len() {
                return mismatch(format!("tokenizer tokens expected {} (the target's), got {}", tv.len(), dv.len()));
            }
            // The differing token with the smallest id, for a stable message.
            let differing = tv.iter().filter(|(token, id)| dv.get(*token) != Some(id)).min_by_key(|(_, id)| **id);
            match differing {
                None => Ok(()),
                Some((token, id)) => mismatch(format!(
                    "token {token:?} expected id {id} (the target's), got {}",
                    dv.get(token).map_or_else(|| "none".to_string(), u32::to_string)
                )),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FAMILIES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/families/fixtures");
    const REPO_FAMILIES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/families/fixtures");

    fn fixture(name: &str) -> PathBuf {
        [Path::new(FAMILIES).join(name), Path::new(REPO_FAMILIES).join(name)]
            .into_iter()
            .find(|p| p.is_dir())
            .unwrap_or_else(|| panic!("fixture {name} is missing"))
    }

    fn draft_of(dir: &Path, speculative_tokens: usize) -> DraftModel {
        let loaded = kylin_loader::load(dir, &kylin_loader::LoadOptions::default()).unwrap();
        let target = DraftTarget {
            path: Some(dir),
            vocab: loaded.config.vocab_size,
            tokenizer: loaded.tokenizer.as_ref(),
            kv_tokens: 4096,
        };
        let opts = EngineOptions { threads: 2, speculative_tokens, ..EngineOptions::default() };
        DraftModel::load(dir, &target, &opts, 256, 2, 256).unwrap()
    }

    /// The bits of the logits of row `row` of the last pass.
    fn logits_bits(draft: &DraftModel, row: usize) -> Vec<u32> {
        draft.scratch.logits(row, draft.model.dims().vocab).iter().map(|v| v.to_bits()).collect()
    }

    /// The last row's logits of a fresh sequence computing `tokens` in one pass.
    fn fresh_logits(draft: &mut DraftModel, pool: &ThreadPool, tokens: &[u32]) -> Vec<u32> {
        let mut seq = draft.new_seq();
        assert!(draft.grow(&mut seq, tokens.len()));
        draft.begin();
        let row = draft.push(&mut seq, tokens, true).unwrap();
        draft.forward(pool);
        let bits = logits_bits(draft, row);
        draft.release(&mut seq);
        bits
    }

    #[test]
    fn a_recurrent_draft_cut_back_after_proposals_continues_as_if_they_never_were() {
        // Proposals fed one pass at a time, some cut back, then the sequence's own tokens: the
        // logits equal a fresh computation of the kept tokens, bit for bit, across several
        // chunks of the delta rule (16 positions) and for cuts at every offset.
        let pool = ThreadPool::new(2);
        for name in ["tiny-qwen3.5", "tiny-lfm2", "tiny-qwen3-next-gqa-sparse"] {
            let mut draft = draft_of(&fixture(name), 6);
            let tokens: Vec<u32> = (0..300u32).map(|i| (i * 7919 + 13) % 1000).collect();
            let mut seq = draft.new_seq();
            let mut len = 5;
            assert!(draft.grow(&mut seq, len));
            draft.begin();
            draft.push(&mut seq, &tokens[..len], false);
            draft.forward(&pool);
            let mut cuts = 0;
            for round in 0..30 {
                // Feed proposals at len.. (the right tokens but for the last, which is wrong),
                // as many as may be fed before a chunk ends, then keep `kept` of them.
                let room = draft.proposal_room(len - 1).saturating_sub(1).min(5);
                let kept = round % (room + 1);
                assert!(draft.grow(&mut seq, len + room + 1));
                for j in 0..room {
                    let id = if j == kept { tokens[len + j] + 1 } else { tokens[len + j] };
                    draft.begin();
                    draft.push_proposal(&mut seq, id);
                    draft.forward(&pool);
                }
                draft.truncate(&mut seq, &tokens, len + kept);
                assert_eq!(seq.computed, len + kept, "{name}: the cut keeps what it was told");
                cuts += usize::from(room > kept);
                // The sequence's own next tokens, then the check against a fresh computation.
                let next = len + kept + 1 + round % 3;
                assert!(draft.grow(&mut seq, next));
                draft.begin();
                let row = draft.push(&mut seq, &tokens[len + kept..next], true).unwrap();
                draft.forward(&pool);
                let got = logits_bits(&draft, row);
                assert_eq!(got, fresh_logits(&mut draft, &pool, &tokens[..next]), "{name}: round {round}, at {next}");
                len = next;
            }
            assert!(len > 64 && cuts > 10, "{name}: {len} positions, {cuts} cuts");
            draft.release(&mut seq);
            assert_eq!((draft.blocks_in_use(), draft.states_in_use()), (0, 0));
        }
    }
}
