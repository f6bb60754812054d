//! The router without a socket (`app()` + `tower::ServiceExt::oneshot`), over a scripted engine.
//!
//! The engine here is a small [`Serving`] whose "model" always wants to write
//! `Hello world! The answer is 42.` then EOS, one byte per token (ids 0..=255 are bytes, 256 is
//! EOS), several sequences per step. Its per-choice logic is the real engines' (`Decoding`:
//! sampling, streaming detokenization, stop strings, log-probabilities), so what is tested here
//! is the HTTP layer: shapes, streaming, errors, admission, cancellation and health.

use std::collections::VecDeque;
use std::sync::mpsc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use kylin_engine::detok::Detokenize;
use kylin_engine::sequence::Decoding;
use kylin_engine::{
    ChatMessage, EngineInfo, EngineStats, Event, EventKind, Request as EngineRequest, Serving, StopReason,
};
use kylin_loader::{GenerationDefaults, KylinError, Result as KResult};
use kylin_server::{AppState, EngineFactory, ServerConfig, app};
use serde_json::{Value, json};
use tower::ServiceExt;

const SCRIPT: &[u8] = b"Hello world! The answer is 42.";
const EOS: u32 = 256;
const VOCAB: usize = 257;
const CONTEXT: usize = 64;
const MAX_SEQS: usize = 4;

struct Bytes;

impl Detokenize for Bytes {
    fn detokenize(&self, ids: &[u32], _skip_special: bool) -> KResult<String> {
        let bytes: Vec<u8> = ids.iter().filter(|&&i| i < 256).map(|&i| i as u8).collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

struct Choice {
    request: u64,
    index: usize,
    decoding: Decoding,
    cancel: kylin_engine::CancelHandle,
    slow: bool,
}

#[derive(Default)]
struct Scripted {
    waiting: VecDeque<EngineRequest>,
    running: Vec<Choice>,
    stats: EngineStats,
}

impl Scripted {
    fn logits(generated: usize) -> Vec<f32> {
        let mut logits = vec![0.0; VOCAB];
        let next = SCRIPT.get(generated).map_or(EOS, |&b| u32::from(b));
        logits[next as usize] = 10.0;
        logits
    }
}

impl Serving for Scripted {
    fn info(&self) -> EngineInfo {
        EngineInfo {
            backend: "scripted".into(),
            architecture: "Script".into(),
            vocab_size: VOCAB,
            context_size: CONTEXT,
            max_seqs: MAX_SEQS,
            max_batch_tokens: 64,
            kv_block_size: 16,
            kv_blocks: 16,
            kv_tokens: 256,
            kv_bytes: 1024,
            kv_dtype: "f32".into(),
            threads: 1,
            precision: "f32".into(),
            kernels: "scalar".into(),
            has_tokenizer: true,
            eos_ids: vec![EOS],
            state_pool: None,
        }
    }

    fn generation_defaults(&self) -> GenerationDefaults {
        GenerationDefaults::default()
    }

    fn add_request(&mut self, request: EngineRequest) -> KResult<()> {
        kylin_engine::serial::validate_request(&request, VOCAB, CONTEXT, MAX_SEQS)?;
        self.waiting.push_back(request);
        Ok(())
    }

    fn step(&mut self, events: &mut Vec<Event>) -> KResult<()> {
        self.stats.steps += 1;
        // Requests whose prompt is "slow" take 10 ms per step, so tests can watch them run.
        if self.running.iter().any(|c| c.slow) || self.waiting.iter().any(|r| r.prompt_ids == b"slow".map(u32::from)) {
            std::thread::sleep(Duration::from_millis(10));
        }
        while self.running.len() < MAX_SEQS
            && let Some(r) = self.waiting.pop_front()
        {
            self.stats.prompt_tokens_total += r.prompt_ids.len() as u64;
            if let Some(k) = r.prompt_logprobs {
                // The "model" at prompt position p is sure of byte p + 1 of the script.
                let logprobs = r.prompt_ids[1..]
                    .iter()
                    .enumerate()
                    .map(|(p, &next)| kylin_engine::sequence::token_logprob(&Scripted::logits(p + 1), next, k))
                    .collect();
                events.push(Event { request: r.id, index: 0, kind: EventKind::PromptLogprobs { start: 1, logprobs } });
            }
            for index in 0..r.n {
                let mut decoding = Decoding::new(&r, index, VOCAB, &[EOS]);
                if decoding.generates_nothing() {
                    let kind = decoding.finish(StopReason::Length, Some(&Bytes))?;
                    events.push(Event { request: r.id, index, kind });
                    continue;
                }
                let slow = r.prompt_ids == b"slow".map(u32::from);
                self.running.push(Choice { request: r.id, index, decoding, cancel: r.cancel.clone(), slow });
            }
        }
        let mut still = Vec::new();
        for mut c in self.running.drain(..) {
            if c.cancel.is_cancelled() {
                let kind = c.decoding.finish(StopReason::Cancelled, Some(&Bytes))?;
                events.push(Event { request: c.request, index: c.index, kind });
                continue;
            }
            let logits = Scripted::logits(c.decoding.generated);
            let (_, token, reason) = c.decoding.accept(&logits, Some(&Bytes), false)?;
            self.stats.generation_tokens_total += 1;
            events.push(Event { request: c.request, index: c.index, kind: token });
            match reason {
                Some(reason) => {
                    let kind = c.decoding.finish(reason, Some(&Bytes))?;
                    events.push(Event { request: c.request, index: c.index, kind });
                }
                None => still.push(c),
            }
        }
        self.running = still;
        Ok(())
    }

    fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    fn stats(&self) -> EngineStats {
        EngineStats {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_blocks_total: 16,
            kv_blocks_used: self.running.len(),
            ..self.stats
        }
    }

    fn tokenize(&self, text: &str, _add_special: bool) -> KResult<Vec<u32>> {
        Ok(text.bytes().map(u32::from).collect())
    }

    fn detokenize(&self, ids: &[u32], skip_special: bool) -> KResult<String> {
        Bytes.detokenize(ids, skip_special)
    }

    fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, Value>,
    ) -> KResult<String> {
        let mut text: String = messages.iter().map(|m| format!("{}: {}\n", m.role, m.content)).collect();
        if kwargs.get("enable_thinking") == Some(&Value::Bool(false)) {
            text.push_str("(no thinking)\n");
        }
        if add_generation_prompt {
            text.push_str("assistant: ");
        }
        Ok(text)
    }
}

fn config() -> ServerConfig {
    let mut c = ServerConfig::new("scripted");
    c.max_queue = 2;
    c.max_body_bytes = 4096;
    c
}

async fn start(config: ServerConfig) -> AppState {
    let factory: EngineFactory = Box::new(|| Ok(Box::new(Scripted::default()) as Box<dyn Serving>));
    let (state, _thread) = AppState::start(config, factory).unwrap();
    state.engine().wait_ready().await.unwrap();
    state
}

fn post(path: &str, body: Value) -> Request<Body> {
    Request::post(path).header("content-type", "application/json").body(Body::from(body.to_string())).unwrap()
}

async fn send(state: &AppState, request: Request<Body>) -> (StatusCode, axum::http::HeaderMap, String) {
    let response = app(state.clone()).oneshot(request).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX).await.unwrap();
    (status, headers, String::from_utf8(bytes.to_vec()).unwrap())
}

