//! Constrained decoding: a grammar per sequence that masks the logits at every step.
//!
//! What a request may constrain its output to ([`GrammarSpec`]): a JSON schema, any JSON
//! object, a regular expression, or a context-free grammar in llguidance's Lark syntax (which
//! can embed JSON schemas with `%json { ... }`, and is how tool calls are constrained). The
//! grammar engine is `llguidance`, the library behind OpenAI's structured outputs; Kylin only
//! gives it the tokenizer's vocabulary as bytes ([`GrammarCompiler::new`]) and drives it.
//!
//! Guarantees:
//! * Compilation ([`GrammarCompiler::compile`]) is bounded by llguidance's limits (grammar
//!   size, lexer fuel, lexer states): a grammar that is malformed, too large, or that admits no
//!   output at all is `INPUT_INVALID` naming the problem, before anything is queued; it never
//!   hangs and never panics (llguidance's panics are caught and reported).
//! * A [`GrammarState`] belongs to one sequence and masks only that sequence's logits, so a
//!   constrained sequence's tokens do not depend on its neighbours (invariant 7).
//! * The mask for a sequence's next token can be computed on another thread while the
//!   forward pass runs ([`GrammarState::prepare`]); sampling then only applies it.
//! * Tokens the grammar forces (a single possible continuation) are returned by
//!   [`GrammarState::forced`] and appended without sampling.

use std::sync::Arc;

use kylin_loader::{KylinError, Result};
use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{InferenceCapabilities, SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};

/// What to constrain a sequence's output to.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// A JSON value valid against this JSON schema.
    JsonSchema(Value),
    /// Any JSON object.
    JsonObject,
    /// Text matching this regular expression (Rust `regex` syntax, anchored at both ends).
    Regex(String),
    /// A context-free grammar in llguidance's Lark syntax.
    Lark(String),
}

impl GrammarSpec {
    /// A short name for messages: `JSON schema`, `regular expression`, ...
    pub fn kind(&self) -> &'static str {
        match self {
            GrammarSpec::JsonSchema(_) => "JSON schema",
            GrammarSpec::JsonObject => "JSON object",
            GrammarSpec::Regex(_) => "regular expression",
            GrammarSpec::Lark(_) => "Lark grammar",
        }
    }
}

/// How JSON is laid out under a constraint: one space after `:` and `,`, no other whitespace,
/// as Python's `json.dumps` writes it (what chat templates show models). Flexible whitespace
/// lets a small model emit newlines forever; fixed separators still give valid JSON.
pub fn json_layout() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// The largest integer a constrained number may take when its schema gives no bound: 2^53 - 1,
/// the largest integer every JSON parser reads exactly. Without a bound a model can write
/// digits for ever (`"stars": 10000000...` until the token limit); with it a number has at most
/// 16 digits before its point, and every value still validates against the schema as given.
pub const NUMBER_BOUND: i64 = 9_007_199_254_740_991;

/// Bounds every `integer` and `number` schema that has no bound of its own ([`NUMBER_BOUND`]).
fn bound_numbers(schema: &mut Value, depth: usize) {
    if depth > 64 {
        return;
    }
    match schema {
        Value::Object(map) => {
            let numeric = match map.get("type") {
                Some(Value::String(t)) => t == "integer" || t == "number",
                Some(Value::Array(ts)) => ts.iter().any(|t| t == "integer" || t == "number"),
                _ => false,
            };
            if numeric {
                let no_max = !map.contains_key("maximum") && !map.contains_key("exclusiveMaximum");
                let no_min = !map.contains_key("minimum") && !map.contains_key("exclusiveMinimum");
                if no_max {
                    map.insert("maximum".into(), json!(NUMBER_BOUND));
                }
                if no_min {
                    map.insert("minimum".into(), json!(-NUMBER_BOUND));
                }
            }
            for (key, value) in map.iter_mut() {
                // `enum`, `const` and `default` are values, not schemas.
                if !matches!(key.as_str(), "enum" | "const" | "default" | "examples" | "x-guidance") {
                    bound_numbers(value, depth + 1);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| bound_numbers(v, depth + 1)),
        _ => {}
    }
}

/// A JSON schema with Kylin's layout options attached (unless the schema sets its own
/// `x-guidance`) and its unbounded numbers bounded, ready for llguidance.
pub fn schema_with_layout(schema: &Value) -> Value {
    let mut schema = schema.clone();
    bound_numbers(&mut schema, 0);
    if let Value::Object(map) = &mut schema
        && !map.contains_key("x-guidance")
    {
        map.insert("x-guidance".into(), json_layout());
    }
    schema
}

/// The tokenizer as llguidance sees it: every token's bytes in a trie, and the Hugging Face
/// tokenizer for the strings a grammar forces.
struct TokenizerBytes {
    trie: TokTrie,
    tokenizer: tokenizers::Tokenizer,
}

impl TokenizerEnv for TokenizerBytes {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.tokenizer.encode(text, false).map(|e| e.get_ids().to_vec()).unwrap_or_default()
        })
    }
}

