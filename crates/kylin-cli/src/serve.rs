//! `kylin serve`: the OpenAI-compatible server (crate `kylin-server`) over the engine that
//! [`crate::open::open_engine`] chooses.
//!
//! The socket is bound first and its address printed at once, then the model loads on the
//! engine thread (`/health` answers 503 meanwhile); the model, the engine and its KV capacity are
//! printed when it is ready. SIGTERM or Ctrl-C stops accepting, gives running requests the grace
//! period, and exits 0.

use std::time::Duration;

use anyhow::{Context, Result};
use kylin_loader::KylinError;
use kylin_server::{AppState, EngineFactory, ServerConfig};

use crate::args::ServeArgs;
use crate::open::open_engine;

pub fn run(args: ServeArgs) -> Result<()> {
    let config = server_config(&args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kylin-http")
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(serve(args, config))
}

/// The name a model is served under when `--served-model-name` is not given: a directory's
/// name as it is (`qwen2.5-coder-0.5b-instruct` keeps its dots), a file's name without its
/// extension only when that extension is a model format's (`.gguf`, `.bin`, `.safetensors`).
pub fn default_served_name(path: &std::path::Path) -> String {
    // A trailing slash or `.` component would leave no file name: resolve it first.
    let resolved = if path.file_name().is_none() { std::fs::canonicalize(path).ok() } else { None };
    let path = resolved.as_deref().unwrap_or(path);
    let Some(name) = path.file_name().map(|n| n.to_string_lossy().into_owned()) else {
        return path.display().to_string();
    };
    if path.is_dir() {
        return name;
    }
    const MODEL_EXTENSIONS: [&str; 3] = [".gguf", ".bin", ".safetensors"];
    for ext in MODEL_EXTENSIONS {
        if name.len() > ext.len() && name.to_ascii_lowercase().ends_with(ext) {
            return name[..name.len() - ext.len()].to_string();
        }
    }
    name
}

fn server_config(args: &ServeArgs) -> Result<ServerConfig> {
    let name = match &args.served_model_name {
        Some(name) => name.clone(),
        None => default_served_name(&args.model.model),
    };
    let api_key = match (&args.api_key, &args.api_key_file) {
        (Some(key), _) => Some(key.clone()),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| KylinError::io(path, "cannot read the --api-key-file", &e))?;
            let key = text.lines().next().unwrap_or("").trim().to_string();
            if key.is_empty() {
                return Err(KylinError::input_invalid(format!("{} holds no API key", path.display())).into());
            }
            Some(key)
        }
        (None, None) => None,
    };
    if api_key.as_deref() == Some("") {
        return Err(KylinError::input_invalid("--api-key must not be empty").into());
    }
    if args.max_body_bytes < 1024 {
        return Err(KylinError::input_invalid("--max-body-bytes must be at least 1024").into());
    }
    let allowed_local_media_path = match &args.allowed_local_media_path {
        None => None,
        // Resolved once, so that a request's path is compared with the real directory.
        Some(dir) => Some(
            std::fs::canonicalize(dir)
                .map_err(|e| KylinError::io(dir, "cannot open the --allowed-local-media-path directory", &e))?,
        ),
    };
    Ok(ServerConfig {
        served_model_name: name,
        api_key,
        max_queue: args.max_queue,
        max_body_bytes: args.max_body_bytes,
        body_timeout: Duration::from_secs(args.body_timeout.max(1)),
        header_read_timeout: Duration::from_secs(args.header_timeout.max(1)),
        grace_period: Duration::from_secs(args.grace_period),
        kv_events: None,
        allowed_local_media_path,
        image_defaults: crate::run_images::image_options(args.mm_processor_kwargs.as_deref())?,
    })
}

