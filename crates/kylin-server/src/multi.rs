//! Many models behind one server (`kylin serve --models-dir DIR` or `--models FILE`): every
//! model is served under its name, loaded on its first request, kept within a memory budget
//! (the least recently used idle models are unloaded to make room), and listed with its state by
//! `/v1/models`; admin routes load, unload and pin one.
//!
//! Each loaded model is a whole single-model server ([`crate::app`] over its own
//! [`AppState`] and engine thread); the [`ModelPool`]'s router reads a request's body once,
//! picks the model its `model` field names, and hands the request to that model's router. The
//! handlers of every API therefore behave exactly as they do with one model.
//!
//! Guarantees:
//! * A request for a model that is loading waits for it (at most `load_timeout`), then gets 503
//!   with `Retry-After`; a model that failed to load answers with its load error.
//! * A model is unloaded only when no request holds it: a request holds its model from the
//!   moment it is routed until its response (a stream included) is complete or dropped, and the
//!   check and the hold happen under the same lock.
//! * The memory a model counts is its weight files' bytes (they are mapped, not copied) plus its
//!   KV cache and recurrent state pool as the engine reports them once built (the estimate
//!   given at configuration before). A model whose count alone exceeds the budget is refused
//!   with a clear error; pinned models are never unloaded to make room.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::StreamExt;
use kylin_loader::KylinError;
use serde_json::{Value, json};
use tower::ServiceExt;

use crate::engine::{EngineFactory, Status};
use crate::error::{ApiError, ServerError};
use crate::{AppState, ServerConfig, anthropic};

/// Builds a fresh engine factory for a model each time it is loaded.
pub type EngineMaker = Arc<dyn Fn() -> EngineFactory + Send + Sync>;

/// One model the pool can serve.
pub struct ModelEntry {
    /// The name clients put in `model`.
    pub name: String,
    /// Where it comes from (a directory or a file), shown by `/v1/models`.
    pub source: String,
    /// Bytes of its weight files.
    pub weight_bytes: u64,
    /// Bytes its KV cache and state pool are expected to take, until the engine reports them.
    pub cache_estimate: u64,
    /// Loaded at start and never unloaded to make room for another model.
    pub pinned: bool,
    /// Builds the engine (on the model's engine thread).
    pub make_engine: EngineMaker,
}

/// How the pool behaves, fixed at start.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// The server's settings: API key, admission, body and header limits, grace period (its
    /// `served_model_name` is not used: every model is served under its own).
    pub server: ServerConfig,
    /// Memory the loaded models may count together.
    pub memory_budget: u64,
    /// How long a request waits for its model to load.
    pub load_timeout: Duration,
}

/// Where a model is in its life, as `/v1/models` reports it.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelState {
    Unloaded,
    Loading,
    Loaded,
    /// The last load failed; the next `POST /models/load` tries again.
    Failed(KylinError),
}

impl ModelState {
    pub fn as_str(&self) -> &'static str {
        match self {
            ModelState::Unloaded => "unloaded",
            ModelState::Loading => "loading",
            ModelState::Loaded => "loaded",
            ModelState::Failed(_) => "failed",
        }
    }
}

/// A started model: its server state, router and engine thread.
struct Running {
    app: AppState,
    router: Router,
    thread: Option<JoinHandle<()>>,
}

enum Slot {
    Unloaded,
    Running(Running),
    Failed(KylinError),
}

struct ModelSlot {
    entry: ModelEntry,
    slot: Mutex<Slot>,
    /// The pool's clock when the model was last used (higher is more recent).
    last_used: AtomicU64,
    pinned: AtomicBool,
    /// Requests holding the model (see [`Hold`]).
    holds: AtomicUsize,
}

