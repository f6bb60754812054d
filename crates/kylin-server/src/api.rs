//! OpenAI request bodies, read field by field so that every error names its field.
//!
//! A body is a JSON object. Each field this server implements is taken out and checked (type
//! and range, with the field's name as `param` on failure). What is left is then judged:
//!
//! * fields that do not change the answer (`user`, `metadata`, `store`, `service_tier`, ...)
//!   are accepted and ignored;
//! * fields that would change the answer and that we do not implement (`tools`,
//!   `response_format` with a schema, `logit_bias`, `echo`, ...) are refused with 400 naming
//!   them, unless their value is the one that changes nothing (`response_format: {"type":
//!   "text"}`, `logit_bias: {}`, `echo: false`, `tools: []`);
//! * unknown fields are refused with 400 naming them, as OpenAI's own API does: a field we do
//!   not know might change the answer, and silently ignoring it would hide that.
//!
//! `null` is the same as an absent field everywhere.

use kylin_engine::ChatMessage;
use kylin_engine::sampler::SamplingParams;
use kylin_loader::GenerationDefaults;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::error::ApiError;

/// The largest `n` one request may ask for.
pub const MAX_N: usize = 128;
/// The most stop strings one request may give.
pub const MAX_STOP: usize = 16;
/// The largest `top_logprobs` (and completions' `logprobs`).
pub const MAX_LOGPROBS: usize = kylin_engine::serving::MAX_TOP_LOGPROBS;

/// Fields accepted everywhere and ignored: they do not change the answer.
const HARMLESS: &[&str] =
    &["user", "metadata", "store", "service_tier", "parallel_tool_calls", "prediction", "request_id", "priority"];

/// A JSON object being taken apart.
pub struct Fields {
    map: Map<String, Value>,
}

impl Fields {
    /// Parses a body that must be a JSON object.
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let value: Value = serde_json::from_slice(body)
            .map_err(|e| ApiError::invalid_body(format!("the body is not valid JSON: {e}")))?;
        match value {
            Value::Object(map) => Ok(Fields { map }),
            _ => Err(ApiError::invalid_body("the body must be a JSON object")),
        }
    }

    /// Takes field `key` (`None` when absent or null); 400 naming it when its type is wrong.
    pub fn take<T: DeserializeOwned>(&mut self, key: &str, expected: &str) -> Result<Option<T>, ApiError> {
        match self.map.remove(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => serde_json::from_value(v)
                .map(Some)
                .map_err(|_| ApiError::invalid(key, format!("`{key}` must be {expected}"))),
        }
    }

    /// Takes a field whose only accepted value is the one that changes nothing.
    pub fn refuse_unless(&mut self, key: &str, harmless: impl Fn(&Value) -> bool, what: &str) -> Result<(), ApiError> {
        match self.map.remove(key) {
            None | Some(Value::Null) => Ok(()),
            Some(v) if harmless(&v) => Ok(()),
            Some(_) => Err(ApiError::invalid(key, format!("`{key}` is not supported by this server ({what})"))
                .code("unsupported_parameter")),
        }
    }

    /// Accepts the harmless fields and refuses whatever else is left.
    pub fn finish(mut self) -> Result<(), ApiError> {
        for key in HARMLESS {
            self.map.remove(*key);
        }
        match self.map.keys().next() {
            None => Ok(()),
            Some(key) => Err(ApiError::invalid(key.as_str(), format!("unrecognized request field `{key}`"))
                .code("unsupported_parameter")),
        }
    }
}

fn is_empty_list(v: &Value) -> bool {
    v.as_array().is_some_and(Vec::is_empty)
}

fn is_empty_object(v: &Value) -> bool {
    v.as_object().is_some_and(Map::is_empty)
}

/// The fields chat and completions share: the model, sampling, limits, stop strings, `n`,
/// streaming.
#[derive(Debug, Clone, Default)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Vec<String>,
    pub n: usize,
    pub stream: bool,
    pub include_usage: bool,
    pub ignore_eos: bool,
}

