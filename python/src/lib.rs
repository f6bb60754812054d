//! `kylin._kylin`: the native half of the `kylin` Python package.
//!
//! One [`Engine`] holds a Kylin [`Serving`] engine (the continuous-batching engine for a decoder,
//! the encoder engine for an embedding model or a reranker) behind a mutex. Requests and
//! results cross the boundary as JSON text, which the Python half (`kylin/__init__.py`) turns
//! into vLLM's objects; the boundary is small, and every value from Python is checked by the
//! same code the server uses (`Serving::add_request` validates, `KylinError` codes come back).
//!
//! Guarantees:
//! - The GIL is released while the engine runs (`Python::detach`): other Python threads run
//!   during a generation, and several Python threads may share one `LLM` (the mutex serialises
//!   them).
//! - Every failure is a `kylin.KylinError` whose `code` is Kylin's stable code
//!   (`INPUT_INVALID`, `CONTEXT_OVERFLOW`, `CONFIG_MISSING`, ...); nothing panics across the
//!   boundary on bad input.

use std::collections::{BTreeMap, VecDeque};
use std::path::Path;
use std::sync::Mutex;

use kylin_engine::PrecisionChoice;
use kylin_engine::batch::{BatchEngine, EngineOptions, KvBudget};
use kylin_engine::encoder::EncoderOptions;
use kylin_engine::encoder_serving::EncoderEngine;
use kylin_engine::sampler::SamplingParams;
use kylin_engine::serving::{Event, EventKind, Request, Serving};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use serde_json::{Map, Value, json};

create_exception!(_kylin, KylinError, PyException, "A Kylin error; `code` is Kylin's stable error code.");

/// A Kylin error as the Python exception (`args = (message, code)`).
fn py_err(e: kylin_loader::KylinError) -> PyErr {
    KylinError::new_err((e.to_string(), e.code().as_str().to_string()))
}

fn invalid(message: impl Into<String>) -> PyErr {
    py_err(kylin_loader::KylinError::input_invalid(message))
}

/// The engine and the events of requests not collected yet.
struct Inner {
    engine: Box<dyn Serving + Send>,
    next_id: u64,
    /// Events of each live request, in order, until its owner takes them.
    queued: BTreeMap<u64, VecDeque<Event>>,
    /// Choices of each live request still open.
    open: BTreeMap<u64, usize>,
    /// Each live request's prompt ids and cancel handle.
    prompts: BTreeMap<u64, Vec<u32>>,
    cancels: BTreeMap<u64, kylin_engine::CancelHandle>,
}

impl Inner {
    /// One step of the engine; its events go to their requests' queues.
    fn step(&mut self) -> kylin_loader::Result<()> {
        let mut events = Vec::new();
        self.engine.step(&mut events)?;
        for e in events {
            if let EventKind::Finished { .. } = e.kind
                && let Some(open) = self.open.get_mut(&e.request)
            {
                *open = open.saturating_sub(1);
            }
            self.queued.entry(e.request).or_default().push_back(e);
        }
        Ok(())
    }

