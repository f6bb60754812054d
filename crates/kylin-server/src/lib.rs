//! `kylin serve`: an OpenAI-compatible HTTP server over any [`kylin_engine::Serving`] engine.
//!
//! The engine knows nothing of HTTP: it lives on its own thread ([`engine`]), and the axum
//! handlers ([`routes`]) talk to it over channels. [`app`] builds the router, so tests drive it
//! without a socket; [`serve`] runs it on a listener until a shutdown signal, then lets the
//! running requests finish within a grace period.
//!
//! Guarantees:
//! * `/health` is public and answers 200 only when the engine is ready; every other route
//!   needs the API key when one is set (`Authorization: Bearer` or Anthropic's `x-api-key`).
//! * At most `max_seqs + max_queue` generation requests are admitted at once; the rest get 429
//!   with `Retry-After`.
//! * Every error is in its API's shape (OpenAI's `{"error": {...}}`, Anthropic's
//!   `{"type": "error", ...}` under `/v1/messages`); a panic in a handler (there should be
//!   none) becomes a 500 without affecting other requests.

pub mod anthropic;
pub mod api;
pub mod chat;
pub mod engine;
pub mod error;
pub mod images;
pub mod kv_events;
pub mod metrics;
pub mod multi;
pub mod responses;
pub mod retrieval;
pub mod routes;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

pub use crate::engine::{EngineFactory, EngineHandle, Published, Status};
pub use crate::error::{ApiError, ServerError};
use crate::metrics::Metrics;

/// How the server behaves, fixed at start.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The name clients put in `model` (and `/v1/models` lists).
    pub served_model_name: String,
    /// When set, every route but `/health` needs `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// Requests admitted beyond the engine's `max_seqs` (they wait in the engine's queue).
    pub max_queue: usize,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Time a client has to send its whole body.
    pub body_timeout: Duration,
    /// Time a client has to send a request's headers (a connection that sends them slowly, or
    /// opens and says nothing, is closed): the slow-client guard before the body's.
    pub header_read_timeout: Duration,
    /// Time running requests get to finish after a shutdown signal.
    pub grace_period: Duration,
    /// Where the engine publishes its prefix cache's changes (vLLM's KV-cache events).
    pub kv_events: Option<kv_events::KvEventSender>,
    /// The directory (canonical) requests may name images in by local path; `None`: only
    /// `data:` URLs.
    pub allowed_local_media_path: Option<std::path::PathBuf>,
    /// The image processor settings a request's `mm_processor_kwargs` starts from (`kylin serve
    /// --mm-processor-kwargs`), checked against the model when an image arrives.
    pub image_defaults: kylin_engine::vision::ImageOptions,
}

impl ServerConfig {
    pub fn new(served_model_name: impl Into<String>) -> Self {
        ServerConfig {
            served_model_name: served_model_name.into(),
            api_key: None,
            max_queue: 64,
            max_body_bytes: 32 << 20,
            body_timeout: Duration::from_secs(30),
            header_read_timeout: Duration::from_secs(30),
            grace_period: Duration::from_secs(30),
            kv_events: None,
            allowed_local_media_path: None,
            image_defaults: Default::default(),
        }
    }
}

pub(crate) struct Inner {
    config: ServerConfig,
    engine: EngineHandle,
    metrics: Arc<Metrics>,
    in_flight: AtomicUsize,
    response_ids: AtomicU64,
    started: u64,
    /// The grammar compiler, once the engine has built it.
    grammar: std::sync::OnceLock<Arc<kylin_engine::grammar::GrammarCompiler>>,
}

/// What every handler shares: the configuration, the engine handle, the metrics and the
/// admission count. Cheap to clone.
#[derive(Clone)]
pub struct AppState(pub(crate) Arc<Inner>);