async fn send_json(state: &AppState, request: Request<Body>) -> (StatusCode, Value) {
    let (status, _, body) = send(state, request).await;
    (status, serde_json::from_str(&body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}")))
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

/// The `data:` payloads of an SSE body.
fn sse_data(body: &str) -> Vec<String> {
    body.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect()
}

#[tokio::test]
async fn chat_completion_has_openai_shape() {
    let state = start(config()).await;
    let (status, v) =
        send_json(&state, post("/v1/chat/completions", json!({"model": "scripted", "messages": user("hi")}))).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["model"], "scripted");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], "Hello world! The answer is 42.");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["choices"][0]["logprobs"], Value::Null);
    // "user: hi\nassistant: " is 20 bytes; 30 bytes of script and EOS.
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 20, "completion_tokens": 31, "total_tokens": 51, "prompt_tokens_details": {"cached_tokens": 0}})
    );
}

#[tokio::test]
async fn text_parts_template_kwargs_and_max_tokens() {
    let state = start(config()).await;
    let messages = json!([{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]);
    let body =
        json!({"messages": messages, "max_completion_tokens": 5, "chat_template_kwargs": {"enable_thinking": false}});
    let (status, v) = send_json(&state, post("/v1/chat/completions", body)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "Hello");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], 20 + "(no thinking)\n".len());
}

