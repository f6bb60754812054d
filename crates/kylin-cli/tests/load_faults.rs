//! Load-time faults (issue 15): files that cannot be read are typed errors naming the path, and
//! a weight file truncated after it was mapped ends the process with Kylin's own message
//! (`FILE_CORRUPTED`, the model's path, exit status 135) instead of a bare "Bus error".

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{kylin, s};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/fixtures").join(name)
}

/// A private copy of a fixture directory, so the test may break it.
fn copy_fixture(name: &str, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kylin-load-faults-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
    }
    dir
}

/// `[CODE]` and the message of a failed `kylin inspect`/`run`.
fn failure(args: &[&str]) -> String {
    let out = kylin(args);
    assert!(!out.status.success(), "{args:?} succeeded");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_directory_in_place_of_a_file_is_a_typed_error_naming_it() {
    for file in ["model.safetensors", "config.json", "tokenizer.json", "generation_config.json"] {
        let dir = copy_fixture("tiny-qwen3", "dir");
        let path = dir.join(file);
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        let err = failure(&["run", s(&dir), "--prompt", "hi", "--max-tokens", "1"]);
        let want = format!("[IO_ERROR] {} is a directory; expected a file", path.display());
        assert!(err.contains(&want), "{file}: wanted {want:?} in {err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_dangling_link_in_place_of_a_file_is_a_typed_error_naming_it() {
    let dir = copy_fixture("tiny-qwen3", "link");
    let path = dir.join("tokenizer.json");
    std::fs::remove_file(&path).unwrap();
    std::os::unix::fs::symlink(dir.join("no-such-file"), &path).unwrap();
    let err = failure(&["run", s(&dir), "--prompt", "hi", "--max-tokens", "1"]);
    let want = format!("[IO_ERROR] {} is a symbolic link to nothing", path.display());
    assert!(err.contains(&want), "wanted {want:?} in {err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_unreadable_file_is_a_typed_error_naming_it() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        // Root reads a file whatever its mode; the directory case above covers an open that
        // fails for a reason other than a missing file.
        eprintln!("running as root: file modes do not stop reads, nothing to check");
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let dir = copy_fixture("tiny-qwen3", "mode");
    let path = dir.join("model.safetensors");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o000)).unwrap();
    let err = failure(&["run", s(&dir), "--prompt", "hi", "--max-tokens", "1"]);
    assert!(err.contains("[IO_ERROR]"), "{err}");
    assert!(err.contains("model.safetensors"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `kylin chat` maps the weights and waits for a line on stdin; the test truncates the weight
/// file under it, then sends a line: the forward pass touches pages past the new end of the
/// file, the kernel raises SIGBUS, and Kylin's handler reports it.
#[test]
fn a_weight_file_truncated_after_mapping_gets_kylins_message_not_a_bare_bus_error() {
    let dir = copy_fixture("tiny-qwen3", "sigbus");
    let weights = dir.join("model.safetensors");
    let mut child = Command::new(env!("CARGO_BIN_EXE_kylin"))
        .args(["chat", s(&dir), "--max-tokens", "4", "--precision", "f32"])
        .env("KYLIN_QUIET", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until the weights are mapped (they appear in the process's maps).
    let maps = format!("/proc/{}/maps", child.id());
    let deadline = Instant::now() + Duration::from_secs(60);
    let name = weights.to_str().unwrap().to_string();
    while !std::fs::read_to_string(&maps).unwrap_or_default().contains(&name) {
        assert!(Instant::now() < deadline, "the weights were not mapped within 60 s");
        assert!(child.try_wait().unwrap().is_none(), "kylin chat exited before mapping the weights");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Keep only the first kilobyte: every tensor's pages are now past the end of the file.
    std::fs::OpenOptions::new().write(true).open(&weights).unwrap().set_len(1024).unwrap();
    {
        let mut stdin = child.stdin.take().unwrap();
        // The chat may already have died (a load still reading the weights); that is the same
        // outcome, so a failed write is not an error here.
        let _ = stdin.write_all(b"Hello there\n/exit\n");
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(135), "status {:?}, stderr: {err}", out.status);
    assert!(err.contains("[FILE_CORRUPTED]"), "{err}");
    assert!(err.contains("SIGBUS") && err.contains(dir.to_str().unwrap()), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