impl AppState {
    /// Starts the engine thread (which builds the engine with `factory`) and returns the state
    /// with the thread's handle, to be joined after [`EngineHandle::stop`].
    pub fn start(config: ServerConfig, factory: EngineFactory) -> std::io::Result<(AppState, JoinHandle<()>)> {
        let metrics = Arc::new(Metrics::new(&config.served_model_name));
        let (engine, join) = EngineHandle::spawn(factory, metrics.clone(), config.kv_events.clone())?;
        let started = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let inner = Inner {
            config,
            engine,
            metrics,
            in_flight: AtomicUsize::new(0),
            response_ids: AtomicU64::new(0),
            started,
            grammar: std::sync::OnceLock::new(),
        };
        Ok((AppState(Arc::new(inner)), join))
    }

    pub fn config(&self) -> &ServerConfig {
        &self.0.config
    }

    pub fn engine(&self) -> &EngineHandle {
        &self.0.engine
    }

    pub fn metrics(&self) -> &Metrics {
        &self.0.metrics
    }

    /// Generation requests admitted and not yet answered.
    pub fn in_flight(&self) -> usize {
        self.0.in_flight.load(Ordering::Acquire)
    }

    pub(crate) fn started(&self) -> u64 {
        self.0.started
    }

    pub(crate) fn next_response_id(&self) -> String {
        let n = self.0.response_ids.fetch_add(1, Ordering::Relaxed);
        format!("{:x}{n:06x}", self.0.started)
    }

    /// A seed for a request that gives none: different for every request.
    pub(crate) fn random_seed(&self) -> u64 {
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        nanos ^ self.0.response_ids.load(Ordering::Relaxed).wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }

    /// Takes an admission slot, or 429 when `max_seqs + max_queue` requests are in flight.
    pub(crate) fn admit(&self) -> Result<Admission, ApiError> {
        let max_seqs = self.engine().published().map_or(1, |p| p.info.max_seqs);
        let limit = max_seqs + self.config().max_queue;
        let taken =
            self.0.in_flight.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < limit).then_some(n + 1));
        match taken {
            Ok(_) => Ok(Admission(self.clone())),
            Err(_) => {
                self.metrics().count_rejected();
                Err(ApiError::queue_full(limit))
            }
        }
    }
}

/// An admission slot, given back when dropped.
pub(crate) struct Admission(AppState);

impl Drop for Admission {
    fn drop(&mut self) {
        self.0.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Checks the API key on every route but `/health`.
async fn require_key(State(state): State<AppState>, request: Request, next: Next) -> Response {
    match key_rejection(state.config().api_key.as_deref(), &request) {
        Some(rejection) => rejection,
        None => next.run(request).await,
    }
}

/// The 401 a request gets when `key` is set and the request does not carry it (`/health` needs
/// no key), in the shape of the API the route belongs to; `None` when it may pass.
pub(crate) fn key_rejection(key: Option<&str>, request: &Request) -> Option<Response> {
    let key = key?;
    if request.uri().path() == "/health" {
        return None;
    }
    // `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's).
    let bearer = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let x_api_key = request.headers().get("x-api-key").and_then(|v| v.to_str().ok()).map(str::trim);
    let matches = |given: Option<&str>| given.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes()));
    if matches(bearer) || matches(x_api_key) {
        return None;
    }
    if request.uri().path().starts_with("/v1/messages") {
        let mut e = ApiError::unauthorized();
        e.message = "a valid API key is required: send it as `x-api-key: KEY`".into();
        return Some(anthropic::AnthropicError(e).into_response());
    }
    Some(ApiError::unauthorized().into_response())
}

/// Compares without stopping at the first difference, so timing does not leak the key.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for (i, &x) in a.iter().enumerate() {
        diff |= usize::from(x ^ b.get(i % b.len().max(1)).copied().unwrap_or(0));
    }
    diff == 0
}

