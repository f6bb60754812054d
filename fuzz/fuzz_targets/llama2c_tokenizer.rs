//! A llama2.c `tokenizer.bin`, then the tokenizer built from it. The first four bytes are
//! the model's vocabulary size (a number the model file gives, so also untrusted) and the
//! next byte's low bit is `allow_more`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    let (Some(size), Some(flag)) = (bytes.get(..4), bytes.get(4)) else { return };
    let vocab_size = u32::from_le_bytes([size[0], size[1], size[2], size[3]]) as usize;
    let path = kylin_fuzz::fake_path("tokenizer.bin");
    let mut warnings = Vec::new();
    let parsed =
        kylin_loader::llama2c::tokenizer::parse_vocab(path, &bytes[5..], vocab_size, flag & 1 == 1, &mut warnings);
    if let Ok(vocab) = parsed {
        let _ = kylin_loader::llama2c::tokenizer::build(path, &vocab, &mut warnings);
    }
});
