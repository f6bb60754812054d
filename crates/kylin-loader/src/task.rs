//! What a decoder directory is for: generating text (the default), embedding texts (a decoder
//! embedder such as Qwen3-Embedding) or scoring query–document pairs (a decoder reranker such
//! as Qwen3-Reranker).
//!
//! The directory says which, as the tools people use read it:
//! * sentence-transformers' `modules.json` (with `1_Pooling/config.json`): an embedder, pooled
//!   and normalised as those files say. A decoder's states are causal, so only last-token
//!   pooling (`lasttoken`, what Qwen3-Embedding and gte-Qwen ship) is meaningful and run; any
//!   other mode is `OPERATOR_UNSUPPORTED` naming the file.
//! * A `README.md` whose heading is `# Qwen3-Reranker`: Qwen3-Reranker, which publishes a plain
//!   `Qwen3ForCausalLM` and scores with the logits of `yes` and `no` after its own prompt
//!   (llama.cpp's converter recognises it the same way).
//! * Otherwise a text generator.
//!
//! `--task` ([`TaskChoice`]) overrides the files: `embed` turns any decoder into a last-token,
//! normalised embedder; `rerank` scores with `yes`/`no` as Qwen3-Reranker does; `generate`
//! ignores sentence-transformers' files.

use std::collections::BTreeMap;
use std::path::Path;

use crate::encoder::{Pooling, read_sentence_config};
use crate::error::{KylinError, Result, regular_file};
use crate::tokenizer::TokenizerBundle;

/// What the user asked the model to be (`--task`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TaskChoice {
    /// Whatever the directory's files say.
    #[default]
    Auto,
    Generate,
    Embed,
    Rerank,
}

/// What a loaded decoder serves.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "snake_case", tag = "task")]
pub enum ModelTask {
    /// Text generation (completions, chat).
    Generate,
    /// Embeddings: the final hidden state (after the final norm) of the last token.
    Embed(DecoderEmbedding),
    /// Relevance scores: `P(yes)` over `{yes, no}` at the last position of the reranker's prompt.
    Rerank(DecoderReranker),
}

/// A decoder embedder's pooling facts (last-token pooling is implied).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DecoderEmbedding {
    /// Embeddings have unit length (`modules.json`'s `Normalize`; always with `--task embed`).
    pub normalize: bool,
    /// Named prompts prefixed to a text (`config_sentence_transformers.json`), e.g. Qwen3-Embedding's
    /// `query` instruction.
    pub prompts: BTreeMap<String, String>,
    /// Where the facts came from, for reports (`modules.json` or `--task embed`).
    pub source: String,
}

/// A `yes`/`no` decoder reranker (Qwen3-Reranker's scoring).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DecoderReranker {
    pub yes_id: u32,
    pub no_id: u32,
    /// Where the choice came from (`README.md` or `--task rerank`).
    pub source: String,
}

/// Decides the task of a decoder directory (see the module documentation).
pub fn decide(dir: &Path, choice: TaskChoice, tokenizer: Option<&TokenizerBundle>) -> Result<ModelTask> {
    match choice {
        TaskChoice::Generate => Ok(ModelTask::Generate),
        TaskChoice::Embed => Ok(ModelTask::Embed(match sentence_embedding(dir)? {
            Some(e) => e,
            None => DecoderEmbedding { normalize: true, prompts: BTreeMap::new(), source: "--task embed".into() },
        })),
        TaskChoice::Rerank => reranker(tokenizer, "--task rerank").map(ModelTask::Rerank),
        TaskChoice::Auto => {
            if let Some(e) = sentence_embedding(dir)? {
                return Ok(ModelTask::Embed(e));
            }
            if readme_names_qwen3_reranker(dir)? {
                return reranker(tokenizer, "README.md (# Qwen3-Reranker)").map(ModelTask::Rerank);
            }
            Ok(ModelTask::Generate)
        }
    }
}

/// sentence-transformers' files of a decoder directory, if it has them.
fn sentence_embedding(dir: &Path) -> Result<Option<DecoderEmbedding>> {
    let Some(sentence) = read_sentence_config(dir)? else { return Ok(None) };
    if sentence.pooling != Pooling::LastToken {
        return Err(KylinError::operator_unsupported(format!(
            "the pooling module asks for `{}` pooling; a decoder's states are causal, and Kylin pools decoder \
             embedders by their last token only (sentence-transformers' `lasttoken`, as Qwen3-Embedding ships)",
            sentence.pooling.name()
        ))
        .at(dir.join("modules.json")));
    }
    Ok(Some(DecoderEmbedding { normalize: sentence.normalize, prompts: sentence.prompts, source: sentence.source }))
}

/// True when `dir/README.md` carries Qwen3-Reranker's heading (read up to 64 KiB).
fn readme_names_qwen3_reranker(dir: &Path) -> Result<bool> {
    let path = dir.join("README.md");
    if !regular_file(&path)? {
        return Ok(false);
    }
    use std::io::Read;
    let file = std::fs::File::open(&path).map_err(|e| KylinError::io(&path, "cannot read", &e))?;
    let mut head = Vec::new();
    file.take(64 << 10).read_to_end(&mut head).map_err(|e| KylinError::io(&path, "cannot read", &e))?;
    Ok(String::from_utf8_lossy(&head).lines().any(|l| l.trim_end() == "# Qwen3-Reranker"))
}

/// The `yes` and `no` ids of the tokenizer, which the reranker's score reads.
fn reranker(tokenizer: Option<&TokenizerBundle>, source: &str) -> Result<DecoderReranker> {
    let tok = tokenizer.ok_or_else(|| {
        KylinError::config_missing(format!(
            "a yes/no reranker ({source}) needs the model's tokenizer to find the `yes` and `no` tokens"
        ))
    })?;
    let id = |token: &str| {
        tok.tokenizer.token_to_id(token).ok_or_else(|| {
            KylinError::config_invalid(format!(
                "a yes/no reranker ({source}) reads the logits of the tokens `yes` and `no`; the tokenizer has no token `{token}`"
            ))
        })
    };
    Ok(DecoderReranker { yes_id: id("yes")?, no_id: id("no")?, source: source.into() })
}
