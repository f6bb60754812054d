//! `kylin serve --models-dir DIR` and `kylin serve --models FILE`: the models of a multi-model
//! server (crate `kylin-server`, module `multi`), found in a directory or listed in a TOML file,
//! each with the options it opens with.
//!
//! The TOML file:
//!
//! ```toml
//! [defaults]                 # options every model starts from
//! kv-memory = "512MiB"
//!
//! [models.coder]
//! path = "qwen2.5-coder-0.5b-instruct"   # relative to the file's folder
//! quantize = "q8_0"                      # any model option, by its flag's name
//! pinned = true                          # loaded at start, never unloaded for room
//!
//! [models.small]
//! path = "/models/smollm2-135m-instruct"
//! ```
//!
//! Options are parsed by the same flag parser as the command line's, so a misspelt option or a
//! bad value is the error the flag gives, prefixed with the file and the model's name.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use kylin_loader::KylinError;
use kylin_server::multi::{ModelEntry, ModelPool, PoolConfig};
use kylin_server::{EngineFactory, ServerConfig};

use crate::args::{ModelArgs, ServeArgs};
use crate::open::{open_engine, parse_size_of};
use crate::serve::default_served_name;

/// A model's KV cache in a multi-model server when its options do not size it: the engine's
/// own default (up to half the memory available) would leave no room for the other models.
const DEFAULT_KV_MEMORY: &str = "1GiB";

/// Options of which a model sets at most one: a model's own replaces the others in [defaults].
const CONFLICTING_OPTIONS: [&[&str]; 1] = [&["kv-memory", "memory-fraction"]];

/// A model to serve: its name, its options and whether it is pinned.
#[derive(Debug)]
pub struct ServedModel {
    pub name: String,
    pub args: ModelArgs,
    pub pinned: bool,
}

/// The flag parser of one model's options, for the TOML file.
#[derive(Parser, Debug)]
#[command(name = "model options", no_binary_name = true, args_override_self = true)]
struct ModelOptions {
    #[command(flatten)]
    model: ModelArgs,
}

/// The models of `--models-dir DIR`: each Hugging Face directory (one with a `config.json`)
/// and each `.gguf` file in it (of a split GGUF, the first part), sorted by name, opened with
/// the command line's model options.
pub fn models_in_dir(dir: &Path, options: &ModelArgs) -> Result<Vec<ServedModel>> {
    if dir.join("config.json").is_file() {
        return Err(KylinError::input_invalid(format!(
            "--models-dir {} is itself a model directory; serve it as `kylin serve {0}`, or pass the folder that holds it",
            dir.display()
        ))
        .into());
    }
    let entries = std::fs::read_dir(dir).map_err(|e| KylinError::io(dir, "cannot read the --models-dir", &e))?;
    let mut paths: Vec<PathBuf> = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| KylinError::io(dir, "cannot read the --models-dir", &e))?;
        let path = entry.path();
        let file_name = entry.file_name().to_string_lossy().into_owned();
        if file_name.starts_with('.') {
            continue;
        }
        let lower = file_name.to_ascii_lowercase();
        let later_split_part = lower.contains("-of-") && !lower.contains("-00001-of-");
        if path.join("config.json").is_file() || (path.is_file() && lower.ends_with(".gguf") && !later_split_part) {
            paths.push(path);
        }
    }
    paths.sort();
    if paths.is_empty() {
        return Err(KylinError::input_invalid(format!(
            "--models-dir {}: no models there (expected Hugging Face directories with a config.json, or .gguf files)",
            dir.display()
        ))
        .into());
    }
    let models = paths
        .into_iter()
        .map(|path| {
            let mut args = options.clone();
            args.model = path.clone();
            default_kv_memory(&mut args);
            ServedModel { name: default_served_name(&path), args, pinned: false }
        })
        .collect();
    unique(models, &dir.display().to_string())
}