impl ModelSlot {
    fn lock(&self) -> MutexGuard<'_, Slot> {
        // A panic while the lock was held leaves a consistent `Slot` (every change is one
        // assignment), so a poisoned lock is used as is.
        self.slot.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

struct PoolInner {
    config: PoolConfig,
    models: Vec<ModelSlot>,
    clock: AtomicU64,
    /// Serializes the decisions that load and unload (making room, then starting).
    loader: tokio::sync::Mutex<()>,
    /// Woken when a hold is released, for a load waiting for room.
    released: tokio::sync::Notify,
    loads: AtomicU64,
    unloads: AtomicU64,
    started: u64,
}

/// The models and their states. Cheap to clone.
#[derive(Clone)]
pub struct ModelPool(Arc<PoolInner>);

/// A request's hold on a loaded model, released when dropped.
struct Hold {
    pool: ModelPool,
    index: usize,
}

impl Drop for Hold {
    fn drop(&mut self) {
        let pool = &self.pool.0;
        pool.models[self.index].last_used.store(pool.clock.fetch_add(1, Ordering::AcqRel) + 1, Ordering::Release);
        pool.models[self.index].holds.fetch_sub(1, Ordering::AcqRel);
        pool.released.notify_waiters();
    }
}

impl ModelPool {
    /// The pool over `entries` (names must be unique; the caller checks). Nothing loads yet:
    /// [`ModelPool::load_pinned`] loads the pinned ones.
    pub fn new(config: PoolConfig, entries: Vec<ModelEntry>) -> ModelPool {
        let started = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let models = entries
            .into_iter()
            .map(|entry| ModelSlot {
                pinned: AtomicBool::new(entry.pinned),
                entry,
                slot: Mutex::new(Slot::Unloaded),
                last_used: AtomicU64::new(0),
                holds: AtomicUsize::new(0),
            })
            .collect();
        ModelPool(Arc::new(PoolInner {
            config,
            models,
            clock: AtomicU64::new(0),
            loader: tokio::sync::Mutex::new(()),
            released: tokio::sync::Notify::new(),
            loads: AtomicU64::new(0),
            unloads: AtomicU64::new(0),
            started,
        }))
    }

    pub fn config(&self) -> &PoolConfig {
        &self.0.config
    }

    /// The served names, in configuration order.
    pub fn names(&self) -> Vec<&str> {
        self.0.models.iter().map(|m| m.entry.name.as_str()).collect()
    }

    /// A model's state.
    pub fn state(&self, name: &str) -> Option<ModelState> {
        let index = self.index(name).ok()?;
        Some(self.state_at(index))
    }

    fn state_at(&self, index: usize) -> ModelState {
        match &*self.0.models[index].lock() {
            Slot::Unloaded => ModelState::Unloaded,
            Slot::Failed(e) => ModelState::Failed(e.clone()),
            Slot::Running(r) => match r.app.engine().status() {
                Status::Loading => ModelState::Loading,
                Status::Ready => ModelState::Loaded,
                Status::ShuttingDown => ModelState::Unloaded,
                Status::Failed(e) => ModelState::Failed(e),
            },
        }
    }

    fn index(&self, name: &str) -> Result<usize, ApiError> {
        self.0.models.iter().position(|m| m.entry.name == name).ok_or_else(|| {
            let served = self.names().iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ");
            ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("the model `{name}` does not exist; this server serves {served}"),
            )
            .param("model")
            .code("model_not_found")
        })
    }

    /// The bytes a model counts while started: its weights, and its caches as the engine
    /// reports them (the configured estimate until it is built).
    fn counted_bytes(&self, index: usize) -> u64 {
        let model = &self.0.models[index];
        match &*model.lock() {
            Slot::Running(r) => {
                let caches = match r.app.engine().published() {
                    Some(p) => p.info.kv_bytes + p.info.state_pool.map_or(0, |s| s.bytes),
                    None => model.entry.cache_estimate,
                };
                model.entry.weight_bytes + caches
            }
            Slot::Unloaded | Slot::Failed(_) => 0,
        }
    }

    /// Bytes the started models count together.
    pub fn used_bytes(&self) -> u64 {
        (0..self.0.models.len()).map(|i| self.counted_bytes(i)).sum()
    }

    /// Loads every pinned model (at start), waiting for each.
    pub async fn load_pinned(&self) -> Vec<(String, Result<(), ApiError>)> {
        let mut results = Vec::new();
        for (index, model) in self.0.models.iter().enumerate() {
            if model.pinned.load(Ordering::Acquire) {
                let result = self.ensure_loaded(index, self.deadline()).await;
                results.push((model.entry.name.clone(), result));
            }
        }
        results
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.0.config.load_timeout
    }

    /// Routes a request to model `index`, loading it first when needed, and returns its router
    /// with a hold on it.
    async fn acquire(&self, index: usize) -> Result<(Router, Hold), ApiError> {
        let deadline = self.deadline();
        loop {
            if let Some(held) = self.try_hold(index)? {
                return Ok(held);
            }
            self.ensure_loaded(index, deadline).await?;
        }
    }

