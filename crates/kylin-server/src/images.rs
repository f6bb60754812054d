//! A request's images, from what the API carries to the engine's image inputs: the bytes of a
//! `data:` URL, or a local file read only inside the directory `--allowed-local-media-path`
//! names (resolved, so neither `..` nor a symbolic link leaves it), then decoded and made into
//! patches by the model's [`ImagePreparer`](kylin_engine::vision::ImagePreparer) on a blocking
//! thread, never on the engine's. Nothing is fetched from the network.

use std::path::Path;

use kylin_engine::serving::ImageInput;
use kylin_engine::vision::ImageOptions;

use crate::AppState;
use crate::api::{ImagePart, ImageRef};
use crate::engine::Published;
use crate::error::ApiError;

/// Prepares a request's images in order, with its settings of the image processor; a 400
/// naming the image's field for anything wrong with one (`mm_processor_kwargs.…` for a setting
/// the model's processor does not read).
pub(crate) async fn prepare(
    state: &AppState,
    published: &Published,
    parts: Vec<ImagePart>,
    options: &ImageOptions,
) -> Result<Vec<ImageInput>, ApiError> {
    let Some(first) = parts.first() else { return Ok(Vec::new()) };
    let Some(preparer) = published.images.as_ref() else {
        return Err(ApiError::invalid(
            first.at.clone(),
            "this model takes no images: it has no vision tower Kylin runs, or its directory has no \
             preprocessor_config.json",
        )
        .code("unsupported_parameter"));
    };
    let options = options.or(&state.config().image_defaults);
    let preparer = preparer.with_options(&options).map_err(|e| ApiError::from_engine(&e, "mm_processor_kwargs"))?;
    let allowed = state.config().allowed_local_media_path.clone();
    let work = move || {
        parts
            .into_iter()
            .map(|part| {
                let bytes = match part.source {
                    ImageRef::Bytes(bytes) => bytes,
                    ImageRef::Path(path) => read_local(&path, allowed.as_deref(), preparer.max_bytes(), &part.at)?,
                };
                preparer.prepare_all(&bytes, &ImageOptions::default()).map_err(|e| ApiError::from_engine(&e, &part.at))
            })
            .collect::<Result<Vec<_>, ApiError>>()
            .map(|all| all.into_iter().flatten().collect())
    };
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ApiError::internal(format!("preparing the images failed: {e}")))?
}

/// A local image file, inside `allowed` and at most `max_bytes` long.
fn read_local(path: &Path, allowed: Option<&Path>, max_bytes: usize, at: &str) -> Result<Vec<u8>, ApiError> {
    let Some(allowed) = allowed else {
        return Err(ApiError::invalid(
            at,
            "local image paths are not accepted: send the image as a `data:` URL, or start the server with \
             --allowed-local-media-path DIR",
        )
        .code("unsupported_parameter"));
    };
    let refused = |why: String| ApiError::invalid(at, why).code("image_invalid");
    let real = std::fs::canonicalize(path).map_err(|e| refused(format!("cannot open {}: {e}", path.display())))?;
    if !real.starts_with(allowed) {
        return Err(refused(format!(
            "{} is outside the directory local images are read from ({})",
            path.display(),
            allowed.display()
        )));
    }
    let meta = std::fs::metadata(&real).map_err(|e| refused(format!("cannot open {}: {e}", path.display())))?;
    if !meta.is_file() {
        return Err(refused(format!("{} is not a file", path.display())));
    }
    if meta.len() > max_bytes as u64 {
        return Err(refused(format!(
            "IMAGE_TOO_LARGE: {} has {} bytes; the most an image may have is {max_bytes}",
            path.display(),
            meta.len()
        )));
    }
    std::fs::read(&real).map_err(|e| refused(format!("cannot read {}: {e}", path.display())))
}
