//! Every way a model directory can be broken gives its exact error code, with the path, the
//! tensor or field, and expected vs. got in the message.
//!
//! Each test copies a fixture from `shared/fixtures` into a temporary directory, breaks one
//! thing, and loads it.

use std::path::{Path, PathBuf};

use kylin_loader::{ErrorCode, KylinError, LoadOptions, detect, inspect, load};
use serde_json::{Map, Value};

const SHARED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata");

fn fixture(name: &str) -> PathBuf {
    Path::new(SHARED).join("fixtures").join(name)
}

/// A writable copy of a fixture directory.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    copy_dir(&fixture(name))
}

/// A writable copy of a family fixture (`shared/families/fixtures`).
fn copy_family(name: &str) -> tempfile::TempDir {
    copy_dir(&Path::new(SHARED).join("families/fixtures").join(name))
}

/// A writable copy of one of the repository's own family fixtures (`tests/fixtures/families`).
fn copy_more(name: &str) -> tempfile::TempDir {
    copy_dir(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/families/fixtures").join(name))
}

fn copy_dir(dir: &Path) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().expect("temp dir");
    for entry in std::fs::read_dir(dir).expect("fixture dir") {
        let entry = entry.expect("dir entry");
        let bytes = std::fs::read(entry.path()).expect("fixture file");
        std::fs::write(tmp.path().join(entry.file_name()), bytes).expect("write copy");
    }
    tmp
}

fn load_err(dir: &Path) -> KylinError {
    load_err_with(dir, &LoadOptions::default())
}

fn load_err_with(dir: &Path, opts: &LoadOptions) -> KylinError {
    match load(dir, opts) {
        Ok(_) => panic!("{} loaded, but it is broken", dir.display()),
        Err(e) => e,
    }
}

fn assert_code(err: &KylinError, code: ErrorCode, needles: &[&str]) {
    assert_eq!(err.code, code, "wrong code for: {err}");
    assert!(err.to_string().starts_with(&format!("[{}] ", code.as_str())), "{err}");
    for n in needles {
        assert!(err.message.contains(n), "message lacks {n:?}: {}", err.message);
    }
}

/// Splits a safetensors file into its header object and its data section.
fn split(bytes: &[u8]) -> (Map<String, Value>, Vec<u8>) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    (header, bytes[8 + n..].to_vec())
}

/// Writes a safetensors file from a header object and a data section.
fn join(header: &Map<String, Value>, data: &[u8]) -> Vec<u8> {
    let mut text = serde_json::to_string(header).unwrap();
    while !text.len().is_multiple_of(8) {
        text.push(' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(data);
    out
}

/// Rewrites the header of `file` with `edit`, keeping the data section.
fn edit_header(file: &Path, edit: impl FnOnce(&mut Map<String, Value>)) {
    let (mut header, data) = split(&std::fs::read(file).unwrap());
    edit(&mut header);
    std::fs::write(file, join(&header, &data)).unwrap();
}

fn rename_tensor(header: &mut Map<String, Value>, from: &str, to: &str) {
    let v = header.remove(from).unwrap_or_else(|| panic!("no tensor {from}"));
    header.insert(to.to_string(), v);
}

fn edit_json(file: &Path, edit: impl FnOnce(&mut Map<String, Value>)) {
    let mut obj: Map<String, Value> = serde_json::from_slice(&std::fs::read(file).unwrap()).unwrap();
    edit(&mut obj);
    std::fs::write(file, serde_json::to_vec_pretty(&obj).unwrap()).unwrap();
}

#[test]
fn every_fixture_loads() {
    for entry in std::fs::read_dir(Path::new(SHARED).join("fixtures")).unwrap() {
        let path = entry.unwrap().path();
        let model = load(&path, &LoadOptions::default()).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(model.weights.layers.len(), model.config.num_layers);
        assert!(model.unused_tensors.is_empty(), "{}: unused {:?}", path.display(), model.unused_tensors);
    }
}

#[test]
fn truncated_data_is_file_corrupted() {
    let dir = copy_fixture("tiny-qwen2-f16");
    let file = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() - 100]).unwrap();
    let err = load_err(dir.path());
    assert_code(&err, ErrorCode::FileCorrupted, &["model.safetensors", "data_offsets"]);
}

