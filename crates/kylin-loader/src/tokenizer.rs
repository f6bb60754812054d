//! Tokenizer files: `tokenizer.json` (or `vocab.json` + `merges.txt`) and `tokenizer_config.json`.

use serde::Serialize;

/// Which files the tokenizer came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenizerKind {
    TokenizerJson,
    VocabMerges,
    /// llama2.c's `tokenizer.bin` beside a `.bin` checkpoint ([`crate::llama2c::tokenizer`]).
    Llama2cBin,
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

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{KylinError, Result, regular_file};

/// Reads a special-token entry of `tokenizer_config.json`: a string or `{"content": ...}`.
fn special_content(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

fn read_json_object(path: &Path) -> Result<Map<String, Value>> {
    let text = std::fs::read_to_string(path).map_err(|e| KylinError::io(path, "cannot read", &e))?;
    parse_json_object(&text, path)
}

/// Parses the text of a JSON object file such as `tokenizer_config.json`; anything else is
/// `CONFIG_INVALID`. `path` is only used in messages.
pub fn parse_json_object(text: &str, path: &Path) -> Result<Map<String, Value>> {
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(KylinError::config_invalid(format!("{} must be a JSON object", path.display())).at(path)),
        Err(e) => Err(KylinError::config_invalid(format!("{} is not valid JSON: {e}", path.display())).at(path)),
    }
}

/// Builds a GPT-2 style byte-level BPE tokenizer from `vocab.json` + `merges.txt`.
fn byte_level_bpe(vocab: &Path, merges: &Path) -> Result<tokenizers::Tokenizer> {
    use tokenizers::models::bpe::BPE;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    let (Some(v), Some(m)) = (vocab.to_str(), merges.to_str()) else {
        return Err(KylinError::config_invalid(format!("{} is not a UTF-8 path", vocab.display())));
    };
    let bpe = BPE::from_file(v, m).build().map_err(|e| {
        KylinError::config_invalid(format!("vocab.json/merges.txt in {} cannot be read: {e}", vocab.display()))
            .at(vocab)
    })?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    tok.with_decoder(Some(ByteLevel::default()));
    tok.with_post_processor(Some(ByteLevel::default().trim_offsets(false)));
    Ok(tok)
}

/// Reads `tokenizer.json`.
///
/// `tokenizers::Tokenizer::from_file` deserializes the model three times over (an untagged enum
/// buffers it, a flattened `serde_json::Value` copies its 150k-entry vocabulary into a map, then
/// the model is built from that); for Qwen's 11 MB file that is about half a second, nearly all
/// of a model's load time. For BPE models (every supported architecture) this reads the file
/// once: the top-level object as raw JSON slices, the BPE model straight into
/// `tokenizers::models::bpe::BPE`, the small components (normalizer, pre-tokenizer,
/// post-processor, decoder, truncation, padding) each with the library's own deserializer, and
/// the added tokens added in order exactly as the library's deserializer adds them. The result is
/// checked: every added token must get the id the file gives it; if anything differs or is not
/// understood, the library's own path is used instead, so the fast path can change speed only.
pub fn read_tokenizer_json(path: &Path) -> Result<tokenizers::Tokenizer> {
    let text = std::fs::read_to_string(path).map_err(|e| KylinError::io(path, "cannot read", &e))?;
    if let Some(tokenizer) = fast_bpe_tokenizer(&text) {
        return Ok(tokenizer);
    }
    text.parse::<tokenizers::Tokenizer>().map_err(|e| {
        KylinError::config_invalid(format!("{} cannot be parsed by the tokenizers library: {e}", path.display()))
            .at(path)
    })
}

