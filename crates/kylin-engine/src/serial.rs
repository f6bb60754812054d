//! [`SerialEngine`]: any [`Backend`] (llama.cpp's above all) behind the [`Serving`] interface,
//! one sequence at a time.
//!
//! Requests wait in a FCFS queue; the running one prefills in one step, then decodes one token
//! per step; its `n` choices run one after the other. The backend's KV cache works as a
//! one-sequence prefix cache: a new choice or request keeps the part of the cache its prompt
//! shares with what the cache holds, and computes only the rest.

use std::collections::VecDeque;

use kylin_loader::{GenerationDefaults, KylinError, Result};

use crate::backend::{Backend, ChatMessage};
use crate::sequence::Decoding;
use crate::serving::{EngineInfo, EngineStats, Event, EventKind, Request, Serving, StopReason, Usage};

/// Checks what both engines require of a request, before anything is queued.
pub fn validate_request(request: &Request, vocab: usize, context: usize, max_seqs: usize) -> Result<()> {
    request.sampling.validate()?;
    if request.prompt_ids.is_empty() {
        return Err(KylinError::input_invalid("the prompt has no tokens"));
    }
    if let Some(&bad) = request.prompt_ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(KylinError::input_invalid(format!(
            "token id {bad} is outside the model's vocabulary of {vocab} ids"
        )));
    }
    if let Some(pooled) = &request.pooling {
        if request.max_new_tokens != 0 || request.n != 1 {
            return Err(KylinError::input_invalid(format!(
                "a pooled request (embedding, reranking) generates nothing and has one choice; got max_tokens {} and n {}",
                request.max_new_tokens, request.n
            )));
        }
        if let crate::serving::Pooled::LastLogits(ids) = pooled {
            if ids.is_empty() || ids.len() > crate::serving::MAX_POOLED_IDS {
                return Err(KylinError::input_invalid(format!(
                    "a pooled request names 1 to {} token ids whose logits it returns; got {}",
                    crate::serving::MAX_POOLED_IDS,
                    ids.len()
                )));
            }
            if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                return Err(KylinError::input_invalid(format!(
                    "pooled token id {bad} is outside the model's vocabulary of {vocab} ids"
                )));
            }
        }
    }
    let scoring_only = request.max_new_tokens == 0 && (request.prompt_logprobs.is_some() || request.pooling.is_some());
    if request.prompt_ids.len() > context || (request.prompt_ids.len() == context && !scoring_only) {
        return Err(KylinError::context_overflow(format!(
            "the prompt has {} tokens but the context holds {context}, which leaves no room to generate; \
             shorten the prompt or raise --ctx-size",
            request.prompt_ids.len()
        )));
    }
    if request.n == 0 || request.n > max_seqs {
        return Err(KylinError::input_invalid(format!(
            "n must be between 1 and {max_seqs} (the engine's --max-seqs); got {}",
            request.n
        ))
        .for_field("n"));
    }
    if request.max_new_tokens == 0 && !scoring_only {
        return Err(KylinError::input_invalid("max_tokens must be at least 1 (0 only with prompt log-probabilities)")
            .for_field("max_tokens"));
    }
    if let Some(k) = request.logprobs.or(request.prompt_logprobs)
        && k > crate::serving::MAX_TOP_LOGPROBS
    {
        return Err(KylinError::input_invalid(format!(
            "top_logprobs must be at most {}; got {k}",
            crate::serving::MAX_TOP_LOGPROBS
        ))
        .for_field("top_logprobs"));
    }
    Ok(())
}

/// The choice being generated.
struct Running {
    request: Request,
    index: usize,
    decoding: Decoding,
    /// The tokens sampled (and forced by a grammar) last, not yet run through the model.
    pending: Vec<u32>,
}

/// After a sampled token (already in `pending`), appends the tokens the choice's grammar
/// forces; returns why the choice ended, if one of them ended it.
#[allow(clippy::too_many_arguments)]
fn take_forced(
    decoding: &mut Decoding,
    text: Option<&dyn Backend>,
    position: usize,
    context: usize,
    pending: &mut Vec<u32>,
    (request, index): (u64, usize),
    stats: &mut EngineStats,
    events: &mut Vec<Event>,
) -> Result<Option<StopReason>> {
    loop {
        let at_end = position + pending.len() >= context;
        match decoding.next_forced(text, at_end)? {
            None => return Ok(None),
            Some((id, token, reason)) => {
                pending.push(id);
                stats.generation_tokens_total += 1;
                events.push(Event { request, index, kind: token });
                if reason.is_some() {
                    return Ok(reason);
                }
            }
        }
    }
}

