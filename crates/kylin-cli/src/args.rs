//! Command-line arguments as typed. Resolution against model defaults happens in each command.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Parser, Debug)]
#[command(name = "kylin", version, about = "Run Hugging Face models on the CPU, no conversion step.")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Validate a model and describe it: format, config, weights, tokenizer, defaults.
    Inspect(InspectArgs),
    /// Generate text from a prompt, a messages file or token ids, streaming to stdout.
    Run(RunArgs),
    /// Interactive multi-turn chat through the model's chat template.
    Chat(ChatArgs),
    /// Top-k logits at every position of a prompt, for comparing with other engines.
    Logits(LogitsArgs),
    /// Measure load time, prefill and decode speed, and peak memory.
    Bench(BenchArgs),
    /// Perplexity on a text (llama-perplexity semantics), and KL divergence against a saved run.
    Perplexity(PerplexityArgs),
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(ServeArgs),
    /// Embed texts with an embedding model (one JSON line per text), or time it (--bench).
    Embed(EmbedArgs),
    /// Write a quantized copy of a model directory that loads without re-quantizing.
    Quantize(QuantizeArgs),
    /// Convert between a Llama Hugging Face directory and a llama2.c .bin checkpoint.
    Convert(ConvertArgs),
    /// One measured repetition of `bench` in a fresh process (used by `bench`).
    #[command(hide = true)]
    BenchWorker(BenchWorkerArgs),
}

impl Command {
    pub fn wants_json(&self) -> bool {
        match self {
            Command::Inspect(a) => a.json,
            Command::Run(a) => a.json,
            Command::Chat(_) => false,
            Command::Logits(a) => a.json,
            Command::Bench(a) => a.json,
            Command::Perplexity(a) => a.json,
            Command::Serve(_) => false,
            Command::Embed(a) => a.json,
            Command::Quantize(_) => false,
            Command::Convert(a) => a.json,
            Command::BenchWorker(_) => true,
        }
    }
}

/// Which engine runs the model.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    /// Chosen from the detected format: HF directories and llama2.c .bin natively, GGUF with llama.cpp.
    Auto,
    /// Kylin's own engine (HF directories, .safetensors files and llama2.c .bin files).
    Native,
    /// llama.cpp (GGUF files).
    #[value(name = "llama.cpp", alias = "llamacpp")]
    LlamaCpp,
}

/// Options that decide how a model is opened.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// A Hugging Face model directory, a .safetensors file (config.json beside it), a .gguf file
    /// or a llama2.c .bin file.
    pub model: PathBuf,
    /// Force a backend instead of choosing from the format.
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: BackendChoice,
    /// Worker threads (default: the machine's physical cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Context size in tokens (default: max_position_embeddings, capped at 4096).
    #[arg(long)]
    pub ctx_size: Option<usize>,
    /// JSON file that renames or adds tensor-table entries for a renamed checkpoint.
    #[arg(long, value_name = "FILE.json")]
    pub tensor_map: Option<PathBuf>,
    /// Accept a tokenizer whose ids reach beyond the model's vocab_size.
    #[arg(long)]
    pub allow_vocab_mismatch: bool,
    /// A Jinja chat template file used instead of the model's own.
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// llama.cpp's flash attention for GGUF models (its `-fa`); Kylin's own engine has one
    /// attention and refuses `on`/`off`.
    #[arg(long, value_enum, default_value = "auto")]
    pub flash_attn: FlashAttnArg,
    /// What a decoder serves: by default what its files say (sentence-transformers' modules.json:
    /// embeddings; a Qwen3-Reranker README: reranking; otherwise text). `embed` pools the last
    /// token's final state (normalised); `rerank` scores with the `yes`/`no` logits after
    /// Qwen3-Reranker's prompt.
    #[arg(long, value_enum, default_value = "auto")]
    pub task: TaskArg,
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// `--task`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskArg {
    Auto,
    Generate,
    Embed,
    Rerank,
}

impl From<TaskArg> for kylin_loader::task::TaskChoice {
    fn from(t: TaskArg) -> Self {
        match t {
            TaskArg::Auto => Self::Auto,
            TaskArg::Generate => Self::Generate,
            TaskArg::Embed => Self::Embed,
            TaskArg::Rerank => Self::Rerank,
        }
    }
}

