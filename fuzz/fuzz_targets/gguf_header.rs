//! A GGUF file's header (metadata and tensor table), as `kylin inspect` and the llama.cpp
//! backend's pre-flight check read it.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    let _ = kylin_loader::gguf::parse_gguf(kylin_fuzz::fake_path("x.gguf"), bytes);
});