/// A [`Backend`] serving requests one sequence at a time.
pub struct SerialEngine {
    backend: Box<dyn Backend>,
    queue: VecDeque<Request>,
    running: Option<Running>,
    /// The ids whose keys and values are in the backend's cache, in order.
    cached: Vec<u32>,
    /// A copy of the last logits row, so the backend can detokenize while they are sampled.
    logits: Vec<f32>,
    stats: EngineStats,
}

impl SerialEngine {
    pub fn new(backend: Box<dyn Backend>) -> Self {
        let logits = vec![0.0; backend.vocab_size()];
        SerialEngine {
            backend,
            queue: VecDeque::new(),
            running: None,
            cached: Vec::new(),
            logits,
            stats: EngineStats::default(),
        }
    }

    /// Starts choice `index` of `request`: reuses the cached prefix, prefills the rest and
    /// samples the first token.
    fn start(&mut self, request: Request, index: usize, events: &mut Vec<Event>) -> Result<()> {
        let vocab = self.backend.vocab_size();
        let mut decoding = Decoding::new(&request, index, vocab, self.backend.eos_ids());
        let prompt = &request.prompt_ids;
        // Choice 0 of a request that scores its prompt computes every position's logits, so
        // the cache serves none of it.
        let scoring = request.prompt_logprobs.filter(|_| index == 0);
        let shared = self.cached.iter().zip(prompt).take_while(|(a, b)| a == b).count();
        let shared = shared.min(prompt.len() - 1).min(self.backend.position());
        let shared = if scoring.is_some() { 0 } else { shared };
        self.backend.rewind(shared);
        self.cached.truncate(shared);
        self.stats.prompt_tokens_total += prompt.len() as u64;
        self.stats.prefix_cache_queries += prompt.len() as u64;
        self.stats.prefix_cache_hits += shared as u64;
        decoding.usage.cached_prompt_tokens = shared;
        match scoring {
            Some(k) => {
                // (prompt, vocab): row p scores prompt token p + 1; the last row samples.
                let all = self.backend.prefill_all_logits(prompt)?;
                let logprobs = all
                    .chunks_exact(vocab)
                    .zip(&prompt[1..])
                    .map(|(row, &next)| crate::sequence::token_logprob(row, next, k))
                    .collect::<Vec<_>>();
                if !logprobs.is_empty() {
                    events.push(Event {
                        request: request.id,
                        index,
                        kind: EventKind::PromptLogprobs { start: 1, logprobs },
                    });
                }
                let last = all.len() - vocab;
                self.logits.copy_from_slice(&all[last..]);
            }
            None => self.logits.copy_from_slice(self.backend.prefill(&prompt[shared..])?),
        }
        self.cached.extend_from_slice(&prompt[shared..]);
        if decoding.generates_nothing() {
            // The request only scores its prompt.
            let running = Running { request, index, decoding, pending: Vec::new() };
            return self.after_token(running, Some(StopReason::Length), events);
        }
        let at_end = self.backend.position() >= self.backend.context_size();
        let text = self.backend.has_tokenizer().then_some(&*self.backend);
        let (id, token, reason) = decoding.accept(&self.logits, text, at_end)?;
        self.stats.generation_tokens_total += 1;
        events.push(Event { request: request.id, index, kind: token });
        let mut pending = vec![id];
        let reason = match reason {
            None => {
                let (position, context) = (self.backend.position(), self.backend.context_size());
                let who = (request.id, index);
                take_forced(&mut decoding, text, position, context, &mut pending, who, &mut self.stats, events)?
            }
            some => some,
        };
        let running = Running { request, index, decoding, pending };
        self.after_token(running, reason, events)
    }

    /// Keeps the choice running, or ends it and moves on to the request's next choice.
    fn after_token(&mut self, mut running: Running, reason: Option<StopReason>, events: &mut Vec<Event>) -> Result<()> {
        match reason {
            None => {
                self.running = Some(running);
                Ok(())
            }
            Some(reason) => {
                let text = self.backend.has_tokenizer().then_some(&*self.backend);
                let kind = running.decoding.finish(reason, text)?;
                events.push(Event { request: running.request.id, index: running.index, kind });
                if running.index + 1 < running.request.n {
                    let next = running.index + 1;
                    self.start(running.request, next, events)
                } else {
                    Ok(())
                }
            }
        }
    }

