//! Incremental scanners the tool-call parsers share: text held back while it may be the start
//! of a marker, and a JSON call object (`{"name": ..., "arguments": {...}}`) read as it
//! streams, so the arguments can be sent on before the call is complete.

use serde_json::Value;

use super::ToolEvent;

/// Splits streamed text at the first of `markers`, holding back an ending that could still
/// become one. Returns the text before the marker (or all that is safe to release) and the
/// index of the marker found, whose text is removed from `buf`.
pub fn take_until(buf: &mut String, markers: &[&str], at_end: bool) -> (String, Option<usize>) {
    let found = markers.iter().enumerate().filter_map(|(i, m)| buf.find(m).map(|at| (at, i))).min();
    if let Some((at, i)) = found {
        let before = buf[..at].to_string();
        buf.replace_range(..at + markers[i].len(), "");
        return (before, Some(i));
    }
    if at_end {
        return (std::mem::take(buf), None);
    }
    // Hold back the longest ending that is a proper prefix of a marker.
    let mut keep = 0;
    for m in markers {
        for len in (1..m.len()).rev() {
            if len <= buf.len() && buf.is_char_boundary(buf.len() - len) && buf.ends_with(&m[..len]) {
                keep = keep.max(len);
                break;
            }
        }
    }
    let cut = buf.len() - keep;
    let out = buf[..cut].to_string();
    buf.replace_range(..cut, "");
    (out, None)
}

/// Removes from `buf` the text before the first `end`, and `end` itself, and returns that
/// text; `None` while `end` has not arrived. With `at_end` (the response is over), the rest of
/// `buf` is the text.
pub fn take_through(buf: &mut String, end: &str, at_end: bool) -> Option<String> {
    match buf.find(end) {
        Some(at) => {
            let text = buf[..at].to_string();
            buf.replace_range(..at + end.len(), "");
            Some(text)
        }
        None if at_end => Some(std::mem::take(buf)),
        None => None,
    }
}

/// Where the scanner is inside the top-level object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Key,
    Colon,
    Value,
    /// A value at depth 1 started at `start`; `nested` when it is an object, array or string.
    InValue {
        start: usize,
    },
    Comma,
}

/// Reads one JSON object of a tool call as it streams: the tool's name (`name`) and its
/// arguments (`arguments` or `parameters`, Llama's key), sent on as raw text while they arrive.
#[derive(Debug)]
pub struct CallScanner {
    index: usize,
    /// The object's text so far.
    buf: String,
    /// Bytes of `buf` scanned.
    pos: usize,
    depth: usize,
    in_string: bool,
    escaped: bool,
    expect: Expect,
    key_start: usize,
    key: String,
    name: Option<String>,
    /// Start of the arguments' value, and its end once known.
    args: Option<(usize, Option<usize>)>,
    /// Arguments bytes already sent.
    sent: usize,
    started: bool,
    /// Byte just past the object's closing brace, once seen.
    end: Option<usize>,
}

impl CallScanner {
    pub fn new(index: usize) -> Self {
        CallScanner {
            index,
            buf: String::new(),
            pos: 0,
            depth: 0,
            in_string: false,
            escaped: false,
            expect: Expect::Key,
            key_start: 0,
            key: String::new(),
            name: None,
            args: None,
            sent: 0,
            started: false,
            end: None,
        }
    }

    /// True once the object's closing brace was read.
    pub fn is_complete(&self) -> bool {
        self.end.is_some()
    }

    /// The call's index among the response's calls.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Feeds text; returns what follows the object when it closed within `text`.
    pub fn push(&mut self, text: &str, out: &mut Vec<ToolEvent>) -> Option<String> {
        if self.end.is_some() {
            return Some(text.to_string());
        }
        self.buf.push_str(text);
        self.scan();
        self.emit(out);
        self.end.map(|end| {
            let rest = self.buf[end..].to_string();
            self.buf.truncate(end);
            rest
        })
    }

    fn value_ended(&mut self, start: usize, end: usize) {
        match self.key.as_str() {
            "name" => {
                if let Ok(Value::String(name)) = serde_json::from_str::<Value>(&self.buf[start..end]) {
                    self.name = Some(name);
                }
            }
            "arguments" | "parameters" => self.args = Some((start, Some(end))),
            _ => {}
        }
    }

