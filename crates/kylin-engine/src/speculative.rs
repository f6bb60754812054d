//! The n-gram proposer of speculative decoding (prompt lookup): guesses the tokens that follow a
//! sequence by finding its last few tokens earlier in it (in the prompt or the output so far)
//! and copying what followed them there.
//!
//! The batching engine verifies the guesses ([`crate::batch`]): a decoding sequence computes its
//! last sampled token and the proposals as one segment with the logits of every row, and samples
//! row by row with its ordinary sampler, stopping at the first sampled token that differs from
//! the proposal. A row's logits are those of a one-token decode (the kernels are batch
//! invariant) and the sampler draws one number per emitted token, so the output is the
//! non-speculative stream token for token, for greedy and seeded sampling alike.
//!
//! Guarantees: proposing allocates nothing (it appends to a buffer planned with room for the
//! proposals) and reads only the sequence's tokens.

/// A source of proposals in place of the n-gram proposer, for a program that embeds the engine
/// and knows better what comes next (a suffix index over a code base, the previous version of
/// a document being edited, a retrieval cache), set with `BatchEngine::set_proposer`.
/// Whatever it proposes, outputs are those of decoding without speculation; a good proposer
/// only makes them come in fewer steps.
pub trait Proposer: Send {
    /// Appends to `out` up to `k` tokens proposed to follow `tokens` (the prompt and the
    /// output so far) of choice `index` of request `request`; returns how many were appended.
    /// `out` has room for `k` more tokens: a proposer that pushes no more than `k` allocates
    /// nothing. The engine keeps at most `k` and stops at the first id outside the vocabulary.
    fn propose(&mut self, request: u64, index: usize, tokens: &[u32], k: usize, out: &mut Vec<u32>) -> usize;
}

/// The longest suffix of the sequence the proposer looks for earlier in it.
pub const NGRAM_MAX: usize = 8;
/// The shortest suffix it looks for, when no longer one occurs earlier.
pub const NGRAM_MIN: usize = 1;
/// The most proposals per sequence and step `--speculative-tokens` accepts.
pub const MAX_SPECULATIVE_TOKENS: usize = 32;

/// How many tokens a sequence proposes next, adapted to how its proposals fared: proposals cost
/// a logits row each (and, with a draft model, draft passes), so a sequence whose guesses keep
/// missing stops paying for them. Whatever it decides, outputs are the same (speculation never
/// changes a token); only the speed is at stake.
///
/// - A sequence starts at [`FIRST_LENGTH`] tokens (a guess costs a row before it is known to
///   pay).
/// - Every proposal accepted: the length doubles, up to `--speculative-tokens`.
/// - Some accepted: the next length is one more than were accepted.
/// - None accepted: the length halves, and the sequence sits out 1, 3, 7, 15, then 31 steps
///   (consecutive misses back off exponentially); its next proposals probe again.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpeculationControl {
    /// The length cap (0: not set yet, [`FIRST_LENGTH`]).
    cap: usize,
    /// Steps left to sit out.
    skip: u32,
    /// Consecutive steps with no proposal accepted.
    misses: u32,
}

/// The length a sequence's first proposals have at most.
pub const FIRST_LENGTH: usize = 2;

/// The longest a sequence sits out after proposals that all missed.
const MAX_SKIP: u32 = 31;

impl SpeculationControl {
    /// The most tokens to propose this step (`max` is `--speculative-tokens`); 0 while sitting
    /// out, which counts the step.
    pub fn next_len(&mut self, max: usize) -> usize {
        if self.skip > 0 {
            self.skip -= 1;
            return 0;
        }
        if self.cap == 0 { FIRST_LENGTH.min(max) } else { self.cap.min(max) }
    }

    /// Whether the sequence sits out its next step (proposes nothing then).
    pub fn sitting_out(&self) -> bool {
        self.skip > 0
    }

    /// Records that `accepted` of `proposed` (> 0) proposals were accepted.
    pub fn update(&mut self, proposed: usize, accepted: usize, max: usize) {
        if accepted >= proposed {
            self.cap = (proposed * 2).min(max).max(1);
            self.misses = 0;
        } else if accepted == 0 {
            self.misses = self.misses.saturating_add(1);
            self.cap = (proposed / 2).max(1);
            self.skip = ((1u32 << self.misses.min(5)) - 1).min(MAX_SKIP);
        } else {
            self.cap = (accepted + 1).min(max);
            self.misses = 0;
        }
    }
}

