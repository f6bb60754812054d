//! Llama 3.1-3.3's JSON calls: the response is `{"name": "f", "parameters": {...}}` (several
//! separated by `;`), optionally after `<|python_tag|>`; a response that starts otherwise is
//! text.

use super::scan::{CallScanner, take_until};
use super::{FREE_TEXT, GrammarWriter, ToolCallParser, ToolEvent, ToolSpec, call_object_json};

const PYTHON_TAG: &str = "<|python_tag|>";

#[derive(Debug, Default)]
enum State {
    /// Nothing decisive seen yet.
    #[default]
    Start,
    /// Plain text to the end.
    Text,
    Call(CallScanner),
    /// After a call: `;` and whitespace, then another call or text.
    Between,
}

#[derive(Debug, Default)]
pub struct Llama3Parser {
    buf: String,
    state: State,
    calls: usize,
}

impl Llama3Parser {
    fn run(&mut self, at_end: bool, out: &mut Vec<ToolEvent>) {
        loop {
            match &mut self.state {
                State::Start | State::Between => {
                    let between = matches!(self.state, State::Between);
                    let skip: &[char] = if between { &[' ', '\n', '\t', '\r', ';'] } else { &[' ', '\n', '\t', '\r'] };
                    let trimmed = self.buf.trim_start_matches(skip);
                    if let Some(rest) = trimmed.strip_prefix(PYTHON_TAG) {
                        self.buf = rest.to_string();
                        self.start_call();
                    } else if trimmed.starts_with('{') {
                        self.buf = trimmed.to_string();
                        self.start_call();
                    } else if trimmed.is_empty() || (PYTHON_TAG.starts_with(trimmed) && !at_end) {
                        if at_end {
                            self.buf.clear();
                        }
                        return;
                    } else {
                        if between {
                            self.buf = trimmed.to_string();
                        }
                        self.state = State::Text;
                    }
                }
                State::Text => {
                    let (text, _) = take_until(&mut self.buf, &[], true);
                    if !text.is_empty() {
                        out.push(ToolEvent::Text(text));
                    }
                    return;
                }
                State::Call(call) => {
                    let text = std::mem::take(&mut self.buf);
                    match call.push(&text, out) {
                        Some(rest) => {
                            call.finish(out);
                            self.buf = rest;
                            self.state = State::Between;
                        }
                        None => {
                            if at_end {
                                if !call.finish(out) {
                                    self.calls -= 1;
                                }
                                self.state = State::Between;
                            }
                            return;
                        }
                    }
                }
            }
        }
    }

    fn start_call(&mut self) {
        self.state = State::Call(CallScanner::new(self.calls));
        self.calls += 1;
    }
}

impl ToolCallParser for Llama3Parser {
    fn push(&mut self, text: &str, out: &mut Vec<ToolEvent>) {
        self.buf.push_str(text);
        self.run(false, out);
    }

    fn finish(&mut self, out: &mut Vec<ToolEvent>) {
        self.run(true, out);
    }
}

/// Calls only when `forced`; with `auto`, a response is text unless it starts with `{` or
/// `<|python_tag|>`, and then it is calls.
pub(crate) fn grammar(g: &GrammarWriter<'_>, tools: &[&ToolSpec], forced: bool, parallel: bool) -> String {
    let more = if parallel { " (\"; \" body)*" } else { "" };
    let tag = if g.is_special(PYTHON_TAG) { format!("{}?", g.lit(PYTHON_TAG)) } else { String::new() };
    let mut lark = if forced {
        format!("start: {tag} body{more}\n")
    } else {
        format!("start: TEXT? | {tag} body{more}\nTEXT: /[^{{<\\s]/ {FREE_TEXT}\n")
    };
    lark.push_str(&super::body_rule(tools.len()));
    for (i, t) in tools.iter().enumerate() {
        lark.push_str(&format!("call{i}: {}\n", call_object_json(t, "parameters")));
    }
    lark
}

#[cfg(test)]
mod tests {
    use super::super::ToolSyntax;
    use super::super::testing::{call, parse_both_ways};

    /// What Llama 3.3's chat template renders for an assistant tool call (after the header).
    const LLAMA_CALL: &str = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}";

    #[test]
    fn llama_calls_parse_whole_and_streamed() {
        for step in [1, 4, 1000] {
            let r = parse_both_ways(ToolSyntax::Llama3, LLAMA_CALL, step);
            assert_eq!(r.calls, vec![call("get_weather", r#"{"city": "Paris"}"#)]);
            assert_eq!(r.content, "");
            let tagged = format!("<|python_tag|>{LLAMA_CALL}; {{\"name\": \"f\", \"parameters\": {{}}}}");
            let r = parse_both_ways(ToolSyntax::Llama3, &tagged, step);
            assert_eq!(r.calls, vec![call("get_weather", r#"{"city": "Paris"}"#), call("f", "{}")]);
        }
    }

    #[test]
    fn text_is_text() {
        let r = parse_both_ways(ToolSyntax::Llama3, "The weather is {unknown}.", 2);
        assert_eq!(r.content, "The weather is {unknown}.");
        assert!(r.calls.is_empty());
    }
}