/// `stop`: a string or a list of strings.
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Common {
    fn take(f: &mut Fields) -> Result<Self, ApiError> {
        let mut c = Common {
            model: f.take("model", "a string")?,
            max_tokens: f.take("max_tokens", "a positive integer")?,
            temperature: f.take("temperature", "a number")?,
            top_p: f.take("top_p", "a number")?,
            top_k: f.take("top_k", "an integer")?,
            min_p: f.take("min_p", "a number")?,
            repetition_penalty: f.take("repetition_penalty", "a number")?,
            presence_penalty: f.take("presence_penalty", "a number")?,
            frequency_penalty: f.take("frequency_penalty", "a number")?,
            seed: f.take("seed", "an integer")?,
            n: f.take("n", "a positive integer")?.unwrap_or(1),
            stream: f.take("stream", "a boolean")?.unwrap_or(false),
            ignore_eos: f.take("ignore_eos", "a boolean")?.unwrap_or(false),
            ..Common::default()
        };
        c.stop = match f.take::<Stop>("stop", "a string or a list of strings")? {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s],
            Some(Stop::Many(v)) => v,
        };
        if c.stop.len() > MAX_STOP {
            return Err(ApiError::invalid("stop", format!("`stop` has {} strings; at most {MAX_STOP}", c.stop.len())));
        }
        if c.stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid("stop", "`stop` strings must not be empty"));
        }
        if let Some(options) = f.take::<Map<String, Value>>("stream_options", "an object")? {
            for (key, value) in options {
                match (key.as_str(), value) {
                    ("include_usage", Value::Bool(b)) => c.include_usage = b,
                    ("include_usage", Value::Null) => {}
                    ("include_usage", _) => {
                        return Err(ApiError::invalid("stream_options.include_usage", "must be a boolean"));
                    }
                    // Only changes how usage is reported per chunk; we report it once.
                    ("continuous_usage_stats", _) => {}
                    (other, _) => {
                        return Err(ApiError::invalid(
                            format!("stream_options.{other}"),
                            format!("unrecognized stream option `{other}`"),
                        ));
                    }
                }
            }
            if !c.stream {
                return Err(ApiError::invalid(
                    "stream_options",
                    "`stream_options` is only allowed with `stream: true`",
                ));
            }
        }
        if c.n == 0 || c.n > MAX_N {
            return Err(ApiError::invalid("n", format!("`n` must be between 1 and {MAX_N}; got {}", c.n)));
        }
        if c.max_tokens == Some(0) {
            return Err(ApiError::invalid("max_tokens", "`max_tokens` must be at least 1"));
        }
        // Fields that would change the answer, refused unless they hold their neutral value.
        f.refuse_unless("logit_bias", is_empty_object, "logit biases are not implemented")?;
        f.refuse_unless("best_of", |v| v.as_u64().is_some_and(|b| b as usize <= c.n), "best-of sampling")?;
        f.refuse_unless("min_tokens", |v| v.as_u64() == Some(0), "a minimum length is not implemented")?;
        f.refuse_unless("skip_special_tokens", |v| v.as_bool() == Some(true), "special tokens are always skipped")?;
        f.refuse_unless(
            "include_stop_str_in_output",
            |v| v.as_bool() == Some(false),
            "the stop string is never included",
        )?;
        f.refuse_unless("use_beam_search", |v| v.as_bool() == Some(false), "beam search is not implemented")?;
        for key in ["guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"] {
            f.refuse_unless(key, |_| false, "constrained decoding is not implemented")?;
        }
        f.refuse_unless("truncate_prompt_tokens", |_| false, "prompts are never truncated")?;
        Ok(c)
    }

    /// The sampler's parameters: the model's `generation_config.json` defaults (Hugging Face
    /// semantics, as `kylin run`), each overridden by the request's field.
    pub fn sampling(&self, defaults: &GenerationDefaults, random_seed: u64) -> Result<SamplingParams, ApiError> {
        let mut p = SamplingParams::from_defaults(defaults);
        let check = |name: &str, v: f32, ok: bool, want: &str| {
            if ok && v.is_finite() {
                Ok(v)
            } else {
                Err(ApiError::invalid(name, format!("`{name}` must be {want}; got {v}")))
            }
        };
        if let Some(t) = self.temperature {
            p.temperature = check("temperature", t, t >= 0.0, "a number >= 0")?;
        }
        if let Some(v) = self.top_p {
            p.top_p = check("top_p", v, v > 0.0 && v <= 1.0, "in (0, 1]")?;
        }
        if let Some(k) = self.top_k {
            p.top_k = match k {
                -1 | 0 => 0,
                k if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
                _ => {
                    return Err(ApiError::invalid(
                        "top_k",
                        format!("`top_k` must be -1, 0 (off) or positive; got {k}"),
                    ));
                }
            };
        }
        if let Some(v) = self.min_p {
            p.min_p = check("min_p", v, (0.0..=1.0).contains(&v), "in [0, 1]")?;
        }
        if let Some(v) = self.repetition_penalty {
            p.repetition_penalty = check("repetition_penalty", v, v > 0.0, "a number > 0")?;
        }
        if let Some(v) = self.presence_penalty {
            p.presence_penalty = check("presence_penalty", v, (-2.0..=2.0).contains(&v), "in [-2, 2]")?;
        }
        if let Some(v) = self.frequency_penalty {
            p.frequency_penalty = check("frequency_penalty", v, (-2.0..=2.0).contains(&v), "in [-2, 2]")?;
        }
        // A seed is any integer (negative ones wrap); without one, each request gets its own.
        p.seed = self.seed.map_or(random_seed, |s| s as u64);
        Ok(p)
    }
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone)]
pub struct ChatRequest {
    pub common: Common,
    pub messages: Vec<ChatMessage>,
    /// `Some(k)` when `logprobs` is true: `k` is `top_logprobs` (0 by default).
    pub logprobs: Option<usize>,
    pub chat_template_kwargs: Map<String, Value>,
    pub add_generation_prompt: bool,
}

