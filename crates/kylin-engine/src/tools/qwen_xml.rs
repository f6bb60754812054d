//! The XML syntax of Qwen3-Coder, Qwen3.5 and Qwen3.6 (vLLM's and SGLang's `qwen3_coder`
//! parser), one block per call:
//!
//! ```text
//! <tool_call>
//! <function=get_weather>
//! <parameter=city>
//! Paris
//! </parameter>
//! <parameter=days>
//! 3
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! A parameter's value is raw text (one leading and one trailing newline dropped). It becomes
//! JSON by the type the tool's schema gives the parameter, as vLLM converts it: strings as
//! they are; integers, numbers and booleans parsed (text that does not parse stays a string);
//! objects and arrays parsed as JSON; `null` (any case) as null; a parameter the schema does
//! not name, or a call of a tool the request did not offer, as a string. The arguments are
//! sent on one parameter at a time: `{` when the function opens, each `"key": value` when its
//! `</parameter>` arrives, `}` when the function closes.

use std::collections::BTreeMap;

use serde_json::Value;

use super::scan::{take_through, take_until};
use super::{GrammarWriter, ToolCallParser, ToolEvent, ToolSpec, block_start_rules, body_rule, quote};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
const FUNCTION: &str = "<function=";
const FUNCTION_END: &str = "</function>";
const PARAMETER: &str = "<parameter=";
const PARAMETER_END: &str = "</parameter>";

/// Each offered tool's parameters by name, with the JSON type its schema declares.
pub(crate) type ParameterTypes = BTreeMap<String, BTreeMap<String, String>>;

/// The declared type of each parameter of each tool (`"string"` where a schema gives none or
/// several).
pub(crate) fn parameter_types(tools: &[ToolSpec]) -> ParameterTypes {
    tools
        .iter()
        .map(|t| {
            let props = t.parameters.get("properties").and_then(Value::as_object);
            let types = props
                .into_iter()
                .flatten()
                .map(|(k, schema)| {
                    let ty = schema.get("type").and_then(Value::as_str).unwrap_or("string").to_string();
                    (k.clone(), ty)
                })
                .collect();
            (t.name.clone(), types)
        })
        .collect()
}

/// `value`, the raw text of parameter `key` of a call of `tool`, as JSON text, by the type the
/// tool's schema declares (see the module's documentation).
pub(crate) fn typed_value(types: &ParameterTypes, tool: &str, key: &str, value: &str) -> String {
    let ty = types.get(tool).and_then(|params| params.get(key)).map(String::as_str);
    let as_string = || Value::String(value.to_string()).to_string();
    if value.trim().eq_ignore_ascii_case("null") {
        return "null".into();
    }
    let parsed = |keep: &dyn Fn(&Value) -> bool| match serde_json::from_str::<Value>(value.trim()) {
        Ok(v) if keep(&v) => v.to_string(),
        _ => as_string(),
    };
    match ty {
        None | Some("string" | "str" | "text" | "enum") => as_string(),
        Some("integer" | "int") => parsed(&|v| v.is_i64() || v.is_u64()),
        Some("number" | "float") => parsed(&Value::is_number),
        Some("boolean" | "bool") => match value.trim().to_ascii_lowercase().as_str() {
            "true" => "true".into(),
            "false" => "false".into(),
            _ => as_string(),
        },
        Some("object" | "array" | "dict" | "list") => parsed(&|v| v.is_object() || v.is_array()),
        Some(_) => parsed(&|_| true),
    }
}

/// One response's calls as their arguments stream, one field at a time: `{` when a call
/// starts, each `"key": value` as it completes, `}` when the call ends.
#[derive(Debug, Default)]
pub(crate) struct ArgumentsStream {
    /// Calls started so far.
    calls: usize,
    /// The open call's tool, and how many fields it has sent.
    pub(crate) name: String,
    sent: usize,
    /// A call is open (its closing brace not yet sent).
    open: bool,
}

impl ArgumentsStream {
    pub(crate) fn start(&mut self, name: &str, out: &mut Vec<ToolEvent>) {
        let index = self.calls;
        self.calls += 1;
        out.push(ToolEvent::Start { index, name: name.to_string() });
        out.push(ToolEvent::Arguments { index, delta: "{".into() });
        self.name = name.to_string();
        self.sent = 0;
        self.open = true;
    }

    /// Sends field `key` with `value`, already JSON text.
    pub(crate) fn field(&mut self, key: String, value: &str, out: &mut Vec<ToolEvent>) {
        let comma = if self.sent > 0 { ", " } else { "" };
        let delta = format!("{comma}{}: {value}", Value::String(key));
        out.push(ToolEvent::Arguments { index: self.calls - 1, delta });
        self.sent += 1;
    }

    /// Closes the open call's arguments and ends it.
    pub(crate) fn end(&mut self, out: &mut Vec<ToolEvent>) {
        if self.open {
            let index = self.calls - 1;
            out.push(ToolEvent::Arguments { index, delta: "}".into() });
            out.push(ToolEvent::End { index });
            self.open = false;
        }
    }
}