#[test]
fn header_length_beyond_the_file_is_file_corrupted_not_an_allocation() {
    let dir = copy_fixture("tiny-qwen2-f16");
    let file = dir.path().join("model.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[..8].copy_from_slice(&10_000_000_000u64.to_le_bytes());
    bytes.truncate(1024);
    std::fs::write(&file, &bytes).unwrap();
    let err = load_err(dir.path());
    assert_code(&err, ErrorCode::FileCorrupted, &["model.safetensors", "10000000000", "1016"]);
}

#[test]
fn bad_header_json_is_file_corrupted() {
    let dir = copy_fixture("tiny-qwen2-f16");
    let file = dir.path().join("model.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[8] = b'[';
    bytes[20] = b'}';
    std::fs::write(&file, &bytes).unwrap();
    assert_code(&load_err(dir.path()), ErrorCode::FileCorrupted, &["not a valid JSON object"]);
}

#[test]
fn overlapping_offsets_are_file_corrupted() {
    let dir = copy_fixture("tiny-qwen2-f16");
    let file = dir.path().join("model.safetensors");
    edit_header(&file, |h| {
        // Two tensors of the same size: the second now claims the first one's bytes.
        let a = h["model.layers.0.input_layernorm.weight"]["data_offsets"].clone();
        h["model.layers.0.post_attention_layernorm.weight"]["data_offsets"] = a;
    });
    assert_code(&load_err(dir.path()), ErrorCode::FileCorrupted, &["overlap", "model.layers.0."]);
}

#[test]
fn byte_length_disagreeing_with_shape_is_file_corrupted() {
    let dir = copy_fixture("tiny-qwen2-f16");
    let file = dir.path().join("model.safetensors");
    edit_header(&file, |h| {
        h["model.norm.weight"]["shape"] = serde_json::json!([7]);
    });
    assert_code(&load_err(dir.path()), ErrorCode::FileCorrupted, &["model.norm.weight", "needs 14 bytes"]);
}

#[test]
fn missing_tensors_are_all_listed() {
    let dir = copy_fixture("tiny-qwen2-f16");
    edit_header(&dir.path().join("model.safetensors"), |h| {
        rename_tensor(h, "model.layers.0.mlp.up_proj.weight", "spare.a");
        rename_tensor(h, "model.layers.1.self_attn.k_proj.bias", "spare.b");
    });
    let err = load_err(dir.path());
    assert_code(
        &err,
        ErrorCode::TensorMissing,
        &["2 required tensors", "model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.k_proj.bias"],
    );
}

#[test]
fn wrong_shape_names_tensor_expected_and_actual() {
    let dir = copy_fixture("tiny-qwen2-f16");
    let mut want = String::new();
    edit_header(&dir.path().join("model.safetensors"), |h| {
        let t = &mut h["model.layers.1.mlp.gate_proj.weight"];
        let shape: Vec<u64> = serde_json::from_value(t["shape"].clone()).unwrap();
        want = format!("expected [{}, {}]", shape[0], shape[1]);
        t["shape"] = serde_json::json!([shape[1], shape[0]]);
    });
    let err = load_err(dir.path());
    assert_code(
        &err,
        ErrorCode::TensorShapeMismatch,
        &["model.layers.1.mlp.gate_proj.weight", &want, "intermediate_size"],
    );
}

#[test]
fn unsupported_dtype_is_tensor_dtype_unsupported() {
    let dir = copy_fixture("tiny-qwen2-f16");
    edit_header(&dir.path().join("model.safetensors"), |h| {
        h["model.norm.weight"]["dtype"] = Value::from("I16");
    });
    assert_code(&load_err(dir.path()), ErrorCode::TensorDtypeUnsupported, &["model.norm.weight", "I16"]);
}

#[test]
fn missing_shard_is_file_not_found_naming_it() {
    let dir = copy_fixture("tiny-qwen3-sharded-f32");
    std::fs::remove_file(dir.path().join("model-00007-of-00017.safetensors")).unwrap();
    let err = load_err(dir.path());
    assert_code(&err, ErrorCode::FileNotFound, &["model-00007-of-00017.safetensors", "model.safetensors.index.json"]);
}

#[test]
fn index_pointing_to_the_wrong_shard_is_file_corrupted() {
    let dir = copy_fixture("tiny-qwen3-sharded-f32");
    let index = dir.path().join("model.safetensors.index.json");
    let mut moved = String::new();
    edit_json(&index, |obj| {
        let map = obj["weight_map"].as_object_mut().unwrap();
        let (name, shard) = map.iter().find(|(_, s)| s.as_str() == Some("model-00003-of-00017.safetensors")).unwrap();
        moved = name.clone();
        let _ = shard;
        map.insert(moved.clone(), Value::from("model-00004-of-00017.safetensors"));
    });
    let err = load_err(dir.path());
    assert_code(&err, ErrorCode::FileCorrupted, &[&moved, "model-00004-of-00017.safetensors"]);
}

#[test]
fn a_tensor_in_two_shards_is_file_corrupted() {
    let dir = copy_fixture("tiny-qwen3-sharded-f32");
    let first = dir.path().join("model-00001-of-00017.safetensors");
    let (h1, _) = split(&std::fs::read(&first).unwrap());
    let name = h1.keys().find(|k| *k != "__metadata__").unwrap().clone();
    // Give a tensor of another shard the same name.
    let other = dir.path().join("model-00002-of-00017.safetensors");
    edit_header(&other, |h| {
        let victim = h.keys().find(|k| *k != "__metadata__").unwrap().clone();
        rename_tensor(h, &victim, &name);
    });
    assert_code(&load_err(dir.path()), ErrorCode::FileCorrupted, &[&name, "stored twice"]);
}

#[test]
fn shard_not_in_the_index_is_ignored_with_a_warning() {
    let dir = copy_fixture("tiny-qwen3-sharded-f32");
    std::fs::write(dir.path().join("model-old.safetensors"), b"not even a safetensors file").unwrap();
    let model = load(dir.path(), &LoadOptions::default()).unwrap();
    assert_eq!(model.files.len(), 17);
    assert!(model.warnings.iter().any(|w| w.contains("model-old.safetensors")), "{:?}", model.warnings);
}

#[test]
fn sharded_untied_model_binds_its_own_head() {
    let model = load(&fixture("tiny-qwen3-sharded-f32"), &LoadOptions::default()).unwrap();
    assert_eq!(model.files.len(), 17);
    assert!(!model.weights.head.tied);
    assert_eq!(model.weights.lm_head.name, "lm_head.weight");
}

#[test]
fn untied_without_lm_head_hints_at_tie_word_embeddings() {
    let dir = copy_fixture("tiny-llama-rope3");
    edit_header(&dir.path().join("model.safetensors"), |h| rename_tensor(h, "lm_head.weight", "spare.head"));
    let err = load_err(dir.path());
    assert_code(&err, ErrorCode::TensorMissing, &["lm_head.weight", "tie_word_embeddings"]);
}

#[test]
fn tied_model_with_lm_head_present_uses_the_embedding_and_says_so() {
    // As the published Qwen3-0.6B: tied, and lm_head.weight stored as a copy of the embedding.
    let dir = copy_fixture("tiny-qwen2-f16");
    let file = dir.path().join("model.safetensors");
    let (mut header, mut data) = split(&std::fs::read(fixture("tiny-qwen2-f16").join("model.safetensors")).unwrap());
    let embed = header["model.embed_tokens.weight"].clone();
    let [a, b]: [u64; 2] = serde_json::from_value(embed["data_offsets"].clone()).unwrap();
    let start = data.len() as u64;
    data.extend_from_within(a as usize..b as usize);
    let mut head = embed.clone();
    head["data_offsets"] = serde_json::json!([start, start + (b - a)]);
    header.insert("lm_head.weight".into(), head);
    std::fs::write(&file, join(&header, &data)).unwrap();

    let model = load(dir.path(), &LoadOptions::default()).unwrap();
    assert!(model.weights.head.tied);
    assert!(model.weights.lm_head.same_bytes(&model.weights.embed_tokens));
    assert!(
        model.weights.head.reason.contains("lm_head.weight is present but ignored"),
        "{}",
        model.weights.head.reason
    );
    assert!(model.unused_tensors.is_empty());
}

#[test]
fn missing_config_field_is_config_invalid_naming_it() {
    for field in ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"] {
        let dir = copy_fixture("tiny-qwen2-f16");
        edit_json(&dir.path().join("config.json"), |c| {
            c.remove(field);
        });
        assert_code(&load_err(dir.path()), ErrorCode::ConfigInvalid, &[field]);
    }
}

#[test]
fn impossible_config_values_are_config_invalid() {
    let cases: [(&str, Value, &str); 4] = [
        ("num_attention_heads", Value::from(0), "num_attention_heads"),
        ("num_key_value_heads", Value::from(3), "not a multiple of num_key_value_heads=3"),
        ("hidden_size", Value::from("64"), "hidden_size"),
        ("rms_norm_eps", Value::from(-1.0), "rms_norm_eps"),
    ];
    for (field, value, needle) in cases {
        let dir = copy_fixture("tiny-qwen2-f16");
        edit_json(&dir.path().join("config.json"), |c| {
            c.insert(field.into(), value.clone());
        });
        assert_code(&load_err(dir.path()), ErrorCode::ConfigInvalid, &[needle]);
    }
}

#[test]
fn malformed_config_json_is_config_invalid_and_missing_is_config_missing() {
    let dir = copy_fixture("tiny-qwen2-f16");
    std::fs::write(dir.path().join("config.json"), b"{\"hidden_size\": 64,").unwrap();
    assert_code(&load_err(dir.path()), ErrorCode::ConfigInvalid, &["config.json", "not valid JSON"]);
    std::fs::remove_file(dir.path().join("config.json")).unwrap();
    assert_code(&load_err(dir.path()), ErrorCode::ConfigMissing, &["config.json"]);
}

#[test]
fn unknown_architecture_lists_the_supported_ones() {
    let dir = copy_fixture("tiny-qwen2-f16");
    edit_json(&dir.path().join("config.json"), |c| {
        c.insert("architectures".into(), serde_json::json!(["GPTNeoXForCausalLM"]));
    });
    let err = load_err(dir.path());
    assert_code(
        &err,
        ErrorCode::MappingMissing,
        &["GPTNeoXForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM"],
    );
}

#[test]
fn unsupported_rope_type_is_operator_unsupported() {
    let dir = copy_fixture("tiny-llama-rope3");
    edit_json(&dir.path().join("config.json"), |c| {
        let key = if c.contains_key("rope_parameters") { "rope_parameters" } else { "rope_scaling" };
        c[key]["rope_type"] = Value::from("axial");
    });
    assert_code(&load_err(dir.path()), ErrorCode::OperatorUnsupported, &["axial", "longrope", "yarn", "proportional"]);
}

#[test]
fn mixture_of_experts_configs_and_tensors_are_checked() {
    let dir = copy_family("tiny-qwen3-moe");
    let config = dir.path().join("config.json");
    // More experts per token than experts.
    edit_json(&config, |c| {
        c.insert("num_experts_per_tok".into(), Value::from(9));
    });
    assert_code(&load_err(dir.path()), ErrorCode::ConfigInvalid, &["num_experts_per_tok=9", "8 experts"]);
    // An expert count the checkpoint does not have: expert 8's tensors are missing, named.
    edit_json(&config, |c| {
        c.insert("num_experts_per_tok".into(), Value::from(2));
        c.insert("num_experts".into(), Value::from(9));
    });
    assert_code(
        &load_err(dir.path()),
        ErrorCode::TensorMissing,
        &["12 required tensors", "model.layers.0.mlp.experts.8.gate_proj.weight", "layers.3.mlp.experts.8.down_proj"],
    );
    // An implausible expert count is refused before anything is sized by it.
    edit_json(&config, |c| {
        c.insert("num_experts".into(), Value::from(1u64 << 40));
    });
    assert_code(&load_err(dir.path()), ErrorCode::ConfigInvalid, &["num_experts"]);
    // A wrong expert width names the tensor and the field it comes from.
    edit_json(&config, |c| {
        c.insert("num_experts".into(), Value::from(8));
        c.insert("moe_intermediate_size".into(), Value::from(40));
    });
    assert_code(
        &load_err(dir.path()),
        ErrorCode::TensorShapeMismatch,
        &["model.layers.0.mlp.experts.0.gate_proj.weight", "[48, 64]", "[40, 64]"],
    );
    // Stacked experts of the wrong shape (gpt-oss's `[experts, hidden, 2 · width]`).
    let dir = copy_family("tiny-gpt-oss");
    edit_json(&dir.path().join("config.json"), |c| {
        c.insert("num_local_experts".into(), Value::from(4));
    });
    assert_code(
        &load_err(dir.path()),
        ErrorCode::TensorShapeMismatch,
        &["model.layers.0.mlp.experts.gate_up_proj", "[8, 64, 128]", "[4, 64, 128]"],
    );
}

#[test]
fn lfm2_moe_dense_layers_and_router_fields_are_checked() {
    let dir = copy_more("tiny-lfm2-moe-dense2-bias");
    let config = dir.path().join("config.json");
    // More dense layers than layers.
    edit_json(&config, |c| {
        c.insert("num_dense_layers".into(), Value::from(6));
    });
    assert_code(
        &load_err(dir.path()),
        ErrorCode::ConfigInvalid,
        &["'num_dense_layers' is 6", "num_hidden_layers is 5"],
    );
    // A third dense layer: layer 2's MLP is not in the checkpoint (its experts are), named.
    edit_json(&config, |c| {
        c.insert("num_dense_layers".into(), Value::from(3));
    });
    assert_code(&load_err(dir.path()), ErrorCode::TensorMissing, &["model.layers.2.feed_forward.w1.weight"]);
    // A non-positive scaling factor.
    edit_json(&config, |c| {
        c.insert("num_dense_layers".into(), Value::from(2));
        c.insert("routed_scaling_factor".into(), Value::from(0.0));
    });
    assert_code(&load_err(dir.path()), ErrorCode::ConfigInvalid, &["routed_scaling_factor"]);
    // The selection bias of the wrong length.
    let dir = copy_more("tiny-lfm2-moe-dense2-bias");
    edit_json(&dir.path().join("config.json"), |c| {
        c.insert("num_experts".into(), Value::from(4));
        c.insert("num_experts_per_tok".into(), Value::from(2));
    });
    assert_code(
        &load_err(dir.path()),
        ErrorCode::TensorShapeMismatch,
        &["model.layers.2.feed_forward.expert_bias", "[8]", "[4]"],
    );
    // No layer_types: transformers' Lfm2MoeConfig has no default for them.
    let dir = copy_more("tiny-lfm2-moe-dense2-bias");
    edit_json(&dir.path().join("config.json"), |c| {
        c.remove("layer_types");
    });
    assert_code(&load_err(dir.path()), ErrorCode::ConfigInvalid, &["layer_types"]);
}

#[test]
fn qwen3_next_grouped_projections_are_checked() {
    // A fused in_proj_qkvz of the wrong height names the tensor, the expected and the actual
    // shape, and the fields the expected one comes from.
    let dir = copy_more("tiny-qwen3-next-gqa-sparse");
    let file = dir.path().join("model.safetensors");
    edit_header(&file, |h| {
        let t = h.get_mut("model.layers.0.linear_attn.in_proj_qkvz.weight").unwrap().as_object_mut().unwrap();
        t.insert("shape".into(), serde_json::json!([104, 128]));
    });
    assert_code(
        &load_err(dir.path()),
        ErrorCode::TensorShapeMismatch,
        &["model.layers.0.linear_attn.in_proj_qkvz.weight", "[208, 64]", "[104, 128]", "linear_num_value_heads=6"],
    );
    // Value heads that do not divide into the key heads' groups.
    let dir = copy_more("tiny-qwen3-next-gqa-sparse");
    edit_json(&dir.path().join("config.json"), |c| {
        c.insert("linear_num_value_heads".into(), Value::from(5));
    });
    assert_code(
        &load_err(dir.path()),
        ErrorCode::ConfigInvalid,
        &["linear_num_value_heads=5", "linear_num_key_heads=2"],
    );
    // Qwen3.5's split projections under a Qwen3-Next config are missing tensors, named.
    let dir = copy_more("tiny-qwen3-next-gqa-sparse");
    edit_header(&dir.path().join("model.safetensors"), |h| {
        rename_tensor(h, "model.layers.2.linear_attn.in_proj_ba.weight", "model.layers.2.linear_attn.in_proj_b.weight");
    });
    assert_code(&load_err(dir.path()), ErrorCode::TensorMissing, &["model.layers.2.linear_attn.in_proj_ba.weight"]);
}

#[test]
fn gemma4_sizes_per_layer_and_shared_keys_are_checked() {
    let dir = copy_family("tiny-gemma4");
    let config = dir.path().join("config.json");
    // The global layer's head width comes from per_layer_config; its tensors must have it.
    let model = load(dir.path(), &LoadOptions::default()).unwrap();
    let widths: Vec<usize> = model.config.decoder.layers.iter().map(|l| l.head_dim).collect();
    assert_eq!(widths, [16, 16, 16, 16, 16, 512]);
    edit_json(&config, |c| {
        c["per_layer_config"]["5"]["head_dim"] = Value::from(256);
    });
    assert_code(
        &load_err(dir.path()),
        ErrorCode::TensorShapeMismatch,
        &["model.layers.5.self_attn.q_proj.weight", "[2048, 64]", "[1024, 64]", "head_dim=256"],
    );
    // An override Kylin does not vary per layer is refused by name.
    edit_json(&config, |c| {
        c["per_layer_config"]["5"] = serde_json::json!({"head_dim": 512, "intermediate_size": 7});
    });
    assert_code(&load_err(dir.path()), ErrorCode::OperatorUnsupported, &["per_layer_config.5.intermediate_size"]);
    // A layer index past the decoder is CONFIG_INVALID naming the field.
    edit_json(&config, |c| {
        c["per_layer_config"] = serde_json::json!({"9": {"head_dim": 512}});
    });
    assert_code(&load_err(dir.path()), ErrorCode::ConfigInvalid, &["per_layer_config"]);
    // Sharing keys and values with every layer leaves none to compute them.
    edit_json(&config, |c| {
        c["per_layer_config"] = serde_json::json!({"5": {"head_dim": 512}});
        c.insert("num_kv_shared_layers".into(), Value::from(6));
    });
    assert_code(&load_err(dir.path()), ErrorCode::ConfigInvalid, &["num_kv_shared_layers", "6"]);
    // The last layer shares the full layers' keys, and there is no earlier full layer.
    edit_json(&config, |c| {
        c.insert("num_kv_shared_layers".into(), Value::from(1));
    });
    assert_code(&load_err(dir.path()), ErrorCode::ConfigInvalid, &["layer 5", "full_attention"]);
    // The row an image's tokens read for their per-layer inputs is the config's pad_token_id
    // (0 when absent), and it must be a row of both embeddings.
    edit_json(&config, |c| {
        c.insert("num_kv_shared_layers".into(), Value::from(0));
        c.insert("pad_token_id".into(), Value::from(7));
    });
    let model = load(dir.path(), &LoadOptions::default()).unwrap();
    assert_eq!(model.config.decoder.per_layer_input.map(|p| p.pad_row), Some(7));
    edit_json(&config, |c| {
        c.remove("pad_token_id");
    });
    let model = load(dir.path(), &LoadOptions::default()).unwrap();
    assert_eq!(model.config.decoder.per_layer_input.map(|p| p.pad_row), Some(0));
    assert!(model.config.defaulted.iter().any(|f| f == "pad_token_id"), "{:?}", model.config.defaulted);
    let vocab = model.config.vocab_size;
    edit_json(&config, |c| {
        c.insert("pad_token_id".into(), Value::from(vocab));
    });
    assert_code(&load_err(dir.path()), ErrorCode::ConfigInvalid, &["pad_token_id", &vocab.to_string()]);
    // The Mixture-of-Experts variant needs its expert fields.
    edit_json(&config, |c| {
        c.insert("pad_token_id".into(), Value::from(0));
        c.insert("enable_moe_block".into(), Value::from(true));
    });
    assert_code(&load_err(dir.path()), ErrorCode::ConfigInvalid, &["enable_moe_block", "num_experts"]);
}

#[test]
fn sliding_window_layers_slide_and_bad_windows_are_refused() {
    // Qwen2's rule: with use_sliding_window and no layer_types (which transformers 5 writes
    // and then follows), layers from max_window_layers on slide.
    let dir = copy_fixture("tiny-qwen2-f16");
    edit_json(&dir.path().join("config.json"), |c| {
        c.remove("layer_types");
        c.insert("use_sliding_window".into(), Value::from(true));
        c.insert("sliding_window".into(), Value::from(8));
        c.insert("max_window_layers".into(), Value::from(1));
    });
    let model = load(dir.path(), &LoadOptions::default()).unwrap();
    let windows: Vec<Option<usize>> = model.config.decoder.layers.iter().map(|l| l.window).collect();
    assert_eq!(windows[0], None);
    assert!(windows[1..].iter().all(|w| *w == Some(8)), "{windows:?}");
    // A zero window is CONFIG_INVALID naming the field.
    edit_json(&dir.path().join("config.json"), |c| {
        c.insert("sliding_window".into(), Value::from(0));
    });
    assert_code(&load_err(dir.path()), ErrorCode::ConfigInvalid, &["sliding_window"]);
    // A layer type Kylin does not run is OPERATOR_UNSUPPORTED naming it and its index.
    edit_json(&dir.path().join("config.json"), |c| {
        c.insert("sliding_window".into(), Value::from(8));
        let n = c["num_hidden_layers"].as_u64().unwrap() as usize;
        let mut types = vec![Value::from("full_attention"); n];
        types[n - 1] = Value::from("chunked_attention");
        c.insert("layer_types".into(), Value::Array(types));
    });
    assert_code(&load_err(dir.path()), ErrorCode::OperatorUnsupported, &["chunked_attention", "layer_types["]);
}

#[test]
fn both_config_layouts_resolve_identically() {
    let new = kylin_loader::read_config(&fixture("tiny-qwen3-yarn")).unwrap();
    let legacy = kylin_loader::read_config(&fixture("tiny-qwen3-yarn-legacy-config")).unwrap();
    assert_eq!(new, legacy);
    assert!(matches!(new.rope.scaling, kylin_loader::RopeScaling::Yarn { factor: 4.0, .. }), "{:?}", new.rope);
}

#[test]
fn defaults_are_filled_and_reported() {
    let dir = copy_fixture("tiny-qwen2-f16");
    edit_json(&dir.path().join("config.json"), |c| {
        c.remove("num_key_value_heads");
        c.remove("rope_theta");
        c.remove("rope_parameters");
    });
    let config = kylin_loader::read_config(dir.path()).unwrap();
    assert_eq!(config.num_kv_heads, config.num_heads);
    assert_eq!(config.head_dim, config.hidden_size / config.num_heads);
    assert_eq!(config.rope.theta, 10000.0);
    for d in ["num_key_value_heads", "head_dim", "rope_theta"] {
        assert!(config.defaulted.iter().any(|x| x == d), "{d} not in {:?}", config.defaulted);
    }
}

#[test]
fn tokenizer_larger_than_the_vocabulary_is_vocab_mismatch_unless_allowed() {
    let dir = copy_fixture("tiny-qwen3");
    let config = kylin_loader::read_config(dir.path()).unwrap();
    // The tokenizers library numbers added tokens after the existing ones (151669 on), so 300
    // more reach past the 151936 embedding rows: the largest id becomes 151968.
    let beyond = 151_968u64;
    edit_json(&dir.path().join("tokenizer.json"), |t| {
        let added = t["added_tokens"].as_array_mut().unwrap();
        for i in 0..300u64 {
            added.push(serde_json::json!({
                "id": 151_669 + i, "content": format!("<|extra_{i}|>"), "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true
            }));
        }
    });
    let err = load_err(dir.path());
    assert_code(&err, ErrorCode::VocabMismatch, &[&beyond.to_string(), &config.vocab_size.to_string()]);
    let opts = LoadOptions { allow_vocab_mismatch: true, ..Default::default() };
    let model = load(dir.path(), &opts).unwrap();
    assert!(model.warnings.iter().any(|w| w.contains("vocab_size")), "{:?}", model.warnings);
}

#[test]
fn missing_tokenizer_is_a_warning_or_config_missing_when_required() {
    let dir = copy_fixture("tiny-qwen2-f16");
    let model = load(dir.path(), &LoadOptions::default()).unwrap();
    assert!(model.tokenizer.is_none());
    assert!(model.warnings.iter().any(|w| w.contains("no tokenizer")), "{:?}", model.warnings);
    let opts = LoadOptions { require_tokenizer: true, ..Default::default() };
    assert_code(&load_err_with(dir.path(), &opts), ErrorCode::ConfigMissing, &["tokenizer.json", "merges.txt"]);
}

#[test]
fn tokenizer_and_eos_union() {
    let model = load(&fixture("tiny-qwen3"), &LoadOptions::default()).unwrap();
    let tok = model.tokenizer.as_ref().unwrap();
    assert_eq!(tok.vocab_size, 151669);
    assert!(!tok.chat_templates.is_empty());
    let eos = tok.eos_token.as_ref().unwrap();
    assert!(model.eos_ids.contains(&eos.id));
    for id in &model.generation.eos_token_ids {
        assert!(model.eos_ids.contains(id));
    }
}

#[test]
fn tensor_map_renames_checkpoint_tensors_and_bad_maps_are_mapping_invalid() {
    let dir = copy_fixture("tiny-qwen2-f16");
    edit_header(&dir.path().join("model.safetensors"), |h| {
        rename_tensor(h, "model.embed_tokens.weight", "tok_embeddings.weight");
        for i in 0..2 {
            rename_tensor(h, &format!("model.layers.{i}.self_attn.q_proj.weight"), &format!("blocks.{i}.attn.wq"));
        }
    });
    assert_code(&load_err(dir.path()), ErrorCode::TensorMissing, &["tensor map"]);
    let map = dir.path().join("map.json");
    std::fs::write(
        &map,
        r#"{"tensors": {"model.embed_tokens.weight": "tok_embeddings.weight",
                        "model.layers.{layer}.self_attn.q_proj.weight": "blocks.{layer}.attn.wq"}}"#,
    )
    .unwrap();
    let opts = LoadOptions { tensor_map: Some(map.clone()), ..Default::default() };
    let model = load(dir.path(), &opts).unwrap();
    assert_eq!(model.weights.layers[1].get(kylin_loader::arch::Role::QProj).unwrap().name, "blocks.1.attn.wq");

    for bad in [
        "[1, 2]",
        r#"{"tensors": {"model.not_a_table_name": "x"}}"#,
        r#"{"tensors": {"model.layers.{layer}.self_attn.q_proj.weight": "no_layer_placeholder"}}"#,
        r#"{"renames": {}}"#,
        "not json",
    ] {
        std::fs::write(&map, bad).unwrap();
        let err = load_err_with(dir.path(), &opts);
        assert_code(&err, ErrorCode::MappingInvalid, &["tensor map"]);
        assert_eq!(err.path.as_deref(), Some(map.as_path()));
    }
}