impl ChatRequest {
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let mut f = Fields::parse(body)?;
        let mut common = Common::take(&mut f)?;
        if let Some(m) = f.take::<usize>("max_completion_tokens", "a positive integer")? {
            if m == 0 {
                return Err(ApiError::invalid("max_completion_tokens", "`max_completion_tokens` must be at least 1"));
            }
            common.max_tokens = Some(m);
        }
        let raw: Vec<Value> = f
            .take("messages", "a list of messages")?
            .ok_or_else(|| ApiError::invalid("messages", "`messages` is required"))?;
        if raw.is_empty() {
            return Err(ApiError::invalid("messages", "`messages` must not be empty"));
        }
        let messages = raw.into_iter().enumerate().map(|(i, m)| message(i, m)).collect::<Result<Vec<_>, _>>()?;
        let logprobs = f.take::<bool>("logprobs", "a boolean")?.unwrap_or(false);
        let top = f.take::<usize>("top_logprobs", "an integer between 0 and 20")?;
        if let Some(k) = top {
            if k > MAX_LOGPROBS {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    format!("`top_logprobs` must be at most {MAX_LOGPROBS}"),
                ));
            }
            if !logprobs {
                return Err(ApiError::invalid("top_logprobs", "`top_logprobs` needs `logprobs: true`"));
            }
        }
        let chat_template_kwargs = f.take("chat_template_kwargs", "an object")?.unwrap_or_default();
        let add_generation_prompt = f.take("add_generation_prompt", "a boolean")?.unwrap_or(true);
        f.refuse_unless("tools", is_empty_list, "tool calling is not implemented")?;
        f.refuse_unless("tool_choice", |v| v == "none" || v == "auto", "tool calling is not implemented")?;
        f.refuse_unless("functions", is_empty_list, "function calling is not implemented")?;
        f.refuse_unless("function_call", |v| v == "none" || v == "auto", "function calling is not implemented")?;
        f.refuse_unless(
            "response_format",
            |v| v.get("type").is_some_and(|t| t == "text"),
            "only {\"type\": \"text\"}",
        )?;
        f.refuse_unless("modalities", |v| v.as_array().is_some_and(|a| a.iter().all(|m| m == "text")), "text only")?;
        f.refuse_unless("audio", |_| false, "audio output is not implemented")?;
        f.refuse_unless("reasoning_effort", |_| false, "use chat_template_kwargs (e.g. enable_thinking)")?;
        f.refuse_unless("web_search_options", |_| false, "web search is not implemented")?;
        f.refuse_unless("chat_template", |_| false, "start the server with --chat-template instead")?;
        f.refuse_unless("continue_final_message", |v| v.as_bool() == Some(false), "not implemented")?;
        f.finish()?;
        Ok(ChatRequest {
            common,
            messages,
            logprobs: logprobs.then_some(top.unwrap_or(0)),
            chat_template_kwargs,
            add_generation_prompt,
        })
    }
}

