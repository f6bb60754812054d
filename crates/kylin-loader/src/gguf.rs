//! GGUF files, read with a bounded parser: enough to recognise, validate and describe them.
//!
//! Kylin does not run GGUF itself (the llama.cpp backend does), but it reads the header first so
//! that a truncated or foreign file is a `FILE_CORRUPTED` error naming the path, never a crash
//! inside C++, and so that `inspect` can describe the file without loading it.
//!
//! Guarantees: the file is mapped read-only and only its header is read. Every length and count
//! read from the file is checked against the bytes that remain before anything is allocated for
//! it, so no allocation is larger than the file; arrays nest at most [`MAX_DEPTH`] deep; every
//! tensor's data range (for the ggml types whose block size is known) must lie inside the file.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::error::{KylinError, Result};

/// Deepest nesting of arrays accepted in metadata (real files use 1).
const MAX_DEPTH: usize = 4;
/// Array elements whose values are kept (longer arrays are summarised by their length).
const KEPT_ARRAY_ITEMS: usize = 16;

/// A metadata value, with long arrays summarised.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum GgufValue {
    Uint(u64),
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    /// An array: its length, and its first items where it is short.
    Array {
        len: u64,
        items: Vec<GgufValue>,
    },
}

impl GgufValue {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::Uint(v) => Some(v),
            GgufValue::Int(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::Float(v) => Some(v),
            GgufValue::Uint(v) => Some(v as f64),
            GgufValue::Int(v) => Some(v as f64),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::Str(s) => Some(s),
            _ => None,
        }
    }

    /// A short human-readable rendering (long strings cut, arrays by length).
    pub fn short(&self) -> String {
        match self {
            GgufValue::Uint(v) => v.to_string(),
            GgufValue::Int(v) => v.to_string(),
            GgufValue::Float(v) => v.to_string(),
            GgufValue::Bool(v) => v.to_string(),
            GgufValue::Str(s) if s.chars().count() > 60 => {
                format!("{:?}... ({} bytes)", s.chars().take(60).collect::<String>(), s.len())
            }
            GgufValue::Str(s) => format!("{s:?}"),
            GgufValue::Array { len, .. } => format!("[{len} items]"),
        }
    }
}

/// What a GGUF file says about itself.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GgufInfo {
    pub path: PathBuf,
    pub file_bytes: u64,
    pub version: u32,
    pub tensor_count: u64,
    /// `general.architecture`, e.g. `qwen2`, `llama`, `qwen3`.
    pub architecture: Option<String>,
    /// `general.name`.
    pub name: Option<String>,
    /// `general.file_type` as llama.cpp names it (`MOSTLY_Q4_K_M`, ...).
    pub file_type: Option<String>,
    /// ggml type name -> tensor count (the quantization types actually stored).
    pub tensor_types: BTreeMap<String, usize>,
    /// Bytes of tensor data (for tensors of known types).
    pub tensor_bytes: u64,
    /// Of which: the stacked expert tensors (`*_exps`), the token embedding, and Gemma 4's
    /// per-layer input embedding (`per_layer_token_embd`, one row per token like the first).
    pub expert_bytes: u64,
    pub embedding_bytes: u64,
    pub per_layer_embedding_bytes: u64,
    pub alignment: u64,
    /// Absolute offset of the tensor data section.
    pub data_offset: u64,
    /// `tokenizer.ggml.model` (`gpt2`, `llama`, ...).
    pub tokenizer_model: Option<String>,
    /// Length of `tokenizer.ggml.tokens`.
    pub vocab_size: Option<u64>,
    pub bos_token_id: Option<u64>,
    pub eos_token_id: Option<u64>,
    pub add_bos_token: Option<bool>,
    /// `tokenizer.chat_template`, when present.
    #[serde(skip)]
    pub chat_template: Option<String>,
    /// Whether a token embedding matrix doubles as the output head (no `output.weight`).
    pub tied_output: bool,
    /// Every metadata key with a short rendering of its value (long arrays summarised).
    pub metadata: BTreeMap<String, GgufValue>,
}