    fn scan(&mut self) {
        let mut i = self.pos;
        while i < self.buf.len() && self.end.is_none() {
            let c = self.buf.as_bytes()[i];
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if c == b'\\' {
                    self.escaped = true;
                } else if c == b'"' {
                    self.in_string = false;
                    if self.depth == 1 {
                        match self.expect {
                            Expect::Key => {
                                self.key = serde_json::from_str(&self.buf[self.key_start..=i]).unwrap_or_default();
                                self.expect = Expect::Colon;
                            }
                            Expect::InValue { start } => {
                                self.value_ended(start, i + 1);
                                self.expect = Expect::Comma;
                            }
                            _ => {}
                        }
                    }
                }
                i += 1;
                continue;
            }
            match c {
                b'"' => {
                    self.in_string = true;
                    if self.depth == 1 {
                        match self.expect {
                            Expect::Key => self.key_start = i,
                            Expect::Value => self.start_value(i),
                            _ => {}
                        }
                    }
                }
                b'{' | b'[' => {
                    if self.depth == 1 && self.expect == Expect::Value {
                        self.start_value(i);
                    }
                    self.depth += 1;
                }
                b'}' | b']' => {
                    if self.depth == 1 {
                        if let Expect::InValue { start } = self.expect {
                            // A number, `true`, `false` or `null` ends at the closing brace.
                            let end = self.buf[..i].trim_end().len();
                            self.value_ended(start, end);
                        }
                        self.depth = 0;
                        self.end = Some(i + 1);
                    } else if self.depth > 1 {
                        self.depth -= 1;
                        if self.depth == 1
                            && let Expect::InValue { start } = self.expect
                        {
                            self.value_ended(start, i + 1);
                            self.expect = Expect::Comma;
                        }
                    }
                }
                b':' if self.depth == 1 && self.expect == Expect::Colon => self.expect = Expect::Value,
                b',' if self.depth == 1 => {
                    if let Expect::InValue { start } = self.expect {
                        let end = self.buf[..i].trim_end().len();
                        self.value_ended(start, end);
                    }
                    self.expect = Expect::Key;
                }
                c if c.is_ascii_whitespace() => {}
                _ => {
                    if self.depth == 1 && self.expect == Expect::Value {
                        self.start_value(i);
                    }
                }
            }
            i += 1;
        }
        self.pos = i;
    }

    fn start_value(&mut self, at: usize) {
        self.expect = Expect::InValue { start: at };
        if matches!(self.key.as_str(), "arguments" | "parameters") {
            self.args = Some((at, None));
        }
    }

    /// Sends the start of the call once its name is known, and the arguments as they arrive
    /// (an object or array streams; a string is decoded and sent whole when it ends).
    fn emit(&mut self, out: &mut Vec<ToolEvent>) {
        let Some(name) = &self.name else { return };
        if !self.started {
            self.started = true;
            out.push(ToolEvent::Start { index: self.index, name: name.clone() });
        }
        let Some((start, end)) = self.args else { return };
        let streams = matches!(self.buf.as_bytes().get(start), Some(b'{' | b'['));
        if !streams {
            return;
        }
        let limit = end.unwrap_or(self.pos.min(self.buf.len()));
        let from = start + self.sent;
        if limit > from && self.buf.is_char_boundary(limit) && self.buf.is_char_boundary(from) {
            out.push(ToolEvent::Arguments { index: self.index, delta: self.buf[from..limit].to_string() });
            self.sent = limit - start;
        }
    }

    /// Ends the call (the object closed, or the text ended): sends what is left and
    /// [`ToolEvent::End`]; `false` when no name was found (not a call).
    pub fn finish(&mut self, out: &mut Vec<ToolEvent>) -> bool {
        self.emit(out);
        let Some(name) = self.name.clone() else { return false };
        if !self.started {
            self.started = true;
            out.push(ToolEvent::Start { index: self.index, name });
        }
        match self.args {
            None => out.push(ToolEvent::Arguments { index: self.index, delta: "{}".into() }),
            Some((start, end)) => {
                let end = end.unwrap_or(self.buf.len()).min(self.buf.len());
                let raw = self.buf.get(start..end).unwrap_or("").trim_end();
                if self.sent == 0 {
                    // A string holding JSON is the arguments' text; anything else is sent as is.
                    let text = match serde_json::from_str::<Value>(raw) {
                        Ok(Value::String(s)) => s,
                        _ => raw.to_string(),
                    };
                    out.push(ToolEvent::Arguments { index: self.index, delta: text });
                    self.sent = raw.len();
                }
            }
        }
        out.push(ToolEvent::End { index: self.index });
        true
    }
}

