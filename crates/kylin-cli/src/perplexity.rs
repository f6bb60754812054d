//! `kylin perplexity`: perplexity of a model on a text, with `llama-perplexity`'s semantics, and
//! the KL divergence of its next-token distributions against a saved base run.
//!
//! The text is tokenized once (with the tokenizer's BOS when it adds one) and cut into
//! non-overlapping windows of `--ctx` tokens; each window runs from an empty cache, and the
//! second half of its positions is scored (each predicts the next token with at least `ctx/2`
//! tokens of context), as llama.cpp does. Perplexity is `exp(mean NLL)`, with the standard error
//! of the mean carried through.
//!
//! `--kl-divergence-base FILE`: when FILE does not exist, the full log-probability rows of every
//! scored position are saved there (f32: f16 rows put a floor of about 4e-5 under the KL
//! divergence, as large as the differences it is meant to show; with the token ids to check that the next run scores
//! the same text); when it exists, this run is compared with it: mean KL(base ‖ this), top-1
//! agreement, and the mean change of the probability of the correct token. Runs on GGUF files
//! too (through llama.cpp), so the same command compares engines, precisions or KV dtypes.

use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;

use anyhow::Result;
use kylin_loader::KylinError;
use serde::Serialize;

use crate::args::PerplexityArgs;
use crate::open::open;

/// File magic of a KL base.
const MAGIC: &[u8; 8] = b"KYLINKL2";

#[derive(Debug, Serialize)]
struct Report {
    model: String,
    file: String,
    ctx: usize,
    windows: usize,
    scored_tokens: usize,
    perplexity: f64,
    perplexity_error: f64,
    mean_nll: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    kl: Option<KlReport>,
}

#[derive(Debug, Serialize)]
struct KlReport {
    base: String,
    /// `saved` (this run wrote the base) or `compared`.
    mode: String,
    mean_kl_divergence: Option<f64>,
    top1_agreement: Option<f64>,
    mean_delta_p: Option<f64>,
    base_perplexity: Option<f64>,
}

/// `log_softmax(row)` in f64.
fn log_softmax(row: &[f32], out: &mut [f64]) {
    let max = row.iter().copied().filter(|v| v.is_finite()).fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&v| f64::from(v - max).exp()).sum();
    let log_z = f64::from(max) + sum.ln();
    for (o, &v) in out.iter_mut().zip(row) {
        *o = f64::from(v) - log_z;
    }
}