impl GgufInfo {
    /// Bytes of weights one decoded token reads: every tensor once but the token embeddings
    /// (one row each, unless the first doubles as the head) and the experts
    /// (`expert_used_count` of `expert_count`), as Kylin counts its own.
    pub fn bytes_per_token(&self) -> u64 {
        let vocab = self.vocab_size.filter(|&v| v > 0).unwrap_or(1);
        let embedding = if self.tied_output { self.embedding_bytes } else { self.embedding_bytes / vocab };
        let per_layer = self.per_layer_embedding_bytes / vocab;
        let experts = match (self.arch_u64("expert_used_count"), self.arch_u64("expert_count")) {
            (Some(k), Some(e)) if e > 0 && k <= e => self.expert_bytes / e * k,
            _ => self.expert_bytes,
        };
        self.tensor_bytes - self.expert_bytes - self.embedding_bytes - self.per_layer_embedding_bytes
            + experts
            + embedding
            + per_layer
    }

    /// `{architecture}.{key}` as an integer.
    pub fn arch_u64(&self, key: &str) -> Option<u64> {
        let arch = self.architecture.as_deref()?;
        self.metadata.get(&format!("{arch}.{key}"))?.as_u64()
    }

    /// `{architecture}.{key}` as a float.
    pub fn arch_f64(&self, key: &str) -> Option<f64> {
        let arch = self.architecture.as_deref()?;
        self.metadata.get(&format!("{arch}.{key}"))?.as_f64()
    }
}

/// Block size (elements) and bytes per block of a ggml type, with its name.
fn ggml_type(id: u32) -> Option<(&'static str, u64, u64)> {
    let t = match id {
        0 => ("F32", 1, 4),
        1 => ("F16", 1, 2),
        2 => ("Q4_0", 32, 18),
        3 => ("Q4_1", 32, 20),
        6 => ("Q5_0", 32, 22),
        7 => ("Q5_1", 32, 24),
        8 => ("Q8_0", 32, 34),
        9 => ("Q8_1", 32, 36),
        10 => ("Q2_K", 256, 84),
        11 => ("Q3_K", 256, 110),
        12 => ("Q4_K", 256, 144),
        13 => ("Q5_K", 256, 176),
        14 => ("Q6_K", 256, 210),
        15 => ("Q8_K", 256, 292),
        16 => ("IQ2_XXS", 256, 66),
        17 => ("IQ2_XS", 256, 74),
        18 => ("IQ3_XXS", 256, 98),
        19 => ("IQ1_S", 256, 50),
        20 => ("IQ4_NL", 32, 18),
        21 => ("IQ3_S", 256, 110),
        22 => ("IQ2_S", 256, 82),
        23 => ("IQ4_XS", 256, 136),
        24 => ("I8", 1, 1),
        25 => ("I16", 1, 2),
        26 => ("I32", 1, 4),
        27 => ("I64", 1, 8),
        28 => ("F64", 1, 8),
        29 => ("IQ1_M", 256, 56),
        30 => ("BF16", 1, 2),
        34 => ("TQ1_0", 256, 54),
        35 => ("TQ2_0", 256, 66),
        39 => ("MXFP4", 32, 17),
        _ => return None,
    };
    Some(t)
}

/// llama.cpp's `llama_ftype` names for `general.file_type`.
fn file_type_name(v: u64) -> String {
    let name = match v {
        0 => "ALL_F32",
        1 => "MOSTLY_F16",
        2 => "MOSTLY_Q4_0",
        3 => "MOSTLY_Q4_1",
        7 => "MOSTLY_Q8_0",
        8 => "MOSTLY_Q5_0",
        9 => "MOSTLY_Q5_1",
        10 => "MOSTLY_Q2_K",
        11 => "MOSTLY_Q3_K_S",
        12 => "MOSTLY_Q3_K_M",
        13 => "MOSTLY_Q3_K_L",
        14 => "MOSTLY_Q4_K_S",
        15 => "MOSTLY_Q4_K_M",
        16 => "MOSTLY_Q5_K_S",
        17 => "MOSTLY_Q5_K_M",
        18 => "MOSTLY_Q6_K",
        32 => "MOSTLY_BF16",
        _ => return format!("type {v}"),
    };
    name.to_string()
}

