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

use kylin_engine::grammar::GrammarSpec;
use kylin_engine::sampler::SamplingParams;
use kylin_engine::tools::{ToolChoice, ToolSpec};
use kylin_engine::vision::ImageOptions;
use kylin_loader::GenerationDefaults;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};

use crate::error::ApiError;

/// The largest `n` one request may ask for.
pub const MAX_N: usize = 128;
/// The most stop strings one request may give.
pub const MAX_STOP: usize = 16;
/// The largest `top_logprobs` (and completions' `logprobs`).
pub const MAX_LOGPROBS: usize = kylin_engine::serving::MAX_TOP_LOGPROBS;

/// Fields accepted everywhere and ignored: they do not change the answer.
const HARMLESS: &[&str] = &["user", "metadata", "store", "service_tier", "prediction", "request_id", "priority"];

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
    pub logit_bias: Vec<(u32, f32)>,
    /// A vLLM-style `guided_*` constraint and the field it came from.
    pub guided: Option<(GrammarSpec, &'static str)>,
    pub skip_special_tokens: bool,
    /// At most this many speculative proposals per step for this request (0: none); the
    /// engine refuses more than the server's `--speculative-tokens`.
    pub speculative_tokens: Option<usize>,
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
        Common::take_with(f, false)
    }

    /// The common fields; `max_tokens: 0` is accepted when `zero_max_tokens` (completions that
    /// echo the prompt, scoring it without generating).
    fn take_with(f: &mut Fields, zero_max_tokens: bool) -> Result<Self, ApiError> {
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
            speculative_tokens: f.take("speculative_tokens", "a non-negative integer")?,
            skip_special_tokens: true,
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
        if c.max_tokens == Some(0) && !zero_max_tokens {
            return Err(ApiError::invalid(
                "max_tokens",
                "`max_tokens` must be at least 1 (0 only on completions with `echo: true`, to score the prompt)",
            ));
        }
        c.logit_bias = logit_bias(f)?;
        c.guided = guided(f)?;
        if let Some(b) = f.take::<bool>("skip_special_tokens", "a boolean")? {
            c.skip_special_tokens = b;
        }
        // Fields that would change the answer, refused unless they hold their neutral value.
        f.refuse_unless("best_of", |v| v.as_u64().is_some_and(|b| b as usize <= c.n), "best-of sampling")?;
        f.refuse_unless("min_tokens", |v| v.as_u64() == Some(0), "a minimum length is not implemented")?;
        f.refuse_unless(
            "include_stop_str_in_output",
            |v| v.as_bool() == Some(false),
            "the stop string is never included",
        )?;
        f.refuse_unless("use_beam_search", |v| v.as_bool() == Some(false), "beam search is not implemented")?;
        f.refuse_unless("structured_outputs", |_| false, "use response_format or guided_json/regex/grammar/choice")?;
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
    /// Normalized messages ([`message`]).
    pub messages: Vec<Value>,
    pub tools: Vec<ToolSpec>,
    pub tool_choice: ToolChoice,
    pub parallel_tool_calls: bool,
    pub response_format: Option<GrammarSpec>,
    /// `Some(k)` when `logprobs` is true: `k` is `top_logprobs` (0 by default).
    pub logprobs: Option<usize>,
    pub chat_template_kwargs: Map<String, Value>,
    pub add_generation_prompt: bool,
    /// The messages' images, in order (each an `{"type": "image"}` part of its message's
    /// content, where the chat template places it).
    pub images: Vec<ImagePart>,
    /// The request's settings of the image processor (`mm_processor_kwargs`).
    pub image_options: ImageOptions,
}

/// `mm_processor_kwargs` ([`ImageOptions::from_json`]), a 400 naming the key for a bad one.
pub fn image_options(value: Option<Map<String, Value>>) -> Result<ImageOptions, ApiError> {
    ImageOptions::from_json(&value.unwrap_or_default()).map_err(|e| {
        let error = ApiError::invalid(e.at, e.message);
        if e.unknown_key { error.code("unsupported_parameter") } else { error }
    })
}

/// An image of a request and the field it came from (`messages[0].content[1].image_url.url`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImagePart {
    pub at: String,
    pub source: ImageRef,
}

