//! The continuous-batching engine: many sequences per forward pass over one paged KV cache.
//!
//! [`EngineCore`] owns what a forward pass needs, planned once: the model, the thread pool, the
//! [`KvPool`] sized from a memory budget, RoPE tables, activation buffers for
//! `max_batch_tokens` tokens and `max_seqs` sequences. [`BatchEngine`] schedules requests over
//! it (the [`Serving`] interface); [`crate::native::NativeBackend`] runs one sequence over it
//! (the [`crate::Backend`] interface used by `run`, `chat` and `logits`).
//!
//! The scheduler, one [`BatchEngine::step`] at a time (vLLM's v1 loop, on the CPU):
//! 1. Cancelled sequences end and free their blocks.
//! 2. Every running sequence that is decoding gets its one token, in admission order. When no
//!    block is free for it, the most recently admitted running sequence is preempted: its blocks
//!    are released (full ones stay in the prefix cache) and it goes back to the front of the
//!    queue, to be recomputed later. The engine never fails because the pool is full.
//!    With speculative decoding on (`EngineOptions::speculative_tokens`), each decoding
//!    sequence then extends its token with the n-gram proposer's guesses
//!    ([`crate::speculative`]), or with a draft model's ([`crate::draft`], which first catches
//!    up on the sequence's tokens in its own KV pool), as far as the step's spare tokens,
//!    logits rows and free blocks allow (never preempting for them); after the forward pass
//!    they are verified row by row with the sequence's sampler and the rejected ones' blocks
//!    are dropped (in the draft's pool too), and the recurrent layers' convolution rows rolled
//!    back (`StatePool::roll_back`; proposals stop before a delta-rule chunk's end).
//! 3. Running sequences whose prompt is partly computed get the next chunk, then waiting
//!    sequences are admitted (FCFS, while fewer than `max_seqs` run) with whatever prefix the
//!    cache holds for them, and get a chunk, until the step holds `max_batch_tokens` tokens
//!    (chunked prefill: a long prompt never stalls decoding sequences for more than one step).
//! 4. One forward pass over all of it; sequences that reached the end of their tokens sample
//!    the next one. A request with `n > 1` runs one sequence for the prompt, and when it samples
//!    its first token, `n - 1` siblings fork from it: they share its full prompt blocks, and the
//!    partly filled last block is copied for each.
//!
//! Guarantees: a step allocates nothing for the compute and the bookkeeping (text pieces and
//! log-probability lists handed out are the only allocations; a request that streams ids only
//! allocates nothing); block references always return to zero when sequences end; a sequence's
//! tokens do not depend on what else runs or on preemption (the kernels are batch invariant and
//! a preempted sequence recomputes the same keys and values).

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kylin_kernels::{ThreadPool, WeightDType};
use kylin_loader::task::ModelTask;
use kylin_loader::vision::ImageAttention;
use kylin_loader::{GenerationDefaults, KylinError, LoadedModel, Result};

use crate::backend::ChatMessage;
use crate::draft::{DraftModel, DraftSeq, DraftTarget};
use crate::kv_pool::{BlockAllocator, KvPool};
use crate::model::NO_BLOCK;
use crate::model::{BatchPlan, EmbeddingRow, Model, PrecisionChoice, QuantFormat, Scratch};
use crate::mtp::{MtpDraft, MtpSeq};
use crate::native::ModelParts;
use crate::rope::Ropes;
use crate::sequence::Decoding;
use crate::serial::validate_request;
use crate::serving::ImageInput;
use crate::serving::{
    EmbeddingInfo, EngineInfo, EngineStats, Event, EventKind, Pooled, Request, Serving, StatePoolInfo, StopReason,
    Usage,
};
use crate::speculative::{MAX_SPECULATIVE_TOKENS, Proposer, SpeculationControl, propose_ngram};
use crate::state_pool::{NO_SLOT, StatePool};
use crate::text::TextCodec;
use crate::vision::{self, Encoding, ImagePreparer, VisionTower};

/// The context size used when none is given, capped by the model's `max_position_embeddings`.
pub const DEFAULT_CONTEXT: usize = 4096;
/// Positions per KV block unless `--kv-block-size` says otherwise, on every attention path but
/// AMX's.
pub const DEFAULT_BLOCK_SIZE: usize = 16;
/// Positions per KV block by default when attention runs on AMX (a BF16 cache under
/// `--precision bf16`): its value products then take 32 positions at a time, which one block
/// must hold (`kylin_kernels::paged`'s wide AMX tiles; BENCHMARKS.md measures both sizes).
pub const AMX_BLOCK_SIZE: usize = 32;

/// The default positions per KV block for an attention path: [`AMX_BLOCK_SIZE`] where the AMX
/// kernel would run at that size, [`DEFAULT_BLOCK_SIZE`] elsewhere.
/// A KV cache's element type, positions per block and tile layout.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KvGeometry {
    pub dtype: WeightDType,
    pub block_size: usize,
    pub layout: kylin_kernels::paged::KvLayout,
}

/// The KV cache of `model` under `opts`: the options' dtype and block size, else the model's
/// defaults, and the layout its attention path reads (the target, a draft model and an MTP head
/// each decide theirs this way).
pub(crate) fn kv_geometry(model: &Model, opts: &EngineOptions) -> KvGeometry {
    let dtype = opts.kv_dtype.unwrap_or(model.default_kv_dtype());
    let (head_dim, needs) = (model.attention_head_dim(), model.attention_needs());
    let precision = model.attention_precision();
    let block_size = opts.block_size.unwrap_or_else(|| default_block_size(precision, dtype, head_dim, needs));
    let layout = kylin_kernels::paged::attention_path(precision, dtype, head_dim, block_size, needs).layout();
    KvGeometry { dtype, block_size, layout }
}

pub fn default_block_size(
    precision: kylin_kernels::Precision,
    kv_dtype: WeightDType,
    head_dim: usize,
    needs: kylin_kernels::paged::AttentionNeeds,
) -> usize {
    use kylin_kernels::paged::{AttentionPath, attention_path};
    if attention_path(precision, kv_dtype, head_dim, AMX_BLOCK_SIZE, needs) == AttentionPath::AmxBf16 {
        AMX_BLOCK_SIZE
    } else {
        DEFAULT_BLOCK_SIZE
    }
}
/// Tokens per step unless `--max-batch-tokens` says otherwise.
pub const DEFAULT_MAX_BATCH_TOKENS: usize = 512;
/// Sequences per batch unless `--max-seqs` says otherwise (the server and `bench`).
pub const DEFAULT_MAX_SEQS: usize = 16;
/// Bytes of logits planned for prompt log-probabilities per step (beyond one row per
/// sequence): `16 MiB / (4 · vocab)` rows, between [`MIN_PROMPT_LOGIT_ROWS`] and
/// [`MAX_PROMPT_LOGIT_ROWS`]. A request that scores its prompt computes at most that many of
/// its positions per step.
pub const PROMPT_LOGITS_BYTES: usize = 16 << 20;
pub const MIN_PROMPT_LOGIT_ROWS: usize = 8;
pub const MAX_PROMPT_LOGIT_ROWS: usize = 64;

/// The logits rows planned for prompt log-probabilities for a vocabulary of `vocab` ids.
pub fn prompt_logit_rows(vocab: usize) -> usize {
    (PROMPT_LOGITS_BYTES / (4 * vocab.max(1))).clamp(MIN_PROMPT_LOGIT_ROWS, MAX_PROMPT_LOGIT_ROWS)
}

/// Share of the memory available after the weights that the default KV budget may take.
pub const DEFAULT_MEMORY_SHARE: f64 = 0.5;
/// The shortest chunk of the recurrent layers' delta rule: positions between two updates of a
/// Gated DeltaNet state, and the spacing of state snapshots. The chunk is the smallest multiple
/// of the KV block size that is at least this, so every snapshot sits on a block boundary.
pub const MIN_STATE_CHUNK: usize = 16;

/// The chunk of the recurrent layers for KV blocks of `block_size` positions (see
/// [`MIN_STATE_CHUNK`]); `CONFIG_INVALID` when it would exceed the kernels' longest chunk.
pub fn state_chunk(block_size: usize) -> Result<usize> {
    let chunk = block_size * MIN_STATE_CHUNK.div_ceil(block_size.max(1));
    if chunk > kylin_kernels::delta::MAX_CHUNK {
        return Err(KylinError::config_invalid(format!(
            "--kv-block-size {block_size} is too large for a model with recurrent layers (their state is updated once per block); pass at most {}",
            kylin_kernels::delta::MAX_CHUNK
        )));
    }
    Ok(chunk)
}

/// Snapshots of recurrent states kept for the prefix cache when `--state-snapshots` is not
/// given: two per sequence (the end of a prompt and the end of a generation, what a repeated
/// prompt and the next chat turn reuse), and at least four.
pub fn default_state_snapshots(max_seqs: usize) -> usize {
    (2 * max_seqs).max(4)
}

/// `EngineOptions::speculative_step_tokens` when not given: two decode steps' worth of
/// compute on the CPUs measured (`BENCHMARKS.md`), so a lone sequence proposes up to 31
/// tokens, eight sequences 3 each, and 32 sequences none.
pub const DEFAULT_SPECULATIVE_STEP_TOKENS: usize = 32;

/// The longest speculative segment with `speculative_tokens` proposals: the last sampled
/// token and the proposals (0 when speculation is off).
fn speculative_rows(speculative_tokens: usize) -> usize {
    if speculative_tokens == 0 { 0 } else { 1 + speculative_tokens }
}

/// The most proposals a sequence of a model with recurrent layers may verify after its last
/// sampled token at position `first` (with Gated DeltaNet chunks of `chunk` positions): no
/// proposal may complete a chunk, since completing one folds it into the state `S₀` for good,
/// and a rejected proposal must leave the state as it was (`crate::state_pool`). The first
/// token, which is never rejected, may complete one.
pub fn proposals_before_chunk_end(first: usize, chunk: usize) -> usize {
    // The last position of the first chunk a proposal could complete.
    let chunk_end = (first / chunk + 1) * chunk - 1;
    let chunk_end = if chunk_end == first { chunk_end + chunk } else { chunk_end };
    chunk_end - first - 1
}

/// How much memory the KV cache may take.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvBudget {
    /// Room for `max_seqs` sequences of the full context, but at most half the memory
    /// available after the weights and activations (and at least one sequence).
    Default,
    /// This many bytes (`--kv-memory`).
    Bytes(u64),
    /// This share of the memory available after the weights and activations (`--memory-fraction`).
    Fraction(f64),
}

/// How to build the engine.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    pub threads: usize,
    /// Longest sequence; default `min(max_position_embeddings, 4096)`.
    pub ctx_size: Option<usize>,
    pub kv_budget: KvBudget,
    /// Element type of the KV cache; `None` follows the precision: BF16 under
    /// `Precision::Bf16` (what transformers keeps for a BF16 model), f32 under `Precision::F32`
    /// (exact against the float32 references).
    pub kv_dtype: Option<WeightDType>,
    pub max_seqs: usize,
    pub max_batch_tokens: usize,
    /// Positions per KV block (`--kv-block-size`); `None` takes [`default_block_size`].
    pub block_size: Option<usize>,
    /// A chat template (its text) replacing the model's own.
    pub chat_template_override: Option<String>,
    /// Touch the whole KV pool and every activation buffer at start-up, so the memory is
    /// resident from the first request on and does not grow with traffic (the server does).
    pub prefault: bool,
    /// Arithmetic of the matrix products (`--precision`); the library default is `F32`, exact
    /// against transformers' float32. A quantized model takes `Auto` only.
    pub precision: PrecisionChoice,
    /// Quantize the linear layers and the head at load (`--quantize`).
    pub quantize: Option<QuantFormat>,
    /// Called with (source bytes done, total) while quantizing.
    pub quantize_progress: Option<QuantizeProgress>,
    /// Snapshots of recurrent states kept for the prefix cache (`--state-snapshots`); `None`
    /// takes [`default_state_snapshots`]. 0 turns prefix reuse off for models with recurrent
    /// layers.
    pub state_snapshots: Option<usize>,
    /// Tokens proposed per decoding sequence and step by n-gram speculative decoding
    /// (`--speculative-tokens`, [`crate::speculative`]); 0 turns it off. A model with
    /// recurrent layers keeps a log of its convolution rows per sequence for it
    /// ([`crate::state_pool`]).
    pub speculative_tokens: usize,
    /// The most tokens a step computes for its decoding sequences and their proposals
    /// (`--speculative-step-tokens`): proposals stop there, so speculation fades out as the
    /// batch grows and is off once this many sequences decode. Past about as many tokens as
    /// prefill computes in the time a decode step reads the weights (15 to 20 on a CPU), a step
    /// is compute-bound, and a proposal costs about what a decoded token does.
    pub speculative_step_tokens: usize,
    /// A draft model's directory (`--draft-model`): a smaller model with the same vocabulary
    /// proposes the `speculative_tokens` tokens instead of the n-gram proposer
    /// ([`crate::draft`]). Only the batching engine runs it; it needs `speculative_tokens > 0`.
    pub draft_model: Option<PathBuf>,
    /// Positions the draft model's KV pool holds; `None`: as many as the target's pool plus one
    /// step's proposals per sequence. A sequence that finds no free draft block does not
    /// speculate in that step.
    pub draft_kv_tokens: Option<usize>,
    /// Speculative decoding with the checkpoint's own multi-token-prediction head (`--mtp`,
    /// [`crate::mtp`]): it proposes the `speculative_tokens` tokens instead of the n-gram
    /// proposer. The model must be loaded with its head (`LoadOptions::mtp`).
    pub mtp: bool,
}

/// A progress callback for the quantization at load: `(done, total)` source bytes.
#[derive(Clone)]
pub struct QuantizeProgress(pub Arc<dyn Fn(u64, u64) + Send + Sync>);

impl std::fmt::Debug for QuantizeProgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("QuantizeProgress")
    }
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            threads: 1,
            ctx_size: None,
            kv_budget: KvBudget::Default,
            kv_dtype: None,
            max_seqs: DEFAULT_MAX_SEQS,
            max_batch_tokens: DEFAULT_MAX_BATCH_TOKENS,
            block_size: None,
            chat_template_override: None,
            prefault: false,
            precision: PrecisionChoice::F32,
            quantize: None,
            quantize_progress: None,
            state_snapshots: None,
            speculative_tokens: 0,
            speculative_step_tokens: DEFAULT_SPECULATIVE_STEP_TOKENS,
            draft_model: None,
            draft_kv_tokens: None,
            mtp: false,
        }
    }
}

/// `f32`, `f16` or `bf16`.
pub fn dtype_name(dtype: WeightDType) -> &'static str {
    match dtype {
        WeightDType::F32 => "f32",
        WeightDType::F16 => "f16",
        WeightDType::BF16 => "bf16",
    }
}

/// Bytes the OS says can still be allocated (`MemAvailable`), where /proc tells.
pub fn memory_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// A byte count for messages: `1.50 GiB`, `12.0 MiB`.
pub fn human_bytes(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", b / (1u64 << 20) as f64)
    }
}

/// The allocators a sequence's blocks come from: the full pool's, and the sliding layers' pool
/// with its window when the model has one ([`KvGroups`]).
pub(crate) struct Allocs<'a> {
    pub full: &'a mut BlockAllocator,
    pub sliding: Option<(&'a mut BlockAllocator, usize)>,
}