    /// Ends every remaining choice of a cancelled request.
    fn cancel_all(request: &Request, from: usize, events: &mut Vec<Event>) {
        for index in from..request.n {
            let usage = Usage { prompt_tokens: request.prompt_ids.len(), ..Usage::default() };
            let kind = EventKind::Finished { reason: StopReason::Cancelled, text: String::new(), usage };
            events.push(Event { request: request.id, index, kind });
        }
    }
}

impl Serving for SerialEngine {
    fn info(&self) -> EngineInfo {
        let summary = self.backend.summary();
        let context = self.backend.context_size();
        EngineInfo {
            backend: summary.backend,
            architecture: summary.architecture,
            vocab_size: self.backend.vocab_size(),
            context_size: context,
            max_seqs: 1,
            max_batch_tokens: context,
            kv_block_size: context,
            kv_blocks: 1,
            kv_tokens: context,
            kv_bytes: summary.kv_bytes_per_position.unwrap_or(0) * context as u64,
            kv_dtype: "f16".to_string(),
            threads: summary.threads,
            precision: summary.precision,
            kernels: summary.kernels,
            has_tokenizer: self.backend.has_tokenizer(),
            eos_ids: self.backend.eos_ids().to_vec(),
            state_pool: None,
        }
    }

    fn generation_defaults(&self) -> GenerationDefaults {
        self.backend.generation_defaults()
    }

    fn add_request(&mut self, request: Request) -> Result<()> {
        // One sequence at a time, but `n` choices run one after the other, so any n up to the
        // OpenAI limit is accepted.
        validate_request(&request, self.backend.vocab_size(), self.backend.context_size(), 128)?;
        if request.pooling.is_some() {
            return Err(KylinError::operator_unsupported(
                "pooled requests (decoder embeddings and reranking) run on the native engine, not one sequence at a time",
            ));
        }
        if !request.images.is_empty() {
            return Err(KylinError::operator_unsupported(
                "images run on the native engine (Hugging Face directories with a vision tower Kylin runs), not on this backend",
            ));
        }
        if self.queue.iter().any(|r| r.id == request.id)
            || self.running.as_ref().is_some_and(|r| r.request.id == request.id)
        {
            return Err(KylinError::input_invalid(format!("request id {} is already in the engine", request.id)));
        }
        self.queue.push_back(request);
        Ok(())
    }

    fn step(&mut self, events: &mut Vec<Event>) -> Result<()> {
        self.stats.steps += 1;
        // Cancelled requests in the queue end without running.
        self.queue.retain(|r| {
            if r.cancel.is_cancelled() {
                SerialEngine::cancel_all(r, 0, events);
                false
            } else {
                true
            }
        });
        if let Some(running) = self.running.take() {
            if running.request.cancel.is_cancelled() {
                SerialEngine::cancel_all(&running.request, running.index, events);
                return Ok(());
            }
            let mut running = running;
            let logits = match running.pending.as_slice() {
                [] => return Ok(()),
                [id] => self.backend.decode(*id)?,
                ids => self.backend.prefill(ids)?,
            };
            self.logits.copy_from_slice(logits);
            self.cached.append(&mut running.pending);
            let at_end = self.backend.position() >= self.backend.context_size();
            let text = self.backend.has_tokenizer().then_some(&*self.backend);
            let (next, token, reason) = running.decoding.accept(&self.logits, text, at_end)?;
            self.stats.generation_tokens_total += 1;
            running.pending.push(next);
            events.push(Event { request: running.request.id, index: running.index, kind: token });
            let reason = match reason {
                None => {
                    let (position, context) = (self.backend.position(), self.backend.context_size());
                    let who = (running.request.id, running.index);
                    let (decoding, pending) = (&mut running.decoding, &mut running.pending);
                    take_forced(decoding, text, position, context, pending, who, &mut self.stats, events)?
                }
                some => some,
            };
            return self.after_token(running, reason, events);
        }
        if let Some(request) = self.queue.pop_front() {
            self.start(request, 0, events)?;
        }
        Ok(())
    }

    fn has_work(&self) -> bool {
        self.running.is_some() || !self.queue.is_empty()
    }

    fn stats(&self) -> EngineStats {
        EngineStats {
            running: usize::from(self.running.is_some()),
            waiting: self.queue.len(),
            kv_blocks_total: 1,
            kv_blocks_used: usize::from(self.running.is_some()),
            kv_blocks_cached: usize::from(self.running.is_none() && !self.cached.is_empty()),
            ..self.stats
        }
    }

    fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        self.backend.tokenize(text, add_special)
    }

    fn detokenize(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.backend.detokenize(ids, skip_special)
    }

    fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        self.backend.apply_chat_template(messages, add_generation_prompt, kwargs)
    }
}
