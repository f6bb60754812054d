//! The repository stands alone (issue 38): nothing the quickstart, the tests or the scripts
//! read lies outside it. The fixtures, references, evaluation texts and the model fetcher with
//! its pinned hashes are in `testdata/` (copied in with their provenance, `testdata/README.md`);
//! this test fails when a file points at a folder beside the checkout again.

use std::path::{Path, PathBuf};

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name == "target" || name.starts_with('.') && name != ".ci" || name == "node_modules" {
            continue;
        }
        if path.is_dir() {
            walk(&path, out);
        } else if matches!(path.extension().and_then(|e| e.to_str()), Some("rs" | "py" | "sh" | "toml" | "md"))
            || name == "run"
        {
            out.push(path);
        }
    }
}

#[test]
fn nothing_reads_a_folder_beside_the_checkout() {
    let root = Path::new(ROOT);
    let mut files = Vec::new();
    for part in ["crates", "scripts", "python", "tests", "fuzz", ".ci", "docs"] {
        walk(&root.join(part), &mut files);
    }
    files.extend(["README.md", "ARCHITECTURE.md", "BENCHMARKS.md"].map(|f| root.join(f)));
    assert!(files.len() > 100, "the walk found only {} files under {ROOT}", files.len());
    // Written in two pieces so that this file does not match itself.
    let outside = [format!("../{}", "shared"), format!("parent / \"{}\"", "shared")];
    let mut offenders = Vec::new();
    for file in &files {
        let Ok(text) = std::fs::read_to_string(file) else { continue };
        for (i, line) in text.lines().enumerate() {
            if outside.iter().any(|p| line.contains(p.as_str())) {
                offenders.push(format!("{}:{}: {}", file.display(), i + 1, line.trim()));
            }
        }
    }
    assert!(offenders.is_empty(), "files that read outside the repository:\n{}", offenders.join("\n"));
    for needed in ["testdata/models/fetch.sh", "testdata/fixtures/tiny-qwen3/config.json", "testdata/reference"] {
        assert!(root.join(needed).exists(), "{needed} is missing from the repository");
    }
}