#[test]
fn detection_explains_what_it_looked_for() {
    let empty = tempfile::tempdir().unwrap();
    assert_code(&detect(empty.path()).unwrap_err(), ErrorCode::ConfigMissing, &["config.json", "model.safetensors"]);
    std::fs::write(empty.path().join("config.json"), "{}").unwrap();
    assert_code(
        &detect(empty.path()).unwrap_err(),
        ErrorCode::FileNotFound,
        &["model.safetensors", "model.safetensors.index.json"],
    );
    // (A `.bin` is a llama2.c checkpoint candidate: see the llama2.c cases below.)
    let other = empty.path().join("weights.dat");
    std::fs::write(&other, b"0123456789").unwrap();
    let err = detect(&other).unwrap_err();
    assert!(err.message.contains("GGUF") && err.message.contains("config.json"), "{err}");
    assert_code(&detect(&empty.path().join("nope")).unwrap_err(), ErrorCode::FileNotFound, &["nope"]);
    let fake = empty.path().join("fake.gguf");
    std::fs::write(&fake, b"GGML and more").unwrap();
    assert_code(&detect(&fake).unwrap_err(), ErrorCode::FileCorrupted, &["magic"]);
}

#[test]
fn a_safetensors_file_uses_the_config_beside_it() {
    let file = fixture("tiny-qwen2-f16").join("model.safetensors");
    let format = detect(&file).unwrap();
    assert_eq!(format.name(), "safetensors");
    let model = load(&file, &LoadOptions::default()).unwrap();
    assert_eq!(model.config.architecture, kylin_loader::Architecture::QWEN2);
}

