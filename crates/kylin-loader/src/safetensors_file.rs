//! Safetensors files, memory-mapped once each and validated before anything trusts them.
//!
//! A file is mapped read-only and shared; only its header is read. Before a single tensor view is
//! made, the 8-byte header length is checked against the file size (so a header claiming 10 GB in
//! a 1 KB file is `FILE_CORRUPTED`, never an allocation), the JSON is parsed, and every tensor's
//! range is checked: inside the data section, no overlap with another tensor, and a byte length
//! equal to `dtype size × product(shape)`. The `safetensors` crate then parses the same header as a
//! second, independent opinion (it also refuses gaps and trailing bytes). Sharded checkpoints
//! (`model.safetensors.index.json`) are opened shard by shard, each once, and the index is
//! checked against the shards' own headers.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;
use serde_json::Value;

use crate::error::{KylinError, Result};
use crate::tensor::{DType, Storage, WeightTensor};

/// The safetensors crate refuses headers above 100 MB; so do we, before parsing.
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// One weight file as `inspect` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WeightFile {
    pub path: PathBuf,
    pub bytes: u64,
}

/// A tensor as the header describes it, with its range already checked against the file.
#[derive(Debug, Clone)]
pub(crate) struct RawTensor {
    pub name: String,
    /// The dtype as spelled in the header (`BF16`, `I64`, ...).
    pub dtype_name: String,
    /// `None` for dtypes Kylin does not recognise (I64, F64, ...).
    pub dtype: Option<DType>,
    pub shape: Vec<usize>,
    /// Absolute byte offset in the file.
    pub offset: usize,
    pub len: usize,
}

/// One mapped, validated safetensors file.
#[derive(Debug)]
pub(crate) struct MappedFile {
    pub path: PathBuf,
    pub storage: Arc<Storage>,
    /// Tensors in header order of their offsets.
    pub tensors: Vec<RawTensor>,
}

/// Maps a safetensors dtype name to Kylin's type and the element width in bits.
fn dtype_info(name: &str) -> Option<(Option<DType>, usize)> {
    let info = match name {
        "F32" => (Some(DType::F32), 32),
        "F16" => (Some(DType::F16), 16),
        "BF16" => (Some(DType::BF16), 16),
        "I8" => (Some(DType::I8), 8),
        "U8" => (Some(DType::U8), 8),
        "F8_E4M3" => (Some(DType::F8E4M3), 8),
        "BOOL" | "F8_E5M2" | "F8_E8M0" | "F8_E4M3FNUZ" | "F8_E5M2FNUZ" => (None, 8),
        "I16" | "U16" => (None, 16),
        "I32" => (Some(DType::I32), 32),
        "I64" => (Some(DType::I64), 64),
        "U32" => (None, 32),
        "U64" | "F64" | "C64" => (None, 64),
        "F4" => (None, 4),
        "F6_E2M3" | "F6_E3M2" => (None, 6),
        _ => return None,
    };
    Some(info)
}

/// One header entry as written.
#[derive(serde::Deserialize)]
struct HeaderEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

pub(crate) fn corrupted(path: &Path, what: impl std::fmt::Display) -> KylinError {
    KylinError::file_corrupted(format!(
        "{}: {what}; the file is damaged or incompletely downloaded, fetch it again",
        path.display()
    ))
    .at(path)
}

