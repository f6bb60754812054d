//! Errors of the server, in OpenAI's shape.
//!
//! Every failure a client can see is an [`ApiError`]: an HTTP status and the JSON body
//! `{"error": {"message", "type", "param", "code"}}` that OpenAI's clients parse. Engine errors
//! ([`KylinError`]) are mapped here once: `INPUT_INVALID` and `CONTEXT_OVERFLOW` are the
//! client's fault (400), anything else is the server's (500). [`ServerError`] is what
//! [`crate::serve`] itself can fail with.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use kylin_loader::{ErrorCode, KylinError};
use serde_json::json;

/// A failure reported to the client as an OpenAI error object.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`, e.g. `invalid_request_error`.
    pub kind: &'static str,
    /// The request field at fault, where there is one.
    pub param: Option<String>,
    /// A stable machine-readable code, e.g. `context_length_exceeded` or `INPUT_INVALID`.
    pub code: Option<String>,
    /// Seconds for the `Retry-After` header (429 and 503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), kind, param: None, code: None, retry_after: None }
    }

    /// Names the request field at fault.
    pub fn param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    pub fn code(mut self, code: impl Into<String>) -> Self {
        self.code = Some(code.into());
        self
    }

    /// 400: the request is malformed or asks for something this server does not do.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message).param(param)
    }

    /// 400: the body is not a JSON object at all (no single field to blame).
    pub fn invalid_body(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400 with OpenAI's `context_length_exceeded` code; the message carries both numbers.
    pub fn context_overflow(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::invalid(param, message).code("context_length_exceeded")
    }

    /// 401: the API key is missing or wrong.
    pub fn unauthorized() -> Self {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "a valid API key is required: send it as `Authorization: Bearer KEY`",
        )
        .code("invalid_api_key")
    }

    /// 404: the request names a model this server does not serve.
    pub fn model_not_found(model: &str, served: &str) -> Self {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("the model `{model}` does not exist; this server serves `{served}`"),
        )
        .param("model")
        .code("model_not_found")
    }

    /// 404: no such route.
    pub fn route_not_found(method: &str, path: &str) -> Self {
        ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", format!("no route for {method} {path}"))
            .code("not_found")
    }

    /// 405: the route exists but not with this method.
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            format!("{path} does not accept {method}"),
        )
        .code("method_not_allowed")
    }

    /// 413: the body is larger than `--max-body-bytes`.
    pub fn too_large(limit: usize) -> Self {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("the request body is larger than the server's limit of {limit} bytes"),
        )
        .code("body_too_large")
    }

    /// 408: the client did not send its body in time.
    pub fn body_timeout(seconds: u64) -> Self {
        ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            format!("the request body was not received within {seconds} s"),
        )
        .code("body_timeout")
    }

    /// 429: the queue is full; the client should retry later.
    pub fn queue_full(limit: usize) -> Self {
        let mut e = ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            format!("the server is at its limit of {limit} requests (running and queued); retry later"),
        )
        .code("queue_full");
        e.retry_after = Some(1);
        e
    }

    /// 503: the model is still loading or the server is shutting down.
    pub fn unavailable(message: impl Into<String>) -> Self {
        let mut e = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", message).code("unavailable");
        e.retry_after = Some(1);
        e
    }

    /// 500: the server or the engine failed (never because of the request's content).
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message).code("internal_error")
    }

    /// Maps an engine error. It blames the parameter the engine named (`KylinError::field`),
    /// else `param`, the field the request's input came from.
    pub fn from_engine(err: &KylinError, param: &str) -> Self {
        let param = err.field.unwrap_or(param);
        match err.code {
            ErrorCode::InputInvalid | ErrorCode::ImageInvalid => {
                ApiError::invalid(param, err.message.clone()).code(err.code.as_str())
            }
            ErrorCode::ContextOverflow => ApiError::context_overflow(param, err.message.clone()),
            _ => ApiError::internal(err.to_string()).code(err.code.as_str()),
        }
    }

    /// The JSON body, `{"error": {...}}`.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(seconds) = self.retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

/// Why [`crate::serve`] stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The engine could not be built (the model failed to load); the message is the engine's.
    #[error("{0}")]
    EngineFailed(KylinError),
    /// The listener or a connection failed.
    #[error("the HTTP server failed: {0}")]
    Io(#[from] std::io::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_engine_error_blames_the_field_it_names_else_the_prompt() {
        let overflow = KylinError::context_overflow("the request asks for 4001 tokens").for_field("max_tokens");
        let e = ApiError::from_engine(&overflow, "messages");
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert_eq!(e.code.as_deref(), Some("context_length_exceeded"));
        let prompt = KylinError::input_invalid("token id 9 is outside the vocabulary");
        assert_eq!(ApiError::from_engine(&prompt, "prompt").param.as_deref(), Some("prompt"));
        // A message that merely mentions a parameter no longer moves the blame.
        let mention = KylinError::input_invalid("the prompt mentions max_tokens");
        assert_eq!(ApiError::from_engine(&mention, "input").param.as_deref(), Some("input"));
    }
}