/// An image a request sends: the bytes of a `data:` URL, or a local file (read only inside
/// the directory `kylin serve --allowed-local-media-path` names). Nothing is fetched from the
/// network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageRef {
    Bytes(Vec<u8>),
    Path(std::path::PathBuf),
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
        let mut images = Vec::new();
        let messages =
            raw.into_iter().enumerate().map(|(i, m)| message(i, m, &mut images)).collect::<Result<Vec<_>, _>>()?;
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
        let image_options = image_options(f.take("mm_processor_kwargs", "an object")?)?;
        let tools = tools(f.take("tools", "a list of tools")?, "tools")?;
        let tool_choice = tool_choice(f.take("tool_choice", "a string or an object")?, &tools)?;
        let parallel_tool_calls = f.take::<bool>("parallel_tool_calls", "a boolean")?.unwrap_or(true);
        f.refuse_unless("functions", is_empty_list, "OpenAI's deprecated form; send `tools`")?;
        f.refuse_unless(
            "function_call",
            |v| v == "none" || v == "auto",
            "OpenAI's deprecated form; send `tool_choice`",
        )?;
        let response_format = response_format(f.take("response_format", "an object")?, "response_format")?;
        if response_format.is_some() && common.guided.is_some() {
            return Err(ApiError::invalid("response_format", "give `response_format` or a guided_* field, not both"));
        }
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
            tools,
            tool_choice,
            parallel_tool_calls,
            response_format,
            logprobs: logprobs.then_some(top.unwrap_or(0)),
            chat_template_kwargs,
            add_generation_prompt,
            images,
            image_options,
        })
    }
}

/// A message's `content` as chat templates read it: a string (a string, a list of text parts
/// joined, or null: empty), or, when it holds images, a list of `{"type": "text", "text"}` and
/// `{"type": "image"}` parts in order, each image appended to `images`.
pub(crate) fn content(value: Option<Value>, at: &str, images: &mut Vec<ImagePart>) -> Result<Value, ApiError> {
    match value {
        None | Some(Value::Null) => Ok(Value::String(String::new())),
        Some(Value::String(s)) => Ok(Value::String(s)),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            let mut list = Vec::new();
            for (j, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str);
                match (kind, part.get("text").and_then(Value::as_str)) {
                    (Some("text" | "input_text" | "output_text"), Some(t)) => {
                        text.push_str(t);
                        list.push(json!({"type": "text", "text": t}));
                    }
                    (Some("text" | "input_text" | "output_text"), None) => {
                        return Err(ApiError::invalid(format!("{at}[{j}].text"), "a text part needs `text`"));
                    }
                    (Some("image_url" | "input_image"), _) => {
                        // Chat's `{"image_url": {"url": ...}}`, or the bare string of the
                        // Responses API's `input_image` (and of some chat clients).
                        let url = match part.get("image_url") {
                            Some(Value::Object(o)) => o.get("url").and_then(Value::as_str),
                            Some(Value::String(s)) => Some(s.as_str()),
                            _ => None,
                        }
                        .ok_or_else(|| {
                            ApiError::invalid(format!("{at}[{j}].image_url"), "an image part needs `image_url.url`")
                        })?;
                        let url_at = format!("{at}[{j}].image_url.url");
                        images.push(ImagePart { source: image_ref(url, &url_at)?, at: url_at });
                        list.push(json!({"type": "image"}));
                    }
                    _ => {
                        return Err(ApiError::invalid(
                            format!("{at}[{j}].type"),
                            "only text and image_url content parts are supported",
                        )
                        .code("unsupported_parameter"));
                    }
                }
            }
            let has_image = list.iter().any(|p| p["type"] == "image");
            Ok(if has_image { Value::Array(list) } else { Value::String(text) })
        }
        Some(_) => Err(ApiError::invalid(at, "`content` must be a string or a list of content parts")),
    }
}