    /// Builds and queues a request from its JSON description.
    fn submit(&mut self, spec: &Map<String, Value>, images: &[Vec<u8>]) -> PyResult<u64> {
        let get_f32 = |k: &str| spec.get(k).and_then(Value::as_f64).map(|v| v as f32);
        let get_usize = |k: &str| -> PyResult<Option<usize>> {
            match spec.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v
                    .as_u64()
                    .map(|n| Some(n as usize))
                    .ok_or_else(|| invalid(format!("`{k}` must be a non-negative integer; got {v}"))),
            }
        };
        // Images: decoded and made into patches first (Gemma 3's text around an image depends on
        // its crops), each placeholder of the prompt expanded after tokenizing.
        let mut prepared = Vec::with_capacity(images.len());
        let preparer = match images.is_empty() {
            true => None,
            false => Some(self.engine.image_preparer().ok_or_else(|| {
                invalid("this model takes no images: it has no vision tower Kylin runs, or no preprocessor_config.json")
            })?),
        };
        if let Some(preparer) = &preparer {
            for bytes in images {
                prepared.push(preparer.prepare(bytes).map_err(py_err)?);
            }
        }
        let prompt_ids: Vec<u32> = match (spec.get("prompt_token_ids"), spec.get("prompt")) {
            (Some(Value::Array(ids)), _) => ids
                .iter()
                .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
                .collect::<Option<_>>()
                .ok_or_else(|| invalid("`prompt_token_ids` must be token ids"))?,
            (_, Some(Value::String(text))) => {
                let add_special = spec.get("add_special_tokens").and_then(Value::as_bool).unwrap_or(true);
                // With images, the image markers the model's processor puts in text (Gemma 3's)
                // go in before tokenizing.
                let text = match &preparer {
                    Some(preparer) => preparer.expand_text(text, &prepared),
                    None => text.clone(),
                };
                self.engine.tokenize(&text, add_special).map_err(py_err)?
            }
            _ => return Err(invalid("a request needs `prompt` (text) or `prompt_token_ids`")),
        };
        let mut prompt_ids = prompt_ids;
        if let Some(preparer) = &preparer {
            prompt_ids = preparer.expand(&prompt_ids, &prepared).map_err(py_err)?;
        }
        let defaults = self.engine.generation_defaults();
        let mut sampling = SamplingParams::from_defaults(&defaults);
        if let Some(t) = get_f32("temperature") {
            sampling.temperature = t;
        }
        if let Some(v) = get_f32("top_p") {
            sampling.top_p = v;
        }
        if let Some(k) = spec.get("top_k").and_then(Value::as_i64) {
            sampling.top_k = if k <= 0 { 0 } else { k as usize };
        }
        if let Some(v) = get_f32("min_p") {
            sampling.min_p = v;
        }
        if let Some(v) = get_f32("repetition_penalty") {
            sampling.repetition_penalty = v;
        }
        if let Some(v) = get_f32("presence_penalty") {
            sampling.presence_penalty = v;
        }
        if let Some(v) = get_f32("frequency_penalty") {
            sampling.frequency_penalty = v;
        }
        if let Some(seed) = spec.get("seed").and_then(Value::as_i64) {
            sampling.seed = seed as u64;
        }
        let context = self.engine.info().context_size;
        let max_new = match get_usize("max_tokens")? {
            Some(m) => m,
            None => context.saturating_sub(prompt_ids.len()).max(1),
        };
        self.next_id += 1;
        let id = self.next_id;
        let mut request = Request::new(id, prompt_ids, max_new);
        request.sampling = sampling;
        request.n = get_usize("n")?.unwrap_or(1);
        request.logprobs = get_usize("logprobs")?;
        request.prompt_logprobs = get_usize("prompt_logprobs")?;
        request.ignore_eos = spec.get("ignore_eos").and_then(Value::as_bool).unwrap_or(false);
        request.skip_special_tokens = spec.get("skip_special_tokens").and_then(Value::as_bool).unwrap_or(true);
        request.speculative_tokens = get_usize("speculative_tokens")?;
        request.images = prepared;
        request.detokenize = self.engine.info().has_tokenizer;
        request.stop = match spec.get("stop") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(list)) => list
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .ok_or_else(|| invalid("`stop` must be a string or a list of strings"))?,
            Some(_) => return Err(invalid("`stop` must be a string or a list of strings")),
        };
        let n = request.n;
        let prompt = request.prompt_ids.clone();
        let cancel = request.cancel.clone();
        self.engine.add_request(request).map_err(py_err)?;
        self.open.insert(id, n);
        self.queued.insert(id, VecDeque::new());
        self.prompts.insert(id, prompt);
        self.cancels.insert(id, cancel);
        Ok(id)
    }
}