#[test]
fn inspect_reports_the_resolved_model() {
    let report = inspect(&fixture("tiny-llama-rope3"), &LoadOptions::default()).unwrap();
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["format"], "hf-dir");
    assert_eq!(json["architecture"], "LlamaForCausalLM");
    assert_eq!(json["config"]["rope"]["type"], "llama3");
    assert_eq!(json["config"]["rope"]["factor"], 8.0);
    for key in [
        "hidden_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
        "rms_norm_eps",
        "tie_word_embeddings",
        "max_position_embeddings",
    ] {
        assert!(
            json["config"][key].is_number() || json["config"][key].is_boolean(),
            "config.{key}: {}",
            json["config"]
        );
    }
    assert_eq!(json["tensor_count"], 21);
    assert_eq!(json["dtypes"]["BF16"], 21);
    assert_eq!(json["binding"]["head"]["tied"], false);
    assert!(json["generation_defaults"].is_object());
    assert!(report.to_human().contains("llama3"));
}

#[test]
fn truncated_gguf_is_file_corrupted() {
    // A GGUF file built here: the magic, a version, counts, one key and one F32 tensor.
    let mut b = Vec::new();
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&1u64.to_le_bytes());
    b.extend_from_slice(&1u64.to_le_bytes());
    let s = |b: &mut Vec<u8>, t: &str| {
        b.extend_from_slice(&(t.len() as u64).to_le_bytes());
        b.extend_from_slice(t.as_bytes());
    };
    s(&mut b, "general.architecture");
    b.extend_from_slice(&8u32.to_le_bytes());
    s(&mut b, "llama");
    s(&mut b, "output.weight");
    b.extend_from_slice(&1u32.to_le_bytes());
    b.extend_from_slice(&64u64.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    while b.len() % 32 != 0 {
        b.push(0);
    }
    b.extend_from_slice(&[0u8; 256]);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    std::fs::write(&path, &b).unwrap();
    let info = kylin_loader::read_gguf_info(&path).unwrap();
    assert_eq!(info.architecture.as_deref(), Some("llama"));
    assert!(!info.tied_output);
    std::fs::write(&path, &b[..b.len() - 10]).unwrap();
    assert_code(
        &inspect(&path, &LoadOptions::default()).unwrap_err(),
        ErrorCode::FileCorrupted,
        &["output.weight", "truncated"],
    );
    std::fs::write(&path, &b[..40]).unwrap();
    assert_code(&inspect(&path, &LoadOptions::default()).unwrap_err(), ErrorCode::FileCorrupted, &["m.gguf"]);
}

#[test]
fn vocab_and_merges_are_the_fallback_and_template_lists_pick_default() {
    let dir = copy_fixture("tiny-qwen2-f16");
    // A byte-level BPE in the older two-file layout: "Ġ" is the byte-level space.
    std::fs::write(
        dir.path().join("vocab.json"),
        r#"{"h": 0, "e": 1, "l": 2, "o": 3, "Ġ": 4, "he": 5, "ll": 6, "hell": 7, "hello": 8}"#,
    )
    .unwrap();
    std::fs::write(dir.path().join("merges.txt"), "#version: 0.2\nh e\nl l\nhe ll\nhell o\n").unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"eos_token": "<|end|>", "added_tokens_decoder": {"9": {"content": "<|end|>", "special": true}},
            "chat_template": [{"name": "tool_use", "template": "tools"},
                              {"name": "default", "template": "{{ messages[0]['content'] }}"}]}"#,
    )
    .unwrap();
    let model = load(dir.path(), &LoadOptions::default()).unwrap();
    let tok = model.tokenizer.as_ref().unwrap();
    assert_eq!(tok.kind, kylin_loader::TokenizerKind::VocabMerges);
    assert_eq!(tok.tokenizer.encode("hello", false).unwrap().get_ids(), [8]);
    assert_eq!(tok.eos_token.as_ref().map(|t| t.id), Some(9));
    assert!(model.eos_ids.contains(&9));
    assert_eq!(tok.chat_templates.len(), 2);
    assert_eq!(tok.default_chat_template().unwrap().source, "{{ messages[0]['content'] }}");
}

