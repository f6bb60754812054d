//! Streaming detokenization: text released token by token, never a broken UTF-8 character,
//! and never text that a stop string might still claim.
//!
//! [`StreamDecoder`] follows the incremental scheme of Hugging Face's text-generation-inference:
//! it decodes a short window of recent ids twice (with and without the newest ones) and releases
//! only the difference, and only once that difference does not end in an incomplete character
//! (`U+FFFD`, which byte-level BPE decoders produce for a partial UTF-8 sequence). Decoding the
//! window instead of the single new id keeps tokenizers that drop or add a leading space per
//! piece (SentencePiece's `▁`) correct.
//!
//! [`StopMatcher`] holds back the end of the released text while it could still be the start of
//! a stop string, so a stop string is never printed, even partly.

use kylin_loader::Result;

use crate::backend::Backend;
use crate::text::TextCodec;

/// Anything that turns ids into text: a [`Backend`] or a [`TextCodec`].
pub trait Detokenize {
    fn detokenize(&self, ids: &[u32], skip_special: bool) -> Result<String>;
}

impl<T: Backend + ?Sized> Detokenize for T {
    fn detokenize(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        Backend::detokenize(self, ids, skip_special)
    }
}

impl Detokenize for TextCodec {
    fn detokenize(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        TextCodec::detokenize(self, ids, skip_special)
    }
}

/// Turns a stream of ids into a stream of complete text pieces.
#[derive(Debug, Default, Clone)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    /// Start of the window decoded for context.
    prefix_offset: usize,
    /// Ids before this one have been released as text.
    read_offset: usize,
    skip_special: bool,
}

impl StreamDecoder {
    /// A decoder; `skip_special` drops special tokens from the text, as HF's
    /// `decode(..., skip_special_tokens=True)`.
    pub fn new(skip_special: bool) -> Self {
        StreamDecoder { skip_special, ..Default::default() }
    }

    /// Adds one id; returns the text it completes (possibly empty).
    pub fn push<D: Detokenize + ?Sized>(&mut self, backend: &D, id: u32) -> Result<String> {
        self.ids.push(id);
        let prefix = backend.detokenize(&self.ids[self.prefix_offset..self.read_offset], self.skip_special)?;
        let full = backend.detokenize(&self.ids[self.prefix_offset..], self.skip_special)?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') && full.is_char_boundary(prefix.len()) {
            let piece = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            Ok(piece)
        } else {
            Ok(String::new())
        }
    }

    /// Whatever is still held back (an incomplete character at the very end), decoded as is.
    pub fn flush<D: Detokenize + ?Sized>(&mut self, backend: &D) -> Result<String> {
        if self.read_offset == self.ids.len() {
            return Ok(String::new());
        }
        let prefix = backend.detokenize(&self.ids[self.prefix_offset..self.read_offset], self.skip_special)?;
        let full = backend.detokenize(&self.ids[self.prefix_offset..], self.skip_special)?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(full.get(prefix.len()..).unwrap_or_default().to_string())
    }
}

/// Finds stop strings in streamed text and decides what can be released.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not yet released, because it may begin a stop string.
    pending: String,
}

/// What [`StopMatcher::push`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopOutcome {
    /// Release this text and go on.
    Continue(String),
    /// A stop string was found: release this text (everything before it) and stop.
    Stopped(String),
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> Self {
        StopMatcher { stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(), pending: String::new() }
    }

    /// Adds streamed text.
    pub fn push(&mut self, text: &str) -> StopOutcome {
        if self.stops.is_empty() {
            return StopOutcome::Continue(text.to_string());
        }
        self.pending.push_str(text);
        // The earliest complete stop string ends generation; the text before it is released.
        if let Some(at) = self.stops.iter().filter_map(|s| self.pending.find(s.as_str())).min() {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return StopOutcome::Stopped(out);
        }
        // Hold back the longest tail of `pending` that is a prefix of some stop string.
        let mut keep_from = self.pending.len();
        for (i, _) in self.pending.char_indices().rev() {
            let tail = &self.pending[i..];
            if self.stops.iter().any(|s| s.starts_with(tail)) {
                keep_from = i;
            }
            if self.pending.len() - i >= self.stops.iter().map(String::len).max().unwrap_or(0) {
                break;
            }
        }
        let out = self.pending[..keep_from].to_string();
        self.pending.drain(..keep_from);
        StopOutcome::Continue(out)
    }

    /// Releases what was held back (generation ended for another reason).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_string_across_pieces_is_never_released() {
        let mut m = StopMatcher::new(&["</end>".to_string()]);
        assert_eq!(m.push("Hello </"), StopOutcome::Continue("Hello ".into()));
        assert_eq!(m.push("en"), StopOutcome::Continue(String::new()));
        assert_eq!(m.push("d> more"), StopOutcome::Stopped("".into()));
    }

    #[test]
    fn false_start_is_released_later() {
        let mut m = StopMatcher::new(&["STOP".to_string()]);
        assert_eq!(m.push("a ST"), StopOutcome::Continue("a ".into()));
        assert_eq!(m.push("AR"), StopOutcome::Continue("STAR".into()));
        assert_eq!(m.push("x S"), StopOutcome::Continue("x ".into()));
        assert_eq!(m.finish(), "S");
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        let mut m = StopMatcher::new(&["b".to_string(), "a".to_string()]);
        assert_eq!(m.push("xxab"), StopOutcome::Stopped("xx".into()));
    }

    #[test]
    fn no_stops_passes_text_through() {
        let mut m = StopMatcher::new(&[]);
        assert_eq!(m.push("é"), StopOutcome::Continue("é".into()));
    }
}
