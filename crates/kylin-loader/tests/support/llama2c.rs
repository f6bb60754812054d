//! Test material for llama2.c checkpoints, shared by the loader's and the engine's tests: Llama
//! fixtures the format can hold, a SentencePiece-style `tokenizer.bin` vocabulary trained here,
//! and llama2.c's own `encode` as the reference.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use kylin_loader::llama2c::tokenizer::Vocab;

pub const SHARED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata");

pub fn shared(rel: &str) -> PathBuf {
    Path::new(SHARED).join(rel)
}

/// A copy of `tiny-llama-rope3` (a Llama with GQA and an untied head) whose config the format
/// can hold: unscaled RoPE with base `theta`, and the head tied to the embedding when `tied`
/// (the stored `lm_head.weight` is then ignored, as transformers does).
pub fn llama_fixture(theta: f64, tied: bool) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().expect("temp dir");
    let src = shared("fixtures/tiny-llama-rope3");
    for entry in std::fs::read_dir(&src).expect("fixture dir") {
        let entry = entry.expect("dir entry");
        std::fs::copy(entry.path(), tmp.path().join(entry.file_name())).expect("copy fixture file");
    }
    let path = tmp.path().join("config.json");
    let mut config: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    config["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": theta});
    config["tie_word_embeddings"] = serde_json::json!(tied);
    std::fs::write(&path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
    tmp
}

/// Text to train and test on: the shared evaluation texts.
pub fn corpus() -> String {
    let mut text = std::fs::read_to_string(shared("data/gpl-3.0.txt")).expect("gpl-3.0.txt");
    text.push_str(&std::fs::read_to_string(shared("data/python-json-module.py")).expect("python-json-module.py"));
    text
}

/// A SentencePiece-style vocabulary of exactly `size` tokens, as llama2.c's `tokenizer.py`
/// writes one: `<unk>`, `\n<s>\n`, `\n</s>\n`, the 256 byte tokens `<0xXX>`, the characters of
/// the corpus's words, then BPE merges learned on space-prefixed words (SentencePiece's dummy
/// prefix), each scored by its rank so that earlier merges win.
pub fn train_vocab(size: usize) -> Vocab {
    let text = corpus();
    let mut pieces: Vec<String> = vec!["<unk>".into(), "\n<s>\n".into(), "\n</s>\n".into()];
    pieces.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
    let mut scores = vec![0.0f32; pieces.len()];
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for w in text.split_whitespace() {
        *counts.entry(format!(" {w}")).or_insert(0) += 1;
    }
    let mut chars: Vec<char> = counts.keys().flat_map(|w| w.chars()).collect();
    chars.sort_unstable();
    chars.dedup();
    let mut known: HashMap<String, u32> = HashMap::new();
    for c in chars {
        known.insert(c.to_string(), pieces.len() as u32);
        pieces.push(c.to_string());
        scores.push(-1e6);
    }
    // Words as token ids, with their counts.
    let mut words: Vec<(Vec<u32>, usize)> =
        counts.iter().map(|(w, &n)| (w.chars().map(|c| known[&c.to_string()]).collect(), n)).collect();
    let mut rank = 0;
    while pieces.len() < size {
        let mut pairs: HashMap<(u32, u32), usize> = HashMap::new();
        for (w, n) in &words {
            for p in w.windows(2) {
                *pairs.entry((p[0], p[1])).or_insert(0) += n;
            }
        }
        // The most frequent pair; ties by the smaller ids, so training is deterministic.
        let Some((&(a, b), _)) = pairs.iter().max_by(|x, y| x.1.cmp(y.1).then(y.0.cmp(x.0))) else { break };
        let merged = format!("{}{}", pieces[a as usize], pieces[b as usize]);
        let id = *known.entry(merged.clone()).or_insert_with(|| {
            pieces.push(merged);
            scores.push(-(rank as f32));
            rank += 1;
            pieces.len() as u32 - 1
        });
        for (w, _) in &mut words {
            let mut i = 0;
            while i + 1 < w.len() {
                if w[i] == a && w[i + 1] == b {
                    w[i] = id;
                    w.remove(i + 1);
                }
                i += 1;
            }
        }
    }
    assert_eq!(pieces.len(), size, "the corpus cannot fill a vocabulary of {size}");
    let max_token_length = pieces.iter().map(|p| p.len()).max().unwrap_or(0) as u32;
    Vocab { max_token_length, pieces: pieces.into_iter().map(String::into_bytes).collect(), scores }
}

/// llama2.c's `encode` (run.c), ported line by line: optional BOS, the dummy-prefix space,
/// characters (or their bytes + 3), then the best-scoring merge, leftmost on ties, until none.
pub fn reference_encode(vocab: &Vocab, text: &str, bos: bool) -> Vec<u32> {
    let lookup: HashMap<&[u8], u32> =
        vocab.pieces.iter().enumerate().rev().map(|(i, p)| (p.as_slice(), i as u32)).collect();
    let mut tokens: Vec<u32> = Vec::new();
    if bos {
        tokens.push(1);
    }
    if !text.is_empty() {
        tokens.push(lookup[b" ".as_slice()]);
    }
    for c in text.chars() {
        let mut buf = [0u8; 4];
        let s = c.encode_utf8(&mut buf);
        match lookup.get(s.as_bytes()) {
            Some(&id) => tokens.push(id),
            None => tokens.extend(s.bytes().map(|b| b as u32 + 3)),
        }
    }
    loop {
        let (mut best_score, mut best) = (-1e10f32, None);
        for i in 0..tokens.len().saturating_sub(1) {
            let mut merged = vocab.pieces[tokens[i] as usize].clone();
            merged.extend_from_slice(&vocab.pieces[tokens[i + 1] as usize]);
            if let Some(&id) = lookup.get(merged.as_slice())
                && vocab.scores[id as usize] > best_score
            {
                best_score = vocab.scores[id as usize];
                best = Some((i, id));
            }
        }
        let Some((i, id)) = best else { break };
        tokens[i] = id;
        tokens.remove(i + 1);
    }
    tokens
}
