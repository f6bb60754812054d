//! What happens to one choice of a request after the model produced its next-token logits:
//! sampling, log-probabilities, streaming detokenization, stop strings, EOS and the token
//! limit. Written once and used by both serving engines, so that a request behaves the same
//! whichever engine runs it.
//!
//! Guarantees: every buffer the sampler needs is allocated when the choice is created; a step
//! allocates only the text pieces and log-probability lists it hands out (and, for a
//! constrained choice, what llguidance allocates for its mask).

use kylin_loader::Result;

use crate::detok::{Detokenize, StopMatcher, StopOutcome, StreamDecoder};
use crate::grammar::GrammarState;
use crate::sampler::Sampler;
use crate::serving::{EventKind, MAX_TOP_LOGPROBS, Request, StopReason, TokenLogprob, Usage};

/// The generation state of one choice (one of a request's `n` parallel samples).
#[derive(Debug, Clone)]
pub struct Decoding {
    sampler: Sampler,
    decoder: StreamDecoder,
    stops: StopMatcher,
    /// Ids that end the choice (empty with `ignore_eos`).
    eos: Vec<u32>,
    max_new_tokens: usize,
    logprobs: Option<usize>,
    /// Top alternatives of the prompt's log-probabilities, when they are wanted.
    prompt_logprobs: Option<usize>,
    detokenize: bool,
    /// Added to the logits before sampling.
    logit_bias: Vec<(u32, f32)>,
    /// The choice's position in its grammar, when the request is constrained.
    grammar: Option<GrammarState>,
    /// Tokens generated so far (an ending EOS included).
    pub generated: usize,
    pub usage: Usage,
}

/// What one token did to a choice: its id, its event, and why the choice ended with it.
pub type Accepted = (u32, EventKind, Option<StopReason>);

impl Decoding {
    /// The state of choice `index` of `request`; its sampler is seeded with `seed + index` and
    /// has seen the prompt (for the repetition penalty).
    pub fn new(request: &Request, index: usize, vocab: usize, eos_ids: &[u32]) -> Self {
        let mut params = request.sampling;
        params.seed = params.seed.wrapping_add(index as u64);
        let mut sampler = Sampler::new(vocab, params);
        sampler.observe_all(&request.prompt_ids);
        Decoding {
            sampler,
            decoder: StreamDecoder::new(request.skip_special_tokens),
            stops: StopMatcher::new(&request.stop),
            eos: if request.ignore_eos { Vec::new() } else { eos_ids.to_vec() },
            max_new_tokens: request.max_new_tokens,
            logprobs: request.logprobs.map(|k| k.min(MAX_TOP_LOGPROBS)),
            prompt_logprobs: request.prompt_logprobs.map(|k| k.min(MAX_TOP_LOGPROBS)),
            detokenize: request.detokenize,
            logit_bias: request.logit_bias.iter().copied().filter(|&(id, _)| (id as usize) < vocab).collect(),
            grammar: request.grammar.as_ref().map(|g| g.start()),
            generated: 0,
            usage: Usage { prompt_tokens: request.prompt_ids.len(), ..Usage::default() },
        }
    }

    /// `Some(k)` when the request wants its prompt's log-probabilities with `k` alternatives.
    pub fn prompt_logprobs(&self) -> Option<usize> {
        self.prompt_logprobs
    }

    /// True when the request only scores its prompt (`max_new_tokens` of 0): the choice ends
    /// with [`StopReason::Length`] when its prompt is computed, nothing sampled.
    pub fn generates_nothing(&self) -> bool {
        self.max_new_tokens == 0
    }

    /// Tokens the choice may still generate before its limit.
    pub fn remaining(&self) -> usize {
        self.max_new_tokens.saturating_sub(self.generated)
    }

    /// True when speculative decoding may propose tokens for the choice: always, but while a
    /// grammar forces tokens (they are handed out first, without sampling).
    pub fn may_speculate(&self) -> bool {
        self.grammar.as_ref().is_none_or(|g| !g.has_forced())
    }

    /// True while the grammar forces tokens that wait to be handed out
    /// ([`Decoding::next_forced`]): a speculative verification stops there.
    pub fn has_forced(&self) -> bool {
        self.grammar.as_ref().is_some_and(GrammarState::has_forced)
    }