/// llama.cpp's attention kernel for GGUF models.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlashAttnArg {
    /// llama.cpp decides (on a CPU it turns flash attention on).
    Auto,
    /// Flash attention: f16 queries, values summed in f16.
    On,
    /// Separate score and value products (f16 operands, f32 sums).
    Off,
}

/// Element type of the KV cache.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDTypeArg {
    F32,
    F16,
    Bf16,
}

/// The command-line spelling of a flag value (`f32`, `bf16`, `auto`, ...), as clap parses it.
pub fn flag_value(value: &impl ValueEnum) -> String {
    value.to_possible_value().map(|v| v.get_name().to_string()).unwrap_or_default()
}

/// Arithmetic of the native engine's matrix products.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrecisionArg {
    /// f32 activations: the exact match with transformers' float32.
    F32,
    /// Activations rounded to BF16 at each matrix product (f32 accumulation); BF16 weights, or Q8_0 weights with --quantize q8_0 on a CPU with AVX-512 BF16.
    Bf16,
    /// bf16 for BF16 weights on a CPU with BF16 matrix kernels (AMX-BF16 or AVX-512 BF16), else f32.
    Auto,
    /// int8 activations for quantized weights: --quantize's own, and for a published quantized checkpoint (W4A16, GPTQ, AWQ, W8A16, FP8) the int8 products instead of BF16 activations; faster on Intel CPUs, a little less accurate.
    Int8,
}

/// A weight format to quantize to at load.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantizeArg {
    /// GGUF's Q8_0 (blocks of 32 int8 with an f16 scale), int8 activations.
    #[value(name = "q8_0")]
    Q8_0,
    /// GGUF's Q4_K (super-blocks of 256, 6-bit sub-block scales and mins), mixed as llama.cpp's
    /// Q4_K_M with Q8_0 for the head and for v_proj/down_proj in a third of the layers.
    #[value(name = "q4_k")]
    Q4K,
}

impl QuantizeArg {
    pub fn format(self) -> kylin_engine::QuantFormat {
        match self {
            QuantizeArg::Q8_0 => kylin_engine::QuantFormat::Q8_0,
            QuantizeArg::Q4K => kylin_engine::QuantFormat::Q4K,
        }
    }
}