/// A cursor over the header bytes that refuses to read past the end.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn corrupted(&self, what: impl std::fmt::Display) -> KylinError {
        KylinError::file_corrupted(format!(
            "{}: {what} (at byte {} of {}); the GGUF file is damaged or incompletely downloaded",
            self.path.display(),
            self.pos,
            self.bytes.len()
        ))
        .at(self.path)
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        let remaining = (self.bytes.len() - self.pos) as u64;
        if n > remaining {
            return Err(self.corrupted(format!("{what} needs {n} bytes but only {remaining} remain")));
        }
        let start = self.pos;
        // `n <= remaining`, so it fits in usize.
        self.pos += n as usize;
        Ok(&self.bytes[start..self.pos])
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N as u64, what)?);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    /// One value of type `ty`; arrays keep at most [`KEPT_ARRAY_ITEMS`] items.
    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<GgufValue> {
        Ok(match ty {
            0 => GgufValue::Uint(u8::from_le_bytes(self.array(key)?) as u64),
            1 => GgufValue::Int(i8::from_le_bytes(self.array(key)?) as i64),
            2 => GgufValue::Uint(u16::from_le_bytes(self.array(key)?) as u64),
            3 => GgufValue::Int(i16::from_le_bytes(self.array(key)?) as i64),
            4 => GgufValue::Uint(u32::from_le_bytes(self.array(key)?) as u64),
            5 => GgufValue::Int(i32::from_le_bytes(self.array(key)?) as i64),
            6 => GgufValue::Float(f32::from_le_bytes(self.array(key)?) as f64),
            7 => GgufValue::Bool(self.array::<1>(key)?[0] != 0),
            8 => GgufValue::Str(self.string(key)?),
            9 => {
                if depth >= MAX_DEPTH {
                    return Err(self.corrupted(format!("metadata '{key}' nests arrays deeper than {MAX_DEPTH}")));
                }
                let item_ty = self.u32(key)?;
                let len = self.u64(key)?;
                // Every item takes at least one byte, so a count beyond the remaining bytes is a lie.
                if len > (self.bytes.len() - self.pos) as u64 {
                    return Err(self.corrupted(format!("metadata array '{key}' claims {len} items")));
                }
                let mut items = Vec::new();
                for i in 0..len {
                    let v = self.value(item_ty, key, depth + 1)?;
                    if i < KEPT_ARRAY_ITEMS as u64 {
                        items.push(v);
                    }
                }
                GgufValue::Array { len, items }
            }
            10 => GgufValue::Uint(self.u64(key)?),
            11 => GgufValue::Int(i64::from_le_bytes(self.array(key)?)),
            12 => GgufValue::Float(f64::from_le_bytes(self.array(key)?)),
            other => return Err(self.corrupted(format!("metadata '{key}' has unknown value type {other}"))),
        })
    }
}

