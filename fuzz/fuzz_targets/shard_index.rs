//! The text of `model.safetensors.index.json` (its `weight_map`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    if let Ok(text) = std::str::from_utf8(bytes) {
        let path = kylin_fuzz::fake_path("model.safetensors.index.json");
        let _ = kylin_loader::safetensors_file::parse_shard_index(text, path);
    }
});
