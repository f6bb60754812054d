//! Tool calling on the text side: which syntax a model writes its tool calls in, a streaming
//! parser per syntax, and the grammar that makes a model's calls follow its tools' schemas.
//!
//! A chat template teaches its model one way to write calls; [`ToolSyntax::detect`] reads it
//! from the template's source: Qwen/Hermes `<tool_call>{json}</tool_call>`, Llama 3.x JSON
//! (`{"name", "parameters"}`, optionally after `<|python_tag|>`), Qwen3-Coder's and Qwen3.5's
//! XML (`<tool_call><function=name><parameter=key>value</parameter></function></tool_call>`,
//! whose values take their JSON types from the tools' schemas), GLM-4.5's
//! (`<tool_call>name<arg_key>key</arg_key><arg_value>value</arg_value></tool_call>`, typed the
//! same way), Mistral `[TOOL_CALLS]` (the
//! JSON list of v3 and the `name[ARGS]{json}` form of later models), Gemma 4
//! `<|tool_call>call:name{...}<tool_call|>`, and gpt-oss's harmony messages
//! (`to=functions.name ... <|message|>{json}`). A template that renders no tools gets
//! [`ToolSyntax::Hermes`], with the tools described in a system message
//! ([`fallback_system_prompt`]).
//!
//! Every syntax has one parser behind [`ToolCallParser`]: text in, [`ToolEvent`]s out, fed
//! token by token while generating (streaming) or once with the whole text, with the same
//! result. Arguments are sent on as raw JSON text while they arrive.
//!
//! [`ToolSyntax::grammar`] writes the Lark grammar (llguidance's syntax, with `%json` for the
//! tools' parameter schemas) that constrains a response: with `tool_choice` `required` or a
//! named tool the response is one or more calls and nothing else, so every call parses and its
//! arguments validate; with `auto` free text is allowed and the grammar takes over from the
//! syntax's call marker on.
//!
//! This module lives in the engine's text side so the CLI and the server share it; it knows
//! nothing of HTTP.

mod gemma;
mod glm;
mod harmony;
mod hermes;
mod llama3;
mod mistral;
mod qwen_xml;
pub mod scan;

use serde_json::{Value, json};

use crate::grammar::schema_with_layout;

/// A function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub description: Option<String>,
    /// A JSON schema for the arguments (an object schema; `{"type": "object"}` when the tool
    /// declares none).
    pub parameters: Value,
}

impl ToolSpec {
    /// The tool as OpenAI's `tools` list holds it, which chat templates read.
    pub fn to_openai(&self) -> Value {
        let mut function = json!({"name": self.name, "parameters": self.parameters});
        if let Some(d) = &self.description {
            function["description"] = json!(d);
        }
        json!({"type": "function", "function": function})
    }
}

/// Whether and which tool the model must call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// No call: the tools are not shown to the model.
    None,
    /// The model decides.
    Auto,
    /// At least one call, and nothing but calls.
    Required,
    /// A call of this tool, and nothing else.
    Named(String),
}

/// One complete tool call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
}

/// What a parser found in the text it was fed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolEvent {
    /// Ordinary text, for the user.
    Text(String),
    /// Reasoning the syntax marks as such (harmony's analysis channel).
    Reasoning(String),
    /// Call `index` (0, 1, ... in order) of tool `name` begins.
    Start { index: usize, name: String },
    /// More of call `index`'s arguments; all deltas of a call add up to its arguments' JSON.
    Arguments { index: usize, delta: String },
    /// Call `index` is complete.
    End { index: usize },
}

/// A streaming tool-call parser: one per response.
pub trait ToolCallParser: Send + std::fmt::Debug {
    /// Feeds the next piece of generated text; appends what it completes to `out`. Text that
    /// may still turn out to be part of a call is held back.
    fn push(&mut self, text: &str, out: &mut Vec<ToolEvent>);
    /// The text ended: releases what was held back and ends an open call.
    fn finish(&mut self, out: &mut Vec<ToolEvent>);
}

