//! The retrieval endpoints: `POST /v1/embeddings` (OpenAI's shape) and `POST /v1/rerank` (the
//! shape llama-server, Cohere and Jina share; also at `/rerank` and `/v1/reranking`).
//!
//! Guarantees:
//! * Requests are read field by field as the other endpoints are: a wrong type, a value out of
//!   range or an unknown field is a 400 naming the field; an input longer than the model reads
//!   is a 400 `context_length_exceeded` naming `input` (or `documents`).
//! * A request's inputs run as one batch on the engine thread, between the steps of the
//!   generation traffic; they hold an admission slot while they do.
//! * `dimensions` truncates each embedding (Matryoshka models) and normalises it again when the
//!   model's embeddings are normalised; `encoding_format: base64` is the little-endian float32
//!   bytes, as OpenAI sends them.

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use crate::AppState;
use crate::api::Fields;
use crate::engine::Prompt;
use crate::error::ApiError;
use crate::routes::{check_model, read_body, ready};

/// The most inputs one embeddings request may hold, and documents one rerank request.
pub const MAX_INPUTS: usize = 2048;

#[derive(serde::Deserialize)]
#[serde(untagged)]
enum RawInput {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

/// `POST /v1/embeddings`: `input`, `model`, `encoding_format`, `dimensions`, `user`; Kylin's
/// extension `prompt_name` prefixes the model's named prompt (e.g. `query`) to every text.
pub async fn embeddings(State(state): State<AppState>, request: Request) -> Result<Response, ApiError> {
    let published = ready(&state)?.clone();
    let (parts, body) = request.into_parts();
    let body = read_body(&state, &parts.headers, body).await?;
    let mut f = Fields::parse(&body)?;
    let model: Option<String> = f.take("model", "a string")?;
    let input = f
        .take::<RawInput>("input", "a string, a list of strings, or token ids")?
        .ok_or_else(|| ApiError::invalid("input", "`input` is required"))?;
    let format: Option<String> = f.take("encoding_format", "`float` or `base64`")?;
    let base64 = match format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid(
                "encoding_format",
                format!("`encoding_format` must be `float` or `base64`; got `{other}`"),
            ));
        }
    };
    let dimensions: Option<usize> = f.take("dimensions", "a positive integer")?;
    let prompt_name: Option<String> = f.take("prompt_name", "a string")?;
    f.finish()?;
    check_model(&state, model.as_deref())?;
    let Some(info) = published.embedding.clone() else {
        return Err(ApiError::invalid(
            "model",
            format!(
                "`{}` does not make embeddings; serve an embedding model (a BERT/XLM-R sentence-transformers directory, Qwen3-Embedding, or a decoder with --task embed)",
                state.config().served_model_name
            ),
        )
        .code("model_not_supported"));
    };
    if let Some(d) = dimensions
        && (d == 0 || d > info.dimension)
    {
        return Err(ApiError::invalid(
            "dimensions",
            format!("`dimensions` must be between 1 and the model's {}; got {d}", info.dimension),
        ));
    }
    let prefix = match &prompt_name {
        None => String::new(),
        Some(name) => info.prompts.get(name).cloned().ok_or_else(|| {
            let known: Vec<&str> = info.prompts.keys().map(String::as_str).collect();
            ApiError::invalid("prompt_name", format!("the model has no prompt `{name}`; it has: {}", known.join(", ")))
        })?,
    };
    let prompts: Vec<Prompt> = match input {
        RawInput::Text(t) => vec![Prompt::Text(format!("{prefix}{t}"))],
        RawInput::Texts(v) => v.into_iter().map(|t| Prompt::Text(format!("{prefix}{t}"))).collect(),
        RawInput::Ids(ids) => vec![Prompt::Ids(ids)],
        RawInput::IdLists(v) => v.into_iter().map(Prompt::Ids).collect(),
    };
    if prompts.is_empty() || prompts.len() > MAX_INPUTS {
        return Err(ApiError::invalid("input", format!("`input` must hold 1 to {MAX_INPUTS} inputs")));
    }
    let vocab = published.info.vocab_size;
    for p in &prompts {
        match p {
            Prompt::Ids(ids) if ids.is_empty() => return Err(ApiError::invalid("input", "an input has no tokens")),
            Prompt::Ids(ids) if ids.iter().any(|&id| id as usize >= vocab) => {
                return Err(ApiError::invalid("input", format!("a token id is outside the vocabulary of {vocab} ids")));
            }
            Prompt::Text(t) if t.is_empty() => {
                return Err(ApiError::invalid("input", "an input is the empty string"));
            }
            _ => {}
        }
    }
    let _admission = state.admit()?;
    let (vectors, tokens) = state.engine().embed(prompts).await.map_err(|e| ApiError::from_engine(&e, "input"))?;
    let data: Vec<Value> = vectors
        .into_iter()
        .enumerate()
        .map(|(i, mut v)| {
            if let Some(d) = dimensions {
                v.truncate(d);
                if info.normalized {
                    kylin_engine::encoder::normalize_in_place(&mut v);
                }
            }
            let embedding = if base64 { json!(encode_base64(&v)) } else { json!(v) };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    Ok(axum::Json(json!({
        "object": "list",
        "data": data,
        "model": state.config().served_model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
    .into_response())
}

/// `POST /v1/rerank`: `query`, `documents` (strings or `{"text"}` objects), `top_n`,
/// `return_documents`, `model`. Results are sorted by `relevance_score`, best first.
pub async fn rerank(State(state): State<AppState>, request: Request) -> Result<Response, ApiError> {
    let published = ready(&state)?.clone();
    let (parts, body) = request.into_parts();
    let body = read_body(&state, &parts.headers, body).await?;
    let mut f = Fields::parse(&body)?;
    let model: Option<String> = f.take("model", "a string")?;
    let query: String =
        f.take("query", "a string")?.ok_or_else(|| ApiError::invalid("query", "`query` is required"))?;
    let raw: Vec<Value> = f
        .take("documents", "a list of strings or {\"text\"} objects")?
        .ok_or_else(|| ApiError::invalid("documents", "`documents` is required"))?;
    let top_n: Option<usize> = f.take("top_n", "a positive integer")?;
    let return_documents = f.take::<bool>("return_documents", "a boolean")?.unwrap_or(false);
    // Kylin's extension: a yes/no reranker's task instruction (Qwen3-Reranker's `<Instruct>`).
    let instruction: Option<String> = f.take("instruction", "a string")?;
    // Cohere's and Jina's fields that change nothing here.
    f.take::<Value>("max_chunks_per_doc", "an integer")?;
    f.refuse_unless("rank_fields", |_| false, "structured documents are not supported")?;
    f.finish()?;
    check_model(&state, model.as_deref())?;
    if !published.rerank {
        return Err(ApiError::invalid(
            "model",
            format!(
                "`{}` does not rerank; serve a reranker (a cross-encoder such as bge-reranker, Qwen3-Reranker, or a decoder with --task rerank)",
                state.config().served_model_name
            ),
        )
        .code("model_not_supported"));
    }
    if raw.is_empty() || raw.len() > MAX_INPUTS {
        return Err(ApiError::invalid("documents", format!("`documents` must hold 1 to {MAX_INPUTS} documents")));
    }
    let mut documents = Vec::with_capacity(raw.len());
    for (i, d) in raw.into_iter().enumerate() {
        documents.push(match d {
            Value::String(s) => s,
            Value::Object(mut m) => match m.remove("text") {
                Some(Value::String(s)) => s,
                _ => return Err(ApiError::invalid(format!("documents[{i}].text"), "a document object needs `text`")),
            },
            _ => return Err(ApiError::invalid(format!("documents[{i}]"), "a document is a string or {\"text\"}")),
        });
    }
    if top_n == Some(0) {
        return Err(ApiError::invalid("top_n", "`top_n` must be at least 1"));
    }
    let _admission = state.admit()?;
    // An error about the instruction names it (the engine's `field`); others the documents.
    let (scores, tokens) = state
        .engine()
        .rerank(query, documents.clone(), instruction)
        .await
        .map_err(|e| ApiError::from_engine(&e, "documents"))?;
    let mut order: Vec<usize> = (0..scores.len()).collect();
    // Best first; equal scores keep the documents' order.
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    order.truncate(top_n.unwrap_or(order.len()));
    let results: Vec<Value> = order
        .into_iter()
        .map(|i| {
            let mut r = Map::new();
            r.insert("index".into(), json!(i));
            r.insert("relevance_score".into(), json!(scores[i]));
            if return_documents {
                r.insert("document".into(), json!({"text": documents[i]}));
            }
            Value::Object(r)
        })
        .collect();
    Ok(axum::Json(json!({
        "id": format!("rerank-{}", state.next_response_id()),
        "object": "list",
        "model": state.config().served_model_name,
        "results": results,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
    .into_response())
}

/// Standard base64 (with padding) of the little-endian bytes of `v`.
fn encode_base64(v: &[f32]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], chunk.get(1).copied().unwrap_or(0), chunk.get(2).copied().unwrap_or(0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for k in 0..4 {
            if k <= chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * k)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_of_floats() {
        // 1.0f32 is 00 00 80 3f.
        assert_eq!(super::encode_base64(&[1.0]), "AACAPw==");
        assert_eq!(super::encode_base64(&[]), "");
    }
}