/// The router: every route of the server over `state`.
pub fn app(state: AppState) -> Router {
    Router::new()
        .route("/health", get(routes::health))
        .route("/metrics", get(routes::metrics))
        .route("/v1/models", get(routes::models))
        .route("/v1/chat/completions", post(routes::chat))
        .route("/v1/completions", post(routes::completions))
        .route("/v1/responses", post(responses::responses))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/embeddings", post(retrieval::embeddings))
        .route("/v1/rerank", post(retrieval::rerank))
        .route("/v1/reranking", post(retrieval::rerank))
        .route("/rerank", post(retrieval::rerank))
        .route("/tokenize", post(routes::tokenize))
        .route("/detokenize", post(routes::detokenize))
        .fallback(routes::not_found)
        .method_not_allowed_fallback(|request: Request| async move {
            ApiError::method_not_allowed(request.method().as_str(), request.uri().path())
        })
        .layer(middleware::from_fn_with_state(state.clone(), require_key))
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(|_| {
            ApiError::internal("the request handler panicked; this is a bug in kylin").into_response()
        }))
        .with_state(state)
}

/// Accepts HTTP/1 connections on `listener` and serves `app` on each until `shutdown`
/// resolves; then stops accepting, asks every connection to finish its request in flight and
/// close, and returns once all have closed.
///
/// Each connection has a timer and `header_timeout` to deliver a request's headers (hyper
/// closes it otherwise), which `axum::serve` does not set. Accept errors (a peer that reset
/// before being accepted, or no file descriptors left) never stop the loop; the latter backs
/// off for a moment.
pub(crate) async fn accept_loop(
    listener: tokio::net::TcpListener,
    app: Router,
    header_timeout: Duration,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;
    use tokio::sync::watch;

    // Dropping `stop_tx` tells the connections to finish; `done_tx.closed()` resolves once every
    // connection task has dropped its `done_rx`.
    let (stop_tx, stop_rx) = watch::channel(());
    let (done_tx, done_rx) = watch::channel(());
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) if matches!(e.raw_os_error(), Some(23 | 24)) => {
                    // ENFILE / EMFILE: wait for connections to close rather than spin.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
                Err(_) => continue,
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let mut stop_rx = stop_rx.clone();
        let done_rx = done_rx.clone();
        tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.timer(TokioTimer::new()).header_read_timeout(header_timeout);
            let mut conn = std::pin::pin!(builder.serve_connection(TokioIo::new(stream), service));
            let mut stopping = false;
            loop {
                tokio::select! {
                    _ = conn.as_mut() => break,
                    _ = stop_rx.changed(), if !stopping => {
                        stopping = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            }
            drop(done_rx);
        });
    }
    drop(listener);
    drop(stop_tx);
    drop(done_rx);
    done_tx.closed().await;
    Ok(())
}

/// Serves `state` on `listener` until `shutdown` resolves (or the engine fails to load), then
/// stops accepting, lets running requests finish for up to the grace period, cancels what is
/// left, and stops the engine thread.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    engine_thread: JoinHandle<()>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let engine = state.engine().clone();
    let signal_engine = engine.clone();
    let signal = async move {
        tokio::select! {
            () = shutdown => {}
            () = signal_engine.wait_shutdown() => {}
        }
        signal_engine.begin_shutdown();
    };
    let grace = state.config().grace_period;
    let header_timeout = state.config().header_read_timeout;
    let server = accept_loop(listener, app(state), header_timeout, signal);
    let mut server = std::pin::pin!(server);
    let result = tokio::select! {
        r = &mut server => r,
        () = async { engine.wait_shutdown().await; tokio::time::sleep(grace).await } => {
            // The grace period is over: cancel what is left and give the connections a moment
            // to see their requests end.
            engine.cancel_all();
            match tokio::time::timeout(Duration::from_secs(2), &mut server).await {
                Ok(r) => r,
                Err(_) => Ok(()),
            }
        }
    };
    engine.cancel_all();
    engine.stop();
    let _ = tokio::task::spawn_blocking(move || engine_thread.join()).await;
    if let Status::Failed(e) = engine.status() {
        return Err(ServerError::EngineFailed(e));
    }
    result.map_err(ServerError::Io)
}
