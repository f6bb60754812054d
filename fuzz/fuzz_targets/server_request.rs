//! The server's request bodies: the same bytes as a chat completion, a completion, a tokenize
//! and a detokenize request, then the sampling parameters of the first two.
#![no_main]

use libfuzzer_sys::fuzz_target;

use kylin_server::api::{ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest};

fuzz_target!(|bytes: &[u8]| {
    let defaults = kylin_loader::GenerationDefaults::default();
    if let Ok(chat) = ChatRequest::parse(bytes) {
        let _ = chat.common.sampling(&defaults, 0);
    }
    if let Ok(completion) = CompletionRequest::parse(bytes) {
        let _ = completion.common.sampling(&defaults, 0);
    }
    let _ = TokenizeRequest::parse(bytes);
    let _ = DetokenizeRequest::parse(bytes);
});
