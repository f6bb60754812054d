//! Inputs the cargo-fuzz targets (fuzz/, docs/fuzzing.md) found to panic, replayed in the
//! ordinary test suite: every file `tests/data/fuzz/<target>-*.json` goes through the same
//! entry point as its target and must give a result (here: a typed error), never a panic.

use std::path::Path;

#[test]
fn config_inputs_found_by_the_fuzzer_are_typed_errors() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/fuzz");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if !name.starts_with("hf_config-") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let result = kylin_loader::HfConfig::from_json_str(&text).and_then(|c| c.resolve());
        let err = result.expect_err(&name);
        assert!(!err.message.is_empty(), "{name}");
        seen += 1;
    }
    assert!(seen > 0, "no regression inputs in {}", dir.display());
}

/// The finding itself: a field's value longer than the 80 bytes an error message shows, cut
/// inside a multi-byte character, panicked in the message's formatting.
#[test]
fn an_error_message_cuts_a_long_value_at_a_character_boundary() {
    let value = "é".repeat(100);
    let text = format!(r#"{{"architectures": ["Qwen3ForCausalLM"], "hidden_size": "{value}"}}"#);
    let err = kylin_loader::HfConfig::from_json_str(&text).and_then(|c| c.resolve()).unwrap_err();
    assert!(err.message.contains("hidden_size") && err.message.contains("..."), "{}", err.message);
}
