//! Qwen3.5's vision tower and images in the prompt, against what transformers computes on the
//! tiny vision-language fixtures (`tests/fixtures/make_vision_model_reference.py`: seeded
//! `pixel_values`, float32 compute, eager attention).

mod support;

use std::path::{Path, PathBuf};

use kylin_engine::vision::{PatchGrid, VisionTower};
use kylin_kernels::ThreadPool;
use serde_json::Value;
use support::floats;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The two fixtures: the shared one (2 rotary frequencies) and ours rotating every section.
fn fixtures() -> [(PathBuf, Value); 2] {
    [
        ("testdata/families/fixtures/tiny-qwen3.5-vl", "tiny-qwen3.5-vl"),
        ("tests/fixtures/tiny-qwen3.5-vl-mrope", "tiny-qwen3.5-vl-mrope"),
    ]
    .map(|(dir, name)| {
        let path = repo().join(format!("tests/fixtures/vision_model/{name}.json"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        (repo().join(dir), serde_json::from_str(&text).expect("the reference is JSON"))
    })
}

fn grid(image: &Value) -> PatchGrid {
    let g: Vec<usize> = image["grid_thw"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
    PatchGrid { t: g[0], h: g[1], w: g[2] }
}

#[test]
fn the_vision_tower_gives_transformers_merged_rows() {
    let pool = ThreadPool::new(2);
    for (dir, reference) in fixtures() {
        let loaded = kylin_loader::load(&dir, &Default::default()).expect("the fixture loads");
        let vision = loaded.vision.as_ref().expect("the Qwen3.5 vision tower is bound");
        assert!(loaded.not_run.iter().all(|p| !p.part.contains("vision")), "the tower is run, not listed as not run");
        let tower = VisionTower::new(vision).expect("the tower binds");
        let mut checked = 0;
        for case in reference["cases"].as_array().unwrap() {
            for image in case["images"].as_array().unwrap() {
                let grid = grid(image);
                let got = tower.encode(&pool, &floats(&image["pixel_values"]), grid).expect("the image encodes");
                let want = floats(&image["merged"]);
                assert_eq!(got.len(), want.len(), "{}: {grid:?}", dir.display());
                let diff = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
                eprintln!("{}: image {grid:?}: max |diff| {diff:e}", dir.display());
                assert!(diff < 2e-5, "{}: image {grid:?}: max |diff| {diff}", dir.display());
                checked += 1;
            }
        }
        assert_eq!(checked, 3);
    }
}

#[test]
fn a_grid_that_does_not_match_its_pixels_is_refused() {
    let (dir, _) = &fixtures()[0];
    let loaded = kylin_loader::load(dir, &Default::default()).unwrap();
    let tower = VisionTower::new(loaded.vision.as_ref().unwrap()).unwrap();
    let pool = ThreadPool::new(1);
    let per_patch = tower.config().patch_values();
    // Rows and columns must be multiples of the merge size (2), and the values must fill the grid.
    for (grid, values) in [
        (PatchGrid { t: 1, h: 3, w: 4 }, 12 * per_patch),
        (PatchGrid { t: 1, h: 4, w: 4 }, 16 * per_patch - 1),
        (PatchGrid { t: 0, h: 4, w: 4 }, 0),
        (PatchGrid { t: usize::MAX, h: 2, w: 2 }, 4 * per_patch),
    ] {
        let err = tower.encode(&pool, &vec![0.0; values], grid).unwrap_err();
        assert_eq!(err.code.as_str(), "INPUT_INVALID", "{grid:?}: {err}");
    }
}