/// How the batching engine is sized (native models; llama.cpp runs one sequence at a time).
#[derive(Args, Debug, Clone, Default)]
pub struct EngineArgs {
    /// Memory for the KV cache, e.g. 2GiB, 512MiB, 1.5GB (default: enough for --max-seqs
    /// sequences of the full context, at most half the memory available after the weights).
    #[arg(long, value_name = "SIZE", conflicts_with = "memory_fraction")]
    pub kv_memory: Option<String>,
    /// Share (0, 1] of the memory available after the weights and activations to use for the KV cache.
    #[arg(long, value_name = "F")]
    pub memory_fraction: Option<f64>,
    /// Element type of the KV cache (default: bf16 under --precision bf16, as transformers keeps
    /// it for a BF16 model; f32 under --precision f32, which matches transformers' float32
    /// exactly; f16 with --quantize). With --quantize, bf16 also runs attention on the BF16
    /// kernels where the CPU has them (faster long prompts, slightly further from f32).
    #[arg(long, value_enum)]
    pub kv_dtype: Option<KvDTypeArg>,
    /// Sequences that run in one batch at most (default 16; 1 for run, chat and logits).
    #[arg(long)]
    pub max_seqs: Option<usize>,
    /// Tokens in one step's batch at most: decode tokens plus prefill chunks (default 512).
    #[arg(long)]
    pub max_batch_tokens: Option<usize>,
    /// Positions per KV block (default 32 where attention runs on AMX, a BF16 cache under
    /// `--precision bf16`; 16 elsewhere).
    #[arg(long)]
    pub kv_block_size: Option<usize>,
    /// Snapshots of recurrent layers' states kept for the prefix cache, for hybrid models
    /// (Qwen3.5, LFM2): a repeated prompt or the next turn of a chat resumes from one (default
    /// two per sequence, at least four; 0 turns prefix reuse off for them). Counted in
    /// --kv-memory with the KV cache.
    #[arg(long)]
    pub state_snapshots: Option<usize>,
    /// N-gram speculative decoding (prompt lookup) in the batching engine (`serve`, `bench
    /// --concurrency`): each decoding sequence proposes up to K tokens per step by finding the
    /// longest of its last 8 down to 1 tokens earlier in its prompt and output, and checks them
    /// in the same forward pass; the length adapts to how its proposals fare. Outputs are
    /// identical to decoding without it, greedy and seeded sampling alike, structured outputs
    /// and hybrid models (Qwen3.5, LFM2, Qwen3-Next) included. Default 0 (off). `run`, `chat`
    /// and single-stream `bench` decode one token at a time.
    /// With --draft-model, K is the number of tokens the draft model proposes per sequence and
    /// step (default 4 when --draft-model is given without this flag).
    #[arg(long, value_name = "K", visible_alias = "spec-tokens")]
    pub speculative_tokens: Option<usize>,
    /// The most tokens a step computes for its decoding sequences and their proposals
    /// (default 32): speculation fades out as the batch grows and is off once N sequences
    /// decode together, where a step is compute-bound and a rejected proposal costs as much as
    /// a token.
    #[arg(long, value_name = "N")]
    pub speculative_step_tokens: Option<usize>,
    /// Speculative decoding with a draft model instead of n-gram lookup (`serve`, `bench
    /// --concurrency`): DIR is a smaller Hugging Face model with the same tokenizer and
    /// vocabulary (e.g. Qwen3-0.6B for Qwen3-8B), run by Kylin's own engine beside the target.
    /// It proposes --speculative-tokens tokens (default 4) per sequence and step, greedily, and
    /// the target checks them in one forward pass; outputs are identical to decoding without
    /// it. A draft with another vocabulary is refused (VOCAB_MISMATCH). Hybrid models (Qwen3.5,
    /// LFM2) may be targets and drafts.
    #[arg(long, value_name = "DIR")]
    pub draft_model: Option<std::path::PathBuf>,
    /// Speculative decoding with the model's own multi-token-prediction head (`serve`, `bench
    /// --concurrency`): the `mtp.*` layer Qwen3.5, Qwen3.5-MoE and Qwen3-Next checkpoints ship
    /// proposes --speculative-tokens tokens (default 2) per sequence and step, greedily, from
    /// the model's own hidden states, and the model checks them in one forward pass; outputs are
    /// identical to decoding without it. A checkpoint without the head is refused
    /// (TENSOR_MISSING).
    #[arg(long, conflicts_with = "draft_model")]
    pub mtp: bool,
    /// Arithmetic of the matrix products (default auto); `f32` reproduces transformers' float32.
    #[arg(long, value_enum)]
    pub precision: Option<PrecisionArg>,
    /// Quantize the linear layers and the head at load (native models): `q8_0` is GGUF's Q8_0,
    /// the same numbers llama.cpp's Q8_0 file holds; `q4_k` is GGUF's Q4_K mixed as Q4_K_M
    /// (Q8_0 where that recipe uses Q6_K). Both compute with int8 activations.
    #[arg(long, value_enum)]
    pub quantize: Option<QuantizeArg>,
}

#[derive(Args, Debug)]
pub struct QuantizeArgs {
    /// A Hugging Face model directory (or a .safetensors file with config.json beside it) with
    /// BF16, F16 or F32 weights.
    pub model: PathBuf,
    /// The format to write.
    #[arg(long, value_enum)]
    pub to: QuantizeArg,
    /// The directory to write (created; must not already hold a model).
    pub out_dir: PathBuf,
    /// Worker threads for the quantization (default: the machine's physical cores).
    #[arg(long)]
    pub threads: Option<usize>,
    #[arg(long, value_name = "FILE.json")]
    pub tensor_map: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// A Hugging Face model directory, a .safetensors file, a .gguf file or a llama2.c .bin file.
    #[arg(required_unless_present = "architectures")]
    pub model: Option<PathBuf>,
    /// List the architectures (`config.json` `architectures[0]`) the native engine runs, with
    /// what is particular to each, instead of inspecting a model.
    #[arg(long, conflicts_with_all = ["tensor_map", "allow_vocab_mismatch"])]
    pub architectures: bool,
    /// Print one JSON object instead of the summary.
    #[arg(long)]
    pub json: bool,
    #[arg(long, value_name = "FILE.json")]
    pub tensor_map: Option<PathBuf>,
    #[arg(long)]
    pub allow_vocab_mismatch: bool,
}