/// A whole response, parsed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParsedResponse {
    pub content: String,
    pub reasoning: String,
    pub calls: Vec<ToolCall>,
}

impl ParsedResponse {
    /// Folds events into the response they describe.
    pub fn absorb(&mut self, events: &[ToolEvent]) {
        for e in events {
            match e {
                ToolEvent::Text(t) => self.content.push_str(t),
                ToolEvent::Reasoning(t) => self.reasoning.push_str(t),
                ToolEvent::Start { index, name } => {
                    if *index >= self.calls.len() {
                        self.calls.resize(index + 1, ToolCall { name: String::new(), arguments: String::new() });
                    }
                    self.calls[*index].name = name.clone();
                }
                ToolEvent::Arguments { index, delta } => {
                    if let Some(c) = self.calls.get_mut(*index) {
                        c.arguments.push_str(delta);
                    }
                }
                ToolEvent::End { .. } => {}
            }
        }
    }
}

/// The ways models write tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolSyntax {
    /// Qwen 2.5/3, Hermes, SmolLM3 and the fallback: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.
    Hermes,
    /// Llama 3.1-3.3: `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`.
    Llama3,
    /// Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}]` (v3) or
    /// `[TOOL_CALLS]name[ARGS]{...}` (Mistral Small 3.2, Devstral and later).
    Mistral,
    /// Gemma 4: `<|tool_call>call:name{key:<|"|>text<|"|>,...}<tool_call|>`.
    Gemma,
    /// gpt-oss (harmony): `<|channel|>commentary to=functions.name <|constrain|>json<|message|>{...}`.
    Harmony,
    /// Qwen3-Coder, Qwen3.5, Qwen3.6: `<tool_call>\n<function=name>\n<parameter=key>\nvalue\n</parameter>\n</function>\n</tool_call>`.
    QwenXml,
    /// GLM-4.5, -4.6, -4.7: `<tool_call>name\n<arg_key>key</arg_key>\n<arg_value>value</arg_value>\n</tool_call>`.
    Glm,
}

/// How to read one request's output for tool calls: the model's syntax and the tools the
/// request offered (the XML syntax types its values by their schemas).
#[derive(Debug, Clone)]
pub struct ToolParsing {
    pub syntax: ToolSyntax,
    pub tools: std::sync::Arc<[ToolSpec]>,
}

impl ToolParsing {
    /// A fresh parser for one response.
    pub fn parser(&self) -> Box<dyn ToolCallParser> {
        self.syntax.parser_for(&self.tools)
    }
}

impl ToolSyntax {
    /// The syntax a chat template teaches, or `None` when the template renders no tools.
    pub fn detect(template: &str) -> Option<ToolSyntax> {
        if template.contains("<|channel|>") && template.contains("<|call|>") {
            Some(ToolSyntax::Harmony)
        } else if template.contains("[TOOL_CALLS]") {
            Some(ToolSyntax::Mistral)
        } else if template.contains("<|tool_call>") {
            Some(ToolSyntax::Gemma)
        } else if template.contains("<arg_key>") && template.contains("<arg_value>") {
            Some(ToolSyntax::Glm)
        } else if template.contains("<function=") && template.contains("<parameter=") {
            Some(ToolSyntax::QwenXml)
        } else if template.contains("<tool_call>") {
            Some(ToolSyntax::Hermes)
        } else if template.contains("<|python_tag|>") || template.contains("\"parameters\": ") {
            Some(ToolSyntax::Llama3)
        } else {
            None
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ToolSyntax::Hermes => "hermes",
            ToolSyntax::Llama3 => "llama3-json",
            ToolSyntax::Mistral => "mistral",
            ToolSyntax::Gemma => "gemma4",
            ToolSyntax::Harmony => "harmony",
            ToolSyntax::QwenXml => "qwen3_coder",
            ToolSyntax::Glm => "glm45",
        }
    }

