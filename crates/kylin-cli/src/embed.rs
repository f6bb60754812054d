//! `kylin embed`: embeddings of texts on the command line, or their throughput (`--bench`).
//!
//! Texts come from `--text` (repeatable) and `--file` (one per line). Each is tokenized with
//! the model's tokenizer (its special tokens added), prefixed with `--prompt-name`'s prompt,
//! embedded in batches of `--batch` with the directory's pooling and normalisation, and printed
//! as one JSON line `{"index", "text", "embedding"}` (or one object with `--json`). `--bench`
//! prints texts per second instead (the figure BENCHMARKS.md compares with llama.cpp).

use std::io::BufRead;
use std::time::Instant;

use anyhow::Result;
use kylin_engine::Serving;
use kylin_loader::KylinError;
use serde_json::json;

use crate::args::EmbedArgs;
use crate::open::{open_encoder, threads};

pub fn run(args: EmbedArgs) -> Result<()> {
    let mut texts = args.texts.clone();
    if let Some(file) = &args.file {
        let reader: Box<dyn BufRead> = if file.as_os_str() == "-" {
            Box::new(std::io::stdin().lock())
        } else {
            let f = std::fs::File::open(file).map_err(|e| KylinError::io(file, "cannot read", &e))?;
            Box::new(std::io::BufReader::new(f))
        };
        for line in reader.lines() {
            let line = line.map_err(|e| KylinError::io(file, "cannot read", &e))?;
            if !line.is_empty() {
                texts.push(line);
            }
        }
    }
    if texts.is_empty() {
        return Err(KylinError::input_invalid("give texts with --text or --file").into());
    }
    if !kylin_loader::encoder::is_encoder_dir(&args.model.model) {
        return Err(KylinError::input_invalid(format!(
            "{} is not an embedding model Kylin runs (a BERT, RoBERTa or XLM-RoBERTa directory)",
            args.model.model.display()
        ))
        .into());
    }
    let threads = threads(&args.model)?;
    let mut engine = open_encoder(&args.model, threads)?;
    let info =
        engine.embedding_info().ok_or_else(|| KylinError::input_invalid("this model does not make embeddings"))?;
    let prefix = match &args.prompt_name {
        None => String::new(),
        Some(name) => info
            .prompts
            .get(name)
            .cloned()
            .ok_or_else(|| KylinError::input_invalid(format!("the model has no prompt named `{name}`")))?,
    };
    if let Some(d) = args.dimensions
        && (d == 0 || d > info.dimension)
    {
        return Err(KylinError::input_invalid(format!(
            "--dimensions must be between 1 and the model's {}; got {d}",
            info.dimension
        ))
        .into());
    }
    let inputs: Vec<Vec<u32>> =
        texts.iter().map(|t| engine.tokenize(&format!("{prefix}{t}"), true)).collect::<Result<_, _>>()?;
    let batch = args.batch.max(1);
    let embed_all = |engine: &mut kylin_engine::encoder_serving::EncoderEngine| -> Result<Vec<Vec<f32>>> {
        let mut out = Vec::with_capacity(inputs.len());
        for chunk in inputs.chunks(batch) {
            out.extend(engine.embed(chunk)?);
        }
        Ok(out)
    };
    if args.bench {
        let tokens: usize = inputs.iter().map(Vec::len).sum();
        embed_all(&mut engine)?;
        let mut best = f64::INFINITY;
        let mut all = Vec::new();
        for _ in 0..args.repetitions.max(1) {
            let started = Instant::now();
            embed_all(&mut engine)?;
            let s = started.elapsed().as_secs_f64();
            best = best.min(s);
            all.push(texts.len() as f64 / s);
        }
        let rate = texts.len() as f64 / best;
        if args.json {
            println!(
                "{}",
                json!({"texts": texts.len(), "tokens": tokens, "batch": batch, "threads": threads,
                       "texts_per_second": rate, "tokens_per_second": tokens as f64 / best, "runs": all})
            );
        } else {
            println!(
                "kylin embed: {} texts ({tokens} tokens) in batches of {batch}, {threads} threads: {rate:.1} texts/s ({:.0} tokens/s), best of {}",
                texts.len(),
                tokens as f64 / best,
                args.repetitions.max(1)
            );
        }
        return Ok(());
    }
    let mut vectors = embed_all(&mut engine)?;
    if let Some(d) = args.dimensions {
        for v in &mut vectors {
            v.truncate(d);
            if info.normalized {
                kylin_engine::encoder::normalize_in_place(v);
            }
        }
    }
    if args.json {
        println!(
            "{}",
            json!({"model": args.model.model, "dimension": vectors.first().map_or(0, Vec::len), "pooling": info.pooling,
                   "normalized": info.normalized, "embeddings": vectors})
        );
    } else {
        for (i, (text, v)) in texts.iter().zip(&vectors).enumerate() {
            println!("{}", json!({"index": i, "text": text, "embedding": v}));
        }
    }
    Ok(())
}
