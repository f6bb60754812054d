//! `tokenizer_config.json` (special tokens, added tokens, flags, chat templates) around a
//! tiny fixed tokenizer, then its default chat template compiled and rendered.
#![no_main]

use libfuzzer_sys::fuzz_target;

use kylin_loader::TokenizerKind;
use kylin_loader::tokenizer::{bundle_from_config, parse_json_object};

fuzz_target!(|bytes: &[u8]| {
    let Ok(text) = std::str::from_utf8(bytes) else { return };
    let path = kylin_fuzz::fake_path("tokenizer_config.json");
    let Ok(config) = parse_json_object(text, path) else { return };
    // The vocab.json + merges.txt kind also reads `added_tokens_decoder`.
    let tokenizer = kylin_fuzz::tiny_tokenizer();
    if let Ok(bundle) = bundle_from_config(tokenizer, TokenizerKind::VocabMerges, Some(&config), path, &mut Vec::new())
    {
        kylin_fuzz::render(&bundle);
    }
});