/// Parses a GGUF header held in `bytes` (the whole file, or a map of it).
pub fn parse_gguf(path: &Path, bytes: &[u8]) -> Result<GgufInfo> {
    let mut r = Reader { bytes, pos: 0, path };
    let magic = r.array::<4>("the magic bytes")?;
    if &magic != b"GGUF" {
        return Err(r.corrupted("the file does not start with the GGUF magic bytes"));
    }
    let version = r.u32("the version")?;
    if !(2..=3).contains(&version) {
        return Err(KylinError::model_version_incompatible(format!(
            "{} is GGUF version {version}; versions 2 and 3 are supported",
            path.display()
        ))
        .at(path));
    }
    let tensor_count = r.u64("the tensor count")?;
    let kv_count = r.u64("the metadata count")?;
    // Each entry takes well over one byte: counts beyond the file size are corrupt headers.
    if tensor_count > bytes.len() as u64 || kv_count > bytes.len() as u64 {
        return Err(r.corrupted(format!("the header claims {tensor_count} tensors and {kv_count} metadata entries")));
    }

    let mut metadata = BTreeMap::new();
    for _ in 0..kv_count {
        let key = r.string("a metadata key")?;
        let ty = r.u32(&key)?;
        let value = r.value(ty, &key, 0)?;
        metadata.insert(key, value);
    }
    let alignment = match metadata.get("general.alignment") {
        None => 32,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a,
            _ => return Err(r.corrupted(format!("general.alignment is {}, not a power of two", v.short()))),
        },
    };

    struct TensorEntry {
        name: String,
        type_id: u32,
        elements: u64,
        offset: u64,
    }
    let mut tensors = Vec::new();
    for _ in 0..tensor_count {
        let name = r.string("a tensor name")?;
        let n_dims = r.u32(&name)?;
        if n_dims > 8 {
            return Err(r.corrupted(format!("tensor '{name}' has {n_dims} dimensions")));
        }
        let mut elements: u64 = 1;
        for _ in 0..n_dims {
            let d = r.u64(&name)?;
            elements = elements
                .checked_mul(d)
                .ok_or_else(|| r.corrupted(format!("tensor '{name}' has an overflowing shape")))?;
        }
        let type_id = r.u32(&name)?;
        let offset = r.u64(&name)?;
        tensors.push(TensorEntry { name, type_id, elements, offset });
    }
    let data_offset = (r.pos as u64).div_ceil(alignment) * alignment;
    let file_bytes = bytes.len() as u64;
    if data_offset > file_bytes {
        return Err(r.corrupted("the tensor data section starts past the end of the file"));
    }
    let data_len = file_bytes - data_offset;

    let mut tensor_types: BTreeMap<String, usize> = BTreeMap::new();
    let mut tensor_bytes = 0u64;
    let (mut expert_bytes, mut embedding_bytes, mut per_layer_embedding_bytes) = (0u64, 0u64, 0u64);
    let mut has_output = false;
    for t in &tensors {
        if t.name == "output.weight" {
            has_output = true;
        }
        let Some((type_name, block, block_bytes)) = ggml_type(t.type_id) else {
            *tensor_types.entry(format!("type {}", t.type_id)).or_insert(0) += 1;
            continue;
        };
        *tensor_types.entry(type_name.to_string()).or_insert(0) += 1;
        if t.elements % block != 0 {
            return Err(r.corrupted(format!(
                "tensor '{}' has {} elements, not a multiple of the {type_name} block of {block}",
                t.name, t.elements
            )));
        }
        let size = (t.elements / block)
            .checked_mul(block_bytes)
            .ok_or_else(|| r.corrupted(format!("tensor '{}' has an overflowing size", t.name)))?;
        let end = t.offset.checked_add(size).filter(|&e| e <= data_len).ok_or_else(|| {
            KylinError::file_corrupted(format!(
                "{}: tensor '{}' ({type_name}, {} elements) needs data bytes {}..{} but the data section has \
                 only {data_len} bytes; the file is truncated or damaged, fetch it again",
                path.display(),
                t.name,
                t.elements,
                t.offset,
                t.offset.saturating_add(size)
            ))
            .at(path)
        })?;
        let _ = end;
        tensor_bytes += size;
        if t.name.contains("_exps.") {
            expert_bytes += size;
        } else if t.name == "token_embd.weight" {
            embedding_bytes += size;
        } else if t.name == "per_layer_token_embd.weight" {
            per_layer_embedding_bytes += size;
        }
    }

    let get_str = |k: &str| metadata.get(k).and_then(GgufValue::as_str).map(str::to_string);
    let get_u64 = |k: &str| metadata.get(k).and_then(GgufValue::as_u64);
    let vocab_size = match metadata.get("tokenizer.ggml.tokens") {
        Some(GgufValue::Array { len, .. }) => Some(*len),
        _ => None,
    };
    Ok(GgufInfo {
        path: path.to_path_buf(),
        file_bytes,
        version,
        tensor_count,
        architecture: get_str("general.architecture"),
        name: get_str("general.name"),
        file_type: get_u64("general.file_type").map(file_type_name),
        tensor_types,
        tensor_bytes,
        expert_bytes,
        embedding_bytes,
        per_layer_embedding_bytes,
        alignment,
        data_offset,
        tokenizer_model: get_str("tokenizer.ggml.model"),
        vocab_size,
        bos_token_id: get_u64("tokenizer.ggml.bos_token_id"),
        eos_token_id: get_u64("tokenizer.ggml.eos_token_id"),
        add_bos_token: match metadata.get("tokenizer.ggml.add_bos_token") {
            Some(GgufValue::Bool(b)) => Some(*b),
            _ => None,
        },
        chat_template: get_str("tokenizer.chat_template"),
        tied_output: !has_output,
        metadata,
    })
}