/// Validates a safetensors buffer and lists its tensors (offsets relative to the buffer).
///
/// This is the whole parser, independent of how the bytes are held, so that property tests can
/// feed it arbitrary bytes. Nothing is allocated in proportion to a number read from the buffer:
/// the header is at most `bytes.len()` long and the tensor list is as long as the header's JSON.
pub(crate) fn parse_header(path: &Path, bytes: &[u8]) -> Result<Vec<RawTensor>> {
    let file_len = bytes.len() as u64;
    let Some(prefix) = bytes.get(..8) else {
        return Err(corrupted(path, format!("the file has {file_len} bytes, fewer than the 8-byte header length")));
    };
    let mut len_bytes = [0u8; 8];
    len_bytes.copy_from_slice(prefix);
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > file_len - 8 {
        return Err(corrupted(
            path,
            format!(
                "the header claims {header_len} bytes but the file has only {} bytes after the length",
                file_len - 8
            ),
        ));
    }
    if header_len > MAX_HEADER_BYTES {
        return Err(corrupted(path, format!("the header claims {header_len} bytes, above the 100 MB limit")));
    }
    // Both conversions are exact: header_len <= file_len, which is a slice length.
    let data_start = 8 + header_len as usize;
    let data_len = bytes.len() - data_start;
    let header = &bytes[8..data_start];
    let text = std::str::from_utf8(header).map_err(|e| corrupted(path, format!("the header is not UTF-8 ({e})")))?;
    let map: BTreeMap<String, Value> = serde_json::from_str(text)
        .map_err(|e| corrupted(path, format!("the header is not a valid JSON object ({e})")))?;

    let mut tensors = Vec::with_capacity(map.len());
    for (name, value) in map {
        if name == "__metadata__" {
            continue;
        }
        let entry: HeaderEntry = serde_json::from_value(value)
            .map_err(|e| corrupted(path, format!("tensor '{name}' has a malformed header entry ({e})")))?;
        let (dtype, bits) = dtype_info(&entry.dtype)
            .ok_or_else(|| corrupted(path, format!("tensor '{name}' has unknown dtype '{}'", entry.dtype)))?;
        let mut shape = Vec::with_capacity(entry.shape.len());
        let mut elements: u64 = 1;
        for &d in &entry.shape {
            elements = elements.checked_mul(d).filter(|&e| e <= file_len.saturating_mul(8)).ok_or_else(|| {
                corrupted(path, format!("tensor '{name}' has shape {:?}, larger than the file", entry.shape))
            })?;
            shape.push(
                usize::try_from(d).map_err(|_| corrupted(path, format!("tensor '{name}' has a huge dimension")))?,
            );
        }
        // elements <= 8 * file_len, so the bit count cannot overflow u64.
        let nbits = elements * bits as u64;
        if !nbits.is_multiple_of(8) {
            return Err(corrupted(path, format!("tensor '{name}' does not fill a whole number of bytes")));
        }
        let expected = nbits / 8;
        let [start, end] = entry.data_offsets;
        if start > end || end > data_len as u64 {
            return Err(corrupted(
                path,
                format!("tensor '{name}' has data_offsets [{start}, {end}] outside the {data_len} data bytes"),
            ));
        }
        if end - start != expected {
            return Err(corrupted(
                path,
                format!(
                    "tensor '{name}' ({} {:?}) needs {expected} bytes but data_offsets [{start}, {end}] give {}",
                    entry.dtype,
                    entry.shape,
                    end - start
                ),
            ));
        }
        tensors.push(RawTensor {
            name,
            dtype_name: entry.dtype,
            dtype,
            shape,
            offset: data_start + start as usize,
            len: (end - start) as usize,
        });
    }
    tensors.sort_by_key(|t| (t.offset, t.len));
    for pair in tensors.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        if b.offset < a.offset + a.len {
            return Err(corrupted(
                path,
                format!(
                    "tensors '{}' (bytes {}..{}) and '{}' (bytes {}..{}) overlap",
                    a.name,
                    a.offset - data_start,
                    a.offset - data_start + a.len,
                    b.name,
                    b.offset - data_start,
                    b.offset - data_start + b.len
                ),
            ));
        }
    }
    // The reference parser's opinion: it also refuses gaps between tensors and trailing bytes.
    safetensors::SafeTensors::read_metadata(bytes)
        .map_err(|e| corrupted(path, format!("the safetensors parser refuses the header: {e}")))?;
    Ok(tensors)
}

/// Validates a whole safetensors file held in memory with the checks [`crate::load`] makes, and
/// returns its tensor count. `path` is only used in messages. For tools and fuzzing.
pub fn validate_bytes(path: &Path, bytes: &[u8]) -> Result<usize> {
    parse_header(path, bytes).map(|tensors| tensors.len())
}

/// Maps `path` read-only and validates its header.
pub(crate) fn open(path: &Path) -> Result<MappedFile> {
    let map = map_read_only(path, 8, "the 8-byte header length")?;
    let tensors = parse_header(path, &map)?;
    Ok(MappedFile { path: path.to_path_buf(), storage: Arc::new(Storage::Mmap(map)), tensors })
}

