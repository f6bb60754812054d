//! llama2.c's `tokenizer.bin`, turned into a `tokenizers` BPE model the engine uses like any other.
//!
//! The file (`tokenizer.py` in llama2.c writes it from a SentencePiece model): i32
//! `max_token_length`, then for each of the model's `vocab_size` tokens an f32 score, an i32
//! byte length and the bytes (SentencePiece's `▁` already turned into a space; ids 0, 1 and 2 are
//! `<unk>`, `\n<s>\n` and `\n</s>\n`; byte tokens are spelled `<0xXX>`). The file does not say how
//! many tokens it holds: the model's header does, and the file must hold exactly that many.
//!
//! llama2.c's `encode` prepends a space to non-empty text (SentencePiece's dummy prefix), looks up
//! every character (falling back to its UTF-8 bytes' `<0xXX>` tokens), then repeatedly merges the
//! adjacent pair whose concatenation is in the vocabulary with the highest score, leftmost first.
//! That is byte-fallback BPE with merges ranked by the score of their result, which is how this
//! module builds it: every split of a token into two tokens is a merge, ranked by the token's
//! score (ties by id, then split point). The one difference is llama2.c's positional tie-break
//! between two *different* overlapping pairs that form the same token (`a|aa|a`); BPE ranks the
//! two pairs instead. Both give tokens that decode to the input, so round trips are exact.
//! Decoding is SentencePiece's: byte tokens become bytes, and one leading space is dropped.
//! BOS (id 1) is added to prompts, as `run.c` does; id 2 is EOS.

use std::collections::HashMap;
use std::path::Path;

use crate::error::{KylinError, Result};
use crate::tokenizer::{SpecialToken, TokenizerBundle, TokenizerKind};

/// The parsed file: one piece and score per id.
#[derive(Debug, Clone, PartialEq)]
pub struct Vocab {
    pub max_token_length: u32,
    pub pieces: Vec<Vec<u8>>,
    pub scores: Vec<f32>,
}