/// The byte-level BPE alphabet (GPT-2's): the character each byte is written as in the
/// vocabulary, inverted.
fn byte_level_map() -> std::collections::HashMap<char, u8> {
    let mut map = std::collections::HashMap::with_capacity(256);
    let mut next = 0x100u32;
    for byte in 0..=255u8 {
        let c = byte as char;
        let printable = matches!(c, '!'..='~' | '\u{A1}'..='\u{AC}' | '\u{AE}'..='\u{FF}');
        if printable {
            map.insert(c, byte);
        } else {
            map.insert(char::from_u32(next).unwrap_or('\u{FFFD}'), byte);
            next += 1;
        }
    }
    map
}

/// The bytes of every token id below `vocab`, in toktrie's convention: a special token is its
/// name after the marker byte 0xFF (so no text can spell it), an id the tokenizer does not know
/// (padding rows of the embedding) is a special token no grammar names.
fn token_bytes(tokenizer: &tokenizers::Tokenizer, vocab: usize) -> Result<Vec<Vec<u8>>> {
    let decoder =
        tokenizer.get_decoder().map(|d| serde_json::to_value(d).unwrap_or(Value::Null)).unwrap_or(Value::Null);
    let decoders: Vec<&Value> = match decoder.get("type").and_then(Value::as_str) {
        Some("Sequence") => {
            decoder.get("decoders").and_then(Value::as_array).map(|a| a.iter().collect()).unwrap_or_default()
        }
        _ => vec![&decoder],
    };
    let kind = |name: &str| decoders.iter().any(|d| d.get("type").and_then(Value::as_str) == Some(name));
    let byte_level = kind("ByteLevel");
    let byte_fallback = kind("ByteFallback");
    // SentencePiece writes spaces as U+2581 and a Replace decoder turns it back.
    let space = decoders
        .iter()
        .find(|d| d.get("type").and_then(Value::as_str) == Some("Replace") && d.get("content") == Some(&json!(" ")))
        .and_then(|d| d.pointer("/pattern/String").and_then(Value::as_str))
        .and_then(|p| {
            let mut chars = p.chars();
            match (chars.next(), chars.next()) {
                (Some(c), None) => Some(c),
                _ => None,
            }
        })
        .unwrap_or('\u{2581}');
    if !byte_level && !byte_fallback {
        return Err(KylinError::input_invalid(
            "constrained decoding needs a byte-level BPE or byte-fallback tokenizer; this tokenizer's decoder is neither",
        ));
    }
    let mut bytes: Vec<Vec<u8>> = vec![Vec::new(); vocab];
    let mut known = vec![false; vocab];
    for (id, token) in tokenizer.get_added_tokens_decoder() {
        let Some(slot) = bytes.get_mut(id as usize) else { continue };
        let mut b = Vec::with_capacity(token.content.len() + 1);
        if token.special {
            b.push(TokTrie::SPECIAL_TOKEN_MARKER);
        }
        b.extend_from_slice(token.content.as_bytes());
        *slot = b;
        known[id as usize] = true;
    }
    let map = byte_level_map();
    for (piece, id) in tokenizer.get_vocab(false) {
        let i = id as usize;
        if i >= vocab || known[i] {
            continue;
        }
        let b = if byte_level {
            piece.chars().map(|c| map.get(&c).copied()).collect::<Option<Vec<u8>>>()
        } else if piece.len() == 6 && piece.starts_with("<0x") && piece.ends_with('>') {
            u8::from_str_radix(&piece[3..5], 16).ok().map(|b| vec![b])
        } else {
            Some(piece.replace(space, " ").into_bytes())
        };
        if let Some(b) = b {
            bytes[i] = b;
            known[i] = true;
        }
    }
    for (i, b) in bytes.iter_mut().enumerate() {
        if !known[i] {
            b.push(TokTrie::SPECIAL_TOKEN_MARKER);
            b.extend_from_slice(format!("<[{i}]>").as_bytes());
        }
    }
    Ok(bytes)
}