/// Tracks one JSON value as it streams (objects, arrays and strings nest; anything else ends
/// at a delimiter), to know where it ends.
#[derive(Debug, Default)]
pub struct ValueEnd {
    depth: usize,
    in_string: bool,
    escaped: bool,
    started: bool,
}

impl ValueEnd {
    /// Scans `text`; returns the byte just past the value's end when it ends within `text`.
    pub fn scan(&mut self, text: &str) -> Option<usize> {
        for (i, c) in text.bytes().enumerate() {
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if c == b'\\' {
                    self.escaped = true;
                } else if c == b'"' {
                    self.in_string = false;
                    if self.depth == 0 {
                        return Some(i + 1);
                    }
                }
                continue;
            }
            match c {
                b'"' => {
                    self.started = true;
                    self.in_string = true;
                }
                b'{' | b'[' => {
                    self.started = true;
                    self.depth += 1;
                }
                b'}' | b']' => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.depth == 0 {
                        return Some(i + 1);
                    }
                }
                c if c.is_ascii_whitespace() && !self.started => {}
                _ => self.started = true,
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(pieces: &[&str]) -> (Vec<ToolEvent>, Option<String>) {
        let mut s = CallScanner::new(0);
        let mut out = Vec::new();
        let mut rest = None;
        for p in pieces {
            if let Some(r) = s.push(p, &mut out) {
                rest = Some(r);
                break;
            }
        }
        s.finish(&mut out);
        (out, rest)
    }

    fn arguments(events: &[ToolEvent]) -> String {
        events
            .iter()
            .filter_map(|e| match e {
                ToolEvent::Arguments { delta, .. } => Some(delta.as_str()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn arguments_stream_as_they_arrive_and_add_up_to_the_value() {
        let text = r#"{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}} tail"#;
        let whole = run(&[text]);
        let pieces: Vec<String> = text.chars().map(String::from).collect();
        let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
        let streamed = run(&refs);
        for (events, _) in [&whole, &streamed] {
            assert_eq!(events.first(), Some(&ToolEvent::Start { index: 0, name: "get_weather".into() }));
            assert_eq!(arguments(events), r#"{"city": "Paris", "days": [1, 2]}"#);
            assert_eq!(events.last(), Some(&ToolEvent::End { index: 0 }));
        }
        assert_eq!(whole.1.as_deref(), Some(" tail"));
        assert!(streamed.0.iter().filter(|e| matches!(e, ToolEvent::Arguments { .. })).count() > 5);
    }

    #[test]
    fn arguments_before_the_name_and_as_a_string() {
        let (events, _) = run(&[r#"{"arguments": {"a": "}"}, "name": "f"}"#]);
        assert_eq!(arguments(&events), r#"{"a": "}"}"#);
        let (events, _) = run(&[r#"{"name": "f", "arguments": "{\"a\": 1}"}"#]);
        assert_eq!(arguments(&events), r#"{"a": 1}"#);
        let (events, _) = run(&[r#"{"name": "f", "parameters": {}}"#]);
        assert_eq!(arguments(&events), "{}");
        let (events, _) = run(&[r#"{"name": "f"}"#]);
        assert_eq!(arguments(&events), "{}");
    }

    #[test]
    fn markers_are_held_back_until_they_can_be_told_apart() {
        let mut buf = "hello <tool".to_string();
        assert_eq!(take_until(&mut buf, &["<tool_call>"], false), ("hello ".into(), None));
        buf.push_str("_call>{");
        assert_eq!(take_until(&mut buf, &["<tool_call>"], false), (String::new(), Some(0)));
        assert_eq!(buf, "{");
        let mut buf = "a <b".to_string();
        assert_eq!(take_until(&mut buf, &["<tool_call>"], true), ("a <b".into(), None));
    }
}