/// An `image_url`'s image: a base64 `data:` URL, or a local file (`file://` URL or absolute
/// path). Network URLs are refused: Kylin fetches nothing.
pub(crate) fn image_ref(url: &str, at: &str) -> Result<ImageRef, ApiError> {
    use base64::Engine as _;
    if let Some(rest) = url.strip_prefix("data:") {
        let (header, data) =
            rest.split_once(',').ok_or_else(|| ApiError::invalid(at, "a `data:` URL needs a comma before its data"))?;
        if !header.split(';').any(|p| p == "base64") {
            return Err(ApiError::invalid(at, "a `data:` image URL must be base64 (`data:image/png;base64,...`)"));
        }
        let bytes = base64::engine::general_purpose::STANDARD.decode(data.trim()).map_err(|e| {
            ApiError::invalid(at, format!("the `data:` URL's base64 is invalid: {e}")).code("image_invalid")
        })?;
        return Ok(ImageRef::Bytes(bytes));
    }
    if url.starts_with("http://") || url.starts_with("https://") {
        return Err(ApiError::invalid(
            at,
            "Kylin fetches nothing from the network: send the image as a `data:` URL (base64), or as a local file \
             inside the directory the server's --allowed-local-media-path names",
        )
        .code("unsupported_parameter"));
    }
    let path = url.strip_prefix("file://").unwrap_or(url);
    if !path.starts_with('/') {
        return Err(ApiError::invalid(at, "an image URL must be a `data:` URL, a `file://` URL or an absolute path"));
    }
    Ok(ImageRef::Path(std::path::PathBuf::from(path)))
}

/// A tool call's arguments as the chat template wants them: an object (parsed from OpenAI's
/// JSON string).
pub fn arguments_object(arguments: &Value, at: &str) -> Result<Value, ApiError> {
    match arguments {
        Value::String(s) if s.trim().is_empty() => Ok(Value::Object(Map::new())),
        Value::String(s) => serde_json::from_str::<Value>(s)
            .map_err(|e| ApiError::invalid(at, format!("`arguments` must be a JSON text: {e}"))),
        Value::Object(_) => Ok(arguments.clone()),
        Value::Null => Ok(Value::Object(Map::new())),
        _ => Err(ApiError::invalid(at, "`arguments` must be a JSON string")),
    }
}