/// Sampling flags; each overrides the model's generation_config.json.
#[derive(Args, Debug, Clone, Default)]
pub struct SamplingArgs {
    /// 0 means greedy.
    #[arg(long)]
    pub temperature: Option<f32>,
    /// 0 disables top-k.
    #[arg(long)]
    pub top_k: Option<usize>,
    #[arg(long)]
    pub top_p: Option<f32>,
    #[arg(long)]
    pub min_p: Option<f32>,
    #[arg(long)]
    pub repetition_penalty: Option<f32>,
    /// Seed for reproducible sampling.
    #[arg(long)]
    pub seed: Option<u64>,
}

/// Chat-template flags shared by `run --messages` and `chat`.
#[derive(Args, Debug, Clone, Default)]
pub struct TemplateArgs {
    /// Extra template variables as a JSON object, e.g. '{"enable_thinking": false}'.
    #[arg(long, value_name = "JSON")]
    pub chat_template_kwargs: Option<String>,
    /// Shorthand for --chat-template-kwargs '{"enable_thinking": false}' (Qwen3).
    #[arg(long)]
    pub no_think: bool,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt text (raw completion, no chat template).
    #[arg(short, long, conflicts_with_all = ["messages", "ids"])]
    pub prompt: Option<String>,
    /// An OpenAI-style JSON messages file, rendered through the chat template.
    #[arg(long, value_name = "FILE", conflicts_with = "ids")]
    pub messages: Option<PathBuf>,
    /// The prompt as comma-separated token ids.
    #[arg(long, value_name = "ID,ID,...")]
    pub ids: Option<String>,
    /// An image (PNG, JPEG or WebP) to ask about (repeatable): the prompt of -p becomes a user
    /// message of the images then the text, through the chat template. For vision-language
    /// directories whose vision tower Kylin runs (Qwen3.5, Gemma 3, Gemma 4).
    #[arg(long, value_name = "FILE", requires = "prompt")]
    pub image: Vec<PathBuf>,
    /// Image processor settings over preprocessor_config.json, a JSON object as vLLM's
    /// `mm_processor_kwargs`: `{"max_soft_tokens": 560}` (Gemma 4), `{"do_pan_and_scan": true}`
    /// (Gemma 3), `{"min_pixels": N, "max_pixels": N}` (Qwen).
    #[arg(long, value_name = "JSON", requires = "image")]
    pub mm_processor_kwargs: Option<String>,
    /// Maximum number of generated tokens (default: generation_config's max_new_tokens, else 256).
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// Stop when this text is generated (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Keep generating past EOS up to --max-tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print one JSON object at the end instead of streaming text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub template: TemplateArgs,
}

#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// A system message that starts the conversation.
    #[arg(long)]
    pub system: Option<String>,
    /// Maximum generated tokens per reply.
    #[arg(long)]
    pub max_tokens: Option<usize>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub template: TemplateArgs,
}

