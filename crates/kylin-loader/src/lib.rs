//! Kylin's loader: turns a path into a validated, zero-copy model description.
//!
//! Everything that comes from a file is checked here, once, and turned into typed values:
//! [`ModelConfig`] (every value decided), [`ModelWeights`] (views into read-only memory maps,
//! in their stored dtype, every shape checked), [`TokenizerBundle`] and [`GenerationDefaults`].
//! Code downstream trusts these values and never re-checks them. Every failure is a
//! [`KylinError`] with a stable code.
//!
//! Entry points: [`detect`] (what is at this path), [`load`] (a Hugging Face directory, a
//! safetensors file or a llama2.c `.bin`, ready for the native engine) and [`inspect`] (a report
//! for any format, GGUF included, without binding anything the report does not need).

pub mod arch;
pub mod config;
pub mod encoder;
pub mod error;
pub mod family;
pub mod generation;
pub mod gguf;
pub mod inspect;
pub mod llama2c;
pub mod mtp;
pub mod published;
pub mod safetensors_file;
pub mod task;
pub mod tensor;
pub mod tokenizer;
pub mod vision;
pub mod weights;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

pub use config::{Architecture, HfConfig, ModelConfig, RopeConfig, RopeScaling, StoredQuantization};
pub use error::{ErrorCode, KylinError, Result};
pub use generation::GenerationDefaults;
pub use gguf::{GgufInfo, read_gguf_info};
pub use inspect::{InspectReport, inspect};
pub use safetensors_file::WeightFile;
pub use tensor::{DType, Storage, WeightTensor};
pub use tokenizer::{ChatTemplate, SpecialToken, TokenizerBundle, TokenizerKind};
pub use weights::{HeadBinding, LayerWeights, ModelWeights};

/// What a path holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Format {
    /// A Hugging Face directory: `config.json` plus `model.safetensors` or shards with
    /// `model.safetensors.index.json`.
    HfDir { dir: PathBuf, sharded: bool },
    /// One `.safetensors` file, with the `config.json` beside it.
    SafetensorsFile { file: PathBuf, dir: PathBuf },
    /// A GGUF file, run by the llama.cpp backend.
    Gguf { file: PathBuf },
    /// A llama2.c checkpoint (`export.py`'s versions 0, 1 and 2), run natively; tokenizer files
    /// are looked for beside it. `version` is what the first bytes say (checked at load).
    LegacyBin { file: PathBuf, version: i32 },
}

impl Format {
    /// `hf-dir`, `safetensors`, `gguf` or `llama2c-bin`.
    pub fn name(&self) -> &'static str {
        match self {
            Format::HfDir { .. } => "hf-dir",
            Format::SafetensorsFile { .. } => "safetensors",
            Format::Gguf { .. } => "gguf",
            Format::LegacyBin { .. } => "llama2c-bin",
        }
    }

    /// The directory holding `config.json` and the tokenizer files (HF formats), or the
    /// tokenizer files beside a llama2.c `.bin`.
    pub fn dir(&self) -> Option<&Path> {
        match self {
            Format::HfDir { dir, .. } | Format::SafetensorsFile { dir, .. } => Some(dir),
            Format::LegacyBin { file, .. } => Some(parent_dir(file)),
            Format::Gguf { .. } => None,
        }
    }
}