// llama2.c checkpoints (`.bin`): every broken header or size gets its code, from the header
// bytes alone, before anything is bound.

#[path = "support/llama2c.rs"]
mod llama2c_support;

use kylin_loader::llama2c::export::write_bin;

/// A llama2.c checkpoint of `version` made from the Llama fixture, alone in its directory.
fn bin_file(version: u32) -> (tempfile::TempDir, PathBuf) {
    let hf = llama2c_support::llama_fixture(10000.0, false);
    let model = load(hf.path(), &LoadOptions::default()).unwrap();
    let out = tempfile::tempdir().unwrap();
    let file = out.path().join("model.bin");
    write_bin(&model, version, &file).unwrap();
    (out, file)
}

fn set_i32(file: &Path, at: usize, value: i32) {
    let mut bytes = std::fs::read(file).unwrap();
    bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
    std::fs::write(file, bytes).unwrap();
}

/// Byte offset of header field `k` (0 = dim ... 6 = seq_len) in a file of `version`.
fn field(version: u32, k: usize) -> usize {
    if version == 0 { 4 * k } else { 8 + 4 * k }
}

#[test]
fn llama2c_files_of_every_version_load() {
    for version in 0..=2 {
        let (_dir, file) = bin_file(version);
        assert_eq!(
            detect(&file).unwrap(),
            kylin_loader::Format::LegacyBin { file: file.clone(), version: version as i32 }
        );
        let model = load(&file, &LoadOptions::default()).unwrap();
        let c = &model.config;
        assert_eq!((c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim), (64, 2, 8, 4, 8));
        assert_eq!((c.intermediate_size, c.vocab_size, c.max_position_embeddings), (192, 1024, 2048));
        assert_eq!((c.rope.theta, c.rms_norm_eps), (10000.0, 1e-5));
        assert!(!c.tie_word_embeddings && !model.weights.head.tied);
        let info = model.llama2c.as_ref().unwrap();
        assert_eq!(info.header.version, version);
        // Versions 0 and 1 copy only wq and wk: (64 + 32) rows x 64 columns x 2 layers x 4 bytes.
        let qk = (64 + 32) * 64 * 2 * 4;
        let all = (model.weights.matrices().map(|t| t.element_count()).sum::<usize>() + 1024 * 64) as u64 * 4;
        assert_eq!(info.owned_bytes, if version == 2 { all } else { qk as u64 }, "version {version}");
        let json = serde_json::to_value(inspect(&file, &LoadOptions::default()).unwrap()).unwrap();
        assert_eq!(json["format"], "llama2c-bin");
        assert_eq!(json["llama2c"]["header"]["version"], version);
        assert_eq!(json["llama2c"]["tensors"][0]["name"], if version == 0 { "tok_embeddings" } else { "rms_att" });
        assert_eq!(json["tensor_count"], if version == 0 { 21 + 2 } else { 21 });
    }
}

#[test]
fn llama2c_short_headers_are_file_corrupted() {
    let (dir, file) = bin_file(1);
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..100]).unwrap();
    assert_code(&load_err(&file), ErrorCode::FileCorrupted, &["'ak42'", "100 bytes", "256-byte header"]);
    let v0 = dir.path().join("v0.bin");
    std::fs::write(&v0, &bytes[8..18]).unwrap();
    assert_code(&load_err(&v0), ErrorCode::FileCorrupted, &["10 bytes", "28-byte header"]);
    std::fs::write(&v0, b"").unwrap();
    assert_code(&load_err(&v0), ErrorCode::FileCorrupted, &["0 bytes"]);
}

#[test]
fn llama2c_wrong_magic_and_version_get_their_codes() {
    let (_dir, file) = bin_file(1);
    let good = std::fs::read(&file).unwrap();
    let mut bytes = good.clone();
    bytes[0] = b'3';
    std::fs::write(&file, &bytes).unwrap();
    assert_code(&load_err(&file), ErrorCode::FileCorrupted, &["magic 'ak42'", "33 34 6b 61"]);
    std::fs::write(&file, &good).unwrap();
    set_i32(&file, 4, 3);
    assert_code(&load_err(&file), ErrorCode::ModelVersionIncompatible, &["version 3", "0, 1"]);
}

#[test]
fn llama2c_sizes_that_disagree_with_the_header_are_file_corrupted() {
    for version in 0..=2 {
        let (_dir, file) = bin_file(version);
        let bytes = std::fs::read(&file).unwrap();
        let n = bytes.len();
        std::fs::write(&file, &bytes[..n - 100]).unwrap();
        let (want, got) = (n.to_string(), (n - 100).to_string());
        assert_code(&load_err(&file), ErrorCode::FileCorrupted, &[&want, &got, "100 bytes missing", "n_layers=2"]);
        let mut longer = bytes.clone();
        longer.extend_from_slice(&[0; 8]);
        std::fs::write(&file, &longer).unwrap();
        assert_code(&load_err(&file), ErrorCode::FileCorrupted, &["8 bytes too many"]);
    }
}

#[test]
fn llama2c_huge_dims_are_file_corrupted_without_allocating() {
    let (_dir, file) = bin_file(1);
    let good = std::fs::read(&file).unwrap();
    // n_layers = 2^31 - 1 in a file of under a megabyte.
    set_i32(&file, field(1, 2), i32::MAX);
    assert_code(&load_err(&file), ErrorCode::FileCorrupted, &["n_layers=2147483647", "implies a file of"]);
    // Sizes whose product overflows 64 bits.
    std::fs::write(&file, &good).unwrap();
    for (k, v) in [(0, 1 << 30), (1, i32::MAX), (2, i32::MAX), (5, i32::MAX)] {
        set_i32(&file, field(1, k), v);
    }
    assert_code(&load_err(&file), ErrorCode::FileCorrupted, &["larger than 2^64 bytes"]);
    // A version 0 dim no model has: not a llama2.c file at all.
    let (_dir0, v0) = bin_file(0);
    set_i32(&v0, field(0, 0), 1 << 28);
    assert_code(&load_err(&v0), ErrorCode::FileCorrupted, &["not a llama2.c checkpoint", "268435456"]);
}

#[test]
fn llama2c_impossible_header_values_are_config_invalid() {
    let cases: &[(u32, usize, i32, &str)] = &[
        (1, field(1, 3), 0, "n_heads = 0"),
        (1, field(1, 3), 7, "not a multiple of n_heads = 7"),
        (1, field(1, 4), 3, "n_kv_heads = 3"),
        (1, field(1, 5), -1024, "vocab_size = -1024"),
        (0, field(0, 5), 0, "vocab_size = 0"),
        (0, field(0, 6), -5, "seq_len = -5"),
        (1, field(1, 3), 64, "head size dim / n_heads = 1"),
        (2, 37, 0, "group_size = 0"),
        (2, 37, 48, "group_size 48 does not divide"),
    ];
    for &(version, at, value, needle) in cases {
        let (_dir, file) = bin_file(version);
        set_i32(&file, at, value);
        assert_code(&load_err(&file), ErrorCode::ConfigInvalid, &[needle]);
    }
    let (_dir, file) = bin_file(1);
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[36] = 7;
    std::fs::write(&file, &bytes).unwrap();
    assert_code(&load_err(&file), ErrorCode::ConfigInvalid, &["shared_classifier = 7"]);
}

#[test]
fn llama2c_header_extension_is_checked() {
    let hf = llama2c_support::llama_fixture(500000.0, true);
    let model = load(hf.path(), &LoadOptions::default()).unwrap();
    let out = tempfile::tempdir().unwrap();
    let file = out.path().join("model.bin");
    write_bin(&model, 1, &file).unwrap();
    let back = load(&file, &LoadOptions::default()).unwrap();
    assert_eq!((back.config.rope.theta, back.config.rms_norm_eps), (500000.0, 1e-5));
    assert!(back.config.tie_word_embeddings && back.weights.head.tied);
    assert!(back.config.defaulted.is_empty(), "{:?}", back.config.defaulted);
    let good = std::fs::read(&file).unwrap();
    let mut bytes = good.clone();
    bytes[64 + 8..64 + 16].copy_from_slice(&f64::NAN.to_le_bytes());
    std::fs::write(&file, &bytes).unwrap();
    assert_code(&load_err(&file), ErrorCode::ConfigInvalid, &["rope_theta = NaN"]);
    let mut bytes = good.clone();
    bytes[68] = 9;
    std::fs::write(&file, &bytes).unwrap();
    assert_code(&load_err(&file), ErrorCode::ModelVersionIncompatible, &["extension version 9"]);
}

#[test]
fn pytorch_pickles_and_ggml_files_are_named_not_misread() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pytorch_model.bin");
    for (bytes, what) in [
        (&b"\x80\x02}q\x00(X\x0b\x00\x00\x00model.embed"[..], "a Python pickle"),
        (&b"PK\x03\x04\x00\x00\x08\x08\x00\x00archive/data.pkl"[..], "a zip archive"),
    ] {
        std::fs::write(&file, bytes).unwrap();
        assert_code(&load_err(&file), ErrorCode::OperatorUnsupported, &["PyTorch", what, "safetensors", "llama2.c"]);
    }
    let ggml = dir.path().join("ggml-model-q4_0.bin");
    std::fs::write(&ggml, b"tjgg\x03\x00\x00\x00 more header bytes").unwrap();
    assert_code(&load_err(&ggml), ErrorCode::OperatorUnsupported, &["GGML", "GGUF"]);
}

