//! JPEG decoding with libjpeg-turbo's decoder, as Pillow decodes.
//!
//! Pillow decodes JPEG files with libjpeg-turbo at its defaults: the accurate integer inverse
//! DCT (`JDCT_ISLOW`), fancy (triangle-filter) chroma upsampling and the library's fixed-point
//! YCbCr to RGB tables. The decoder here is the same code, built from the sources `mozjpeg-sys`
//! vendors (mozjpeg's decompressor is libjpeg-turbo's) with libjpeg-turbo's SIMD routines, as
//! Pillow's wheels build it, so the bytes equal Pillow's. On valid files the SIMD and the C
//! routines agree exactly; on corrupt ones (coefficients out of range) the 16-bit SIMD inverse
//! DCT differs from the C one, and using the SIMD build keeps even those equal to Pillow's.
//!
//! libjpeg reports a fatal error by calling `error_exit`, which must not return. Here it
//! unwinds (the C code is compiled with `-fexceptions` for that, the `unwinding` feature of
//! `mozjpeg-sys`) to a `catch_unwind` around every call into the library, which turns the
//! error into a `VisionError`; `resume_unwind` carries the message without running the panic
//! hook, so nothing is printed. Warnings that mean the compressed data is corrupt or cut short
//! are refused too, where Pillow would fill the lost blocks and return an image.

use std::ffi::{c_int, c_ulong};
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};

use image::RgbImage;
use mozjpeg_sys as sys;

use crate::decode::{ImageFormatKind, ImageLimits, check_dimensions, jpeg_has_end_of_image};
use crate::error::VisionError;

/// libjpeg's `JMSG_LENGTH_MAX`: the longest message `format_message` writes, with its NUL.
const MESSAGE_LENGTH: usize = 200;

/// The error manager libjpeg calls, with room for what a decoding has to report: the
/// library's own manager first, so that a pointer to it is a pointer to this.
#[repr(C)]
struct ErrorManager {
    public: sys::jpeg_error_mgr,
    /// The first warning that means the compressed data is corrupt or cut short.
    corrupt: Option<String>,
}

/// A fatal libjpeg error, carried from `error_exit` to the `catch_unwind` around the call.
struct LibjpegError {
    /// Whether the memory budget was exceeded.
    out_of_memory: bool,
    message: String,
}

/// The text libjpeg formats for its current message (its code and parameters).
///
/// # Safety
/// `cinfo` must be a live libjpeg object whose error manager is set.
unsafe fn current_message(cinfo: &mut sys::jpeg_common_struct) -> String {
    // The binding declares the buffer as `&[u8; 80]`, but libjpeg writes up to
    // `JMSG_LENGTH_MAX` bytes into it; call it with a pointer to a buffer of that size.
    type FormatMessage = unsafe extern "C-unwind" fn(*mut sys::jpeg_common_struct, *mut u8);
    let mut buffer = [0u8; MESSAGE_LENGTH];
    // SAFETY: the caller guarantees `cinfo.err` points to a live error manager.
    let Some(format) = (unsafe { (*cinfo.err).format_message }) else {
        return String::from("libjpeg reported an error");
    };
    // SAFETY: both function types take two pointer-sized arguments with the same ABI, and the
    // buffer has the length libjpeg writes at most.
    unsafe {
        let format: FormatMessage = std::mem::transmute(format);
        format(cinfo, buffer.as_mut_ptr());
    }
    let length = buffer.iter().position(|&b| b == 0).unwrap_or(MESSAGE_LENGTH);
    String::from_utf8_lossy(&buffer[..length]).into_owned()
}

/// libjpeg's fatal-error handler: unwinds to the `catch_unwind` around the library call.
unsafe extern "C-unwind" fn error_exit(cinfo: &mut sys::jpeg_common_struct) {
    // SAFETY: libjpeg calls this with the object whose error manager it is.
    let message = unsafe { current_message(cinfo) };
    // SAFETY: as above.
    let out_of_memory = unsafe { current_is(cinfo, &MEMORY_ERRORS) };
    resume_unwind(Box::new(LibjpegError { out_of_memory, message }));
}

/// libjpeg's message handler: keeps the first warning that means lost data, prints nothing.
unsafe extern "C-unwind" fn emit_message(cinfo: &mut sys::jpeg_common_struct, level: c_int) {
    if level >= 0 {
        // Trace messages, which only a raised trace level produces.
        return;
    }
    // SAFETY: `err` points to the `ErrorManager` installed in `Decoder::new`, whose first field
    // is libjpeg's manager.
    let manager = unsafe { &mut *cinfo.err.cast::<ErrorManager>() };
    manager.public.num_warnings += 1;
    // SAFETY: as above.
    if manager.corrupt.is_none() && unsafe { current_is(cinfo, &LOST_DATA_WARNINGS) } {
        // SAFETY: as above.
        manager.corrupt = Some(unsafe { current_message(cinfo) });
    }
}