/// A Kylin engine over one model directory.
#[pyclass(module = "kylin._kylin")]
pub struct Engine {
    inner: Mutex<Inner>,
    info: String,
}

/// The JSON of one event, as the Python half reads it.
fn event_json(e: &Event) -> Value {
    match &e.kind {
        EventKind::Token { id, text, logprob } => json!({
            "kind": "token", "index": e.index, "id": id, "text": text,
            "logprob": logprob.as_ref().map(|lp| json!({"id": lp.id, "logprob": lp.logprob, "top": lp.top})),
        }),
        EventKind::PromptLogprobs { start, logprobs } => json!({
            "kind": "prompt_logprobs", "index": e.index, "start": start,
            "logprobs": logprobs.iter().map(|lp| json!({"id": lp.id, "logprob": lp.logprob, "top": lp.top})).collect::<Vec<_>>(),
        }),
        EventKind::Finished { reason, text, usage } => json!({
            "kind": "finished", "index": e.index, "text": text, "finish_reason": reason.openai(),
            "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "cached_tokens": usage.cached_prompt_tokens,
        }),
        EventKind::Pooled { values } => json!({"kind": "pooled", "index": e.index, "values": values}),
    }
}

fn parse_object(text: &str, what: &str) -> PyResult<Map<String, Value>> {
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(m)) => Ok(m),
        _ => Err(invalid(format!("{what} must be a JSON object"))),
    }
}