/// The blocks of one sequence: its block table and the chained hashes of its registered blocks,
/// and, with a sliding pool, its table there.
///
/// The sliding table covers the same positions (block `i` holds positions `i·bs..(i+1)·bs` of
/// the sliding layers) but only from the block of the next query's window start: blocks wholly
/// below it are released as the sequence advances ([`NO_BLOCK`] in their place, never read by
/// attention), so a sequence holds at most its window plus one step of sliding positions. A
/// full sliding block is registered in the sliding pool's prefix cache under the same chained
/// hash as the full block of the same positions, so a prefix hit can be extended to the
/// sliding layers: a hit of `m` blocks is usable when the sliding blocks its window needs are
/// cached too.
#[derive(Debug, Default)]
pub(crate) struct SeqKv {
    pub blocks: Vec<u32>,
    /// `hashes[i]` is block `i`'s chained hash, for the full blocks registered so far.
    pub hashes: Vec<u64>,
    /// The sliding pool's table (empty without one).
    pub sliding: Vec<u32>,
}

/// The first block a query at position `pos` reads in a window of `window` positions.
fn window_first_block(pos: usize, window: usize, block_size: usize) -> usize {
    (pos + 1).saturating_sub(window) / block_size
}

impl SeqKv {
    pub fn with_capacity(max_blocks: usize) -> Self {
        SeqKv {
            blocks: Vec::with_capacity(max_blocks),
            hashes: Vec::with_capacity(max_blocks),
            sliding: Vec::with_capacity(max_blocks),
        }
    }

    /// Blocks still to allocate to hold positions `0..len`.
    pub fn missing(&self, len: usize, block_size: usize) -> usize {
        len.div_ceil(block_size).saturating_sub(self.blocks.len())
    }

    /// Allocates blocks until positions `0..len` are covered (in both pools); false (and
    /// nothing allocated) when too few blocks are free.
    pub fn grow(&mut self, a: &mut Allocs<'_>, len: usize, block_size: usize) -> bool {
        let missing = self.missing(len, block_size);
        let sliding_missing = len.div_ceil(block_size).saturating_sub(self.sliding.len());
        if missing > a.full.free() {
            return false;
        }
        if let Some((s, _)) = &a.sliding
            && sliding_missing > s.free()
        {
            return false;
        }
        for _ in 0..missing {
            match a.full.allocate() {
                Some(b) => self.blocks.push(b),
                None => return false,
            }
        }
        if let Some((s, _)) = &mut a.sliding {
            for _ in 0..sliding_missing {
                match s.allocate() {
                    Some(b) => self.sliding.push(b),
                    None => return false,
                }
            }
        }
        true
    }

    /// On an empty table: takes the cached blocks that hold a prefix of `tokens`, at most
    /// `limit` tokens' worth; returns the number of tokens they hold. With a sliding pool, the
    /// hit is cut back until the sliding blocks the next query's window reads are cached too.
    pub fn match_prefix(&mut self, a: &mut Allocs<'_>, tokens: &[u32], limit: usize, block_size: usize) -> usize {
        debug_assert!(self.blocks.is_empty() && self.sliding.is_empty());
        let mut parent = 0u64;
        for chunk in tokens[..limit.min(tokens.len())].chunks_exact(block_size) {
            match a.full.lookup(parent, chunk) {
                Some((b, h)) => {
                    self.blocks.push(b);
                    self.hashes.push(h);
                    parent = h;
                }
                None => break,
            }
        }
        if let Some((s, window)) = &mut a.sliding {
            let (window, bs) = (*window, block_size);
            let parent_of = |hashes: &[u64], i: usize| if i == 0 { 0 } else { hashes[i - 1] };
            // The longest hit whose window's sliding blocks are all cached.
            let mut m = self.blocks.len();
            while m > 0 {
                let first = window_first_block(m * bs, window, bs);
                let cached = (first..m).all(|i| s.peek(parent_of(&self.hashes, i), &tokens[i * bs..(i + 1) * bs]));
                if cached {
                    break;
                }
                m -= 1;
            }
            while self.blocks.len() > m {
                if let Some(b) = self.blocks.pop() {
                    a.full.release(b);
                }
            }
            self.hashes.truncate(m);
            let first = window_first_block(m * bs, window, bs).min(m);
            self.sliding.resize(first, NO_BLOCK);
            for i in first..m {
                let found = s.lookup(parent_of(&self.hashes, i), &tokens[i * bs..(i + 1) * bs]);
                // Checked by `peek` above, and nothing ran in between.
                self.sliding.push(found.map_or(NO_BLOCK, |(b, _)| b));
            }
        }
        self.blocks.len() * block_size
    }

    /// After `computed` tokens are in the cache: registers the full blocks not registered yet
    /// (in both pools), and releases the sliding blocks wholly below the window of the next
    /// query (position `computed`).
    pub fn advance(&mut self, a: &mut Allocs<'_>, tokens: &[u32], computed: usize, block_size: usize) {
        let full = (computed / block_size).min(self.blocks.len());
        while self.hashes.len() < full {
            let i = self.hashes.len();
            let parent = self.hashes.last().copied().unwrap_or(0);
            let ids = &tokens[i * block_size..(i + 1) * block_size];
            let h = a.full.register(self.blocks[i], parent, ids);
            if let Some((s, _)) = &mut a.sliding
                && let Some(&b) = self.sliding.get(i)
                && b != NO_BLOCK
            {
                s.register(b, parent, ids);
            }
            self.hashes.push(h);
        }
        if let Some((s, window)) = &mut a.sliding {
            let first = window_first_block(computed, *window, block_size).min(self.sliding.len());
            for b in &mut self.sliding[..first] {
                if *b != NO_BLOCK {
                    s.release(*b);
                    *b = NO_BLOCK;
                }
            }
        }
    }

    /// Keeps the first `keep` blocks and releases the rest; returns the blocks kept, fewer than
    /// `keep` when the sliding blocks the window of position `keep · bs` reads were released
    /// and are not cached any more (the rest is recomputed).
    pub fn truncate(&mut self, a: &mut Allocs<'_>, tokens: &[u32], keep: usize, block_size: usize) -> usize {
        let mut keep = keep.min(self.blocks.len());
        if let Some((s, window)) = &mut a.sliding {
            let bs = block_size;
            let parent_of = |hashes: &[u64], i: usize| if i == 0 { 0 } else { hashes[i - 1] };
            // Released sliding blocks of the window are taken back from the cache if they are
            // still there; otherwise the kept prefix shrinks until they are not needed.
            while keep > 0 {
                let first = window_first_block(keep * bs, *window, bs);
                let ok = (first..keep).all(|i| {
                    self.sliding.get(i).is_some_and(|&b| b != NO_BLOCK)
                        || (i < self.hashes.len() && s.peek(parent_of(&self.hashes, i), &tokens[i * bs..(i + 1) * bs]))
                });
                if ok {
                    for i in first..keep {
                        if self.sliding[i] == NO_BLOCK {
                            let found = s.lookup(parent_of(&self.hashes, i), &tokens[i * bs..(i + 1) * bs]);
                            self.sliding[i] = found.map_or(NO_BLOCK, |(b, _)| b);
                        }
                    }
                    break;
                }
                keep -= 1;
            }
            while self.sliding.len() > keep {
                if let Some(b) = self.sliding.pop()
                    && b != NO_BLOCK
                {
                    s.release(b);
                }
            }
        }
        while self.blocks.len() > keep {
            if let Some(b) = self.blocks.pop() {
                a.full.release(b);
            }
        }
        self.hashes.truncate(keep);
        keep
    }

    pub fn release_all(&mut self, a: &mut Allocs<'_>) {
        if let Some((s, _)) = &mut a.sliding {
            for b in self.sliding.drain(..) {
                if b != NO_BLOCK {
                    s.release(b);
                }
            }
        }
        while let Some(b) = self.blocks.pop() {
            a.full.release(b);
        }
        self.hashes.clear();
    }
}

/// The sliding layers' own KV pool and their window ([`KvGroups`]).
#[derive(Debug)]
pub(crate) struct SlidingPool {
    pub kv: KvPool,
    pub window: usize,
}

/// Everything a forward pass needs, planned once.
pub struct EngineCore {
    pub(crate) model: Model,
    pub(crate) pool: ThreadPool,
    pub(crate) kv: KvPool,
    /// The sliding layers' pool, when the model's sliding layers share one window.
    pub(crate) swa: Option<SlidingPool>,
    /// The recurrent layers' states (live and snapshots), when the model has any.
    pub(crate) states: Option<StatePool>,
    pub(crate) rope: Ropes,
    pub(crate) scratch: Scratch,
    pub(crate) plan: BatchPlan,
    pub(crate) text: Option<Arc<TextCodec>>,
    pub(crate) eos_ids: Vec<u32>,
    pub(crate) generation: GenerationDefaults,
    pub(crate) architecture: String,
    pub(crate) context: usize,
    pub(crate) max_seqs: usize,
    pub(crate) max_batch_tokens: usize,
    /// Logits rows a step can give to the prompt positions of requests that want their
    /// prompt's log-probabilities (beyond one row per sequence).
    pub(crate) prompt_rows: usize,
    /// Milliseconds spent quantizing the weights at load, if asked to.
    pub(crate) quantize_ms: Option<f64>,
    /// Tokens the n-gram proposer may propose per decoding sequence and step (0: off).
    pub(crate) speculative_tokens: usize,
    pub(crate) speculative_step_tokens: usize,
}

impl std::fmt::Debug for EngineCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineCore")
            .field("architecture", &self.architecture)
            .field("dims", self.model.dims())
            .field("context", &self.context)
            .field("kv_blocks", &self.kv.alloc.total())
            .finish()
    }
}

