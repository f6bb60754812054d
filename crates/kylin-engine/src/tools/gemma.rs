//! Gemma 4's calls: `<|tool_call>call:name{key:value,...}<tool_call|>`, where strings are
//! written between `<|"|>` quotes and keys are bare. The arguments are turned into JSON when
//! the call closes.

use serde_json::{Map, Number, Value};

use super::scan::take_until;
use super::{FREE_TEXT, GrammarWriter, ToolCallParser, ToolEvent, ToolSpec, parameters_schema, quote};

const OPEN: &str = "<|tool_call>";
const CLOSE: &str = "<tool_call|>";
const QUOTE: &str = "<|\"|>";

#[derive(Debug, Default)]
pub struct GemmaParser {
    buf: String,
    /// Inside a call: its text so far.
    call: Option<String>,
    calls: usize,
}

impl GemmaParser {
    fn end_call(&mut self, body: &str, out: &mut Vec<ToolEvent>) {
        let body = body.trim();
        let Some(rest) = body.strip_prefix("call:") else { return };
        let (name, args) = match rest.find('{') {
            Some(at) => (&rest[..at], &rest[at..]),
            None => (rest, "{}"),
        };
        let arguments = parse_value(&mut Cursor { text: args, at: 0 }).unwrap_or(Value::Object(Map::new()));
        let index = self.calls;
        self.calls += 1;
        out.push(ToolEvent::Start { index, name: name.trim().to_string() });
        out.push(ToolEvent::Arguments { index, delta: arguments.to_string() });
        out.push(ToolEvent::End { index });
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
                    self.call = Some(String::new());
                }
                Some(body) => {
                    let (piece, found) = take_until(&mut self.buf, &[CLOSE], at_end);
                    body.push_str(&piece);
                    if found.is_none() && !at_end {
                        return;
                    }
                    let body = self.call.take().unwrap_or_default();
                    self.end_call(&body, out);
                    if found.is_none() {
                        return;
                    }
                }
            }
        }
    }
}

impl ToolCallParser for GemmaParser {
    fn push(&mut self, text: &str, out: &mut Vec<ToolEvent>) {
        self.buf.push_str(text);
        self.run(false, out);
    }

    fn finish(&mut self, out: &mut Vec<ToolEvent>) {
        self.run(true, out);
    }
}

struct Cursor<'a> {
    text: &'a str,
    at: usize,
}

impl Cursor<'_> {
    fn rest(&self) -> &str {
        &self.text[self.at..]
    }

    fn skip_space(&mut self) {
        let rest = self.rest();
        self.at += rest.len() - rest.trim_start().len();
    }

    fn eat(&mut self, s: &str) -> bool {
        self.skip_space();
        if self.rest().starts_with(s) {
            self.at += s.len();
            true
        } else {
            false
        }
    }
}

/// One value of Gemma's argument syntax, as JSON. `None` when malformed.
fn parse_value(c: &mut Cursor<'_>) -> Option<Value> {
    c.skip_space();
    if c.eat(QUOTE) {
        let end = c.rest().find(QUOTE)?;
        let s = c.rest()[..end].to_string();
        c.at += end + QUOTE.len();
        return Some(Value::String(s));
    }
    if c.eat("{") {
        let mut map = Map::new();
        loop {
            if c.eat("}") {
                return Some(Value::Object(map));
            }
            c.eat(",");
            c.skip_space();
            let key = if c.eat(QUOTE) {
                let end = c.rest().find(QUOTE)?;
                let k = c.rest()[..end].to_string();
                c.at += end + QUOTE.len();
                k
            } else {
                let end = c.rest().find(':')?;
                let k = c.rest()[..end].trim().to_string();
                c.at += end;
                k
            };
            if !c.eat(":") {
                return None;
            }
            map.insert(key, parse_value(c)?);
        }
    }
    if c.eat("[") {
        let mut list = Vec::new();
        loop {
            if c.eat("]") {
                return Some(Value::Array(list));
            }
            c.eat(",");
            list.push(parse_value(c)?);
        }
    }
    let (end, word) = {
        let rest = c.rest();
        let end = rest.find([',', '}', ']']).unwrap_or(rest.len());
        (end, rest[..end].trim().to_string())
    };
    c.at += end;
    Some(match word.as_str() {
        "true" => Value::Bool(true),
        "false" => Value::Bool(false),
        "null" => Value::Null,
        _ => match word.parse::<i64>() {
            Ok(i) => Value::Number(i.into()),
            Err(_) => {
                word.parse::<f64>().ok().and_then(Number::from_f64).map_or(Value::String(word.clone()), Value::Number)
            }
        },
    })
}