/// One message, checked and normalized to what chat templates read: `role`, `content` (text,
/// or parts when it holds images, which go to `images`), and for tool calling `tool_calls`
/// (arguments as objects) or `tool_call_id`.
pub fn message(i: usize, value: Value, images: &mut Vec<ImagePart>) -> Result<Value, ApiError> {
    let at = |field: &str| format!("messages[{i}].{field}");
    let Value::Object(mut m) = value else {
        return Err(ApiError::invalid(format!("messages[{i}]"), "each message must be an object"));
    };
    let role = match m.remove("role") {
        Some(Value::String(r)) => r,
        _ => return Err(ApiError::invalid(at("role"), "each message needs a string `role`")),
    };
    let role = match role.as_str() {
        "system" | "user" | "assistant" | "tool" => role,
        // OpenAI's newer name for system instructions; chat templates know `system`.
        "developer" => "system".to_string(),
        "function" => {
            return Err(ApiError::invalid(
                at("role"),
                "role `function` is OpenAI's deprecated form; send `tool` messages",
            )
            .code("unsupported_parameter"));
        }
        _ => return Err(ApiError::invalid(at("role"), format!("unknown role `{role}`"))),
    };
    let content = content(m.remove("content"), &at("content"), images)?;
    let mut out = Map::new();
    out.insert("role".into(), Value::String(role.clone()));
    out.insert("content".into(), content);
    let tool_calls = m.remove("tool_calls");
    let tool_call_id = m.remove("tool_call_id");
    let name = m.remove("name");
    match (role.as_str(), tool_calls) {
        ("assistant", Some(Value::Array(calls))) if !calls.is_empty() => {
            let mut list = Vec::with_capacity(calls.len());
            for (j, call) in calls.into_iter().enumerate() {
                let call_at = |f: &str| format!("messages[{i}].tool_calls[{j}].{f}");
                let id = call.get("id").and_then(Value::as_str).unwrap_or("").to_string();
                let function = call
                    .get("function")
                    .ok_or_else(|| ApiError::invalid(call_at("function"), "a tool call needs `function`"))?;
                let fname =
                    function.get("name").and_then(Value::as_str).filter(|n| !n.is_empty()).ok_or_else(|| {
                        ApiError::invalid(call_at("function.name"), "a tool call needs a function `name`")
                    })?;
                let args = arguments_object(
                    function.get("arguments").unwrap_or(&Value::Null),
                    &call_at("function.arguments"),
                )?;
                list.push(json!({"id": id, "type": "function", "function": {"name": fname, "arguments": args}}));
            }
            out.insert("tool_calls".into(), Value::Array(list));
        }
        (_, None | Some(Value::Null)) => {}
        ("assistant", Some(Value::Array(_))) => {}
        (_, Some(_)) => {
            return Err(ApiError::invalid(at("tool_calls"), "`tool_calls` belongs to assistant messages, as a list"));
        }
    }
    if role == "tool" {
        let id = match tool_call_id {
            Some(Value::String(id)) if !id.is_empty() => id,
            _ => {
                return Err(ApiError::invalid(
                    at("tool_call_id"),
                    "a `tool` message needs the `tool_call_id` it answers",
                ));
            }
        };
        out.insert("tool_call_id".into(), Value::String(id));
    } else if tool_call_id.is_some_and(|v| !v.is_null()) {
        return Err(ApiError::invalid(at("tool_call_id"), "`tool_call_id` belongs to `tool` messages"));
    }
    if let Some(Value::String(n)) = name {
        out.insert("name".into(), Value::String(n));
    }
    for (key, value) in m {
        match key.as_str() {
            "refusal" | "reasoning_content" | "reasoning" => {}
            "function_call" | "audio" if value.is_null() => {}
            "function_call" | "audio" => {
                return Err(ApiError::invalid(at(&key), format!("`{key}` is not supported; use `tool_calls`"))
                    .code("unsupported_parameter"));
            }
            _ => return Err(ApiError::invalid(at(&key), format!("unrecognized message field `{key}`"))),
        }
    }
    Ok(Value::Object(out))
}

/// Tool names OpenAI accepts: letters, digits, `_` and `-`, at most 64.
fn valid_tool_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 64 && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The most tools one request may declare.
pub const MAX_TOOLS: usize = 128;

/// One tool declared the Chat Completions way (`{"type": "function", "function": {...}}`) or
/// flat (`{"type": "function", "name", ...}`, the Responses API's form).
pub fn tool(j: usize, value: &Value, param: &str) -> Result<ToolSpec, ApiError> {
    let at = |f: &str| format!("{param}[{j}]{f}");
    let kind = value.get("type").and_then(Value::as_str);
    if kind != Some("function") {
        return Err(ApiError::invalid(at(".type"), "only `function` tools are supported").code("unsupported_parameter"));
    }
    let (f, prefix) = match value.get("function") {
        Some(f) => (f, ".function"),
        None => (value, ""),
    };
    let name = f.get("name").and_then(Value::as_str).unwrap_or("");
    if !valid_tool_name(name) {
        return Err(ApiError::invalid(
            at(&format!("{prefix}.name")),
            format!("a tool name must be 1 to 64 letters, digits, `_` or `-`; got `{name}`"),
        ));
    }
    let parameters = match f.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => {
            return Err(ApiError::invalid(
                at(&format!("{prefix}.parameters")),
                "`parameters` must be a JSON schema object",
            ));
        }
    };
    let description = f.get("description").and_then(Value::as_str).map(str::to_string);
    Ok(ToolSpec { name: name.to_string(), description, parameters })
}

/// `tools` of a request.
pub fn tools(value: Option<Value>, param: &str) -> Result<Vec<ToolSpec>, ApiError> {
    let list = match value {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(ApiError::invalid(param, format!("`{param}` must be a list of tools"))),
    };
    if list.len() > MAX_TOOLS {
        return Err(ApiError::invalid(param, format!("`{param}` has {} tools; at most {MAX_TOOLS}", list.len())));
    }
    let tools = list.iter().enumerate().map(|(j, t)| tool(j, t, param)).collect::<Result<Vec<_>, _>>()?;
    for (j, t) in tools.iter().enumerate() {
        if tools[..j].iter().any(|u| u.name == t.name) {
            return Err(ApiError::invalid(format!("{param}[{j}]"), format!("two tools are named `{}`", t.name)));
        }
    }
    Ok(tools)
}

