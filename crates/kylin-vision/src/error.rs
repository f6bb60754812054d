//! The error type of image input.
//!
//! Every refusal is a [`VisionError`] with a stable [`VisionErrorCode`], shown as
//! `[CODE] message`; the message names what was expected and what was found. The codes are a
//! public contract (the server will map them to HTTP errors), so they never change meaning.

use std::fmt;

/// Stable error codes of image input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VisionErrorCode {
    /// The bytes are not a PNG, JPEG or WebP file (another format, or no image at all).
    ImageFormat,
    /// The file or the image it describes is larger than the limits allow.
    ImageTooLarge,
    /// The file is damaged or truncated, or the decoder refused it.
    ImageDecode,
    /// The image's shape cannot be processed: an aspect ratio over 200, or sides that are not
    /// multiples of the patch grid when resizing is off.
    ImageShape,
    /// A `preprocessor_config.json` value is missing, of the wrong type or out of range.
    PreprocessorConfig,
}

impl VisionErrorCode {
    /// The stable spelling, e.g. `IMAGE_TOO_LARGE`.
    pub fn as_str(self) -> &'static str {
        match self {
            VisionErrorCode::ImageFormat => "IMAGE_FORMAT",
            VisionErrorCode::ImageTooLarge => "IMAGE_TOO_LARGE",
            VisionErrorCode::ImageDecode => "IMAGE_DECODE",
            VisionErrorCode::ImageShape => "IMAGE_SHAPE",
            VisionErrorCode::PreprocessorConfig => "PREPROCESSOR_CONFIG",
        }
    }
}

impl fmt::Display for VisionErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A refused image or preprocessor config, with a stable code and a complete message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("[{code}] {message}")]
pub struct VisionError {
    pub code: VisionErrorCode,
    pub message: String,
}

impl VisionError {
    pub fn new(code: VisionErrorCode, message: impl Into<String>) -> Self {
        VisionError { code, message: message.into() }
    }

    /// The stable code's spelling, e.g. `IMAGE_FORMAT`.
    pub fn code(&self) -> &'static str {
        self.code.as_str()
    }

    pub(crate) fn format(message: impl Into<String>) -> Self {
        Self::new(VisionErrorCode::ImageFormat, message)
    }

    pub(crate) fn too_large(message: impl Into<String>) -> Self {
        Self::new(VisionErrorCode::ImageTooLarge, message)
    }

    pub(crate) fn decode(message: impl Into<String>) -> Self {
        Self::new(VisionErrorCode::ImageDecode, message)
    }

    pub(crate) fn shape(message: impl Into<String>) -> Self {
        Self::new(VisionErrorCode::ImageShape, message)
    }

    pub(crate) fn config(message: impl Into<String>) -> Self {
        Self::new(VisionErrorCode::PreprocessorConfig, message)
    }
}