/// Maps `path` read-only and parses its GGUF header.
///
/// `FILE_NOT_FOUND` if it does not exist, `FILE_CORRUPTED` for a header that runs past the end
/// of the file or tensor data that does, `MODEL_VERSION_INCOMPATIBLE` for an unknown version.
pub fn read_gguf_info(path: &Path) -> Result<GgufInfo> {
    let file = File::open(path).map_err(|e| KylinError::io(path, "cannot open GGUF file", &e))?;
    let size = file.metadata().map_err(|e| KylinError::io(path, "cannot stat GGUF file", &e))?.len();
    if size < 24 {
        return Err(KylinError::file_corrupted(format!(
            "{} has {size} bytes, too few for a GGUF header (24 bytes at least)",
            path.display()
        ))
        .at(path));
    }
    // SAFETY: read-only private map of a file Kylin never writes; see `safetensors_file::open`
    // for the truncation caveat, which applies equally here.
    let map = unsafe { memmap2::MmapOptions::new().map(&file) }
        .map_err(|e| KylinError::io(path, "cannot memory-map GGUF file", &e))?;
    parse_gguf(path, &map)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal GGUF: one string key, one u32 key, one F32 tensor of 4 elements.
    pub(crate) fn tiny_gguf() -> Vec<u8> {
        tiny_gguf_with("token_embd.weight")
    }

    /// The same with the tensor named `tensor`.
    fn tiny_gguf_with(tensor: &str) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes()); // tensors
        b.extend_from_slice(&2u64.to_le_bytes()); // kv
        let s = |b: &mut Vec<u8>, t: &str| {
            b.extend_from_slice(&(t.len() as u64).to_le_bytes());
            b.extend_from_slice(t.as_bytes());
        };
        s(&mut b, "general.architecture");
        b.extend_from_slice(&8u32.to_le_bytes());
        s(&mut b, "llama");
        s(&mut b, "llama.context_length");
        b.extend_from_slice(&4u32.to_le_bytes());
        b.extend_from_slice(&2048u32.to_le_bytes());
        s(&mut b, tensor);
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes()); // F32
        b.extend_from_slice(&0u64.to_le_bytes()); // offset
        while b.len() % 32 != 0 {
            b.push(0);
        }
        b.extend_from_slice(&[0u8; 16]);
        b
    }

    #[test]
    fn parses_a_minimal_file() {
        let info = parse_gguf(Path::new("t.gguf"), &tiny_gguf()).unwrap();
        assert_eq!(info.architecture.as_deref(), Some("llama"));
        assert_eq!(info.arch_u64("context_length"), Some(2048));
        assert_eq!(info.tensor_types.get("F32"), Some(&1));
        assert_eq!(info.tensor_bytes, 16);
        assert!(info.tied_output);
    }

    /// Gemma 4's per-layer input embedding is read one row per token, as the token embedding
    /// is: a token's bytes count one of its rows, not the whole table.
    #[test]
    fn a_per_layer_embedding_counts_one_row_per_token() {
        let mut info = parse_gguf(Path::new("t.gguf"), &tiny_gguf_with("per_layer_token_embd.weight")).unwrap();
        assert_eq!((info.per_layer_embedding_bytes, info.embedding_bytes), (16, 0));
        info.vocab_size = Some(2);
        assert_eq!(info.bytes_per_token(), 8, "one row of 2 f32 values");
        let mut info = parse_gguf(Path::new("t.gguf"), &tiny_gguf_with("blk.0.attn_q.weight")).unwrap();
        info.vocab_size = Some(2);
        assert_eq!(info.bytes_per_token(), 16, "an ordinary matrix is read whole");
    }

    #[test]
    fn every_truncation_is_file_corrupted() {
        let full = tiny_gguf();
        for len in 0..full.len() {
            let err = parse_gguf(Path::new("t.gguf"), &full[..len]).unwrap_err();
            assert_eq!(err.code, crate::ErrorCode::FileCorrupted, "truncated to {len}: {err}");
        }
    }

    #[test]
    fn huge_counts_do_not_allocate() {
        let mut b = tiny_gguf();
        // The metadata count claims 2^60 entries.
        b[16..24].copy_from_slice(&(1u64 << 60).to_le_bytes());
        assert_eq!(parse_gguf(Path::new("t.gguf"), &b).unwrap_err().code, crate::ErrorCode::FileCorrupted);
    }
}