/// The directory of a file path (`.` for a bare file name).
pub fn parent_dir(file: &Path) -> &Path {
    file.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

const INDEX_NAME: &str = "model.safetensors.index.json";
const SINGLE_NAME: &str = "model.safetensors";

/// Recognises what `path` is, by layout and magic bytes.
pub fn detect(path: &Path) -> Result<Format> {
    let meta = std::fs::metadata(path).map_err(|e| KylinError::io(path, "cannot open model path", &e))?;
    if meta.is_dir() {
        let dir = path.to_path_buf();
        if !error::regular_file(&dir.join("config.json"))? {
            return Err(KylinError::config_missing(format!(
                "{} has no config.json; a Hugging Face model directory needs config.json and \
                 model.safetensors or {INDEX_NAME} (for a GGUF file, pass the .gguf file itself)",
                dir.display()
            ))
            .at(path));
        }
        if error::regular_file(&dir.join(INDEX_NAME))? {
            return Ok(Format::HfDir { dir, sharded: true });
        }
        if error::regular_file(&dir.join(SINGLE_NAME))? {
            return Ok(Format::HfDir { dir, sharded: false });
        }
        let legacy = ["pytorch_model.bin", "pytorch_model.bin.index.json"].iter().any(|n| dir.join(n).exists());
        let hint = if legacy {
            "; this directory has PyTorch .bin weights, which Kylin does not read: convert them to safetensors"
        } else {
            ""
        };
        return Err(KylinError::file_not_found(format!(
            "{} has config.json but no weights: looked for {SINGLE_NAME} and {INDEX_NAME}{hint}",
            dir.display()
        ))
        .at(path));
    }
    let mut head = Vec::with_capacity(8);
    if let Ok(f) = std::fs::File::open(path) {
        // A short or unreadable file leaves `head` short; the format's own checks report it.
        let _ = std::io::Read::read_to_end(&mut std::io::Read::take(f, 8), &mut head);
    }
    if head.starts_with(b"GGUF") {
        return Ok(Format::Gguf { file: path.to_path_buf() });
    }
    match llama2c::sniff(path, &head)? {
        Some(llama2c::Sniffed::Magic(version)) => return Ok(Format::LegacyBin { file: path.to_path_buf(), version }),
        Some(llama2c::Sniffed::NoMagic) => return Ok(Format::LegacyBin { file: path.to_path_buf(), version: 0 }),
        None => {}
    }
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    if ext == "gguf" {
        return Err(KylinError::file_corrupted(format!(
            "{} has the .gguf extension but does not start with the GGUF magic bytes",
            path.display()
        ))
        .at(path));
    }
    if ext == "safetensors" {
        let dir = parent_dir(path).to_path_buf();
        if !error::regular_file(&dir.join("config.json"))? {
            return Err(KylinError::config_missing(format!(
                "{} needs a config.json beside it in {}",
                path.display(),
                dir.display()
            ))
            .at(path));
        }
        return Ok(Format::SafetensorsFile { file: path.to_path_buf(), dir });
    }
    Err(KylinError::input_invalid(format!(
        "{} is not a model Kylin recognises: expected a directory with config.json and {SINGLE_NAME} or \
         {INDEX_NAME}, a .safetensors file with config.json beside it, a GGUF file or a llama2.c .bin",
        path.display()
    ))
    .at(path))
}

/// Options of [`load`] and [`inspect`].
#[derive(Default, Clone, Debug)]
pub struct LoadOptions {
    /// A JSON tensor-map file renaming table entries (see [`arch`] for the format).
    pub tensor_map: Option<PathBuf>,
    /// Accept a tokenizer with ids beyond the config's `vocab_size` (a warning instead of an error).
    pub allow_vocab_mismatch: bool,
    /// Refuse a directory without tokenizer files (`CONFIG_MISSING`).
    pub require_tokenizer: bool,
    /// Ask the OS to read the bound weights into memory in the background (for running the
    /// model; `inspect` leaves it off, since it reads nothing in full).
    pub prefetch: bool,
    /// What the model serves (`--task`): by default what the directory's files say (see
    /// [`task`]).
    pub task: task::TaskChoice,
    /// Bind the checkpoint's multi-token-prediction head (`mtp.*`) for speculative decoding
    /// (`--speculative mtp`): `TENSOR_MISSING` when it has none.
    pub mtp: bool,
}

/// Where the load time went, in milliseconds.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct LoadTimings {
    /// Config, mapping and validating the weight files, binding.
    pub weights_ms: f64,
    /// Reading tokenizer files (parsing tokenizer.json dominates).
    pub tokenizer_ms: f64,
}

