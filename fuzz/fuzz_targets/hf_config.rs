//! `config.json` (with `rope_scaling`, `quantization_config`, ...), parsed and resolved
//! into a `ModelConfig`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    if let Ok(text) = std::str::from_utf8(bytes) {
        let _ = kylin_loader::HfConfig::from_json_str(text).and_then(|c| c.resolve());
    }
});
