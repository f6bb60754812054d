//! The cost of constrained decoding per engine step: the same decode steps with 1 and 8
//! sequences, unconstrained and under a JSON schema, on a real model.
//!
//! ```text
//! cargo run --release -p kylin-engine --example grammar_overhead -- ~/.cache/kylin-models/qwen2.5-coder-0.5b-instruct [threads]
//! ```
//!
//! Each case admits its sequences, lets their prompts finish, then times `STEPS` decode steps
//! (every sequence decoding, EOS ignored) and reports the median step. The schema cannot be
//! complete within the steps (an array of at least 1000 strings), so every constrained step
//! computes a mask for every sequence; the masks are computed on their own thread while the
//! forward pass runs. The mask computation alone is timed on the same schema for reference.

use std::path::PathBuf;
use std::time::Instant;

use kylin_engine::batch::{BatchEngine, EngineOptions};
use kylin_engine::grammar::GrammarSpec;
use kylin_engine::serving::{Event, Request, Serving};
use kylin_engine::text::TextCodec;
use serde_json::json;

const STEPS: usize = 40;
const ROUNDS: usize = 3;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let Some(model) = args.next().map(PathBuf::from) else {
        eprintln!("usage: grammar_overhead MODEL_DIR [threads]");
        std::process::exit(2);
    };
    let threads: usize = args.next().and_then(|t| t.parse().ok()).unwrap_or(2);
    let loaded = kylin_loader::load(&model, &Default::default()).unwrap_or_else(|e| panic!("{e}"));
    let opts = EngineOptions { threads, max_seqs: 8, ctx_size: Some(1024), ..EngineOptions::default() };
    let mut engine = BatchEngine::new(loaded, &opts).unwrap_or_else(|e| panic!("{e}"));
    let schema = json!({"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1000});
    let compiler = engine.grammar_compiler().unwrap_or_else(|e| panic!("{e}"));
    let grammar = compiler.compile(&GrammarSpec::JsonSchema(schema)).unwrap_or_else(|e| panic!("{e}"));

    // The mask alone: advance a state along a valid output and time each mask.
    let codec: &TextCodec = engine.core().text().unwrap_or_else(|e| panic!("{e}"));
    let mut state = grammar.start();
    let mut mask_us = Vec::new();
    let ids =
        codec.tokenize(r#"["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta""#, false).unwrap();
    let mut scratch = vec![0f32; engine.info().vocab_size];
    for &id in &ids {
        if state.forced() == Some(id) {
            state.commit(id).unwrap();
            continue;
        }
        let t = Instant::now();
        state.prepare().unwrap();
        mask_us.push(t.elapsed().as_secs_f64() * 1e6);
        state.apply(&mut scratch).unwrap();
        state.commit(id).unwrap();
    }
    println!(
        "model {}, {} threads, vocab {}: one mask {:.0} us (median of {})",
        model.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        threads,
        engine.info().vocab_size,
        median(mask_us.clone()),
        mask_us.len()
    );

    let prompt = codec.tokenize("List some words as a JSON array of strings:", true).unwrap();
    let mut next_id = 1;
    let mut results = Vec::new();
    for seqs in [1usize, 8] {
        let mut per_case = [Vec::new(), Vec::new()];
        for _round in 0..ROUNDS {
            for (case, constrained) in [false, true].into_iter().enumerate() {
                for s in 0..seqs {
                    let mut r = Request::new(next_id, prompt.clone(), STEPS + 8);
                    next_id += 1;
                    r.ignore_eos = true;
                    // Different prompts per sequence: no shared prefix blocks across cases.
                    r.prompt_ids.push(100 + s as u32);
                    if constrained {
                        r.grammar = Some(grammar.clone());
                    }
                    engine.add_request(r).unwrap();
                }
                let mut events: Vec<Event> = Vec::new();
                // Prefill and the first tokens, untimed.
                for _ in 0..4 {
                    engine.step(&mut events).unwrap();
                }
                let mut times = Vec::with_capacity(STEPS);
                for _ in 0..STEPS {
                    events.clear();
                    let t = Instant::now();
                    engine.step(&mut events).unwrap();
                    times.push(t.elapsed().as_secs_f64() * 1e3);
                }
                while engine.has_work() {
                    engine.step(&mut events).unwrap();
                }
                per_case[case].push(median(times));
            }
        }
        let plain = median(per_case[0].clone());
        let constrained = median(per_case[1].clone());
        results.push((seqs, plain, constrained));
    }
    for (seqs, plain, constrained) in results {
        println!(
            "{seqs} sequence(s): unconstrained {plain:.2} ms/step, JSON schema {constrained:.2} ms/step ({:+.1}%)",
            (constrained / plain - 1.0) * 100.0
        );
    }
}
