//! An encoder as a [`Serving`] engine: embeddings and reranking for the server and the CLI.
//!
//! [`EncoderEngine`] answers [`Serving::embed`] (an embedding model) or [`Serving::rerank`] (a
//! cross-encoder) with one batched forward pass per call, on the thread that owns it, between
//! the steps it never has (it generates nothing: [`Serving::add_request`] refuses with
//! `INPUT_INVALID` saying which endpoints the model serves). Tokenizing and detokenizing work as
//! for any model, so `/tokenize` does too.

use kylin_loader::encoder::{EncoderKind, LoadedEncoder};
use kylin_loader::{GenerationDefaults, KylinError, Result};

use crate::backend::ChatMessage;
use crate::encoder::{Encoder, EncoderInput, EncoderOptions};
use crate::serving::{EmbeddingInfo, EngineInfo, EngineStats, Event, Request, Serving};
use crate::text::TextCodec;

/// An encoder model serving embeddings or rerank scores.
pub struct EncoderEngine {
    encoder: Encoder,
    text: Option<TextCodec>,
    /// Ids the tokenizer ends sequences with (reported; nothing is generated).
    eos_ids: Vec<u32>,
    max_batch_tokens: usize,
    stats: EngineStats,
}

impl std::fmt::Debug for EncoderEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EncoderEngine").field("encoder", &self.encoder).finish()
    }
}

impl EncoderEngine {
    pub fn new(loaded: LoadedEncoder, opts: EncoderOptions) -> Result<Self> {
        let encoder = Encoder::new(&loaded, opts)?;
        let text = loaded.tokenizer.as_ref().map(|t| TextCodec::new(t, None)).transpose()?;
        let eos_ids =
            loaded.tokenizer.as_ref().and_then(|t| t.eos_token.as_ref()).map(|t| vec![t.id]).unwrap_or_default();
        Ok(EncoderEngine {
            encoder,
            text,
            eos_ids,
            max_batch_tokens: opts.max_batch_tokens,
            stats: EngineStats::default(),
        })
    }

    pub fn encoder(&self) -> &Encoder {
        &self.encoder
    }

    fn text(&self) -> Result<&TextCodec> {
        self.text.as_ref().ok_or_else(|| {
            KylinError::config_missing("this model has no tokenizer (tokenizer.json); send token ids instead of text")
        })
    }

    /// What the model serves, for messages.
    fn serves(&self) -> &'static str {
        if self.encoder.is_cross_encoder() { "/v1/rerank" } else { "/v1/embeddings" }
    }
}

impl Serving for EncoderEngine {
    fn info(&self) -> EngineInfo {
        let c = self.encoder.config();
        EngineInfo {
            backend: "kylin".into(),
            architecture: c.architecture.clone(),
            vocab_size: c.vocab_size,
            context_size: self.encoder.max_tokens(),
            max_seqs: 1,
            max_batch_tokens: self.max_batch_tokens,
            kv_block_size: 0,
            kv_blocks: 0,
            kv_tokens: 0,
            kv_bytes: 0,
            kv_dtype: "none".into(),
            threads: self.encoder.threads(),
            precision: "f32".into(),
            kernels: kylin_kernels::kernel_family(kylin_kernels::Precision::F32).into(),
            has_tokenizer: self.text.is_some(),
            eos_ids: self.eos_ids.clone(),
            state_pool: None,
        }
    }

    fn generation_defaults(&self) -> GenerationDefaults {
        GenerationDefaults::default()
    }

    fn add_request(&mut self, _request: Request) -> Result<()> {
        Err(KylinError::input_invalid(format!(
            "{} is an encoder: it generates no text; use {}",
            self.encoder.config().architecture,
            self.serves()
        )))
    }

    fn step(&mut self, _events: &mut Vec<Event>) -> Result<()> {
        Ok(())
    }

    fn has_work(&self) -> bool {
        false
    }

    fn stats(&self) -> EngineStats {
        self.stats
    }

    fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        self.text()?.tokenize(text, add_special)
    }

    fn detokenize(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.text()?.detokenize(ids, skip_special)
    }

    fn apply_chat_template(
        &self,
        _messages: &[ChatMessage],
        _add_generation_prompt: bool,
        _kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        Err(KylinError::input_invalid(format!("an encoder has no chat template; use {}", self.serves())))
    }

    fn embedding_info(&self) -> Option<EmbeddingInfo> {
        if self.encoder.is_cross_encoder() {
            return None;
        }
        Some(EmbeddingInfo {
            dimension: self.encoder.config().hidden,
            pooling: self.encoder.pooling().name().into(),
            normalized: self.encoder.normalizes(),
            max_tokens: self.encoder.max_tokens(),
            prompts: self.encoder.sentence().map(|s| s.prompts.clone()).unwrap_or_default(),
        })
    }

    fn embed(&mut self, inputs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        if self.encoder.is_cross_encoder() {
            return Err(KylinError::input_invalid(
                "this model is a cross-encoder: it reranks (/v1/rerank), it does not embed",
            ));
        }
        let inputs: Vec<EncoderInput> = inputs.iter().map(|ids| EncoderInput::single(ids.clone())).collect();
        let out = self.encoder.embed(&inputs)?;
        self.stats.steps += 1;
        self.stats.prompt_tokens_total += inputs.iter().map(|i| i.ids.len() as u64).sum::<u64>();
        Ok(out)
    }

    fn can_rerank(&self) -> bool {
        self.encoder.is_cross_encoder() && self.encoder.config().num_labels == Some(1)
    }

    fn rerank(&mut self, query: &str, documents: &[String], instruction: Option<&str>) -> Result<(Vec<f32>, usize)> {
        if instruction.is_some() {
            return Err(KylinError::input_invalid(
                "a cross-encoder takes no instruction (only yes/no rerankers such as Qwen3-Reranker do)",
            )
            .for_field("instruction"));
        }
        if !self.can_rerank() {
            return Err(KylinError::input_invalid(
                "this model does not rerank: a reranker is a cross-encoder with one label (e.g. bge-reranker)",
            ));
        }
        let text = self.text()?;
        let mut inputs = Vec::with_capacity(documents.len());
        for doc in documents {
            let (ids, mut type_ids) = text.tokenize_pair(query, doc)?;
            if self.encoder.config().kind == EncoderKind::Roberta {
                // RoBERTa has one token type; its pair template marks none.
                type_ids.iter_mut().for_each(|t| *t = 0);
            }
            inputs.push(EncoderInput { ids, type_ids });
        }
        let logits = self.encoder.classify(&inputs)?;
        let tokens = inputs.iter().map(|i| i.ids.len()).sum::<usize>();
        self.stats.steps += 1;
        self.stats.prompt_tokens_total += tokens as u64;
        // sentence-transformers' CrossEncoder scores a one-label model with a sigmoid.
        Ok((logits.iter().map(|l| 1.0 / (1.0 + (-l[0]).exp())).collect(), tokens))
    }
}
