//! GLM-4.5's syntax (GLM-4.5, -4.5-Air, -4.6, -4.7; vLLM's `glm45` parser), one block per call:
//!
//! ```text
//! <tool_call>get_weather
//! <arg_key>city</arg_key>
//! <arg_value>Paris</arg_value>
//! <arg_key>days</arg_key>
//! <arg_value>3</arg_value>
//! </tool_call>
//! ```
//!
//! GLM's template writes a string argument as it is and any other as JSON (`tojson`); the parser
//! reads each value back by the type the tool's schema declares, as the XML syntax of Qwen3.5
//! does ([`super::qwen_xml::typed_value`]). The arguments are sent on one argument at a time.

use super::qwen_xml::{ArgumentsStream, ParameterTypes, parameter_rules, typed_value};
use super::scan::{take_through, take_until};
use super::{GrammarWriter, ToolCallParser, ToolEvent, ToolSpec, block_start_rules, body_rule, quote};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
const KEY: &str = "<arg_key>";
const KEY_END: &str = "</arg_key>";
const VALUE: &str = "<arg_value>";
const VALUE_END: &str = "</arg_value>";

/// Where the parser is.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
enum At {
    /// Free text, until `<tool_call>`.
    #[default]
    Text,
    /// Reading the tool's name, until a newline, `<arg_key>` or `</tool_call>`.
    Name,
    /// Inside the call, until `<arg_key>` or `</tool_call>`.
    Call,
    /// Reading an argument's name, until `</arg_key>`.
    Key,
    /// Between `</arg_key>` and `<arg_value>` (of argument `key`).
    BeforeValue { key: String },
    /// Reading argument `key`'s value, until `</arg_value>`.
    Value { key: String },
}

#[derive(Debug, Default)]
pub struct GlmParser {
    buf: String,
    at: At,
    args: ArgumentsStream,
    types: ParameterTypes,
}

impl GlmParser {
    pub fn new(types: ParameterTypes) -> Self {
        GlmParser { types, ..Default::default() }
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
                    self.at = At::Name;
                }
                At::Name => {
                    let ends = ["\n", KEY, CLOSE];
                    let found = ends.iter().enumerate().filter_map(|(i, m)| self.buf.find(m).map(|at| (at, i))).min();
                    let Some((at, which)) = found.or(at_end.then_some((self.buf.len(), 0))) else {
                        return;
                    };
                    let name = self.buf[..at].trim().to_string();
                    // The newline is consumed; `<arg_key>` and `</tool_call>` are read next.
                    self.buf.replace_range(..at + usize::from(which == 0 && at < self.buf.len()), "");
                    if name.is_empty() {
                        self.at = if at_end { At::Text } else { At::Call };
                        if at_end {
                            return;
                        }
                        continue;
                    }
                    self.args.start(&name, out);
                    self.at = At::Call;
                }
                At::Call => {
                    let (_, found) = take_until(&mut self.buf, &[KEY, CLOSE], at_end);
                    match found {
                        Some(0) => self.at = At::Key,
                        Some(_) => {
                            self.args.end(out);
                            self.at = At::Text;
                        }
                        None => return,
                    }
                }
                At::Key => {
                    let Some(key) = take_through(&mut self.buf, KEY_END, false) else {
                        if at_end {
                            self.buf.clear();
                        }
                        return;
                    };
                    self.at = At::BeforeValue { key: key.trim().to_string() };
                }
                At::BeforeValue { key } => {
                    let (_, found) = take_until(&mut self.buf, &[VALUE], at_end);
                    if found.is_none() {
                        return;
                    }
                    self.at = At::Value { key };
                }
                At::Value { key } => {
                    let Some(raw) = take_through(&mut self.buf, VALUE_END, at_end) else {
                        return;
                    };
                    let value = typed_value(&self.types, &self.args.name, &key, &raw);
                    self.args.field(key, &value, out);
                    self.at = At::Call;
                }
            }
        }
    }
}

impl ToolCallParser for GlmParser {
    fn push(&mut self, text: &str, out: &mut Vec<ToolEvent>) {
        self.buf.push_str(text);
        self.run(false, out);
    }

    fn finish(&mut self, out: &mut Vec<ToolEvent>) {
        self.run(true, out);
        self.args.end(out);
    }
}

/// The grammar of a call of each tool: its arguments in the schema's order, the required ones
/// always and the others optionally; a string's value is text of its `enum` or length bounds
/// without `</arg_value>`, any other value the JSON its schema allows.
pub(crate) fn grammar(g: &GrammarWriter<'_>, tools: &[&ToolSpec], forced: bool, parallel: bool) -> String {
    let (key, key_end, value_open, value_end) = (g.lit(KEY), g.lit(KEY_END), g.lit(VALUE), g.lit(VALUE_END));
    let mut lark = block_start_rules(g, OPEN, forced, parallel);
    lark.push_str(&format!("call_rest: body {}\n", g.lit(CLOSE)));
    lark.push_str(&body_rule(tools.len()));
    for (i, tool) in tools.iter().enumerate() {
        let items = parameter_rules(&mut lark, i, tool, VALUE_END, |name, value| {
            format!("{key} {} {key_end} \"\\n\" {value_open} {value} {value_end} \"\\n\"", quote(name))
        });
        lark.push_str(&format!("call{i}: {} \"\\n\" {items}\n", quote(&tool.name)));
    }
    lark
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
                "city": {"type": "string"}, "days": {"type": "integer"}, "hours": {"type": "array"}}}),
        }]
    }

    /// What GLM-4.5's chat template renders for an assistant message with two calls.
    const TWO_CALLS: &str = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>CET</arg_value>\n</tool_call>";

    #[test]
    fn glm_calls_parse_whole_and_streamed_with_values_typed_by_the_schema() {
        for step in [1, 2, 3, 7, 1000] {
            let r = parse_both_ways_for(ToolSyntax::Glm, TWO_CALLS, step, &tools());
            assert_eq!(
                r.calls,
                vec![call("get_weather", r#"{"city": "Paris", "days": 3}"#), call("get_time", r#"{"zone": "CET"}"#)]
            );
            assert_eq!(r.content.trim(), "");
        }
        let r = parse_both_ways_for(
            ToolSyntax::Glm,
            "Checking.<tool_call>get_weather\n<arg_key>hours</arg_key>\n<arg_value>[1, 2]</arg_value>\n<arg_key>city</arg_key>\n<arg_value>Rome",
            2,
            &tools(),
        );
        assert_eq!(r.content, "Checking.");
        assert_eq!(r.calls, vec![call("get_weather", r#"{"hours": [1,2], "city": "Rome"}"#)]);
        let r = parse_both_ways_for(ToolSyntax::Glm, "a <tool and <arg_key> are text", 2, &tools());
        assert_eq!(r.content, "a <tool and <arg_key> are text");
        assert!(r.calls.is_empty());
    }
}
