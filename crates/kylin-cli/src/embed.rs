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
use crate::open::{open_engine_sized, threads};

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
    let threads = threads(&args.model)?;
    let batch = args.batch.max(1);
    // An encoder directory runs on the encoder engine; a decoder embedder (Qwen3-Embedding, or
    // any decoder with --task embed) on the batching engine, sized to one batch of these texts.
    let mut model_args = args.model.clone();
    if model_args.ctx_size.is_none() && !kylin_loader::encoder::is_encoder_dir(&model_args.model) {
        model_args.ctx_size = decoder_context(&model_args.model, &texts, args.prompt_name.as_deref());
    }
    let mut engine = open_engine_sized(&model_args, batch, false)?;
    let info = engine.embedding_info().ok_or_else(|| {
        KylinError::input_invalid(format!(
            "{} does not make embeddings (an embedding model is a BERT, RoBERTa or XLM-RoBERTa directory, a decoder \
             with sentence-transformers' last-token pooling such as Qwen3-Embedding, or any decoder with --task embed)",
            args.model.model.display()
        ))
    })?;
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
    let embed_all = |engine: &mut Box<dyn Serving>| -> Result<Vec<Vec<f32>>> {
        let mut out = Vec::with_capacity(inputs.len());
        for chunk in inputs.chunks(batch) {
            out.extend(engine.embed(chunk)?);
        }
        Ok(out)
    };
    if args.bench {
        let tokens: usize = inputs.iter().map(Vec::len).sum();
        let reps = args.repetitions.max(1);
        let mine = embed_all(&mut engine)?;
        let mut other = match &args.vs {
            Some(path) => Some(vs::open(path, threads, batch, &inputs, info.pooling == "last_token")?),
            None => None,
        };
        // Warm-up of the other engine, and how close its embeddings are to Kylin's.
        let agreement = match &mut other {
            Some(o) => {
                let theirs = o.embed(&inputs)?;
                Some(mine.iter().zip(&theirs).map(|(a, b)| cosine(a, b)).fold(f64::INFINITY, f64::min))
            }
            None => None,
        };
        // Alternating runs (A B A B ...), best of each.
        let (mut best, mut best_other) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..reps {
            let started = Instant::now();
            embed_all(&mut engine)?;
            best = best.min(started.elapsed().as_secs_f64());
            if let Some(o) = &mut other {
                let started = Instant::now();
                o.embed(&inputs)?;
                best_other = best_other.min(started.elapsed().as_secs_f64());
            }
        }
        let n = texts.len() as f64;
        if args.json {
            println!(
                "{}",
                json!({"texts": texts.len(), "tokens": tokens, "batch": batch, "threads": threads,
                       "kylin_texts_per_second": n / best,
                       "llamacpp_texts_per_second": other.as_ref().map(|_| n / best_other),
                       "min_cosine_to_llamacpp": agreement})
            );
        } else {
            println!(
                "kylin embed: {} texts ({tokens} tokens), batches of {batch}, {threads} threads, best of {reps}",
                texts.len()
            );
            println!("  kylin      {:>8.1} texts/s {:>8.0} tokens/s", n / best, tokens as f64 / best);
            if other.is_some() {
                println!(
                    "  llama.cpp  {:>8.1} texts/s {:>8.0} tokens/s   (kylin/llama.cpp {:.2}x; min cosine {:.6})",
                    n / best_other,
                    tokens as f64 / best_other,
                    best_other / best,
                    agreement.unwrap_or(f64::NAN)
                );
            }
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

/// A context that holds the longest text with its prompt and the tokenizer's specials: a token
/// is at least one byte (byte-level BPE, SentencePiece with byte fallback), so the bytes bound
/// the tokens. `None` (the model's default) when the directory's files cannot say.
fn decoder_context(dir: &std::path::Path, texts: &[String], prompt_name: Option<&str>) -> Option<usize> {
    let prompt = match prompt_name {
        None => 0,
        Some(name) => kylin_loader::encoder::read_sentence_config(dir).ok()??.prompts.get(name).map_or(0, String::len),
    };
    let longest = texts.iter().map(String::len).max()? + prompt + 16;
    let limit = kylin_loader::read_config(dir).ok()?.max_position_embeddings;
    Some(longest.min(limit))
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(&x, &y)| f64::from(x) * f64::from(y)).sum();
    let na = a.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
    let nb = b.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb).max(1e-30)
}

/// The llama.cpp side of `--vs`.
mod vs {
    use std::path::Path;

    use anyhow::Result;

    #[cfg(feature = "llamacpp")]
    pub fn open(path: &Path, threads: usize, batch: usize, inputs: &[Vec<u32>], last_token: bool) -> Result<Embedder> {
        let longest = inputs.iter().map(Vec::len).max().unwrap_or(1);
        let tokens = inputs.chunks(batch).map(|c| c.iter().map(Vec::len).sum::<usize>()).max().unwrap_or(1);
        Ok(Embedder(kylin_llamacpp::embed::LlamaCppEmbedder::load(
            path,
            threads,
            batch,
            tokens.max(longest),
            last_token,
        )?))
    }

    #[cfg(feature = "llamacpp")]
    pub struct Embedder(kylin_llamacpp::embed::LlamaCppEmbedder);

    #[cfg(feature = "llamacpp")]
    impl Embedder {
        pub fn embed(&mut self, inputs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
            Ok(self.0.embed(inputs)?)
        }
    }

    #[cfg(not(feature = "llamacpp"))]
    pub struct Embedder;

    #[cfg(not(feature = "llamacpp"))]
    impl Embedder {
        pub fn embed(&mut self, _inputs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
            Ok(Vec::new())
        }
    }

    #[cfg(not(feature = "llamacpp"))]
    pub fn open(_path: &Path, _threads: usize, _batch: usize, _inputs: &[Vec<u32>], _last: bool) -> Result<Embedder> {
        Err(kylin_loader::KylinError::operator_unsupported("--vs needs the llamacpp feature").into())
    }
}