    /// The syntax's fixed strings, which a tokenizer may hold as special tokens (then the
    /// text must keep special tokens for the parser to see them).
    pub fn markers(self) -> &'static [&'static str] {
        match self {
            ToolSyntax::Hermes | ToolSyntax::QwenXml => &["<tool_call>", "</tool_call>"],
            ToolSyntax::Glm => {
                &["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]
            }
            ToolSyntax::Llama3 => &["<|python_tag|>"],
            ToolSyntax::Mistral => &["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"],
            ToolSyntax::Gemma => &["<|tool_call>", "<tool_call|>", "<|\"|>"],
            ToolSyntax::Harmony => &["<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|constrain|>", "<|call|>"],
        }
    }

    /// A fresh parser for one response (values of the XML syntax untyped: see
    /// [`ToolSyntax::parser_for`]).
    pub fn parser(self) -> Box<dyn ToolCallParser> {
        self.parser_for(&[])
    }

    /// A fresh parser for one response to a request that offered `tools`.
    pub fn parser_for(self, tools: &[ToolSpec]) -> Box<dyn ToolCallParser> {
        match self {
            ToolSyntax::QwenXml => Box::new(qwen_xml::QwenXmlParser::new(qwen_xml::parameter_types(tools))),
            ToolSyntax::Glm => Box::new(glm::GlmParser::new(qwen_xml::parameter_types(tools))),
            ToolSyntax::Hermes => Box::new(hermes::HermesParser::default()),
            ToolSyntax::Llama3 => Box::new(llama3::Llama3Parser::default()),
            ToolSyntax::Mistral => Box::new(mistral::MistralParser::default()),
            ToolSyntax::Gemma => Box::new(gemma::GemmaParser::default()),
            ToolSyntax::Harmony => Box::new(harmony::HarmonyParser::default()),
        }
    }

    /// Parses a whole response.
    pub fn parse(self, text: &str) -> ParsedResponse {
        self.parse_for(text, &[])
    }

    /// Parses a whole response to a request that offered `tools`.
    pub fn parse_for(self, text: &str, tools: &[ToolSpec]) -> ParsedResponse {
        let mut parser = self.parser_for(tools);
        let mut events = Vec::new();
        parser.push(text, &mut events);
        parser.finish(&mut events);
        let mut parsed = ParsedResponse::default();
        parsed.absorb(&events);
        parsed
    }

    /// The Lark grammar constraining a response to `tools` under `choice`; `None` when the
    /// response is not constrained (`none`, or `auto` for a syntax whose free text cannot be
    /// told from a call before it ends). `special` gives the id of a marker that is one
    /// special token of the tokenizer (the grammar names it by id; otherwise it spells it).
    pub fn grammar(
        self,
        tools: &[ToolSpec],
        choice: &ToolChoice,
        parallel: bool,
        special: &dyn Fn(&str) -> Option<u32>,
    ) -> Option<String> {
        let chosen: Vec<&ToolSpec> = match choice {
            ToolChoice::None => return None,
            ToolChoice::Auto | ToolChoice::Required => tools.iter().collect(),
            ToolChoice::Named(name) => tools.iter().filter(|t| &t.name == name).collect(),
        };
        if chosen.is_empty() {
            return None;
        }
        let forced = !matches!(choice, ToolChoice::Auto);
        let g = GrammarWriter { special };
        match self {
            ToolSyntax::Hermes => Some(hermes::grammar(&g, &chosen, forced, parallel)),
            ToolSyntax::Llama3 => Some(llama3::grammar(&g, &chosen, forced, parallel)),
            ToolSyntax::Mistral => Some(mistral::grammar(&g, &chosen, forced, parallel)),
            ToolSyntax::Gemma => Some(gemma::grammar(&g, &chosen, forced, parallel)),
            ToolSyntax::Harmony => forced.then(|| harmony::grammar(&g, &chosen)),
            ToolSyntax::QwenXml => Some(qwen_xml::grammar(&g, &chosen, forced, parallel)),
            ToolSyntax::Glm => Some(glm::grammar(&g, &chosen, forced, parallel)),
        }
    }
}