/// The fast path of [`read_tokenizer_json`]; `None` whenever it is not sure to give the same
/// tokenizer as the library.
fn fast_bpe_tokenizer(text: &str) -> Option<tokenizers::Tokenizer> {
    use serde_json::value::RawValue;
    use tokenizers::{DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper};

    #[derive(serde::Deserialize)]
    struct ModelKind<'a> {
        #[serde(rename = "type", borrow)]
        kind: Option<&'a str>,
    }
    #[derive(serde::Deserialize)]
    struct Added {
        id: u32,
        content: String,
        #[serde(default)]
        single_word: bool,
        #[serde(default)]
        lstrip: bool,
        #[serde(default)]
        rstrip: bool,
        #[serde(default = "yes")]
        normalized: bool,
        #[serde(default)]
        special: bool,
    }
    fn yes() -> bool {
        true
    }
    fn part<T: serde::de::DeserializeOwned>(raw: Option<&&RawValue>) -> Option<Option<T>> {
        match raw {
            None => Some(None),
            Some(r) => serde_json::from_str::<Option<T>>(r.get()).ok(),
        }
    }

    let parts: std::collections::HashMap<&str, &RawValue> = serde_json::from_str(text).ok()?;
    if parts.keys().any(|k| {
        !matches!(
            *k,
            "version"
                | "truncation"
                | "padding"
                | "added_tokens"
                | "normalizer"
                | "pre_tokenizer"
                | "model"
                | "decoder"
                | "post_processor"
        )
    }) {
        return None;
    }
    if let Some(v) = parts.get("version")
        && serde_json::from_str::<&str>(v.get()).ok()? != "1.0"
    {
        return None;
    }
    let model = parts.get("model")?;
    if serde_json::from_str::<ModelKind<'_>>(model.get()).ok()?.kind != Some("BPE") {
        return None;
    }
    let bpe: tokenizers::models::bpe::BPE = serde_json::from_str(model.get()).ok()?;
    let mut tokenizer = tokenizers::Tokenizer::new(bpe);
    tokenizer.with_normalizer(part::<NormalizerWrapper>(parts.get("normalizer"))?).ok()?;
    tokenizer.with_pre_tokenizer(part::<PreTokenizerWrapper>(parts.get("pre_tokenizer"))?);
    tokenizer.with_post_processor(part::<PostProcessorWrapper>(parts.get("post_processor"))?);
    tokenizer.with_decoder(part::<DecoderWrapper>(parts.get("decoder"))?);
    tokenizer.with_truncation(part::<tokenizers::TruncationParams>(parts.get("truncation"))?).ok()?;
    tokenizer.with_padding(part::<tokenizers::PaddingParams>(parts.get("padding"))?);
    let added: Vec<Added> = part(parts.get("added_tokens"))?.unwrap_or_default();
    let tokens = added.iter().map(|t| {
        tokenizers::AddedToken::from(t.content.clone(), t.special)
            .single_word(t.single_word)
            .lstrip(t.lstrip)
            .rstrip(t.rstrip)
            .normalized(t.normalized)
    });
    tokenizer.add_tokens(tokens.collect::<Vec<_>>()).ok()?;
    if added.iter().any(|t| tokenizer.token_to_id(&t.content) != Some(t.id)) {
        return None;
    }
    Some(tokenizer)
}

/// Finds and reads the tokenizer files in `dir`. `Ok(None)` when there is no tokenizer at all.
pub fn load_tokenizer(dir: &Path, warnings: &mut Vec<String>) -> Result<Option<TokenizerBundle>> {
    let tj = dir.join("tokenizer.json");
    let config_path = dir.join("tokenizer_config.json");
    let config = if regular_file(&config_path)? { Some(read_json_object(&config_path)?) } else { None };
    let (tokenizer, kind) = if regular_file(&tj)? {
        (read_tokenizer_json(&tj)?, TokenizerKind::TokenizerJson)
    } else if regular_file(&dir.join("vocab.json"))? && regular_file(&dir.join("merges.txt"))? {
        (byte_level_bpe(&dir.join("vocab.json"), &dir.join("merges.txt"))?, TokenizerKind::VocabMerges)
    } else {
        return Ok(None);
    };
    let mut bundle = bundle_from_config(tokenizer, kind, config.as_ref(), &config_path, warnings)?;
    // The newer layout keeps the default template in its own file, which takes precedence.
    let jinja = dir.join("chat_template.jinja");
    if regular_file(&jinja)? {
        let source = std::fs::read_to_string(&jinja).map_err(|e| KylinError::io(&jinja, "cannot read", &e))?;
        bundle.chat_templates.retain(|t| t.name != "default");
        bundle.chat_templates.insert(0, ChatTemplate { name: "default".into(), source });
    }
    Ok(Some(bundle))
}