    /// Holds the model when it is ready; `None` when it must be loaded (or waited for) first.
    fn try_hold(&self, index: usize) -> Result<Option<(Router, Hold)>, ApiError> {
        let model = &self.0.models[index];
        let slot = model.lock();
        match &*slot {
            Slot::Running(r) if r.app.engine().status() == Status::Ready => {
                // Taken under the slot's lock, which an unload checks the holds under.
                model.holds.fetch_add(1, Ordering::AcqRel);
                let router = r.router.clone();
                drop(slot);
                model.last_used.store(self.0.clock.fetch_add(1, Ordering::AcqRel) + 1, Ordering::Release);
                Ok(Some((router, Hold { pool: self.clone(), index })))
            }
            Slot::Failed(e) => Err(load_failed(&model.entry.name, e)),
            _ => Ok(None),
        }
    }

    /// Makes sure model `index` is started and waits (until `deadline`) for it to be ready.
    async fn ensure_loaded(&self, index: usize, deadline: Instant) -> Result<(), ApiError> {
        let name = &self.0.models[index].entry.name;
        loop {
            let running = match &*self.0.models[index].lock() {
                Slot::Running(r) => Some(r.app.clone()),
                Slot::Failed(e) => return Err(load_failed(name, e)),
                Slot::Unloaded => None,
            };
            let Some(app) = running else {
                self.start(index, deadline).await?;
                continue;
            };
            match app.engine().status() {
                Status::Ready => return Ok(()),
                Status::Loading => {
                    let waited = tokio::time::timeout_at(deadline.into(), app.engine().wait_ready()).await;
                    match waited {
                        Err(_) => return Err(still_loading(name, self.0.config.load_timeout)),
                        Ok(Ok(_)) => return Ok(()),
                        Ok(Err(_)) => continue,
                    }
                }
                Status::Failed(e) => {
                    self.mark_failed(index, e.clone()).await;
                    return Err(load_failed(name, &e));
                }
                Status::ShuttingDown => {
                    // Being unloaded: wait for the unload to finish, then load again.
                    if Instant::now() >= deadline {
                        return Err(still_loading(name, self.0.config.load_timeout));
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    }

    /// Starts model `index` if it is unloaded, unloading idle models first while the budget
    /// has no room for it.
    async fn start(&self, index: usize, deadline: Instant) -> Result<(), ApiError> {
        let model = &self.0.models[index];
        let name = &model.entry.name;
        let Ok(_loader) = tokio::time::timeout_at(deadline.into(), self.0.loader.lock()).await else {
            return Err(still_loading(name, self.0.config.load_timeout));
        };
        if !matches!(&*model.lock(), Slot::Unloaded) {
            return Ok(());
        }
        let budget = self.0.config.memory_budget;
        let need = model.entry.weight_bytes + model.entry.cache_estimate;
        if need > budget {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                format!(
                    "the model `{name}` needs {} (weights {} and caches {}), more than the memory budget of {} \
                     (--models-memory)",
                    mib(need),
                    mib(model.entry.weight_bytes),
                    mib(model.entry.cache_estimate),
                    mib(budget)
                ),
            )
            .param("model")
            .code("memory_budget_exceeded"));
        }
        loop {
            // Registered before the checks, so that a hold released after them still wakes it.
            let released = self.0.released.notified();
            let mut released = std::pin::pin!(released);
            released.as_mut().enable();
            let used = self.used_bytes();
            if used + need <= budget {
                break;
            }
            if let Some(victim) = self.take_idle_victim(index) {
                self.stop(victim).await;
                continue;
            }
            let busy = self.0.models.iter().enumerate().any(|(i, m)| {
                i != index && !m.pinned.load(Ordering::Acquire) && matches!(&*m.lock(), Slot::Running(_))
            });
            if !busy {
                return Err(ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "service_unavailable",
                    format!(
                        "the model `{name}` needs {} but pinned models hold {} of the memory budget of {} \
                         (--models-memory); unpin or unload one (POST /models/unload)",
                        mib(need),
                        mib(used),
                        mib(budget)
                    ),
                )
                .param("model")
                .code("memory_budget_exceeded"));
            }
            // Every model that could make room is serving: wait for a request to finish.
            if tokio::time::timeout_at(deadline.into(), released).await.is_err() {
                let mut e = ApiError::unavailable(format!(
                    "the model `{name}` cannot load within {} s: the models holding the memory budget are serving \
                     requests",
                    self.0.config.load_timeout.as_secs()
                ));
                e.code = Some("memory_budget_busy".into());
                return Err(e);
            }
        }
        let mut config = self.0.config.server.clone();
        config.served_model_name = name.clone();
        config.api_key = None;
        let (app, thread) = AppState::start(config, (model.entry.make_engine)())
            .map_err(|e| ApiError::internal(format!("cannot start the engine thread for `{name}`: {e}")))?;
        let router = crate::app(app.clone());
        *model.lock() = Slot::Running(Running { app, router, thread: Some(thread) });
        model.last_used.store(self.0.clock.fetch_add(1, Ordering::AcqRel) + 1, Ordering::Release);
        self.0.loads.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Takes the least recently used started model other than `except` that is not pinned,
    /// not loading and held by no request, leaving it unloaded.
    fn take_idle_victim(&self, except: usize) -> Option<Running> {
        let mut order: Vec<usize> = (0..self.0.models.len()).filter(|&i| i != except).collect();
        order.sort_by_key(|&i| self.0.models[i].last_used.load(Ordering::Acquire));
        for i in order {
            let model = &self.0.models[i];
            if model.pinned.load(Ordering::Acquire) {
                continue;
            }
            let mut slot = model.lock();
            let idle = match &*slot {
                Slot::Running(r) => {
                    model.holds.load(Ordering::Acquire) == 0 && r.app.engine().status() != Status::Loading
                }
                _ => false,
            };
            if idle && let Slot::Running(r) = std::mem::replace(&mut *slot, Slot::Unloaded) {
                return Some(r);
            }
        }
        None
    }

    /// Stops a started model's engine and waits for its thread, which frees its memory.
    async fn stop(&self, mut running: Running) {
        let engine = running.app.engine().clone();
        engine.begin_shutdown();
        engine.cancel_all();
        engine.stop();
        if let Some(thread) = running.thread.take() {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
        self.0.unloads.fetch_add(1, Ordering::Relaxed);
    }

    async fn mark_failed(&self, index: usize, error: KylinError) {
        let previous = std::mem::replace(&mut *self.0.models[index].lock(), Slot::Failed(error));
        if let Slot::Running(mut r) = previous {
            // The engine thread waits for commands after a failed build; stop it, then join.
            r.app.engine().stop();
            if let Some(thread) = r.thread.take() {
                let _ = tokio::task::spawn_blocking(move || thread.join()).await;
            }
        }
    }

    /// `POST /models/load`: loads a model (again, after a failure) and waits for it.
    pub async fn load(&self, name: &str) -> Result<(), ApiError> {
        let index = self.index(name)?;
        {
            let mut slot = self.0.models[index].lock();
            if matches!(&*slot, Slot::Failed(_)) {
                *slot = Slot::Unloaded;
            }
        }
        self.ensure_loaded(index, self.deadline()).await
    }

    /// `POST /models/unload`: unloads a model; one serving requests is refused with 409 unless
    /// `force`, which cancels them.
    pub async fn unload(&self, name: &str, force: bool) -> Result<(), ApiError> {
        let index = self.index(name)?;
        let _loader = self.0.loader.lock().await;
        let model = &self.0.models[index];
        let running = {
            let mut slot = model.lock();
            let holds = model.holds.load(Ordering::Acquire);
            if holds > 0 && !force && matches!(&*slot, Slot::Running(_)) {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    "invalid_request_error",
                    format!(
                        "the model `{name}` is serving {holds} request(s); retry when they finish, or send \
                         \"force\": true to cancel them"
                    ),
                )
                .param("model")
                .code("model_busy"));
            }
            match std::mem::replace(&mut *slot, Slot::Unloaded) {
                Slot::Running(r) => Some(r),
                Slot::Unloaded | Slot::Failed(_) => None,
            }
        };
        if let Some(r) = running {
            self.stop(r).await;
        }
        Ok(())
    }

    /// `POST /models/pin`: a pinned model is never unloaded to make room for another.
    pub fn pin(&self, name: &str, pinned: bool) -> Result<(), ApiError> {
        let index = self.index(name)?;
        self.0.models[index].pinned.store(pinned, Ordering::Release);
        Ok(())
    }

    /// Stops every model (the end of a shutdown).
    pub async fn stop_all(&self) {
        for model in &self.0.models {
            let running = match std::mem::replace(&mut *model.lock(), Slot::Unloaded) {
                Slot::Running(r) => Some(r),
                _ => None,
            };
            if let Some(r) = running {
                self.stop(r).await;
            }
        }
    }

    /// The engines of the started models.
    fn running_engines(&self) -> Vec<crate::EngineHandle> {
        self.0
            .models
            .iter()
            .filter_map(|m| match &*m.lock() {
                Slot::Running(r) => Some(r.app.engine().clone()),
                _ => None,
            })
            .collect()
    }

    /// The `/v1/models` entry of model `index`.
    fn describe(&self, index: usize) -> Value {
        let model = &self.0.models[index];
        let state = self.state_at(index);
        let mut status = json!({
            "value": state.as_str(),
            "pinned": model.pinned.load(Ordering::Acquire),
            "memory_bytes": self.counted_bytes(index),
        });
        if let ModelState::Failed(e) = &state {
            status["error"] = json!({"code": e.code.as_str(), "message": e.message});
        }
        let mut entry = json!({
            "id": model.entry.name,
            "object": "model",
            "created": self.0.started,
            "owned_by": "kylin",
            "root": model.entry.source,
            "status": status,
        });
        if let Slot::Running(r) = &*model.lock()
            && let Some(p) = r.app.engine().published()
        {
            entry["max_model_len"] = json!(p.info.context_size);
        }
        entry
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

fn load_failed(name: &str, e: &KylinError) -> ApiError {
    let mut error = ApiError::unavailable(format!("the model `{name}` failed to load: {e}"));
    error.code = Some("model_load_failed".into());
    error.retry_after = None;
    error
}

fn still_loading(name: &str, timeout: Duration) -> ApiError {
    let mut e = ApiError::unavailable(format!("the model `{name}` is still loading after {} s", timeout.as_secs()));
    e.code = Some("model_loading".into());
    e
}

/// The routes that generate, embed, rerank or tokenize: a request to one goes to the model its
/// body names.
const MODEL_ROUTES: [&str; 11] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/embeddings",
    "/v1/rerank",
    "/v1/reranking",
    "/rerank",
    "/tokenize",
    "/detokenize",
];

/// The router of a multi-model server.
pub fn pool_app(pool: ModelPool) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/models", get(models))
        .route("/models/load", post(admin_load))
        .route("/models/unload", post(admin_unload))
        .route("/models/pin", post(admin_pin))
        .fallback(forward)
        .layer(middleware::from_fn_with_state(pool.clone(), require_key))
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(|_| {
            ApiError::internal("the request handler panicked; this is a bug in kylin").into_response()
        }))
        .with_state(pool)
}

