//! libjpeg's fatal errors reach Kylin by unwinding, but never as a panic: the fuzz harness
//! (libfuzzer-sys) and servers install panic hooks that abort or log, and a refused JPEG must
//! not trigger them. This binary holds one test so that its hook sees no other test's panics.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};

use kylin_vision::{ImageLimits, decode_image};
use support::read;

static HOOK_CALLS: AtomicUsize = AtomicUsize::new(0);

#[test]
fn refused_jpeg_files_never_reach_the_panic_hook() {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        HOOK_CALLS.fetch_add(1, Ordering::SeqCst);
        default_hook(info);
    }));
    let jpeg = read("photo.jpg");
    let sof = jpeg.windows(2).position(|w| w == [0xFF, 0xC0]).expect("a baseline JPEG has SOF0");
    let dht = jpeg.windows(2).position(|w| w == [0xFF, 0xC4]).expect("a Huffman table");
    let mut bad_table = jpeg.clone();
    bad_table[dht + 5..dht + 21].fill(0xFF);
    let mut bad_components = jpeg.clone();
    bad_components[sof + 9] = 4;
    let mut bad_precision = jpeg.clone();
    bad_precision[sof + 4] = 12;
    let mut unknown_marker = jpeg.clone();
    unknown_marker[sof] = 0xFF;
    unknown_marker[sof + 1] = 0xC8;
    let mut refused = 0;
    for bytes in [bad_table, bad_components, bad_precision, unknown_marker, jpeg[..jpeg.len() / 2].to_vec()] {
        let error = decode_image(&bytes, &ImageLimits::default()).expect_err("a corrupt JPEG");
        assert_eq!(error.code(), "IMAGE_DECODE", "{error}");
        refused += 1;
    }
    assert_eq!(refused, 5);
    assert_eq!(HOOK_CALLS.load(Ordering::SeqCst), 0, "a refused JPEG went through the panic hook");
}