impl EngineCore {
    /// Binds the weights, builds the text codec, sizes the KV pool from the budget and plans
    /// every buffer.
    ///
    /// `CONFIG_INVALID` for a zero or too-large `ctx_size`, zero limits, or a KV budget too
    /// small for one sequence of the context (with the numbers); the binding errors of
    /// [`Model::new`].
    pub fn new(parts: ModelParts<'_>, opts: &EngineOptions) -> Result<Self> {
        let config = parts.config;
        let mut model = Model::new(config, parts.weights)?;
        let quantize_started = std::time::Instant::now();
        if let Some(format) = opts.quantize {
            let progress = opts.quantize_progress.as_ref().map(|p| p.0.clone());
            model.quantize(format, opts.threads.max(1), &|done, total| {
                if let Some(p) = &progress {
                    p(done, total)
                }
            })?;
        }
        // A published quantized checkpoint is decoded here: dequantized (`--precision f32`) or
        // repacked for the integer kernels, timed as a quantization.
        model.prepare_published(opts.precision, opts.threads.max(1))?;
        let quantize_ms = (opts.quantize.is_some() || config.published.is_some())
            .then(|| quantize_started.elapsed().as_secs_f64() * 1e3);
        model.set_precision(opts.precision)?;
        let max_pos = config.max_position_embeddings;
        let context = match opts.ctx_size {
            None => max_pos.min(DEFAULT_CONTEXT),
            Some(0) => return Err(KylinError::config_invalid("--ctx-size must be at least 1; got 0")),
            Some(n) if n > max_pos => {
                return Err(KylinError::config_invalid(format!(
                    "--ctx-size {n} exceeds the model's max_position_embeddings of {max_pos}; pass at most {max_pos}"
                )));
            }
            Some(n) => n,
        };
        let KvGeometry { dtype: kv_dtype, block_size, layout } = kv_geometry(&model, opts);
        for (name, value) in [
            ("--max-seqs", opts.max_seqs),
            ("--max-batch-tokens", opts.max_batch_tokens),
            ("--kv-block-size", block_size),
        ] {
            if value == 0 {
                return Err(KylinError::config_invalid(format!("{name} must be at least 1; got 0")));
            }
        }
        if block_size > 1024 {
            return Err(KylinError::config_invalid(format!(
                "--kv-block-size {block_size} is too large; pass at most 1024"
            )));
        }
        let max_seqs = opts.max_seqs.min(opts.max_batch_tokens);
        let max_batch_tokens = opts.max_batch_tokens.min(context.max(1) * max_seqs);
        let speculative_tokens = opts.speculative_tokens;
        if speculative_tokens > MAX_SPECULATIVE_TOKENS {
            return Err(KylinError::config_invalid(format!(
                "--speculative-tokens {speculative_tokens} is too large; pass at most {MAX_SPECULATIVE_TOKENS}"
            )));
        }
        // Logits rows beyond one per sequence: the prompt log-probabilities' share, and with
        // speculation, one row per proposal of every sequence (both drawn from one budget).
        let prompt_rows = prompt_logit_rows(model.dims().vocab)
            .saturating_add(max_seqs.saturating_mul(speculative_tokens))
            .min(max_batch_tokens);
        let mut scratch = model.plan_scratch_with_rows(max_batch_tokens, max_seqs, context, prompt_rows)?;
        // The sliding layers' pool holds what one step's queries can read: for each sequence
        // the window before its first query plus its share of the step. A sequence computing
        // `len` tokens holds at most `ceil((window - 1 + len) / bs) + 1` blocks, and the `len`
        // of one step add up to at most `max_batch_tokens`, so this many blocks never run out
        // (and never more than every sequence at the full context).
        let groups = model.kv_groups();
        let sliding_blocks = match groups.window {
            Some(window) if !groups.sliding.is_empty() => {
                let per_seq = (window - 1).div_ceil(block_size) + 2;
                let step = max_batch_tokens.div_ceil(block_size);
                let most = context.div_ceil(block_size) + 1;
                let blocks = per_seq
                    .checked_mul(max_seqs)
                    .and_then(|b| b.checked_add(step))
                    .map(|b| b.min(most.saturating_mul(max_seqs)));
                Some(blocks.ok_or_else(|| {
                    KylinError::config_invalid("the sliding-window KV pool overflows; pass a smaller --max-seqs")
                })?)
            }
            _ => None,
        };
        let sliding_bytes = sliding_blocks
            .map_or(Some(0), |n| KvPool::block_bytes(kv_dtype, &groups.sliding, block_size)?.checked_mul(n as u64));
        let sliding_bytes = sliding_bytes.ok_or_else(|| {
            KylinError::config_invalid("the sliding-window KV pool overflows; pass a smaller --max-seqs")
        })?;
        // The recurrent layers' state pool: a live state per sequence and the snapshots; like
        // the sliding pool, it comes out of the budget before the KV blocks.
        let recurrent = model.recurrent_layers();
        let state_plan = if recurrent.is_empty() {
            None
        } else {
            let chunk = state_chunk(block_size)?;
            let snapshots = opts.state_snapshots.unwrap_or_else(|| default_state_snapshots(max_seqs));
            let (live, snap) = StatePool::slot_bytes(&recurrent, chunk, speculative_rows(speculative_tokens));
            let bytes = live
                .checked_mul(max_seqs as u64)
                .and_then(|l| snap.checked_mul(snapshots as u64).and_then(|s| l.checked_add(s)))
                .ok_or_else(|| KylinError::config_invalid("the state pool overflows; pass a smaller --max-seqs"))?;
            Some((chunk, snapshots, bytes))
        };
        let state_bytes = state_plan.map_or(0, |p| p.2);
        let reserved = sliding_bytes.saturating_add(state_bytes);
        let n_blocks = kv_blocks(opts, kv_dtype, block_size, &model, &scratch, context, max_seqs, reserved)?;
        let mut states = match state_plan {
            Some((chunk, snapshots, _)) => {
                Some(StatePool::new(&recurrent, chunk, max_seqs, snapshots, speculative_rows(speculative_tokens))?)
            }
            None => None,
        };
        let mut kv = KvPool::new(kv_dtype, layout, n_blocks, block_size, &groups.full)?;
        let mut swa = match (sliding_blocks, groups.window) {
            (Some(blocks), Some(window)) => {
                let kv = KvPool::new(kv_dtype, layout, blocks, block_size, &groups.sliding)?;
                Some(SlidingPool { kv, window })
            }
            _ => None,
        };
        if opts.prefault {
            kv.prefault();
            if let Some(swa) = &mut swa {
                swa.kv.prefault();
            }
            if let Some(states) = &mut states {
                states.prefault();
            }
            scratch.prefault();
        }
        let max_blocks_per_seq = context.div_ceil(block_size) + 1;
        let plan = BatchPlan::with_capacity(max_batch_tokens, max_seqs, max_seqs * max_blocks_per_seq);
        let text = parts
            .tokenizer
            .map(|bundle| TextCodec::new(bundle, opts.chat_template_override.clone()).map(Arc::new))
            .transpose()?;
        Ok(EngineCore {
            rope: model.rope(context)?,
            model,
            pool: ThreadPool::new(opts.threads.max(1)),
            kv,
            swa,
            states,
            scratch,
            plan,
            text,
            eos_ids: parts.eos_ids,
            generation: parts.generation,
            architecture: config.architecture.hf_name().to_string(),
            context,
            max_seqs,
            max_batch_tokens,
            prompt_rows,
            quantize_ms,
            speculative_tokens,
            speculative_step_tokens: opts.speculative_step_tokens,
        })
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    pub fn context(&self) -> usize {
        self.context
    }

    /// The KV cache's element type.
    pub fn kv_dtype(&self) -> WeightDType {
        self.kv.dtype
    }

    pub fn block_size(&self) -> usize {
        self.kv.block_size
    }

    /// Rows the last layer computed output for in the last forward pass (only the rows whose
    /// logits were wanted, unless every hidden row is kept or every logit was asked for).
    pub fn last_layer_rows(&self) -> usize {
        self.scratch.last_layer_rows()
    }

    /// Bytes of the planned activation buffers.
    pub fn activation_bytes(&self) -> u64 {
        self.scratch.bytes()
    }

    /// Bytes of the KV pools (the full layers' and the sliding layers').
    pub fn kv_bytes(&self) -> u64 {
        self.kv.bytes() + self.swa.as_ref().map_or(0, |s| s.kv.bytes())
    }

    /// The most proposals a sequence whose last sampled token sits at `first` may verify in
    /// one step as far as its recurrent state goes ([`proposals_before_chunk_end`]; no limit
    /// without recurrent layers).
    fn proposal_room(&self, first: usize) -> usize {
        self.states.as_ref().map_or(usize::MAX, |s| proposals_before_chunk_end(first, s.chunk()))
    }

    /// The recurrent layers' state pool (`None` for a model without recurrent layers).
    pub fn state_pool(&self) -> Option<&StatePool> {
        self.states.as_ref()
    }

    /// Bytes of the recurrent layers' state pool (0 without one).
    pub fn state_bytes(&self) -> u64 {
        self.states.as_ref().map_or(0, StatePool::bytes)
    }

    /// A live state slot for a sequence entering the running set, zeroed; `NO_SLOT` for a
    /// model without recurrent layers, `None` when every slot is held.
    pub(crate) fn take_state_slot(&mut self) -> Option<u32> {
        match &mut self.states {
            None => Some(NO_SLOT),
            Some(states) => states.allocate(),
        }
    }

    /// Gives a sequence's live state slot back (nothing for `NO_SLOT`).
    pub(crate) fn release_state_slot(&mut self, slot: u32) {
        if let (Some(states), true) = (&mut self.states, slot != NO_SLOT) {
            states.release(slot);
        }
    }

    /// Keeps a snapshot of a sequence's state at its anchor (its last chunk boundary at or below
    /// `computed`, a block boundary), registered under the hash of the block that ends there, so
    /// a later prompt that begins with the same tokens starts from it. Nothing for a model
    /// without recurrent layers, at position 0, or when that block is not registered yet.
    pub(crate) fn snapshot_state(&mut self, kv: &SeqKv, slot: u32, computed: usize) {
        let bs = self.kv.block_size;
        let Some(states) = &mut self.states else { return };
        if slot == NO_SLOT {
            return;
        }
        let anchor = computed / states.chunk() * states.chunk();
        if anchor == 0 || anchor / bs > kv.hashes.len() {
            return;
        }
        states.store_snapshot(slot, kv.hashes[anchor / bs - 1], anchor);
    }

    /// After a prefix match put cached blocks in `kv`: cuts the match back to the longest
    /// prefix whose recurrent state a snapshot holds and puts that state into `slot` (or, with
    /// none, releases the blocks and zeroes the state); returns the tokens that are computed.
    /// For a model without recurrent layers, the match as it is.
    pub(crate) fn resume_state(&mut self, kv: &mut SeqKv, slot: u32, tokens: &[u32]) -> usize {
        let bs = self.kv.block_size;
        let matched = kv.blocks.len().min(kv.hashes.len());
        let Some(states) = &mut self.states else { return kv.blocks.len() * bs };
        let mut keep = 0;
        for m in (1..=matched).rev() {
            let pos = m * bs;
            if pos.is_multiple_of(states.chunk()) && states.restore_snapshot(kv.hashes[m - 1], pos, slot) {
                keep = m;
                break;
            }
        }
        if keep == 0 {
            states.reset(slot);
        }
        let kept = kv.truncate(&mut self.allocs(), tokens, keep, bs);
        debug_assert_eq!(kept, keep);
        kept * bs
    }

    /// Bytes of the sliding layers' own pool (0 without one).
    pub fn sliding_kv_bytes(&self) -> u64 {
        self.swa.as_ref().map_or(0, |s| s.kv.bytes())
    }

    /// Blocks of the sliding layers' pool that sequences hold now (0 without the pool).
    pub fn sliding_blocks_in_use(&self) -> usize {
        self.swa.as_ref().map_or(0, |s| s.kv.alloc.total() - s.kv.alloc.free())
    }

    /// The allocators a sequence's blocks come from.
    pub(crate) fn allocs(&mut self) -> Allocs<'_> {
        Allocs { full: &mut self.kv.alloc, sliding: self.swa.as_mut().map(|s| (&mut s.kv.alloc, s.window)) }
    }

    /// Blocks with no reference (free or holding an evictable cached prefix).
    pub fn free_blocks(&self) -> usize {
        self.kv.alloc.free()
    }

    pub fn total_blocks(&self) -> usize {
        self.kv.alloc.total()
    }

    /// Runs the current plan (RoPE prepared up to the plan's last position).
    pub(crate) fn forward(&mut self, all_logits: Option<&mut [f32]>) {
        let sliding = self.swa.as_mut().map(|s| &mut s.kv);
        self.model.forward_plan(
            &self.pool,
            &mut self.kv,
            sliding,
            self.states.as_mut(),
            &mut self.rope,
            &mut self.scratch,
            &self.plan,
            all_logits,
        );
    }

    /// Logits row `row` of the last forward pass.
    pub(crate) fn logits(&self, row: usize) -> &[f32] {
        self.scratch.logits(row, self.model.dims().vocab)
    }

    pub(crate) fn info(&self, backend: &str) -> EngineInfo {
        let bs = self.kv.block_size;
        EngineInfo {
            backend: backend.to_string(),
            architecture: self.architecture.clone(),
            vocab_size: self.model.dims().vocab,
            context_size: self.context,
            max_seqs: self.max_seqs,
            max_batch_tokens: self.max_batch_tokens,
            kv_block_size: bs,
            kv_blocks: self.kv.alloc.total(),
            kv_tokens: self.kv.alloc.total() * bs,
            // Both pools: the full layers' (every position of `kv_tokens`) and the sliding
            // layers' window pool.
            kv_bytes: self.kv_bytes(),
            kv_dtype: dtype_name(self.kv.dtype).to_string(),
            threads: self.pool.threads(),
            precision: self.model.precision_name().to_string(),
            kernels: self.model.kernels_report(self.kv.dtype, self.kv.block_size),
            has_tokenizer: self.text.is_some(),
            eos_ids: self.eos_ids.clone(),
            state_pool: self.states.as_ref().map(|s| {
                let (live_bytes, snapshot_bytes) =
                    StatePool::slot_bytes(&self.model.recurrent_layers(), s.chunk(), s.speculative_rows());
                StatePoolInfo {
                    live_slots: s.live_slots(),
                    snapshots: s.snapshot_slots(),
                    live_bytes,
                    snapshot_bytes,
                    bytes: s.bytes(),
                    chunk: s.chunk(),
                }
            }),
        }
    }

    /// The text codec, or `CONFIG_MISSING` when the model directory has no tokenizer.
    pub fn text(&self) -> Result<&TextCodec> {
        self.text.as_deref().ok_or_else(|| {
            KylinError::config_missing(
                "model has no tokenizer (tokenizer.json or vocab.json + merges.txt); \
                 pass token ids instead of text, or add the tokenizer files to the model directory",
            )
        })
    }
}

/// The number of KV blocks the budget buys; `CONFIG_INVALID` if fewer than one sequence of the
/// context needs.
#[allow(clippy::too_many_arguments)]
fn kv_blocks(
    opts: &EngineOptions,
    kv_dtype: WeightDType,
    bs: usize,
    model: &Model,
    scratch: &Scratch,
    context: usize,
    max_seqs: usize,
    reserved_bytes: u64,
) -> Result<usize> {
    // The sliding layers' pool and the recurrent layers' states come out of the budget first.
    let sliding_bytes = reserved_bytes;
    let full = model.kv_groups().full;
    let per_seq = context.div_ceil(bs);
    if full.is_empty() {
        // Every layer slides: the full pool holds no bytes, only the block table bookkeeping
        // (prefix cache, scheduling) of `max_seqs` full-context sequences; the sliding pool
        // is the memory, and it must fit the budget.
        if let KvBudget::Bytes(bytes) = opts.kv_budget
            && bytes < sliding_bytes
        {
            return Err(KylinError::config_invalid(format!(
                "--kv-memory {} is below the sliding-window KV pool and recurrent states of {} ({max_seqs} sequences); raise it or lower --max-seqs",
                human_bytes(bytes),
                human_bytes(sliding_bytes)
            )));
        }
        return Ok(per_seq.saturating_mul(max_seqs).min(u32::MAX as usize - 1));
    }
    let per_block = KvPool::block_bytes(kv_dtype, &full, bs)
        .filter(|&b| b > 0)
        .ok_or_else(|| KylinError::config_invalid("the KV block size overflows; pass a smaller --kv-block-size"))?;
    let after_weights = || {
        memory_available().map(|m| {
            m.saturating_sub(model.weight_bytes_resident())
                .saturating_sub(scratch.bytes())
                .saturating_sub(sliding_bytes)
        })
    };
    let too_small = |what: String, blocks: u64| {
        KylinError::config_invalid(format!(
            "{what} holds {blocks} KV blocks of {bs} positions ({} tokens, {} per block in {}), but one sequence of \
             the context ({context} tokens) needs {per_seq} blocks ({}); raise the budget or lower --ctx-size",
            blocks * bs as u64,
            human_bytes(per_block),
            dtype_name(kv_dtype),
            human_bytes(per_seq as u64 * per_block)
        ))
    };
    let blocks = match opts.kv_budget {
        KvBudget::Bytes(bytes) => {
            // The sliding layers' pool comes out of the budget first.
            let blocks = bytes.saturating_sub(sliding_bytes) / per_block;
            if blocks < per_seq as u64 {
                return Err(too_small(format!("--kv-memory {}", human_bytes(bytes)), blocks));
            }
            blocks
        }
        KvBudget::Fraction(f) => {
            if !(f > 0.0 && f <= 1.0) {
                return Err(KylinError::config_invalid(format!("--memory-fraction must be in (0, 1]; got {f}")));
            }
            let available = after_weights().ok_or_else(|| {
                KylinError::config_invalid(
                    "--memory-fraction needs the available memory, which /proc/meminfo does not tell here; pass --kv-memory",
                )
            })?;
            let bytes = (available as f64 * f) as u64;
            let blocks = bytes / per_block;
            if blocks < per_seq as u64 {
                return Err(too_small(
                    format!("--memory-fraction {f} of {} available after the weights", human_bytes(available)),
                    blocks,
                ));
            }
            blocks
        }
        KvBudget::Default => {
            let wanted = (per_seq as u64).saturating_mul(max_seqs as u64);
            let cap = after_weights().map_or(wanted, |a| (a as f64 * DEFAULT_MEMORY_SHARE) as u64 / per_block);
            wanted.min(cap).max(per_seq as u64)
        }
    };
    usize::try_from(blocks.min(u32::MAX as u64 - 1))
        .map_err(|_| KylinError::config_invalid("the KV budget overflows; pass a smaller --kv-memory"))
}

/// Where a sequence is in its life.
#[derive(Debug)]
struct Seq {
    request: u64,
    index: usize,
    /// Prompt, then generated ids; the last one is not computed yet once decoding.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Tokens whose keys and values are in the cache.
    computed: usize,
    kv: SeqKv,
    decoding: Decoding,
    /// The request, kept by a choice-0 sequence whose `n - 1` siblings fork after its prompt.
    fork: Option<Box<Request>>,
    cancel: crate::serving::CancelHandle,
    /// Prompt tokens the prefix cache supplied at its first admission.
    cached_prompt: Option<usize>,
    /// With prompt log-probabilities: the first prompt position whose logits are still to be
    /// scored (position `p` scores token `p + 1`); positions below it were reported.
    next_scored: usize,
    /// Its live slot in the recurrent layers' state pool while it runs (`NO_SLOT` otherwise,
    /// and always for a model without recurrent layers).
    state: u32,
    /// What the request returns at its last prompt position instead of generating.
    pooling: Option<Pooled>,
    /// With speculative decoding: the segment a speculating step computes, its last sampled
    /// token followed by the proposals (room for `1 + speculative_tokens` planned up front).
    draft: Vec<u32>,
    /// How many tokens it proposes next (adapted to how its proposals fared).
    speculation: SpeculationControl,
    /// The most proposals per step the request allows (its `speculative_tokens`, else the
    /// engine's).
    speculation_limit: usize,
    /// With a draft model: the sequence's keys and values in the draft's pool, and how many of
    /// its tokens they hold (empty otherwise, and whenever the sequence is not running).
    draft_kv: DraftSeq,
    /// With an MTP head: the sequence's keys and values in the head's pool (empty otherwise,
    /// and whenever the sequence is not running).
    mtp: MtpSeq,
    /// The head's row, in the pass that caught up on the sequence's last computed position,
    /// that gives its first proposal (valid while no other head pass ran and the sequence
    /// holds as many tokens as then).
    mtp_row: Option<MtpRow>,
    /// The prompt's images, encoded, in prompt order (shared by a request's choices).
    images: Arc<[SeqImage]>,
}

