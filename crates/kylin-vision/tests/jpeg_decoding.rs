//! JPEG decoding against Pillow's (libjpeg-turbo's) on the fixtures of
//! tests/fixtures/vision/jpeg, byte for byte, and the refusal of corrupt JPEG files.

mod support;

use kylin_vision::{ImageLimits, RgbImage, VisionError, decode_image};
use serde_json::Value;
use support::{read, usize_of};

fn cases() -> Vec<Value> {
    let manifest: Value = serde_json::from_slice(&read("jpeg/manifest.json")).expect("jpeg/manifest.json is JSON");
    manifest["images"].as_array().expect("images").clone()
}

/// Every layout (4:4:4, 4:2:2, 4:2:0, 4:4:0, 4:1:1, progressive, restart intervals, grayscale,
/// CMYK, YCCK, odd sizes) decodes to exactly the bytes transformers' `convert_to_rgb` makes of
/// Pillow's image.
#[test]
fn every_jpeg_decodes_to_pillows_bytes() {
    let cases = cases();
    assert!(cases.len() >= 15, "only {} JPEG cases", cases.len());
    let mut failures = Vec::new();
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let (width, height) = (usize_of(&case["width"]) as u32, usize_of(&case["height"]) as u32);
        let expected = RgbImage::from_raw(width, height, read(case["rgb"].as_str().unwrap())).expect("the .rgb size");
        let decoded = match decode_image(&read(case["file"].as_str().unwrap()), &ImageLimits::default()) {
            Ok(image) => image,
            Err(error) => {
                failures.push(format!("{name}: refused: {error}"));
                continue;
            }
        };
        if decoded.dimensions() != expected.dimensions() {
            failures.push(format!("{name}: {:?}, Pillow {:?}", decoded.dimensions(), expected.dimensions()));
            continue;
        }
        let differing = decoded.as_raw().iter().zip(expected.as_raw()).filter(|(a, b)| a != b).count();
        println!("{name} ({}, {}): {differing} bytes differ", case["mode"], case["what"]);
        if differing != 0 {
            failures.push(format!("{name}: {differing} of {} bytes differ from Pillow's", expected.as_raw().len()));
        }
    }
    // On valid files libjpeg-turbo's C and SIMD routines agree; on `garbage_in_scan` (corrupt
    // coefficients) only the SIMD inverse DCT gives Pillow's bytes, and mozjpeg-sys builds it
    // only where `nasm` is installed (scripts/setup.sh installs it).
    assert!(failures.is_empty(), "{failures:#?} (is nasm installed? without it mozjpeg-sys builds without SIMD)");
}

fn refusal(bytes: &[u8]) -> VisionError {
    match decode_image(bytes, &ImageLimits::default()) {
        Ok(image) => panic!("decoded {}x{} from a corrupt file", image.width(), image.height()),
        Err(error) => error,
    }
}

/// The offset of the first marker segment `marker` (e.g. `0xC4`) before the first scan.
fn segment(bytes: &[u8], marker: u8) -> usize {
    let mut at = 2;
    while bytes[at + 1] != marker {
        assert_ne!(bytes[at + 1], 0xDA, "no marker {marker:02x} before the scan");
        at += 2 + usize::from(u16::from_be_bytes([bytes[at + 2], bytes[at + 3]]));
    }
    at
}

/// The offset of the first byte of entropy-coded data.
fn scan_data(bytes: &[u8]) -> usize {
    let sos = segment(bytes, 0xDA);
    sos + 2 + usize::from(u16::from_be_bytes([bytes[sos + 2], bytes[sos + 3]]))
}

/// Garbage that breaks the scan early (a marker inside the entropy-coded data, so blocks are
/// missing): libjpeg warns and fills the rest of the scan with gray, which Pillow returns as
/// the image; Kylin refuses it. Garbage that libjpeg reads as codes cannot be told from a
/// picture, by libjpeg or by Pillow, and decodes to Pillow's bytes: the fixture
/// `jpeg/garbage_in_scan.jpg` checks that. (libjpeg-turbo's fast Huffman path replaces an
/// invalid code without a warning, so even invalid codes are not always detected.)
#[test]
fn garbage_in_the_entropy_coded_data_is_a_decode_error() {
    let jpeg = read("photo.jpg");
    let start = scan_data(&jpeg);
    let garbage: Vec<u8> = (0..64u8).map(|i| if i % 8 == 5 { 0xFF } else { i.wrapping_mul(37) ^ 0x5A }).collect();
    for (marker, at) in [(0xD3, start), (0xC8, start + 40), (0xE1, start + (jpeg.len() - start) / 2)] {
        let mut corrupt = jpeg.clone();
        corrupt[at..at + 64].copy_from_slice(&garbage);
        // A marker in the garbage: a restart marker out of place, a reserved one, an APP1.
        corrupt[at + 30] = 0xFF;
        corrupt[at + 31] = marker;
        let error = refusal(&corrupt);
        assert_eq!(error.code(), "IMAGE_DECODE", "garbage at {at}: {error}");
        println!("garbage at {at} with marker {marker:02X}: {error}");
    }
}