#[pymethods]
impl Engine {
    /// Opens `path` (a Hugging Face directory): a decoder on the batching engine, an encoder
    /// (embeddings, reranking) on the encoder engine. `options` is JSON: `threads`, `ctx_size`,
    /// `max_seqs`, `max_batch_tokens`, `kv_memory` (bytes), `precision` (`f32`, `bf16`, `auto`, `int8`),
    /// `task` (`auto`, `generate`, `embed`, `rerank`: as `kylin serve --task`),
    /// `speculative_tokens`, `speculative_step_tokens`, `draft_model` (a directory) and `mtp`
    /// (a boolean: the checkpoint's multi-token-prediction head proposes), as `kylin serve`
    /// reads them.
    #[new]
    fn new(py: Python<'_>, path: &str, options: &str) -> PyResult<Self> {
        let opts = parse_object(options, "the engine options")?;
        let usize_opt = |k: &str| opts.get(k).and_then(Value::as_u64).map(|n| n as usize);
        let threads = usize_opt("threads").unwrap_or_else(kylin_kernels::physical_cores).max(1);
        let precision = match opts.get("precision").and_then(Value::as_str) {
            None => PrecisionChoice::F32,
            Some(p) => PrecisionChoice::parse(p)
                .ok_or_else(|| invalid(format!("precision must be f32, bf16, auto or int8; got {p}")))?,
        };
        let task = match opts.get("task").and_then(Value::as_str) {
            None | Some("auto") => kylin_loader::task::TaskChoice::Auto,
            Some("generate") => kylin_loader::task::TaskChoice::Generate,
            Some("embed") => kylin_loader::task::TaskChoice::Embed,
            Some("rerank") => kylin_loader::task::TaskChoice::Rerank,
            Some(t) => return Err(invalid(format!("task must be auto, generate, embed or rerank; got {t}"))),
        };
        let draft_model = match opts.get("draft_model") {
            None | Some(Value::Null) => None,
            Some(Value::String(p)) => Some(std::path::PathBuf::from(p)),
            Some(_) => return Err(invalid("draft_model must be a path")),
        };
        let mtp = match opts.get("mtp") {
            None | Some(Value::Null) => false,
            Some(v) => v.as_bool().ok_or_else(|| invalid("mtp must be true or false"))?,
        };
        let speculative_tokens = match opts.get("speculative_tokens") {
            None | Some(Value::Null) if draft_model.is_some() => kylin_engine::draft::DEFAULT_DRAFT_TOKENS,
            None | Some(Value::Null) if mtp => kylin_engine::mtp::DEFAULT_MTP_TOKENS,
            None | Some(Value::Null) => 0,
            Some(v) => v.as_u64().ok_or_else(|| invalid("speculative_tokens must be a non-negative integer"))? as usize,
        };
        let speculative_step_tokens = match opts.get("speculative_step_tokens") {
            None | Some(Value::Null) => kylin_engine::batch::DEFAULT_SPECULATIVE_STEP_TOKENS,
            Some(v) => v
                .as_u64()
                .filter(|&n| n > 0)
                .ok_or_else(|| invalid("speculative_step_tokens must be a positive integer"))?
                as usize,
        };
        let path = Path::new(path).to_path_buf();
        let engine: Box<dyn Serving + Send> = py
            .detach(|| -> kylin_loader::Result<Box<dyn Serving + Send>> {
                if kylin_loader::encoder::is_encoder_dir(&path) {
                    let loaded = kylin_loader::encoder::load_encoder(&path)?;
                    let max_batch_tokens =
                        usize_opt("max_batch_tokens").unwrap_or(EncoderOptions::default().max_batch_tokens);
                    return Ok(Box::new(EncoderEngine::new(loaded, EncoderOptions { threads, max_batch_tokens })?));
                }
                let model = kylin_loader::load(
                    &path,
                    &kylin_loader::LoadOptions { prefetch: true, task, mtp, ..Default::default() },
                )?;
                let defaults = EngineOptions::default();
                let options = EngineOptions {
                    threads,
                    ctx_size: usize_opt("ctx_size"),
                    kv_budget: usize_opt("kv_memory").map_or(KvBudget::Default, |b| KvBudget::Bytes(b as u64)),
                    max_seqs: usize_opt("max_seqs").unwrap_or(defaults.max_seqs),
                    max_batch_tokens: usize_opt("max_batch_tokens").unwrap_or(defaults.max_batch_tokens),
                    precision,
                    speculative_tokens,
                    speculative_step_tokens,
                    draft_model,
                    mtp,
                    ..defaults
                };
                Ok(Box::new(BatchEngine::new(model, &options)?))
            })
            .map_err(py_err)?;
        let mut info = serde_json::to_value(engine.info()).unwrap_or_default();
        info["embedding"] = serde_json::to_value(engine.embedding_info()).unwrap_or_default();
        info["rerank"] = json!(engine.can_rerank());
        info["generation_defaults"] = json!(format!("{:?}", engine.generation_defaults()));
        let inner = Inner {
            engine,
            next_id: 0,
            queued: BTreeMap::new(),
            open: BTreeMap::new(),
            prompts: BTreeMap::new(),
            cancels: BTreeMap::new(),
        };
        Ok(Engine { inner: Mutex::new(inner), info: info.to_string() })
    }

    /// What the engine is (JSON): architecture, context size, threads, embedding info, ...
    fn info(&self) -> String {
        self.info.clone()
    }

    /// Queues a request (JSON: `prompt` or `prompt_token_ids`, sampling fields, `max_tokens`,
    /// `n`, `stop`, `logprobs`, `prompt_logprobs`, ...) with the image files its prompt's
    /// placeholders stand for, in order; returns its id.
    #[pyo3(signature = (request, images = Vec::new()))]
    fn submit(&self, py: Python<'_>, request: &str, images: Vec<Vec<u8>>) -> PyResult<u64> {
        let spec = parse_object(request, "a request")?;
        py.detach(|| self.lock().submit(&spec, &images))
    }

