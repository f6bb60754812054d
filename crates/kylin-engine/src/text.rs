//! Text in and out of the native engine: the Hugging Face tokenizer and the chat template.
//!
//! [`TextCodec`] reproduces what `transformers` does for the same files:
//!
//! * `tokenize(text, add_special)` is `tokenizer(text, add_special_tokens=add_special)`. Added
//!   tokens written in the text (such as `<|im_start|>`) are recognised as single ids. BOS (and
//!   EOS) are added only where the tokenizer's post-processor or `add_bos_token` /
//!   `add_eos_token` from `tokenizer_config.json` ask for it, and never twice.
//! * `apply_chat_template` is `tokenizer.apply_chat_template(..., tokenize=False)`: the template
//!   is rendered with Jinja semantics (`trim_blocks` and `lstrip_blocks`, as `transformers`
//!   sets them), Python string methods, `raise_exception`, HF's `tojson` and `strftime_now`. The
//!   rendered text is then tokenized with `add_special = false`, as HF does for chat prompts.
//!
//! The template is compiled once in [`TextCodec::new`], so a malformed template is reported when
//! the model loads (`CONFIG_INVALID`), not on the first request.

use std::collections::BTreeMap;

use kylin_loader::{KylinError, Result, TokenizerBundle};
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error as JinjaError, ErrorKind as JinjaErrorKind};

use crate::backend::ChatMessage;

/// Prefix that marks an error raised by the template itself through `raise_exception`, so it
/// can be told apart from a template bug after minijinja has wrapped it.
const RAISE_MARKER: &str = "kylin-template-raised: ";

/// The most work one render may do, in minijinja's fuel: one unit per instruction plus, with
/// the patched minijinja (`vendor/README.md`), one per 4 bytes or items of every value an
/// instruction reads or makes. Real chat templates render a conversation of 1000 messages and
/// 1 MB of text within it (`real_templates_render_a_megabyte_conversation_within_the_budget`),
/// while a template that loops without end stops with `CONFIG_INVALID` instead of holding a
/// request, or the server's engine, for hours, in a quarter of a second for the costliest
/// units found: at 20 million, a template of nested loops over many frames ran 1 s and one
/// nesting a value to the limit 3.8 s (fuzz findings 5 and 4 in docs/fuzzing.md).
const TEMPLATE_FUEL: u64 = 5_000_000;

/// The stack of the thread a chat template renders on: room for the deepest value a template
/// can build within [`TEMPLATE_FUEL`]. minijinja formats, compares and drops values
/// recursively, some 300 to 370 bytes of stack per level of nesting. A value is carried from
/// one loop iteration to the next only in a namespace, and the patched minijinja makes each
/// assignment to one pay for searching the whole value (vendor/README.md), so a value nested
/// loop after loop stops near 40 000 levels; macro and loop recursion stop at 500 calls of a
/// block's depth. Some 100 000 levels at most: tens of MB, far below this. (256 MiB overflowed
/// at finding 6 in docs/fuzzing.md, and 1 GiB at finding 9, before the search's price.) The
/// stack is reserved, and only the pages a deep template touches are ever backed by memory.
/// Tested by `fuzz_regressions.rs`.
const RENDER_STACK_BYTES: usize = 1 << 30;

/// Name under which the chat template is compiled.
const TEMPLATE_NAME: &str = "chat_template";

/// A tokenizer plus its chat template, behaving like `transformers`' tokenizer for the same files.
pub struct TextCodec {
    tokenizer: tokenizers::Tokenizer,
    bos: Option<(String, u32)>,
    eos: Option<(String, u32)>,
    pad: Option<String>,
    unk: Option<String>,
    add_bos_token: bool,
    add_eos_token: bool,
    /// The compiled template environment, if the model (or the override) has a template.
    template: Option<Environment<'static>>,
    /// Where the template came from, for error messages.
    template_origin: String,
    /// The template's text (tool-call syntax detection reads it).
    template_source: Option<String>,
    /// The grammar compiler over this vocabulary, built on first use.
    grammar: std::sync::OnceLock<Result<std::sync::Arc<crate::grammar::GrammarCompiler>>>,
}