#[test]
fn a_bad_huffman_table_is_a_decode_error() {
    let jpeg = read("photo.jpg");
    let dht = segment(&jpeg, 0xC4);
    // The first table's 16 code counts (after the length and the class/id byte): counts that
    // overflow the code space make libjpeg refuse the table.
    let mut corrupt = jpeg.clone();
    corrupt[dht + 5..dht + 21].fill(0xFF);
    let error = refusal(&corrupt);
    assert_eq!(error.code(), "IMAGE_DECODE", "{error}");
    assert!(error.to_string().contains("Huffman"), "{error}");
    // A table class and id that libjpeg does not have (class 3).
    let mut corrupt = jpeg;
    corrupt[dht + 4] = 0x37;
    assert_eq!(refusal(&corrupt).code(), "IMAGE_DECODE");
}

#[test]
fn a_frame_claiming_more_components_than_it_has_is_a_decode_error() {
    let jpeg = read("photo.jpg");
    let sof = segment(&jpeg, 0xC0);
    // Three components claimed as four: the segment's length no longer matches.
    let mut corrupt = jpeg.clone();
    corrupt[sof + 9] = 4;
    assert_eq!(refusal(&corrupt).code(), "IMAGE_DECODE");
    // Two components (Pillow opens only 1, 3 or 4), with a length that matches.
    let mut two = jpeg[..sof + 4].to_vec();
    let length = u16::from_be_bytes([jpeg[sof + 2], jpeg[sof + 3]]);
    two[sof + 2..sof + 4].copy_from_slice(&(length - 3).to_be_bytes());
    two.extend_from_slice(&jpeg[sof + 4..sof + 9]);
    two.push(2);
    two.extend_from_slice(&jpeg[sof + 10..sof + 16]);
    two.extend_from_slice(&jpeg[sof + 2 + usize::from(length)..]);
    let error = refusal(&two);
    assert_eq!(error.code(), "IMAGE_DECODE", "{error}");
    // 200 components claimed in a segment of that length: libjpeg's limit is 10.
    let mut many = jpeg[..sof + 2].to_vec();
    many.extend_from_slice(&(8u16 + 3 * 200).to_be_bytes());
    many.extend_from_slice(&jpeg[sof + 4..sof + 9]);
    many.push(200);
    for id in 0..200u8 {
        many.extend_from_slice(&[id, 0x11, 0]);
    }
    many.extend_from_slice(&jpeg[sof + 2 + usize::from(length)..]);
    assert_eq!(refusal(&many).code(), "IMAGE_DECODE");
}

#[test]
fn a_scan_cut_short_before_the_end_marker_is_a_decode_error() {
    // The end-of-image marker is there, but the scan data stops half way: libjpeg would fill
    // the rest with gray after a warning; Pillow's image would be incomplete.
    let jpeg = read("photo.jpg");
    let start = scan_data(&jpeg);
    let mut cut = jpeg[..start + (jpeg.len() - start) / 2].to_vec();
    cut.extend_from_slice(&[0xFF, 0xD9]);
    let error = refusal(&cut);
    assert_eq!(error.code(), "IMAGE_DECODE", "{error}");
}

/// Seeded random corruptions of every fixture: each gives an image or an error, never a
/// panic or an abort, and an image has the declared size.
#[test]
fn random_corruptions_never_panic() {
    let mut files: Vec<Vec<u8>> = cases().iter().map(|c| read(c["file"].as_str().unwrap())).collect();
    files.push(read("photo.jpg"));
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let (mut decoded, mut refused) = (0, 0);
    for file in &files {
        for _ in 0..60 {
            let mut bytes = file.clone();
            for _ in 0..1 + next() % 4 {
                let at = 2 + (next() as usize) % (bytes.len() - 2);
                bytes[at] = next() as u8;
            }
            match decode_image(&bytes, &ImageLimits::default()) {
                Ok(image) => {
                    assert_eq!(image.as_raw().len(), image.width() as usize * image.height() as usize * 3);
                    decoded += 1;
                }
                Err(error) => {
                    assert!(["IMAGE_DECODE", "IMAGE_TOO_LARGE", "IMAGE_FORMAT"].contains(&error.code()), "{error}");
                    refused += 1;
                }
            }
        }
    }
    println!("{decoded} corrupted files decoded, {refused} refused");
    assert!(refused > 0);
}

/// A progressive file whose last scan is repeated past the scan limit: each scan is a pass over
/// the whole image, so the decoder stops counting at 1000 rather than spend the time.
#[test]
fn too_many_scans_are_a_decode_error() {
    let jpeg = read("jpeg/photo_progressive.jpg");
    let last_scan = jpeg.windows(2).rposition(|w| w == [0xFF, 0xDA]).expect("a scan");
    assert_eq!(&jpeg[jpeg.len() - 2..], [0xFF, 0xD9]);
    let scan = &jpeg[last_scan..jpeg.len() - 2];
    let mut repeated = jpeg[..jpeg.len() - 2].to_vec();
    // The file's own scans are about ten; 1000 more pass the limit.
    for _ in 0..1000 {
        repeated.extend_from_slice(scan);
    }
    repeated.extend_from_slice(&[0xFF, 0xD9]);
    let error = refusal(&repeated);
    assert_eq!(error.code(), "IMAGE_DECODE", "{error}");
    assert!(error.to_string().contains("more than 1000 scans"), "{error}");
    // A few repeats are within the limit and decode (libjpeg only warns about the progression).
    let mut few = jpeg[..jpeg.len() - 2].to_vec();
    few.extend_from_slice(scan);
    few.extend_from_slice(&[0xFF, 0xD9]);
    assert!(decode_image(&few, &ImageLimits::default()).is_ok());
}
