//! The Hermes syntax (Qwen 2.5 and 3, Hermes, SmolLM3, and Kylin's fallback):
//! `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, one block per call, after
//! optional text.

use super::scan::{CallScanner, take_until};
use super::{GrammarWriter, ToolCallParser, ToolEvent, ToolSpec, block_start_rules, body_rule, call_object_json};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

#[derive(Debug, Default)]
pub struct HermesParser {
    buf: String,
    call: Option<CallScanner>,
    calls: usize,
}

impl HermesParser {
    fn end_call(&mut self, out: &mut Vec<ToolEvent>) {
        if let Some(mut call) = self.call.take()
            && !call.finish(out)
        {
            // Not a call after all (no name): give its text back.
            self.calls -= 1;
        }
    }

    fn run(&mut self, at_end: bool, out: &mut Vec<ToolEvent>) {
        loop {
            match &mut self.call {
                None => {
                    let (text, found) = take_until(&mut self.buf, &[OPEN], at_end);
                    if !text.is_empty() {
                        out.push(ToolEvent::Text(text));
                    }
                    if found.is_none() {
                        return;
                    }
                    self.call = Some(CallScanner::new(self.calls));
                    self.calls += 1;
                }
                Some(call) => {
                    let (body, found) = take_until(&mut self.buf, &[CLOSE], at_end);
                    // Whatever follows the object inside the block (a newline) is dropped.
                    let _ = call.push(&body, out);
                    if found.is_none() && !at_end {
                        return;
                    }
                    self.end_call(out);
                    if found.is_none() {
                        return;
                    }
                }
            }
        }
    }
}

impl ToolCallParser for HermesParser {
    fn push(&mut self, text: &str, out: &mut Vec<ToolEvent>) {
        self.buf.push_str(text);
        self.run(false, out);
    }

    fn finish(&mut self, out: &mut Vec<ToolEvent>) {
        self.run(true, out);
        self.end_call(out);
    }
}

/// The grammar: calls only when `forced`, else free text that turns into calls at `<tool_call>`.
pub(crate) fn grammar(g: &GrammarWriter<'_>, tools: &[&ToolSpec], forced: bool, parallel: bool) -> String {
    let bodies: Vec<String> = tools.iter().map(|t| call_object_json(t, "arguments")).collect();
    let mut lark = block_start_rules(g, OPEN, forced, parallel);
    let close = g.lit(CLOSE);
    lark.push_str(&format!("call_rest: \"\\n\" body \"\\n\" {close}\n"));
    lark.push_str(&body_rule(bodies.len()));
    for (i, b) in bodies.iter().enumerate() {
        lark.push_str(&format!("call{i}: {b}\n"));
    }
    lark
}

#[cfg(test)]
mod tests {
    use super::super::testing::{call, parse_both_ways};
    use super::super::{ToolEvent, ToolSyntax};

    /// What Qwen2.5's chat template renders for an assistant message with two tool calls (the
    /// model writes the same after `<|im_start|>assistant\n`).
    const QWEN_TWO_CALLS: &str = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"CET\", \"24h\": true}}\n</tool_call>";

    #[test]
    fn qwen_calls_parse_whole_and_streamed() {
        for step in [1, 2, 3, 7, 1000] {
            let r = parse_both_ways(ToolSyntax::Hermes, QWEN_TWO_CALLS, step);
            assert_eq!(
                r.calls,
                vec![call("get_weather", r#"{"city": "Paris"}"#), call("get_time", r#"{"zone": "CET", "24h": true}"#)]
            );
            assert_eq!(r.content.trim(), "");
        }
    }

    #[test]
    fn text_before_a_call_and_text_alone() {
        let r = parse_both_ways(
            ToolSyntax::Hermes,
            "Let me check.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
            2,
        );
        assert_eq!(r.content, "Let me check.\n");
        assert_eq!(r.calls, vec![call("f", "{}")]);
        let r = parse_both_ways(ToolSyntax::Hermes, "a < b and <tool is not a call", 1);
        assert_eq!(r.content, "a < b and <tool is not a call");
        assert!(r.calls.is_empty());
    }

    #[test]
    fn an_unterminated_call_still_ends_and_a_nameless_one_is_dropped() {
        let r = parse_both_ways(ToolSyntax::Hermes, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}", 3);
        assert_eq!(r.calls, vec![call("f", r#"{"x": 1}"#)]);
        let r = parse_both_ways(ToolSyntax::Hermes, "<tool_call>\nnot json\n</tool_call>", 3);
        assert!(r.calls.is_empty());
    }

    #[test]
    fn arguments_arrive_before_the_call_ends() {
        let mut parser = ToolSyntax::Hermes.parser();
        let mut out = Vec::new();
        parser.push("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa", &mut out);
        assert!(out.contains(&ToolEvent::Start { index: 0, name: "get_weather".into() }));
        let sent: String = out
            .iter()
            .filter_map(|e| if let ToolEvent::Arguments { delta, .. } = e { Some(delta.as_str()) } else { None })
            .collect();
        assert_eq!(sent, "{\"city\": \"Pa");
    }
}