    /// How many of the proposals `tokens` the choice's grammar accepts in order from where it
    /// is (all of them without a grammar), consuming none: a proposal the grammar forbids
    /// could never be sampled, so it is not computed.
    pub fn valid_prefix(&mut self, tokens: &[u32]) -> usize {
        match &mut self.grammar {
            Some(g) => g.valid_prefix(tokens),
            None => tokens.len(),
        }
    }

    /// True when the choice is constrained and the mask for its next token is not computed
    /// yet: [`Decoding::prepare_mask`] can run while the forward pass does.
    pub fn needs_mask(&self) -> bool {
        self.grammar.as_ref().is_some_and(GrammarState::needs_mask)
    }

    /// Computes the grammar's mask for the next token (nothing without a grammar). A failure
    /// is reported by the next [`Decoding::accept`], which computes the mask again.
    pub fn prepare_mask(&mut self) {
        if let Some(g) = &mut self.grammar {
            let _ = g.prepare();
        }
    }

    /// Samples the next token from `logits` (`(vocab)`), and returns it with the token event
    /// and, when the choice ends with it, the reason. `at_context_end` says the sequence has no
    /// room for another token. `text` is the detokenizer (None: ids only).
    ///
    /// With a grammar, the forbidden ids are masked first, and the tokens the grammar forces
    /// after this one are then handed out by [`Decoding::next_forced`].
    pub fn accept<D: Detokenize + ?Sized>(
        &mut self,
        logits: &[f32],
        text: Option<&D>,
        at_context_end: bool,
    ) -> Result<Accepted> {
        let bias = &self.logit_bias;
        let grammar = &mut self.grammar;
        let sampled = self.sampler.sample_with(logits, |l| {
            for &(id, b) in bias {
                if let Some(x) = l.get_mut(id as usize) {
                    *x += b;
                }
            }
            match grammar {
                Some(g) => g.apply(l),
                None => Ok(()),
            }
        });
        let id = match sampled {
            Ok(id) => id,
            Err(_) if self.grammar.is_some() => {
                // The grammar could not say what may come next: the choice ends here, with
                // what it has (no token of this step is emitted).
                let id = self.eos.first().copied().unwrap_or(0);
                self.grammar = None;
                return Ok((
                    id,
                    EventKind::Token { id, text: String::new(), logprob: None },
                    Some(StopReason::GrammarFailed),
                ));
            }
            Err(e) => return Err(e),
        };
        let logprob = self.logprobs.map(|k| token_logprob(logits, id, k));
        self.take(id, logprob, text, at_context_end)
    }

    /// The next token the grammar forces after the last one, with its event and, when the
    /// choice ends with it, the reason; `None` when nothing is forced (sample next). A forced
    /// token's log-probability is 0 (it was the only possible token).
    pub fn next_forced<D: Detokenize + ?Sized>(
        &mut self,
        text: Option<&D>,
        at_context_end: bool,
    ) -> Result<Option<Accepted>> {
        let Some(id) = self.grammar.as_ref().and_then(GrammarState::forced) else { return Ok(None) };
        let logprob = self.logprobs.map(|_| TokenLogprob { id, logprob: 0.0, top: Vec::new() });
        self.take(id, logprob, text, at_context_end).map(Some)
    }

    /// Appends `id` to the choice: counts, grammar, detokenization, stop strings and limits.
    fn take<D: Detokenize + ?Sized>(
        &mut self,
        id: u32,
        logprob: Option<TokenLogprob>,
        text: Option<&D>,
        at_context_end: bool,
    ) -> Result<Accepted> {
        self.sampler.observe_generated(id);
        self.generated += 1;
        self.usage.completion_tokens = self.generated;
        let mut piece = String::new();
        let mut reason = None;
        if self.eos.contains(&id) {
            reason = Some(StopReason::Eos);
        } else {
            if let Some(g) = &mut self.grammar
                && g.commit(id).is_err()
            {
                reason = Some(StopReason::GrammarFailed);
            }
            if let (true, Some(text)) = (self.detokenize, text) {
                let decoded = self.decoder.push(text, id)?;
                if !decoded.is_empty() {
                    match self.stops.push(&decoded) {
                        StopOutcome::Continue(out) => piece = out,
                        StopOutcome::Stopped(out) => {
                            piece = out;
                            reason = reason.or(Some(StopReason::StopString));
                        }
                    }
                }
            }
        }
        if reason.is_none() {
            if self.grammar.as_ref().is_some_and(GrammarState::is_finished) {
                // The grammar is complete: nothing but EOS could follow.
                reason = Some(StopReason::Eos);
            } else if self.generated >= self.max_new_tokens {
                reason = Some(StopReason::Length);
            } else if at_context_end {
                reason = Some(StopReason::ContextFull);
            }
        }
        Ok((id, EventKind::Token { id, text: piece, logprob }, reason))
    }