/// The models a `--models` TOML file lists.
pub fn models_in_file(file: &Path) -> Result<Vec<ServedModel>> {
    let text = std::fs::read_to_string(file).map_err(|e| KylinError::io(file, "cannot read the --models file", &e))?;
    let table: toml::Table = toml::from_str(&text)
        .map_err(|e| KylinError::input_invalid(format!("{}: not a valid TOML file: {e}", file.display())))?;
    let base = file.parent().unwrap_or(Path::new("."));
    let empty = toml::Table::new();
    let mut defaults = &empty;
    let mut models_table = None;
    for (key, value) in &table {
        match (key.as_str(), value) {
            ("defaults", toml::Value::Table(t)) => {
                if let Some(key) = ["path", "pinned"].into_iter().find(|k| t.contains_key(*k)) {
                    return Err(KylinError::input_invalid(format!(
                        "{}: [defaults] cannot set `{key}`; set it in each [models.NAME] table",
                        file.display()
                    ))
                    .into());
                }
                defaults = t;
            }
            ("models", toml::Value::Table(t)) => models_table = Some(t),
            _ => {
                return Err(KylinError::input_invalid(format!(
                    "{}: unexpected `{key}`; the file holds a [defaults] table and [models.NAME] tables",
                    file.display()
                ))
                .into());
            }
        }
    }
    let Some(models_table) = models_table.filter(|t| !t.is_empty()) else {
        return Err(KylinError::input_invalid(format!("{}: no [models.NAME] tables", file.display())).into());
    };
    let mut models = Vec::new();
    for (name, value) in models_table {
        let where_ = format!("[models.{name}]");
        let toml::Value::Table(t) = value else {
            return Err(KylinError::input_invalid(format!("{}: {where_} must be a table", file.display())).into());
        };
        let path = match t.get("path") {
            Some(toml::Value::String(p)) => base.join(p),
            Some(_) => {
                return Err(
                    KylinError::input_invalid(format!("{}: {where_} `path` must be a string", file.display())).into()
                );
            }
            None => {
                return Err(KylinError::input_invalid(format!(
                    "{}: {where_} has no `path` (the model's directory or file)",
                    file.display()
                ))
                .into());
            }
        };
        let pinned = match t.get("pinned") {
            None => false,
            Some(toml::Value::Boolean(b)) => *b,
            Some(_) => {
                return Err(KylinError::input_invalid(format!(
                    "{}: {where_} `pinned` must be true or false",
                    file.display()
                ))
                .into());
            }
        };
        // A model's option replaces the defaults' options it conflicts with, as well as its own.
        let mut skip_defaults = Vec::new();
        for group in CONFLICTING_OPTIONS {
            if t.keys().any(|k| group.contains(&k.replace('_', "-").as_str())) {
                skip_defaults.extend_from_slice(group);
            }
        }
        let mut argv = vec![path.display().to_string()];
        argv.extend(option_flags(file, "[defaults]", defaults, &skip_defaults)?);
        argv.extend(option_flags(file, &where_, t, &["path", "pinned"])?);
        let parsed = ModelOptions::try_parse_from(&argv).map_err(|e| {
            let message = e.to_string();
            let first = message.lines().next().unwrap_or("").trim_start_matches("error: ").to_string();
            KylinError::input_invalid(format!("{}: {where_}: {first}", file.display()))
        })?;
        let mut args = parsed.model;
        default_kv_memory(&mut args);
        models.push(ServedModel { name: name.clone(), args, pinned });
    }
    unique(models, &file.display().to_string())
}

/// A table's options as command-line flags: `key = value` is `--key value`, `key = true` is
/// `--key`, `key = false` is nothing.
fn option_flags(file: &Path, where_: &str, table: &toml::Table, skip: &[&str]) -> Result<Vec<String>> {
    let mut flags = Vec::new();
    for (key, value) in table {
        let option = key.replace('_', "-");
        if skip.contains(&option.as_str()) {
            continue;
        }
        let flag = format!("--{option}");
        match value {
            toml::Value::Boolean(true) => flags.push(flag),
            toml::Value::Boolean(false) => {}
            toml::Value::String(s) => flags.extend([flag, s.clone()]),
            toml::Value::Integer(i) => flags.extend([flag, i.to_string()]),
            toml::Value::Float(f) => flags.extend([flag, f.to_string()]),
            _ => {
                return Err(KylinError::input_invalid(format!(
                    "{}: {where_} `{key}` must be a string, a number or a boolean",
                    file.display()
                ))
                .into());
            }
        }
    }
    Ok(flags)
}

