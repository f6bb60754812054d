//! Property tests: random bytes and random mutations of real headers, fed to the safetensors,
//! GGUF and config parsers, never panic and never allocate more than a small multiple of the
//! input (a global allocator records the largest single allocation).

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use kylin_loader::{ErrorCode, HfConfig};
use proptest::prelude::*;

struct Tracking;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged, only recording sizes.
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as our caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as our caller's.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: same contract as our caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Tracking = Tracking;

const SHARED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata");

/// Runs `f` and returns the largest single allocation it made (approximately: other test
/// threads allocate too, but only small amounts).
fn largest_allocation(f: impl FnOnce()) -> usize {
    LARGEST.store(0, Ordering::SeqCst);
    f();
    LARGEST.load(Ordering::SeqCst)
}

/// The allocation bound for parsing `input_len` bytes: proportional to the input, never to a
/// number written in it.
fn bound(input_len: usize) -> usize {
    16 * input_len + (1 << 20)
}

fn real_safetensors() -> Vec<u8> {
    std::fs::read(Path::new(SHARED).join("fixtures/tiny-qwen2-f16/model.safetensors")).unwrap()
}

fn real_config() -> String {
    std::fs::read_to_string(Path::new(SHARED).join("fixtures/tiny-qwen3-yarn/config.json")).unwrap()
}

/// A real GGUF header from a test model when available, else a small one built here.
fn gguf_sample() -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&2u64.to_le_bytes());
    b.extend_from_slice(&3u64.to_le_bytes());
    let s = |b: &mut Vec<u8>, t: &str| {
        b.extend_from_slice(&(t.len() as u64).to_le_bytes());
        b.extend_from_slice(t.as_bytes());
    };
    s(&mut b, "general.architecture");
    b.extend_from_slice(&8u32.to_le_bytes());
    s(&mut b, "qwen3");
    s(&mut b, "tokenizer.ggml.tokens");
    b.extend_from_slice(&9u32.to_le_bytes());
    b.extend_from_slice(&8u32.to_le_bytes());
    b.extend_from_slice(&3u64.to_le_bytes());
    for t in ["a", "bb", "<|im_end|>"] {
        s(&mut b, t);
    }
    s(&mut b, "qwen3.rope.freq_base");
    b.extend_from_slice(&6u32.to_le_bytes());
    b.extend_from_slice(&1.0e6f32.to_le_bytes());
    for (name, ty) in [("token_embd.weight", 30u32), ("blk.0.ffn_down.weight", 8u32)] {
        s(&mut b, name);
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&32u64.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        b.extend_from_slice(&ty.to_le_bytes());
        b.extend_from_slice(&(if ty == 30 { 0u64 } else { 128 }).to_le_bytes());
    }
    while b.len() % 32 != 0 {
        b.push(0);
    }
    b.extend_from_slice(&[0u8; 128 + 68]);
    b
}

fn check_safetensors(bytes: &[u8]) {
    let mut result = None;
    let largest = largest_allocation(|| {
        result = Some(kylin_loader::safetensors_file::validate_bytes(Path::new("x.safetensors"), bytes))
    });
    assert!(largest <= bound(bytes.len()), "allocated {largest} bytes for {} input bytes", bytes.len());
    if let Some(Err(e)) = result {
        assert_eq!(e.code, ErrorCode::FileCorrupted, "{e}");
    }
}

fn check_gguf(bytes: &[u8]) {
    let mut result = None;
    let largest = largest_allocation(|| result = Some(kylin_loader::gguf::parse_gguf(Path::new("x.gguf"), bytes)));
    assert!(largest <= bound(bytes.len()), "allocated {largest} bytes for {} input bytes", bytes.len());
    if let Some(Err(e)) = result {
        assert!(matches!(e.code, ErrorCode::FileCorrupted | ErrorCode::ModelVersionIncompatible), "{e}");
    }
}

fn check_config(text: &str) {
    let mut outcome = None;
    let largest = largest_allocation(|| outcome = Some(HfConfig::from_json_str(text).and_then(|c| c.resolve())));
    assert!(largest <= bound(text.len()), "allocated {largest} bytes for {} input bytes", text.len());
    if let Some(Err(e)) = outcome {
        assert!(
            matches!(e.code, ErrorCode::ConfigInvalid | ErrorCode::MappingMissing | ErrorCode::OperatorUnsupported),
            "{e}"
        );
    }
}

/// A small llama2.c checkpoint of `version` (zeros for weights).
fn llama2c_sample(version: u32) -> Vec<u8> {
    let header = kylin_loader::llama2c::BinHeader {
        version,
        dim: 8,
        hidden_dim: 16,
        n_layers: 2,
        n_heads: 2,
        n_kv_heads: 1,
        vocab_size: 8,
        seq_len: 4,
        shared_classifier: version == 1,
        group_size: (version == 2).then_some(4),
        rope_theta: (version == 2).then_some(5e5),
        rms_norm_eps: (version == 2).then_some(1e-6),
    };
    let mut bytes = header.to_bytes().unwrap();
    bytes.resize(header.file_bytes().unwrap().unwrap() as usize, 0);
    bytes
}