/// One message: a role and text content (a string or a list of text parts).
fn message(i: usize, value: Value) -> Result<ChatMessage, ApiError> {
    let at = |field: &str| format!("messages[{i}].{field}");
    let Value::Object(mut m) = value else {
        return Err(ApiError::invalid(format!("messages[{i}]"), "each message must be an object"));
    };
    let role = match m.remove("role") {
        Some(Value::String(r)) => r,
        _ => return Err(ApiError::invalid(at("role"), "each message needs a string `role`")),
    };
    let role = match role.as_str() {
        "system" | "user" | "assistant" => role,
        // OpenAI's newer name for system instructions; chat templates know `system`.
        "developer" => "system".to_string(),
        "tool" | "function" => {
            return Err(ApiError::invalid(
                at("role"),
                format!("role `{role}` needs tool calling, which is not implemented"),
            )
            .code("unsupported_parameter"));
        }
        _ => return Err(ApiError::invalid(at("role"), format!("unknown role `{role}`"))),
    };
    let content = match m.remove("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s,
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str);
                match (kind, part.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (Some("text"), None) => {
                        return Err(ApiError::invalid(
                            format!("messages[{i}].content[{j}].text"),
                            "a text part needs `text`",
                        ));
                    }
                    _ => {
                        return Err(ApiError::invalid(
                            format!("messages[{i}].content[{j}].type"),
                            "only text content parts are supported",
                        )
                        .code("unsupported_parameter"));
                    }
                }
            }
            text
        }
        Some(_) => return Err(ApiError::invalid(at("content"), "`content` must be a string or a list of text parts")),
    };
    for (key, value) in m {
        match key.as_str() {
            "name" | "refusal" => {}
            "tool_calls" | "function_call" | "audio" if !value.is_null() && !is_empty_list(&value) => {
                return Err(ApiError::invalid(
                    at(&key),
                    format!("`{key}` needs tool calling, which is not implemented"),
                )
                .code("unsupported_parameter"));
            }
            "tool_calls" | "function_call" | "audio" => {}
            _ => return Err(ApiError::invalid(at(&key), format!("unrecognized message field `{key}`"))),
        }
    }
    Ok(ChatMessage { role, content })
}

/// A completions prompt: text or token ids, one or several.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    Text(String),
    Ids(Vec<u32>),
}

#[derive(serde::Deserialize)]
#[serde(untagged)]
enum RawPrompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

/// `POST /v1/completions`.
#[derive(Debug, Clone)]
pub struct CompletionRequest {
    pub common: Common,
    pub prompts: Vec<PromptInput>,
    /// `logprobs`: how many alternatives per token (0 means only the chosen token's).
    pub logprobs: Option<usize>,
}

impl CompletionRequest {
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let mut f = Fields::parse(body)?;
        let common = Common::take(&mut f)?;
        let prompts = match f.take::<RawPrompt>("prompt", "a string, a list of strings, or token ids")? {
            None => return Err(ApiError::invalid("prompt", "`prompt` is required")),
            Some(RawPrompt::Text(t)) => vec![PromptInput::Text(t)],
            Some(RawPrompt::Texts(v)) => v.into_iter().map(PromptInput::Text).collect(),
            Some(RawPrompt::Ids(ids)) => vec![PromptInput::Ids(ids)],
            Some(RawPrompt::IdLists(v)) => v.into_iter().map(PromptInput::Ids).collect(),
        };
        if prompts.is_empty() {
            return Err(ApiError::invalid("prompt", "`prompt` must not be an empty list"));
        }
        if prompts.len() * common.n > MAX_N {
            return Err(ApiError::invalid("prompt", format!("prompts times `n` must be at most {MAX_N}")));
        }
        let logprobs = f.take::<usize>("logprobs", "an integer between 0 and 20")?;
        if logprobs.is_some_and(|k| k > MAX_LOGPROBS) {
            return Err(ApiError::invalid("logprobs", format!("`logprobs` must be at most {MAX_LOGPROBS}")));
        }
        f.refuse_unless("echo", |v| v.as_bool() == Some(false), "echoing the prompt is not implemented")?;
        f.refuse_unless("suffix", |v| v.as_str() == Some(""), "insertion (suffix) is not implemented")?;
        f.refuse_unless(
            "response_format",
            |v| v.get("type").is_some_and(|t| t == "text"),
            "only {\"type\": \"text\"}",
        )?;
        f.finish()?;
        Ok(CompletionRequest { common, prompts, logprobs })
    }
}

