//! `kylin run --image FILE -p TEXT`: one answer about images, on the batching engine (which
//! runs the vision tower): the images and the text become one user message through the chat
//! template, each image's placeholder is expanded to its tokens, and the answer streams out.

use std::io::Write;
use std::time::Instant;

use anyhow::Result;
use kylin_engine::serving::{EventKind, Request};
use kylin_engine::vision::ImageOptions;
use kylin_loader::KylinError;
use serde_json::{Value, json};

use crate::args::RunArgs;
use crate::run::{max_tokens, resolve_sampling, template_kwargs};

pub fn run(args: &RunArgs) -> Result<()> {
    let started = Instant::now();
    let mut engine = crate::open::open_engine_sized(&args.model, 1, false)?;
    let preparer = engine.image_preparer().ok_or_else(|| {
        KylinError::input_invalid(format!(
            "{} takes no images: it has no vision tower Kylin runs (Qwen3.5, Gemma 3 and Gemma 4 vision-language directories do), \
             or no preprocessor_config.json",
            args.model.model.display()
        ))
    })?;
    let prompt = args.prompt.as_deref().unwrap_or_default();

    // 1. The images, each decoded and made into patches as the directory's processor says
    //    (with --mm-processor-kwargs over it; Gemma 3's pan-and-scan crops follow their image).
    let options = image_options(args.mm_processor_kwargs.as_deref())?;
    let preparer = preparer.with_options(&options)?;
    let mut images = Vec::with_capacity(args.image.len());
    for path in &args.image {
        let bytes = std::fs::read(path).map_err(|e| KylinError::io(path, "cannot read the image", &e))?;
        let prepared = preparer
            .prepare_all(&bytes, &ImageOptions::default())
            .map_err(|e| KylinError::image_invalid(format!("{}: {}", path.display(), e.message)))?;
        images.extend(prepared);
    }

    // 2. The chat: one user message, the images then the text.
    let mut content: Vec<Value> = args.image.iter().map(|_| json!({"type": "image"})).collect();
    content.push(json!({"type": "text", "text": prompt}));
    let messages = [json!({"role": "user", "content": content})];
    let text = engine.render_chat(&messages, true, &template_kwargs(&args.template)?)?;
    let prompt_ids = preparer.expand(&engine.tokenize(&preparer.expand_text(&text, &images), false)?, &images)?;
    let image_tokens: usize = images.iter().map(|i| preparer.tokens(i)).sum();

    // 3. Generate, streaming unless the caller wants one JSON object.
    let defaults = engine.generation_defaults();
    let mut request = Request::new(1, prompt_ids.clone(), max_tokens(args.max_tokens, &defaults));
    request.sampling = resolve_sampling(&args.sampling, &defaults);
    request.stop = args.stop.clone();
    request.ignore_eos = args.ignore_eos;
    request.images = images;
    let loaded = Instant::now();
    engine.add_request(request)?;
    let (mut answer, mut ids, mut reason, mut first_token) = (String::new(), Vec::new(), None, None);
    let mut events = Vec::new();
    let mut out = std::io::stdout().lock();
    while engine.has_work() {
        events.clear();
        engine.step(&mut events)?;
        for event in &events {
            let piece = match &event.kind {
                EventKind::Token { id, text, .. } => {
                    ids.push(*id);
                    first_token.get_or_insert_with(|| loaded.elapsed());
                    text.as_str()
                }
                EventKind::Finished { reason: r, text, .. } => {
                    reason = Some(*r);
                    text.as_str()
                }
                _ => "",
            };
            answer.push_str(piece);
            if !args.json {
                let _ = out.write_all(piece.as_bytes());
                let _ = out.flush();
            }
        }
    }
    let total = loaded.elapsed().as_secs_f64();
    let encode_ms = engine.stats().image_encode_seconds * 1e3;
    let ttft = first_token.map_or(total, |d| d.as_secs_f64());
    let decode = if ids.len() > 1 { (ids.len() - 1) as f64 / (total - ttft).max(1e-9) } else { 0.0 };
    let finish = reason.map_or("unknown", |r| r.openai());
    if args.json {
        let value = json!({
            "prompt_ids": prompt_ids,
            "image_tokens": image_tokens,
            "generated_ids": ids,
            "text": answer,
            "finish_reason": finish,
            "timings": {
                "load_ms": (loaded - started).as_secs_f64() * 1e3,
                "encode_ms": encode_ms,
                "ttft_ms": ttft * 1e3,
                "decode_tok_s": decode,
            },
        });
        println!("{value}");
    } else {
        let _ = writeln!(out);
        eprintln!(
            "[{} prompt tokens ({image_tokens} for {} image(s)), {} generated, finish: {finish}] images encoded in \
             {encode_ms:.0} ms, time to first token {:.0} ms (the encoding included), decode {decode:.1} tok/s",
            prompt_ids.len(),
            args.image.len(),
            ids.len(),
            ttft * 1e3
        );
    }
    Ok(())
}

/// `--mm-processor-kwargs JSON` ([`ImageOptions::from_json`]); `INPUT_INVALID` naming the key
/// for a bad one.
pub(crate) fn image_options(text: Option<&str>) -> Result<ImageOptions, KylinError> {
    let Some(text) = text else { return Ok(ImageOptions::default()) };
    let value: Value = serde_json::from_str(text)
        .map_err(|e| KylinError::input_invalid(format!("--mm-processor-kwargs is not JSON: {e}")))?;
    let Value::Object(map) = value else {
        return Err(KylinError::input_invalid(format!("--mm-processor-kwargs must be a JSON object; got {value}")));
    };
    ImageOptions::from_json(&map)
        .map_err(|e| KylinError::input_invalid(format!("--mm-processor-kwargs: {}", e.message)))
}
