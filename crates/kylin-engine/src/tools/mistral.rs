//! Mistral's `[TOOL_CALLS]`: a JSON list of `{"name", "arguments"}` objects after it (v3:
//! Mistral 7B v0.3, Nemo, Small 3.1), or `name[ARGS]{...}` (optionally `name[CALL_ID]id[ARGS]`),
//! one marker per call (Small 3.2, Devstral and later).

use super::scan::{CallScanner, ValueEnd, take_until};
use super::{FREE_TEXT, GrammarWriter, ToolCallParser, ToolEvent, ToolSpec, arguments_json, call_object_json, quote};

const MARK: &str = "[TOOL_CALLS]";
const ARGS: &str = "[ARGS]";
const CALL_ID: &str = "[CALL_ID]";

#[derive(Debug, Default)]
enum State {
    #[default]
    Text,
    /// After the marker, before its first non-space character.
    Marker,
    /// Inside the JSON list, before an element, `,` or `]`.
    List,
    ListCall(CallScanner),
    /// `name[ARGS]`: reading the name (and a call id).
    Name(String),
    Args {
        index: usize,
        end: ValueEnd,
    },
}

#[derive(Debug, Default)]
pub struct MistralParser {
    buf: String,
    state: State,
    calls: usize,
}

impl MistralParser {
    fn run(&mut self, at_end: bool, out: &mut Vec<ToolEvent>) {
        loop {
            match &mut self.state {
                State::Text => {
                    let (text, found) = take_until(&mut self.buf, &[MARK], at_end);
                    if !text.is_empty() {
                        out.push(ToolEvent::Text(text));
                    }
                    if found.is_none() {
                        return;
                    }
                    self.state = State::Marker;
                }
                State::Marker => {
                    let trimmed = self.buf.trim_start();
                    if trimmed.is_empty() {
                        self.buf.clear();
                        return;
                    }
                    self.buf = trimmed.to_string();
                    self.state =
                        if self.buf.starts_with('[') && !self.buf.starts_with(ARGS) && !self.buf.starts_with(CALL_ID) {
                            self.buf.remove(0);
                            State::List
                        } else {
                            State::Name(String::new())
                        };
                }
                State::List => {
                    let trimmed = self.buf.trim_start_matches([' ', '\n', ',']);
                    if trimmed.is_empty() {
                        self.buf.clear();
                        return;
                    }
                    if let Some(rest) = trimmed.strip_prefix(']') {
                        self.buf = rest.to_string();
                        self.state = State::Text;
                        continue;
                    }
                    self.buf = trimmed.to_string();
                    self.state = State::ListCall(CallScanner::new(self.calls));
                    self.calls += 1;
                }
                State::ListCall(call) => {
                    let text = std::mem::take(&mut self.buf);
                    match call.push(&text, out) {
                        Some(rest) => {
                            call.finish(out);
                            self.buf = rest;
                            self.state = State::List;
                        }
                        None => {
                            if at_end && !call.finish(out) {
                                self.calls -= 1;
                            }
                            return;
                        }
                    }
                }
                State::Name(name) => {
                    let (piece, found) = take_until(&mut self.buf, &[ARGS, CALL_ID], at_end);
                    name.push_str(&piece);
                    match found {
                        None => return,
                        Some(1) => {
                            // `[CALL_ID]id[ARGS]`: the id is ours to choose, drop it.
                            let (_, found) = take_until(&mut self.buf, &[ARGS], at_end);
                            if found.is_none() {
                                // Wait for `[ARGS]` with the name kept.
                                self.buf.insert_str(0, CALL_ID);
                                let kept = std::mem::take(name);
                                self.buf.insert_str(0, &kept);
                                self.state = State::Name(String::new());
                                return;
                            }
                        }
                        Some(_) => {}
                    }
                    let index = self.calls;
                    self.calls += 1;
                    out.push(ToolEvent::Start { index, name: name.trim().to_string() });
                    self.state = State::Args { index, end: ValueEnd::default() };
                }
                State::Args { index, end } => {
                    let index = *index;
                    match end.scan(&self.buf) {
                        Some(at) => {
                            let rest = self.buf.split_off(at);
                            let args = std::mem::replace(&mut self.buf, rest);
                            if !args.trim().is_empty() {
                                out.push(ToolEvent::Arguments { index, delta: args.trim_start().to_string() });
                            }
                            out.push(ToolEvent::End { index });
                            self.state = State::Text;
                        }
                        None => {
                            let args = std::mem::take(&mut self.buf);
                            if !args.is_empty() {
                                out.push(ToolEvent::Arguments { index, delta: args });
                            }
                            if at_end {
                                out.push(ToolEvent::End { index });
                                self.state = State::Text;
                            }
                            return;
                        }
                    }
                }
            }
        }
    }
}