/// Maps a weight file read-only (safetensors or llama2.c `.bin`), after checking that it holds
/// at least `min_len` bytes (`FILE_CORRUPTED` naming `what` otherwise), and asks the OS to read
/// its first megabyte, where the header is.
pub(crate) fn map_read_only(path: &Path, min_len: u64, what: &str) -> Result<memmap2::Mmap> {
    let file = File::open(path).map_err(|e| KylinError::io(path, "cannot open weight file", &e))?;
    let size = file.metadata().map_err(|e| KylinError::io(path, "cannot stat weight file", &e))?.len();
    if size < min_len {
        return Err(corrupted(path, format!("the file has {size} bytes, fewer than {what} ({min_len} bytes)")));
    }
    // SAFETY: the map is read-only and private to this process's view of a file Kylin never
    // writes. The usual mmap caveat applies: if another process truncates the file while it is
    // mapped, reading the lost pages raises SIGBUS. Sizes are checked here, at open; after that,
    // `kylin`'s SIGBUS handler (kylin-cli `sigbus.rs`) reports the fault as FILE_CORRUPTED with
    // the model's path and exits with status 135 (tested in kylin-cli `tests/load_faults.rs`).
    let map = unsafe { memmap2::MmapOptions::new().map(&file) }
        .map_err(|e| KylinError::io(path, "cannot memory-map weight file", &e))?;
    // A hint only (failures are harmless): the header is read now. The tensors the model binds
    // are prefetched by `load` (`WeightTensor::advise_will_need`); the map keeps the default
    // access advice, whose readahead also serves a cold page cache well. `MADV_RANDOM` would
    // turn that readahead off and make a cold start fault in 4 KiB at a time (23 s instead of
    // 2 s for Qwen2.5-0.5B from disk). `MADV_HUGEPAGE` was measured and dropped: beside the
    // `MADV_WILLNEED` readahead, whose 4 KiB folios a map can only map 4 KiB at a time, it left
    // decode unchanged; without that readahead (ext4 on Linux 6.18 then faults 2 MiB folios in)
    // BF16 decode on AVX-512 went up 2-12%, but a cold `kylin run` took 2.6 s instead of 1.5
    // (BENCHMARKS.md, "issue 36 on an Intel Xeon with AMX", which also measures a background
    // `MADV_POPULATE_READ` that keeps the cold start).
    #[cfg(unix)]
    {
        let _ = map.advise_range(memmap2::Advice::WillNeed, 0, map.len().min(1 << 20));
    }
    Ok(map)
}

/// Where a tensor lives: file index and tensor index within that file.
#[derive(Debug, Clone, Copy)]
struct Slot {
    file: usize,
    tensor: usize,
}

/// Every tensor of a checkpoint (one file or all shards), by name.
#[derive(Debug)]
pub(crate) struct TensorIndex {
    files: Vec<MappedFile>,
    by_name: BTreeMap<String, Slot>,
}

impl TensorIndex {
    fn from_files(files: Vec<MappedFile>) -> Result<TensorIndex> {
        let mut by_name: BTreeMap<String, Slot> = BTreeMap::new();
        for (fi, f) in files.iter().enumerate() {
            for (ti, t) in f.tensors.iter().enumerate() {
                if let Some(prev) = by_name.insert(t.name.clone(), Slot { file: fi, tensor: ti }) {
                    return Err(KylinError::file_corrupted(format!(
                        "tensor '{}' is stored twice: in {} and in {}; remove the stale shard",
                        t.name,
                        files[prev.file].path.display(),
                        f.path.display()
                    ))
                    .at(&f.path));
                }
            }
        }
        Ok(TensorIndex { files, by_name })
    }

    pub fn raw(&self, name: &str) -> Option<&RawTensor> {
        let s = self.by_name.get(name)?;
        Some(&self.files[s.file].tensors[s.tensor])
    }

    pub fn path_of(&self, name: &str) -> Option<&Path> {
        let s = self.by_name.get(name)?;
        Some(&self.files[s.file].path)
    }

    /// A view of a tensor whose dtype Kylin recognises; `None` if absent or unrecognised.
    pub fn view(&self, name: &str) -> Option<WeightTensor> {
        let s = self.by_name.get(name)?;
        let f = &self.files[s.file];
        let t = &f.tensors[s.tensor];
        WeightTensor::new(t.name.clone(), t.dtype?, t.shape.clone(), Arc::clone(&f.storage), t.offset, t.len)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.by_name.keys().map(String::as_str)
    }

    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    pub fn files(&self) -> Vec<WeightFile> {
        self.files.iter().map(|f| WeightFile { path: f.path.clone(), bytes: f.storage.bytes().len() as u64 }).collect()
    }

    pub fn tensor_bytes(&self) -> u64 {
        self.files.iter().flat_map(|f| &f.tensors).map(|t| t.len as u64).sum()
    }