fn default_kv_memory(args: &mut ModelArgs) {
    if args.engine.kv_memory.is_none() && args.engine.memory_fraction.is_none() {
        args.engine.kv_memory = Some(DEFAULT_KV_MEMORY.to_string());
    }
}

fn unique(models: Vec<ServedModel>, source: &str) -> Result<Vec<ServedModel>> {
    for (i, m) in models.iter().enumerate() {
        if let Some(other) = models[..i].iter().find(|o| o.name == m.name) {
            return Err(KylinError::input_invalid(format!(
                "{source}: two models are named `{}` ({} and {})",
                m.name,
                other.args.model.display(),
                m.args.model.display()
            ))
            .into());
        }
    }
    Ok(models)
}

/// Bytes of a model's weight files: a directory's `.safetensors` files, or the file itself.
fn weight_bytes(path: &Path) -> Result<u64> {
    let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).map_err(|e| KylinError::io(p, "cannot read", &e));
    if !path.is_dir() {
        return Ok(size(path)?);
    }
    let mut total = 0;
    let entries = std::fs::read_dir(path).map_err(|e| KylinError::io(path, "cannot read the model directory", &e))?;
    for entry in entries.flatten() {
        let p = entry.path();
        if p.extension().is_some_and(|e| e == "safetensors") {
            total += size(&p)?;
        }
    }
    Ok(total)
}