#[test]
fn llama2c_files_refuse_a_tensor_map_and_check_their_tokenizer() {
    let (dir, file) = bin_file(1);
    let opts = LoadOptions { tensor_map: Some(dir.path().join("map.json")), ..LoadOptions::default() };
    assert_code(&load_err_with(&file, &opts), ErrorCode::InputInvalid, &["llama2.c", "fixed places"]);
    // A tokenizer.bin of a larger vocabulary beside the model.
    let vocab = llama2c_support::train_vocab(1100);
    std::fs::write(dir.path().join("tokenizer.bin"), kylin_loader::llama2c::tokenizer::to_bytes(&vocab)).unwrap();
    assert_code(&load_err(&file), ErrorCode::VocabMismatch, &["tokenizer.bin", "1024 tokens"]);
    let allowed = LoadOptions { allow_vocab_mismatch: true, ..LoadOptions::default() };
    let model = load(&file, &allowed).unwrap();
    assert_eq!(model.tokenizer.as_ref().unwrap().vocab_size, 1024);
    assert!(model.warnings.iter().any(|w| w.contains("first 1024 tokens")), "{:?}", model.warnings);
    // No tokenizer at all: ids only, with a warning naming what was looked for.
    std::fs::remove_file(dir.path().join("tokenizer.bin")).unwrap();
    let model = load(&file, &LoadOptions::default()).unwrap();
    assert!(model.tokenizer.is_none());
    assert!(model.warnings.iter().any(|w| w.contains("tokenizer.bin, then tokenizer.json")), "{:?}", model.warnings);
    let required = LoadOptions { require_tokenizer: true, ..LoadOptions::default() };
    assert_code(&load_err_with(&file, &required), ErrorCode::ConfigMissing, &["tokenizer.bin"]);
}

#[test]
fn what_the_llama2c_format_cannot_hold_is_refused_by_name() {
    let out = tempfile::tempdir().unwrap();
    let file = out.path().join("model.bin");
    let refuse = |dir: &Path, version: u32, needles: &[&str]| {
        let model = load(dir, &LoadOptions::default()).unwrap();
        let err = write_bin(&model, version, &file).unwrap_err();
        assert_code(&err, ErrorCode::OperatorUnsupported, needles);
        assert!(!file.exists(), "nothing is written");
    };
    refuse(&fixture("tiny-llama-rope3"), 1, &["rope_parameters.rope_type 'llama3'"]);
    refuse(&fixture("tiny-qwen3"), 1, &["Qwen3ForCausalLM", "self_attn.q_norm.weight", "head_dim 16"]);
    refuse(&fixture("tiny-qwen2-f16"), 1, &["Qwen2ForCausalLM", "model.layers.0.self_attn.q_proj.bias"]);
    let theta = llama2c_support::llama_fixture(500000.0, false);
    refuse(theta.path(), 0, &["rope_theta 500000", "bin-v1"]);
}

// Published quantized checkpoints (issue 13): the fixtures of `tests/fixtures/quantized`.

fn quantized_fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/quantized").join(name)
}

/// A writable copy of a quantized fixture directory.
fn copy_quantized(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().expect("temp dir");
    for entry in std::fs::read_dir(quantized_fixture(name)).expect("fixture dir") {
        let entry = entry.expect("dir entry");
        std::fs::copy(entry.path(), tmp.path().join(entry.file_name())).expect("copy");
    }
    tmp
}

fn edit_quantization_config(dir: &Path, edit: impl FnOnce(&mut Map<String, Value>)) {
    edit_json(&dir.join("config.json"), |c| {
        edit(c.get_mut("quantization_config").and_then(Value::as_object_mut).expect("quantization_config"))
    });
}

#[test]
fn every_quantized_fixture_loads_with_every_tensor_used() {
    for entry in std::fs::read_dir(quantized_fixture("")).unwrap() {
        let path = entry.unwrap().path();
        if !path.join("config.json").is_file() {
            continue;
        }
        let model = load(&path, &LoadOptions::default()).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(model.unused_tensors.is_empty(), "{}: unused {:?}", path.display(), model.unused_tensors);
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        // 7 matrices in each of 2 layers are quantized; the head stays as stored. The MoE
        // fixture: 4 attention matrices and 8 experts of 3 in each of 2 layers (not the routers).
        let expected = if name.ends_with("-bf16") {
            0
        } else if name.contains("moe") {
            56
        } else {
            14
        };
        assert_eq!(model.weights.published.len(), expected, "{name}: quantized modules");
        assert!(!model.weights.published.contains_key("lm_head.weight"), "{name}: the head is quantized");
    }
}

#[test]
fn a_missing_scale_is_tensor_missing() {
    for (fixture, tensor) in [
        ("tiny-qwen3-w8a8", "model.layers.0.self_attn.q_proj.weight_scale"),
        ("tiny-qwen3-fp8", "model.layers.1.mlp.up_proj.weight_scale_inv"),
        ("tiny-llama-gptq", "model.layers.0.mlp.down_proj.scales"),
        ("tiny-llama-awq", "model.layers.1.self_attn.o_proj.qzeros"),
    ] {
        let dir = copy_quantized(fixture);
        edit_header(&dir.path().join("model.safetensors"), |h| rename_tensor(h, tensor, "renamed.away"));
        assert_code(&load_err(dir.path()), ErrorCode::TensorMissing, &[tensor]);
    }
}

#[test]
fn a_wrong_packed_shape_is_tensor_shape_mismatch() {
    // The same bytes, viewed as another shape.
    let dir = copy_quantized("tiny-qwen3-w4a16");
    let tensor = "model.layers.0.self_attn.k_proj.weight_packed";
    edit_header(&dir.path().join("model.safetensors"), |h| h[tensor]["shape"] = serde_json::json!([64, 32]));
    assert_code(&load_err(dir.path()), ErrorCode::TensorShapeMismatch, &[tensor, "[128, 16]", "[64, 32]"]);

    let dir = copy_quantized("tiny-llama-gptq");
    let tensor = "model.layers.1.mlp.gate_proj.qweight";
    edit_header(&dir.path().join("model.safetensors"), |h| h[tensor]["shape"] = serde_json::json!([384, 16]));
    assert_code(&load_err(dir.path()), ErrorCode::TensorShapeMismatch, &[tensor, "[16, 384]", "[384, 16]"]);
}

#[test]
fn a_wrong_dtype_is_tensor_dtype_unsupported() {
    let dir = copy_quantized("tiny-qwen3-w8a8");
    let tensor = "model.layers.1.mlp.down_proj.weight";
    edit_header(&dir.path().join("model.safetensors"), |h| h[tensor]["dtype"] = Value::from("U8"));
    assert_code(&load_err(dir.path()), ErrorCode::TensorDtypeUnsupported, &[tensor, "U8"]);
}

#[test]
fn unsupported_variants_are_operator_unsupported_naming_the_field() {
    type Edit = fn(&mut Map<String, Value>);
    let cases: [(&str, Edit, &str); 6] = [
        ("tiny-llama-gptq", |q| q["bits"] = Value::from(3), "bits"),
        ("tiny-llama-gptq", |q| q["checkpoint_format"] = Value::from("marlin"), "checkpoint_format"),
        ("tiny-llama-awq", |q| q["version"] = Value::from("gemv"), "version"),
        ("tiny-qwen3-w4a16", |q| q["config_groups"]["group_0"]["weights"]["num_bits"] = Value::from(3), "num_bits"),
        (
            "tiny-qwen3-w8a8",
            |q| q["config_groups"]["group_0"]["weights"]["strategy"] = Value::from("tensor_group"),
            "strategy",
        ),
        ("tiny-qwen3-w8a8", |q| q["quant_method"] = Value::from("bitsandbytes"), "quant_method"),
    ];
    for (fixture, edit, field) in cases {
        let dir = copy_quantized(fixture);
        edit_quantization_config(dir.path(), edit);
        assert_code(&load_err(dir.path()), ErrorCode::OperatorUnsupported, &[field]);
    }
}

#[test]
fn inspect_reports_the_method_bits_group_and_unquantized_modules() {
    for (fixture, needles) in [
        (
            "tiny-qwen3-w4a16",
            &["compressed-tensors", "int4", "pack-quantized", "groups of 128", "unquantized: lm_head"][..],
        ),
        ("tiny-qwen3-w8a8", &["compressed-tensors", "int8", "one scale per output channel", "token, dynamic"][..]),
        ("tiny-llama-gptq", &["gptq", "int4", "groups of 128", "asymmetric", "unquantized: lm_head"][..]),
        ("tiny-llama-awq", &["awq", "int4", "groups of 128", "unquantized: lm_head"][..]),
        ("tiny-qwen3-fp8", &["fp8", "e4m3", "per 128 x 128 block", "unquantized: lm_head"][..]),
    ] {
        let report = inspect(&quantized_fixture(fixture), &LoadOptions::default()).unwrap();
        let text = report.to_human();
        let json = serde_json::to_string(&report).unwrap();
        for needle in needles {
            assert!(text.contains(needle), "{fixture}: inspect lacks {needle:?}:\n{text}");
            assert!(json.contains(needle), "{fixture}: inspect --json lacks {needle:?}:\n{json}");
        }
    }
}