#[tokio::test]
async fn stop_strings_are_never_emitted_streamed_or_not() {
    let state = start(config()).await;
    let (_, v) = send_json(&state, post("/v1/completions", json!({"prompt": "x", "stop": ["answer", "zzz"]}))).await;
    assert_eq!(v["choices"][0]["text"], "Hello world! The ");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let (_, _, body) =
        send(&state, post("/v1/completions", json!({"prompt": "x", "stop": "answer", "stream": true}))).await;
    let text: String = sse_data(&body)
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap()["choices"][0]["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(text, "Hello world! The ");
}

#[tokio::test]
async fn chat_stream_has_role_first_then_usage_then_done() {
    let state = start(config()).await;
    let body = json!({"messages": user("hi"), "stream": true, "stream_options": {"include_usage": true}, "n": 2});
    let (status, headers, body) = send(&state, post("/v1/chat/completions", body)).await;
    assert_eq!(status, StatusCode::OK);
    assert!(headers["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    let data = sse_data(&body);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    for (i, chunk) in chunks[..2].iter().enumerate() {
        assert_eq!(chunk["object"], "chat.completion.chunk");
        assert_eq!(chunk["choices"][0]["index"], i);
        assert_eq!(chunk["choices"][0]["delta"]["role"], "assistant");
    }
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 62);
    for index in 0..2 {
        let mine: Vec<&Value> =
            chunks.iter().filter(|c| c["choices"].get(0).is_some_and(|x| x["index"] == index)).collect();
        let text: String = mine.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
        assert_eq!(text, "Hello world! The answer is 42.");
        assert_eq!(mine.last().unwrap()["choices"][0]["finish_reason"], "stop");
        assert!(mine.iter().all(|c| c["usage"].is_null()));
    }
}

#[tokio::test]
async fn logprobs_in_both_apis() {
    let state = start(config()).await;
    let body = json!({"messages": user("hi"), "logprobs": true, "top_logprobs": 2, "max_tokens": 3});
    let (_, v) = send_json(&state, post("/v1/chat/completions", body)).await;
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 3);
    assert_eq!(content[0]["token"], "H");
    assert_eq!(content[0]["bytes"], json!([72]));
    assert!(content[0]["logprob"].as_f64().unwrap() < 0.0);
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 2);
    assert_eq!(content[0]["top_logprobs"][0]["token"], "H");
    let (_, v) =
        send_json(&state, post("/v1/completions", json!({"prompt": "x", "logprobs": 1, "max_tokens": 2}))).await;
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"], json!(["H", "e"]));
    assert_eq!(lp["text_offset"], json!([0, 1]));
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 1);
}

#[tokio::test]
async fn echo_scores_the_prompt_then_generates() {
    let state = start(config()).await;
    // The scripted model is sure of "ello" after "H": each prompt token after the first has a
    // log-probability near 0, the first none.
    let body = json!({"prompt": "Hello", "echo": true, "logprobs": 2, "max_tokens": 0});
    let (status, v) = send_json(&state, post("/v1/completions", body)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["text"], "Hello");
    assert_eq!(choice["finish_reason"], "length");
    let lp = &choice["logprobs"];
    assert_eq!(lp["tokens"], json!(["H", "e", "l", "l", "o"]));
    assert_eq!(lp["text_offset"], json!([0, 1, 2, 3, 4]));
    assert_eq!(lp["token_logprobs"][0], Value::Null);
    assert_eq!(lp["top_logprobs"][0], Value::Null);
    for i in 1..5 {
        let logprob = lp["token_logprobs"][i].as_f64().unwrap();
        assert!(logprob < 0.0 && logprob > -0.05, "{lp}");
        assert_eq!(lp["top_logprobs"][i].as_object().unwrap().len(), 2, "{lp}");
    }
    assert_eq!(v["usage"]["completion_tokens"], 0);
    assert_eq!(v["usage"]["prompt_tokens"], 5);

    // With generated tokens: the prompt's entries, then the generated ones, offsets going on
    // from the prompt's text; `n` copies the prompt's scores into every choice.
    let body = json!({"prompt": "Hxy", "echo": true, "logprobs": 0, "max_tokens": 2, "n": 2});
    let (_, v) = send_json(&state, post("/v1/completions", body)).await;
    for choice in v["choices"].as_array().unwrap() {
        assert_eq!(choice["text"], "HxyHe");
        let lp = &choice["logprobs"];
        assert_eq!(lp["tokens"], json!(["H", "x", "y", "H", "e"]));
        assert_eq!(lp["text_offset"], json!([0, 1, 2, 3, 4]));
        // "x" and "y" are not what the model expects: low log-probabilities, and the chosen
        // token is added to `top_logprobs` beside the best one (logprobs 0: the chosen only).
        assert!(lp["token_logprobs"][1].as_f64().unwrap() < -5.0);
        assert_eq!(lp["top_logprobs"][1].as_object().unwrap().len(), 1);
        assert!(lp["top_logprobs"][1].get("x").is_some(), "{lp}");
    }

    // Echo without log-probabilities: the text only.
    let (_, v) =
        send_json(&state, post("/v1/completions", json!({"prompt": "ab", "echo": true, "max_tokens": 1}))).await;
    assert_eq!(v["choices"][0]["text"], "abH");
    assert_eq!(v["choices"][0]["logprobs"], Value::Null);
    // Token ids are echoed as their text.
    let (_, v) =
        send_json(&state, post("/v1/completions", json!({"prompt": [72, 105], "echo": true, "max_tokens": 0}))).await;
    assert_eq!(v["choices"][0]["text"], "Hi");
}