fn argmax64(v: &[f64]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

pub fn run(args: PerplexityArgs) -> Result<()> {
    if args.ctx < 4 {
        return Err(KylinError::input_invalid(format!("--ctx must be at least 4; got {}", args.ctx)).into());
    }
    let text = std::fs::read_to_string(&args.file)
        .map_err(|e| KylinError::io(&args.file, "cannot read the --file text", &e))?;
    let mut model_args = args.model.clone();
    model_args.ctx_size = Some(model_args.ctx_size.unwrap_or(args.ctx).max(args.ctx));
    let mut opened = open(&model_args, true)?;
    let backend = opened.backend.as_mut();
    let vocab = backend.vocab_size();
    let tokens = backend.tokenize(&text, true)?;
    let bos = backend.tokenize("", true)?.first().copied();
    let available = tokens.len() / args.ctx;
    let windows = args.chunks.map_or(available, |c| c.min(available));
    if windows == 0 {
        return Err(KylinError::input_invalid(format!(
            "{} has {} tokens, fewer than one window of --ctx {}",
            args.file.display(),
            tokens.len(),
            args.ctx
        ))
        .into());
    }
    let first = args.ctx / 2;
    let scored_per_window = args.ctx - 1 - first;

    // The KL base: read it when it exists, else prepare to write it.
    let base_path = args.kl_divergence_base.as_deref();
    let mut base_reader = None;
    let mut base_writer = None;
    let mut base_ppl = None;
    if let Some(path) = base_path {
        if path.exists() {
            let (reader, ppl) = open_base(path, vocab, args.ctx, windows)?;
            base_reader = Some(reader);
            base_ppl = Some(ppl);
        } else {
            let file =
                std::fs::File::create(path).map_err(|e| KylinError::io(path, "cannot create the KL base", &e))?;
            let mut w = BufWriter::new(file);
            w.write_all(MAGIC)?;
            for v in [vocab as u64, args.ctx as u64, windows as u64] {
                w.write_all(&v.to_le_bytes())?;
            }
            base_writer = Some(w);
        }
    }

    let mut nll_sum = 0.0f64;
    let mut nll_sq = 0.0f64;
    let mut count = 0usize;
    let (mut kl_sum, mut agree, mut dp_sum) = (0.0f64, 0usize, 0.0f64);
    let mut logp = vec![0.0f64; vocab];
    let mut base_row = vec![0.0f64; vocab];
    let mut raw = vec![0u8; vocab * 4];
    // A progress bar on stderr (indicatif hides it when stderr is not a terminal; `--json`
    // turns it off).
    let bar = if args.json { indicatif::ProgressBar::hidden() } else { indicatif::ProgressBar::new(windows as u64) };
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} windows {elapsed} (eta {eta}) {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    for w in 0..windows {
        let mut window = tokens[w * args.ctx..(w + 1) * args.ctx].to_vec();
        if let Some(b) = bos {
            window[0] = b;
        }
        backend.reset();
        let logits = backend.prefill_all_logits(&window)?;
        for j in first..args.ctx - 1 {
            let target = window[j + 1] as usize;
            log_softmax(&logits[j * vocab..(j + 1) * vocab], &mut logp);
            let nll = -logp[target];
            nll_sum += nll;
            nll_sq += nll * nll;
            count += 1;
            if let Some(wr) = base_writer.as_mut() {
                wr.write_all(&(target as u32).to_le_bytes())?;
                for &v in &logp {
                    wr.write_all(&(v as f32).to_le_bytes())?;
                }
            }
            if let Some(rd) = base_reader.as_mut() {
                let mut id = [0u8; 4];
                rd.read_exact(&mut id)?;
                if u32::from_le_bytes(id) as usize != target {
                    return Err(KylinError::input_invalid(format!(
                        "the KL base {} was made from other tokens (window {w}, position {j}); \
                         use the same text, --ctx and tokenizer",
                        base_path.map(|p| p.display().to_string()).unwrap_or_default()
                    ))
                    .into());
                }
                rd.read_exact(&mut raw)?;
                for (b, c) in base_row.iter_mut().zip(raw.chunks_exact(4)) {
                    *b = f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
                }
                // This run's row rounded to f32 as the base's was, so identical runs give 0.
                let kl: f64 = base_row.iter().zip(&logp).map(|(&b, &c)| b.exp() * (b - f64::from(c as f32))).sum();
                kl_sum += kl.max(0.0);
                agree += usize::from(argmax64(&base_row) == argmax64(&logp));
                dp_sum += logp[target].exp() - base_row[target].exp();
            }
        }
        bar.set_message(format!("perplexity so far {:.4}", (nll_sum / count as f64).exp()));
        bar.inc(1);
    }
    bar.finish_and_clear();
    let mean = nll_sum / count as f64;
    let var = (nll_sq / count as f64 - mean * mean).max(0.0);
    let stderr = (var / (count.max(2) - 1) as f64).sqrt();
    let ppl = mean.exp();
    if let Some(mut wr) = base_writer.take() {
        wr.write_all(&ppl.to_le_bytes())?;
        wr.flush()?;
    }
    let kl = base_path.map(|p| KlReport {
        base: p.display().to_string(),
        mode: if base_reader.is_some() { "compared" } else { "saved" }.to_string(),
        mean_kl_divergence: base_reader.as_ref().map(|_| kl_sum / count as f64),
        top1_agreement: base_reader.as_ref().map(|_| agree as f64 / count as f64),
        mean_delta_p: base_reader.as_ref().map(|_| dp_sum / count as f64),
        base_perplexity: base_ppl,
    });
    let report = Report {
        model: args.model.model.display().to_string(),
        file: args.file.display().to_string(),
        ctx: args.ctx,
        windows,
        scored_tokens: count,
        perplexity: ppl,
        perplexity_error: ppl * stderr,
        mean_nll: mean,
        kl,
    };
    debug_assert_eq!(count, windows * scored_per_window);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "perplexity {:.4} +/- {:.4} over {} scored tokens ({} windows of {})",
            report.perplexity, report.perplexity_error, count, windows, args.ctx
        );
        if let Some(k) = &report.kl {
            match (k.mean_kl_divergence, k.top1_agreement, k.mean_delta_p) {
                (Some(kl), Some(top1), Some(dp)) => println!(
                    "against {} (perplexity {:.4}): mean KL divergence {kl:.6}, top-1 agreement {:.2}%, mean delta p {:+.5}",
                    k.base,
                    k.base_perplexity.unwrap_or(f64::NAN),
                    top1 * 100.0,
                    dp
                ),
                _ => println!("saved the distributions to {}", k.base),
            }
        }
    }
    Ok(())
}

/// Opens a KL base and checks that it matches this run; returns the reader positioned at the
/// first row and the base's perplexity.
fn open_base(path: &Path, vocab: usize, ctx: usize, windows: usize) -> Result<(BufReader<std::fs::File>, f64)> {
    let mut file = std::fs::File::open(path).map_err(|e| KylinError::io(path, "cannot open the KL base", &e))?;
    let len = file.metadata().map_err(|e| KylinError::io(path, "cannot read the KL base", &e))?.len();
    let mut header = [0u8; 32];
    file.read_exact(&mut header)
        .map_err(|_| KylinError::file_corrupted(format!("KL base {} is shorter than its header", path.display())))?;
    if &header[..8] != MAGIC {
        return Err(KylinError::file_corrupted(format!("{} is not a kylin KL base", path.display())).into());
    }
    let field = |i: usize| u64::from_le_bytes(header[8 + 8 * i..16 + 8 * i].try_into().unwrap_or([0; 8]));
    let (v, c, w) = (field(0), field(1), field(2));
    if (v, c, w) != (vocab as u64, ctx as u64, windows as u64) {
        return Err(KylinError::input_invalid(format!(
            "the KL base {} has vocab {v}, ctx {c}, {w} windows; this run has vocab {vocab}, ctx {ctx}, {windows} windows",
            path.display()
        ))
        .into());
    }
    let rows = windows as u64 * (ctx as u64 - 1 - ctx as u64 / 2);
    let expected = 32 + rows * (4 + 4 * vocab as u64) + 8;
    if len != expected {
        return Err(KylinError::file_corrupted(format!(
            "KL base {} has {len} bytes; expected {expected}",
            path.display()
        ))
        .into());
    }
    let mut tail = [0u8; 8];
    use std::io::{Seek, SeekFrom};
    file.seek(SeekFrom::Start(len - 8))?;
    file.read_exact(&mut tail)?;
    file.seek(SeekFrom::Start(32))?;
    Ok((BufReader::with_capacity(1 << 20, file), f64::from_le_bytes(tail)))
}