async fn serve(args: ServeArgs, mut config: ServerConfig) -> Result<()> {
    let many = args.models_dir.is_some() || args.models.is_some();
    if many && !args.model.model.as_os_str().is_empty() {
        return Err(KylinError::input_invalid(format!(
            "give either a model ({}) or --models-dir/--models, not both",
            args.model.model.display()
        ))
        .into());
    }
    if many {
        return crate::serve_many::serve(args, config, shutdown_signal()).await;
    }
    if args.model.model.as_os_str().is_empty() {
        return Err(KylinError::input_invalid(
            "kylin serve needs a model (a Hugging Face directory, a .gguf or a .bin file), or --models-dir DIR or \
             --models FILE",
        )
        .into());
    }
    if args.models_memory.is_some() {
        return Err(KylinError::input_invalid("--models-memory applies only with --models-dir or --models").into());
    }
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .map_err(|e| KylinError::input_invalid(format!("cannot listen on {}:{}: {e}", args.host, args.port)))?;
    let address = listener.local_addr().context("the listener has no address")?;
    if let Some(endpoint) = &args.kv_events_endpoint {
        let sender = kylin_server::kv_events::start_publisher(endpoint, &args.kv_events_topic)
            .await
            .map_err(KylinError::input_invalid)?;
        println!("kylin serve: KV-cache events (vLLM's format) published on {endpoint}");
        config.kv_events = Some(sender);
    }
    let name = config.served_model_name.clone();
    println!("kylin serve: listening on http://{address} (model `{name}` loading)");
    let model_args = args.model.clone();
    let factory: EngineFactory = Box::new(move || {
        open_engine(&model_args).map_err(|e| match e.downcast::<KylinError>() {
            Ok(k) => k,
            Err(other) => KylinError::backend_failed(format!("{other:#}")),
        })
    });
    let (state, engine_thread) = AppState::start(config, factory).context("cannot start the engine thread")?;
    let announce = state.engine().clone();
    let path = args.model.model.display().to_string();
    tokio::spawn(async move {
        if let Ok(p) = announce.wait_ready().await {
            let info = &p.info;
            let engine = if info.max_seqs <= 1 { "one sequence at a time" } else { "continuous batching" };
            if let Some(e) = &p.embedding {
                println!(
                    "kylin serve: model `{name}` from {path}: {} {} (embeddings: {} dimensions, {} pooling{}, \
                 inputs up to {} tokens), {} threads, precision {} ({})",
                    info.backend,
                    info.architecture,
                    e.dimension,
                    e.pooling,
                    if e.normalized { ", normalized" } else { "" },
                    e.max_tokens,
                    info.threads,
                    info.precision,
                    info.kernels
                );
            } else if p.rerank && info.kv_blocks == 0 {
                println!(
                    "kylin serve: model `{name}` from {path}: {} {} (reranker, pairs up to {} tokens), {} threads, \
                 precision {} ({})",
                    info.backend, info.architecture, info.context_size, info.threads, info.precision, info.kernels
                );
            } else {
                println!(
                    "kylin serve: model `{name}` from {path}: {} {} ({engine}, up to {} sequences), context {} tokens, \
                 KV cache {} tokens in {} blocks ({:.1} MiB, {}), {} threads, precision {} ({})",
                    info.backend,
                    info.architecture,
                    info.max_seqs,
                    info.context_size,
                    info.kv_tokens,
                    info.kv_blocks,
                    info.kv_bytes as f64 / (1u64 << 20) as f64,
                    info.kv_dtype,
                    info.threads,
                    info.precision,
                    info.kernels
                );
                if let Some(states) = &info.state_pool {
                    println!(
                        "kylin serve: recurrent layers' state pool {:.1} MiB: {} live states of {:.1} MiB and {} snapshots of {:.1} MiB for the prefix cache (every {} positions)",
                        states.bytes as f64 / (1u64 << 20) as f64,
                        states.live_slots,
                        states.live_bytes as f64 / (1u64 << 20) as f64,
                        states.snapshots,
                        states.snapshot_bytes as f64 / (1u64 << 20) as f64,
                        states.chunk
                    );
                }
            }
            println!("kylin serve: ready on http://{address}/v1 (GET /health says 200)");
        }
    });
    kylin_server::serve(listener, state, engine_thread, shutdown_signal()).await.map_err(|e| match e {
        kylin_server::ServerError::EngineFailed(k) => anyhow::Error::new(k),
        other => anyhow::Error::new(other),
    })?;
    println!("kylin serve: stopped");
    Ok(())
}

/// SIGTERM or Ctrl-C (SIGINT).
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
    eprintln!("kylin serve: shutting down (running requests get the grace period)");
}

#[cfg(test)]
mod tests {
    use super::default_served_name;

    #[test]
    fn directory_names_keep_their_dots_and_files_lose_only_a_model_extension() {
        let dir = tempfile::tempdir().unwrap();
        let model_dir = dir.path().join("qwen2.5-coder-0.5b-instruct");
        std::fs::create_dir(&model_dir).unwrap();
        assert_eq!(default_served_name(&model_dir), "qwen2.5-coder-0.5b-instruct");
        let with_slash = std::path::PathBuf::from(format!("{}/", model_dir.display()));
        assert_eq!(default_served_name(&with_slash), "qwen2.5-coder-0.5b-instruct");
        for (file, name) in [
            ("smollm2-135m.Q4_1.gguf", "smollm2-135m.Q4_1"),
            ("stories15M.bin", "stories15M"),
            ("model-v1.5.safetensors", "model-v1.5"),
            ("weights.v2.txt", "weights.v2.txt"),
        ] {
            let path = dir.path().join(file);
            std::fs::write(&path, b"x").unwrap();
            assert_eq!(default_served_name(&path), name, "{file}");
        }
    }
}
