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

/// The longest suffix of the sequence the proposer looks for earlier in it.
pub const NGRAM_MAX: usize = 3;
/// The shortest suffix it looks for, when no longer one occurs earlier.
pub const NGRAM_MIN: usize = 1;
/// The most proposals per sequence and step `--speculative-tokens` accepts.
pub const MAX_SPECULATIVE_TOKENS: usize = 32;

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
        assert_eq!(propose(&[1, 5, 5, 5, 5, 5, 5], 3), vec![5, 5, 5]);
    }
}
