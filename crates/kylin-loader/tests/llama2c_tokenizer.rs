//! llama2.c's `tokenizer.bin`: the tokenizer built from it encodes as llama2.c's own `encode`
//! does, decodes back to the input, and broken files get their codes.

#[path = "support/llama2c.rs"]
mod support;

use std::path::Path;

use kylin_loader::ErrorCode;
use kylin_loader::llama2c::tokenizer::{Vocab, build, parse_vocab, to_bytes};

fn tokenizer(vocab: &Vocab) -> kylin_loader::TokenizerBundle {
    let bytes = to_bytes(vocab);
    let mut warnings = Vec::new();
    let parsed = parse_vocab(Path::new("tokenizer.bin"), &bytes, vocab.pieces.len(), false, &mut warnings).unwrap();
    assert_eq!(&parsed, vocab);
    let bundle = build(Path::new("tokenizer.bin"), &parsed, &mut warnings).unwrap();
    assert!(warnings.is_empty(), "{warnings:?}");
    bundle
}

/// Lines of prose and code, plus text outside the vocabulary (byte fallback) and edge cases.
fn samples() -> Vec<String> {
    let mut out: Vec<String> = support::corpus().lines().filter(|l| !l.trim().is_empty()).map(str::to_string).collect();
    out.extend(
        [
            "",
            " ",
            "   leading spaces",
            "trailing spaces   ",
            "tabs\tand\nnewlines\n\n",
            "héllo wörld, 世界 🦀 ∑",
            "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
            "          indented code:    return self._x",
            "<s> looks special </s>",
        ]
        .map(str::to_string),
    );
    out
}

#[test]
fn encodes_as_llama2c_encode_and_round_trips() {
    let vocab = support::train_vocab(1024);
    let bundle = tokenizer(&vocab);
    assert_eq!(bundle.vocab_size, 1024);
    assert_eq!(bundle.bos_token.as_ref().map(|t| (t.content.as_str(), t.id)), Some(("<s>", 1)));
    assert_eq!(bundle.eos_token.as_ref().map(|t| (t.content.as_str(), t.id)), Some(("</s>", 2)));
    assert_eq!(bundle.unk_token.as_ref().map(|t| t.id), Some(0));
    assert!(bundle.add_bos_token, "llama2.c's run.c starts every prompt with BOS");
    let tok = &bundle.tokenizer;
    let (mut same, mut total) = (0, 0);
    for text in samples() {
        // "<s>" typed in text is the BOS token for a Hugging Face tokenizer, not for llama2.c;
        // the text around it gets its own dummy-prefix space, as in transformers' Llama tokenizer.
        let special = text.contains("<s>");
        let ids = tok.encode(text.as_str(), false).unwrap().get_ids().to_vec();
        if !special {
            total += 1;
            let want = support::reference_encode(&vocab, &text, false);
            if ids == want {
                same += 1;
            } else {
                eprintln!("differs from llama2.c's encode: {text:?}\n  ours {ids:?}\n  llama2.c {want:?}");
            }
        }
        if !special {
            let back = tok.decode(&ids, false).unwrap();
            assert_eq!(back, text, "round trip of {text:?} through {ids:?}");
        }
    }
    // BPE ranks two overlapping pairs that form the same token, where llama2.c takes the leftmost;
    // nothing in these texts should hit that.
    assert_eq!(same, total, "{same} of {total} texts tokenized as llama2.c's encode does");
}

#[test]
fn special_tokens_decode_or_skip_as_sentencepiece_does() {
    let vocab = support::train_vocab(600);
    let bundle = tokenizer(&vocab);
    let tok = &bundle.tokenizer;
    let mut ids = vec![1];
    ids.extend(tok.encode("Hello world", false).unwrap().get_ids());
    ids.push(2);
    assert_eq!(tok.decode(&ids, true).unwrap(), "Hello world");
    assert_eq!(tok.decode(&ids, false).unwrap(), "<s> Hello world</s>");
}

#[test]
fn broken_tokenizer_files_get_their_codes() {
    let vocab = support::train_vocab(600);
    let bytes = to_bytes(&vocab);
    let path = Path::new("tokenizer.bin");
    let parse = |b: &[u8], n: usize| parse_vocab(path, b, n, false, &mut Vec::new());

    let err = parse(&bytes[..2], 600).unwrap_err();
    assert_eq!(err.code, ErrorCode::FileCorrupted, "{err}");
    let err = parse(&bytes[..bytes.len() - 1], 600).unwrap_err();
    assert_eq!(err.code, ErrorCode::FileCorrupted, "{err}");
    assert!(err.message.contains("beyond the end of the file"), "{err}");
    // A model with a huge vocab_size and a small file: an error, never a huge allocation.
    let err = parse(&bytes, usize::MAX / 2).unwrap_err();
    assert_eq!(err.code, ErrorCode::FileCorrupted, "{err}");
    assert!(err.message.contains("ends after 600 tokens"), "{err}");

    // A tokenizer of another model (more tokens than this model's vocabulary).
    let err = parse(&bytes, 512).unwrap_err();
    assert_eq!(err.code, ErrorCode::VocabMismatch, "{err}");
    let mut warnings = Vec::new();
    let first = parse_vocab(path, &bytes, 512, true, &mut warnings).unwrap();
    assert_eq!(first.pieces.len(), 512);
    assert_eq!(warnings.len(), 1);

    let mut bad = vocab.clone();
    bad.pieces[300] = vec![0xff, 0xfe];
    let err = build(path, &bad, &mut Vec::new()).unwrap_err();
    assert_eq!(err.code, ErrorCode::ConfigInvalid, "{err}");
    assert!(err.message.contains("token 300"), "{err}");

    let mut negative = bytes.clone();
    negative[8..12].copy_from_slice(&(-5i32).to_le_bytes());
    let err = parse(&negative, 600).unwrap_err();
    assert_eq!(err.code, ErrorCode::FileCorrupted, "{err}");
    assert!(err.message.contains("token 0 has length -5"), "{err}");
}