#[test]
fn an_implausible_layer_count_is_refused_before_anything_is_sized_by_it() {
    let dir = copy_fixture("tiny-qwen3");
    edit_json(&dir.path().join("config.json"), |c| {
        c.insert("num_hidden_layers".into(), Value::from(3_000_000_000u64));
    });
    assert_code(&load_err(dir.path()), ErrorCode::ConfigInvalid, &["num_hidden_layers", "3000000000"]);
}

#[test]
fn hybrid_configs_and_tensors_are_checked() {
    // Qwen3.5: the layer pattern, the Gated DeltaNet sizes and their tensors.
    let dir = copy_family("tiny-qwen3.5");
    let config = dir.path().join("config.json");
    let model = load(dir.path(), &LoadOptions::default()).unwrap();
    let kinds: Vec<bool> = model.config.decoder.layers.iter().map(|l| l.mixer.is_recurrent()).collect();
    assert_eq!(kinds, [true, true, true, false]);
    assert!(model.config.decoder.attention_output_gate);
    assert_eq!(model.config.rope.partial_rotary_factor, 0.25);
    edit_json(&config, |c| {
        c["layer_types"] = serde_json::json!(["linear_attention", "mamba", "linear_attention", "full_attention"]);
    });
    assert_code(&load_err(dir.path()), ErrorCode::OperatorUnsupported, &["layer_types[1]", "mamba"]);
    edit_json(&config, |c| {
        c["layer_types"] = serde_json::json!(["linear_attention", "full_attention"]);
    });
    assert_code(&load_err(dir.path()), ErrorCode::ConfigInvalid, &["layer_types", "2 entries", "4"]);
    // Without layer_types, every full_attention_interval-th layer is attention: here every
    // second, so layer 1's linear_attn tensors are surplus and its self_attn ones missing.
    edit_json(&config, |c| {
        c.remove("layer_types");
        c.insert("full_attention_interval".into(), Value::from(2));
    });
    assert_code(&load_err(dir.path()), ErrorCode::TensorMissing, &["model.layers.1.self_attn.q_proj.weight"]);
    edit_json(&config, |c| {
        c.insert("full_attention_interval".into(), Value::from(0));
    });
    assert_code(&load_err(dir.path()), ErrorCode::ConfigInvalid, &["full_attention_interval", "0"]);
    edit_json(&config, |c| {
        c.insert("full_attention_interval".into(), Value::from(4));
        c["linear_num_value_heads"] = Value::from(3);
    });
    assert_code(
        &load_err(dir.path()),
        ErrorCode::ConfigInvalid,
        &["linear_num_value_heads=3", "linear_num_key_heads=2"],
    );
    // A value head count that divides but disagrees with the tensors: the shape error names
    // the sizes it came from.
    edit_json(&config, |c| {
        c["linear_num_value_heads"] = Value::from(8);
    });
    assert_code(
        &load_err(dir.path()),
        ErrorCode::TensorShapeMismatch,
        &["model.layers.0.linear_attn.in_proj_qkv.weight", "[192, 64]", "linear_num_value_heads=8"],
    );
    edit_json(&config, |c| {
        c["linear_num_value_heads"] = Value::from(4);
        c["linear_key_head_dim"] = Value::from(512);
    });
    assert_code(&load_err(dir.path()), ErrorCode::OperatorUnsupported, &["linear_key_head_dim", "512"]);
    edit_json(&config, |c| {
        c["linear_key_head_dim"] = Value::from(16);
        c["linear_conv_kernel_dim"] = Value::from(0);
    });
    assert_code(&load_err(dir.path()), ErrorCode::ConfigInvalid, &["linear_conv_kernel_dim", "0"]);
    edit_json(&config, |c| {
        c["linear_conv_kernel_dim"] = Value::from(4);
        c["rope_parameters"]["mrope_section"] = Value::from("11,11,10");
    });
    assert_code(&load_err(dir.path()), ErrorCode::ConfigInvalid, &["rope_parameters.mrope_section"]);
    edit_json(&config, |c| {
        c["rope_parameters"]["mrope_section"] = serde_json::json!([1, 1, 0]);
        c.insert("attn_output_gate".into(), Value::from(false));
    });
    assert_code(&load_err(dir.path()), ErrorCode::OperatorUnsupported, &["attn_output_gate"]);
    edit_json(&config, |c| {
        c.remove("attn_output_gate");
    });
    // The convolution's weight is [channels, 1, taps].
    edit_header(&dir.path().join("model.safetensors"), |h| {
        h["model.layers.2.linear_attn.conv1d.weight"]["shape"] = serde_json::json!([128, 4]);
    });
    assert_code(
        &load_err(dir.path()),
        ErrorCode::TensorShapeMismatch,
        &["model.layers.2.linear_attn.conv1d.weight", "[128, 4]", "[128, 1, 4]", "linear_conv_kernel_dim=4"],
    );

    // LFM2: the layer pattern from full_attn_idxs, the adjusted MLP width, the convolution.
    let dir = copy_family("tiny-lfm2");
    let config = dir.path().join("config.json");
    edit_json(&config, |c| {
        c.remove("layer_types");
        c["full_attn_idxs"] = serde_json::json!([2, 9]);
    });
    assert_code(&load_err(dir.path()), ErrorCode::ConfigInvalid, &["full_attn_idxs", "9"]);
    edit_json(&config, |c| {
        c["full_attn_idxs"] = serde_json::json!([2, 5]);
        c["block_auto_adjust_ff_dim"] = Value::from(true);
    });
    // 2 · 128 / 3 = 85, rounded up to 256: the stored MLP (128) no longer fits.
    assert_code(
        &load_err(dir.path()),
        ErrorCode::TensorShapeMismatch,
        &["model.layers.0.feed_forward.w1.weight", "[256, 64]", "intermediate_size=256"],
    );
    edit_json(&config, |c| {
        c["block_auto_adjust_ff_dim"] = Value::from(false);
        c["conv_bias"] = Value::from(true);
    });
    assert_code(&load_err(dir.path()), ErrorCode::TensorMissing, &["model.layers.0.conv.conv.bias"]);
    edit_json(&config, |c| {
        c["conv_bias"] = Value::from(false);
        c["conv_L_cache"] = Value::from(99);
    });
    assert_code(&load_err(dir.path()), ErrorCode::OperatorUnsupported, &["conv_L_cache", "99"]);

    // Qwen3.5-MoE: its shared expert needs a width, its router's top k fit the experts, and the
    // shared expert's gate is one of its tensors.
    let dir = copy_family("tiny-qwen3.5-moe");
    let config = dir.path().join("config.json");
    edit_json(&config, |c| {
        c["shared_expert_intermediate_size"] = Value::from(0);
    });
    assert_code(&load_err(dir.path()), ErrorCode::ConfigInvalid, &["shared_expert_intermediate_size"]);
    edit_json(&config, |c| {
        c["shared_expert_intermediate_size"] = Value::from(64);
        c["num_experts_per_tok"] = Value::from(9);
    });
    assert_code(&load_err(dir.path()), ErrorCode::ConfigInvalid, &["num_experts_per_tok=9", "8 experts"]);
    edit_json(&config, |c| {
        c["num_experts_per_tok"] = Value::from(2);
    });
    edit_header(&dir.path().join("model.safetensors"), |h| {
        rename_tensor(h, "model.layers.3.mlp.shared_expert_gate.weight", "model.layers.3.mlp.shared_gate.weight");
    });
    assert_code(&load_err(dir.path()), ErrorCode::TensorMissing, &["model.layers.3.mlp.shared_expert_gate.weight"]);
}

#[test]
fn a_published_qwen3_5_layout_binds_its_vision_tower_and_lists_its_mtp_tensors_as_not_run() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/families/fixtures/tiny-qwen3.5-vl-mtp");
    let model = load(&dir, &LoadOptions::default()).unwrap();
    assert!(model.unused_tensors.is_empty(), "unused: {:?}", model.unused_tensors);
    let parts: Vec<(&str, usize)> = model.not_run.iter().map(|p| (p.part.as_str(), p.tensors.len())).collect();
    assert_eq!(parts, [("multi-token prediction (mtp.*)", 6)]);
    let vision = model.vision.as_ref().expect("the Qwen3.5 vision tower is bound");
    assert_eq!(vision.names.len(), 21);
    assert_eq!((vision.config.depth, vision.config.hidden, vision.config.out_hidden), (1, 32, 64));
    assert!(model.warnings.iter().any(|w| w.contains("6 mtp.* tensors")), "{:?}", model.warnings);
    let report = inspect(&dir, &LoadOptions::default()).unwrap().to_human();
    assert!(report.contains("not run: multi-token prediction (mtp.*), 6 tensors: mtp."), "{report}");
    assert!(report.contains("Gated DeltaNet on 3 of 4 layers"), "{report}");
    assert!(report.contains("vision tower: qwen3_5_vision (1 blocks, width 32"), "{report}");
}

