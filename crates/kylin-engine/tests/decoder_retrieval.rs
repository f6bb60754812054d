//! Decoder embedders and rerankers against sentence-transformers and transformers, on the
//! fixtures of `scripts/make_decoder_retrieval_fixtures.py` (`tests/fixtures/retrieval`):
//! a Qwen3-Embedding-shaped directory (sentence-transformers' last-token pooling, the bare
//! `Qwen3Model` weights without a head) and a Qwen3-Reranker-shaped one (a causal LM scored by
//! `P(yes)` after the model card's prompt).
//!
//! The ids must be the reference's exactly; embeddings within 1e-4 element-wise (cosine at
//! least 0.9999), scores within 1e-4. Both run in the batching engine with chat traffic:
//! neither the embeddings nor the other request's tokens may change.

mod support;

use support::{cosine, floats};

use std::path::{Path, PathBuf};

use kylin_engine::batch::{BatchEngine, EngineOptions};
use kylin_engine::{EventKind, Serving};
use kylin_loader::task::{ModelTask, TaskChoice};
use kylin_loader::{ErrorCode, LoadOptions};
use serde_json::Value;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/retrieval");

fn fixture(name: &str) -> PathBuf {
    Path::new(FIXTURES).join("fixtures").join(name)
}

fn reference(name: &str) -> Value {
    let path = Path::new(FIXTURES).join("reference").join(format!("{name}.json"));
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn engine(name: &str, task: TaskChoice) -> BatchEngine {
    let opts = LoadOptions { task, ..LoadOptions::default() };
    let model = kylin_loader::load(&fixture(name), &opts).unwrap_or_else(|e| panic!("{name}: {e}"));
    BatchEngine::new(
        model,
        &EngineOptions { threads: 2, ctx_size: Some(256), max_batch_tokens: 96, ..Default::default() },
    )
    .unwrap()
}

fn assert_close(name: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{name}: width");
    let diff = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(diff <= 1e-4, "{name}: max |diff| {diff}");
    assert!(cosine(got, want) >= 0.9999, "{name}: cosine {}", cosine(got, want));
}

#[test]
fn qwen3_embedding_layout_matches_sentence_transformers() {
    let reference = reference("tiny-qwen3-embedding");
    let model = kylin_loader::load(&fixture("tiny-qwen3-embedding"), &LoadOptions::default()).unwrap();
    let ModelTask::Embed(task) = &model.task else { panic!("modules.json makes an embedder: {:?}", model.task) };
    assert!(task.normalize);
    assert!(model.warnings.iter().any(|w| w.contains("no lm_head.weight")), "{:?}", model.warnings);
    let mut engine = engine("tiny-qwen3-embedding", TaskChoice::Auto);
    let info = engine.embedding_info().expect("an embedder");
    assert_eq!((info.dimension, info.pooling.as_str(), info.normalized), (32, "last_token", true));

    let texts: Vec<&str> = reference["texts"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    let mut inputs = Vec::new();
    for (i, text) in texts.iter().enumerate() {
        let ids = engine.tokenize(text, true).unwrap();
        assert_eq!(ids, support::ids(&reference["input_ids"][i]), "ids of text {i} (the tokenizer appends its EOS)");
        inputs.push(ids);
    }
    let got = engine.embed(&inputs).unwrap();
    for (i, (g, want)) in got.iter().zip(reference["embeddings"].as_array().unwrap()).enumerate() {
        assert_close(&format!("text {i}"), g, &floats(want));
    }

    // The query through its named prompt, as `encode(prompt_name="query")` does.
    let prompt = &info.prompts["query"];
    let query = engine.tokenize(&format!("{prompt}{}", reference["query"].as_str().unwrap()), true).unwrap();
    assert_eq!(query, support::ids(&reference["query_input_ids"]));
    let got = engine.embed(&[query]).unwrap();
    assert_close("query", &got[0], &floats(&reference["query_embedding"]));

    // One at a time, again (now from the prefix cache) and in another order: the same bits.
    let again: Vec<Vec<f32>> =
        inputs.iter().rev().map(|ids| engine.embed(std::slice::from_ref(ids)).unwrap().remove(0)).collect();
    let batched = engine.embed(&inputs).unwrap();
    for (i, v) in again.iter().rev().enumerate() {
        assert_eq!(v, &batched[i], "text {i}: alone vs in a batch");
    }
}

#[test]
fn qwen3_reranker_matches_the_model_card_scoring() {
    let reference = reference("tiny-qwen3-reranker");
    let model = kylin_loader::load(&fixture("tiny-qwen3-reranker"), &LoadOptions::default()).unwrap();
    let ModelTask::Rerank(task) = &model.task else { panic!("the README makes a reranker: {:?}", model.task) };
    assert_eq!(
        (task.yes_id, task.no_id),
        (reference["yes_id"].as_u64().unwrap() as u32, reference["no_id"].as_u64().unwrap() as u32)
    );
    let mut engine = engine("tiny-qwen3-reranker", TaskChoice::Auto);
    assert!(engine.can_rerank());
    let query = reference["query"].as_str().unwrap();
    let documents: Vec<String> =
        reference["documents"].as_array().unwrap().iter().map(|d| d.as_str().unwrap().to_string()).collect();
    let text = engine.core().text().unwrap();
    for (i, doc) in documents.iter().enumerate() {
        let ids = kylin_engine::retrieval::yes_no_prompt(text, query, doc, None).unwrap();
        assert_eq!(ids, support::ids(&reference["input_ids"][i]), "prompt of document {i}");
    }
    let (scores, tokens) = engine.rerank(query, &documents, None).unwrap();
    let total: usize = reference["input_ids"].as_array().unwrap().iter().map(|v| v.as_array().unwrap().len()).sum();
    assert_eq!(tokens, total);
    for (i, (got, want)) in scores.iter().zip(reference["scores"].as_array().unwrap()).enumerate() {
        let want = want.as_f64().unwrap() as f32;
        assert!((got - want).abs() <= 1e-4, "document {i}: {got} vs {want}");
    }
    // The task instruction is the request's when it gives one.
    let custom = reference["custom_instruction"].as_str().unwrap();
    let (scores, _) = engine.rerank(query, &documents, Some(custom)).unwrap();
    for (i, (got, want)) in scores.iter().zip(reference["custom_scores"].as_array().unwrap()).enumerate() {
        let want = want.as_f64().unwrap() as f32;
        assert!((got - want).abs() <= 1e-4, "document {i} with the custom instruction: {got} vs {want}");
    }
    // A reranker is still a language model: it generates.
    let mut events = Vec::new();
    engine.add_request(support::request(1, vec![5, 6, 7], 3)).unwrap();
    while engine.has_work() {
        engine.step(&mut events).unwrap();
    }
    assert!(events.iter().any(|e| matches!(e.kind, EventKind::Finished { .. })));
}

/// Embedding while a chat request decodes: both share steps, and neither changes.
#[test]
fn embeddings_batch_with_generation_and_change_nothing() {
    // The reranker's decoder as an embedder (--task embed) and as a generator.
    let mut alone = engine("tiny-qwen3-reranker", TaskChoice::Generate);
    let prompt = support::prompt(40, 7, 300);
    let mut solo = Vec::new();
    alone.add_request(support::request(1, prompt.clone(), 24)).unwrap();
    while alone.has_work() {
        alone.step(&mut solo).unwrap();
    }

    let mut engine = engine("tiny-qwen3-reranker", TaskChoice::Embed);
    let inputs: Vec<Vec<u32>> = (0..6).map(|i| support::prompt(20 + 9 * i, 100 + i as u64, 300)).collect();
    let quiet = engine.embed(&inputs).unwrap();
    for v in &quiet {
        let norm: f32 = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "--task embed normalises: {norm}");
    }
    // `--task embed` makes an embedder: it refuses to generate.
    let err = engine.add_request(support::request(9, prompt.clone(), 4)).unwrap_err();
    assert_eq!(err.code, ErrorCode::InputInvalid);

    let mut busy = self::engine("tiny-qwen3-reranker", TaskChoice::Auto);
    let mut events = Vec::new();
    busy.add_request(support::request(1, prompt, 24)).unwrap();
    busy.step(&mut events).unwrap();
    busy.step(&mut events).unwrap();
    // The reranker scores in the middle of the generation: its steps carry the other request.
    let query = "Where does the cat sit?";
    let docs = vec!["The cat sits on the mat.".to_string(), "Paris is the capital of France.".to_string()];
    let (mid, _) = busy.rerank(query, &docs, None).unwrap();
    while busy.has_work() {
        busy.step(&mut events).unwrap();
    }
    assert_eq!(events, solo, "the generation is the same with pooled requests beside it");
    let mut fresh = self::engine("tiny-qwen3-reranker", TaskChoice::Auto);
    assert_eq!(fresh.rerank(query, &docs, None).unwrap().0, mid, "scores are the same with a generation beside them");
}

#[test]
fn decoder_embedder_files_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixture("tiny-qwen3-embedding");
    copy_dir(&src, dir.path());
    // Generating from a head-less directory: the missing head is named.
    let opts = LoadOptions { task: TaskChoice::Generate, ..LoadOptions::default() };
    let err = kylin_loader::load(dir.path(), &opts).unwrap_err();
    assert_eq!(err.code, ErrorCode::TensorMissing, "{err}");
    assert!(err.message.contains("lm_head.weight"), "{err}");
    // Mean pooling over a causal decoder is refused, naming the file.
    std::fs::write(
        dir.path().join("1_Pooling/config.json"),
        r#"{"word_embedding_dimension": 32, "pooling_mode": "mean"}"#,
    )
    .unwrap();
    let err = kylin_loader::load(dir.path(), &LoadOptions::default()).unwrap_err();
    assert_eq!(err.code, ErrorCode::OperatorUnsupported, "{err}");
    assert!(
        err.message.contains("`mean`") && err.path.as_deref().is_some_and(|p| p.ends_with("modules.json")),
        "{err}"
    );

    // A reranker whose tokenizer has no `no` token.
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&fixture("tiny-qwen3-reranker"), dir.path());
    let path = dir.path().join("tokenizer.json");
    let mut tok: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    // `no` leaves the vocabulary, with the merges that make or use it.
    let id = tok["model"]["vocab"].as_object_mut().unwrap().remove("no").unwrap();
    tok["model"]["vocab"].as_object_mut().unwrap().insert("n_o".into(), id);
    let parts = |m: &Value| -> Vec<String> {
        match m {
            Value::String(s) => s.split(' ').map(str::to_string).collect(),
            other => other.as_array().unwrap().iter().map(|p| p.as_str().unwrap().to_string()).collect(),
        }
    };
    tok["model"]["merges"].as_array_mut().unwrap().retain(|m| {
        let p = parts(m);
        p.concat() != "no" && !p.iter().any(|x| x == "no")
    });
    std::fs::write(&path, serde_json::to_string(&tok).unwrap()).unwrap();
    let err = kylin_loader::load(dir.path(), &LoadOptions::default()).unwrap_err();
    assert_eq!(err.code, ErrorCode::ConfigInvalid, "{err}");
    assert!(err.message.contains("no token `no`"), "{err}");
}

fn copy_dir(src: &Path, dst: &Path) {
    for entry in std::fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        let to = dst.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            std::fs::create_dir_all(&to).unwrap();
            copy_dir(&entry.path(), &to);
        } else {
            std::fs::copy(entry.path(), to).unwrap();
        }
    }
}