    /// Tensor count per stored dtype name.
    pub fn dtype_counts(&self) -> BTreeMap<String, usize> {
        let mut out = BTreeMap::new();
        for t in self.files.iter().flat_map(|f| &f.tensors) {
            *out.entry(t.dtype_name.clone()).or_insert(0) += 1;
        }
        out
    }
}

/// Opens a single safetensors file.
pub(crate) fn open_single(path: &Path) -> Result<TensorIndex> {
    TensorIndex::from_files(vec![open(path)?])
}

/// Parses the text of a `model.safetensors.index.json` into its `weight_map`: tensor name to
/// shard file name. Every shard name must be a plain file name (no directory, no `..`), so an
/// index cannot point outside its directory. Errors are `FILE_CORRUPTED`; `index_path` is only
/// used in messages. This is the part of [`open_sharded`] that reads untrusted text, kept
/// separate so that it can be fuzzed without files.
pub fn parse_shard_index(text: &str, index_path: &Path) -> Result<BTreeMap<String, String>> {
    let invalid = |what: String| KylinError::file_corrupted(format!("{}: {what}", index_path.display())).at(index_path);
    let value: Value = serde_json::from_str(text).map_err(|e| invalid(format!("not valid JSON ({e})")))?;
    let Some(Value::Object(weight_map)) = value.get("weight_map") else {
        return Err(invalid("no 'weight_map' object".into()));
    };
    let mut wanted: BTreeMap<String, String> = BTreeMap::new();
    for (tensor, shard) in weight_map {
        let shard = shard.as_str().ok_or_else(|| invalid(format!("weight_map['{tensor}'] is not a file name")))?;
        // A shard name is a plain file name beside the index: no directories, no escaping.
        if shard.is_empty() || shard.contains('/') || shard.contains('\\') || shard == "." || shard == ".." {
            return Err(invalid(format!("weight_map['{tensor}'] = '{shard}' is not a plain file name")));
        }
        wanted.insert(tensor.clone(), shard.to_string());
    }
    Ok(wanted)
}

/// Opens a sharded checkpoint from its `model.safetensors.index.json`; warnings are appended.
pub(crate) fn open_sharded(index_path: &Path, warnings: &mut Vec<String>) -> Result<TensorIndex> {
    let dir = index_path.parent().unwrap_or(Path::new("."));
    let text = std::fs::read_to_string(index_path).map_err(|e| KylinError::io(index_path, "cannot read", &e))?;
    let wanted = parse_shard_index(&text, index_path)?;
    let shard_names: BTreeSet<&str> = wanted.values().map(String::as_str).collect();
    let mut files = Vec::with_capacity(shard_names.len());
    for shard in &shard_names {
        let p = dir.join(shard);
        if !crate::error::regular_file(&p)? {
            let referencing = wanted.iter().filter(|(_, s)| s.as_str() == *shard).count();
            return Err(KylinError::file_not_found(format!(
                "shard '{shard}' named in {} (for {referencing} tensors) does not exist in {}; \
                 download the missing shard",
                index_path.display(),
                dir.display()
            ))
            .at(&p));
        }
        files.push(open(&p)?);
    }
    let index = TensorIndex::from_files(files)?;
    for (tensor, shard) in &wanted {
        match index.path_of(tensor) {
            Some(p) if p.file_name().and_then(|n| n.to_str()) == Some(shard.as_str()) => {}
            Some(p) => {
                return Err(KylinError::file_corrupted(format!(
                    "{} puts tensor '{tensor}' in '{shard}' but it is stored in {}",
                    index_path.display(),
                    p.display()
                ))
                .at(index_path));
            }
            None => {
                return Err(KylinError::file_corrupted(format!(
                    "{} puts tensor '{tensor}' in '{shard}' but that shard does not contain it",
                    index_path.display()
                ))
                .at(dir.join(shard)));
            }
        }
    }
    let unlisted: Vec<&str> = index.names().filter(|n| !wanted.contains_key(*n)).collect();
    if !unlisted.is_empty() {
        warnings.push(format!(
            "{} tensors are stored in shards but not listed in the index (kept): {}",
            unlisted.len(),
            unlisted.join(", ")
        ));
    }
    if let Ok(entries) = std::fs::read_dir(dir) {
        let mut stray: Vec<String> = entries
            .filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .filter(|n| n.ends_with(".safetensors") && !shard_names.contains(n.as_str()))
            .collect();
        stray.sort();
        if !stray.is_empty() {
            warnings.push(format!("ignored safetensors files not named in the index: {}", stray.join(", ")));
        }
    }
    Ok(index)
}
