//! A safetensors file held in memory, validated as `kylin_loader::load` validates one.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    let _ = kylin_loader::safetensors_file::validate_bytes(kylin_fuzz::fake_path("x.safetensors"), bytes);
});
