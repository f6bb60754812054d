//! Image files Kylin refuses, each with its stable code and without decoding (or allocating)
//! what it does not accept.

mod support;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use kylin_vision::{ImageFormatKind, ImageLimits, decode_image, sniff_format};
use support::read;

/// The system allocator, noting the largest single allocation made by a thread that asks.
struct LargestAllocation;

thread_local! {
    static WATCHING: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: every call is forwarded unchanged to the system allocator; the bookkeeping touches
// only const-initialised thread-locals, which neither allocate nor register destructors.
unsafe impl GlobalAlloc for LargestAllocation {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if WATCHING.with(Cell::get) {
            LARGEST.with(|largest| largest.set(largest.get().max(layout.size())));
        }
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: LargestAllocation = LargestAllocation;

/// The largest single allocation `work` makes on this thread.
fn largest_allocation<T>(work: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.with(|largest| largest.set(0));
    WATCHING.with(|watching| watching.set(true));
    let out = work();
    WATCHING.with(|watching| watching.set(false));
    (out, LARGEST.with(Cell::get))
}

fn refusal(bytes: &[u8], limits: &ImageLimits) -> kylin_vision::VisionError {
    decode_image(bytes, limits).map(|image| image.dimensions()).expect_err("the input must be refused")
}

#[test]
fn other_formats_are_refused_by_their_magic_bytes() {
    for (file, named) in [("refused/small.gif", "GIF"), ("refused/small.bmp", "BMP"), ("refused/small.tiff", "TIFF")] {
        let error = refusal(&read(file), &ImageLimits::default());
        assert_eq!(error.code(), "IMAGE_FORMAT", "{file}: {error}");
        let message = error.to_string();
        assert!(message.contains("expected a PNG, JPEG or WebP image") && message.contains(named), "{message}");
    }
    for bytes in [&b""[..], b"%PDF-1.7", b"<svg xmlns", b"hello, world", b"RIFF\x10\0\0\0WAVEfmt "] {
        assert_eq!(refusal(bytes, &ImageLimits::default()).code(), "IMAGE_FORMAT", "{bytes:?}");
    }
}

#[test]
fn formats_are_detected_by_content_not_name() {
    assert_eq!(sniff_format(&read("photo.jpg")), Ok(ImageFormatKind::Jpeg));
    assert_eq!(sniff_format(&read("logo_rgba.png")), Ok(ImageFormatKind::Png));
    assert_eq!(sniff_format(&read("lotus.webp")), Ok(ImageFormatKind::WebP));
    assert_eq!(sniff_format(&read("icon_lossless.webp")), Ok(ImageFormatKind::WebP));
}

#[test]
fn truncated_files_are_decode_errors() {
    let error = refusal(&read("refused/truncated.png"), &ImageLimits::default());
    assert_eq!(error.code(), "IMAGE_DECODE", "{error}");
    // libjpeg would fill a truncated scan with gray after a warning; Pillow refuses the file, and
    // so does Kylin.
    let jpeg = read("photo.jpg");
    for cut in [4, 20, jpeg.len() / 3, jpeg.len() - 2] {
        let error = refusal(&jpeg[..cut], &ImageLimits::default());
        assert_eq!(error.code(), "IMAGE_DECODE", "JPEG cut at {cut}: {error}");
    }
    let webp = read("lotus.webp");
    let error = refusal(&webp[..webp.len() / 2], &ImageLimits::default());
    assert_eq!(error.code(), "IMAGE_DECODE", "{error}");
}

/// A PNG of 83 bytes whose header claims 100000 x 100000 pixels (30 GB of RGB): refused from
/// the header, with no allocation larger than a megabyte.
#[test]
fn decompression_bomb_is_refused_from_the_header() {
    let bomb = read("refused/bomb_100000x100000.png");
    assert!(bomb.len() < 100);
    let (error, largest) = largest_allocation(|| refusal(&bomb, &ImageLimits::default()));
    assert!(largest < 1 << 20, "refusing the bomb allocated {largest} bytes at once");
    assert_eq!(error.code(), "IMAGE_TOO_LARGE", "{error}");
    let message = error.to_string();
    assert!(message.contains("100000x100000") && message.contains("50000000"), "{message}");
}

/// The same for a JPEG: a real file whose start-of-frame marker is patched to claim 65000 x
/// 65000 pixels.
#[test]
fn jpeg_claiming_a_huge_frame_is_refused_from_the_header() {
    let mut jpeg = read("photo.jpg");
    let sof = jpeg.windows(2).position(|w| w == [0xFF, 0xC0]).expect("a baseline JPEG has SOF0");
    // SOF0: marker, length (2), precision (1), height (2), width (2).
    jpeg[sof + 5..sof + 9].copy_from_slice(&[0xFD, 0xE8, 0xFD, 0xE8]);
    let (error, largest) = largest_allocation(|| refusal(&jpeg, &ImageLimits::default()));
    assert!(largest < 1 << 20, "refusing the JPEG allocated {largest} bytes at once");
    assert_eq!(error.code(), "IMAGE_TOO_LARGE", "{error}");
    assert!(error.to_string().contains("65000x65000"), "{error}");
}

#[test]
fn limits_are_enforced() {
    let png = read("logo_rgba.png");
    let limits = ImageLimits { max_bytes: png.len() - 1, ..ImageLimits::default() };
    let error = refusal(&png, &limits);
    assert_eq!(error.code(), "IMAGE_TOO_LARGE");
    assert!(error.to_string().contains(&format!("{} bytes", png.len())), "{error}");

    // logo_rgba.png is 151 x 51 = 7701 pixels.
    let limits = ImageLimits { max_pixels: 7700, ..ImageLimits::default() };
    assert_eq!(refusal(&png, &limits).code(), "IMAGE_TOO_LARGE");
    let limits = ImageLimits { max_pixels: 7701, ..ImageLimits::default() };
    let (decoded, largest) = largest_allocation(|| decode_image(&png, &limits).map(|image| image.dimensions()));
    assert_eq!(decoded, Ok((151, 51)));
    // The watch sees real allocations: decoding the 151 x 51 image allocates its pixels.
    assert!(largest >= 151 * 51 * 3, "{largest}");
    let limits = ImageLimits { max_side: 150, ..ImageLimits::default() };
    assert_eq!(refusal(&png, &limits).code(), "IMAGE_TOO_LARGE");
}

/// Corrupting bytes anywhere after the signature gives an error or an image, never a panic.
#[test]
fn corrupted_bytes_never_panic() {
    for file in ["logo_rgba.png", "photo.jpg", "lotus.webp", "icon_lossless.webp", "icon_palette.png"] {
        let original = read(file);
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..200 {
            let mut bytes = original.clone();
            for _ in 0..4 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let at = 12 + (state as usize) % (bytes.len() - 12);
                bytes[at] = (state >> 32) as u8;
            }
            if let Err(error) = decode_image(&bytes, &ImageLimits::default()) {
                assert!(!error.message.is_empty());
            }
        }
    }
}