/// Compiles grammars for one model's tokenizer. Built once (it indexes the whole vocabulary,
/// a fraction of a second for 150k tokens), shared by every request; `Send` and `Sync`.
pub struct GrammarCompiler {
    factory: ParserFactory,
    env: TokEnv,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler").field("vocab", &self.env.tok_trie().vocab_size()).finish()
    }
}

/// The most bytes a grammar or schema may have (the request body limit usually bounds it first).
pub const MAX_GRAMMAR_BYTES: usize = 1 << 20;

impl GrammarCompiler {
    /// Indexes `tokenizer`'s vocabulary for `vocab` logits (the model's row count, which may
    /// exceed the tokenizer's) with `eos_ids` as the ids that end a sequence.
    pub fn new(tokenizer: &tokenizers::Tokenizer, vocab: usize, eos_ids: &[u32]) -> Result<Self> {
        let words = token_bytes(tokenizer, vocab)?;
        let eos = eos_ids.first().copied().unwrap_or(0);
        let info = TokRxInfo::new(vocab as u32, eos);
        let mut trie = TokTrie::from(&info, &words);
        if eos_ids.len() > 1 {
            trie = trie.with_eos_tokens(eos_ids);
        }
        let env: TokEnv = Arc::new(TokenizerBytes { trie, tokenizer: tokenizer.clone() });
        let mut factory = ParserFactory::new(
            &env,
            InferenceCapabilities { ff_tokens: true, ..InferenceCapabilities::default() },
            &llguidance::earley::SlicedBiasComputer::general_slices(),
        )
        .map_err(|e| KylinError::input_invalid(format!("cannot index the vocabulary for constrained decoding: {e}")))?;
        factory.quiet();
        *factory.limits_mut() = ParserLimits { verbose_errors: false, ..ParserLimits::default() };
        Ok(GrammarCompiler { factory, env })
    }

    /// The id of `text` when it is one special token of this tokenizer (`<|python_tag|>`,
    /// `[TOOL_CALLS]`), which a grammar must name as `<text>` rather than spell.
    pub fn special_token(&self, text: &str) -> Option<u32> {
        self.env.tok_trie().get_special_token(text)
    }

    /// Compiles `spec`: `INPUT_INVALID` with llguidance's reason when it is malformed, too
    /// large, or admits no output at all.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Grammar> {
        let invalid = |why: String| KylinError::input_invalid(format!("the {} cannot be used: {why}", spec.kind()));
        let top = match spec {
            GrammarSpec::JsonSchema(schema) => {
                let size = schema.to_string().len();
                if size > MAX_GRAMMAR_BYTES {
                    return Err(invalid(format!("it has {size} bytes; at most {MAX_GRAMMAR_BYTES}")));
                }
                if !matches!(schema, Value::Object(_) | Value::Bool(true)) {
                    return Err(invalid("a JSON schema must be an object (or `true`)".into()));
                }
                TopLevelGrammar::from_json_schema(schema_with_layout(schema))
            }
            GrammarSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(schema_with_layout(&json!({"type": "object"})))
            }
            GrammarSpec::Regex(rx) => {
                if rx.len() > MAX_GRAMMAR_BYTES {
                    return Err(invalid(format!("it has {} bytes; at most {MAX_GRAMMAR_BYTES}", rx.len())));
                }
                TopLevelGrammar::from_regex(rx)
            }
            GrammarSpec::Lark(lark) => {
                if lark.len() > MAX_GRAMMAR_BYTES {
                    return Err(invalid(format!("it has {} bytes; at most {MAX_GRAMMAR_BYTES}", lark.len())));
                }
                TopLevelGrammar::from_lark(lark.clone())
            }
        };
        let parser = self.factory.create_parser(top).map_err(|e| invalid(first_line(&e.to_string())))?;
        let mut matcher = Matcher::new(Ok(parser));
        // The first mask shows at once whether any output is possible at all.
        match matcher.compute_mask() {
            Ok(mask) if mask.is_zero() => {
                return Err(invalid("it admits no output at all (unsatisfiable)".into()));
            }
            Ok(_) => {}
            Err(e) => return Err(invalid(first_line(&e.to_string()))),
        }
        Ok(Grammar { matcher, vocab: self.env.tok_trie().vocab_size() })
    }
}

