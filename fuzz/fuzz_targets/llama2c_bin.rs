//! A llama2.c checkpoint (versions 0, 1 and 2): header and weight layout.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    let _ = kylin_loader::llama2c::parse(kylin_fuzz::fake_path("x.bin"), bytes);
});