/// A model ready for the native engine.
#[derive(Debug)]
pub struct LoadedModel {
    pub format: Format,
    pub config: ModelConfig,
    pub weights: ModelWeights,
    pub files: Vec<WeightFile>,
    /// Tensors stored in the checkpoint (used or not).
    pub tensor_count: usize,
    /// Bytes of tensor data stored in the checkpoint.
    pub total_bytes: u64,
    /// Stored dtype name -> tensor count.
    pub dtypes: BTreeMap<String, usize>,
    pub unused_tensors: Vec<String>,
    /// Tensors of parts the native engine does not run, by part: the vision tower and projector
    /// of a `*ForConditionalGeneration` directory, and the multi-token-prediction head
    /// (`mtp.*`, Qwen3.5) unless [`LoadOptions::mtp`] binds it.
    pub not_run: Vec<NotRun>,
    /// The vision tower of a vision-language directory whose tower Kylin runs.
    pub vision: Option<vision::LoadedVision>,
    /// The multi-token-prediction head, when [`LoadOptions::mtp`] asked for it.
    pub mtp: Option<mtp::MtpHead>,
    /// Generation, embeddings or reranking ([`task::decide`]).
    pub task: task::ModelTask,
    /// The header and tensor layout of a llama2.c `.bin` (`None` for other formats).
    pub llama2c: Option<llama2c::BinInfo>,
    pub tokenizer: Option<TokenizerBundle>,
    pub generation: GenerationDefaults,
    /// Sorted, deduplicated union of generation_config, config and tokenizer EOS ids.
    pub eos_ids: Vec<u32>,
    pub warnings: Vec<String>,
    pub timings: LoadTimings,
}

/// Reads and resolves `dir/config.json`.
pub fn read_config(dir: &Path) -> Result<ModelConfig> {
    read_hf_config(dir)?.resolve()
}

/// Reads `dir/config.json` as written.
pub fn read_hf_config(dir: &Path) -> Result<HfConfig> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| {
        let mut err = KylinError::io(&path, "cannot read", &e);
        if err.code == ErrorCode::FileNotFound {
            err.code = ErrorCode::ConfigMissing;
        }
        err
    })?;
    HfConfig::from_json_str(&text).map_err(|e| e.at(&path))
}

/// The parts shared by [`load`] and [`inspect`] for Hugging Face formats.
pub(crate) struct HfParts {
    pub config: ModelConfig,
    pub index: safetensors_file::TensorIndex,
    pub warnings: Vec<String>,
}

pub(crate) fn open_hf(format: &Format) -> Result<HfParts> {
    let mut warnings = Vec::new();
    let (dir, index) = match format {
        Format::HfDir { dir, sharded: true } => (dir, None::<PathBuf>),
        Format::HfDir { dir, sharded: false } => (dir, Some(dir.join(SINGLE_NAME))),
        Format::SafetensorsFile { file, dir } => (dir, Some(file.clone())),
        Format::Gguf { file } => {
            return Err(KylinError::operator_unsupported(format!(
                "{} is a GGUF file: the native engine loads Hugging Face safetensors and llama2.c .bin files; \
                 run it with the llama.cpp backend (--backend llama.cpp)",
                file.display()
            ))
            .at(file));
        }
        Format::LegacyBin { file, .. } => {
            return Err(KylinError::operator_unsupported(format!(
                "{} is a llama2.c checkpoint, which has no config.json",
                file.display()
            ))
            .at(file));
        }
    };
    let config = read_config(dir)?;
    let index = match index {
        Some(file) => safetensors_file::open_single(&file)?,
        None => safetensors_file::open_sharded(&dir.join(INDEX_NAME), &mut warnings)?,
    };
    Ok(HfParts { config, index, warnings })
}

/// A part of a checkpoint the native engine does not run, and its tensors.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct NotRun {
    /// What the part is (`vision tower and projector`, `multi-token prediction (mtp.*)`).
    pub part: String,
    pub tensors: Vec<String>,
}