impl std::fmt::Debug for TextCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextCodec")
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos_token", &self.add_bos_token)
            .field("has_chat_template", &self.template.is_some())
            .field("template_origin", &self.template_origin)
            .finish()
    }
}

impl TextCodec {
    /// Builds the codec from the loader's bundle. `chat_template_override` (the text of a
    /// template, e.g. from `--chat-template`) replaces the model's own template.
    ///
    /// Fails with `CONFIG_INVALID` if the template does not compile.
    pub fn new(bundle: &TokenizerBundle, chat_template_override: Option<String>) -> Result<Self> {
        let (source, origin) = match chat_template_override {
            Some(text) => (Some(text), "the chat template given with --chat-template".to_string()),
            None => match bundle.default_chat_template() {
                Some(t) => (Some(t.source.clone()), format!("chat template '{}' of tokenizer_config.json", t.name)),
                None => (None, "tokenizer_config.json".to_string()),
            },
        };
        let template_source = source.clone();
        let template = match source {
            Some(source) => Some(build_environment(source, &origin)?),
            None => None,
        };
        // `tokenizer(text)` in transformers neither pads nor truncates unless asked to, whatever
        // `tokenizer.json` stores (all-MiniLM-L6-v2's pads every text to 128 tokens).
        let mut tokenizer = bundle.tokenizer.clone();
        tokenizer.with_padding(None);
        let _ = tokenizer.with_truncation(None);
        Ok(TextCodec {
            tokenizer,
            bos: bundle.bos_token.as_ref().map(|t| (t.content.clone(), t.id)),
            eos: bundle.eos_token.as_ref().map(|t| (t.content.clone(), t.id)),
            pad: bundle.pad_token.as_ref().map(|t| t.content.clone()),
            unk: bundle.unk_token.as_ref().map(|t| t.content.clone()),
            add_bos_token: bundle.add_bos_token,
            add_eos_token: bundle.add_eos_token,
            template,
            template_origin: origin,
            template_source,
            grammar: std::sync::OnceLock::new(),
        })
    }

    /// True when a chat template is available (from the model or the override).
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// The chat template's text, when there is one.
    pub fn template_source(&self) -> Option<&str> {
        self.template_source.as_deref()
    }

    /// The tool-call syntax the chat template teaches (`None`: it renders no tools).
    pub fn tool_syntax(&self) -> Option<crate::tools::ToolSyntax> {
        self.template_source.as_deref().and_then(crate::tools::ToolSyntax::detect)
    }

    /// The grammar compiler for this tokenizer with `vocab` logits and `eos_ids`, built on the
    /// first call (it indexes the vocabulary once) and shared after.
    pub fn grammar_compiler(
        &self,
        vocab: usize,
        eos_ids: &[u32],
    ) -> Result<std::sync::Arc<crate::grammar::GrammarCompiler>> {
        self.grammar
            .get_or_init(|| {
                crate::grammar::GrammarCompiler::new(&self.tokenizer, vocab, eos_ids).map(std::sync::Arc::new)
            })
            .clone()
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn tokenizer(&self) -> &tokenizers::Tokenizer {
        &self.tokenizer
    }

    /// Text to ids, as HF `tokenizer(text, add_special_tokens=add_special)["input_ids"]`.
    ///
    /// Special and added tokens written in `text` are matched as single ids. With `add_special`,
    /// the post-processor of `tokenizer.json` runs, and BOS/EOS are added where
    /// `add_bos_token`/`add_eos_token` say so and the post-processor did not already add them.
    pub fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let encoding = self
            .tokenizer
            .encode(text, add_special)
            .map_err(|e| KylinError::input_invalid(format!("the tokenizer could not encode the text: {e}")))?;
        let mut ids = encoding.get_ids().to_vec();
        if add_special {
            if let (true, Some((_, bos))) = (self.add_bos_token, &self.bos)
                && ids.first() != Some(bos)
            {
                ids.insert(0, *bos);
            }
            if let (true, Some((_, eos))) = (self.add_eos_token, &self.eos)
                && ids.last() != Some(eos)
            {
                ids.push(*eos);
            }
        }
        Ok(ids)
    }