#[test]
fn a_broken_vision_tower_names_its_field_or_tensor() {
    let dir = copy_family("tiny-qwen3.5-vl");
    let config = dir.path().join("config.json");
    edit_json(&config, |c| {
        c["vision_config"]["num_heads"] = Value::from(3);
    });
    assert_code(&load_err(dir.path()), ErrorCode::ConfigInvalid, &["vision_config", "num_heads 3"]);
    edit_json(&config, |c| {
        c["vision_config"]["num_heads"] = Value::from(2);
        c["vision_config"]["num_position_embeddings"] = Value::from(60);
    });
    assert_code(&load_err(dir.path()), ErrorCode::ConfigInvalid, &["a square", "num_position_embeddings 60"]);
    edit_json(&config, |c| {
        c["vision_config"]["num_position_embeddings"] = Value::from(64);
        c["vision_config"]["patch_size"] = Value::from(-4);
    });
    assert_code(&load_err(dir.path()), ErrorCode::ConfigInvalid, &["vision_config `patch_size`", "-4"]);
    edit_json(&config, |c| {
        c["vision_config"]["patch_size"] = Value::from(4);
        c.remove("image_token_id");
    });
    assert_code(&load_err(dir.path()), ErrorCode::ConfigMissing, &["image_token_id"]);
    edit_json(&config, |c| {
        c.insert("image_token_id".into(), Value::from(1000));
        c["vision_config"]["spatial_merge_size"] = Value::from(4);
    });
    // The merger's first matrix is (32 · 2²)²; a merge of 4 implies (32 · 4²)².
    assert_code(
        &load_err(dir.path()),
        ErrorCode::TensorShapeMismatch,
        &["model.visual.merger.linear_fc1.weight", "[512, 512]", "[128, 128]"],
    );
    edit_json(&config, |c| {
        c["vision_config"]["spatial_merge_size"] = Value::from(2);
    });
    edit_header(&dir.path().join("model.safetensors"), |h| {
        rename_tensor(h, "model.visual.blocks.0.attn.qkv.weight", "model.visual.blocks.0.attn.qkv_proj.weight");
    });
    assert_code(&load_err(dir.path()), ErrorCode::TensorMissing, &["model.visual.blocks.0.attn.qkv.weight"]);
}

#[test]
fn an_mtp_head_is_bound_when_asked_for_and_its_tensors_are_checked() {
    let with_head = LoadOptions { mtp: true, ..LoadOptions::default() };
    // Bound: its tensors are the head's, not "not run"; without asking, listed as not run.
    let dir = copy_more("tiny-qwen3.5-mtp");
    let loaded = load(dir.path(), &with_head).unwrap();
    let head = loaded.mtp.as_ref().expect("the head is bound");
    assert_eq!(head.config.num_layers, 1);
    assert!(head.tensors.iter().any(|n| n == "mtp.layers.0.self_attn.q_proj.weight"), "{:?}", head.tensors);
    assert!(head.tensors.iter().any(|n| n == "mtp.norm.weight"));
    assert!(loaded.not_run.iter().all(|p| !p.part.contains("multi-token")), "{:?}", loaded.not_run);
    let plain = load(dir.path(), &LoadOptions::default()).unwrap();
    assert!(plain.mtp.is_none());
    assert!(plain.not_run.iter().any(|p| p.part.contains("multi-token")));

    // A layer tensor of the wrong shape: named, with what was expected.
    edit_header(&dir.path().join("model.safetensors"), |h| {
        let t = &mut h["mtp.layers.0.mlp.down_proj.weight"];
        let shape: Vec<u64> = serde_json::from_value(t["shape"].clone()).unwrap();
        t["shape"] = serde_json::json!([shape[1], shape[0]]);
    });
    let err = load_err_with(dir.path(), &with_head);
    assert_code(&err, ErrorCode::TensorShapeMismatch, &["mtp.layers.0.mlp.down_proj.weight"]);
    // ... and the decoder still loads without the head.
    assert!(load(dir.path(), &LoadOptions::default()).is_ok());

    // A missing projection or layer tensor.
    let dir = copy_more("tiny-qwen3.5-mtp");
    edit_header(&dir.path().join("model.safetensors"), |h| rename_tensor(h, "mtp.fc.weight", "mtp.fc2.weight"));
    let err = load_err_with(dir.path(), &with_head);
    assert_code(&err, ErrorCode::TensorMissing, &["mtp.fc.weight"]);
    let dir = copy_more("tiny-qwen3.5-mtp");
    edit_header(&dir.path().join("model.safetensors"), |h| {
        rename_tensor(h, "mtp.layers.0.self_attn.k_proj.weight", "mtp.layers.0.self_attn.k.weight")
    });
    let err = load_err_with(dir.path(), &with_head);
    assert_code(&err, ErrorCode::TensorMissing, &["mtp.layers.0.self_attn.k_proj.weight"]);
    // A head of two layers.
    let dir = copy_more("tiny-qwen3.5-mtp");
    edit_header(&dir.path().join("model.safetensors"), |h| {
        rename_tensor(h, "mtp.layers.0.input_layernorm.weight", "mtp.layers.1.input_layernorm.weight")
    });
    let err = load_err_with(dir.path(), &with_head);
    assert_code(&err, ErrorCode::OperatorUnsupported, &["mtp.layers.0", "mtp.layers.1"]);

    // A checkpoint without a head, asked for one.
    let dir = copy_family("tiny-qwen3.5");
    let err = load_err_with(dir.path(), &with_head);
    assert_code(&err, ErrorCode::TensorMissing, &["mtp.fc.weight"]);
}

#[test]
fn a_glm_nextn_layer_is_bound_when_asked_for_and_its_tensors_are_checked() {
    let with_head = LoadOptions { mtp: true, ..LoadOptions::default() };
    // GLM-4.5 keeps its NextN layer as model.layers.{num_hidden_layers}: bound as the head
    // (the copies of the embedding and head it carries count as the head's), listed as not run
    // without --mtp, never "unused".
    let dir = copy_more("tiny-glm4-moe-mtp");
    let loaded = load(dir.path(), &with_head).unwrap();
    let head = loaded.mtp.as_ref().expect("the NextN layer is bound");
    assert_eq!(head.config.num_layers, 1);
    for name in [
        "model.layers.3.eh_proj.weight",
        "model.layers.3.enorm.weight",
        "model.layers.3.hnorm.weight",
        "model.layers.3.shared_head.norm.weight",
        "model.layers.3.self_attn.q_proj.bias",
        "model.layers.3.mlp.experts.7.down_proj.weight",
        "model.layers.3.mlp.gate.e_score_correction_bias",
        "model.layers.3.embed_tokens.weight",
    ] {
        assert!(head.tensors.iter().any(|n| n == name), "{name} not in {:?}", head.tensors);
    }
    assert!(loaded.not_run.iter().all(|p| !p.part.contains("multi-token")), "{:?}", loaded.not_run);
    assert!(loaded.unused_tensors.is_empty(), "{:?}", loaded.unused_tensors);
    let plain = load(dir.path(), &LoadOptions::default()).unwrap();
    assert!(plain.mtp.is_none());
    assert!(plain.unused_tensors.is_empty(), "{:?}", plain.unused_tensors);
    let listed = plain.not_run.iter().find(|p| p.part.contains("multi-token")).expect("listed as not run");
    assert_eq!(listed.tensors.len(), head.tensors.len());

    // A missing norm of the NextN layer, and a layer tensor of the wrong shape: named.
    edit_header(&dir.path().join("model.safetensors"), |h| {
        rename_tensor(h, "model.layers.3.hnorm.weight", "model.layers.3.hnorm2.weight")
    });
    assert_code(&load_err_with(dir.path(), &with_head), ErrorCode::TensorMissing, &["model.layers.3.hnorm.weight"]);
    let dir = copy_more("tiny-glm4-moe-mtp");
    edit_header(&dir.path().join("model.safetensors"), |h| {
        let t = &mut h["model.layers.3.mlp.shared_experts.down_proj.weight"];
        let shape: Vec<u64> = serde_json::from_value(t["shape"].clone()).unwrap();
        t["shape"] = serde_json::json!([shape[1], shape[0]]);
    });
    let err = load_err_with(dir.path(), &with_head);
    assert_code(&err, ErrorCode::TensorShapeMismatch, &["model.layers.3.mlp.shared_experts.down_proj.weight"]);
    assert!(load(dir.path(), &LoadOptions::default()).is_ok(), "the decoder loads without its head");

    // Two NextN layers.
    let dir = copy_more("tiny-glm4-moe-mtp");
    edit_header(&dir.path().join("model.safetensors"), |h| {
        rename_tensor(h, "model.layers.3.shared_head.head.weight", "model.layers.4.shared_head.head.weight")
    });
    let err = load_err_with(dir.path(), &with_head);
    assert_code(&err, ErrorCode::OperatorUnsupported, &["model.layers.3", "model.layers.4"]);
}

#[test]
fn glm_router_groups_that_do_not_split_the_experts_are_refused_by_name() {
    for (edit, field) in [
        (serde_json::json!({"n_group": 3}), "n_group"),
        (serde_json::json!({"n_group": 2, "topk_group": 3}), "topk_group"),
        (serde_json::json!({"n_group": 0}), "n_group"),
        (serde_json::json!({"routed_scaling_factor": -1.0}), "routed_scaling_factor"),
        (serde_json::json!({"first_k_dense_replace": 9}), "first_k_dense_replace"),
        (serde_json::json!({"n_group": 4, "topk_group": 1}), "num_experts_per_tok"),
    ] {
        let dir = copy_more("tiny-glm4-moe-mtp");
        edit_json(&dir.path().join("config.json"), |c| {
            for (k, v) in edit.as_object().unwrap() {
                c[k] = v.clone();
            }
        });
        assert_code(&load_err(dir.path()), ErrorCode::ConfigInvalid, &[field]);
    }
}