/// Where a sequence's first MTP proposal is: logits row `row` of head pass `pass`, made when the
/// sequence held `tokens` tokens.
#[derive(Debug, Clone, Copy)]
struct MtpRow {
    row: usize,
    pass: u64,
    tokens: usize,
}

/// An image of a sequence's prompt: where its placeholder tokens are and what replaces them.
#[derive(Debug)]
struct SeqImage {
    /// Index of its first placeholder token in the prompt.
    start: usize,
    /// Its tokens: rows times columns of merged patches.
    tokens: usize,
    rows: usize,
    columns: usize,
    /// The tower's output, `(tokens, hidden)`.
    embedding: Arc<[f32]>,
    /// A hash of its pixels and grid, from which its tokens' ids in the sequence are made.
    content: u64,
    /// The placeholder token its tokens stand for in the request's prompt.
    placeholder: u32,
}

/// Ids from here up in a sequence's tokens are an image's tokens ([`image_token_id`]).
const IMAGE_IDS: u32 = 0x8000_0000;

/// The id a sequence holds for token `k` of an image with content hash `content`: past every
/// vocabulary (the forward pass takes the image's row for it), and a function of the image's
/// content, so the prefix cache, keyed by ids, finds a repeated image and never confuses two.
fn image_token_id(content: u64, k: usize) -> u32 {
    let mixed = (content ^ (k as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    IMAGE_IDS | (mixed >> 33) as u32
}

impl Seq {
    /// Gives the sequence its prompt's images: their placeholder tokens become ids made from
    /// each image's content ([`image_token_id`]).
    fn attach_images(&mut self, images: Arc<[SeqImage]>) {
        for image in images.iter() {
            for k in 0..image.tokens {
                self.tokens[image.start + k] = image_token_id(image.content, k);
            }
        }
        self.images = images;
    }

    /// The multimodal rotary position (time, row, column) of token `index`, as transformers'
    /// `get_rope_index` gives it: text tokens take one position on every axis, counting on from
    /// the previous token; an image's tokens take the position after the text before it plus
    /// their row and column; the text after an image continues after its larger side.
    fn rope_position(&self, index: usize) -> [u32; 3] {
        let mut shift = 0isize;
        for image in self.images.iter() {
            if index < image.start {
                break;
            }
            if index < image.start + image.tokens {
                let base = (image.start as isize + shift) as u32;
                let k = index - image.start;
                return [base, base + (k / image.columns) as u32, base + (k % image.columns) as u32];
            }
            shift += image.rows.max(image.columns) as isize - image.tokens as isize;
        }
        let p = (index as isize + shift) as u32;
        [p, p, p]
    }

    /// Plans the multimodal inputs of the segment about to be pushed: tokens `from..from + n`
    /// of the sequence (or its proposals after `from`), the first at `t0` in the plan: their
    /// rotary positions with `rope`, how far each attends with `bidirectional`, and the image
    /// rows of its image tokens.
    fn plan_multimodal(&self, plan: &mut BatchPlan, t0: usize, from: usize, n: usize, rope: bool, bidirectional: bool) {
        if rope {
            for i in 0..n {
                plan.positions.push(self.rope_position(from + i));
            }
        }
        if bidirectional {
            // An image's tokens see every token of their image (Gemma 3, and Gemma 4 on its
            // sliding layers); the rest, up to themselves.
            for index in from..from + n {
                let image = self.images.iter().find(|i| (i.start..i.start + i.tokens).contains(&index));
                plan.attend_until.push(image.map_or(index + 1, |i| i.start + i.tokens) as u32);
            }
        }
        for image in self.images.iter() {
            let (lo, hi) = (image.start.max(from), (image.start + image.tokens).min(from + n));
            for index in lo..hi {
                plan.embedding_rows.push(EmbeddingRow {
                    t: t0 + index - from,
                    rows: image.embedding.clone(),
                    row: index - image.start,
                });
            }
        }
    }

    fn is_decoding(&self) -> bool {
        self.computed + 1 == self.tokens.len() && self.computed >= self.prompt_len
    }

    /// True while some prompt position's log-probability is wanted and not reported yet:
    /// the sequence's chunks then ask for the logits of every token.
    fn scores_prompt(&self) -> bool {
        self.decoding.prompt_logprobs().is_some() && self.next_scored + 1 < self.prompt_len
    }
}

/// One scheduled piece of work: running sequence `slot` computes `len` tokens.
#[derive(Debug, Clone, Copy)]
struct Scheduled {
    slot: usize,
    len: usize,
    /// The logits row of the last token, when it samples.
    logits_row: Option<usize>,
    /// The chunk wants every token's logits (prompt log-probabilities); the first token's row.
    all_rows: bool,
    first_row: usize,
    /// Tokens proposed after the sequence's last sampled token (its `draft`): the segment is
    /// the draft, `1 + proposed` tokens with every row's logits, verified after the forward.
    proposed: usize,
    /// The segment's first position in the sequence and its first token in the plan.
    start: usize,
    t0: usize,
}

/// A sequence the draft model proposes for in this step: `scheduled[i]`, `k` proposals, and
/// the logits row of the draft's last pass that gives its next one.
#[derive(Debug, Clone, Copy)]
struct DraftJob {
    i: usize,
    k: usize,
    row: usize,
}

impl Scheduled {
    fn new(slot: usize, len: usize, all_rows: bool) -> Self {
        Scheduled { slot, len, logits_row: None, all_rows, first_row: 0, proposed: 0, start: 0, t0: 0 }
    }
}

/// The continuous-batching engine (see the module documentation).
pub struct BatchEngine {
    core: EngineCore,
    /// Running sequences in admission order (the last is preempted first).
    running: Vec<Seq>,
    waiting: VecDeque<Seq>,
    scheduled: Vec<Scheduled>,
    /// Slots of running sequences that finished in this step.
    finished: Vec<usize>,
    stats: EngineStats,
    /// Generation, embeddings or reranking (the directory's files, or `--task`).
    task: ModelTask,
    /// Events of other requests produced while [`Serving::embed`] or [`Serving::rerank`] ran
    /// steps; the next [`Serving::step`] hands them out first.
    held: Vec<Event>,
    /// The id of the next request the engine makes for itself (embedding and reranking
    /// inputs), counting up from [`INTERNAL_IDS`].
    next_internal_id: u64,
    /// The draft model that proposes speculative tokens (`--draft-model`), if any.
    draft: Option<DraftModel>,
    /// A proposer the embedding program set in place of the n-gram proposer, if any.
    proposer: Option<Box<dyn Proposer>>,
    /// The sequences the draft or the MTP head proposes for in the current step (room for
    /// `max_seqs`).
    draft_jobs: Vec<DraftJob>,
    /// The checkpoint's MTP head proposing speculative tokens (`--mtp`), if any.
    mtp: Option<MtpDraft>,
    /// The vision tower that encodes a prompt's images, for a vision-language directory whose
    /// tower Kylin runs.
    vision: Option<VisionTower>,
    /// What turns its image files into image inputs.
    image_preparer: Option<Arc<ImagePreparer>>,
    /// Requests whose images are being encoded, a step's share at a time, in arrival order;
    /// each waits to run once its images are done.
    encoding: VecDeque<PendingImages>,
    /// The latest images' encodings by content hash (most recent last), so an image sent again
    /// (the next turn of a chat) is not encoded again.
    image_cache: VecDeque<(u64, Arc<[f32]>)>,
}

/// Encodings of images the engine keeps for images sent again.
const IMAGE_CACHE: usize = 32;

/// A request's first sequence while its images are encoded.
struct PendingImages {
    seq: Seq,
    images: Vec<ImageInput>,
    /// Where each image's placeholder run is in the prompt, and its length.
    runs: Vec<(usize, usize)>,
    done: Vec<SeqImage>,
    /// The image being encoded and its content hash.
    current: Option<(Encoding, u64)>,
}

impl PendingImages {
    /// Image `k` with its encoding, as the sequence holds it.
    fn image_done(&self, k: usize, embedding: Arc<[f32]>, content: u64, merge: usize, placeholder: u32) -> SeqImage {
        let (start, tokens) = self.runs[k];
        let grid = self.images[k].grid;
        SeqImage { start, tokens, rows: grid.h / merge, columns: grid.w / merge, embedding, content, placeholder }
    }
}

/// A hash of an image's grid and pixels.
fn image_content(image: &ImageInput) -> u64 {
    let mut hasher = std::hash::DefaultHasher::new();
    std::hash::Hash::hash(&image.grid, &mut hasher);
    for v in image.pixels.iter() {
        std::hash::Hash::hash(&v.to_bits(), &mut hasher);
    }
    std::hash::Hasher::finish(&hasher)
}

/// Request ids from here up are the engine's own (the pooled requests behind
/// [`Serving::embed`] and [`Serving::rerank`]); callers number theirs below.
pub const INTERNAL_IDS: u64 = 1 << 63;

impl std::fmt::Debug for BatchEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchEngine")
            .field("core", &self.core)
            .field("running", &self.running.len())
            .field("waiting", &self.waiting.len())
            .finish()
    }
}

impl BatchEngine {
    /// Builds the engine for a model from [`kylin_loader::load`].
    pub fn new(model: LoadedModel, opts: &EngineOptions) -> Result<Self> {
        let LoadedModel { format, config, weights, tokenizer, generation, eos_ids, task, vision, mtp, .. } = model;
        let parts =
            ModelParts { config: &config, weights: &weights, tokenizer: tokenizer.as_ref(), generation, eos_ids };
        let mut engine = BatchEngine::build(parts, opts, format.dir(), mtp.as_ref())?;
        engine.task = task;
        engine.vision = vision.as_ref().map(VisionTower::new).transpose()?;
        let token_text = |id: u32| tokenizer.as_ref().and_then(|t| t.tokenizer.id_to_token(id));
        engine.image_preparer = match &vision {
            Some(v) => ImagePreparer::new(v, &token_text)?.map(Arc::new),
            None => None,
        };
        Ok(engine)
    }

    /// Builds the engine from bound parts (a draft model's messages then call the target "the
    /// target model": its directory is not known here).
    pub fn from_parts(parts: ModelParts<'_>, opts: &EngineOptions) -> Result<Self> {
        BatchEngine::build(parts, opts, None, None)
    }

    fn build(
        parts: ModelParts<'_>,
        opts: &EngineOptions,
        target_path: Option<&Path>,
        mtp_head: Option<&kylin_loader::mtp::MtpHead>,
    ) -> Result<Self> {
        let tokenizer = parts.tokenizer;
        let mut core = EngineCore::new(parts, opts)?;
        let max_seqs = core.max_seqs;
        let draft = match &opts.draft_model {
            None => None,
            Some(_) if core.speculative_tokens == 0 => {
                return Err(KylinError::config_invalid(
                    "--draft-model needs --speculative-tokens of at least 1 (the draft tokens per step)",
                ));
            }
            Some(dir) => {
                let target = DraftTarget {
                    path: target_path,
                    vocab: core.model.dims().vocab,
                    tokenizer,
                    kv_tokens: core.kv.alloc.total() * core.kv.block_size,
                };
                Some(DraftModel::load(dir, &target, opts, core.context, max_seqs, core.max_batch_tokens)?)
            }
        };
        let mtp = match (opts.mtp, mtp_head) {
            (false, _) => None,
            (true, _) if core.speculative_tokens == 0 => {
                return Err(KylinError::config_invalid(
                    "--mtp needs --speculative-tokens of at least 1 (the tokens the MTP head proposes per step)",
                ));
            }
            (true, _) if draft.is_some() => {
                return Err(KylinError::config_invalid(
                    "--mtp and --draft-model both propose speculative tokens; set one or the other",
                ));
            }
            (true, None) => {
                return Err(KylinError::tensor_missing(
                    "--mtp: the model was loaded without its multi-token-prediction head (load it with LoadOptions::mtp)",
                ));
            }
            (true, Some(head)) => {
                // What the target's pool holds, plus one step's proposals per sequence; passes
                // catch up on a whole step's tokens, and on what the prefix cache gave.
                let slack = (core.speculative_tokens + 1).saturating_mul(max_seqs);
                let kv_tokens = (core.kv.alloc.total() * core.kv.block_size).saturating_add(slack);
                let max_tokens = core.max_batch_tokens.saturating_mul(2);
                let mut mtp = MtpDraft::new(head, opts, core.context, max_seqs, max_tokens, kv_tokens)?;
                mtp.share_lm_head(&core.model);
                // The head reads the target's final hidden row of every position it catches up on.
                core.scratch.keep_every_hidden_row();
                Some(mtp)
            }
        };
        Ok(BatchEngine {
            core,
            running: Vec::with_capacity(max_seqs),
            waiting: VecDeque::with_capacity(64),
            scheduled: Vec::with_capacity(max_seqs),
            finished: Vec::with_capacity(max_seqs),
            stats: EngineStats::default(),
            task: ModelTask::Generate,
            held: Vec::new(),
            next_internal_id: INTERNAL_IDS,
            draft_jobs: Vec::with_capacity(if draft.is_some() || mtp.is_some() { max_seqs } else { 0 }),
            draft,
            mtp,
            proposer: None,
            vision: None,
            image_preparer: None,
            encoding: VecDeque::new(),
            image_cache: VecDeque::with_capacity(IMAGE_CACHE),
        })
    }

    pub fn core(&self) -> &EngineCore {
        &self.core
    }

    /// Proposes speculative tokens with `proposer` in place of the n-gram proposer.
    /// `CONFIG_INVALID` when speculation is off (`speculative_tokens` 0) or a draft model
    /// proposes.
    pub fn set_proposer(&mut self, proposer: Box<dyn Proposer>) -> Result<()> {
        if self.core.speculative_tokens == 0 {
            return Err(KylinError::config_invalid(
                "a proposer needs --speculative-tokens of at least 1 (the proposals per step)",
            ));
        }
        if self.draft.is_some() || self.mtp.is_some() {
            return Err(KylinError::config_invalid(
                "a draft model or an MTP head proposes already (--draft-model, --mtp); set one or the other",
            ));
        }
        self.proposer = Some(proposer);
        Ok(())
    }

    /// The draft model proposing speculative tokens (`--draft-model`), if any.
    pub fn draft(&self) -> Option<&DraftModel> {
        self.draft.as_ref()
    }

    /// The MTP head proposing speculative tokens (`--mtp`), if any.
    pub fn mtp(&self) -> Option<&MtpDraft> {
        self.mtp.as_ref()
    }

    /// A fresh sequence for choice `index` of `request`, with nothing computed.
    fn new_seq(&self, request: &Request, index: usize) -> Seq {
        let core = &self.core;
        let cap =
            request.prompt_ids.len().saturating_add(request.max_new_tokens).saturating_add(1).min(core.context + 1);
        let mut tokens = Vec::with_capacity(cap);
        tokens.extend_from_slice(&request.prompt_ids);
        Seq {
            request: request.id,
            index,
            tokens,
            prompt_len: request.prompt_ids.len(),
            computed: 0,
            kv: SeqKv::with_capacity(core.context.div_ceil(core.kv.block_size) + 1),
            decoding: Decoding::new(request, index, core.model.dims().vocab, &core.eos_ids),
            fork: None,
            cancel: request.cancel.clone(),
            cached_prompt: None,
            // Choice 0 reports the prompt's log-probabilities; its siblings have nothing to score.
            next_scored: if index == 0 { 0 } else { request.prompt_ids.len() },
            state: NO_SLOT,
            pooling: request.pooling.clone(),
            draft: Vec::with_capacity(if core.speculative_tokens > 0 { core.speculative_tokens + 1 } else { 0 }),
            speculation: SpeculationControl::default(),
            speculation_limit: request
                .speculative_tokens
                .unwrap_or(core.speculative_tokens)
                .min(core.speculative_tokens),
            draft_kv: self.draft.as_ref().map_or_else(DraftSeq::default, DraftModel::new_seq),
            mtp: self.mtp.as_ref().map_or_else(MtpSeq::default, MtpDraft::new_seq),
            mtp_row: None,
            images: Arc::from(Vec::new()),
        }
    }