    /// A pair of texts to ids and token types, as HF `tokenizer(first, second)` (the
    /// post-processor's pair template: `[CLS] a [SEP] b [SEP]` with types 0 then 1 for BERT,
    /// `<s> a </s></s> b </s>` for RoBERTa): a cross-encoder's input.
    pub fn tokenize_pair(&self, first: &str, second: &str) -> Result<(Vec<u32>, Vec<u32>)> {
        let encoding = self
            .tokenizer
            .encode((first, second), true)
            .map_err(|e| KylinError::input_invalid(format!("the tokenizer could not encode the pair: {e}")))?;
        Ok((encoding.get_ids().to_vec(), encoding.get_type_ids().to_vec()))
    }

    /// Ids to text, as HF `tokenizer.decode(ids, skip_special_tokens=skip_special)`.
    pub fn detokenize(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.tokenizer
            .decode(ids, skip_special)
            .map_err(|e| KylinError::input_invalid(format!("the tokenizer could not decode {} ids: {e}", ids.len())))
    }

    /// Renders `messages` through the chat template, as HF
    /// `apply_chat_template(messages, add_generation_prompt=..., tokenize=False, **kwargs)`.
    ///
    /// Template variables: `messages`, `add_generation_prompt`, `tools` (none), `bos_token`,
    /// `eos_token`, `pad_token`, `unk_token` (when the tokenizer has them), then every entry of
    /// `kwargs` (which may override the others, as in Python).
    ///
    /// Errors: `CONFIG_MISSING` without a template; `INPUT_INVALID` when the template raises an
    /// exception (its message is kept); `CONFIG_INVALID` when the template fails otherwise.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let messages: Vec<serde_json::Value> =
            messages.iter().map(|m| serde_json::json!({"role": m.role, "content": m.content})).collect();
        self.render_chat(&messages, add_generation_prompt, kwargs)
    }

    /// [`TextCodec::apply_chat_template`] for messages as OpenAI's JSON holds them, with
    /// whatever fields they carry (`tool_calls` with their arguments as objects, `tool_call_id`,
    /// `name`, ...); the tools go in `kwargs["tools"]`. Objects keep their keys' order, as
    /// Python's dicts do, so `tojson` writes what transformers writes.
    pub fn render_chat(
        &self,
        messages: &[serde_json::Value],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let Some(env) = &self.template else {
            return Err(KylinError::config_missing(
                "this model has no chat template: tokenizer_config.json has no 'chat_template'; \
                 give one with --chat-template FILE, or use a raw prompt",
            ));
        };
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        let msgs: Vec<Value> = messages.iter().map(json_to_value).collect();
        ctx.insert("messages".into(), Value::from(msgs));
        ctx.insert("add_generation_prompt".into(), Value::from(add_generation_prompt));
        ctx.insert("tools".into(), Value::from(()));
        let specials = [
            ("bos_token", self.bos.as_ref().map(|b| b.0.clone())),
            ("eos_token", self.eos.as_ref().map(|e| e.0.clone())),
            ("pad_token", self.pad.clone()),
            ("unk_token", self.unk.clone()),
        ];
        for (name, value) in specials {
            if let Some(v) = value {
                ctx.insert(name.into(), Value::from(v));
            }
        }
        for (k, v) in kwargs {
            ctx.insert(k.clone(), json_to_value(v));
        }
        let template = env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| KylinError::config_invalid(format!("{}: {e}", self.template_origin)))?;
        // minijinja formats, compares and drops nested values recursively, and a template can
        // nest a value once per loop iteration (`{% set ns.x = [ns.x] %}`): about 140 to 270
        // bytes of stack per level, so 30 000 levels overflow an 8 MiB main thread and far fewer
        // a 2 MiB tokio worker. The render runs on its own thread whose stack holds the deepest
        // value the fuel allows (see `RENDER_STACK_BYTES`); the stack is reserved, and only the
        // pages a deep template touches are ever backed by memory.
        std::thread::scope(|scope| {
            let render = std::thread::Builder::new()
                .name("chat-template".into())
                .stack_size(RENDER_STACK_BYTES)
                .spawn_scoped(scope, || template.render(Value::from(ctx)).map_err(|e| self.render_error(&e)))
                .map_err(|e| KylinError::config_invalid(format!("cannot start the chat template's thread: {e}")))?;
            render.join().unwrap_or_else(|_| {
                Err(KylinError::config_invalid(format!("{}: the chat template panicked", self.template_origin)))
            })
        })
    }

    fn render_error(&self, err: &JinjaError) -> KylinError {
        // The marker may sit in the error itself or in one of its sources.
        let mut current: Option<&(dyn std::error::Error + 'static)> = Some(err);
        while let Some(e) = current {
            if let Some(j) = e.downcast_ref::<JinjaError>()
                && let Some(detail) = j.detail()
                && let Some(msg) = detail.strip_prefix(RAISE_MARKER)
            {
                return KylinError::input_invalid(format!("the chat template rejected the messages: {msg}"));
            }
            current = e.source();
        }
        if err.kind() == JinjaErrorKind::OutOfFuel {
            return KylinError::config_invalid(format!(
                "{} ran more than {TEMPLATE_FUEL} instructions without finishing (a runaway loop?); \
                 fix the template or give another with --chat-template",
                self.template_origin
            ));
        }
        KylinError::config_invalid(format!(
            "{} failed to render: {err:#}; fix the template or give another with --chat-template",
            self.template_origin
        ))
    }
}