async fn require_key(State(pool): State<ModelPool>, request: Request, next: Next) -> Response {
    match crate::key_rejection(pool.config().server.api_key.as_deref(), &request) {
        Some(rejection) => rejection,
        None => next.run(request).await,
    }
}

/// `GET /health`: 200 while the server runs, with every model's state.
async fn health(State(pool): State<ModelPool>) -> Response {
    let states: serde_json::Map<String, Value> = (0..pool.0.models.len())
        .map(|i| (pool.0.models[i].entry.name.clone(), json!(pool.state_at(i).as_str())))
        .collect();
    axum::Json(json!({"status": "ok", "models": states})).into_response()
}

/// `GET /v1/models`: every model, its state, whether it is pinned and the memory it counts.
async fn models(State(pool): State<ModelPool>) -> Response {
    let data: Vec<Value> = (0..pool.0.models.len()).map(|i| pool.describe(i)).collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

/// `GET /metrics`: every loaded model's metrics (each family once, its samples labelled by
/// model) and the pool's own.
async fn metrics(State(pool): State<ModelPool>) -> Response {
    let mut texts = Vec::new();
    for model in &pool.0.models {
        if let Slot::Running(r) = &*model.lock() {
            texts.push(r.app.metrics().render(&r.app.engine().stats()));
        }
    }
    let loaded = (0..pool.0.models.len()).filter(|&i| pool.state_at(i) == ModelState::Loaded).count();
    let own = format!(
        "# HELP kylin:models_loaded Models loaded and ready.\n# TYPE kylin:models_loaded gauge\nkylin:models_loaded {loaded}\n\
         # HELP kylin:models_memory_bytes Memory the started models count against the budget.\n\
         # TYPE kylin:models_memory_bytes gauge\nkylin:models_memory_bytes {}\n\
         # HELP kylin:models_memory_budget_bytes The memory budget of the models (--models-memory).\n\
         # TYPE kylin:models_memory_budget_bytes gauge\nkylin:models_memory_budget_bytes {}\n\
         # HELP kylin:model_loads_total Models started.\n# TYPE kylin:model_loads_total counter\nkylin:model_loads_total {}\n\
         # HELP kylin:model_unloads_total Models unloaded.\n# TYPE kylin:model_unloads_total counter\nkylin:model_unloads_total {}\n",
        pool.used_bytes(),
        pool.config().memory_budget,
        pool.0.loads.load(Ordering::Relaxed),
        pool.0.unloads.load(Ordering::Relaxed),
    );
    texts.push(own);
    let text = merge_metric_families(&texts);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

/// Merges Prometheus texts so that each family's `# HELP` and `# TYPE` appear once, followed by
/// the samples of every text, as the exposition format requires.
pub fn merge_metric_families(texts: &[String]) -> String {
    // (family name, header lines, sample lines), in the order families first appear.
    let mut families: Vec<(String, Vec<String>, Vec<String>)> = Vec::new();
    for text in texts {
        let mut current: Option<usize> = None;
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ").or_else(|| line.strip_prefix("# TYPE ")) {
                let name = rest.split_whitespace().next().unwrap_or("").to_string();
                let index = match families.iter().position(|(n, _, _)| *n == name) {
                    Some(i) => i,
                    None => {
                        families.push((name, Vec::new(), Vec::new()));
                        families.len() - 1
                    }
                };
                if !families[index].1.iter().any(|h| h == line) {
                    families[index].1.push(line.to_string());
                }
                current = Some(index);
            } else if !line.is_empty() {
                match current {
                    Some(i) => families[i].2.push(line.to_string()),
                    None => {
                        families.push((String::new(), Vec::new(), vec![line.to_string()]));
                        current = Some(families.len() - 1);
                    }
                }
            }
        }
    }
    let mut out = String::new();
    for (_, headers, samples) in families {
        for line in headers.iter().chain(&samples) {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[derive(serde::Deserialize)]
struct AdminRequest {
    model: String,
    #[serde(default)]
    force: bool,
    #[serde(default = "yes")]
    pinned: bool,
}

fn yes() -> bool {
    true
}

async fn admin_body(pool: &ModelPool, request: Request) -> Result<AdminRequest, ApiError> {
    let (parts, body) = request.into_parts();
    let config = &pool.config().server;
    let bytes =
        crate::routes::read_body_within(config.max_body_bytes, config.body_timeout, &parts.headers, body).await?;
    serde_json::from_slice(&bytes).map_err(|e| ApiError::invalid_body(format!("the request body is not valid: {e}")))
}

/// `POST /models/load {"model": NAME}`: loads it and answers once it is ready.
async fn admin_load(State(pool): State<ModelPool>, request: Request) -> Result<Response, ApiError> {
    let body = admin_body(&pool, request).await?;
    pool.load(&body.model).await?;
    let index = pool.index(&body.model)?;
    Ok(axum::Json(pool.describe(index)).into_response())
}

/// `POST /models/unload {"model": NAME, "force": false}`.
async fn admin_unload(State(pool): State<ModelPool>, request: Request) -> Result<Response, ApiError> {
    let body = admin_body(&pool, request).await?;
    pool.unload(&body.model, body.force).await?;
    let index = pool.index(&body.model)?;
    Ok(axum::Json(pool.describe(index)).into_response())
}

/// `POST /models/pin {"model": NAME, "pinned": true}`.
async fn admin_pin(State(pool): State<ModelPool>, request: Request) -> Result<Response, ApiError> {
    let body = admin_body(&pool, request).await?;
    pool.pin(&body.model, body.pinned)?;
    let index = pool.index(&body.model)?;
    Ok(axum::Json(pool.describe(index)).into_response())
}

/// An error in the shape of the API the route belongs to.
fn shaped(path: &str, e: ApiError) -> Response {
    if path.starts_with("/v1/messages") { anthropic::AnthropicError(e).into_response() } else { e.into_response() }
}

/// Every other request: a model route goes to the model its body names, loaded first when
/// needed; anything else is 404 (or 405).
async fn forward(State(pool): State<ModelPool>, request: Request) -> Response {
    let path = request.uri().path().to_string();
    if !MODEL_ROUTES.contains(&path.as_str()) {
        return ApiError::route_not_found(request.method().as_str(), &path).into_response();
    }
    if request.method() != Method::POST {
        return ApiError::method_not_allowed(request.method().as_str(), &path).into_response();
    }
    match route_to_model(&pool, request).await {
        Ok(response) => response,
        Err(e) => shaped(&path, e),
    }
}

async fn route_to_model(pool: &ModelPool, request: Request) -> Result<Response, ApiError> {
    let (parts, body) = request.into_parts();
    let config = &pool.config().server;
    let bytes =
        crate::routes::read_body_within(config.max_body_bytes, config.body_timeout, &parts.headers, body).await?;
    #[derive(serde::Deserialize)]
    struct Named {
        #[serde(default)]
        model: Option<Value>,
    }
    let named: Named = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::invalid_body(format!("the request body is not valid JSON: {e}")))?;
    let name = match named.model {
        Some(Value::String(name)) => name,
        Some(_) => return Err(ApiError::invalid("model", "`model` must be a string")),
        None if pool.0.models.len() == 1 => pool.0.models[0].entry.name.clone(),
        None => {
            let served = pool.names().iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ");
            return Err(ApiError::invalid(
                "model",
                format!("`model` is required: this server serves several models ({served})"),
            ));
        }
    };
    let index = pool.index(&name)?;
    let (router, hold) = pool.acquire(index).await?;
    let request = Request::from_parts(parts, Body::from(bytes));
    let response = match router.oneshot(request).await {
        Ok(response) => response,
        Err(never) => match never {},
    };
    // The hold lives as long as the response body: a stream keeps its model loaded.
    let (parts, body) = response.into_parts();
    let body = Body::from_stream(body.into_data_stream().map(move |chunk| {
        let _held = &hold;
        chunk
    }));
    Ok(Response::from_parts(parts, body))
}

/// Serves the pool on `listener` until `shutdown` resolves, then stops accepting, lets running
/// requests finish for up to the grace period, cancels what is left and stops every model.
pub async fn serve_pool(
    listener: tokio::net::TcpListener,
    pool: ModelPool,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let config = pool.config().server.clone();
    let (stopping_tx, mut stopping_rx) = tokio::sync::watch::channel(false);
    let signal_pool = pool.clone();
    let signal = async move {
        shutdown.await;
        for engine in signal_pool.running_engines() {
            engine.begin_shutdown();
        }
        let _ = stopping_tx.send(true);
    };
    let server = crate::accept_loop(listener, pool_app(pool.clone()), config.header_read_timeout, signal);
    let mut server = std::pin::pin!(server);
    let result = tokio::select! {
        r = &mut server => r,
        () = async {
            let _ = stopping_rx.wait_for(|s| *s).await;
            tokio::time::sleep(config.grace_period).await;
        } => {
            for engine in pool.running_engines() {
                engine.cancel_all();
            }
            match tokio::time::timeout(Duration::from_secs(2), &mut server).await {
                Ok(r) => r,
                Err(_) => Ok(()),
            }
        }
    };
    pool.stop_all().await;
    result.map_err(ServerError::Io)
}

#[cfg(test)]
mod tests {
    use super::merge_metric_families;

    #[test]
    fn merged_metrics_name_each_family_once_with_every_models_samples() {
        let a = "# HELP x X.\n# TYPE x gauge\nx{model_name=\"a\"} 1\n# HELP y Y.\n# TYPE y counter\ny{model_name=\"a\"} 2\n";
        let b = "# HELP x X.\n# TYPE x gauge\nx{model_name=\"b\"} 3\n# HELP y Y.\n# TYPE y counter\ny{model_name=\"b\"} 4\n";
        let merged = merge_metric_families(&[a.to_string(), b.to_string()]);
        assert_eq!(
            merged,
            "# HELP x X.\n# TYPE x gauge\nx{model_name=\"a\"} 1\nx{model_name=\"b\"} 3\n\
             # HELP y Y.\n# TYPE y counter\ny{model_name=\"a\"} 2\ny{model_name=\"b\"} 4\n"
        );
    }
}