    /// Runs the engine until request `id` has new events (or ends), and returns them as JSON
    /// with its prompt ids: `{"prompt_token_ids", "events", "done"}`. The GIL is released while
    /// the engine runs.
    fn poll(&self, py: Python<'_>, id: u64) -> PyResult<String> {
        py.detach(|| {
            let mut inner = self.lock();
            loop {
                let done = inner.open.get(&id).is_none_or(|&open| open == 0);
                let has = inner.queued.get(&id).is_some_and(|q| !q.is_empty());
                if has || done || !inner.engine.has_work() {
                    let events: Vec<Value> = inner
                        .queued
                        .get_mut(&id)
                        .map(|q| q.drain(..).map(|e| event_json(&e)).collect())
                        .unwrap_or_default();
                    let prompt = inner.prompts.get(&id).cloned().unwrap_or_default();
                    if done {
                        inner.open.remove(&id);
                        inner.queued.remove(&id);
                        inner.prompts.remove(&id);
                        inner.cancels.remove(&id);
                    }
                    return Ok(json!({"prompt_token_ids": prompt, "events": events, "done": done}).to_string());
                }
                inner.step().map_err(py_err)?;
            }
        })
    }

    /// Cancels request `id` (its choices end with finish reason `cancelled` at the next step).
    fn cancel(&self, py: Python<'_>, id: u64) -> PyResult<()> {
        py.detach(|| {
            let mut inner = self.lock();
            // Requests are cancelled through their handle; the engine ends them at its next step.
            if let Some(handle) = inner.cancels.get(&id) {
                handle.cancel();
            }
            inner.step().map_err(py_err)
        })
    }

    /// Text to ids with the model's tokenizer.
    fn tokenize(&self, text: &str, add_special_tokens: bool) -> PyResult<Vec<u32>> {
        self.lock().engine.tokenize(text, add_special_tokens).map_err(py_err)
    }

    /// Ids to text.
    fn detokenize(&self, ids: Vec<u32>, skip_special_tokens: bool) -> PyResult<String> {
        self.lock().engine.detokenize(&ids, skip_special_tokens).map_err(py_err)
    }

    /// Renders OpenAI-style messages (JSON) through the model's chat template.
    fn render_chat(&self, messages: &str, add_generation_prompt: bool, kwargs: &str) -> PyResult<String> {
        let messages: Vec<Value> =
            serde_json::from_str(messages).map_err(|e| invalid(format!("messages are not a JSON list: {e}")))?;
        let kwargs = parse_object(kwargs, "chat_template_kwargs")?;
        self.lock().engine.render_chat(&messages, add_generation_prompt, &kwargs).map_err(py_err)
    }

    /// Embeddings of texts (JSON list of strings, or of id lists), as a JSON list of lists.
    fn embed(&self, py: Python<'_>, inputs: &str) -> PyResult<String> {
        let list: Vec<Value> =
            serde_json::from_str(inputs).map_err(|e| invalid(format!("inputs are not a JSON list: {e}")))?;
        py.detach(|| {
            let mut inner = self.lock();
            let mut ids = Vec::with_capacity(list.len());
            for v in &list {
                ids.push(match v {
                    Value::String(text) => inner.engine.tokenize(text, true).map_err(py_err)?,
                    Value::Array(a) => a
                        .iter()
                        .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
                        .collect::<Option<Vec<u32>>>()
                        .ok_or_else(|| invalid("an input must be a string or token ids"))?,
                    _ => return Err(invalid("an input must be a string or token ids")),
                });
            }
            let vectors = inner.engine.embed(&ids).map_err(py_err)?;
            Ok(json!(vectors).to_string())
        })
    }

    /// Relevance scores of documents for a query (a reranker), as a JSON list.
    #[pyo3(signature = (query, documents, instruction=None))]
    fn rerank(
        &self,
        py: Python<'_>,
        query: &str,
        documents: Vec<String>,
        instruction: Option<String>,
    ) -> PyResult<Vec<f32>> {
        py.detach(|| {
            self.lock().engine.rerank(query, &documents, instruction.as_deref()).map(|(s, _)| s).map_err(py_err)
        })
    }
}

impl Engine {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the engine half-stepped in a way that
        // matters more than refusing every later call would, so a poisoned lock is reused.
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[pymodule]
fn _kylin(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Engine>()?;
    m.add("KylinError", m.py().get_type::<KylinError>())?;
    Ok(())
}