impl crate::serving::PromptText for TextCodec {
    fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        TextCodec::tokenize(self, text, add_special)
    }

    fn render_chat(
        &self,
        messages: &[serde_json::Value],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        TextCodec::render_chat(self, messages, add_generation_prompt, kwargs)
    }
}

/// Compiles `source` in an environment configured like `transformers`' template sandbox.
fn build_environment(source: String, origin: &str) -> Result<Environment<'static>> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|e| KylinError::config_invalid(format!("{origin}: {e}")))?;
    env.set_syntax(syntax);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_fuel(Some(TEMPLATE_FUEL));
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    env.add_filter("pprint", pprint);
    env.add_template_owned(TEMPLATE_NAME, source).map_err(|e| {
        KylinError::config_invalid(format!(
            "{origin} does not compile: {e:#}; fix it or give another with --chat-template"
        ))
    })?;
    Ok(env)
}

/// `raise_exception(message)`: the template refuses its input.
fn raise_exception(message: String) -> std::result::Result<Value, JinjaError> {
    Err(JinjaError::new(JinjaErrorKind::InvalidOperation, format!("{RAISE_MARKER}{message}")))
}

/// `strftime_now(format)`: the current UTC time formatted like Python's `strftime`.
fn strftime_now(format: String) -> std::result::Result<Value, JinjaError> {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    Ok(Value::from(strftime(&format, secs)))
}