    /// Checks a request's images against its prompt: one run of the image placeholder token
    /// per image, as long as the tokens the image becomes; returns the runs.
    fn check_images(&self, request: &Request) -> Result<Vec<(usize, usize)>> {
        if request.images.is_empty() {
            return Ok(Vec::new());
        }
        let Some(tower) = &self.vision else {
            return Err(KylinError::input_invalid(
                "this model takes no images: it has no vision tower Kylin runs (images run on Qwen3.5, Gemma 3 and Gemma 4 vision-language directories)",
            ));
        };
        let placeholder = tower.config().image_token_id;
        let prompt = &request.prompt_ids;
        let mut runs = Vec::new();
        let mut i = 0;
        while i < prompt.len() {
            if prompt[i] == placeholder {
                let start = i;
                while i < prompt.len() && prompt[i] == placeholder {
                    i += 1;
                }
                runs.push((start, i - start));
            } else {
                i += 1;
            }
        }
        if runs.len() != request.images.len() {
            return Err(KylinError::input_invalid(format!(
                "the prompt has {} run(s) of the image token {placeholder} for {} image(s); expected one run per image",
                runs.len(),
                request.images.len()
            )));
        }
        for (n, (&(_, len), image)) in runs.iter().zip(&request.images).enumerate() {
            tower.check(&image.pixels, image.grid)?;
            let tokens = tower.tokens(image.grid);
            if len != tokens {
                return Err(KylinError::input_invalid(format!(
                    "image {n} of the prompt ({} x {} patches) becomes {tokens} tokens, but its run of image tokens has {len}",
                    image.grid.h, image.grid.w
                )));
            }
            if image.grid.t != 1 {
                return Err(KylinError::input_invalid(format!(
                    "image {n} has {} frames; an image has one (videos are not supported)",
                    image.grid.t
                )));
            }
            if tower.config().image_tokens_bidirectional() && tokens > self.core.max_batch_tokens {
                return Err(KylinError::input_invalid(format!(
                    "image {n} becomes {tokens} tokens, which attend to each other and so run in one step, \
                     but a step holds {} tokens; raise --max-batch-tokens to at least {tokens}",
                    self.core.max_batch_tokens
                )));
            }
            if tower.config().image_tokens_bidirectional()
                && request.prompt_logprobs.is_some()
                && tokens > self.core.prompt_rows
            {
                return Err(KylinError::input_invalid(format!(
                    "prompt log-probabilities over image {n} ({tokens} tokens, which run in one step) need {tokens} \
                     logits rows in one step; this model computes at most {} (its vocabulary is large); \
                     ask without prompt_logprobs",
                    self.core.prompt_rows
                )));
            }
        }
        Ok(runs)
    }

    /// Encodes the waiting requests' images, oldest request first; a request whose images are
    /// all done goes to the waiting queue. Beside running sequences a step runs about
    /// [`vision::STEP_MACS`] multiply-adds of the tower (units of a block: the projections or
    /// MLP of [`vision::UNIT_ROWS`] patches, or one head's attention), so their tokens are
    /// delayed by that much at a time. With nothing else running, a step runs
    /// [`vision::ALONE_STEP_MACS`] in units of the whole image (faster), so a request that
    /// arrives meanwhile starts within about a second, not after the whole tower.
    fn encode_step(&mut self) {
        let Some(tower) = &self.vision else { return };
        let (mut left, unit_rows) = match self.running.is_empty() {
            true => (vision::ALONE_STEP_MACS, usize::MAX),
            false => (vision::STEP_MACS, vision::UNIT_ROWS),
        };
        let merge = tower.config().spatial_merge_size;
        let placeholder = tower.config().image_token_id;
        while left > 0 {
            let Some(front) = self.encoding.front_mut() else { break };
            if front.seq.cancel.is_cancelled() {
                // Ended by the scheduler with the other cancelled waiting sequences.
                if let Some(p) = self.encoding.pop_front() {
                    self.waiting.push_back(p.seq);
                }
                continue;
            }
            let k = front.done.len();
            if front.current.is_none() {
                if k == front.images.len() {
                    if let Some(mut p) = self.encoding.pop_front() {
                        p.seq.attach_images(Arc::from(p.done));
                        self.waiting.push_back(p.seq);
                    }
                    continue;
                }
                let image = &front.images[k];
                let content = image_content(image);
                if let Some(at) = self.image_cache.iter().position(|(h, _)| *h == content) {
                    if let Some(entry) = self.image_cache.remove(at) {
                        front.done.push(front.image_done(k, entry.1.clone(), content, merge, placeholder));
                        self.image_cache.push_back(entry);
                        self.stats.image_cache_hits += 1;
                    }
                    continue;
                }
                let started = std::time::Instant::now();
                let begun = tower.begin(&self.core.pool, &image.pixels, image.grid);
                self.stats.image_encode_seconds += started.elapsed().as_secs_f64();
                match begun {
                    Ok(encoding) => front.current = Some((encoding, content)),
                    // Checked when the request came; should it fail, the request ends.
                    Err(_) => {
                        front.seq.cancel.cancel();
                        continue;
                    }
                }
            }
            let Some((encoding, content)) = &mut front.current else { continue };
            let started = std::time::Instant::now();
            let done = tower.advance(&self.core.pool, encoding, &mut left, unit_rows);
            self.stats.image_encode_seconds += started.elapsed().as_secs_f64();
            if let Some(out) = done {
                self.stats.images_encoded += 1;
                let content = *content;
                let embedding: Arc<[f32]> = Arc::from(out);
                front.done.push(front.image_done(k, embedding.clone(), content, merge, placeholder));
                front.current = None;
                if self.image_cache.len() == IMAGE_CACHE {
                    self.image_cache.pop_front();
                }
                self.image_cache.push_back((content, embedding));
            }
        }
    }

    /// A running sequence leaves the running set (it ends or is preempted): its state is kept
    /// as a snapshot at its anchor for a later prompt or its own recomputation, then its slot
    /// and blocks are released.
    fn leave(&mut self, seq: &mut Seq) {
        if seq.state != NO_SLOT {
            self.core.snapshot_state(&seq.kv, seq.state, seq.computed);
            self.core.release_state_slot(seq.state);
            seq.state = NO_SLOT;
        }
        seq.kv.release_all(&mut self.core.allocs());
        if let Some(draft) = &mut self.draft {
            draft.release(&mut seq.draft_kv);
        }
        if let Some(mtp) = &mut self.mtp {
            mtp.release(&mut seq.mtp);
        }
        seq.mtp_row = None;
    }

    /// Ends a sequence that is not running (waiting or never admitted).
    fn end_waiting(&mut self, mut seq: Seq, reason: StopReason, events: &mut Vec<Event>) {
        self.leave(&mut seq);
        let text = self.core.text.as_deref();
        if let Ok(kind) = seq.decoding.finish(reason, text) {
            events.push(Event { request: seq.request, index: seq.index, kind });
        }
        if let Some(request) = seq.fork.take() {
            end_unforked(&request, reason, events);
        }
    }

    /// Moves the last running sequence back to the front of the queue, its blocks released.
    fn preempt_last(&mut self) {
        if let Some(mut seq) = self.running.pop() {
            self.leave(&mut seq);
            seq.computed = 0;
            self.stats.preemptions += 1;
            self.waiting.push_front(seq);
        }
    }

    /// Tokens a sequence can compute this step given `budget` and the free blocks. When an
    /// image's tokens attend to each other both ways (Gemma 3 and 4), a chunk never ends inside an
    /// image: it stops before the image (or takes nothing this step), so the image's tokens are
    /// computed together.
    fn fit(&self, seq: &Seq, budget: usize) -> usize {
        let bs = self.core.kv.block_size;
        let want = (seq.tokens.len() - seq.computed).min(budget);
        let coverable = (seq.kv.blocks.len() + self.core.kv.alloc.free()) * bs;
        let len = want.min(coverable.saturating_sub(seq.computed));
        if !self.vision.as_ref().is_some_and(|t| t.config().image_tokens_bidirectional()) {
            return len;
        }
        let end = seq.computed + len;
        match seq.images.iter().find(|i| i.start < end && end < i.start + i.tokens) {
            Some(image) => image.start.saturating_sub(seq.computed),
            None => len,
        }
    }