/// Parses `tokenizer.bin` bytes holding exactly `vocab_size` tokens. Short or malformed files
/// are `FILE_CORRUPTED`; a file with more tokens than the model is `VOCAB_MISMATCH`, or with
/// `allow_more` a warning (the first `vocab_size` tokens are used, as llama2.c's `run.c` does).
/// The lists grow with the bytes actually read, never with `vocab_size` alone.
pub fn parse_vocab(
    path: &Path,
    bytes: &[u8],
    vocab_size: usize,
    allow_more: bool,
    warnings: &mut Vec<String>,
) -> Result<Vocab> {
    let corrupted = |what: String| {
        KylinError::file_corrupted(format!("{}: {what}; the llama2.c tokenizer file is damaged", path.display()))
            .at(path)
    };
    let i32_at = |at: usize| bytes.get(at..at + 4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    let max_token_length = i32_at(0).ok_or_else(|| {
        corrupted(format!("the file has {} bytes, fewer than the 4-byte max_token_length", bytes.len()))
    })?;
    let max_token_length = u32::try_from(max_token_length)
        .map_err(|_| corrupted(format!("max_token_length is {max_token_length}; it must not be negative")))?;
    // Every token takes at least 8 bytes (score and length).
    let room = vocab_size.min(bytes.len() / 8);
    let (mut pieces, mut scores) = (Vec::with_capacity(room), Vec::with_capacity(room));
    let mut at = 4;
    for id in 0..vocab_size {
        let (Some(score), Some(len)) = (i32_at(at), i32_at(at + 4)) else {
            return Err(corrupted(format!(
                "the file ends after {id} tokens, but the model's vocab_size is {vocab_size}"
            )));
        };
        let len = usize::try_from(len).map_err(|_| corrupted(format!("token {id} has length {len}")))?;
        let piece = bytes
            .get(at + 8..)
            .and_then(|rest| rest.get(..len))
            .ok_or_else(|| corrupted(format!("token {id} has length {len}, beyond the end of the file")))?;
        scores.push(f32::from_bits(score as u32));
        pieces.push(piece.to_vec());
        at += 8 + len;
    }
    if at != bytes.len() {
        let msg = format!(
            "{} has {} bytes after the model's {vocab_size} tokens: it holds a larger vocabulary than this \
             model's, so it probably belongs to another model",
            path.display(),
            bytes.len() - at
        );
        if !allow_more {
            return Err(KylinError::vocab_mismatch(format!(
                "{msg}; put the model's own tokenizer.bin beside it (or allow the mismatch explicitly)"
            ))
            .at(path));
        }
        warnings.push(format!("{msg}; only its first {vocab_size} tokens are used"));
    }
    Ok(Vocab { max_token_length, pieces, scores })
}

/// Whether a piece is a byte-fallback token, `<0xXX>`.
fn is_byte_piece(piece: &str) -> bool {
    let b = piece.as_bytes();
    b.len() == 6 && b.starts_with(b"<0x") && b[5] == b'>' && b[3..5].iter().all(u8::is_ascii_hexdigit)
}

/// The special tokens llama2.c fixes by id: 0 `<unk>`, 1 BOS, 2 EOS (written `\n<s>\n` and
/// `\n</s>\n` by `tokenizer.py`; the surrounding newlines are dropped here).
fn special_name(id: usize, piece: &str) -> Option<String> {
    let trimmed = piece.trim();
    match (id, trimmed) {
        (0, "<unk>") => Some(trimmed.to_string()),
        (1 | 2, _) => Some(if trimmed.is_empty() { ["<s>", "</s>"][id - 1].to_string() } else { trimmed.to_string() }),
        _ => None,
    }
}

/// Builds the tokenizer (see the module documentation). Pieces that are not UTF-8 are
/// `CONFIG_INVALID`; empty or repeated pieces cannot be looked up by text (nor by llama2.c's
/// `encode`) and are left out of the vocabulary, with a warning.
pub fn build(path: &Path, vocab: &Vocab, warnings: &mut Vec<String>) -> Result<TokenizerBundle> {
    use tokenizers::decoders::byte_fallback::ByteFallback;
    use tokenizers::decoders::fuse::Fuse;
    use tokenizers::decoders::sequence::Sequence;
    use tokenizers::decoders::strip::Strip;
    use tokenizers::models::bpe::BPE;
    use tokenizers::normalizers::prepend::Prepend;

    let mut texts: Vec<String> = Vec::with_capacity(vocab.pieces.len());
    for (id, piece) in vocab.pieces.iter().enumerate() {
        let text = String::from_utf8(piece.clone()).map_err(|_| {
            KylinError::config_invalid(format!(
                "{}: token {id} ({piece:?}) is not UTF-8; Kylin reads tokenizer.bin files written from \
                 SentencePiece models, whose pieces are text",
                path.display()
            ))
            .at(path)
        })?;
        texts.push(special_name(id, &text).unwrap_or(text));
    }
    let mut by_text: HashMap<String, u32> = HashMap::with_capacity(texts.len());
    let mut skipped = Vec::new();
    for (id, text) in texts.iter().enumerate() {
        if text.is_empty() || by_text.contains_key(text) {
            skipped.push(id);
        } else {
            by_text.insert(text.clone(), id as u32);
        }
    }
    if !skipped.is_empty() {
        let shown: Vec<String> = skipped.iter().take(10).map(|i| i.to_string()).collect();
        warnings.push(format!(
            "{}: {} tokens are empty or repeat an earlier token's text and can only be decoded as nothing \
             (ids {}{})",
            path.display(),
            skipped.len(),
            shown.join(", "),
            if skipped.len() > 10 { ", ..." } else { "" }
        ));
    }

    // Merges: every split of a mergeable token into two mergeable tokens, best score first.
    let mergeable = |id: u32| -> bool {
        let t = &texts[id as usize];
        special_name(id as usize, t).is_none() && !is_byte_piece(t)
    };
    let mut merges: Vec<(f32, u32, usize, u32, u32)> = Vec::new();
    for (text, &id) in &by_text {
        if !mergeable(id) {
            continue;
        }
        for (k, _) in text.char_indices().skip(1) {
            let (left, right) = (by_text.get(&text[..k]), by_text.get(&text[k..]));
            if let (Some(&l), Some(&r)) = (left, right)
                && mergeable(l)
                && mergeable(r)
            {
                merges.push((vocab.scores[id as usize], id, k, l, r));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let merges: Vec<(String, String)> =
        merges.iter().map(|m| (texts[m.3 as usize].clone(), texts[m.4 as usize].clone())).collect();

    let unk = texts.first().filter(|t| t.as_str() == "<unk>").cloned();
    let bpe_vocab: tokenizers::models::bpe::Vocab = by_text.iter().map(|(t, &id)| (t.clone(), id)).collect();
    let mut builder = BPE::builder().vocab_and_merges(bpe_vocab, merges).byte_fallback(true).fuse_unk(true);
    if let Some(u) = &unk {
        builder = builder.unk_token(u.clone());
    }
    let bpe = builder.build().map_err(|e| {
        KylinError::config_invalid(format!("{}: cannot build a BPE tokenizer from it: {e}", path.display())).at(path)
    })?;
    let mut tokenizer = tokenizers::Tokenizer::new(bpe);
    tokenizer
        .with_normalizer(Some(Prepend::new(" ".into())))
        .map_err(|e| KylinError::config_invalid(format!("{}: {e}", path.display())))?;
    tokenizer.with_decoder(Some(Sequence::new(vec![
        ByteFallback::new().into(),
        Fuse::new().into(),
        Strip::new(' ', 1, 0).into(),
    ])));

    let token = |id: usize| -> Option<SpecialToken> {
        let content = texts.get(id)?;
        (by_text.get(content) == Some(&(id as u32))).then(|| SpecialToken { content: content.clone(), id: id as u32 })
    };
    let unk_token = unk.as_ref().and_then(|_| token(0));
    let bos_token = token(1);
    let eos_token = token(2);
    let special_tokens: Vec<SpecialToken> =
        [&unk_token, &bos_token, &eos_token].into_iter().flatten().cloned().collect();
    tokenizer
        .add_special_tokens(
            special_tokens.iter().map(|t| tokenizers::AddedToken::from(t.content.clone(), true)).collect::<Vec<_>>(),
        )
        .map_err(|e| KylinError::config_invalid(format!("{}: {e}", path.display())))?;

    Ok(TokenizerBundle {
        tokenizer,
        kind: TokenizerKind::Llama2cBin,
        vocab_size: vocab.pieces.len(),
        bos_token,
        eos_token,
        pad_token: None,
        unk_token,
        add_bos_token: true,
        add_eos_token: false,
        special_tokens,
        chat_templates: Vec::new(),
    })
}

/// Writes a vocabulary as `tokenizer.bin` bytes (for tests and tools).
pub fn to_bytes(vocab: &Vocab) -> Vec<u8> {
    let mut out = (vocab.max_token_length as i32).to_le_bytes().to_vec();
    for (piece, score) in vocab.pieces.iter().zip(&vocab.scores) {
        out.extend_from_slice(&score.to_le_bytes());
        out.extend_from_slice(&(piece.len() as i32).to_le_bytes());
        out.extend_from_slice(piece);
    }
    out
}