/// Writes grammar pieces for a tokenizer: markers as special tokens or as text.
pub(crate) struct GrammarWriter<'a> {
    special: &'a dyn Fn(&str) -> Option<u32>,
}

impl GrammarWriter<'_> {
    /// `text` as a grammar item: `<[id]>` when it is one special token, else a string literal.
    pub fn lit(&self, text: &str) -> String {
        match (self.special)(text) {
            Some(id) => format!("<[{id}]>"),
            None => quote(text),
        }
    }

    /// True when `text` is one special token.
    pub fn is_special(&self, text: &str) -> bool {
        (self.special)(text).is_some()
    }
}

/// The `start` rule of a syntax whose calls are blocks opened by `marker` and whose rule
/// `call_rest` holds the rest of one call: calls only when `forced`, else free text that turns
/// into calls at the marker (a special token can only be the marker; spelled as text, the
/// marker never occurs inside the free text). `parallel` allows further blocks after a newline.
pub(crate) fn block_start_rules(g: &GrammarWriter<'_>, marker: &str, forced: bool, parallel: bool) -> String {
    let open = g.lit(marker);
    let more = if parallel { format!(" (\"\\n\" {open} call_rest)*") } else { String::new() };
    if forced {
        format!("start: {open} call_rest{more}\n")
    } else if g.is_special(marker) {
        format!("start: TEXT | TEXT? {open} call_rest{more}\nTEXT: /(.|\\n)+/\n")
    } else {
        format!(
            "start: TEXT | call_head call_rest{more}\ncall_head[lazy]: TEXT {open}\nTEXT: {}\n",
            text_without(marker)
        )
    }
}

/// `body: call0 | call1 | ...`, one alternative per tool.
pub(crate) fn body_rule(tools: usize) -> String {
    format!("body: {}\n", (0..tools).map(|i| format!("call{i}")).collect::<Vec<_>>().join(" | "))
}

/// A Lark string literal.
pub(crate) fn quote(text: &str) -> String {
    serde_json::to_string(text).unwrap_or_else(|_| "\"\"".into())
}

/// A tool's parameters as a schema for the grammar (an empty schema allows any object).
pub(crate) fn parameters_schema(tool: &ToolSpec) -> Value {
    match &tool.parameters {
        Value::Object(m) if m.is_empty() => json!({"type": "object"}),
        Value::Null => json!({"type": "object"}),
        other => other.clone(),
    }
}

/// `%json {...}` of a call object `{"name": NAME, ARGS_KEY: PARAMETERS}`, laid out as
/// `json.dumps` writes it.
pub(crate) fn call_object_json(tool: &ToolSpec, args_key: &str) -> String {
    let schema = json!({
        "type": "object",
        "properties": {"name": {"const": tool.name}, args_key: parameters_schema(tool)},
        "required": ["name", args_key],
        "additionalProperties": false,
    });
    format!("%json {}", schema_with_layout(&schema))
}

/// `%json {...}` of a tool's arguments alone.
pub(crate) fn arguments_json(tool: &ToolSpec) -> String {
    format!("%json {}", schema_with_layout(&parameters_schema(tool)))
}

/// The text a grammar may leave free: anything (the marker of a text syntax excluded by the
/// caller where it matters).
pub(crate) const FREE_TEXT: &str = "/(.|\\n)*/";

/// A terminal for text that never contains `marker`, so the marker can only start a call.
pub(crate) fn text_without(marker: &str) -> String {
    format!("/(?s:.*)/ & ~/(?s:.*){}(?s:.*)/", regex_escape(marker))
}