/// Rules for a value of `schema` in Gemma's syntax (`prefix` names the rules); the common
/// JSON schema keywords (`type`, `properties`, `items`, `enum`, `const`, `anyOf`) are honoured,
/// anything else is an unconstrained value.
fn value_rules(schema: &Value, prefix: &str, quote_lit: &str, rules: &mut Vec<String>) -> String {
    let name = format!("{prefix}v");
    let max = schema
        .get("maxLength")
        .and_then(Value::as_u64)
        .map_or(String::from("*"), |n| format!("{{0,{}}}", n.min(10_000)));
    let string = format!("{quote_lit} /[^<]{max}/ {quote_lit}");
    let options: Option<&[Value]> = schema
        .get("enum")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .or_else(|| schema.get("const").map(std::slice::from_ref));
    let body = if let Some(options) = options {
        options
            .iter()
            .map(|o| match o {
                Value::String(s) => format!("{quote_lit} {} {quote_lit}", quote(s)),
                other => quote(&other.to_string()),
            })
            .collect::<Vec<_>>()
            .join(" | ")
    } else if let Some(any) = schema.get("anyOf").or(schema.get("oneOf")).and_then(Value::as_array) {
        any.iter()
            .enumerate()
            .map(|(i, s)| value_rules(s, &format!("{prefix}a{i}"), quote_lit, rules))
            .collect::<Vec<_>>()
            .join(" | ")
    } else {
        match schema.get("type").and_then(Value::as_str) {
            Some("string") => string,
            Some("integer") => {
                let min = schema.get("minimum").and_then(Value::as_i64);
                let max = schema.get("maximum").and_then(Value::as_i64);
                match (min, max) {
                    // A small range is listed; other bounds are left to the arguments' check.
                    (Some(lo), Some(hi)) if lo <= hi && hi - lo <= 200 => {
                        (lo..=hi).map(|n| quote(&n.to_string())).collect::<Vec<_>>().join(" | ")
                    }
                    (Some(lo), _) if lo >= 0 => "/[0-9]+/".into(),
                    _ => "/-?[0-9]+/".into(),
                }
            }
            Some("number") => "/-?[0-9]+(\\.[0-9]+)?([eE][-+]?[0-9]+)?/".into(),
            Some("boolean") => "\"true\" | \"false\"".into(),
            Some("null") => "\"null\"".into(),
            Some("array") => {
                let item =
                    value_rules(schema.get("items").unwrap_or(&Value::Null), &format!("{prefix}i"), quote_lit, rules);
                format!("\"[\" ({item} (\",\" {item})*)? \"]\"")
            }
            Some("object") => {
                // Every property, in sorted order as the template writes them.
                let mut props: Vec<(&String, &Value)> =
                    schema.get("properties").and_then(Value::as_object).map(|m| m.iter().collect()).unwrap_or_default();
                props.sort_by(|a, b| a.0.cmp(b.0));
                let items: Vec<String> = props
                    .iter()
                    .enumerate()
                    .map(|(i, (k, s))| {
                        format!("{} \":\" {}", quote(k), value_rules(s, &format!("{prefix}p{i}"), quote_lit, rules))
                    })
                    .collect();
                format!("\"{{\" {} \"}}\"", items.join(" \",\" "))
            }
            _ => format!("{string} | /-?[0-9.eE+]+/ | \"true\" | \"false\" | \"null\""),
        }
    };
    rules.push(format!("{name}: {body}"));
    name
}

pub(crate) fn grammar(g: &GrammarWriter<'_>, tools: &[&ToolSpec], forced: bool, parallel: bool) -> String {
    let open = g.lit(OPEN);
    let close = g.lit(CLOSE);
    let quote_lit = g.lit(QUOTE);
    let more = if parallel { " call*" } else { "" };
    let mut lark = if forced {
        format!("start: call{more}\n")
    } else {
        format!("start: TEXT | TEXT? call{more}\nTEXT: {FREE_TEXT}\n")
    };
    let mut rules = Vec::new();
    let bodies: Vec<String> = tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let args = value_rules(&parameters_schema(t), &format!("t{i}"), &quote_lit, &mut rules);
            format!("{} {args}", quote(&format!("call:{}", t.name)))
        })
        .collect();
    lark.push_str(&format!("call: {open} ({}) {close}\n", bodies.join(" | ")));
    for r in rules {
        lark.push_str(&r);
        lark.push('\n');
    }
    lark
}

#[cfg(test)]
mod tests {
    use super::super::ToolSyntax;
    use super::super::testing::{call, parse_both_ways};

    /// Gemma 4's chat template for two calls.
    const GEMMA: &str = "<|tool_call>call:get_weather{city:<|\"|>Paris, France<|\"|>,days:3}<tool_call|><|tool_call>call:f{flags:[true,false],opts:{x:1.5}}<tool_call|>";

    #[test]
    fn gemma_calls_parse_whole_and_streamed_into_json() {
        for step in [1, 5, 1000] {
            let r = parse_both_ways(ToolSyntax::Gemma, GEMMA, step);
            assert_eq!(
                r.calls,
                vec![
                    call("get_weather", r#"{"city":"Paris, France","days":3}"#),
                    call("f", r#"{"flags":[true,false],"opts":{"x":1.5}}"#)
                ]
            );
        }
    }
}