/// Loads a Hugging Face model (directory or safetensors file) or a llama2.c `.bin` for the
/// native engine.
///
/// Nothing is read in full: headers are parsed and the tensors become views into the maps
/// (a `.bin`'s exceptions are in [`llama2c`]). GGUF is `OPERATOR_UNSUPPORTED` here (it runs on
/// the llama.cpp backend).
pub fn load(path: &Path, opts: &LoadOptions) -> Result<LoadedModel> {
    let format = detect(path)?;
    if let Format::LegacyBin { file, .. } = &format {
        if opts.mtp {
            return Err(KylinError::tensor_missing(format!(
                "{} is a llama2.c checkpoint, which has no multi-token-prediction head",
                file.display()
            ))
            .at(file));
        }
        return llama2c::load(file, opts);
    }
    let t0 = Instant::now();
    let HfParts { mut config, index, mut warnings } = open_hf(&format)?;
    let dir = format.dir().unwrap_or(Path::new("."));
    // The tokenizer first: a reranker's task names two of its tokens.
    let t1 = Instant::now();
    let tokenizer = tokenizer::load_tokenizer(dir, &mut warnings)?;
    let tokenizer_ms = t1.elapsed().as_secs_f64() * 1e3;
    let task = task::decide(dir, opts.task, tokenizer.as_ref())?;
    let map = match &opts.tensor_map {
        Some(p) => arch::TensorMap::load(p, config.architecture)?,
        None if config.multimodal.is_some() => arch::TensorMap::language_model(config.architecture, &index),
        // Saved from the bare `*Model` (Qwen3-Embedding): no `model.` prefix and no head.
        None if arch::TensorMap::is_bare_model(&index) => arch::TensorMap::bare_model(config.architecture),
        None => arch::TensorMap::default(),
    };
    if matches!(task, task::ModelTask::Embed(_))
        && !config.tie_word_embeddings
        && index.raw(&map.name_for("lm_head.weight")).is_none()
    {
        // An embedder never reads its head: one saved without it binds the embedding there, so
        // that the engine's shapes hold.
        warnings.push(
            "the checkpoint has no lm_head.weight (an embedding model saved without its head): \
             the embedding matrix stands in for it; no text is generated"
                .into(),
        );
        config.tie_word_embeddings = true;
    }
    let mut bound = arch::bind(&config, &index, &map)?;
    let mut not_run = Vec::new();
    let mut vision_tower = None;
    if let Some(class) = &config.multimodal {
        let is_language =
            |n: &String| n.contains("language_model") || n.starts_with("lm_head") || n.starts_with("mtp.");
        let (language, mut vision): (Vec<String>, Vec<String>) = bound.unused.drain(..).partition(is_language);
        bound.unused = language;
        // A tower Kylin runs is bound; another is one line instead of every name.
        if let Some(vision_config) = vision::read_vision_config(dir)? {
            let tower = vision::bind_vision(vision_config, &index, dir)?;
            vision.retain(|n| !tower.names.contains(n));
            // SigLIP's attention-pooling head: Gemma 3 reads the tower's last hidden state.
            let siglip = matches!(tower.config.kind, vision::VisionKind::Gemma3 { .. });
            let (head, rest): (Vec<String>, Vec<String>) =
                vision.drain(..).partition(|n| siglip && n.contains("vision_tower.") && n.contains(".head."));
            vision = rest;
            if !head.is_empty() {
                not_run.push(NotRun {
                    part: "SigLIP attention-pooling head (Gemma 3 reads the last hidden state)".into(),
                    tensors: head,
                });
            }
            // Gemma 4's audio encoder: Kylin takes no audio input.
            let (audio, rest): (Vec<String>, Vec<String>) =
                vision.drain(..).partition(|n| n.contains("audio_tower.") || n.contains("embed_audio."));
            vision = rest;
            if !audio.is_empty() {
                not_run
                    .push(NotRun { part: "audio tower and projector (Kylin takes no audio)".into(), tensors: audio });
            }
            vision_tower = Some(tower);
        } else if !vision.is_empty() {
            warnings.push(format!(
                "{class}: the language model runs; the vision tower and projector ({} tensors) are not used \
                 (Kylin runs the Qwen3.5, Gemma 3 and Gemma 4 vision towers)",
                vision.len()
            ));
            not_run.push(NotRun { part: "vision tower and projector".into(), tensors: std::mem::take(&mut vision) });
        }
        bound.unused.extend(vision);
    }
    // Qwen3.5's multi-token-prediction head: a further decoder layer that proposes the token
    // after next, for speculative decoding; the model's own logits do not use it. Bound when
    // asked for; otherwise listed as not run.
    let mtp_head = if opts.mtp {
        let head = mtp::bind(&config, &index, &map)?.ok_or_else(|| {
            KylinError::tensor_missing(format!(
                "{} has no multi-token-prediction head (neither {} nor a NextN layer's model.layers.{}.eh_proj.weight \
                 is in the checkpoint); Qwen3.5, Qwen3-Next and GLM-4.5 checkpoints ship one (speculate with n-gram \
                 or a draft model instead)",
                dir.display(),
                mtp::MTP_FC,
                config.num_layers
            ))
            .at(dir)
        })?;
        Some(head)
    } else {
        None
    };
    let layers = config.num_layers;
    let (mtp, rest): (Vec<String>, Vec<String>) = bound.unused.drain(..).partition(|n| mtp::is_head_tensor(n, layers));
    bound.unused = rest;
    let mtp: Vec<String> = match &mtp_head {
        Some(head) => mtp.into_iter().filter(|n| head.tensors.binary_search(n).is_err()).collect(),
        None => mtp,
    };
    if !mtp.is_empty() {
        // Qwen's `mtp.*`, or a NextN layer past the decoder's (GLM-4.5).
        let what = if mtp.iter().all(|n| n.starts_with("mtp.")) {
            "mtp.*".to_string()
        } else {
            format!("NextN layer model.layers.{layers}.*")
        };
        warnings.push(format!(
            "{} {what} tensors (the multi-token-prediction head) are not run: --mtp runs them as the proposer of \
             speculative decoding",
            mtp.len()
        ));
        not_run.push(NotRun { part: format!("multi-token prediction ({what})"), tensors: mtp });
    }
    if opts.prefetch {
        for tensor in bound.weights.tensors() {
            tensor.advise_will_need();
        }
    }
    if !bound.unused.is_empty() {
        warnings.push(format!(
            "{} tensors in the checkpoint are not used by the {} table: {}",
            bound.unused.len(),
            config.architecture.hf_name(),
            bound.unused.join(", ")
        ));
    }
    let weights_ms = t0.elapsed().as_secs_f64() * 1e3 - tokenizer_ms;

    check_tokenizer(dir, HF_TOKENIZER_FILES, &config, tokenizer.as_ref(), opts, &mut warnings)?;
    let generation = GenerationDefaults::load(&dir.join("generation_config.json"))?;
    let eos_ids = eos_union(&config, &generation, tokenizer.as_ref());

    Ok(LoadedModel {
        files: index.files(),
        tensor_count: index.len(),
        total_bytes: index.tensor_bytes(),
        dtypes: index.dtype_counts(),
        format,
        config,
        weights: bound.weights,
        unused_tensors: bound.unused,
        not_run,
        vision: vision_tower,
        mtp: mtp_head,
        task,
        llama2c: None,
        tokenizer,
        generation,
        eos_ids,
        warnings,
        timings: LoadTimings { weights_ms, tokenizer_ms },
    })
}

