//! The one error type of Kylin's library crates.
//!
//! Every failure that comes from outside data (a file, a flag, a request) is a [`KylinError`]
//! with a stable [`ErrorCode`]; it is shown as `[CODE] message`. Messages name the path, the
//! tensor or field, expected vs. got, and what to do. The codes are part of the public contract:
//! scripts match on them, so they never change meaning.

use std::fmt;
use std::path::{Path, PathBuf};

/// Stable error codes (see DESIGN.md). `CONTEXT_OVERFLOW`, `INPUT_INVALID` and `BACKEND_FAILED`
/// extend the design list for the engine and the CLI.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    ConfigMissing,
    ConfigInvalid,
    FileNotFound,
    FileCorrupted,
    TensorMissing,
    TensorShapeMismatch,
    TensorDtypeUnsupported,
    MappingMissing,
    MappingInvalid,
    OperatorUnsupported,
    VocabMismatch,
    ModelVersionIncompatible,
    /// A prompt (plus generation) does not fit in the planned context.
    ContextOverflow,
    /// A flag, a messages file or a request is malformed.
    InputInvalid,
    /// An image of a request cannot be used: its format, size or content (the message starts
    /// with the image decoder's own code, e.g. `IMAGE_TOO_LARGE`).
    ImageInvalid,
    /// An external backend (llama.cpp) refused or failed.
    BackendFailed,
    /// The operating system refused an I/O operation on a file that exists.
    Io,
}

impl ErrorCode {
    /// The stable spelling, e.g. `TENSOR_MISSING`.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::ConfigMissing => "CONFIG_MISSING",
            ErrorCode::ConfigInvalid => "CONFIG_INVALID",
            ErrorCode::FileNotFound => "FILE_NOT_FOUND",
            ErrorCode::FileCorrupted => "FILE_CORRUPTED",
            ErrorCode::TensorMissing => "TENSOR_MISSING",
            ErrorCode::TensorShapeMismatch => "TENSOR_SHAPE_MISMATCH",
            ErrorCode::TensorDtypeUnsupported => "TENSOR_DTYPE_UNSUPPORTED",
            ErrorCode::MappingMissing => "MAPPING_MISSING",
            ErrorCode::MappingInvalid => "MAPPING_INVALID",
            ErrorCode::OperatorUnsupported => "OPERATOR_UNSUPPORTED",
            ErrorCode::VocabMismatch => "VOCAB_MISMATCH",
            ErrorCode::ModelVersionIncompatible => "MODEL_VERSION_INCOMPATIBLE",
            ErrorCode::ContextOverflow => "CONTEXT_OVERFLOW",
            ErrorCode::InputInvalid => "INPUT_INVALID",
            ErrorCode::ImageInvalid => "IMAGE_INVALID",
            ErrorCode::BackendFailed => "BACKEND_FAILED",
            ErrorCode::Io => "IO_ERROR",
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A failure with a stable code and a complete, human-readable message.
///
/// The message is written once, where the failure is detected, because only that place knows
/// the path, the tensor and the expected value. `path` is kept separately for callers that want
/// to show or match it. `field` names the request parameter a request's error is about
/// (`max_tokens`, `n`, `temperature`, ...), in the OpenAI API's words, so that a server can
/// blame the right parameter without reading the message; `None` for errors about the prompt
/// itself and for errors that are not about a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("[{code}] {message}")]
pub struct KylinError {
    pub code: ErrorCode,
    pub message: String,
    pub path: Option<PathBuf>,
    pub field: Option<&'static str>,
}

impl KylinError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        KylinError { code, message: message.into(), path: None, field: None }
    }

    /// Names the request parameter the error is about; the message should already name it.
    pub fn for_field(mut self, field: &'static str) -> Self {
        self.field = Some(field);
        self
    }

    /// Attaches the file the error is about; the message should already name it.
    pub fn at(mut self, path: impl AsRef<Path>) -> Self {
        self.path = Some(path.as_ref().to_path_buf());
        self
    }

    pub fn code(&self) -> ErrorCode {
        self.code
    }

    /// An I/O failure on `path`, classified: a missing file is `FILE_NOT_FOUND`.
    pub fn io(path: &Path, what: &str, err: &std::io::Error) -> Self {
        let code = if err.kind() == std::io::ErrorKind::NotFound { ErrorCode::FileNotFound } else { ErrorCode::Io };
        KylinError::new(code, format!("{what} {}: {err}", path.display())).at(path)
    }
}

/// Whether a file the loader may read is there: `Ok(true)` for a regular file (symbolic links
/// followed), `Ok(false)` when nothing is at `path`, and an `IO` error naming the path when
/// something else is (a directory, a socket, a dangling link, a parent it may not search), so
/// a file that cannot be read is never mistaken for a missing one.
pub fn regular_file(path: &Path) -> Result<bool> {
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_file() => Ok(true),
        Ok(meta) => {
            let what = if meta.is_dir() { "a directory" } else { "not a regular file" };
            Err(KylinError::new(ErrorCode::Io, format!("{} is {what}; expected a file", path.display())).at(path))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if std::fs::symlink_metadata(path).is_ok() {
                return Err(KylinError::new(
                    ErrorCode::Io,
                    format!("{} is a symbolic link to nothing; expected a file", path.display()),
                )
                .at(path));
            }
            Ok(false)
        }
        Err(e) => Err(KylinError::io(path, "cannot read", &e)),
    }
}

/// Shorthand constructors, one per code, so call sites read as sentences.
macro_rules! constructors {
    ($($fn_name:ident => $code:ident),* $(,)?) => {
        impl KylinError {
            $(
                pub fn $fn_name(message: impl Into<String>) -> Self {
                    KylinError::new(ErrorCode::$code, message)
                }
            )*
        }
    };
}

constructors! {
    config_missing => ConfigMissing,
    config_invalid => ConfigInvalid,
    file_not_found => FileNotFound,
    file_corrupted => FileCorrupted,
    tensor_missing => TensorMissing,
    tensor_shape_mismatch => TensorShapeMismatch,
    tensor_dtype_unsupported => TensorDtypeUnsupported,
    mapping_missing => MappingMissing,
    mapping_invalid => MappingInvalid,
    operator_unsupported => OperatorUnsupported,
    vocab_mismatch => VocabMismatch,
    model_version_incompatible => ModelVersionIncompatible,
    context_overflow => ContextOverflow,
    input_invalid => InputInvalid,
    image_invalid => ImageInvalid,
    backend_failed => BackendFailed,
}

pub type Result<T, E = KylinError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_is_code_then_message() {
        let e = KylinError::tensor_missing("tensor 'lm_head.weight' not found");
        assert_eq!(e.to_string(), "[TENSOR_MISSING] tensor 'lm_head.weight' not found");
    }

    #[test]
    fn missing_file_is_file_not_found() {
        let err = std::io::Error::from(std::io::ErrorKind::NotFound);
        let e = KylinError::io(Path::new("/nope/config.json"), "cannot open", &err);
        assert_eq!(e.code(), ErrorCode::FileNotFound);
        assert!(e.message.contains("/nope/config.json"));
    }
}
