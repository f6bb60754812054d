//! A chat template's source, compiled and rendered for a short conversation as the engine
//! does for every chat request. A template that loops without end is a finding (-timeout).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    if let Ok(source) = std::str::from_utf8(bytes) {
        kylin_fuzz::render(&kylin_fuzz::bundle_with_template(source));
    }
});