/// The message templates of the libjpeg warnings that mean some of the image's blocks could
/// not be decoded and were filled in: corrupt entropy-coded data, or data that ends before the
/// image does. The other warnings (stray bytes between markers, an unknown Adobe transform, a
/// JFIF version, unusual scan parameters) leave the decoded pixels whole, and Pillow ignores
/// them. Messages are named by their templates because their numbers depend on how the library
/// was configured (arithmetic decoding inserts two).
const LOST_DATA_WARNINGS: [&str; 5] = [
    "Corrupt JPEG data: bad Huffman code",
    "Corrupt JPEG data: bad arithmetic code",
    "Corrupt JPEG data: premature end of data segment",
    "Corrupt JPEG data: found marker 0x%02x instead of RST%d",
    "Premature end of JPEG file",
];

/// The templates of the fatal errors that mean the memory budget was exceeded.
const MEMORY_ERRORS: [&str; 2] = ["Insufficient memory (case %d)", "Backing store not supported"];

/// The template of libjpeg's current message, from its message table.
///
/// # Safety
/// `cinfo` must be a live libjpeg object whose error manager is set.
unsafe fn current_template(cinfo: &sys::jpeg_common_struct) -> Option<&'static [u8]> {
    // SAFETY: the caller guarantees `err` points to a live manager; its message table is
    // libjpeg's static array of `last_jpeg_message + 1` C strings.
    unsafe {
        let errors = &*cinfo.err;
        let code = errors.msg_code;
        if code <= 0 || code > errors.last_jpeg_message || errors.jpeg_message_table.is_null() {
            return None;
        }
        let template = *errors.jpeg_message_table.offset(code as isize);
        (!template.is_null()).then(|| std::ffi::CStr::from_ptr(template).to_bytes())
    }
}

/// Whether libjpeg's current message is one of `templates`.
///
/// # Safety
/// As for [`current_template`].
unsafe fn current_is(cinfo: &sys::jpeg_common_struct, templates: &[&str]) -> bool {
    // SAFETY: forwarded from the caller.
    unsafe { current_template(cinfo) }.is_some_and(|t| templates.iter().any(|w| w.as_bytes() == t))
}

/// The most scans a progressive file may have. Encoders write about ten; every scan is a pass
/// over the whole image, so a file of many nearly empty scans would cost far more time to decode
/// than its size suggests (libjpeg-turbo's documentation recommends such a limit). Pillow has
/// none, but no real file comes near this.
const MAX_SCANS: c_int = 1000;

/// libjpeg's `jpeg_progress_mgr` (the binding declares it opaque).
#[repr(C)]
struct ProgressManager {
    progress_monitor: Option<unsafe extern "C-unwind" fn(cinfo: &mut sys::jpeg_common_struct)>,
    pass_counter: std::ffi::c_long,
    pass_limit: std::ffi::c_long,
    completed_passes: c_int,
    total_passes: c_int,
}

/// libjpeg's progress callback, called as the input is read: refuses a file of too many scans.
unsafe extern "C-unwind" fn progress_monitor(cinfo: &mut sys::jpeg_common_struct) {
    // SAFETY: the monitor is only installed on the decompressor, whose common part is its first
    // field.
    let scans =
        unsafe { (*(cinfo as *mut sys::jpeg_common_struct).cast::<sys::jpeg_decompress_struct>()).input_scan_number };
    if scans > MAX_SCANS {
        resume_unwind(Box::new(LibjpegError {
            out_of_memory: false,
            message: format!("the progressive JPEG file has more than {MAX_SCANS} scans"),
        }));
    }
}

/// A libjpeg decompressor reading from a byte slice, destroyed on drop. The decompressor and
/// its error and progress managers are heap allocations owned through raw pointers, since
/// libjpeg keeps pointers to them.
struct Decoder<'a> {
    cinfo: *mut sys::jpeg_decompress_struct,
    errors: *mut ErrorManager,
    progress: *mut ProgressManager,
    _bytes: std::marker::PhantomData<&'a [u8]>,
}