/// OpenAI's `tool_choice` (a string or `{"type": "function", "function": {"name"}}`), checked
/// against the declared tools.
pub fn tool_choice(value: Option<Value>, tools: &[ToolSpec]) -> Result<ToolChoice, ApiError> {
    let choice = match &value {
        None | Some(Value::Null) => return Ok(if tools.is_empty() { ToolChoice::None } else { ToolChoice::Auto }),
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("`tool_choice` must be `none`, `auto`, `required` or a named function; got `{other}`"),
                ));
            }
        },
        Some(v) => {
            let name = v
                .pointer("/function/name")
                .or_else(|| v.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::invalid("tool_choice", "a named `tool_choice` needs `function.name`"))?;
            ToolChoice::Named(name.to_string())
        }
    };
    match &choice {
        ToolChoice::Named(name) if !tools.iter().any(|t| &t.name == name) => Err(ApiError::invalid(
            "tool_choice",
            format!("`tool_choice` names the tool `{name}`, which is not among `tools`"),
        )),
        ToolChoice::Required | ToolChoice::Named(_) if tools.is_empty() => {
            Err(ApiError::invalid("tool_choice", "`tool_choice` asks for a tool call, but `tools` is empty"))
        }
        _ => Ok(choice),
    }
}

/// OpenAI's `response_format` (and the Responses API's `text.format`): `text`, `json_object`,
/// or `json_schema` with its `schema`.
pub fn response_format(value: Option<Value>, param: &str) -> Result<Option<GrammarSpec>, ApiError> {
    let Some(v) = value.filter(|v| !v.is_null()) else { return Ok(None) };
    match v.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(GrammarSpec::JsonObject)),
        Some("json_schema") => {
            // Chat Completions nests it under `json_schema`; the Responses API puts it flat.
            let inner = v.get("json_schema").unwrap_or(&v);
            match inner.get("schema") {
                Some(schema @ (Value::Object(_) | Value::Bool(true))) => {
                    Ok(Some(GrammarSpec::JsonSchema(schema.clone())))
                }
                None | Some(Value::Null) => Ok(Some(GrammarSpec::JsonObject)),
                Some(_) => Err(ApiError::invalid(
                    format!("{param}.json_schema.schema"),
                    "`schema` must be a JSON schema object",
                )),
            }
        }
        Some(other) => Err(ApiError::invalid(
            format!("{param}.type"),
            format!("`{param}.type` must be `text`, `json_object` or `json_schema`; got `{other}`"),
        )),
        None => Err(ApiError::invalid(format!("{param}.type"), format!("`{param}` needs a `type`"))),
    }
}

/// vLLM's structured-output fields (`guided_json`, `guided_regex`, `guided_grammar`,
/// `guided_choice`): at most one.
fn guided(f: &mut Fields) -> Result<Option<(GrammarSpec, &'static str)>, ApiError> {
    let mut found = Vec::new();
    if let Some(v) = f.take::<Value>("guided_json", "a JSON schema")? {
        let schema = match v {
            Value::String(s) => {
                serde_json::from_str(&s).map_err(|e| ApiError::invalid("guided_json", format!("not JSON: {e}")))?
            }
            v => v,
        };
        found.push((GrammarSpec::JsonSchema(schema), "guided_json"));
    }
    if let Some(rx) = f.take::<String>("guided_regex", "a string")? {
        found.push((GrammarSpec::Regex(rx), "guided_regex"));
    }
    if let Some(g) = f.take::<String>("guided_grammar", "a string (a Lark grammar)")? {
        found.push((GrammarSpec::Lark(g), "guided_grammar"));
    }
    if let Some(choices) = f.take::<Vec<String>>("guided_choice", "a list of strings")? {
        if choices.is_empty() {
            return Err(ApiError::invalid("guided_choice", "`guided_choice` must not be empty"));
        }
        let alternatives: Vec<String> = choices.iter().map(|c| serde_json::to_string(c).unwrap_or_default()).collect();
        found.push((GrammarSpec::Lark(format!("start: {}", alternatives.join(" | "))), "guided_choice"));
    }
    if found.len() > 1 {
        return Err(ApiError::invalid(
            found[1].1,
            "give at most one of guided_json, guided_regex, guided_grammar, guided_choice",
        ));
    }
    Ok(found.pop())
}