#[derive(Args, Debug)]
pub struct EmbedArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// A text to embed (repeatable).
    #[arg(short, long = "text", value_name = "TEXT")]
    pub texts: Vec<String>,
    /// A file of texts to embed, one per line (`-` reads standard input).
    #[arg(long, value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// Prefix the model's named prompt (config_sentence_transformers.json), e.g. `query`.
    #[arg(long, value_name = "NAME")]
    pub prompt_name: Option<String>,
    /// Keep the first N dimensions (Matryoshka models), normalised again if the model normalises.
    #[arg(long, value_name = "N")]
    pub dimensions: Option<usize>,
    /// Texts per batch (one forward pass of the encoder each).
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Time the embedding of the texts instead of printing them: texts per second over
    /// `--repetitions` passes after one warm-up.
    #[arg(long)]
    pub bench: bool,
    /// With --bench: the same model as a GGUF file, timed in llama.cpp's embedding mode on the
    /// same token ids in the same run (alternating), with the cosine of its embeddings to Kylin's.
    #[arg(long, value_name = "MODEL.gguf", requires = "bench")]
    pub vs: Option<PathBuf>,
    #[arg(long, default_value_t = 3)]
    pub repetitions: usize,
    /// One JSON object for the whole run instead of one line per text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct LogitsArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The input as comma-separated token ids.
    #[arg(long, value_name = "ID,ID,...", conflicts_with = "prompt")]
    pub ids: Option<String>,
    /// The input as text (tokenized with the model's tokenizer).
    #[arg(short, long)]
    pub prompt: Option<String>,
    /// How many of the best logits to print per position.
    #[arg(long, default_value_t = 20)]
    pub top: usize,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// A second model to measure in the same run, alternating with the first (A B A B ...).
    #[arg(long, value_name = "MODEL")]
    pub vs: Option<PathBuf>,
    /// Backend for the --vs model.
    #[arg(long, value_enum, default_value = "auto")]
    pub vs_backend: BackendChoice,
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Measured repetitions per model (after one warm-up).
    #[arg(long, default_value_t = 3)]
    pub repetitions: usize,
    /// Skip the warm-up round: for long prompts (a 16k-token prefill takes minutes) run right
    /// after another run of the same models has brought them into the page cache.
    #[arg(long)]
    pub no_warmup: bool,
    /// Submit this many sequences at once (distinct prompts) and measure the batching engine:
    /// aggregate decode throughput, time to first token and inter-token latency percentiles.
    #[arg(long, value_name = "N")]
    pub concurrency: Option<usize>,
    /// With --concurrency: every prompt begins with the same N tokens (a shared system prompt).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub shared_prefix: usize,
    /// With --concurrency: once every sequence decodes, submit one more request with a prompt
    /// of N tokens and report how much it delays the decoding ones (`itl_ms_max`).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub late_prompt_tokens: usize,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The text to score.
    #[arg(long, value_name = "TEXT")]
    pub file: PathBuf,
    /// Tokens per window; the second half of each window is scored.
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// Score at most this many windows.
    #[arg(long)]
    pub chunks: Option<usize>,
    /// Save the distributions here (first run) or compare with them (when the file exists).
    #[arg(long, value_name = "FILE")]
    pub kl_divergence_base: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct BenchWorkerArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[arg(long)]
    pub prompt_tokens: usize,
    #[arg(long)]
    pub gen_tokens: usize,
    /// Skip the in-process warm-up pass.
    #[arg(long)]
    pub no_warmup: bool,
    #[arg(long)]
    pub concurrency: Option<usize>,
    #[arg(long, default_value_t = 0)]
    pub shared_prefix: usize,
    #[arg(long, default_value_t = 0)]
    pub late_prompt_tokens: usize,
}

