//! llama2.c `.bin` files through the `kylin` binary: `convert` both ways, and `inspect`, `run`,
//! `logits`, `chat`, `bench` and `serve` on the result, with the same answers as the Hugging
//! Face directory it came from.

mod common;
#[path = "../../kylin-loader/tests/support/llama2c.rs"]
mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};

use common::{kylin, s};

use serde_json::Value;

fn ok(args: &[&str]) -> String {
    let out = kylin(args);
    assert!(out.status.success(), "kylin {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).to_string()
}

fn ok_json(args: &[&str]) -> Value {
    let text = ok(args);
    serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

fn err_code(args: &[&str]) -> String {
    let out = kylin(args);
    assert!(!out.status.success(), "kylin {args:?} succeeded");
    let text = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(text.starts_with('['), "{text}");
    text
}

const IDS: &str = "1,50,300,7,900,12,5,811,64";

/// The same top tokens at every position, with logits equal up to the order of f32 sums: the
/// `.bin`'s un-permuted q/k are made at load, and on AVX2 without AVX-512 weights made at load
/// run row-major where the HF directory's mapped ones run in strips.
fn assert_same_top_logits(got: &str, want: &str, what: &str) {
    let (got, want): (Value, Value) = (serde_json::from_str(got).unwrap(), serde_json::from_str(want).unwrap());
    assert_eq!(got["input_ids"], want["input_ids"], "{what}");
    let positions = |v: &Value| v["positions"].as_array().unwrap().clone();
    let (got, want) = (positions(&got), positions(&want));
    assert_eq!(got.len(), want.len(), "{what}");
    for (p, (g, w)) in got.iter().zip(&want).enumerate() {
        let (g, w) = (g["top"].as_array().unwrap(), w["top"].as_array().unwrap());
        assert_eq!(g.len(), w.len(), "{what}: position {p}");
        for (a, b) in g.iter().zip(w) {
            assert_eq!(a[0], b[0], "{what}: position {p}: top tokens");
            let (x, y) = (a[1].as_f64().unwrap(), b[1].as_f64().unwrap());
            assert!((x - y).abs() <= 1e-4 * y.abs().max(1.0), "{what}: position {p}: logit {x} against {y}");
        }
    }
}

#[test]
fn convert_both_ways_and_every_command_reads_the_bin() {
    let hf = support::llama_fixture(10000.0, false);
    let out = tempfile::tempdir().unwrap();
    let want_logits = ok(&["logits", s(hf.path()), "--ids", IDS, "--top", "5", "--json", "--precision", "f32"]);
    let want_run = ok_json(&[
        "run",
        s(hf.path()),
        "--ids",
        IDS,
        "--json",
        "--temperature",
        "0",
        "--max-tokens",
        "8",
        "--ignore-eos",
    ]);
    for version in 0..=2 {
        let file = out.path().join(format!("v{version}.bin"));
        let r = ok_json(&["convert", s(hf.path()), "--to", &format!("bin-v{version}"), s(&file), "--json"]);
        assert_eq!(r["format"], "llama2c-bin");
        assert_eq!(r["version"], version);
        assert!(r["bytes"].as_u64().unwrap() > 200_000);

        let report = ok_json(&["inspect", s(&file), "--json"]);
        assert_eq!(report["format"], "llama2c-bin");
        assert_eq!(report["backend"], "kylin");
        assert_eq!(report["config"]["hidden_size"], 64);
        assert_eq!(report["llama2c"]["header"]["version"], version);
        let tensors = report["llama2c"]["tensors"].as_array().unwrap();
        let wq = tensors.iter().find(|t| t["name"] == "wq").unwrap();
        assert_eq!((wq["count"].as_u64(), &wq["shape"]), (Some(2), &serde_json::json!([64, 64])));
        assert_eq!(wq["encoding"], if version == 2 { "Q8_0" } else { "F32" });
        let human = ok(&["inspect", s(&file)]);
        assert!(human.contains(&format!("llama2.c    version {version}")), "{human}");
        assert!(human.contains("copied at load"), "{human}");

        if version < 2 {
            let got = ok(&["logits", s(&file), "--ids", IDS, "--top", "5", "--json", "--precision", "f32"]);
            assert_same_top_logits(&got, &want_logits, &format!("version {version}"));
            let run = ok_json(&[
                "run",
                s(&file),
                "--ids",
                IDS,
                "--json",
                "--temperature",
                "0",
                "--max-tokens",
                "8",
                "--ignore-eos",
            ]);
            assert_eq!(run["ids"], want_run["ids"], "version {version}");
        }
    }
    // The output exists: --force is needed to replace it.
    let v1 = out.path().join("v1.bin");
    assert!(err_code(&["convert", s(hf.path()), "--to", "bin-v1", s(&v1)]).starts_with("[INPUT_INVALID]"));
    ok(&["convert", s(hf.path()), "--to", "bin-v1", s(&v1), "--force"]);

    // .bin -> HF -> the same logits.
    let back = out.path().join("back");
    let r = ok_json(&["convert", s(&v1), "--to", "hf", s(&back), "--json"]);
    assert_eq!(r["format"], "hf-dir");
    assert!(back.join("config.json").is_file() && back.join("model.safetensors").is_file());
    let got = ok(&["logits", s(&back), "--ids", IDS, "--top", "5", "--json", "--precision", "f32"]);
    assert_eq!(got, want_logits);
    assert!(err_code(&["convert", s(&v1), "--to", "hf", s(&back)]).starts_with("[INPUT_INVALID]"));
    assert!(err_code(&["convert", s(&back), "--to", "hf", s(&out.path().join("x"))]).starts_with("[INPUT_INVALID]"));

    // What the format cannot hold, and what is not a llama2.c file.
    let qwen = Path::new(support::SHARED).join("fixtures/tiny-qwen3");
    let text = err_code(&["convert", s(&qwen), "--to", "bin-v1", s(&out.path().join("q.bin"))]);
    assert!(text.starts_with("[OPERATOR_UNSUPPORTED]") && text.contains("q_norm"), "{text}");
    assert!(!out.path().join("q.bin").exists());
    let pickle = out.path().join("pytorch_model.bin");
    std::fs::write(&pickle, b"\x80\x02}q\x00(X\x05\x00\x00\x00model").unwrap();
    let text = err_code(&["inspect", s(&pickle)]);
    assert!(text.starts_with("[OPERATOR_UNSUPPORTED]") && text.contains("PyTorch"), "{text}");
}

#[test]
fn chat_bench_and_serve_run_a_bin_with_its_tokenizer() {
    let hf = support::llama_fixture(10000.0, false);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.bin");
    ok(&["convert", s(hf.path()), "--to", "bin-v1", s(&file)]);
    let vocab = support::train_vocab(1024);
    std::fs::write(dir.path().join("tokenizer.bin"), kylin_loader::llama2c::tokenizer::to_bytes(&vocab)).unwrap();
    let report = ok_json(&["inspect", s(&file), "--json"]);
    assert_eq!(report["tokenizer"]["kind"], "llama2c_bin");
    assert_eq!(report["tokenizer"]["eos_ids"], serde_json::json!([2]));

    // chat, with a template given on the command line (a tokenizer.bin has none).
    let template = dir.path().join("template.jinja");
    std::fs::write(&template, "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
        .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kylin"))
        .args(["chat", s(&file), "--chat-template", s(&template), "--temperature", "0", "--max-tokens", "6"])
        .env("KYLIN_QUIET", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"Hello there\nAnd again\n/exit\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let log = String::from_utf8_lossy(&out.stderr);
    assert_eq!(log.lines().filter(|l| l.contains("prompt tokens")).count(), 2, "{log}");

    // bench, the .bin against the directory it came from.
    let r = ok_json(&[
        "bench",
        s(hf.path()),
        "--vs",
        s(&file),
        "--prompt-tokens",
        "16",
        "--gen-tokens",
        "4",
        "--repetitions",
        "1",
        "--json",
    ]);
    let results = r["results"].as_array().unwrap();
    assert_eq!(results.len(), 2);
    for key in ["load_ms", "decode_tok_s", "peak_rss_mb"] {
        assert!(results[1][key].as_f64().unwrap() > 0.0, "{key}: {}", results[1]);
    }

    // serve: a completion from text, over a socket.
    let mut server = Command::new(env!("CARGO_BIN_EXE_kylin"))
        .args(["serve", s(&file), "--port", "0", "--threads", "1", "--kv-memory", "64MiB"])
        .env("KYLIN_QUIET", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(server.stdout.take().unwrap()).lines();
    let mut address = None;
    for line in lines.by_ref() {
        let line = line.unwrap();
        if let Some(rest) = line.strip_prefix("kylin serve: listening on http://") {
            address = rest.split_whitespace().next().map(str::to_string);
        }
        if line.starts_with("kylin serve: ready") {
            break;
        }
    }
    let address = address.expect("the server printed its address");
    let body = r#"{"prompt": "Everyone is permitted", "max_tokens": 5, "temperature": 0}"#;
    let mut stream = std::net::TcpStream::connect(&address).unwrap();
    write!(
        stream,
        "POST /v1/completions HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    server.kill().unwrap();
    server.wait().unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.contains("\"completion_tokens\":5"), "{response}");
}