/// Formats Unix time `secs` (UTC) with the common `strftime` directives.
fn strftime(format: &str, secs: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (hour, minute, second) = (rem / 3600, (rem % 3600) / 60, rem % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let is_leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let m_idx = (month - 1) as usize;
    let yday = cumulative[m_idx] + day + i64::from(is_leap && month > 2);
    let month_name = MONTHS[m_idx];
    let day_name = DAYS[weekday];

    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", if hour % 12 == 0 { 12 } else { hour % 12 })),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('B') => out.push_str(month_name),
            Some('b') | Some('h') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(day_name),
            Some('a') => out.push_str(&day_name[..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// HF's `tojson` filter: `json.dumps(value, ensure_ascii=False, indent=indent,
/// sort_keys=sort_keys)`, so non-ASCII text is kept and `<`, `>`, `&` are not escaped.
/// Separators are Python's defaults: `", "` and `": "` inline, `","` and `": "` with an indent.
/// The deepest value `pprint` formats. minijinja's own `pprint` (`{:#?}`) indents through one
/// writer adapter per level of nesting, so both the text and the work per character grow with
/// the depth: the cost is the cube of it. A list nested 5000 deep, built with 50 000
/// instructions of fuel, held its render for 379 s (the `chat_template` fuzz target; finding 6
/// in docs/fuzzing.md). Real templates print flat messages, if they use `pprint` at all.
const PPRINT_MAX_DEPTH: usize = 64;

/// `pprint` as minijinja's, refusing values nested deeper than [`PPRINT_MAX_DEPTH`].
fn pprint(value: Value) -> std::result::Result<Value, JinjaError> {
    if nested_deeper_than(&value, PPRINT_MAX_DEPTH)? {
        return Err(JinjaError::new(
            JinjaErrorKind::InvalidOperation,
            format!("pprint: value nested more than {PPRINT_MAX_DEPTH} levels deep"),
        ));
    }
    Ok(Value::from(format!("{value:#?}")))
}

/// Whether `value` has lists or maps nested more than `levels` deep. It recurses at most
/// `levels + 1` times, however deep the value.
fn nested_deeper_than(value: &Value, levels: usize) -> std::result::Result<bool, JinjaError> {
    let kind = value.kind();
    if !matches!(kind, ValueKind::Map | ValueKind::Seq | ValueKind::Iterable) {
        return Ok(false);
    }
    let Some(below) = levels.checked_sub(1) else {
        return Ok(true);
    };
    for item in value.try_iter()? {
        // A map iterates over its keys; the nesting is in the values.
        let child = if kind == ValueKind::Map { value.get_item(&item)? } else { item };
        if nested_deeper_than(&child, below)? {
            return Ok(true);
        }
    }
    Ok(false)
}

fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, JinjaError> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(usize::try_from(n).unwrap_or(0).min(64))),
            (None, Some(s)) => Some(s.to_string()),
            _ => {
                return Err(JinjaError::new(
                    JinjaErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ));
            }
        },
    };
    let opts = JsonOpts { indent, ensure_ascii: ensure_ascii.unwrap_or(false), sort_keys: sort_keys.unwrap_or(false) };
    let mut out = String::new();
    write_json(&value, &opts, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

struct JsonOpts {
    indent: Option<String>,
    ensure_ascii: bool,
    sort_keys: bool,
}

fn write_json(value: &Value, opts: &JsonOpts, depth: usize, out: &mut String) -> std::result::Result<(), JinjaError> {
    if depth > 256 {
        return Err(JinjaError::new(JinjaErrorKind::InvalidOperation, "tojson: value nested too deep"));
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(ind) = &opts.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    };
    let item_sep = if opts.indent.is_some() { "," } else { ", " };
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            let s = value.to_string();
            match s.as_str() {
                "inf" => out.push_str("Infinity"),
                "-inf" => out.push_str("-Infinity"),
                "NaN" | "nan" => out.push_str("NaN"),
                _ => out.push_str(&s),
            }
        }
        ValueKind::String => write_json_string(value.as_str().unwrap_or_default(), opts, out),
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                match key.as_str() {
                    Some(k) => write_json_string(k, opts, out),
                    None => write_json_string(&key.to_string(), opts, out),
                }
                out.push_str(": ");
                write_json(&value.get_item(key)?, opts, depth + 1, out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_json(item, opts, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        _ => write_json_string(&value.to_string(), opts, out),
    }
    Ok(())
}

/// A JSON string literal as Python's `json.dumps` writes it.
fn write_json_string(s: &str, opts: &JsonOpts, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (opts.ensure_ascii && (c as u32) > 0x7e) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A JSON value (from the CLI or an HTTP request) as a template value.
pub(crate) fn json_to_value(v: &serde_json::Value) -> Value {
    match v {
        serde_json::Value::Null => Value::from(()),
        serde_json::Value::Bool(b) => Value::from(*b),
        serde_json::Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        serde_json::Value::String(s) => Value::from(s.clone()),
        serde_json::Value::Array(a) => Value::from(a.iter().map(json_to_value).collect::<Vec<_>>()),
        // In the object's own order, as Python's dicts keep it.
        serde_json::Value::Object(o) => {
            let map: indexmap::IndexMap<Value, Value> =
                o.iter().map(|(k, v)| (Value::from(k.clone()), json_to_value(v))).collect();
            Value::from(map)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kylin_loader::{ChatTemplate, ErrorCode, TokenizerKind};

    /// A bundle around a tiny word-level tokenizer, enough to exercise templates.
    fn bundle(template: Option<&str>) -> TokenizerBundle {
        let json = r#"{
          "version": "1.0",
          "added_tokens": [{"id": 3, "content": "<s>", "single_word": false, "lstrip": false,
                            "rstrip": false, "normalized": false, "special": true}],
          "pre_tokenizer": {"type": "Whitespace"},
          "model": {"type": "WordLevel", "vocab": {"hello": 0, "world": 1, "[UNK]": 2, "<s>": 3},
                    "unk_token": "[UNK]"}
        }"#;
        let tokenizer = tokenizers::Tokenizer::from_bytes(json.as_bytes()).expect("test tokenizer");
        TokenizerBundle {
            tokenizer,
            kind: TokenizerKind::TokenizerJson,
            vocab_size: 4,
            bos_token: Some(kylin_loader::SpecialToken { content: "<s>".into(), id: 3 }),
            eos_token: None,
            pad_token: None,
            unk_token: None,
            add_bos_token: true,
            add_eos_token: false,
            special_tokens: vec![],
            chat_templates: template
                .map(|t| vec![ChatTemplate { name: "default".into(), source: t.into() }])
                .unwrap_or_default(),
        }
    }

    fn user(text: &str) -> Vec<ChatMessage> {
        vec![ChatMessage { role: "user".into(), content: text.into() }]
    }

    #[test]
    fn add_bos_token_adds_bos_once() {
        let codec = TextCodec::new(&bundle(None), None).unwrap();
        assert_eq!(codec.tokenize("hello world", true).unwrap(), vec![3, 0, 1]);
        assert_eq!(codec.tokenize("hello world", false).unwrap(), vec![0, 1]);
        assert_eq!(codec.tokenize("<s> hello", true).unwrap(), vec![3, 0]);
    }

    #[test]
    fn missing_template_is_config_missing() {
        let codec = TextCodec::new(&bundle(None), None).unwrap();
        assert!(!codec.has_chat_template());
        let err = codec.apply_chat_template(&user("hi"), true, &Default::default()).unwrap_err();
        assert_eq!(err.code(), ErrorCode::ConfigMissing);
        assert!(err.message.contains("tokenizer_config.json"));
        assert!(err.message.contains("--chat-template"));
    }

    #[test]
    fn bad_template_is_config_invalid() {
        let err = TextCodec::new(&bundle(Some("{% for x in %}")), None).unwrap_err();
        assert_eq!(err.code(), ErrorCode::ConfigInvalid);
    }

    #[test]
    fn raise_exception_is_input_invalid_with_message() {
        let t = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('System first!') }}{% endif %}";
        let codec = TextCodec::new(&bundle(Some(t)), None).unwrap();
        let err = codec.apply_chat_template(&user("hi"), true, &Default::default()).unwrap_err();
        assert_eq!(err.code(), ErrorCode::InputInvalid);
        assert!(err.message.contains("System first!"), "{}", err.message);
    }

    #[test]
    fn python_methods_tojson_and_kwargs() {
        let t = "{{ messages[0].content.strip().upper() }}|{{ 'a,b'.split(',')[-1] }}|\
                 {{ {'k': 'é<', 'n': [1, 2.5, none, true]} | tojson }}|{{ [1] | tojson(indent=2) }}|\
                 {{ bos_token }}|{{ enable_thinking }}";
        let codec = TextCodec::new(&bundle(Some(t)), None).unwrap();
        let mut kw = serde_json::Map::new();
        kw.insert("enable_thinking".into(), serde_json::Value::Bool(false));
        let out = codec.apply_chat_template(&user("  hi  "), true, &kw).unwrap();
        assert_eq!(out, "HI|b|{\"k\": \"é<\", \"n\": [1, 2.5, null, true]}|[\n  1\n]|<s>|False");
    }

    #[test]
    fn override_replaces_model_template() {
        let codec = TextCodec::new(&bundle(Some("model")), Some("override {{ messages|length }}".into())).unwrap();
        assert_eq!(codec.apply_chat_template(&user("x"), false, &Default::default()).unwrap(), "override 1");
    }

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S %a %A %b %B %j %%", 1_709_211_909),
            "2024-02-29 13:05:09 Thu Thursday Feb February 060 %"
        );
        assert_eq!(strftime("%d %b %Y", 0), "01 Jan 1970");
    }
}