/// The first line of an llguidance error (later lines dump parser state).
fn first_line(message: &str) -> String {
    let line = message.lines().next().unwrap_or(message);
    let line = line.strip_prefix("Error: ").unwrap_or(line);
    line.chars().take(400).collect()
}

/// A compiled grammar, in its start state. Cloning it is cheap; each choice of a request gets
/// its own [`GrammarState`] from it.
#[derive(Clone)]
pub struct Grammar {
    matcher: Matcher,
    vocab: usize,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar").field("vocab", &self.vocab).finish()
    }
}

impl Grammar {
    /// A fresh state for one sequence.
    pub fn start(&self) -> GrammarState {
        GrammarState { matcher: self.matcher.clone(), mask: None, forced: Vec::new() }
    }
}

/// One sequence's position in its grammar.
pub struct GrammarState {
    matcher: Matcher,
    /// The mask for the next token, once computed.
    mask: Option<SimpleVob>,
    /// Tokens the grammar forces next, not yet handed out (in reverse order).
    forced: Vec<u32>,
}

impl std::fmt::Debug for GrammarState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarState").field("prepared", &self.mask.is_some()).finish()
    }
}

impl Clone for GrammarState {
    fn clone(&self) -> Self {
        GrammarState { matcher: self.matcher.deep_clone(), mask: self.mask.clone(), forced: self.forced.clone() }
    }
}

impl GrammarState {
    /// True when the mask for the next token still has to be computed.
    pub fn needs_mask(&self) -> bool {
        self.mask.is_none() && self.forced.is_empty() && !self.matcher.is_stopped()
    }

    /// Computes the mask for the next token (the expensive part: tens of microseconds to a
    /// few milliseconds); a second call before the next [`GrammarState::commit`] does nothing.
    pub fn prepare(&mut self) -> Result<()> {
        if self.mask.is_none() {
            let mask = self.matcher.compute_mask_or_eos().map_err(|e| {
                KylinError::input_invalid(format!("the grammar failed: {}", first_line(&e.to_string())))
            })?;
            if mask.is_zero() {
                return Err(KylinError::input_invalid("the grammar allows no token here"));
            }
            self.mask = Some(mask);
        }
        Ok(())
    }

    /// Sets every logit the grammar forbids to `-inf` (computing the mask first if
    /// [`GrammarState::prepare`] did not run).
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<()> {
        self.prepare()?;
        if let Some(mask) = &self.mask {
            let words = mask.as_slice();
            for (w, chunk) in logits.chunks_mut(32).enumerate() {
                let bits = words.get(w).copied().unwrap_or(0);
                if bits == u32::MAX {
                    continue;
                }
                for (b, logit) in chunk.iter_mut().enumerate() {
                    if bits & (1 << b) == 0 {
                        *logit = f32::NEG_INFINITY;
                    }
                }
            }
        }
        Ok(())
    }

    /// Advances past `id` (sampled under the mask, or forced), then collects the tokens the
    /// grammar forces next.
    pub fn commit(&mut self, id: u32) -> Result<()> {
        self.mask = None;
        if self.forced.last() == Some(&id) {
            self.forced.pop();
            return Ok(());
        }
        self.forced.clear();
        self.matcher.consume_token(id).map_err(|e| {
            KylinError::input_invalid(format!("the grammar refused token {id}: {}", first_line(&e.to_string())))
        })?;
        if !self.matcher.is_stopped() {
            let mut forced = self.matcher.consume_ff_tokens();
            forced.reverse();
            self.forced = forced;
        }
        Ok(())
    }

    /// The next token the grammar forces (already consumed by the grammar; pass it to
    /// [`GrammarState::commit`] when it is appended).
    pub fn forced(&self) -> Option<u32> {
        self.forced.last().copied()
    }

    /// True while tokens the grammar forces wait to be handed out.
    pub fn has_forced(&self) -> bool {
        !self.forced.is_empty()
    }

    /// How many of `tokens`, in order from the current state, the grammar accepts, consuming
    /// none (speculative proposals are cut there before they are computed). 0 while forced
    /// tokens wait (they come first) or when the grammar fails.
    pub fn valid_prefix(&mut self, tokens: &[u32]) -> usize {
        if !self.forced.is_empty() {
            return 0;
        }
        self.matcher.validate_tokens(tokens).unwrap_or(0)
    }

    /// True once the grammar is complete and admits nothing more (the sequence is done).
    pub fn is_finished(&self) -> bool {
        self.forced.is_empty() && self.matcher.is_stopped()
    }
}