    /// Steps 1-3 of the module documentation: fills `scheduled`.
    fn schedule(&mut self, events: &mut Vec<Event>) {
        let bs = self.core.kv.block_size;
        self.scheduled.clear();

        // 1. Cancelled sequences end.
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].cancel.is_cancelled() {
                let seq = self.running.remove(i);
                self.end_waiting(seq, StopReason::Cancelled, events);
            } else {
                i += 1;
            }
        }
        let mut i = 0;
        while i < self.waiting.len() {
            if self.waiting[i].cancel.is_cancelled() {
                if let Some(seq) = self.waiting.remove(i) {
                    self.end_waiting(seq, StopReason::Cancelled, events);
                }
            } else {
                i += 1;
            }
        }

        let mut budget = self.core.max_batch_tokens;
        // 2. One token for every decoding sequence, preempting from the back when blocks run out.
        let mut slot = 0;
        while slot < self.running.len() && budget > 0 {
            if !self.running[slot].is_decoding() {
                slot += 1;
                continue;
            }
            let need = self.running[slot].computed + 1;
            let mut preempted_self = false;
            while self.running[slot].kv.missing(need, bs) > self.core.kv.alloc.free() {
                let last = self.running.len() - 1;
                self.preempt_last();
                if last == slot {
                    preempted_self = true;
                    break;
                }
            }
            if preempted_self {
                break;
            }
            let seq = &mut self.running[slot];
            let grown = seq.kv.grow(&mut self.core.allocs(), need, bs);
            debug_assert!(grown);
            self.scheduled.push(Scheduled::new(slot, 1, false));
            budget -= 1;
            slot += 1;
        }

        // 2b. Speculative decoding: each decoding sequence, in admission order, extends its one
        //     token with the n-gram proposer's guesses, as far as the step's tokens, its logits
        //     rows and the free blocks allow; proposals never preempt anyone.
        //     Together with the decodes they stay within `speculative_step_tokens`.
        let mut rows = self.core.prompt_rows;
        let mut proposals = budget.min(self.core.speculative_step_tokens.saturating_sub(self.scheduled.len()));
        let offered = proposals;
        if self.draft.is_some() {
            self.propose_with_draft(&mut proposals, &mut rows);
        } else if self.mtp.is_some() {
            self.propose_with_mtp(&mut proposals, &mut rows);
        } else if self.core.speculative_tokens > 0 {
            self.propose(&mut proposals, &mut rows);
        }
        budget -= offered - proposals;

        // 3a. Running sequences with a partly computed prompt get their next chunk. A chunk
        //     whose logits are all wanted (prompt log-probabilities) is also limited by the
        //     step's logits rows.
        for slot in 0..self.running.len() {
            if budget == 0 {
                break;
            }
            let seq = &self.running[slot];
            if seq.is_decoding() || seq.computed >= seq.tokens.len() {
                continue;
            }
            let all_rows = seq.scores_prompt();
            let len = if all_rows { self.fit(seq, budget.min(rows)) } else { self.fit(seq, budget) };
            if len == 0 {
                continue;
            }
            let end = seq.computed + len;
            let seq = &mut self.running[slot];
            if seq.kv.grow(&mut self.core.allocs(), end, bs) {
                self.scheduled.push(Scheduled::new(slot, len, all_rows));
                budget -= len;
                if all_rows {
                    rows -= len;
                }
            }
        }

        // 3b. Admit waiting sequences, first come first served.
        while budget > 0 && self.running.len() < self.core.max_seqs {
            let Some(mut seq) = self.waiting.pop_front() else { break };
            let Some(slot) = self.core.take_state_slot() else {
                self.waiting.push_front(seq);
                break;
            };
            seq.state = slot;
            if self.core.states.is_some() && !seq.kv.blocks.is_empty() {
                // A fresh state slot holds nothing of this sequence: blocks kept from before
                // are matched again below, with the state from a snapshot.
                seq.kv.release_all(&mut self.core.allocs());
                seq.computed = 0;
            }
            if seq.kv.blocks.is_empty() {
                // Positions whose prompt log-probabilities are still wanted are computed, never
                // taken from the cache.
                let limit = match seq.decoding.prompt_logprobs() {
                    Some(_) => (seq.tokens.len() - 1).min(seq.next_scored),
                    None => seq.tokens.len() - 1,
                };
                seq.kv.match_prefix(&mut self.core.allocs(), &seq.tokens, limit, bs);
                // With recurrent layers, the hit is cut back to the last snapshot of their state.
                let matched = self.core.resume_state(&mut seq.kv, seq.state, &seq.tokens);
                seq.computed = matched;
                self.stats.prefix_cache_queries += seq.tokens.len() as u64;
                self.stats.prefix_cache_hits += matched as u64;
                if seq.cached_prompt.is_none() {
                    let cached = matched.min(seq.prompt_len);
                    seq.cached_prompt = Some(cached);
                    seq.decoding.usage.cached_prompt_tokens = cached;
                    self.stats.prompt_tokens_total += seq.prompt_len as u64;
                }
            }
            let all_rows = seq.scores_prompt();
            let len = if all_rows { self.fit(&seq, budget.min(rows)) } else { self.fit(&seq, budget) };
            let end = seq.computed + len;
            if len == 0 || !seq.kv.grow(&mut self.core.allocs(), end, bs) {
                // Not even one token fits: give the matched blocks back and wait.
                seq.kv.release_all(&mut self.core.allocs());
                self.core.release_state_slot(seq.state);
                seq.state = NO_SLOT;
                seq.computed = 0;
                self.waiting.push_front(seq);
                break;
            }
            self.running.push(seq);
            self.scheduled.push(Scheduled::new(self.running.len() - 1, len, all_rows));
            budget -= len;
            if all_rows {
                rows -= len;
            }
        }
    }

    /// Step 2b: turns the scheduled one-token decodes into speculative segments (the last
    /// token and the proposals) where the proposer has something to propose and `budget`
    /// tokens, `rows` logits rows and free blocks are left for it.
    fn propose(&mut self, budget: &mut usize, rows: &mut usize) {
        let bs = self.core.kv.block_size;
        let vocab = self.core.model.dims().vocab;
        for i in 0..self.scheduled.len() {
            if *budget == 0 || *rows == 0 {
                break;
            }
            let seq = &mut self.running[self.scheduled[i].slot];
            if !seq.decoding.may_speculate() {
                continue;
            }
            let k = proposal_length(&self.core, seq, *budget, *rows, usize::MAX);
            if k == 0 {
                continue;
            }
            seq.draft.clear();
            seq.draft.push(seq.tokens[seq.computed]);
            let mut proposed = match &mut self.proposer {
                Some(proposer) => {
                    proposer.propose(seq.request, seq.index, &seq.tokens, k, &mut seq.draft);
                    seq.draft.truncate(1 + k);
                    seq.draft.len() - 1
                }
                None => propose_ngram(&seq.tokens, k, &mut seq.draft),
            };
            // An image's tokens are never sampled: a proposal stops before them (and before any
            // id outside the vocabulary, which only a proposer set by the program makes).
            if let Some(cut) = seq.draft[1..].iter().position(|&id| id >= IMAGE_IDS || id as usize >= vocab) {
                seq.draft.truncate(1 + cut);
                proposed = cut;
            }
            // Nor does a token the sequence's grammar forbids.
            let valid = seq.decoding.valid_prefix(&seq.draft[1..]);
            if valid < proposed {
                seq.draft.truncate(1 + valid);
                proposed = valid;
            }
            if proposed == 0 || !seq.kv.grow(&mut self.core.allocs(), seq.computed + 1 + proposed, bs) {
                continue;
            }
            self.scheduled[i].len = 1 + proposed;
            self.scheduled[i].proposed = proposed;
            *budget -= proposed;
            *rows -= proposed;
        }
    }

    /// Step 2b with a draft model: like [`BatchEngine::propose`], with the draft's greedy
    /// guesses. Each speculating sequence first lets the draft catch up on its tokens the
    /// draft has not computed (all such sequences in one draft pass of at most the draft's
    /// `max_tokens`; a sequence whose catch-up does not fit computes a chunk of it and proposes
    /// from a later step), whose last row gives its first proposal; then one batched one-token
    /// draft pass per further proposal, fed the previous one.
    fn propose_with_draft(&mut self, budget: &mut usize, rows: &mut usize) {
        let Some(draft) = self.draft.as_mut() else { return };
        let bs = self.core.kv.block_size;
        let draft_context = draft.context();
        let mut left = draft.max_tokens();
        self.draft_jobs.clear();
        draft.begin();
        // 1. Who proposes how many, and the catch-up pass.
        for i in 0..self.scheduled.len() {
            if *budget == 0 || *rows == 0 || left == 0 {
                break;
            }
            let seq = &mut self.running[self.scheduled[i].slot];
            let len = seq.tokens.len();
            // The draft model reads no images: it does not propose for a prompt with them.
            if !seq.decoding.may_speculate() || len > draft_context || !seq.images.is_empty() {
                continue;
            }
            // The draft computes positions up to `len + k - 2`.
            let own = (draft_context + 1 - len).min(draft.proposal_room(seq.computed));
            let k = proposal_length(&self.core, seq, *budget, *rows, own);
            if k == 0 {
                continue;
            }
            // The draft holds a prefix of the tokens and never the last one.
            if seq.draft_kv.computed >= len {
                draft.truncate(&mut seq.draft_kv, &seq.tokens, len - 1);
            }
            let from = seq.draft_kv.computed;
            let catch_up = len - from;
            if catch_up > left {
                let end = from + left;
                if draft.grow(&mut seq.draft_kv, end) {
                    draft.push(&mut seq.draft_kv, &seq.tokens[from..end], false);
                    left = 0;
                }
                continue;
            }
            if !draft.grow(&mut seq.draft_kv, len + k - 1) {
                continue;
            }
            let proposes = seq.kv.grow(&mut self.core.allocs(), seq.computed + 1 + k, bs);
            let row = draft.push(&mut seq.draft_kv, &seq.tokens[from..len], proposes);
            left -= catch_up;
            let Some(row) = row else { continue };
            seq.draft.clear();
            seq.draft.push(seq.tokens[seq.computed]);
            self.scheduled[i].len = 1 + k;
            self.scheduled[i].proposed = k;
            *budget -= k;
            *rows -= k;
            self.draft_jobs.push(DraftJob { i, k, row });
        }
        self.stats.draft_model_computed_tokens += draft.planned_tokens() as u64;
        draft.forward(&self.core.pool);
        // 2. The first proposals, then one pass per further one.
        let mut round = 1;
        loop {
            for job in &self.draft_jobs {
                if job.k >= round {
                    let id = draft.greedy(job.row);
                    self.running[self.scheduled[job.i].slot].draft.push(id);
                }
            }
            if !self.draft_jobs.iter().any(|job| job.k > round) {
                break;
            }
            draft.begin();
            for job in &mut self.draft_jobs {
                if job.k > round {
                    let seq = &mut self.running[self.scheduled[job.i].slot];
                    let last = seq.draft[round];
                    // Planned: `grow` above covered the position.
                    job.row = draft.push_proposal(&mut seq.draft_kv, last);
                }
            }
            self.stats.draft_model_computed_tokens += draft.planned_tokens() as u64;
            draft.forward(&self.core.pool);
            round += 1;
        }
        // 3. A constrained sequence's proposals stop before the first its grammar forbids.
        self.cut_drafted_proposals_to_grammar();
    }

    /// A constrained sequence's proposals from the draft model or the MTP head (this step's
    /// `draft_jobs`) stop before the first its grammar forbids. One is kept, so that the
    /// verification cuts the proposer's cache back as for any other rejection.
    fn cut_drafted_proposals_to_grammar(&mut self) {
        for job in &self.draft_jobs {
            let s = &mut self.scheduled[job.i];
            let seq = &mut self.running[s.slot];
            let valid = seq.decoding.valid_prefix(&seq.draft[1..]).max(1);
            if valid < s.proposed {
                seq.draft.truncate(1 + valid);
                s.proposed = valid;
                s.len = 1 + valid;
            }
        }
    }

    /// Whether the MTP head follows `seq` (computes its positions as the target does): a
    /// sequence that may speculate, whose prompt has no images (the head reads token
    /// embeddings only) and that generates.
    fn mtp_follows(seq: &Seq) -> bool {
        seq.speculation_limit > 0
            && seq.decoding.may_speculate()
            && seq.images.is_empty()
            && seq.pooling.is_none()
            && !seq.decoding.generates_nothing()
    }

    /// Step 2b with an MTP head: like [`BatchEngine::propose_with_draft`]. A sequence's first
    /// proposal is the head's row for its last computed position, made by the previous step's
    /// catch-up ([`BatchEngine::mtp_catch_up`]); each further one is one batched head pass at
    /// the next position, fed the previous proposal and the head's own output row.
    fn propose_with_mtp(&mut self, budget: &mut usize, rows: &mut usize) {
        let Some(mtp) = self.mtp.as_mut() else { return };
        let bs = self.core.kv.block_size;
        let head_context = mtp.context();
        self.draft_jobs.clear();
        mtp.begin();
        for i in 0..self.scheduled.len() {
            if *budget == 0 || *rows == 0 {
                break;
            }
            let seq = &mut self.running[self.scheduled[i].slot];
            let len = seq.tokens.len();
            let Some(first) = seq.mtp_row.filter(|r| r.pass == mtp.passes() && r.tokens == len) else { continue };
            if !BatchEngine::mtp_follows(seq) || seq.mtp.computed() != seq.computed {
                continue;
            }
            // The head computes positions up to `len + k - 3`.
            let k = proposal_length(&self.core, seq, *budget, *rows, (head_context + 2).saturating_sub(len));
            if k == 0 {
                continue;
            }
            // The head's logits are the target's head's: its proposals are ids of the vocabulary.
            let id = mtp.greedy(first.row);
            if !mtp.grow(&mut seq.mtp, len + k - 2) || !seq.kv.grow(&mut self.core.allocs(), seq.computed + 1 + k, bs) {
                continue;
            }
            seq.draft.clear();
            seq.draft.push(seq.tokens[seq.computed]);
            seq.draft.push(id);
            let row = if k > 1 { mtp.push_chained(&mut seq.mtp, id, first.row) } else { 0 };
            self.scheduled[i].len = 1 + k;
            self.scheduled[i].proposed = k;
            *budget -= k;
            *rows -= k;
            self.draft_jobs.push(DraftJob { i, k, row });
        }
        // One pass per further proposal, each fed the previous one.
        let mut round = 2;
        while self.draft_jobs.iter().any(|job| job.k >= round) {
            self.stats.draft_model_computed_tokens += mtp.planned_tokens() as u64;
            mtp.forward(&self.core.pool);
            mtp.begin();
            for job in &mut self.draft_jobs {
                if job.k >= round {
                    let seq = &mut self.running[self.scheduled[job.i].slot];
                    let id = mtp.greedy(job.row);
                    seq.draft.push(id);
                    if job.k > round {
                        // Planned: `grow` above covered the position.
                        job.row = mtp.push_chained(&mut seq.mtp, id, job.row);
                    }
                }
            }
            round += 1;
        }
        self.cut_drafted_proposals_to_grammar();
    }

    /// After the forward pass and the sampling: the MTP head computes, for every sequence it
    /// follows, the positions the target computed in this step (position `p` reads the token at
    /// `p + 1`, which is now known, and the target's final-normed hidden state at `p`, still in
    /// the target's activations), all in one pass. It first drops its positions from the
    /// segment's start on (its proposals' rows), and fills positions the target computed
    /// without it (a prefix-cache hit, a forked choice's prompt) with the token's embedding
    /// alone (a zero hidden row): proposals there are weaker, outputs unchanged. The last row of
    /// a decoding sequence gives its first proposal of the next step.
    fn mtp_catch_up(&mut self) {
        let Some(mtp) = self.mtp.as_mut() else { return };
        let mut left = mtp.max_tokens();
        mtp.begin();
        for k in 0..self.scheduled.len() {
            let s = self.scheduled[k];
            if self.finished.contains(&s.slot) {
                continue;
            }
            let seq = &mut self.running[s.slot];
            seq.mtp_row = None;
            if !BatchEngine::mtp_follows(seq) {
                continue;
            }
            // Positions with the target's hidden state: the segment's kept tokens.
            let end = seq.computed.min(seq.tokens.len() - 1).min(mtp.context());
            let start = s.start.min(end);
            mtp.truncate(&mut seq.mtp, start);
            let from = seq.mtp.computed();
            let take = (end - from).min(left);
            if take == 0 || !mtp.grow(&mut seq.mtp, from + take) {
                continue;
            }
            left -= take;
            let gap = start - from;
            // The last row proposes when it is the sequence's last computed position and the
            // sequence will propose next step.
            let proposes = from + take == seq.computed && seq.is_decoding() && !seq.speculation.sitting_out();
            let (model, scratch) = (&self.core.model, &self.core.scratch);
            let next_ids = &seq.tokens[from + 1..from + take + 1];
            let row = mtp.push_rows(&mut seq.mtp, next_ids, proposes, |i, out| {
                if i < gap {
                    out.fill(0.0);
                } else {
                    model.final_hidden(scratch, s.t0 + i - gap, out);
                }
            });
            if let Some(row) = row {
                seq.mtp_row = Some(MtpRow { row, pass: mtp.passes() + 1, tokens: seq.tokens.len() });
            }
        }
        self.stats.draft_model_computed_tokens += mtp.planned_tokens() as u64;
        mtp.forward(&self.core.pool);
    }

    /// With a draft model, before the forward pass: the draft computes the prompt chunks the
    /// step schedules (from where its cache ends up to the chunk's end, never a sequence's last
    /// token, all in one pass of at most its `max_tokens`), so that a sequence's first
    /// proposals do not wait for the draft to compute its whole prompt. A chunk that does not
    /// fit is left to the catch-up of [`BatchEngine::propose_with_draft`].
    fn draft_prefill(&mut self) {
        let Some(draft) = self.draft.as_mut() else { return };
        let draft_context = draft.context();
        let mut left = draft.max_tokens();
        draft.begin();
        for s in &self.scheduled {
            let seq = &mut self.running[s.slot];
            if s.proposed > 0
                || seq.is_decoding()
                || !seq.decoding.may_speculate()
                || seq.pooling.is_some()
                || seq.decoding.generates_nothing()
            {
                continue;
            }
            let from = seq.draft_kv.computed;
            let end = (seq.computed + s.len).min(seq.tokens.len().saturating_sub(1)).min(draft_context);
            if end <= from || end - from > left || !draft.grow(&mut seq.draft_kv, end) {
                continue;
            }
            draft.push(&mut seq.draft_kv, &seq.tokens[from..end], false);
            left -= end - from;
        }
        self.stats.draft_model_computed_tokens += draft.planned_tokens() as u64;
        draft.forward(&self.core.pool);
    }

    /// Verifies the proposals of running sequence `slot` once the forward pass computed its
    /// draft (logits rows `first_row..=first_row + proposed`): samples row by row with the
    /// sequence's own sampler, emitting every sampled token, and goes on to the next row while
    /// the sampled token is the proposal that row was computed with. The keys and values of
    /// the rejected proposals are dropped: the sequence continues as if only the accepted
    /// tokens had been computed, and only their blocks reach the prefix cache.
    fn verify_proposals(
        &mut self,
        slot: usize,
        first_row: usize,
        proposed: usize,
        events: &mut Vec<Event>,
    ) -> Result<()> {
        let bs = self.core.kv.block_size;
        let vocab = self.core.model.dims().vocab;
        let context = self.core.context;
        let seq = &mut self.running[slot];
        debug_assert_eq!(seq.draft.len(), 1 + proposed);
        let text = self.core.text.as_deref();
        let mut emitted = 0;
        let mut reason = None;
        for row in 0..=proposed {
            let at_end = seq.tokens.len() + 1 > context;
            let (id, token, ended) =
                seq.decoding.accept(self.core.scratch.logits(first_row + row, vocab), text, at_end)?;
            seq.tokens.push(id);
            emitted += 1;
            self.stats.generation_tokens_total += 1;
            events.push(Event { request: seq.request, index: seq.index, kind: token });
            if ended.is_some() {
                reason = ended;
                break;
            }
            // Tokens a grammar forces now come next, not the proposals.
            if row == proposed || id != seq.draft[row + 1] || seq.decoding.has_forced() {
                break;
            }
        }
        self.stats.speculative_proposed_tokens += proposed as u64;
        self.stats.speculative_accepted_tokens += (emitted - 1) as u64;
        // A choice that ended on a proposal's row says nothing about the rows after it.
        if reason.is_none() {
            seq.speculation.update(proposed, emitted - 1, seq.speculation_limit);
        }
        if self.mtp.is_some() {
            self.stats.draft_model_proposed_tokens += proposed as u64;
            self.stats.draft_model_accepted_tokens += (emitted - 1) as u64;
        }
        if let Some(draft) = &mut self.draft {
            self.stats.draft_model_proposed_tokens += proposed as u64;
            self.stats.draft_model_accepted_tokens += (emitted - 1) as u64;
            // The draft computed the last token and its proposals but the last; positions up
            // to the last emitted token hold what it computed there (the accepted proposals).
            draft.truncate(&mut seq.draft_kv, &seq.tokens, seq.computed + emitted);
        }
        // The last token and the accepted proposals were computed with the tokens the sequence
        // now holds at their positions; the blocks past them go back to the pool, never
        // registered, and the kept last block's rejected positions are overwritten later. The
        // recurrent layers' convolution rows go back to the last kept token (their `S₀` never
        // moved past it).
        if emitted <= proposed
            && let Some(states) = &mut self.core.states
        {
            states.roll_back(seq.state, emitted);
        }
        seq.computed += emitted;
        seq.kv.advance(&mut self.core.allocs(), &seq.tokens, seq.computed, bs);
        let kept = seq.kv.truncate(&mut self.core.allocs(), &seq.tokens, seq.computed.div_ceil(bs), bs);
        if kept * bs < seq.computed && self.core.states.is_some() {
            // The sliding window's released blocks cut the kept prefix below the state: the
            // state goes back to the last snapshot at or below it (or to nothing).
            seq.computed = self.core.resume_state(&mut seq.kv, seq.state, &seq.tokens);
        }
        seq.computed = seq.computed.min(kept * bs);
        let text = self.core.text.as_deref();
        if reason.is_none() {
            reason = take_forced(seq, text, context, &mut self.stats, events)?;
        }
        if let Some(reason) = reason {
            let kind = seq.decoding.finish(reason, text)?;
            events.push(Event { request: seq.request, index: seq.index, kind });
            self.finished.push(slot);
        }
        Ok(())
    }

    /// Creates the siblings of `leader` (choice 0 of a request with `n > 1`) right after its
    /// prompt was computed, sampling their first tokens from the same logits `row`.
    fn fork(&mut self, leader_slot: usize, request: &Request, row: usize, events: &mut Vec<Event>) -> Result<()> {
        let bs = self.core.kv.block_size;
        let prompt_len = request.prompt_ids.len();
        let full = prompt_len / bs;
        let partial = prompt_len % bs;
        for index in 1..request.n {
            let mut seq = self.new_seq(request, index);
            seq.attach_images(self.running[leader_slot].images.clone());
            seq.cached_prompt = self.running[leader_slot].cached_prompt;
            seq.decoding.usage.cached_prompt_tokens = seq.cached_prompt.unwrap_or(0);
            // Share the full prompt blocks (and the sliding ones the leader still holds); copy
            // the partly filled last one.
            let alloc = &mut self.core.kv.alloc;
            for i in 0..full {
                let b = self.running[leader_slot].kv.blocks[i];
                alloc.retain(b);
                seq.kv.blocks.push(b);
            }
            if let Some(swa) = &mut self.core.swa {
                for &b in &self.running[leader_slot].kv.sliding[..full] {
                    if b != NO_BLOCK {
                        swa.kv.alloc.retain(b);
                    }
                    seq.kv.sliding.push(b);
                }
            }
            let leader_hashes = &self.running[leader_slot].kv.hashes;
            seq.kv.hashes.extend_from_slice(&leader_hashes[..full.min(leader_hashes.len())]);
            seq.computed = full * bs;
            let sliding_copy = match &mut self.core.swa {
                Some(swa) if partial > 0 => swa.kv.alloc.allocate().map(Some),
                _ => Some(None),
            };
            if partial > 0
                && let Some(sliding_copy) = sliding_copy
                && let Some(copy) = self.core.kv.alloc.allocate()
            {
                let source = self.running[leader_slot].kv.blocks[full];
                self.core.kv.copy_block(source, copy);
                seq.kv.blocks.push(copy);
                if let (Some(swa), Some(copy)) = (&mut self.core.swa, sliding_copy) {
                    swa.kv.copy_block(self.running[leader_slot].kv.sliding[full], copy);
                    seq.kv.sliding.push(copy);
                }
                seq.computed = prompt_len;
            } else if let (Some(swa), Some(Some(copy))) = (&mut self.core.swa, sliding_copy) {
                // No full block for the copy: the sliding one goes back too.
                swa.kv.alloc.release(copy);
            }
            // Without a free block for the copy, the sibling recomputes the last partial block.
            let at_end = prompt_len + 1 > self.core.context;
            let text = self.core.text.as_deref();
            let (id, token, reason) =
                seq.decoding.accept(self.core.scratch.logits(row, self.core.model.dims().vocab), text, at_end)?;
            seq.tokens.push(id);
            self.stats.generation_tokens_total += 1;
            events.push(Event { request: request.id, index, kind: token });
            let reason = match reason {
                None => take_forced(&mut seq, text, self.core.context, &mut self.stats, events)?,
                some => some,
            };
            let room = self.running.len() < self.core.max_seqs;
            match reason {
                Some(reason) => self.end_waiting(seq, reason, events),
                None if seq.computed == prompt_len && room => {
                    // The sibling continues from the leader's recurrent state too.
                    let leader_state = self.running[leader_slot].state;
                    match self.core.take_state_slot() {
                        Some(slot) => {
                            if let (Some(states), true) = (&mut self.core.states, slot != NO_SLOT) {
                                states.copy_live(leader_state, slot);
                            }
                            seq.state = slot;
                            self.running.push(seq)
                        }
                        None => {
                            seq.kv.release_all(&mut self.core.allocs());
                            seq.computed = 0;
                            self.waiting.push_back(seq)
                        }
                    }
                }
                None if self.core.states.is_some() => {
                    // With recurrent layers a sibling cannot resume at a block boundary without a
                    // snapshot of its state there: it is admitted again, from the prompt's
                    // snapshot through the prefix cache.
                    seq.kv.release_all(&mut self.core.allocs());
                    seq.computed = 0;
                    self.waiting.push_back(seq)
                }
                None => {
                    // Recomputed later (the partial block), or no room to run now.
                    let kept = seq.kv.truncate(&mut self.core.allocs(), &seq.tokens, full, bs);
                    seq.computed = kept * bs;
                    if self.running.len() < self.core.max_seqs {
                        self.running.push(seq)
                    } else {
                        seq.kv.release_all(&mut self.core.allocs());
                        seq.computed = 0;
                        self.waiting.push_back(seq)
                    }
                }
            }
        }
        Ok(())
    }

    /// Step 4: the forward pass and what follows it.
    fn run_scheduled(&mut self, events: &mut Vec<Event>) -> Result<()> {
        let bs = self.core.kv.block_size;
        self.core.plan.clear();
        let rope = self.core.model.multimodal_rope();
        // With Gemma 3's and 4's images, every token of the step says how far it attends.
        let bidirectional = self.vision.as_ref().is_some_and(|t| t.config().image_tokens_bidirectional())
            && self.scheduled.iter().any(|s| !self.running[s.slot].images.is_empty());
        self.core.plan.attend_until_sliding_only = bidirectional
            && self
                .vision
                .as_ref()
                .is_some_and(|t| t.config().image_attention() == ImageAttention::BidirectionalOnSliding);
        for s in self.scheduled.iter_mut() {
            let seq = &self.running[s.slot];
            let t0 = self.core.plan.ids.len();
            (s.start, s.t0) = (seq.computed, t0);
            if rope || bidirectional || !seq.images.is_empty() {
                // Every token's rotary positions, how far it attends, and the image rows of the
                // segment's image tokens.
                seq.plan_multimodal(&mut self.core.plan, t0, seq.computed, s.len, rope, bidirectional);
            }
            if s.proposed > 0 {
                // The draft: the last sampled token, then the proposals (not in `tokens`).
                debug_assert_eq!(seq.draft.first(), seq.tokens.get(seq.computed));
                s.first_row = self.core.plan.push_speculative(
                    &seq.draft,
                    seq.computed,
                    &seq.kv.blocks,
                    &seq.kv.sliding,
                    seq.state,
                );
                s.logits_row = Some(s.first_row);
                continue;
            }
            let end = seq.computed + s.len;
            let ids = &seq.tokens[seq.computed..end];
            let last = end == seq.tokens.len();
            if s.all_rows {
                s.first_row =
                    self.core.plan.push_all_logits(ids, seq.computed, &seq.kv.blocks, &seq.kv.sliding, seq.state);
                s.logits_row = last.then(|| s.first_row + s.len - 1);
            } else {
                s.logits_row = self.core.plan.push(ids, seq.computed, &seq.kv.blocks, &seq.kv.sliding, seq.state, last);
            }
        }
        // Constrained sequences compute the grammar mask for their next token while the forward
        // pass runs, on a thread of their own (the pool's threads run the forward); an
        // unconstrained batch takes the plain path and allocates nothing.
        if self.running.iter().any(|s| s.decoding.needs_mask()) {
            let running = &mut self.running;
            let core = &mut self.core;
            std::thread::scope(|scope| {
                // Without a thread (none could be started), the masks are computed when
                // sampling; a panic inside llguidance is caught there and ends its sequence.
                let masks = std::thread::Builder::new()
                    .name("kylin-grammar".into())
                    .spawn_scoped(scope, || prepare_masks(running.iter_mut()));
                core.forward(None);
                if let Ok(handle) = masks {
                    let _ = handle.join();
                }
            });
        } else {
            self.core.forward(None);
        }
        self.stats.steps += 1;

        self.finished.clear();
        let vocab = self.core.model.dims().vocab;
        let n_scheduled = self.scheduled.len();
        for k in 0..n_scheduled {
            let Scheduled { slot, len, logits_row, all_rows, first_row, proposed, .. } = self.scheduled[k];
            if proposed > 0 {
                self.verify_proposals(slot, first_row, proposed, events)?;
                continue;
            }
            let seq = &mut self.running[slot];
            if all_rows {
                report_prompt_logprobs(seq, first_row, len, |row| self.core.scratch.logits(row, vocab), events);
            }
            seq.computed += len;
            seq.kv.advance(&mut self.core.allocs(), &seq.tokens, seq.computed, bs);
            if seq.computed >= seq.prompt_len && seq.computed - len < seq.prompt_len {
                // The prompt is complete: its recurrent state at its last chunk boundary is what
                // a repeated prompt or the next turn of a chat reuses.
                self.core.snapshot_state(&seq.kv, seq.state, seq.computed);
            }
            let seq = &mut self.running[slot];
            let Some(row) = logits_row else { continue };
            if let Some(pooled) = &seq.pooling {
                let values = match pooled {
                    Pooled::LastHidden => self.core.scratch.logit_hidden(row, self.core.model.dims().hidden).to_vec(),
                    Pooled::LastLogits(ids) => {
                        let logits = self.core.scratch.logits(row, vocab);
                        ids.iter().map(|&id| logits[id as usize]).collect()
                    }
                };
                events.push(Event { request: seq.request, index: seq.index, kind: EventKind::Pooled { values } });
            }
            if seq.decoding.generates_nothing() {
                // The request only scores its prompt: it ends here, its choices with it.
                let text = self.core.text.as_deref();
                let kind = seq.decoding.finish(StopReason::Length, text)?;
                events.push(Event { request: seq.request, index: seq.index, kind });
                if let Some(request) = seq.fork.take() {
                    end_unforked(&request, StopReason::Length, events);
                }
                self.finished.push(slot);
                continue;
            }
            let at_end = seq.tokens.len() + 1 > self.core.context;
            let text = self.core.text.as_deref();
            let (id, token, reason) = seq.decoding.accept(self.core.scratch.logits(row, vocab), text, at_end)?;
            seq.tokens.push(id);
            self.stats.generation_tokens_total += 1;
            events.push(Event { request: seq.request, index: seq.index, kind: token });
            let reason = match reason {
                None => take_forced(seq, text, self.core.context, &mut self.stats, events)?,
                some => some,
            };
            if let Some(reason) = reason {
                let kind = seq.decoding.finish(reason, text)?;
                events.push(Event { request: seq.request, index: seq.index, kind });
                self.finished.push(slot);
            }
            if let Some(request) = self.running[slot].fork.take() {
                self.fork(slot, &request, row, events)?;
            }
        }
        self.mtp_catch_up();
        // Finished sequences leave, highest slot first so the others keep their slots.
        self.finished.sort_unstable();
        while let Some(slot) = self.finished.pop() {
            let mut seq = self.running.remove(slot);
            self.leave(&mut seq);
        }
        Ok(())
    }
}