/// The tokenizer files [`tokenizer::load_tokenizer`] looks for, in its order, for messages.
pub(crate) const HF_TOKENIZER_FILES: &str = "tokenizer.json, then vocab.json + merges.txt";

/// The tokenizer presence and vocabulary checks.
pub(crate) fn check_tokenizer(
    dir: &Path,
    looked_for: &str,
    config: &ModelConfig,
    tokenizer: Option<&TokenizerBundle>,
    opts: &LoadOptions,
    warnings: &mut Vec<String>,
) -> Result<()> {
    let Some(tok) = tokenizer else {
        let msg = format!("{} has no tokenizer: looked for {looked_for}", dir.display());
        if opts.require_tokenizer {
            return Err(KylinError::config_missing(msg).at(dir));
        }
        warnings.push(msg);
        return Ok(());
    };
    if tok.vocab_size > config.vocab_size {
        let msg = format!(
            "the tokenizer produces ids up to {} but config.json vocab_size is {}: those ids have no embedding row",
            tok.vocab_size - 1,
            config.vocab_size
        );
        if !opts.allow_vocab_mismatch {
            return Err(KylinError::vocab_mismatch(format!(
                "{msg}; use the tokenizer that belongs to this model (or allow the mismatch explicitly)"
            )));
        }
        warnings.push(msg);
    }
    Ok(())
}

/// Sorted, deduplicated union of every EOS id source.
pub(crate) fn eos_union(
    config: &ModelConfig,
    generation: &GenerationDefaults,
    tok: Option<&TokenizerBundle>,
) -> Vec<u32> {
    let mut ids: Vec<u32> = generation.eos_token_ids.clone();
    ids.extend(&config.eos_token_ids);
    if let Some(e) = tok.and_then(|t| t.eos_token.as_ref()) {
        ids.push(e.id);
    }
    ids.sort_unstable();
    ids.dedup();
    ids
}
