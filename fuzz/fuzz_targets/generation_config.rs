//! `generation_config.json`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    if let Ok(text) = std::str::from_utf8(bytes) {
        let path = kylin_fuzz::fake_path("generation_config.json");
        let _ = kylin_loader::GenerationDefaults::parse(text, path);
    }
});