impl BatchEngine {
    /// One scheduler step (the module documentation's four parts).
    fn advance(&mut self, events: &mut Vec<Event>) -> Result<()> {
        self.encode_step();
        self.schedule(events);
        // Running sequences that all wait for blocks (partly computed prompts filled the pool):
        // preempt from the back until one of them can go on. The pool holds at least one
        // sequence of the full context, so the front sequence always fits on its own.
        while self.scheduled.is_empty() && !self.running.is_empty() {
            self.preempt_last();
            self.schedule(events);
        }
        if self.scheduled.is_empty() {
            return Ok(());
        }
        self.draft_prefill();
        self.run_scheduled(events)
    }

    /// Runs prompt-only requests that return pooled values (embeddings, reranking logits) and
    /// steps the engine until they are all done: they share every step with the requests
    /// already running, whose events wait in `held` for the next [`Serving::step`]. The
    /// inputs are validated before any is queued; the prefix cache serves them as any prompt.
    fn run_pooled(&mut self, prompts: Vec<(Vec<u32>, Pooled)>) -> Result<Vec<Vec<f32>>> {
        let (vocab, context, max_seqs) = (self.core.model.dims().vocab, self.core.context, self.core.max_seqs);
        let first = self.next_internal_id;
        let count = prompts.len();
        let mut requests = Vec::with_capacity(count);
        for (i, (ids, pooled)) in prompts.into_iter().enumerate() {
            let mut request = Request::new(first + i as u64, ids, 0);
            request.detokenize = false;
            request.pooling = Some(pooled);
            validate_request(&request, vocab, context, max_seqs)
                .map_err(|e| KylinError { message: format!("input {i}: {}", e.message), ..e })?;
            requests.push(request);
        }
        self.next_internal_id += count as u64;
        let cancels: Vec<_> = requests.iter().map(|r| r.cancel.clone()).collect();
        for request in requests {
            self.add_request(request)?;
        }
        let ours = first..first + count as u64;
        let mut out: Vec<Option<Vec<f32>>> = vec![None; count];
        let mut done = 0;
        let mut events = Vec::new();
        while done < count {
            events.clear();
            let stepped = if self.running.is_empty() && self.waiting.is_empty() {
                Err(KylinError::backend_failed("internal: the engine went idle before its pooled requests finished"))
            } else {
                self.advance(&mut events)
            };
            if let Err(e) = stepped {
                // What was not computed is dropped at the next step.
                cancels.iter().for_each(|c| c.cancel());
                return Err(e);
            }
            for event in events.drain(..) {
                if !ours.contains(&event.request) {
                    self.held.push(event);
                    continue;
                }
                let i = (event.request - first) as usize;
                match event.kind {
                    EventKind::Pooled { values } => out[i] = Some(values),
                    EventKind::Finished { .. } => done += 1,
                    _ => {}
                }
            }
        }
        out.into_iter()
            .enumerate()
            .map(|(i, v)| {
                v.ok_or_else(|| {
                    KylinError::backend_failed(format!("internal: pooled input {i} finished without its values"))
                })
            })
            .collect()
    }
}

/// How many tokens `seq` proposes this step, at most `own` (the proposer's own limit): within
/// its request's limit, the step's `budget` tokens and `rows` logits rows, the context (the
/// proposals sit at positions `tokens.len()..`), one fewer than the choice may still generate
/// (more would never be emitted) and the recurrent layers' chunk room; then as many as its
/// adaptive length allows (which counts a step sat out). 0: it does not propose.
fn proposal_length(core: &EngineCore, seq: &mut Seq, budget: usize, rows: usize, own: usize) -> usize {
    let room = core.context.saturating_sub(seq.tokens.len());
    let k = seq.speculation_limit.min(budget).min(rows).min(room).min(own);
    let k = k.min(seq.decoding.remaining().saturating_sub(1)).min(core.proposal_room(seq.computed));
    if k == 0 {
        return 0;
    }
    k.min(seq.speculation.next_len(seq.speculation_limit))
}