impl ToolCallParser for MistralParser {
    fn push(&mut self, text: &str, out: &mut Vec<ToolEvent>) {
        self.buf.push_str(text);
        self.run(false, out);
    }

    fn finish(&mut self, out: &mut Vec<ToolEvent>) {
        self.run(true, out);
    }
}

/// The grammar in the `name[ARGS]{...}` form when `[ARGS]` is a token of the tokenizer (the
/// later models), else the JSON list.
pub(crate) fn grammar(g: &GrammarWriter<'_>, tools: &[&ToolSpec], forced: bool, parallel: bool) -> String {
    let mark = g.lit(MARK);
    let mut lark = String::new();
    let head = if forced { String::new() } else { "TEXT? ".to_string() };
    if g.is_special(ARGS) {
        let more = if parallel { format!(" ({mark} body)*") } else { String::new() };
        if forced {
            lark.push_str(&format!("start: {mark} body{more}\n"));
        } else {
            lark.push_str(&format!("start: TEXT | {head}{mark} body{more}\nTEXT: {FREE_TEXT}\n"));
        }
        let args = g.lit(ARGS);
        lark.push_str(&format!(
            "body: {}\n",
            (0..tools.len()).map(|i| format!("call{i}")).collect::<Vec<_>>().join(" | ")
        ));
        for (i, t) in tools.iter().enumerate() {
            lark.push_str(&format!("call{i}: {} {args} args{i}\nargs{i}: {}\n", quote(&t.name), arguments_json(t)));
        }
    } else {
        let more = if parallel { " (\", \" body)*" } else { "" };
        if forced {
            lark.push_str(&format!("start: {mark} \"[\" body{more} \"]\"\n"));
        } else {
            lark.push_str(&format!("start: TEXT | {head}{mark} \"[\" body{more} \"]\"\nTEXT: {FREE_TEXT}\n"));
        }
        lark.push_str(&format!(
            "body: {}\n",
            (0..tools.len()).map(|i| format!("call{i}")).collect::<Vec<_>>().join(" | ")
        ));
        for (i, t) in tools.iter().enumerate() {
            lark.push_str(&format!("call{i}: {}\n", call_object_json(t, "arguments")));
        }
    }
    lark
}

#[cfg(test)]
mod tests {
    use super::super::ToolSyntax;
    use super::super::testing::{call, parse_both_ways};

    /// Mistral Nemo's chat template for two calls (v3: a JSON list with ids).
    const NEMO: &str = "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}, \"id\": \"abcDEF123\"}, {\"name\": \"f\", \"arguments\": {}, \"id\": \"abcDEF124\"}]";
    /// Mistral Small 3.2's chat template for two calls.
    const SMALL_32: &str =
        "[TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]f[CALL_ID]abcDEF124[ARGS]{}";

    #[test]
    fn both_mistral_forms_parse_whole_and_streamed() {
        for step in [1, 3, 1000] {
            for text in [NEMO, SMALL_32, "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]f[ARGS]{}"] {
                let r = parse_both_ways(ToolSyntax::Mistral, text, step);
                assert_eq!(r.calls, vec![call("get_weather", r#"{"city": "Paris"}"#), call("f", "{}")], "{text}");
                assert_eq!(r.content, "");
            }
        }
    }

    #[test]
    fn text_before_the_marker_is_content() {
        let r = parse_both_ways(
            ToolSyntax::Mistral,
            "Sure. [TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": [1]}}]",
            2,
        );
        assert_eq!(r.content, "Sure. ");
        assert_eq!(r.calls, vec![call("f", r#"{"a": [1]}"#)]);
    }
}