/// OpenAI's `logit_bias`: token ids (as strings) to a bias in [-100, 100].
fn logit_bias(f: &mut Fields) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(map) = f.take::<Map<String, Value>>("logit_bias", "an object of token ids to biases")? else {
        return Ok(Vec::new());
    };
    if map.len() > 1024 {
        return Err(ApiError::invalid("logit_bias", "`logit_bias` may hold at most 1024 ids"));
    }
    let mut out = Vec::with_capacity(map.len());
    for (k, v) in map {
        let id: u32 = k
            .parse()
            .map_err(|_| ApiError::invalid("logit_bias", format!("`logit_bias` keys must be token ids; got `{k}`")))?;
        let bias = v.as_f64().filter(|b| (-100.0..=100.0).contains(b)).ok_or_else(|| {
            ApiError::invalid(format!("logit_bias.{k}"), format!("a bias must be a number in [-100, 100]; got {v}"))
        })?;
        out.push((id, bias as f32));
    }
    Ok(out)
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
    /// `echo`: the text starts with the prompt, and with `logprobs` the log-probabilities
    /// cover the prompt's tokens too (the first one's is null).
    pub echo: bool,
}

impl CompletionRequest {
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let mut f = Fields::parse(body)?;
        let echo = f.take::<bool>("echo", "a boolean")?.unwrap_or(false);
        let common = Common::take_with(&mut f, echo)?;
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
        f.refuse_unless("suffix", |v| v.as_str() == Some(""), "insertion (suffix) is not implemented")?;
        let format = response_format(f.take("response_format", "an object")?, "response_format")?;
        let mut common = common;
        if let Some(spec) = format {
            if common.guided.is_some() {
                return Err(ApiError::invalid(
                    "response_format",
                    "give `response_format` or a guided_* field, not both",
                ));
            }
            common.guided = Some((spec, "response_format"));
        }
        f.finish()?;
        Ok(CompletionRequest { common, prompts, logprobs, echo })
    }
}

/// `POST /tokenize`: text, token-less chat messages, or a completions-style prompt.
#[derive(Debug, Clone)]
pub enum TokenizeRequest {
    Text {
        model: Option<String>,
        text: String,
        add_special_tokens: bool,
    },
    Chat {
        model: Option<String>,
        messages: Vec<Value>,
        kwargs: Map<String, Value>,
        add_generation_prompt: bool,
        /// The messages' images, in order: their tokens are counted as the model's processor
        /// puts them into the prompt.
        images: Vec<ImagePart>,
        image_options: ImageOptions,
    },
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
        let image_options = image_options(f.take("mm_processor_kwargs", "an object")?)?;
        f.finish()?;
        match (prompt, messages) {
            (Some(text), None) => {
                Ok(TokenizeRequest::Text { model, text, add_special_tokens: add_special_tokens.unwrap_or(true) })
            }
            (None, Some(raw)) => {
                let mut images = Vec::new();
                let messages = raw
                    .into_iter()
                    .enumerate()
                    .map(|(i, m)| message(i, m, &mut images))
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(TokenizeRequest::Chat { model, messages, kwargs, add_generation_prompt, images, image_options })
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
        let e =
            ChatRequest::parse(br#"{"messages":[{"role":"user","content":[{"type":"input_audio"}]}]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content[0].type"));
        let e = ChatRequest::parse(br#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content[0].image_url"));
    }

    #[test]
    fn answer_changing_fields_are_refused_and_neutral_values_accepted() {
        let base = r#""messages":[{"role":"user","content":"hi"}]"#;
        let e = ChatRequest::parse(format!(r#"{{{base},"tools":[{{"type":"function"}}]}}"#).as_bytes()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0].name"));
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