impl<'a> Decoder<'a> {
    fn new(bytes: &'a [u8]) -> Result<Self, VisionError> {
        let length = c_ulong::try_from(bytes.len()).map_err(|_| VisionError::too_large("the JPEG file is too long"))?;
        // SAFETY: the error manager and the decompressor are plain C data for which all-zero is
        // the state libjpeg expects before `jpeg_std_error` and `jpeg_create_decompress` fill
        // them in.
        let errors = Box::into_raw(Box::new(ErrorManager { public: unsafe { std::mem::zeroed() }, corrupt: None }));
        let cinfo = Box::into_raw(Box::new(unsafe { std::mem::zeroed::<sys::jpeg_decompress_struct>() }));
        let progress = Box::into_raw(Box::new(ProgressManager {
            progress_monitor: Some(progress_monitor),
            pass_counter: 0,
            pass_limit: 0,
            completed_passes: 0,
            total_passes: 0,
        }));
        // SAFETY: the pointers are fresh allocations; `jpeg_std_error` only fills in the manager
        // it is given, and the decompressor keeps a pointer to it, which stays valid until drop.
        unsafe {
            sys::jpeg_std_error(&mut (*errors).public);
            (*errors).public.error_exit = Some(error_exit);
            (*errors).public.emit_message = Some(emit_message);
            (*cinfo).common.err = &raw mut (*errors).public;
        }
        // From here on `Drop` frees all three (destroying a zeroed decompressor is a no-op).
        let decoder = Decoder { cinfo, errors, progress, _bytes: std::marker::PhantomData };
        call(|| {
            // SAFETY: `cinfo` is zeroed with its error manager set, as `jpeg_create_decompress`
            // requires; the source is the slice, which outlives the decoder (`'a`).
            unsafe {
                sys::jpeg_create_decompress(cinfo);
                sys::jpeg_mem_src(&mut *cinfo, bytes.as_ptr(), length);
                (*cinfo).common.progress = progress.cast::<sys::jpeg_progress_mgr>();
            }
        })?;
        Ok(decoder)
    }

    /// The first warning that means data was lost, if any.
    fn lost_data(&self) -> Option<String> {
        // SAFETY: `errors` is live until drop and no libjpeg call is running.
        unsafe { (*self.errors).corrupt.clone() }
    }
}

impl Drop for Decoder<'_> {
    fn drop(&mut self) {
        // SAFETY: the pointers come from `Box::into_raw` in `new` and are freed only here;
        // destroying the decompressor frees its memory whatever state an error left it in (a
        // zeroed one, which creation never reached, has nothing to free).
        unsafe {
            sys::jpeg_destroy_decompress(&mut *self.cinfo);
            drop(Box::from_raw(self.cinfo));
            drop(Box::from_raw(self.errors));
            drop(Box::from_raw(self.progress));
        }
    }
}

/// Runs libjpeg calls, turning a fatal error (an unwind from `error_exit`) into a
/// `VisionError`. Any other panic is not libjpeg's and goes on unwinding.
fn call<T>(f: impl FnOnce() -> T) -> Result<T, VisionError> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| match payload.downcast::<LibjpegError>() {
        Ok(error) => libjpeg_error(*error),
        Err(other) => resume_unwind(other),
    })
}

fn libjpeg_error(error: LibjpegError) -> VisionError {
    if error.out_of_memory {
        VisionError::too_large(format!("decoding the JPEG image exceeds its memory limit: {}", error.message))
    } else {
        VisionError::decode(format!("the JPEG file could not be decoded: {}", error.message))
    }
}