/// Where the parser is.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
enum At {
    /// Free text, until `<tool_call>`.
    #[default]
    Text,
    /// Inside `<tool_call>`, until `<function=`.
    Call,
    /// Reading the function's name, until `>`.
    Name,
    /// Inside the function, until `<parameter=` or `</function>`.
    Function,
    /// Reading a parameter's name, until `>`.
    ParameterName,
    /// Reading parameter `key`'s value, until `</parameter>`.
    Value { key: String },
    /// After `</function>`, until `</tool_call>`.
    AfterFunction,
}

#[derive(Debug, Default)]
pub struct QwenXmlParser {
    buf: String,
    at: At,
    args: ArgumentsStream,
    types: ParameterTypes,
}

impl QwenXmlParser {
    pub fn new(types: ParameterTypes) -> Self {
        QwenXmlParser { types, ..Default::default() }
    }

    /// `value`, the raw text of parameter `key`, as JSON text (one leading and one trailing
    /// newline dropped).
    fn json_value(&self, key: &str, value: &str) -> String {
        let value = value.strip_prefix('\n').unwrap_or(value);
        let value = value.strip_suffix('\n').unwrap_or(value);
        typed_value(&self.types, &self.args.name, key, value)
    }

    fn run(&mut self, at_end: bool, out: &mut Vec<ToolEvent>) {
        loop {
            match self.at.clone() {
                At::Text => {
                    let (text, found) = take_until(&mut self.buf, &[OPEN], at_end);
                    if !text.is_empty() {
                        out.push(ToolEvent::Text(text));
                    }
                    if found.is_none() {
                        return;
                    }
                    self.at = At::Call;
                }
                At::Call => {
                    // Only whitespace is expected before `<function=`; anything else is dropped.
                    let (_, found) = take_until(&mut self.buf, &[FUNCTION, CLOSE], at_end);
                    match found {
                        Some(0) => self.at = At::Name,
                        Some(_) => self.at = At::Text,
                        None => return,
                    }
                }
                At::Name => {
                    // A name the text ends inside is dropped.
                    let Some(name) = take_through(&mut self.buf, ">", false) else {
                        if at_end {
                            self.buf.clear();
                        }
                        return;
                    };
                    self.args.start(name.trim(), out);
                    self.at = At::Function;
                }
                At::Function => {
                    let (_, found) = take_until(&mut self.buf, &[PARAMETER, FUNCTION_END, CLOSE], at_end);
                    match found {
                        Some(0) => self.at = At::ParameterName,
                        Some(1) => {
                            self.args.end(out);
                            self.at = At::AfterFunction;
                        }
                        Some(_) => {
                            self.args.end(out);
                            self.at = At::Text;
                        }
                        None => return,
                    }
                }
                At::ParameterName => {
                    let Some(key) = take_through(&mut self.buf, ">", false) else {
                        if at_end {
                            self.buf.clear();
                        }
                        return;
                    };
                    self.at = At::Value { key: key.trim().to_string() };
                }
                At::Value { key } => {
                    // The value is complete at `</parameter>` (or where the text ends).
                    let Some(raw) = take_through(&mut self.buf, PARAMETER_END, at_end) else {
                        return;
                    };
                    let value = self.json_value(&key, &raw);
                    self.args.field(key, &value, out);
                    self.at = At::Function;
                }
                At::AfterFunction => {
                    let (_, found) = take_until(&mut self.buf, &[CLOSE], at_end);
                    if found.is_none() {
                        return;
                    }
                    self.at = At::Text;
                }
            }
        }
    }
}

impl ToolCallParser for QwenXmlParser {
    fn push(&mut self, text: &str, out: &mut Vec<ToolEvent>) {
        self.buf.push_str(text);
        self.run(false, out);
    }

    fn finish(&mut self, out: &mut Vec<ToolEvent>) {
        self.run(true, out);
        self.args.end(out);
    }
}

/// The grammar of a call of each tool: its parameters in the schema's order, the required ones
/// always and the others optionally; a string's value is any text without `</parameter>`, any
/// other value the JSON its schema allows.
pub(crate) fn grammar(g: &GrammarWriter<'_>, tools: &[&ToolSpec], forced: bool, parallel: bool) -> String {
    let mut lark = block_start_rules(g, OPEN, forced, parallel);
    lark.push_str(&format!("call_rest: \"\\n\" body \"\\n\" {}\n", g.lit(CLOSE)));
    lark.push_str(&body_rule(tools.len()));
    for (i, tool) in tools.iter().enumerate() {
        let items = parameter_rules(&mut lark, i, tool, PARAMETER_END, |key, value| {
            format!("{} \"\\n\" {value} \"\\n\" {} \"\\n\"", quote(&format!("{PARAMETER}{key}>")), quote(PARAMETER_END))
        });
        lark.push_str(&format!(
            "call{i}: {} \"\\n\" {} {}\n",
            quote(&format!("{FUNCTION}{}>", tool.name)),
            items,
            quote(FUNCTION_END)
        ));
    }
    lark
}

