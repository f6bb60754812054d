//! Decoder rerankers: the prompt Qwen3-Reranker is trained on, and its score.
//!
//! Qwen3-Reranker is a plain causal LM that answers "yes" or "no" to whether a document meets a
//! query. Its model card builds each pair's input as `prefix + pair + suffix`, each part
//! tokenized on its own (the pair with the tokenizer's specials, which Qwen's tokenizer does not
//! add), and scores the pair with the probability of `yes` against `no` at the last position.
//! [`yes_no_prompt`] and [`yes_probability`] are those two steps; the engine runs the prompts as
//! pooled requests that return the two logits.

use kylin_loader::Result;

use crate::text::TextCodec;

/// The system turn and the opening of the user turn, as Qwen3-Reranker's model card writes it.
pub const RERANK_PREFIX: &str = "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n";
/// The end of the user turn and an assistant turn with empty thinking.
pub const RERANK_SUFFIX: &str = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";
/// The task instruction when the request gives none (the model card's default).
pub const RERANK_INSTRUCTION: &str = "Given a web search query, retrieve relevant passages that answer the query";

/// The token ids of one query–document pair in Qwen3-Reranker's format.
pub fn yes_no_prompt(text: &TextCodec, query: &str, document: &str, instruction: Option<&str>) -> Result<Vec<u32>> {
    let mut prompts = yes_no_prompts(text, query, std::slice::from_ref(&document), instruction)?;
    Ok(prompts.remove(0))
}

/// The token ids of every query–document pair, the fixed prefix and suffix tokenized once.
pub fn yes_no_prompts<D: AsRef<str>>(
    text: &TextCodec,
    query: &str,
    documents: &[D],
    instruction: Option<&str>,
) -> Result<Vec<Vec<u32>>> {
    let instruction = instruction.unwrap_or(RERANK_INSTRUCTION);
    let prefix = text.tokenize(RERANK_PREFIX, false)?;
    let suffix = text.tokenize(RERANK_SUFFIX, false)?;
    documents
        .iter()
        .map(|document| {
            let pair = format!("<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {}", document.as_ref());
            let pair = text.tokenize(&pair, true)?;
            let mut ids = Vec::with_capacity(prefix.len() + pair.len() + suffix.len());
            ids.extend_from_slice(&prefix);
            ids.extend(pair);
            ids.extend_from_slice(&suffix);
            Ok(ids)
        })
        .collect()
}

/// `exp(log_softmax([no, yes])[1])`: the probability of `yes` over the two answers.
pub fn yes_probability(no: f32, yes: f32) -> f32 {
    // Computed as 1 / (1 + e^(no - yes)), which neither overflows nor loses the small scores.
    1.0 / (1.0 + ((no - yes) as f64).exp()) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yes_probability_is_the_two_way_softmax() {
        assert_eq!(yes_probability(0.0, 0.0), 0.5);
        let (no, yes) = (1.25f32, -0.5f32);
        let want = (yes.exp() / (yes.exp() + no.exp())) as f64;
        assert!((yes_probability(no, yes) as f64 - want).abs() < 1e-7);
        // Far apart logits saturate instead of overflowing.
        assert_eq!(yes_probability(-1e4, 1e4), 1.0);
        assert_eq!(yes_probability(1e4, -1e4), 0.0);
    }
}