#[derive(Args, Debug)]
#[command(mut_arg("model", |a| {
    // Empty when --models-dir or --models names the models instead (checked in `serve`).
    a.required(false)
        .value_parser(clap::builder::TypedValueParser::map(clap::builder::OsStringValueParser::new(), PathBuf::from))
        .default_value("")
        .hide_default_value(true)
}))]
pub struct ServeArgs {
    /// The model (required unless --models-dir or --models is given).
    #[command(flatten)]
    pub model: ModelArgs,
    /// Serve every model in DIR under its name (each Hugging Face directory with a config.json
    /// and each .gguf file; the model options given here apply to each): loaded on its first
    /// request, unloaded when idle and the least recently used while --models-memory has no
    /// room for another. Each model's KV cache is 1GiB unless --kv-memory says otherwise.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["models", "served_model_name"])]
    pub models_dir: Option<PathBuf>,
    /// Serve the models a TOML file lists, with their own options: `[models.NAME]` tables
    /// with `path` (relative to the file), `pinned = true` to load at start and never unload,
    /// and any model option by its flag's name (`quantize = "q8_0"`, `kv-memory = "512MiB"`);
    /// a `[defaults]` table gives options every model starts from.
    #[arg(long, value_name = "FILE", conflicts_with = "served_model_name")]
    pub models: Option<PathBuf>,
    /// Memory the models of --models-dir or --models may take together (weights as their files'
    /// size, KV caches and state pools as built), e.g. 16GiB (default: 80% of the memory
    /// available at start).
    #[arg(long, value_name = "SIZE")]
    pub models_memory: Option<String>,
    /// Publish the prefix cache's changes as vLLM's KV-cache events (BlockStored, BlockRemoved,
    /// AllBlocksCleared in MessagePack) on a ZeroMQ PUB socket bound here, e.g.
    /// tcp://127.0.0.1:5557 (vLLM's default port) or tcp://*:5557, for precise prefix routers.
    #[arg(long, value_name = "ENDPOINT", conflicts_with_all = ["models_dir", "models"])]
    pub kv_events_endpoint: Option<String>,
    /// The topic of every KV-cache event message (the first frame; default empty, as vLLM's).
    #[arg(long, value_name = "TOPIC", default_value = "", requires = "kv_events_endpoint")]
    pub kv_events_topic: String,
    /// Seconds a request waits for its model to load (then 503 with Retry-After).
    #[arg(long, value_name = "SECONDS", default_value_t = 300)]
    pub load_timeout: u64,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free one, printed at start).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// The model name clients send in `model` (default: the model's directory or file name).
    #[arg(long, value_name = "NAME")]
    pub served_model_name: Option<String>,
    /// Require `Authorization: Bearer KEY` on every route but /health.
    #[arg(long, value_name = "KEY", conflicts_with = "api_key_file")]
    pub api_key: Option<String>,
    /// Read the API key from a file (its first line), so it stays out of the process list.
    #[arg(long, value_name = "FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Requests admitted beyond the engine's --max-seqs; more get 429 with Retry-After.
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub max_queue: usize,
    /// Largest request body in bytes (larger ones get 413); images sent as base64 `data:` URLs
    /// count in it.
    #[arg(long, value_name = "BYTES", default_value_t = 32 << 20)]
    pub max_body_bytes: usize,
    /// Let requests name images by local path (`file://` URLs or absolute paths in
    /// `image_url`) inside this directory; without it, only `data:` URLs are accepted. Nothing
    /// is ever fetched from the network.
    #[arg(long, value_name = "DIR")]
    pub allowed_local_media_path: Option<PathBuf>,
    /// Image processor settings every request starts from, a JSON object as vLLM's
    /// `--mm-processor-kwargs` (`{"max_soft_tokens": 560}` for Gemma 4, `{"do_pan_and_scan":
    /// true}` for Gemma 3, `{"min_pixels": N, "max_pixels": N}` for Qwen); a request's
    /// `mm_processor_kwargs` overrides them key by key.
    #[arg(long, value_name = "JSON")]
    pub mm_processor_kwargs: Option<String>,
    /// Seconds a client has to send its request body (then 408).
    #[arg(long, value_name = "SECONDS", default_value_t = 30)]
    pub body_timeout: u64,
    /// Seconds a connection has to send a request's headers (then it is closed).
    #[arg(long, value_name = "SECONDS", default_value_t = 30)]
    pub header_timeout: u64,
    /// Seconds running requests get to finish after SIGTERM or Ctrl-C.
    #[arg(long, value_name = "SECONDS", default_value_t = 30)]
    pub grace_period: u64,
}

/// What `kylin convert` writes.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvertTarget {
    /// llama2.c version 0: 28-byte header, float32 (`export.py --version 0`).
    #[value(name = "bin-v0")]
    BinV0,
    /// llama2.c version 1: 256-byte "ak42" header, float32.
    #[value(name = "bin-v1")]
    BinV1,
    /// llama2.c version 2: 256-byte "ak42" header, Q8_0 matrices (group size 64).
    #[value(name = "bin-v2")]
    BinV2,
    /// A Hugging Face directory (config.json, model.safetensors, tokenizer files) from a .bin.
    Hf,
}

#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// A Llama Hugging Face directory (for --to bin-*) or a llama2.c .bin file (for --to hf).
    pub model: PathBuf,
    /// The output format.
    #[arg(long, value_enum)]
    pub to: ConvertTarget,
    /// The output: a .bin file, or a directory for --to hf.
    pub out: PathBuf,
    /// Replace an existing output file (or write into a non-empty directory).
    #[arg(long)]
    pub force: bool,
    /// Print one JSON object describing what was written.
    #[arg(long)]
    pub json: bool,
}
