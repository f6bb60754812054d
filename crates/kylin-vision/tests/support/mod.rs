//! The fixtures of tests/fixtures/vision, written by tests/fixtures/make_vision_fixtures.py.

#![allow(dead_code)]

use std::path::PathBuf;

use serde_json::Value;

pub fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/vision")
}

pub fn read(name: &str) -> Vec<u8> {
    let path = fixture_dir().join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

pub fn manifest() -> Value {
    serde_json::from_slice(&read("manifest.json")).expect("manifest.json is JSON")
}

pub fn read_f32(name: &str) -> Vec<f32> {
    read(name).chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

pub fn usize_of(value: &Value) -> usize {
    value.as_u64().expect("an unsigned integer") as usize
}

/// A case's image as Pillow decoded it (`convert_to_rgb`): the row-major RGB bytes of the fixture
/// file `name`, of the case's `width` and `height`.
pub fn pillow_rgb_file(case: &Value, name: &str) -> kylin_vision::RgbImage {
    let (width, height) = (usize_of(&case["width"]) as u32, usize_of(&case["height"]) as u32);
    kylin_vision::RgbImage::from_raw(width, height, read(name)).expect("the .rgb file matches the size")
}