/// `text` as a regular expression matching itself.
pub(crate) fn regex_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 2);
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~/".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The system message that teaches a model whose template renders no tools to call them in
/// the Hermes syntax (Qwen 2.5's own wording).
pub fn fallback_system_prompt(tools: &[ToolSpec]) -> String {
    let mut text = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for t in tools {
        text.push('\n');
        text.push_str(&t.to_openai().to_string());
    }
    text.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments \
         within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \
         \"arguments\": <args-json-object>}\n</tool_call>",
    );
    text
}

#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// Parses `text` whole and fed in pieces of `step` characters; both must agree.
    pub fn parse_both_ways(syntax: ToolSyntax, text: &str, step: usize) -> ParsedResponse {
        parse_both_ways_for(syntax, text, step, &[])
    }

    /// [`parse_both_ways`] for a request that offered `tools`.
    pub fn parse_both_ways_for(syntax: ToolSyntax, text: &str, step: usize, tools: &[ToolSpec]) -> ParsedResponse {
        let whole = syntax.parse_for(text, tools);
        let mut parser = syntax.parser_for(tools);
        let mut events = Vec::new();
        let chars: Vec<char> = text.chars().collect();
        for piece in chars.chunks(step) {
            parser.push(&piece.iter().collect::<String>(), &mut events);
        }
        parser.finish(&mut events);
        let mut streamed = ParsedResponse::default();
        streamed.absorb(&events);
        assert_eq!(streamed, whole, "streamed in pieces of {step} and whole differ for {text:?}");
        whole
    }

    pub fn call(name: &str, arguments: &str) -> ToolCall {
        ToolCall { name: name.into(), arguments: arguments.into() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_syntax_is_read_from_the_template() {
        let qwen = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../testdata/models/qwen2.5-coder-0.5b-instruct/tokenizer_config.json"
        ))
        .unwrap();
        assert_eq!(ToolSyntax::detect(&qwen), Some(ToolSyntax::Hermes));
        assert_eq!(ToolSyntax::detect("{{ '[TOOL_CALLS] [' }}"), Some(ToolSyntax::Mistral));
        assert_eq!(ToolSyntax::detect("{{- \"<|python_tag|>\" + tool_call.name }}"), Some(ToolSyntax::Llama3));
        assert_eq!(ToolSyntax::detect("{{- '<|tool_call>call:' + function['name'] }}"), Some(ToolSyntax::Gemma));
        assert_eq!(
            ToolSyntax::detect(
                "{{- \"<|start|>assistant to=\" }}{{- \"functions.\" + tool_call.name + \"<|channel|>commentary \" }}{{- \"<|call|>\" }}"
            ),
            Some(ToolSyntax::Harmony)
        );
        assert_eq!(ToolSyntax::detect("{% for m in messages %}{{ m.content }}{% endfor %}"), None);
        // Qwen3.5's template (its published shape: scripts/make_qwen35_tokenizer.py) teaches the
        // XML calls, though it also names <tool_call>.
        let qwen35 = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/qwen3.5/chat_template.jinja"
        ))
        .unwrap();
        assert_eq!(ToolSyntax::detect(&qwen35), Some(ToolSyntax::QwenXml));
        // GLM-4.5's template writes its calls with <arg_key>/<arg_value> inside <tool_call>.
        let glm = "{{- '<tool_call>' + tc.name }}{% for k, v in tc.arguments.items() %}\n<arg_key>{{ k }}</arg_key>\n<arg_value>{{ v }}</arg_value>{% endfor %}\n</tool_call>";
        assert_eq!(ToolSyntax::detect(glm), Some(ToolSyntax::Glm));
    }

    #[test]
    fn markers_become_special_tokens_or_literals() {
        let special = |s: &str| (s == "<|python_tag|>").then_some(128010);
        let g = GrammarWriter { special: &special };
        assert_eq!(g.lit("<|python_tag|>"), "<[128010]>");
        assert_eq!(g.lit("<tool_call>\n"), "\"<tool_call>\\n\"");
    }
}