    /// Ends the choice: releases the text still held back (none after a stop string) and
    /// returns the final event.
    pub fn finish<D: Detokenize + ?Sized>(&mut self, reason: StopReason, text: Option<&D>) -> Result<EventKind> {
        let mut rest = String::new();
        if reason != StopReason::StopString
            && let (true, Some(text)) = (self.detokenize, text)
        {
            rest = self.decoder.flush(text)?;
            rest = match self.stops.push(&rest) {
                StopOutcome::Stopped(out) => out,
                StopOutcome::Continue(out) => out + &self.stops.finish(),
            };
        }
        Ok(EventKind::Finished { reason, text: rest, usage: self.usage })
    }
}

/// Log-probability of `id` and the `k` best ids under `softmax(logits)` (raw model output).
pub fn token_logprob(logits: &[f32], id: u32, k: usize) -> TokenLogprob {
    let max = logits.iter().copied().filter(|v| !v.is_nan()).fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().filter(|v| !v.is_nan()).map(|&v| f64::from(v - max).exp()).sum();
    let log_z = f64::from(max) + sum.ln();
    let logprob_of = |v: f32| if v.is_nan() { f32::NEG_INFINITY } else { (f64::from(v) - log_z) as f32 };
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k > 0 {
        // Keep the k best in a small sorted list (best first, lower id first on ties).
        for (i, &v) in logits.iter().enumerate() {
            if v.is_nan() {
                continue;
            }
            if top.len() == k && top.last().is_some_and(|&(_, worst)| v <= worst) {
                continue;
            }
            let at = top.partition_point(|&(_, x)| x >= v);
            top.insert(at, (i as u32, v));
            top.truncate(k);
        }
    }
    let chosen = logits.get(id as usize).copied().unwrap_or(f32::NEG_INFINITY);
    TokenLogprob { id, logprob: logprob_of(chosen), top: top.into_iter().map(|(i, v)| (i, logprob_of(v))).collect() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_a_log_softmax_with_the_best_first() {
        let logits = [1.0f32, 3.0, 2.0, 3.0];
        let lp = token_logprob(&logits, 2, 3);
        let z: f64 = logits.iter().map(|&v| f64::from(v).exp()).sum();
        assert!((f64::from(lp.logprob) - (2.0 - z.ln())).abs() < 1e-6);
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 3, 2]);
        let total: f64 = logits.iter().map(|&v| (f64::from(v) - z.ln()).exp()).sum();
        assert!((total - 1.0).abs() < 1e-9);
    }

    #[test]
    fn length_and_eos_end_a_choice() {
        let mut request = Request::new(1, vec![0], 2);
        request.detokenize = false;
        let mut d = Decoding::new(&request, 0, 4, &[3]);
        let none: Option<&crate::text::TextCodec> = None;
        let (id, _, reason) = d.accept(&[0.0, 5.0, 0.0, 0.0], none, false).unwrap();
        assert_eq!((id, reason), (1, None));
        let (_, _, reason) = d.accept(&[0.0, 5.0, 0.0, 0.0], none, false).unwrap();
        assert_eq!(reason, Some(StopReason::Length));
        let mut d = Decoding::new(&request, 0, 4, &[3]);
        let (_, _, reason) = d.accept(&[0.0, 0.0, 0.0, 9.0], none, false).unwrap();
        assert_eq!(reason, Some(StopReason::Eos));
    }
}
