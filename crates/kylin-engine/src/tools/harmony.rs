//! gpt-oss's harmony messages: each `[<|start|>assistant][ to=functions.NAME]<|channel|>CHANNEL[
//! to=functions.NAME][ <|constrain|>json]<|message|>BODY` ends with `<|end|>`, `<|call|>` or
//! `<|return|>`. A message to `functions.NAME` is a call with BODY as its arguments; the
//! `final` channel is the answer, `analysis` the reasoning.

use super::scan::take_until;
use super::{GrammarWriter, ToolCallParser, ToolEvent, ToolSpec, arguments_json, quote};

const MESSAGE: &str = "<|message|>";
const ENDS: [&str; 4] = ["<|end|>", "<|call|>", "<|return|>", "<|start|>"];

#[derive(Debug)]
enum Body {
    Final,
    Analysis,
    Call(usize),
}

#[derive(Debug, Default)]
pub struct HarmonyParser {
    buf: String,
    header: String,
    body: Option<Body>,
    calls: usize,
    /// Whether any harmony structure was seen (otherwise the text is plain content).
    structured: bool,
}

impl HarmonyParser {
    fn open(&mut self, out: &mut Vec<ToolEvent>) {
        let header = std::mem::take(&mut self.header);
        let recipient = header.split("to=").nth(1).map(|r| {
            let r = r.split(['<', ' ']).next().unwrap_or("").trim();
            r.strip_prefix("functions.").unwrap_or(r).to_string()
        });
        let channel =
            header.split("<|channel|>").nth(1).map(|c| c.split(['<', ' ']).next().unwrap_or("").trim().to_string());
        self.body = Some(match (recipient, channel.as_deref()) {
            (Some(name), _) if !name.is_empty() => {
                let index = self.calls;
                self.calls += 1;
                out.push(ToolEvent::Start { index, name });
                Body::Call(index)
            }
            (_, Some("analysis")) => Body::Analysis,
            _ => Body::Final,
        });
    }

    fn run(&mut self, at_end: bool, out: &mut Vec<ToolEvent>) {
        loop {
            match &self.body {
                None => {
                    let (piece, found) = take_until(&mut self.buf, &[MESSAGE], at_end);
                    self.header.push_str(&piece);
                    if found.is_some() {
                        self.structured = true;
                        self.open(out);
                        continue;
                    }
                    if at_end && !self.structured {
                        // Not harmony at all: the text is the answer.
                        let text = std::mem::take(&mut self.header);
                        if !text.is_empty() {
                            out.push(ToolEvent::Text(text));
                        }
                    }
                    return;
                }
                Some(body) => {
                    let (piece, found) = take_until(&mut self.buf, &ENDS, at_end);
                    if !piece.is_empty() {
                        out.push(match body {
                            Body::Final => ToolEvent::Text(piece),
                            Body::Analysis => ToolEvent::Reasoning(piece),
                            Body::Call(index) => ToolEvent::Arguments { index: *index, delta: piece },
                        });
                    }
                    if found.is_none() && !at_end {
                        return;
                    }
                    if let Some(Body::Call(index)) = self.body.take() {
                        out.push(ToolEvent::End { index });
                    }
                    if found.is_none() {
                        return;
                    }
                }
            }
        }
    }
}

impl ToolCallParser for HarmonyParser {
    fn push(&mut self, text: &str, out: &mut Vec<ToolEvent>) {
        self.buf.push_str(text);
        self.run(false, out);
    }

    fn finish(&mut self, out: &mut Vec<ToolEvent>) {
        self.run(true, out);
    }
}

/// A forced call: optional reasoning on the analysis channel, then a commentary message to
/// one of the functions with JSON arguments (`<|call|>`, an EOS id, follows by itself).
pub(crate) fn grammar(g: &GrammarWriter<'_>, tools: &[&ToolSpec]) -> String {
    let (channel, message, end, start) = (g.lit("<|channel|>"), g.lit(MESSAGE), g.lit("<|end|>"), g.lit("<|start|>"));
    let constrain = g.lit("<|constrain|>");
    let mut lark = format!(
        "start: ({channel} \"analysis\" {message} ANALYSIS {end} {start} \"assistant\")? {channel} \"commentary to=functions.\" body\nANALYSIS: /[^<]*/\n"
    );
    lark.push_str(&super::body_rule(tools.len()));
    for (i, t) in tools.iter().enumerate() {
        lark.push_str(&format!(
            "call{i}: {} \" \" {constrain} \"json\" {message} {}\n",
            quote(&t.name),
            arguments_json(t)
        ));
    }
    lark
}

#[cfg(test)]
mod tests {
    use super::super::ToolSyntax;
    use super::super::testing::{call, parse_both_ways};

    /// gpt-oss's chat template for a call (`<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{...}<|call|>`),
    /// after the generation prompt `<|start|>assistant`, with reasoning before it.
    const TEMPLATE: &str = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\"}<|call|>";
    /// What the model itself writes (the recipient after the channel).
    const MODEL: &str =
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}";

    #[test]
    fn harmony_calls_parse_whole_and_streamed() {
        for step in [1, 6, 1000] {
            let r = parse_both_ways(ToolSyntax::Harmony, TEMPLATE, step);
            assert_eq!(r.calls, vec![call("get_weather", r#"{"city": "Paris"}"#)]);
            assert_eq!(r.reasoning, "Need the weather.");
            let r = parse_both_ways(ToolSyntax::Harmony, MODEL, step);
            assert_eq!(r.calls, vec![call("get_weather", r#"{"city": "Paris"}"#)]);
        }
    }

    #[test]
    fn the_final_channel_is_the_answer() {
        let r = parse_both_ways(
            ToolSyntax::Harmony,
            "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>Hello!",
            2,
        );
        assert_eq!((r.content.as_str(), r.reasoning.as_str()), ("Hello!", "think"));
        assert!(r.calls.is_empty());
        assert_eq!(parse_both_ways(ToolSyntax::Harmony, "plain text", 3).content, "plain text");
    }
}