/// Decodes a JPEG file as Pillow does and converts it as transformers' `convert_to_rgb` does:
/// grayscale is repeated into the three channels, and CMYK (which Pillow reads with Adobe's
/// inverted polarity) goes through Pillow's `CMYK` to `RGB` conversion. The declared
/// dimensions are checked against `limits` before any pixel is decoded.
pub(crate) fn decode_jpeg(bytes: &[u8], limits: &ImageLimits) -> Result<RgbImage, VisionError> {
    let decoder = Decoder::new(bytes)?;
    let cinfo = decoder.cinfo;

    // 1. The header, up to the first scan, without decoding the pixels.
    // SAFETY: `cinfo` is a created decompressor with a source (here and below).
    call(|| unsafe { sys::jpeg_read_header(&mut *cinfo, 1) })?;
    // SAFETY: the header fields are plain data, filled in by `jpeg_read_header`.
    let (width, height, components) = unsafe { ((*cinfo).image_width, (*cinfo).image_height, (*cinfo).num_components) };
    check_dimensions(ImageFormatKind::Jpeg, width, height, limits)?;
    // Pillow (without `LOAD_TRUNCATED_IMAGES`) refuses a file that ends inside its scans, where
    // libjpeg would fill the rest with gray after a warning: refuse it before decoding.
    if !jpeg_has_end_of_image(bytes) {
        return Err(VisionError::decode(
            "the JPEG file is truncated: expected an end-of-image marker after its first scan, found none",
        ));
    }
    // Pillow opens 1, 3 and 4 components as L, RGB and CMYK, and refuses any other count.
    let out_color_space = match components {
        1 => sys::JCS_GRAYSCALE,
        3 => sys::JCS_RGB,
        4 => sys::JCS_CMYK,
        n => return Err(VisionError::decode(format!("the JPEG file has {n} components; 1, 3 or 4 are supported"))),
    };

    // 2. Pillow's settings (libjpeg's defaults, written out) and a memory budget: the decoded
    // image's coefficients in 16-bit for four components (progressive files keep them all),
    // twice over, plus room for the decoder's tables.
    // SAFETY: these fields may be set between `jpeg_read_header` and `jpeg_start_decompress`;
    // `mem` was allocated by `jpeg_create_decompress`.
    unsafe {
        (*cinfo).out_color_space = out_color_space;
        (*cinfo).dct_method = sys::J_DCT_METHOD::JDCT_ISLOW;
        (*cinfo).do_fancy_upsampling = 1;
        (*cinfo).do_block_smoothing = 1;
        (*cinfo).quantize_colors = 0;
        (*cinfo).scale_num = 1;
        (*cinfo).scale_denom = 1;
        let budget = u64::from(width) * u64::from(height) * 16 + (64 << 20);
        (*(*cinfo).common.mem).max_memory_to_use = std::ffi::c_long::try_from(budget).unwrap_or(std::ffi::c_long::MAX);
    }

    // 3. The pixels, row by row into one buffer.
    call(|| unsafe { sys::jpeg_start_decompress(&mut *cinfo) })?;
    // SAFETY: the output fields are filled in by `jpeg_start_decompress`.
    let (out_width, out_height, out_components) =
        unsafe { ((*cinfo).output_width, (*cinfo).output_height, (*cinfo).output_components) };
    let channels = usize::try_from(out_components).unwrap_or(0);
    if (out_width, out_height) != (width, height) || channels != components as usize {
        return Err(VisionError::decode(format!(
            "the JPEG header declares {width}x{height} pixels of {components} components but the decoder gives \
             {out_width}x{out_height} of {out_components}"
        )));
    }
    let row_bytes = width as usize * channels;
    let mut pixels = vec![0u8; row_bytes * height as usize];
    call(|| {
        for row in pixels.chunks_exact_mut(row_bytes) {
            let mut rows = [row.as_mut_ptr()];
            // SAFETY: the row has room for `output_width * output_components` samples, which is
            // what libjpeg writes per scanline.
            let read = unsafe { sys::jpeg_read_scanlines(&mut *cinfo, rows.as_mut_ptr(), 1) };
            if read != 1 {
                // Only a suspending source reads no line, and the memory source never suspends.
                return false;
            }
        }
        // SAFETY: every scanline has been read.
        unsafe { sys::jpeg_finish_decompress(&mut *cinfo) };
        true
    })?
    .then_some(())
    .ok_or_else(|| VisionError::decode("the JPEG decoder stopped before the last row"))?;

    // 4. Refuse what Pillow would refuse as truncated, and data the decoder had to fill in.
    if let Some(warning) = decoder.lost_data() {
        return Err(VisionError::decode(format!("the JPEG file is corrupt or truncated: {warning}")));
    }
    drop(decoder);

    Ok(match channels {
        1 => crate::decode::from_gray(width, height, pixels.into_iter()),
        3 => RgbImage::from_raw(width, height, pixels).unwrap_or_else(|| RgbImage::new(width, height)),
        _ => crate::decode::from_rgb(width, height, pixels.chunks_exact(4).map(adobe_cmyk_to_rgb)),
    })
}

/// One pixel of a CMYK JPEG as Pillow's `convert("RGB")` leaves it: Pillow reads the samples
/// with Adobe's inverted polarity (`CMYK;I`), then its `cmyk2rgb` computes each channel as
/// `(255 - k) - c * (255 - k) / 255`, the division rounded as Pillow's `MULDIV255` rounds it.
fn adobe_cmyk_to_rgb(samples: &[u8]) -> [u8; 3] {
    let [c, m, y, k] = [samples[0], samples[1], samples[2], samples[3]].map(|s| 255 - i32::from(s));
    let not_k = 255 - k;
    let channel = |ink: i32| {
        let product = ink * not_k + 128;
        let scaled = ((product >> 8) + product) >> 8;
        (not_k - scaled).clamp(0, 255) as u8
    };
    [channel(c), channel(m), channel(y)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cmyk_without_ink_is_white_and_full_black_is_black() {
        // Stored inverted: 255 is no ink.
        assert_eq!(adobe_cmyk_to_rgb(&[255, 255, 255, 255]), [255, 255, 255]);
        assert_eq!(adobe_cmyk_to_rgb(&[255, 255, 255, 0]), [0, 0, 0]);
        assert_eq!(adobe_cmyk_to_rgb(&[0, 255, 255, 255]), [0, 255, 255]);
    }
}