/// Runs the multi-model server.
pub async fn serve(
    args: ServeArgs,
    server: ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let memory_budget = match &args.models_memory {
        Some(text) => parse_size_of("--models-memory", text)?,
        None => kylin_engine::batch::memory_available().map_or(8 << 30, |available| available / 5 * 4),
    };
    let models = match (&args.models_dir, &args.models) {
        (Some(dir), _) => models_in_dir(dir, &args.model)?,
        (None, Some(file)) => models_in_file(file)?,
        (None, None) => {
            return Err(KylinError::input_invalid("kylin serve: --models-dir or --models names the models").into());
        }
    };
    let mut entries = Vec::with_capacity(models.len());
    for model in models {
        let cache_estimate = match &model.args.engine.kv_memory {
            Some(size) => parse_size_of("--kv-memory", size)?,
            None => 0,
        };
        let args = Arc::new(model.args);
        let make_args = args.clone();
        entries.push(ModelEntry {
            name: model.name,
            source: args.model.display().to_string(),
            weight_bytes: weight_bytes(&args.model)?,
            cache_estimate,
            pinned: model.pinned,
            make_engine: Arc::new(move || {
                let args = make_args.clone();
                let factory: EngineFactory = Box::new(move || {
                    open_engine(&args).map_err(|e| match e.downcast::<KylinError>() {
                        Ok(k) => k,
                        Err(other) => KylinError::backend_failed(format!("{other:#}")),
                    })
                });
                factory
            }),
        });
    }
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .map_err(|e| KylinError::input_invalid(format!("cannot listen on {}:{}: {e}", args.host, args.port)))?;
    let address = listener.local_addr().context("the listener has no address")?;
    for entry in &entries {
        println!(
            "kylin serve: model `{}` from {} ({:.1} MiB of weights{})",
            entry.name,
            entry.source,
            entry.weight_bytes as f64 / (1u64 << 20) as f64,
            if entry.pinned { ", pinned" } else { "" }
        );
    }
    let pool = ModelPool::new(
        PoolConfig { server, memory_budget, load_timeout: Duration::from_secs(args.load_timeout.max(1)) },
        entries,
    );
    println!(
        "kylin serve: listening on http://{address} ({} models, memory budget {:.1} MiB; models load on their first \
         request)",
        pool.names().len(),
        memory_budget as f64 / (1u64 << 20) as f64
    );
    let preload = pool.clone();
    tokio::spawn(async move {
        for (name, result) in preload.load_pinned().await {
            match result {
                Ok(()) => println!("kylin serve: pinned model `{name}` loaded"),
                Err(e) => eprintln!("kylin serve: pinned model `{name}` failed to load: {}", e.message),
            }
        }
        println!("kylin serve: ready on http://{address}/v1 (GET /v1/models lists the models and their state)");
    });
    kylin_server::multi::serve_pool(listener, pool, shutdown).await?;
    println!("kylin serve: stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults() -> ModelArgs {
        ModelOptions::try_parse_from(["unused"]).unwrap().model
    }

    #[test]
    fn a_models_dir_serves_hugging_face_directories_and_first_gguf_parts_by_name() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["b-model", "a.model", ".hidden", "no-config"] {
            std::fs::create_dir(dir.path().join(name)).unwrap();
            if name != "no-config" {
                std::fs::write(dir.path().join(name).join("config.json"), b"{}").unwrap();
            }
        }
        for file in ["c.Q8_0.gguf", "d-00001-of-00002.gguf", "d-00002-of-00002.gguf", "notes.txt"] {
            std::fs::write(dir.path().join(file), b"x").unwrap();
        }
        let mut options = defaults();
        options.engine.max_seqs = Some(3);
        let models = models_in_dir(dir.path(), &options).unwrap();
        let names: Vec<&str> = models.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["a.model", "b-model", "c.Q8_0", "d-00001-of-00002"]);
        assert!(models.iter().all(|m| m.args.engine.max_seqs == Some(3) && !m.pinned));
        assert!(models.iter().all(|m| m.args.engine.kv_memory.as_deref() == Some(DEFAULT_KV_MEMORY)));

        let empty = tempfile::tempdir().unwrap();
        let e = models_in_dir(empty.path(), &options).unwrap_err();
        assert!(e.to_string().contains("no models there"), "{e}");
    }

    #[test]
    fn a_models_file_resolves_paths_merges_defaults_and_names_bad_options() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("models.toml");
        std::fs::write(
            &file,
            "[defaults]\nkv-memory = \"64MiB\"\nthreads = 2\n\n[models.one]\npath = \"m1\"\npinned = true\n\
             threads = 1\n\n[models.two]\npath = \"/abs/m2\"\nquantize = \"q8_0\"\nmemory-fraction = 0.5\n",
        )
        .unwrap();
        let models = models_in_file(&file).unwrap();
        assert_eq!(models.len(), 2);
        let one = models.iter().find(|m| m.name == "one").unwrap();
        assert_eq!(one.args.model, dir.path().join("m1"));
        assert!(one.pinned);
        assert_eq!(one.args.threads, Some(1), "the model's own option wins over [defaults]");
        assert_eq!(one.args.engine.kv_memory.as_deref(), Some("64MiB"));
        let two = models.iter().find(|m| m.name == "two").unwrap();
        assert_eq!(two.args.model, PathBuf::from("/abs/m2"));
        assert_eq!(two.args.threads, Some(2));
        assert!(two.args.engine.quantize.is_some());

        for (text, expected) in [
            ("[models.x]\npath = \"m\"\nkv-memroy = \"1GiB\"\n", "[models.x]: unexpected argument '--kv-memroy'"),
            ("[models.x]\nquantize = \"q8_0\"\n", "[models.x] has no `path`"),
            ("[models.x]\npath = \"m\"\npinned = \"yes\"\n", "`pinned` must be true or false"),
            ("[models.x]\npath = \"m\"\nthreads = [1]\n", "`threads` must be a string, a number or a boolean"),
            ("[model.x]\npath = \"m\"\n", "unexpected `model`"),
            ("[defaults]\nthreads = 1\n", "no [models.NAME] tables"),
            ("[models.x\n", "not a valid TOML file"),
        ] {
            std::fs::write(&file, text).unwrap();
            let e = models_in_file(&file).unwrap_err().to_string();
            assert!(e.contains(expected), "{text:?}: {e}");
            assert!(e.contains(&file.display().to_string()), "{e}");
        }
    }
}