/// Ends choices `1..n` of a request whose siblings were never forked.
fn end_unforked(request: &Request, reason: StopReason, events: &mut Vec<Event>) {
    for index in 1..request.n {
        let usage = Usage { prompt_tokens: request.prompt_ids.len(), ..Usage::default() };
        let kind = EventKind::Finished { reason, text: String::new(), usage };
        events.push(Event { request: request.id, index, kind });
    }
}

/// Reports the prompt log-probabilities a chunk of `len` tokens (from `seq.computed`, rows
/// `first_row..` of `logits`) gives: position `p` scores prompt token `p + 1`. Positions
/// already reported (a chunk recomputed after preemption) are skipped.
fn report_prompt_logprobs<'a>(
    seq: &mut Seq,
    first_row: usize,
    len: usize,
    logits: impl Fn(usize) -> &'a [f32],
    events: &mut Vec<Event>,
) {
    let Some(k) = seq.decoding.prompt_logprobs() else { return };
    let from = seq.next_scored.max(seq.computed);
    let to = (seq.computed + len).min(seq.prompt_len - 1);
    if from >= to {
        return;
    }
    // An image's tokens are scored as the placeholder token the request's prompt holds.
    let prompt_id = |id: u32| if id >= IMAGE_IDS { seq.images.first().map_or(id, |i| i.placeholder) } else { id };
    let logprobs = (from..to)
        .map(|p| crate::sequence::token_logprob(logits(first_row + p - seq.computed), prompt_id(seq.tokens[p + 1]), k))
        .collect();
    seq.next_scored = to;
    events.push(Event {
        request: seq.request,
        index: seq.index,
        kind: EventKind::PromptLogprobs { start: from + 1, logprobs },
    });
}

/// Computes the grammar masks the sequences will need for their next token.
fn prepare_masks<'a>(seqs: impl Iterator<Item = &'a mut Seq>) {
    for seq in seqs {
        if seq.decoding.needs_mask() {
            seq.decoding.prepare_mask();
        }
    }
}

/// Appends the tokens the sequence's grammar forces after its last token, without sampling
/// (they are computed by the next forward pass as a chunk); returns why the sequence ended,
/// if one of them ended it.
fn take_forced(
    seq: &mut Seq,
    text: Option<&TextCodec>,
    context: usize,
    stats: &mut EngineStats,
    events: &mut Vec<Event>,
) -> Result<Option<StopReason>> {
    loop {
        let at_end = seq.tokens.len() + 1 > context;
        match seq.decoding.next_forced(text, at_end)? {
            None => return Ok(None),
            Some((id, token, reason)) => {
                seq.tokens.push(id);
                stats.generation_tokens_total += 1;
                events.push(Event { request: seq.request, index: seq.index, kind: token });
                if reason.is_some() {
                    return Ok(reason);
                }
            }
        }
    }
}

impl Serving for BatchEngine {
    fn info(&self) -> EngineInfo {
        self.core.info("kylin")
    }

    fn image_preparer(&self) -> Option<Arc<ImagePreparer>> {
        self.image_preparer.clone()
    }

    fn record_kv_events(&mut self) -> bool {
        // Between two drains (one step) a block is registered at most once and evicted at most
        // once per allocation, and a step allocates fewer blocks than the pool holds.
        let alloc = &mut self.core.kv.alloc;
        alloc.record_events(2 * alloc.total().max(1));
        true
    }

    fn drain_kv_events(&mut self, f: &mut dyn FnMut(crate::kv_pool::KvEvent<'_>)) {
        self.core.kv.alloc.drain_events(f);
    }

    fn generation_defaults(&self) -> GenerationDefaults {
        self.core.generation.clone()
    }

    fn add_request(&mut self, request: Request) -> Result<()> {
        validate_request(&request, self.core.model.dims().vocab, self.core.context, self.core.max_seqs)?;
        if let (ModelTask::Embed(e), None) = (&self.task, &request.pooling) {
            return Err(KylinError::input_invalid(format!(
                "this model is an embedding model (from {}): it serves /v1/embeddings and generates no text",
                e.source
            )));
        }
        if let Some(k) = request.speculative_tokens
            && k > self.core.speculative_tokens
        {
            return Err(KylinError::input_invalid(if self.core.speculative_tokens == 0 {
                format!(
                    "speculative_tokens {k} asks for speculative decoding, which this server runs without; start it \
                     with --speculative-tokens"
                )
            } else {
                format!(
                    "speculative_tokens {k} is more than the server's --speculative-tokens {}; pass at most that",
                    self.core.speculative_tokens
                )
            })
            .for_field("speculative_tokens"));
        }
        let duplicate = self.running.iter().chain(self.waiting.iter()).any(|s| s.request == request.id);
        if duplicate {
            return Err(KylinError::input_invalid(format!("request id {} is already in the engine", request.id)));
        }
        let runs = self.check_images(&request)?;
        let images = request.images.clone();
        let mut seq = self.new_seq(&request, 0);
        if request.n > 1 {
            seq.fork = Some(Box::new(request));
        }
        if runs.is_empty() {
            self.waiting.push_back(seq);
        } else {
            // Its images are encoded over the next steps, then it waits to run.
            self.encoding.push_back(PendingImages { seq, images, runs, done: Vec::new(), current: None });
        }
        Ok(())
    }

    fn step(&mut self, events: &mut Vec<Event>) -> Result<()> {
        events.append(&mut self.held);
        self.advance(events)
    }

    fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty() || !self.held.is_empty() || !self.encoding.is_empty()
    }

    fn embedding_info(&self) -> Option<EmbeddingInfo> {
        let ModelTask::Embed(e) = &self.task else { return None };
        Some(EmbeddingInfo {
            dimension: self.core.model.dims().hidden,
            pooling: "last_token".into(),
            normalized: e.normalize,
            max_tokens: self.core.context,
            prompts: e.prompts.clone(),
        })
    }

    fn embed(&mut self, inputs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        let ModelTask::Embed(e) = &self.task else {
            return Err(KylinError::input_invalid(
                "this model does not make embeddings; serve an embedding model (a sentence-transformers directory such \
                 as Qwen3-Embedding's, or pass --task embed)",
            ));
        };
        let normalize = e.normalize;
        let mut out = self.run_pooled(inputs.iter().map(|ids| (ids.clone(), Pooled::LastHidden)).collect())?;
        if normalize {
            out.iter_mut().for_each(|v| crate::encoder::normalize_in_place(v));
        }
        Ok(out)
    }

    fn can_rerank(&self) -> bool {
        matches!(self.task, ModelTask::Rerank(_))
    }

    fn rerank(&mut self, query: &str, documents: &[String], instruction: Option<&str>) -> Result<(Vec<f32>, usize)> {
        let ModelTask::Rerank(r) = &self.task else {
            return Err(KylinError::input_invalid(
                "this model does not rerank; serve a reranker (a cross-encoder such as bge-reranker, Qwen3-Reranker, \
                 or a decoder with --task rerank)",
            ));
        };
        let ids = vec![r.no_id, r.yes_id];
        let text = self.core.text()?;
        let prompts: Vec<(Vec<u32>, Pooled)> = crate::retrieval::yes_no_prompts(text, query, documents, instruction)?
            .into_iter()
            .map(|p| (p, Pooled::LastLogits(ids.clone())))
            .collect();
        let tokens = prompts.iter().map(|(p, _)| p.len()).sum();
        let logits = self.run_pooled(prompts)?;
        Ok((logits.iter().map(|l| crate::retrieval::yes_probability(l[0], l[1])).collect(), tokens))
    }

    fn stats(&self) -> EngineStats {
        let alloc = &self.core.kv.alloc;
        EngineStats {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_blocks_total: alloc.total(),
            kv_blocks_used: alloc.total() - alloc.free(),
            kv_blocks_cached: alloc.cached_free(),
            ..self.stats
        }
    }

    fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        self.core.text()?.tokenize(text, add_special)
    }

    fn detokenize(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.core.text()?.detokenize(ids, skip_special)
    }

    fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        self.core.text()?.apply_chat_template(messages, add_generation_prompt, kwargs)
    }

    fn render_chat(
        &self,
        messages: &[serde_json::Value],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        self.core.text()?.render_chat(messages, add_generation_prompt, kwargs)
    }

    fn tool_syntax(&self) -> Option<crate::tools::ToolSyntax> {
        self.core.text.as_deref().and_then(TextCodec::tool_syntax)
    }

    fn grammar_compiler(&self) -> Result<Arc<crate::grammar::GrammarCompiler>> {
        self.core.text()?.grammar_compiler(self.core.model.dims().vocab, &self.core.eos_ids)
    }

    fn prompt_text(&self) -> Option<Arc<dyn crate::serving::PromptText>> {
        self.core.text.clone().map(|codec| codec as Arc<dyn crate::serving::PromptText>)
    }
}

#[cfg(test)]
mod mtp_tests {
    use std::path::Path;

    use super::*;
    use crate::draft::{DraftModel, DraftTarget};

    const FAMILIES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/families/fixtures");

    /// A copy of the fixture at `dir` whose `lm_head.weight` is all zeros.
    fn with_zero_lm_head(dir: &Path) -> tempfile::TempDir {
        let tmp = tempfile::tempdir().unwrap();
        for entry in std::fs::read_dir(dir).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), tmp.path().join(entry.file_name())).unwrap();
        }
        let file = tmp.path().join("model.safetensors");
        let mut bytes = std::fs::read(&file).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        let offsets = &header["lm_head.weight"]["data_offsets"];
        let (from, to) = (offsets[0].as_u64().unwrap() as usize, offsets[1].as_u64().unwrap() as usize);
        bytes[8 + n + from..8 + n + to].fill(0);
        std::fs::write(&file, bytes).unwrap();
        tmp
    }

    #[test]
    fn the_mtp_head_follows_every_sequence_as_a_fresh_computation_would() {
        // After every step, each sequence's first proposal of the next step (the head's row for
        // its last computed position) must be, bit for bit, what a fresh head computes over the
        // sequence's tokens with the target's hidden rows from one fresh pass: the catch-up
        // reads the right rows of the target's activations, at the right positions, after
        // chunked prompts, rejected proposals and several sequences per step.
        //
        // With the fixtures' random heads every proposal is rejected; with a head of zeros
        // (every logit 0: the target and the head both pick token 0) every one is accepted, and
        // the head's output rows, which the head of zeros leaves as they are, are compared.
        let pool = ThreadPool::new(2);
        for (name, zero_head) in [
            ("tiny-qwen3.5-mtp", false),
            ("tiny-qwen3.5-moe-mtp", false),
            ("tiny-qwen3-next-mtp", false),
            ("tiny-glm4-moe-mtp", false),
            ("tiny-qwen3.5-mtp", true),
        ] {
            let copy = zero_head.then(|| with_zero_lm_head(&Path::new(FAMILIES).join(name)));
            let dir = copy.as_ref().map_or_else(|| Path::new(FAMILIES).join(name), |t| t.path().to_path_buf());
            let with_head = kylin_loader::LoadOptions { mtp: true, ..Default::default() };
            let opts = EngineOptions {
                threads: 2,
                ctx_size: Some(256),
                max_batch_tokens: 24,
                speculative_tokens: 3,
                mtp: true,
                ..EngineOptions::default()
            };
            let mut e = BatchEngine::new(kylin_loader::load(&dir, &with_head).unwrap(), &opts).unwrap();
            let head = kylin_loader::load(&dir, &with_head).unwrap().mtp.unwrap();
            let mut fresh = MtpDraft::new(&head, &opts, 256, 1, 256, 4096).unwrap();
            // With the target's prepared head, as the engine gives its own head.
            fresh.share_lm_head(&e.core.model);
            let vocab = e.core.model.dims().vocab;
            let target_of = DraftTarget { path: None, vocab, tokenizer: None, kv_tokens: 4096 };
            let mut target = DraftModel::load(&dir, &target_of, &opts, 256, 1, 256).unwrap();
            target.keep_every_hidden_row();
            let h = e.core.model.dims().hidden;
            for (id, len) in [5usize, 20, 33, 50].into_iter().enumerate() {
                let ids: Vec<u32> = (0..len as u32).map(|i| (i * 7919 + 13 * id as u32 + 5) % 1000).collect();
                e.add_request(Request::new(id as u64, ids, 24)).unwrap();
            }
            let (mut checked, mut events) = (0, Vec::new());
            while !(e.running.is_empty() && e.waiting.is_empty()) {
                // Proposals of random heads are rejected, and a sequence whose proposals all
                // miss sits out steps: start every sequence's control afresh, so that each
                // decoding sequence proposes (and its head row is made) every step.
                for seq in &mut e.running {
                    seq.speculation = SpeculationControl::default();
                }
                events.clear();
                e.step(&mut events).unwrap();
                for seq in &e.running {
                    let mtp = e.mtp.as_ref().unwrap();
                    let Some(r) = seq.mtp_row.filter(|r| r.pass == mtp.passes() && r.tokens == seq.tokens.len()) else {
                        continue;
                    };
                    let c = seq.computed;
                    let mut t = target.new_seq();
                    assert!(target.grow(&mut t, c));
                    target.begin();
                    target.push(&mut t, &seq.tokens[..c], false);
                    target.forward(&pool);
                    let mut hidden = vec![0.0f32; c * h];
                    for (p, out) in hidden.chunks_exact_mut(h).enumerate() {
                        target.model().final_hidden(target.scratch(), p, out);
                    }
                    target.release(&mut t);
                    let mut s = fresh.new_seq();
                    assert!(fresh.grow(&mut s, c));
                    fresh.begin();
                    let row = fresh.push(&mut s, &seq.tokens[1..=c], &hidden, true).unwrap();
                    fresh.forward(&pool);
                    let bits = |l: &[f32]| l.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    let what = format!("{name} (zero head: {zero_head}): request {}, {c} positions", seq.request);
                    assert_eq!(bits(mtp.logits(r.row)), bits(fresh.logits(row)), "{what}: logits");
                    assert_eq!(bits(mtp.output(r.row)), bits(fresh.output(row)), "{what}: output row");
                    fresh.release(&mut s);
                    checked += 1;
                }
            }
            let (proposed, accepted) = (e.stats.draft_model_proposed_tokens, e.stats.draft_model_accepted_tokens);
            assert!(proposed > 0, "{name}: the head proposed nothing");
            if zero_head {
                assert_eq!(accepted, proposed, "{name}: a head of zeros proposes what the target picks");
            }
            assert!(checked > 20, "{name}: only {checked} rows checked");
            assert_eq!(e.mtp.as_ref().unwrap().blocks_in_use(), 0, "{name}: the head's blocks all return");
        }
    }

    #[test]
    fn under_quantize_the_mtp_head_reads_the_targets_quantized_head() {
        let dir = Path::new(FAMILIES).join("tiny-qwen3.5-mtp");
        let with_head = kylin_loader::LoadOptions { mtp: true, ..Default::default() };
        let opts = EngineOptions {
            threads: 2,
            ctx_size: Some(128),
            speculative_tokens: 2,
            mtp: true,
            quantize: Some(QuantFormat::Q8_0),
            precision: PrecisionChoice::Auto,
            ..EngineOptions::default()
        };
        let e = BatchEngine::new(kylin_loader::load(&dir, &with_head).unwrap(), &opts).unwrap();
        assert!(e.mtp.as_ref().unwrap().head().shares_quantized_lm_head(&e.core.model));
    }
}