#[tokio::test]
async fn echo_streams_the_prompt_first() {
    let state = start(config()).await;
    let body = json!({"prompt": "He", "echo": true, "logprobs": 1, "max_tokens": 2, "stream": true});
    let (status, _, body) = send(&state, post("/v1/completions", body)).await;
    assert_eq!(status, StatusCode::OK);
    let data = sse_data(&body);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    let first = &chunks[0]["choices"][0];
    assert_eq!(first["text"], "He");
    assert_eq!(first["logprobs"]["tokens"], json!(["H", "e"]));
    assert_eq!(first["logprobs"]["token_logprobs"][0], Value::Null);
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(text, "HeHe");
    let offsets: Vec<Value> = chunks[1..]
        .iter()
        .filter(|c| !c["choices"][0]["logprobs"].is_null())
        .map(|c| c["choices"][0]["logprobs"]["text_offset"][0].clone())
        .collect();
    assert_eq!(offsets, vec![json!(2), json!(3)]);
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "length");

    let body = json!({"prompt": "He", "echo": true, "logprobs": 1, "max_tokens": 0, "stream": true});
    let (_, _, body) = send(&state, post("/v1/completions", body)).await;
    let data = sse_data(&body);
    let chunks: Vec<Value> = data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    assert_eq!(chunks.len(), 2, "{chunks:?}");
    assert_eq!(chunks[0]["choices"][0]["text"], "He");
    assert_eq!(chunks[1]["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn max_tokens_zero_needs_echo() {
    let state = start(config()).await;
    for (path, body) in [
        ("/v1/completions", json!({"prompt": "x", "max_tokens": 0})),
        ("/v1/chat/completions", json!({"messages": user("hi"), "max_tokens": 0})),
    ] {
        let (status, v) = send_json(&state, post(path, body)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
        assert_eq!(v["error"]["param"], "max_tokens");
    }
    let (status, v) = send_json(&state, post("/v1/completions", json!({"prompt": "x", "echo": "yes"}))).await;
    assert_eq!((status, v["error"]["param"].clone()), (StatusCode::BAD_REQUEST, json!("echo")));
}

#[tokio::test]
async fn retrieval_routes_on_a_generating_model_are_400_naming_the_model() {
    let state = start(config()).await;
    let (status, v) = send_json(&state, post("/v1/embeddings", json!({"input": "hi"}))).await;
    assert_eq!((status, v["error"]["param"].clone()), (StatusCode::BAD_REQUEST, json!("model")), "{v}");
    assert_eq!(v["error"]["code"], "model_not_supported");
    for path in ["/v1/rerank", "/rerank", "/v1/reranking"] {
        let (status, v) = send_json(&state, post(path, json!({"query": "q", "documents": ["a"]}))).await;
        assert_eq!((status, v["error"]["param"].clone()), (StatusCode::BAD_REQUEST, json!("model")), "{path}: {v}");
    }
    // Field errors come first and name their field.
    let cases = [
        ("/v1/embeddings", json!({}), "input"),
        ("/v1/embeddings", json!({"input": "x", "encoding_format": "hex"}), "encoding_format"),
        ("/v1/embeddings", json!({"input": "x", "dimensions": "many"}), "dimensions"),
        ("/v1/embeddings", json!({"input": {"a": 1}}), "input"),
        ("/v1/embeddings", json!({"input": "x", "frobnicate": 1}), "frobnicate"),
        ("/v1/rerank", json!({"documents": ["a"]}), "query"),
        ("/v1/rerank", json!({"query": "q"}), "documents"),
        ("/v1/rerank", json!({"query": "q", "documents": ["a"], "top_n": -1}), "top_n"),
    ];
    for (path, body, param) in cases {
        let (status, v) = send_json(&state, post(path, body.clone())).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body} -> {v}");
        assert_eq!(v["error"]["param"], param, "{body} -> {v}");
    }
}

#[tokio::test]
async fn several_prompts_and_token_ids() {
    let state = start(config()).await;
    let (status, v) =
        send_json(&state, post("/v1/completions", json!({"prompt": [[1, 2], [3]], "n": 2, "max_tokens": 2}))).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    assert!(choices.iter().enumerate().all(|(i, c)| c["index"] == i && c["text"] == "He"));
    assert_eq!(v["usage"]["prompt_tokens"], 3);
}

#[tokio::test]
async fn invalid_requests_are_400_naming_the_field() {
    let state = start(config()).await;
    let cases = [
        (json!({"messages": user("hi"), "temperature": -1}), "temperature"),
        (json!({"messages": user("hi"), "top_p": "x"}), "top_p"),
        (
            json!({"messages": user("hi"), "tools": [{"type": "function", "function": {"name": "f g"}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"messages": user("hi"), "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}),
            "tool_choice",
        ),
        (json!({"messages": user("hi"), "tool_choice": "required"}), "tool_choice"),
        (json!({"messages": user("hi"), "response_format": {"type": "yaml"}}), "response_format.type"),
        // The scripted engine cannot mask logits: a format it cannot honour is refused, naming it.
        (json!({"messages": user("hi"), "response_format": {"type": "json_object"}}), "response_format"),
        (json!({"messages": user("hi"), "logit_bias": {"one": 5}}), "logit_bias"),
        (json!({"messages": user("hi"), "logit_bias": {"999": 5}}), "logit_bias"),
        (json!({"messages": user("hi"), "logit_bias": {"1": 500}}), "logit_bias.1"),
        (json!({"messages": [{"role": "tool", "content": "x"}]}), "messages[0].tool_call_id"),
        (
            json!({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}),
            "messages[0].tool_calls[0].function.arguments",
        ),
        (json!({"messages": user("hi"), "top_logprobs": 21, "logprobs": true}), "top_logprobs"),
        (json!({"messages": user("hi"), "n": 0}), "n"),
        (json!({"messages": user("hi"), "made_up_field": 1}), "made_up_field"),
        (json!({"messages": [{"role": "function", "content": "x"}]}), "messages[0].role"),
        (json!({"messages": []}), "messages"),
        (json!({"model": "scripted"}), "messages"),
    ];
    for (body, param) in cases {
        let (status, v) = send_json(&state, post("/v1/chat/completions", body.clone())).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body} -> {v}");
        assert_eq!(v["error"]["param"], param, "{body} -> {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(v["error"]["message"].is_string());
    }
    let harmless = json!({"messages": user("hi"), "user": "u", "metadata": {"a": "b"}, "max_tokens": 1, "tools": []});
    assert_eq!(send_json(&state, post("/v1/chat/completions", harmless)).await.0, StatusCode::OK);
    let bad_json = Request::post("/v1/completions").body(Body::from("{not json")).unwrap();
    assert_eq!(send_json(&state, bad_json).await.0, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn a_prompt_longer_than_the_context_is_400_with_both_numbers() {
    let state = start(config()).await;
    let (status, v) = send_json(&state, post("/v1/completions", json!({"prompt": "x".repeat(100)}))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains("100") && message.contains("64"), "{message}");
    let (status, v) = send_json(&state, post("/v1/completions", json!({"prompt": "xx", "max_tokens": 100}))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["param"], "max_tokens");
}

#[tokio::test]
async fn unknown_model_route_and_method_are_openai_errors() {
    let state = start(config()).await;
    let (status, v) =
        send_json(&state, post("/v1/chat/completions", json!({"model": "gpt-4", "messages": user("hi")}))).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(v["error"]["code"], "model_not_found");
    let (status, v) = send_json(&state, Request::get("/v1/nothing").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(v["error"]["message"].as_str().unwrap().contains("/v1/nothing"));
    let (status, v) = send_json(&state, Request::get("/v1/chat/completions").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert!(v["error"].is_object());
}

#[tokio::test]
async fn oversized_bodies_are_413() {
    let state = start(config()).await;
    let body = json!({"prompt": "x".repeat(10_000)});
    let (status, v) = send_json(&state, post("/v1/completions", body.clone())).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(v["error"]["code"], "body_too_large");
    // Without a Content-Length (a streamed body), the limit holds while reading.
    let chunks = futures_util::stream::iter(vec![Ok::<_, std::io::Error>(body.to_string())]);
    let request = Request::post("/v1/completions").body(Body::from_stream(chunks)).unwrap();
    assert_eq!(send_json(&state, request).await.0, StatusCode::PAYLOAD_TOO_LARGE);
}

#[tokio::test]
async fn the_api_key_guards_everything_but_health() {
    let mut c = config();
    c.api_key = Some("sekret".into());
    let state = start(c).await;
    let (status, v) = send_json(&state, post("/v1/completions", json!({"prompt": "x", "max_tokens": 1}))).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(v["error"]["code"], "invalid_api_key");
    let wrong = Request::get("/v1/models").header("authorization", "Bearer nope").body(Body::empty()).unwrap();
    assert_eq!(send(&state, wrong).await.0, StatusCode::UNAUTHORIZED);
    let right = Request::get("/v1/models").header("authorization", "Bearer sekret").body(Body::empty()).unwrap();
    let (status, v) = send_json(&state, right).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["data"][0]["id"], "scripted");
    assert_eq!(send(&state, Request::get("/health").body(Body::empty()).unwrap()).await.0, StatusCode::OK);
}

/// Waits (bounded) until the engine's published statistics satisfy `f`.
async fn wait_stats(state: &AppState, f: impl Fn(&EngineStats) -> bool) -> EngineStats {
    for _ in 0..200 {
        let s = state.engine().stats();
        if f(&s) {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    state.engine().stats()
}

#[tokio::test]
async fn a_full_queue_is_429_and_disconnects_free_their_sequences() {
    let state = start(config()).await;
    // max_seqs 4 + max_queue 2: six streams are admitted, the seventh is refused.
    let mut open = Vec::new();
    for _ in 0..6 {
        let body = json!({"prompt": "slow", "stream": true, "ignore_eos": true, "max_tokens": 60});
        let response = app(state.clone()).oneshot(post("/v1/completions", body)).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        open.push(response);
    }
    assert_eq!(state.in_flight(), 6);
    let (status, headers, body) = send(&state, post("/v1/completions", json!({"prompt": "x"}))).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    assert_eq!(headers["retry-after"], "1");
    let s = wait_stats(&state, |s| s.running == 4).await;
    assert_eq!((s.running, s.waiting), (4, 2));
    // The clients go away without reading: every sequence is cancelled and its blocks freed.
    drop(open);
    let s = wait_stats(&state, |s| s.running == 0 && s.waiting == 0).await;
    assert_eq!((s.running, s.waiting, s.kv_blocks_used), (0, 0, 0));
    assert_eq!(state.in_flight(), 0);
    let (_, _, metrics) = send(&state, Request::get("/metrics").body(Body::empty()).unwrap()).await;
    assert!(metrics.contains("kylin:num_requests_running{model_name=\"scripted\"} 0"), "{metrics}");
    assert!(metrics.contains("kylin:kv_cache_usage_perc{model_name=\"scripted\"} 0"), "{metrics}");
    // The names load-aware routers read (vLLM's).
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"] {
        assert!(metrics.contains(&format!("# TYPE {name} gauge\n{name}{{model_name=\"scripted\"}} 0")), "{metrics}");
    }
    assert!(metrics.contains("kylin:request_rejected_queue_full_total{model_name=\"scripted\"} 1"));
    assert!(metrics.contains("kylin:request_success_total{model_name=\"scripted\",finished_reason=\"abort\"} 6"));
}

#[tokio::test]
async fn metrics_count_tokens_and_latencies() {
    let state = start(config()).await;
    send(&state, post("/v1/completions", json!({"prompt": "abc", "max_tokens": 4}))).await;
    let (status, headers, text) = send(&state, Request::get("/metrics").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::OK);
    assert!(headers["content-type"].to_str().unwrap().starts_with("text/plain"));
    assert!(text.contains("kylin:prompt_tokens_total{model_name=\"scripted\"} 3"), "{text}");
    assert!(text.contains("kylin:generation_tokens_total{model_name=\"scripted\"} 4"));
    assert!(text.contains("kylin:time_to_first_token_seconds_count{model_name=\"scripted\"} 1"));
    assert!(text.contains("kylin:inter_token_latency_seconds_count{model_name=\"scripted\"} 3"));
    assert!(text.contains("kylin:e2e_request_latency_seconds_count{model_name=\"scripted\"} 1"));
    assert!(text.contains("kylin:request_success_total{model_name=\"scripted\",finished_reason=\"length\"} 1"));
}

#[tokio::test]
async fn tokenize_and_detokenize() {
    let state = start(config()).await;
    let (status, v) = send_json(&state, post("/tokenize", json!({"prompt": "Hi"}))).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v, json!({"count": 2, "max_model_len": 64, "tokens": [72, 105]}));
    let (_, v) = send_json(&state, post("/tokenize", json!({"messages": user("hi")}))).await;
    assert_eq!(v["count"], 20);
    let (_, v) = send_json(&state, post("/detokenize", json!({"tokens": [72, 105]}))).await;
    assert_eq!(v, json!({"prompt": "Hi"}));
    let (status, v) = send_json(&state, post("/detokenize", json!({"tokens": [999]}))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["param"], "tokens");
}

#[tokio::test]
async fn health_is_503_while_loading_and_requests_too() {
    let (release, wait) = mpsc::channel::<()>();
    let factory: EngineFactory = Box::new(move || {
        let _ = wait.recv();
        Ok(Box::new(Scripted::default()) as Box<dyn Serving>)
    });
    let (state, _thread) = AppState::start(config(), factory).unwrap();
    let (status, headers, _) = send(&state, Request::get("/health").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(headers.contains_key("retry-after"));
    let (status, v) = send_json(&state, post("/v1/completions", json!({"prompt": "x"}))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(v["error"]["type"], "service_unavailable");
    release.send(()).unwrap();
    state.engine().wait_ready().await.unwrap();
    assert_eq!(send(&state, Request::get("/health").body(Body::empty()).unwrap()).await.0, StatusCode::OK);
    state.engine().begin_shutdown();
    assert_eq!(
        send(&state, Request::get("/health").body(Body::empty()).unwrap()).await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
}

#[tokio::test]
async fn a_failed_load_is_reported() {
    let factory: EngineFactory = Box::new(|| Err(KylinError::file_not_found("no such model")));
    let (state, _thread) = AppState::start(config(), factory).unwrap();
    let err = state.engine().wait_ready().await.unwrap_err();
    assert!(err.message.contains("no such model"));
    assert_eq!(
        send(&state, Request::get("/health").body(Body::empty()).unwrap()).await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
}

#[tokio::test]
async fn seeds_make_sampling_reproducible() {
    let state = start(config()).await;
    let body = json!({"prompt": "x", "temperature": 5.0, "seed": 7, "max_tokens": 8, "n": 2});
    let (_, a) = send_json(&state, post("/v1/completions", body.clone())).await;
    let (_, b) = send_json(&state, post("/v1/completions", body)).await;
    assert_eq!(a["choices"], b["choices"]);
}

#[tokio::test]
async fn a_client_that_never_finishes_its_body_gets_408() {
    let mut c = config();
    c.body_timeout = Duration::from_millis(200);
    let state = start(c).await;
    let first = futures_util::stream::iter(vec![Ok::<_, std::io::Error>("{\"prompt\": ".to_string())]);
    let never = futures_util::stream::pending::<Result<String, std::io::Error>>();
    let body = Body::from_stream(futures_util::StreamExt::chain(first, never));
    let (status, v) = send_json(&state, Request::post("/v1/completions").body(body).unwrap()).await;
    assert_eq!(status, StatusCode::REQUEST_TIMEOUT);
    assert_eq!(v["error"]["code"], "body_timeout");
    assert_eq!(state.in_flight(), 0);
}

/// Over a real loopback socket: a client that sends its headers too slowly is disconnected
/// after the header-read timeout, while a complete request on another connection is served,
/// and a shutdown signal stops the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_client_is_cut_off_by_the_header_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut c = config();
    c.header_read_timeout = std::time::Duration::from_millis(500);
    c.grace_period = std::time::Duration::from_secs(1);
    let factory: EngineFactory = Box::new(|| Ok(Box::new(Scripted::default()) as Box<dyn Serving>));
    let (state, thread) = AppState::start(c, factory).unwrap();
    state.engine().wait_ready().await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(kylin_server::serve(listener, state, thread, async {
        let _ = stopped.await;
    }));

    // Half a request line and one header, then silence.
    let mut slow = tokio::net::TcpStream::connect(address).await.unwrap();
    slow.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n").await.unwrap();
    let started = std::time::Instant::now();
    let mut buf = Vec::new();
    let read = tokio::time::timeout(std::time::Duration::from_secs(5), slow.read_to_end(&mut buf)).await;
    assert!(read.is_ok(), "the slow connection was still open after 5 s");
    let waited = started.elapsed();
    assert!(waited >= std::time::Duration::from_millis(400), "closed after {waited:?}, before the timeout");
    assert!(!String::from_utf8_lossy(&buf).contains("200 OK"), "a partial request got an answer: {buf:?}");

    // A complete request is served.
    let mut ok = tokio::net::TcpStream::connect(address).await.unwrap();
    ok.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut answer = String::new();
    ok.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    stop.send(()).unwrap();
    let result = tokio::time::timeout(std::time::Duration::from_secs(10), server).await;
    assert!(matches!(result, Ok(Ok(Ok(())))), "the server did not stop cleanly: {result:?}");
}

#[tokio::test]
async fn the_responses_api_answers_in_its_shape() {
    let state = start(config()).await;
    let (status, v) = send_json(&state, post("/v1/responses", json!({"input": "hi", "instructions": "x"}))).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "response");
    assert_eq!(v["status"], "completed");
    assert_eq!(v["output"][0]["type"], "message");
    assert_eq!(v["output"][0]["content"][0]["text"], "Hello world! The answer is 42.");
    assert_eq!(v["instructions"], "x");
    assert_eq!(v["usage"]["output_tokens"], 31);
    let (_, _, body) = send(&state, post("/v1/responses", json!({"input": "hi", "stream": true}))).await;
    let kinds: Vec<String> = sse_data(&body)
        .iter()
        .map(|d| serde_json::from_str::<Value>(d).unwrap()["type"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(kinds.first().map(String::as_str), Some("response.created"));
    assert_eq!(kinds.last().map(String::as_str), Some("response.completed"));
    assert!(kinds.iter().filter(|k| *k == "response.output_text.delta").count() > 3);
    let (status, v) =
        send_json(&state, post("/v1/responses", json!({"input": "hi", "previous_response_id": "r"}))).await;
    assert_eq!((status, v["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("previous_response_id")));
    let (status, v) =
        send_json(&state, post("/v1/responses", json!({"input": [{"type": "function_call_output"}]}))).await;
    assert_eq!((status, v["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("input[0].call_id")));
}

#[tokio::test]
async fn anthropic_messages_answer_and_fail_in_anthropic_shape() {
    let mut c = config();
    c.api_key = Some("sekret".into());
    let state = start(c).await;
    let with_key = |body: Value| {
        Request::post("/v1/messages")
            .header("content-type", "application/json")
            .header("x-api-key", "sekret")
            .body(Body::from(body.to_string()))
            .unwrap()
    };
    let (status, v) =
        send_json(&state, with_key(json!({"max_tokens": 34, "system": "s", "messages": user("hi")}))).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!((v["type"].as_str(), v["role"].as_str()), (Some("message"), Some("assistant")));
    assert_eq!(v["content"][0], json!({"type": "text", "text": "Hello world! The answer is 42."}));
    assert_eq!(v["stop_reason"], "end_turn");
    assert_eq!(v["usage"]["output_tokens"], 31);
    let (_, v) = send_json(&state, with_key(json!({"max_tokens": 5, "messages": user("hi")}))).await;
    assert_eq!(v["stop_reason"], "max_tokens");
    let (status, v) = send_json(&state, with_key(json!({"messages": user("hi")}))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(v["error"]["message"].as_str().unwrap().contains("max_tokens"));
    let (_, _, body) = send(&state, with_key(json!({"max_tokens": 34, "stream": true, "messages": user("hi")}))).await;
    let events: Vec<&str> = body.lines().filter_map(|l| l.strip_prefix("event: ")).collect();
    assert_eq!(events[..3], ["message_start", "ping", "content_block_start"]);
    assert_eq!(events[events.len() - 3..], ["content_block_stop", "message_delta", "message_stop"]);
    let text: String = sse_data(&body)
        .iter()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter(|v| v["type"] == "content_block_delta")
        .map(|v| v["delta"]["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(text, "Hello world! The answer is 42.");
    let wrong = Request::post("/v1/messages").header("x-api-key", "nope").body(Body::from("{}")).unwrap();
    let (status, v) = send_json(&state, wrong).await;
    assert_eq!((status, v["error"]["type"].as_str()), (StatusCode::UNAUTHORIZED, Some("authentication_error")));
    let (status, v) = send_json(
        &state,
        Request::post("/v1/messages/count_tokens")
            .header("x-api-key", "sekret")
            .body(Body::from(json!({"messages": user("hi")}).to_string()))
            .unwrap(),
    )
    .await;
    assert_eq!((status, v["input_tokens"].as_u64()), (StatusCode::OK, Some(20)));
}