/// Appends to `out` up to `k` tokens proposed to follow `tokens`: for `n` from [`NGRAM_MAX`]
/// down to [`NGRAM_MIN`], the earlier occurrences of the last `n` tokens are looked for, and
/// the tokens that followed one of them are proposed: the most recent occurrence followed by
/// `k` tokens, or when none is, the earliest (the one followed by the most). Returns how many
/// were appended (0 when no suffix occurs earlier).
pub fn propose_ngram(tokens: &[u32], k: usize, out: &mut Vec<u32>) -> usize {
    let len = tokens.len();
    if k == 0 {
        return 0;
    }
    for n in (NGRAM_MIN..=NGRAM_MAX).rev() {
        if len <= n {
            continue;
        }
        let suffix = &tokens[len - n..];
        // Occurrences starting at `start < len - n`, so that at least one token follows them;
        // the most recent first.
        let mut earliest = None;
        for start in (0..len - n).rev() {
            if &tokens[start..start + n] == suffix {
                earliest = Some(start);
                if start + n + k <= len {
                    break;
                }
            }
        }
        if let Some(start) = earliest {
            let from = start + n;
            let to = (from + k).min(len);
            out.extend_from_slice(&tokens[from..to]);
            return to - from;
        }
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn speculation_length_grows_with_acceptance_and_backs_off_after_misses() {
        let mut c = SpeculationControl::default();
        assert_eq!(c.next_len(8), FIRST_LENGTH);
        assert_eq!(c.next_len(1), 1);
        c.update(2, 2, 8);
        assert_eq!(c.next_len(8), 4);
        c.update(4, 4, 8);
        c.update(8, 8, 8);
        assert_eq!(c.next_len(8), 8);
        c.update(8, 2, 8);
        assert_eq!(c.next_len(8), 3);
        c.update(3, 3, 8);
        assert_eq!(c.next_len(8), 6);
        // Misses: sit out 1, then 3, then 7 steps, the length halving each time.
        for (skip, len) in [(1, 3), (3, 1), (7, 1)] {
            let proposed = c.next_len(8);
            c.update(proposed, 0, 8);
            for _ in 0..skip {
                assert_eq!(c.next_len(8), 0);
            }
            assert_eq!(c.next_len(8), len, "after sitting out {skip}");
            // That probe's proposals miss too: the next round of the loop records it.
            c.cap = len;
        }
        // The back-off is capped.
        for _ in 0..10 {
            c.update(1, 0, 8);
        }
        assert_eq!(c.skip, MAX_SKIP);
        // One hit resets it.
        c.skip = 0;
        c.update(1, 1, 8);
        assert_eq!((c.next_len(8), c.misses), (2, 0));
    }

    fn propose(tokens: &[u32], k: usize) -> Vec<u32> {
        let mut out = Vec::new();
        let n = propose_ngram(tokens, k, &mut out);
        assert_eq!(n, out.len());
        out
    }

    #[test]
    fn the_longest_suffix_found_earlier_proposes_what_followed_it() {
        // "1 2 3" occurred at the start and was followed by "4 5 6".
        assert_eq!(propose(&[1, 2, 3, 4, 5, 6, 9, 1, 2, 3], 2), vec![4, 5]);
        assert_eq!(propose(&[1, 2, 3, 4, 5, 6, 9, 1, 2, 3], 8), vec![4, 5, 6, 9, 1, 2, 3]);
        // The trigram "7 2 3" never occurred: the bigram "2 3" did, most recently before "8".
        assert_eq!(propose(&[2, 3, 5, 2, 3, 8, 7, 2, 3], 1), vec![8]);
        // Only the last token recurs.
        assert_eq!(propose(&[4, 9, 8, 7, 4], 3), vec![9, 8, 7]);
    }

    #[test]
    fn nothing_is_proposed_without_an_earlier_occurrence() {
        assert!(propose(&[1, 2, 3, 4], 4).is_empty());
        assert!(propose(&[1], 4).is_empty());
        assert!(propose(&[], 4).is_empty());
        assert!(propose(&[1, 2, 1], 0).is_empty());
    }

    #[test]
    fn a_repeated_token_proposes_itself() {
        assert_eq!(propose(&[5, 5, 5, 5], 3), vec![5]);
        // The longest suffix that recurs (eight 5s) is found where three tokens follow it.
        assert_eq!(propose(&[1, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5], 3), vec![5, 5, 5]);
    }
}