/// Completes a [`TokenizerBundle`] from a loaded tokenizer and the parsed
/// `tokenizer_config.json` (`None` when the file is absent): added tokens (for the
/// `vocab.json` + `merges.txt` layout), special tokens, `add_bos_token` / `add_eos_token` and
/// the chat templates. `config_path` is only used in messages; warnings are appended. This is
/// the part of [`load_tokenizer`] that reads the config's untrusted values, kept separate so that
/// it can be fuzzed without files.
pub fn bundle_from_config(
    mut tokenizer: tokenizers::Tokenizer,
    kind: TokenizerKind,
    config: Option<&Map<String, Value>>,
    config_path: &Path,
    warnings: &mut Vec<String>,
) -> Result<TokenizerBundle> {
    if kind == TokenizerKind::VocabMerges
        && let Some(Value::Object(decoder)) = config.and_then(|c| c.get("added_tokens_decoder"))
    {
        // The added tokens live in tokenizer_config.json in this layout; add them in id order.
        let mut added: Vec<(u32, String, bool)> = decoder
            .iter()
            .filter_map(|(id, v)| {
                let id = id.parse::<u32>().ok()?;
                Some((id, special_content(v)?, v.get("special").and_then(Value::as_bool).unwrap_or(false)))
            })
            .collect();
        added.sort();
        for (_, content, special) in added {
            let token = tokenizers::AddedToken::from(content.clone(), special);
            let added = if special { tokenizer.add_special_tokens([token]) } else { tokenizer.add_tokens([token]) };
            added.map_err(|e| {
                KylinError::config_invalid(format!(
                    "tokenizer_config.json added token {content:?} cannot be added to the vocabulary: {e}"
                ))
                .at(config_path)
            })?;
        }
    }

    let vocab_size = tokenizer.get_vocab(true).values().copied().max().map_or(0, |m| m as usize + 1);
    let mut special_tokens: Vec<SpecialToken> = tokenizer
        .get_added_tokens_decoder()
        .into_iter()
        .filter(|(_, t)| t.special)
        .map(|(id, t)| SpecialToken { content: t.content, id })
        .collect();
    special_tokens.sort_by_key(|t| t.id);

    let empty = Map::new();
    let cfg = config.unwrap_or(&empty);
    let mut lookup = |key: &str| -> Option<SpecialToken> {
        let content = cfg.get(key).and_then(special_content)?;
        match tokenizer.token_to_id(&content) {
            Some(id) => Some(SpecialToken { content, id }),
            None => {
                warnings.push(format!("tokenizer_config.json {key} '{content}' is not in the vocabulary; ignored"));
                None
            }
        }
    };
    let bos_token = lookup("bos_token");
    let eos_token = lookup("eos_token");
    let pad_token = lookup("pad_token");
    let unk_token = lookup("unk_token");
    let flag = |key: &str| -> Result<bool> {
        match cfg.get(key) {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(KylinError::config_invalid(format!(
                "tokenizer_config.json field '{key}' must be true or false, got {v}"
            ))
            .at(config_path)),
        }
    };
    let add_bos_token = flag("add_bos_token")?;
    let add_eos_token = flag("add_eos_token")?;

    let mut chat_templates = Vec::new();
    match cfg.get("chat_template") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => chat_templates.push(ChatTemplate { name: "default".into(), source: s.clone() }),
        Some(Value::Array(items)) => {
            for item in items {
                let name = item.get("name").and_then(Value::as_str);
                let source = item.get("template").and_then(Value::as_str);
                match (name, source) {
                    (Some(n), Some(s)) => chat_templates.push(ChatTemplate { name: n.into(), source: s.into() }),
                    _ => {
                        return Err(KylinError::config_invalid(
                            "tokenizer_config.json chat_template list entries must be {\"name\", \"template\"}",
                        )
                        .at(config_path));
                    }
                }
            }
        }
        Some(_) => {
            return Err(KylinError::config_invalid(
                "tokenizer_config.json field 'chat_template' must be a string or a list of {name, template}",
            )
            .at(config_path));
        }
    }
    Ok(TokenizerBundle {
        tokenizer,
        kind,
        vocab_size,
        bos_token,
        eos_token,
        pad_token,
        unk_token,
        add_bos_token,
        add_eos_token,
        special_tokens,
        chat_templates,
    })
}
