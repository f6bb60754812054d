//! Tokenizer files: `tokenizer.json` (or `vocab.json` + `merges.txt`) and `tokenizer_config.json`.

use serde::Serialize;

/// Which files the tokenizer came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenizerKind {
    TokenizerJson,
    VocabMerges,
}

/// A chat template from `tokenizer_config.json` (`chat_template` as a string is named `default`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatTemplate {
    pub name: String,
    pub source: String,
}

/// A special token with its id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SpecialToken {
    pub content: String,
    pub id: u32,
}

/// The model's tokenizer and everything `tokenizer_config.json` says about it.
#[derive(Clone)]
pub struct TokenizerBundle {
    pub tokenizer: tokenizers::Tokenizer,
    pub kind: TokenizerKind,
    /// Number of ids the tokenizer can produce (largest id + 1, added tokens included).
    pub vocab_size: usize,
    pub bos_token: Option<SpecialToken>,
    pub eos_token: Option<SpecialToken>,
    pub pad_token: Option<SpecialToken>,
    pub unk_token: Option<SpecialToken>,
    /// `add_bos_token` from `tokenizer_config.json` (false when absent).
    pub add_bos_token: bool,
    pub add_eos_token: bool,
    /// Every added token flagged `special`.
    pub special_tokens: Vec<SpecialToken>,
    pub chat_templates: Vec<ChatTemplate>,
}

impl std::fmt::Debug for TokenizerBundle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenizerBundle")
            .field("kind", &self.kind)
            .field("vocab_size", &self.vocab_size)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("add_bos_token", &self.add_bos_token)
            .field("chat_templates", &self.chat_templates.len())
            .finish()
    }
}

impl TokenizerBundle {
    /// The template named `default`, else the first one.
    pub fn default_chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_templates.iter().find(|t| t.name == "default").or_else(|| self.chat_templates.first())
    }
}