/// Writes to `lark` one rule per parameter of tool `i` (`call{i}_p{j}: write(key, value)`, the
/// value a string's text ended by `end` or the JSON its schema allows) and returns the
/// sequence of them in the schema's order, the required ones always and the others optional.
pub(crate) fn parameter_rules(
    lark: &mut String,
    i: usize,
    tool: &ToolSpec,
    end: &str,
    write: impl Fn(&str, &str) -> String,
) -> String {
    let props = tool.parameters.get("properties").and_then(Value::as_object);
    let required: Vec<&str> = tool
        .parameters
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut items = Vec::new();
    for (j, (key, schema)) in props.into_iter().flatten().enumerate() {
        let rule = format!("call{i}_p{j}");
        let value = match string_value(schema, end) {
            Some(StringValue::OneOf(items)) => items,
            Some(StringValue::Text(terminal)) => {
                // `&` and `~` combine terminals only: the text is a terminal of its own.
                let name = format!("CALL{i}_P{j}_TEXT");
                lark.push_str(&format!("{name}: {terminal}\n"));
                name
            }
            None => format!("%json {}", crate::grammar::schema_with_layout(schema)),
        };
        lark.push_str(&format!("{rule}: {}\n", write(key, &value)));
        items.push(if required.contains(&key.as_str()) { rule } else { format!("{rule}?") });
    }
    items.join(" ")
}

/// A string parameter's value as the XML holds it (raw text, no quotes), ended by `end`.
enum StringValue {
    /// One of the schema's `enum` values: the alternatives, as a grammar item.
    OneOf(String),
    /// Text without the end marker of the schema's `minLength` to `maxLength` characters: the
    /// terminal's definition.
    Text(String),
}

/// [`StringValue`] for a string schema; `None` for any other (its value is JSON).
fn string_value(schema: &Value, end: &str) -> Option<StringValue> {
    if schema.get("type").and_then(Value::as_str) != Some("string") {
        return None;
    }
    if let Some(values) = schema.get("enum").and_then(Value::as_array) {
        let items: Option<Vec<String>> = values.iter().map(|v| v.as_str().map(quote)).collect();
        return items.filter(|i| !i.is_empty()).map(|i| StringValue::OneOf(format!("({})", i.join(" | "))));
    }
    let min = schema.get("minLength").and_then(Value::as_u64).unwrap_or(0);
    let max = schema.get("maxLength").and_then(Value::as_u64).map_or(String::new(), |m| m.to_string());
    Some(StringValue::Text(format!("/(?s:.){{{min},{max}}}/ & ~/(?s:.*){}(?s:.*)/", super::regex_escape(end))))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::super::testing::{call, parse_both_ways_for};
    use super::super::{ToolSpec, ToolSyntax};

    fn tools() -> Vec<ToolSpec> {
        vec![ToolSpec {
            name: "get_weather".into(),
            description: None,
            parameters: json!({"type": "object", "properties": {
                "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
                "hours": {"type": "array"}, "note": {"type": "string"}}}),
        }]
    }

    /// What Qwen3.5's chat template renders for an assistant message with two calls.
    const TWO_CALLS: &str = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>";

    #[test]
    fn calls_parse_whole_and_streamed_with_values_typed_by_the_schema() {
        for step in [1, 2, 3, 7, 1000] {
            let r = parse_both_ways_for(ToolSyntax::QwenXml, TWO_CALLS, step, &tools());
            assert_eq!(
                r.calls,
                vec![call("get_weather", r#"{"city": "Paris", "days": 3}"#), call("get_time", r#"{"zone": "CET"}"#)]
            );
            assert_eq!(r.content.trim(), "");
        }
    }

    #[test]
    fn values_follow_their_declared_types_and_strings_stay_as_written() {
        let text = "I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew\nYork <b>\n</parameter>\n<parameter=days>\nthree\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n<parameter=note>\n42\n</parameter>\n<parameter=extra>\nnull\n</parameter>\n</function>\n</tool_call>";
        let r = parse_both_ways_for(ToolSyntax::QwenXml, text, 4, &tools());
        assert_eq!(r.content, "I will check.\n");
        assert_eq!(
            r.calls,
            vec![call(
                "get_weather",
                r#"{"city": "New\nYork <b>", "days": "three", "metric": true, "hours": [1,2], "note": "42", "extra": null}"#
            )]
        );
        // Without the tools (another request's parser), every value is a string.
        let r = parse_both_ways_for(ToolSyntax::QwenXml, TWO_CALLS, 5, &[]);
        assert_eq!(r.calls[0], call("get_weather", r#"{"city": "Paris", "days": "3"}"#));
    }

    #[test]
    fn an_unterminated_call_still_ends_and_text_alone_is_text() {
        let r = parse_both_ways_for(
            ToolSyntax::QwenXml,
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome",
            3,
            &tools(),
        );
        assert_eq!(r.calls, vec![call("get_weather", r#"{"city": "Rome"}"#)]);
        let r = parse_both_ways_for(ToolSyntax::QwenXml, "a <tool or <function=x> is text", 2, &tools());
        assert_eq!(r.content, "a <tool or <function=x> is text");
        assert!(r.calls.is_empty());
    }
}
