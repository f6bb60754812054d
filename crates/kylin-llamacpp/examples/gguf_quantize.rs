//! `cargo run --release -p kylin-llamacpp --example gguf_quantize -- IN.gguf OUT.gguf [TYPE]`:
//! llama.cpp's own `llama-quantize` (its `llama_model_quantize`, no importance matrix) on the
//! llama.cpp that Kylin links, for benchmarks that need a GGUF twin the model fetch script does
//! not provide (e.g. `qwen3-0.6b-shaped` in Q4_K_M). TYPE is `q4_k_m` (default), `q4_k_s` or
//! `q8_0`.

use std::ffi::CString;

use llama_cpp_sys_2::{
    LLAMA_FTYPE_MOSTLY_Q4_K_M, LLAMA_FTYPE_MOSTLY_Q4_K_S, LLAMA_FTYPE_MOSTLY_Q8_0, llama_backend_init,
    llama_model_quantize, llama_model_quantize_default_params,
};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: gguf_quantize IN.gguf OUT.gguf [q4_k_m|q4_k_s|q8_0]");
        std::process::exit(2);
    }
    let ftype = match args.get(3).map(String::as_str).unwrap_or("q4_k_m") {
        "q4_k_m" => LLAMA_FTYPE_MOSTLY_Q4_K_M,
        "q4_k_s" => LLAMA_FTYPE_MOSTLY_Q4_K_S,
        "q8_0" => LLAMA_FTYPE_MOSTLY_Q8_0,
        other => {
            eprintln!("unknown type '{other}'; use q4_k_m, q4_k_s or q8_0");
            std::process::exit(2);
        }
    };
    let (input, output) = match (CString::new(args[1].as_str()), CString::new(args[2].as_str())) {
        (Ok(i), Ok(o)) => (i, o),
        _ => {
            eprintln!("paths must not contain NUL bytes");
            std::process::exit(2);
        }
    };
    // SAFETY: plain C calls with valid NUL-terminated paths and a parameter struct from
    // llama.cpp's own defaults, alive for the call.
    let status = unsafe {
        llama_backend_init();
        let mut params = llama_model_quantize_default_params();
        params.ftype = ftype;
        params.nthread = 2;
        llama_model_quantize(input.as_ptr(), output.as_ptr(), &params)
    };
    if status != 0 {
        eprintln!("llama_model_quantize failed with status {status}");
        std::process::exit(1);
    }
}