/// `POST /tokenize`: text, token-less chat messages, or a completions-style prompt.
#[derive(Debug, Clone)]
pub enum TokenizeRequest {
    Text { model: Option<String>, text: String, add_special_tokens: bool },
    Chat { model: Option<String>, messages: Vec<ChatMessage>, kwargs: Map<String, Value>, add_generation_prompt: bool },
}

impl TokenizeRequest {
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let mut f = Fields::parse(body)?;
        let model = f.take("model", "a string")?;
        let prompt: Option<String> = f.take("prompt", "a string")?;
        let messages: Option<Vec<Value>> = f.take("messages", "a list of messages")?;
        let add_special_tokens = f.take("add_special_tokens", "a boolean")?;
        let add_generation_prompt = f.take("add_generation_prompt", "a boolean")?.unwrap_or(true);
        let kwargs = f.take("chat_template_kwargs", "an object")?.unwrap_or_default();
        f.finish()?;
        match (prompt, messages) {
            (Some(text), None) => {
                Ok(TokenizeRequest::Text { model, text, add_special_tokens: add_special_tokens.unwrap_or(true) })
            }
            (None, Some(raw)) => {
                let messages =
                    raw.into_iter().enumerate().map(|(i, m)| message(i, m)).collect::<Result<Vec<_>, _>>()?;
                Ok(TokenizeRequest::Chat { model, messages, kwargs, add_generation_prompt })
            }
            _ => Err(ApiError::invalid("prompt", "give exactly one of `prompt` and `messages`")),
        }
    }
}

/// `POST /detokenize`.
#[derive(Debug, Clone)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

impl DetokenizeRequest {
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let mut f = Fields::parse(body)?;
        let model = f.take("model", "a string")?;
        let tokens = f
            .take("tokens", "a list of token ids")?
            .ok_or_else(|| ApiError::invalid("tokens", "`tokens` is required"))?;
        f.finish()?;
        Ok(DetokenizeRequest { model, tokens })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrong_types_name_their_field() {
        let e =
            ChatRequest::parse(br#"{"messages":[{"role":"user","content":"hi"}],"temperature":"hot"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"));
        let e = ChatRequest::parse(br#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content[0].type"));
    }

    #[test]
    fn answer_changing_fields_are_refused_and_neutral_values_accepted() {
        let base = r#""messages":[{"role":"user","content":"hi"}]"#;
        let e = ChatRequest::parse(format!(r#"{{{base},"tools":[{{"type":"function"}}]}}"#).as_bytes()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools"));
        let e = ChatRequest::parse(format!(r#"{{{base},"frobnicate":1}}"#).as_bytes()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("frobnicate"));
        let ok = ChatRequest::parse(
            format!(r#"{{{base},"tools":[],"response_format":{{"type":"text"}},"user":"u","logit_bias":{{}}}}"#)
                .as_bytes(),
        );
        assert!(ok.is_ok());
    }

    #[test]
    fn prompts_in_every_form() {
        let p = |s: &str| CompletionRequest::parse(s.as_bytes()).map(|r| r.prompts);
        assert_eq!(p(r#"{"prompt":"a"}"#).unwrap(), vec![PromptInput::Text("a".into())]);
        assert_eq!(p(r#"{"prompt":["a","b"]}"#).unwrap().len(), 2);
        assert_eq!(p(r#"{"prompt":[1,2]}"#).unwrap(), vec![PromptInput::Ids(vec![1, 2])]);
        assert_eq!(p(r#"{"prompt":[[1],[2]]}"#).unwrap().len(), 2);
        assert_eq!(p(r#"{"prompt":{"x":1}}"#).unwrap_err().param.as_deref(), Some("prompt"));
    }
}