fn check_llama2c(bytes: &[u8]) {
    let mut result = None;
    let largest =
        largest_allocation(|| result = Some(kylin_loader::llama2c::parse(Path::new("x.bin"), bytes).map(|_| ())));
    assert!(largest <= bound(bytes.len()), "allocated {largest} bytes for {} input bytes", bytes.len());
    if let Some(Err(e)) = result {
        assert!(
            matches!(e.code, ErrorCode::FileCorrupted | ErrorCode::ConfigInvalid | ErrorCode::ModelVersionIncompatible),
            "{e}"
        );
    }
}

fn check_llama2c_tokenizer(bytes: &[u8], vocab_size: usize) {
    let mut result = None;
    let largest = largest_allocation(|| {
        let path = Path::new("tokenizer.bin");
        result = Some(kylin_loader::llama2c::tokenizer::parse_vocab(path, bytes, vocab_size, false, &mut Vec::new()))
    });
    assert!(largest <= bound(bytes.len()), "allocated {largest} bytes for {} input bytes", bytes.len());
    if let Some(Err(e)) = result {
        assert!(matches!(e.code, ErrorCode::FileCorrupted | ErrorCode::VocabMismatch), "{e}");
    }
}

#[test]
fn the_samples_parse() {
    for version in 0..=2 {
        kylin_loader::llama2c::parse(Path::new("x.bin"), &llama2c_sample(version)).unwrap();
    }
    assert!(kylin_loader::safetensors_file::validate_bytes(Path::new("x"), &real_safetensors()).unwrap() > 0);
    let info = kylin_loader::gguf::parse_gguf(Path::new("x"), &gguf_sample()).unwrap();
    assert_eq!(info.vocab_size, Some(3));
    assert_eq!(info.tensor_types.get("Q8_0"), Some(&1));
    HfConfig::from_json_str(&real_config()).unwrap().resolve().unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        check_safetensors(&bytes);
        check_gguf(&bytes);
        check_llama2c(&bytes);
        check_llama2c_tokenizer(&bytes, 1 << 40);
        if let Ok(text) = std::str::from_utf8(&bytes) {
            check_config(text);
        }
    }

    #[test]
    fn random_llama2c_headers_never_allocate_from_them(
        fields in proptest::array::uniform7(any::<i32>()),
        version in 0u32..4,
        tail in proptest::collection::vec(any::<u8>(), 0..512),
    ) {
        let mut bytes = Vec::new();
        if version > 0 {
            bytes.extend_from_slice(&kylin_loader::llama2c::MAGIC.to_le_bytes());
            bytes.extend_from_slice(&(version as i32).to_le_bytes());
        }
        for f in fields {
            bytes.extend_from_slice(&f.to_le_bytes());
        }
        bytes.extend_from_slice(&tail);
        check_llama2c(&bytes);
        check_llama2c_tokenizer(&bytes, fields[0] as u32 as usize);
    }

    #[test]
    fn mutated_llama2c_files_never_panic(
        version in 0u32..3,
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let mut bytes = llama2c_sample(version);
        let header = if version == 0 { 28 } else { 256 };
        for (at, value) in edits {
            let i = at.index(header);
            bytes[i] = value;
        }
        if truncate {
            bytes.truncate(cut.index(bytes.len()));
        }
        check_llama2c(&bytes);
    }

    #[test]
    fn random_length_prefix_never_allocates_from_it(len in any::<u64>(), tail in proptest::collection::vec(any::<u8>(), 0..256)) {
        let mut bytes = len.to_le_bytes().to_vec();
        bytes.extend_from_slice(&tail);
        check_safetensors(&bytes);
        let mut g = b"GGUF\x03\0\0\0".to_vec();
        g.extend_from_slice(&len.to_le_bytes());
        g.extend_from_slice(&len.rotate_left(7).to_le_bytes());
        g.extend_from_slice(&tail);
        check_gguf(&g);
    }

    #[test]
    fn mutated_safetensors_headers_never_panic(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let mut bytes = real_safetensors();
        let header_end = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        for (at, value) in edits {
            let i = at.index(header_end);
            bytes[i] = value;
        }
        if truncate {
            bytes.truncate(cut.index(bytes.len()));
        }
        check_safetensors(&bytes);
    }

    #[test]
    fn mutated_gguf_headers_never_panic(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let mut bytes = gguf_sample();
        for (at, value) in edits {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        if truncate {
            bytes.truncate(cut.index(bytes.len()));
        }
        check_gguf(&bytes);
    }

    #[test]
    fn mutated_configs_never_panic(
        key in prop::sample::select(vec![
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
            "rope_scaling", "rope_theta", "architectures", "tie_word_embeddings", "eos_token_id",
            "use_sliding_window", "max_window_layers", "layer_types", "hidden_act",
        ]),
        value in prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            any::<u64>().prop_map(serde_json::Value::from),
            any::<f64>().prop_map(|f| serde_json::Number::from_f64(f).map_or(serde_json::Value::Null, serde_json::Value::Number)),
            ".{0,12}".prop_map(serde_json::Value::from),
            Just(serde_json::json!({"rope_type": "yarn", "factor": 0.0})),
            Just(serde_json::json!({"type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 1})),
            Just(serde_json::json!({"rope_type": "dynamic"})),
            Just(serde_json::json!(["Qwen3ForCausalLM", 3])),
            Just(serde_json::json!(["sliding_attention"])),
        ],
    ) {
        let mut obj: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&real_config()).unwrap();
        obj.insert(key.to_string(), value);
        check_config(&serde_json::to_string(&obj).unwrap());
    }
}
