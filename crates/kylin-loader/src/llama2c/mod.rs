//! llama2.c checkpoints (the `.bin` files of Karpathy's `export.py`, which NanoInfer's
//! `read_model_file` also reads): versions 0, 1 and 2, turned into the same [`ModelConfig`] and
//! [`ModelWeights`] as a Hugging Face directory, so every command runs them on the native engine.
//!
//! Layouts (little-endian throughout):
//!
//! | version | header | then |
//! |---|---|---|
//! | 0 (`legacy_export`) | 28 bytes: 7 × i32 `dim`, `hidden_dim`, `n_layers`, `n_heads`, `n_kv_heads`, `vocab_size` (negative when the classifier is not shared), `seq_len` | f32: `tok_embeddings`, then per kind for every layer `rms_att`, `wq`, `wk`, `wv`, `wo`, `rms_ffn`, `w1`, `w2`, `w3`, then `rms_final`, the two `freq_cis` tables (`seq_len × head_size / 2` each, unused) and `wcls` when not shared |
//! | 1 | 256 bytes: u32 magic `0x616b3432` ("ak42"), i32 version, the 7 × i32 (`vocab_size` positive), u8 `shared_classifier`, zeros | f32: `rms_att` (all layers), `rms_ffn`, `rms_final`, `tok_embeddings`, `wq` … `w3` (all layers each), `wcls` when not shared |
//! | 2 | as version 1, plus i32 `group_size` at byte 37 | the f32 norms as in version 1, then every matrix in version 1's order as Q8_0: its int8 values, then one f32 scale per `group_size` values |
//!
//! `w1`, `w2` and `w3` are Hugging Face's `gate_proj`, `down_proj` and `up_proj`; the head size is
//! `dim / n_heads`; llama2.c's `run.c` fixes the activation (SiLU), the RoPE base (10000) and the
//! RMSNorm epsilon (1e-5).
//!
//! **Kylin's header extension.** A model whose RoPE base or epsilon differ from llama2.c's (SmolLM2
//! uses a base of 100000) cannot be described by those fields, so `kylin convert` writes both into
//! the padding of the 256-byte header (versions 1 and 2): at byte 64 the bytes `kyln`, u32 1, f64
//! `rope_theta`, f64 `rms_norm_eps`. llama2.c writes zeros there and never reads them; a file
//! without the extension gets llama2.c's values. Version 0 has no padding: such models are refused
//! by the exporter instead.
//!
//! Guarantees:
//! - Validated as safetensors are, before anything is bound: impossible header values are
//!   `CONFIG_INVALID` (a zero or negative size, heads that do not divide `dim`, a group size that
//!   does not divide a tensor), an unknown version `MODEL_VERSION_INCOMPATIBLE`; the file size the
//!   header implies is computed with checked arithmetic and must equal the file's own
//!   (`FILE_CORRUPTED`, naming both). Nothing is allocated from a header number before that check;
//!   afterwards every allocation is bounded by the file's size.
//! - Zero copy for the f32 versions (0 and 1), except `wq` and `wk`. llama2.c's RoPE rotates
//!   interleaved pairs `(2i, 2i + 1)` of each head, so `export.py` permutes the rows of Hugging
//!   Face's `q_proj`/`k_proj` (whose rotate-half RoPE pairs `i` with `i + head_dim / 2`). Kylin
//!   undoes that permutation at load, into owned memory (the one exception to zero copy, about a
//!   tenth of a Llama's weights), so the engine runs the very model the HF directory holds, with
//!   the logits of that directory bit for bit. The alternative, an interleaved RoPE in the engine,
//!   would rotate the same values but sum `q · k` in another order, and add a branch to a shared
//!   kernel for one file format.
//! - Version 2 is dequantized to f32 at load into owned memory (4 bytes per weight): the native
//!   engine's integer Q8_0 kernels use another block layout, so until a repacking path exists this
//!   is the documented fallback, reported by `inspect`.

pub mod export;
pub mod tokenizer;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use serde::Serialize;

use std::time::Instant;

use crate::arch::{self, Role};
use crate::config::{Architecture, ModelConfig, RopeConfig, RopeScaling};
use crate::error::{KylinError, Result};
use crate::generation::GenerationDefaults;
use crate::safetensors_file::{WeightFile, corrupted, map_read_only};
use crate::tensor::{DType, Storage, WeightTensor};
use crate::weights::{HeadBinding, LayerWeights, ModelWeights};
use crate::{Format, LoadOptions, LoadTimings, LoadedModel, check_tokenizer, eos_union, parent_dir};

/// The magic of versions 1 and 2: "ak42" as a little-endian u32 (the file starts with `42ka`).
pub const MAGIC: u32 = 0x616b_3432;
/// Header bytes of version 0 (7 × i32).
pub const V0_HEADER_BYTES: u64 = 28;
/// Header bytes of versions 1 and 2.
pub const HEADER_BYTES: u64 = 256;
/// llama2.c's fixed RoPE base.
pub const ROPE_THETA: f64 = 10000.0;
/// llama2.c's fixed RMSNorm epsilon.
pub const RMS_NORM_EPS: f64 = 1e-5;
/// Where Kylin's header extension starts, and its marker and version.
const EXT_OFFSET: usize = 64;
const EXT_MAGIC: &[u8; 4] = b"kyln";
const EXT_VERSION: u32 = 1;
/// The extension's length: marker, version, two f64.
const EXT_BYTES: usize = 4 + 4 + 8 + 8;
/// No model has a hidden size near this: a version 0 `dim` above it means the file is not a
/// llama2.c checkpoint at all (or its `ak42` magic is damaged).
const MAX_V0_DIM: i32 = 1 << 24;

/// One kind of tensor, named as `export.py` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Part {
    TokEmbeddings,
    RmsAtt,
    Wq,
    Wk,
    Wv,
    Wo,
    RmsFfn,
    W1,
    W2,
    W3,
    RmsFinal,
    FreqCisReal,
    FreqCisImag,
    Wcls,
}

impl Part {
    /// `export.py`'s name.
    pub fn name(self) -> &'static str {
        match self {
            Part::TokEmbeddings => "tok_embeddings",
            Part::RmsAtt => "rms_att",
            Part::Wq => "wq",
            Part::Wk => "wk",
            Part::Wv => "wv",
            Part::Wo => "wo",
            Part::RmsFfn => "rms_ffn",
            Part::W1 => "w1",
            Part::W2 => "w2",
            Part::W3 => "w3",
            Part::RmsFinal => "rms_final",
            Part::FreqCisReal => "freq_cis_real",
            Part::FreqCisImag => "freq_cis_imag",
            Part::Wcls => "wcls",
        }
    }

    /// The tensor's role in the model; `None` for version 0's RoPE tables, which the engine
    /// computes itself.
    pub fn role(self) -> Option<Role> {
        Some(match self {
            Part::TokEmbeddings => Role::Embed,
            Part::RmsAtt => Role::AttnNorm,
            Part::Wq => Role::QProj,
            Part::Wk => Role::KProj,
            Part::Wv => Role::VProj,
            Part::Wo => Role::OProj,
            Part::RmsFfn => Role::MlpNorm,
            Part::W1 => Role::GateProj,
            Part::W2 => Role::DownProj,
            Part::W3 => Role::UpProj,
            Part::RmsFinal => Role::FinalNorm,
            Part::Wcls => Role::LmHead,
            Part::FreqCisReal | Part::FreqCisImag => return None,
        })
    }

    /// Whether the file holds one tensor of this kind per layer.
    pub fn per_layer(self) -> bool {
        matches!(
            self,
            Part::RmsAtt | Part::Wq | Part::Wk | Part::Wv | Part::Wo | Part::RmsFfn | Part::W1 | Part::W2 | Part::W3
        )
    }

    /// The shape, `[rows, cols]` for matrices (`[out, in]`, as `nn.Linear` stores them) and
    /// `[len]` for vectors. Every product of two header values fits in `u64`.
    fn shape(self, h: &BinHeader) -> Vec<u64> {
        let (dim, hidden, vocab) = (h.dim as u64, h.hidden_dim as u64, h.vocab_size as u64);
        let (q_dim, kv_dim) = (dim, h.n_kv_heads as u64 * h.head_size() as u64);
        match self {
            Part::TokEmbeddings | Part::Wcls => vec![vocab, dim],
            Part::RmsAtt | Part::RmsFfn | Part::RmsFinal => vec![dim],
            Part::Wq => vec![q_dim, dim],
            Part::Wk | Part::Wv => vec![kv_dim, dim],
            Part::Wo => vec![dim, q_dim],
            Part::W1 | Part::W3 => vec![hidden, dim],
            Part::W2 => vec![dim, hidden],
            Part::FreqCisReal | Part::FreqCisImag => vec![h.seq_len as u64, h.head_size() as u64 / 2],
        }
    }
}

/// How a tensor's values are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Encoding {
    F32,
    /// int8 values, then one f32 scale per group of the header's `group_size` values.
    #[serde(rename = "Q8_0")]
    Q8_0,
}

impl Encoding {
    pub fn as_str(self) -> &'static str {
        match self {
            Encoding::F32 => "F32",
            Encoding::Q8_0 => "Q8_0",
        }
    }
}

/// A validated header.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BinHeader {
    /// 0, 1 or 2.
    pub version: u32,
    pub dim: usize,
    pub hidden_dim: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// Always positive here (version 0's sign is `shared_classifier`).
    pub vocab_size: usize,
    pub seq_len: usize,
    pub shared_classifier: bool,
    /// Version 2's quantization group size.
    pub group_size: Option<usize>,
    /// The RoPE base from Kylin's header extension (else llama2.c's 10000).
    pub rope_theta: Option<f64>,
    /// The RMSNorm epsilon from Kylin's header extension (else llama2.c's 1e-5).
    pub rms_norm_eps: Option<f64>,
}

impl BinHeader {
    /// `dim / n_heads` (validated to divide exactly).
    pub fn head_size(&self) -> usize {
        self.dim / self.n_heads
    }

    pub fn header_bytes(&self) -> u64 {
        if self.version == 0 { V0_HEADER_BYTES } else { HEADER_BYTES }
    }

    /// The header's values in one line, for messages.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "dim={}, hidden_dim={}, n_layers={}, n_heads={}, n_kv_heads={}, vocab_size={}, seq_len={}, \
             shared classifier {}",
            self.dim,
            self.hidden_dim,
            self.n_layers,
            self.n_heads,
            self.n_kv_heads,
            self.vocab_size,
            self.seq_len,
            if self.shared_classifier { "yes" } else { "no" }
        );
        if let Some(gs) = self.group_size {
            s.push_str(&format!(", group_size={gs}"));
        }
        s
    }

    /// The tensor groups in file order: ≤ 14 entries whatever the header says.
    fn groups(&self) -> Vec<Group> {
        let layers = self.n_layers;
        let g = |part: Part, count: usize, encoding: Encoding| Group { part, count, encoding };
        let per_layer = |encoding: Encoding| {
            [Part::Wq, Part::Wk, Part::Wv, Part::Wo, Part::W1, Part::W2, Part::W3].map(|p| g(p, layers, encoding))
        };
        let mut out = Vec::with_capacity(14);
        match self.version {
            0 => {
                out.push(g(Part::TokEmbeddings, 1, Encoding::F32));
                for part in
                    [Part::RmsAtt, Part::Wq, Part::Wk, Part::Wv, Part::Wo, Part::RmsFfn, Part::W1, Part::W2, Part::W3]
                {
                    out.push(g(part, layers, Encoding::F32));
                }
                out.push(g(Part::RmsFinal, 1, Encoding::F32));
                out.push(g(Part::FreqCisReal, 1, Encoding::F32));
                out.push(g(Part::FreqCisImag, 1, Encoding::F32));
                if !self.shared_classifier {
                    out.push(g(Part::Wcls, 1, Encoding::F32));
                }
            }
            _ => {
                let matrices = if self.version == 2 { Encoding::Q8_0 } else { Encoding::F32 };
                out.push(g(Part::RmsAtt, layers, Encoding::F32));
                out.push(g(Part::RmsFfn, layers, Encoding::F32));
                out.push(g(Part::RmsFinal, 1, Encoding::F32));
                out.push(g(Part::TokEmbeddings, 1, matrices));
                out.extend(per_layer(matrices));
                if !self.shared_classifier {
                    out.push(g(Part::Wcls, 1, matrices));
                }
            }
        }
        out
    }

    /// Bytes of one tensor of `part` stored as `encoding`; `None` on overflow. `CONFIG_INVALID`
    /// when a Q8_0 tensor is not a whole number of groups.
    fn tensor_bytes(&self, part: Part, encoding: Encoding) -> Result<Option<u64>> {
        let Some(n) = part.shape(self).iter().try_fold(1u64, |acc, &d| acc.checked_mul(d)) else {
            return Ok(None);
        };
        match encoding {
            Encoding::F32 => Ok(n.checked_mul(4)),
            Encoding::Q8_0 => {
                let gs = self.group_size.unwrap_or(1) as u64;
                if !n.is_multiple_of(gs) {
                    return Err(KylinError::config_invalid(format!(
                        "the llama2.c header's group_size {gs} does not divide {} ({n} values, shape {:?}); \
                         export.py never writes such a file",
                        part.name(),
                        part.shape(self)
                    )));
                }
                Ok((n / gs).checked_mul(4).and_then(|s| s.checked_add(n)))
            }
        }
    }

    /// The size of the file this header describes; `None` beyond `u64`, `CONFIG_INVALID` when a
    /// version 2 group size does not divide a tensor.
    pub fn file_bytes(&self) -> Result<Option<u64>> {
        self.expected_file_bytes(&self.groups())
    }

    /// The whole file's size as this header describes it; `None` beyond `u64`.
    fn expected_file_bytes(&self, groups: &[Group]) -> Result<Option<u64>> {
        let mut total = self.header_bytes();
        for g in groups {
            let Some(each) = self.tensor_bytes(g.part, g.encoding)? else { return Ok(None) };
            let Some(next) = each.checked_mul(g.count as u64).and_then(|b| total.checked_add(b)) else {
                return Ok(None);
            };
            total = next;
        }
        Ok(Some(total))
    }

    /// The resolved configuration: a Llama with llama2.c's fixed choices.
    pub fn model_config(&self) -> ModelConfig {
        let mut defaulted = Vec::new();
        let theta = self.rope_theta.unwrap_or_else(|| {
            defaulted.push("rope_theta".to_string());
            ROPE_THETA
        });
        let rms_norm_eps = self.rms_norm_eps.unwrap_or_else(|| {
            defaulted.push("rms_norm_eps".to_string());
            RMS_NORM_EPS
        });
        ModelConfig {
            architecture: Architecture::LLAMA,
            model_type: "llama".into(),
            hidden_size: self.dim,
            num_layers: self.n_layers,
            num_heads: self.n_heads,
            num_kv_heads: self.n_kv_heads,
            head_dim: self.head_size(),
            intermediate_size: self.hidden_dim,
            vocab_size: self.vocab_size,
            max_position_embeddings: self.seq_len,
            rms_norm_eps,
            rope: RopeConfig { theta, partial_rotary_factor: 1.0, scaling: RopeScaling::Default, multimodal: None },
            tie_word_embeddings: self.shared_classifier,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            hidden_act: "silu".into(),
            decoder: crate::family::DecoderSpec::plain(
                self.n_layers,
                self.head_size(),
                self.n_kv_heads,
                self.hidden_dim,
            ),
            multimodal: None,
            declared_dtype: Some(if self.version == 2 { "q8_0" } else { "float32" }.into()),
            bos_token_id: None,
            eos_token_ids: Vec::new(),
            defaulted,
            quantization: None,
            published: None,
        }
    }

    /// The header as written: 28 bytes (version 0) or 256 (versions 1 and 2, with Kylin's
    /// extension when the RoPE base or the epsilon is given). `OPERATOR_UNSUPPORTED` for a value
    /// beyond the format's int32 fields.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let field = |name: &str, v: usize| -> Result<i32> {
            i32::try_from(v).map_err(|_| {
                KylinError::operator_unsupported(format!("{name} = {v} does not fit the llama2.c header's int32 field"))
            })
        };
        let vocab = field("vocab_size", self.vocab_size)?;
        let fields = [
            field("dim", self.dim)?,
            field("hidden_dim", self.hidden_dim)?,
            field("n_layers", self.n_layers)?,
            field("n_heads", self.n_heads)?,
            field("n_kv_heads", self.n_kv_heads)?,
            if self.version == 0 && !self.shared_classifier { -vocab } else { vocab },
            field("seq_len", self.seq_len)?,
        ];
        let mut out = Vec::with_capacity(HEADER_BYTES as usize);
        if self.version != 0 {
            out.extend_from_slice(&MAGIC.to_le_bytes());
            out.extend_from_slice(&(self.version as i32).to_le_bytes());
        }
        for f in fields {
            out.extend_from_slice(&f.to_le_bytes());
        }
        if self.version == 0 {
            return Ok(out);
        }
        out.push(u8::from(self.shared_classifier));
        if let Some(gs) = self.group_size {
            out.extend_from_slice(&field("group_size", gs)?.to_le_bytes());
        }
        out.resize(HEADER_BYTES as usize, 0);
        if self.rope_theta.is_some() || self.rms_norm_eps.is_some() {
            let mut ext = Vec::with_capacity(EXT_BYTES);
            ext.extend_from_slice(EXT_MAGIC);
            ext.extend_from_slice(&EXT_VERSION.to_le_bytes());
            ext.extend_from_slice(&self.rope_theta.unwrap_or(ROPE_THETA).to_le_bytes());
            ext.extend_from_slice(&self.rms_norm_eps.unwrap_or(RMS_NORM_EPS).to_le_bytes());
            out[EXT_OFFSET..EXT_OFFSET + EXT_BYTES].copy_from_slice(&ext);
        }
        Ok(out)
    }
}

/// Tensors of one kind, stored back to back.
#[derive(Debug, Clone, Copy)]
struct Group {
    part: Part,
    count: usize,
    encoding: Encoding,
}

/// One tensor of the file and where it is.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Section {
    pub part: Part,
    /// The layer of a per-layer tensor.
    pub layer: Option<usize>,
    pub shape: Vec<usize>,
    pub encoding: Encoding,
    /// Absolute byte offset in the file.
    pub offset: usize,
    pub bytes: usize,
}

impl Section {
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// The Hugging Face name of the tensor this section fills (`None` for the RoPE tables).
    pub fn hf_name(&self) -> Option<String> {
        arch::tensor_name(Architecture::LLAMA, self.part.role()?, self.layer.unwrap_or(0))
    }
}

/// A validated file: its header and where every tensor is.
#[derive(Debug, Clone)]
pub struct BinLayout {
    pub header: BinHeader,
    /// Every tensor in file order.
    pub sections: Vec<Section>,
}

fn le_i32(bytes: &[u8], at: usize) -> i32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&bytes[at..at + 4]);
    i32::from_le_bytes(b)
}

fn le_f64(bytes: &[u8], at: usize) -> f64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[at..at + 8]);
    f64::from_le_bytes(b)
}

/// What the first bytes of a `.bin` say it is, before anything is validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sniffed {
    /// The `ak42` magic with this version (any value; checked at load).
    Magic(i32),
    /// No magic: version 0 if anything.
    NoMagic,
}

/// Recognises the files a `.bin` path may hold that are not llama2.c checkpoints, from their
/// first bytes: PyTorch pickles (`pytorch_model.bin`) and llama.cpp's pre-GGUF GGML files.
/// `Ok(None)` for anything else.
pub(crate) fn sniff(path: &Path, head: &[u8]) -> Result<Option<Sniffed>> {
    if head.len() >= 4 && u32::from_le_bytes([head[0], head[1], head[2], head[3]]) == MAGIC {
        return Ok(Some(Sniffed::Magic(if head.len() >= 8 { le_i32(head, 4) } else { -1 })));
    }
    if path.extension().and_then(|e| e.to_str()) != Some("bin") {
        return Ok(None);
    }
    let zip = head.starts_with(b"PK\x03\x04");
    let pickle = head.len() >= 2 && head[0] == 0x80 && (2..=5).contains(&head[1]);
    if zip || pickle {
        return Err(KylinError::operator_unsupported(format!(
            "{} is a PyTorch checkpoint ({}, as `torch.save` writes `pytorch_model.bin`), not a llama2.c \
             export: Kylin does not unpickle files; it reads Hugging Face safetensors (save the model with \
             `save_pretrained(..., safe_serialization=True)`) and llama2.c `.bin` exports",
            path.display(),
            if zip { "a zip archive" } else { "a Python pickle" }
        ))
        .at(path));
    }
    let ggml = [b"lmgg", b"fmgg", b"tjgg", b"algg"].iter().any(|m| head.starts_with(&m[..]));
    if ggml {
        return Err(KylinError::operator_unsupported(format!(
            "{} is a GGML file (llama.cpp's format before GGUF), not a llama2.c export: convert it to GGUF \
             with llama.cpp's convert_llama_ggml_to_gguf.py and run the .gguf",
            path.display()
        ))
        .at(path));
    }
    Ok(Some(Sniffed::NoMagic))
}

/// Reads and validates the header values (nothing about the file size yet).
fn read_header(path: &Path, bytes: &[u8]) -> Result<BinHeader> {
    let len = bytes.len() as u64;
    let magic = bytes.len() >= 4 && u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) == MAGIC;
    let invalid =
        |what: String| KylinError::config_invalid(format!("{}: the llama2.c header {what}", path.display())).at(path);
    let (version, raw, shared_byte, group_size, ext_at) = if magic {
        if len < HEADER_BYTES {
            return Err(corrupted(
                path,
                format!(
                    "the file starts with the llama2.c magic 'ak42' but has {len} bytes, fewer than the {HEADER_BYTES}-byte header"
                ),
            ));
        }
        let version = le_i32(bytes, 4);
        if !(1..=2).contains(&version) {
            return Err(KylinError::model_version_incompatible(format!(
                "{} is a llama2.c checkpoint of version {version}; Kylin reads versions 0, 1 (float32) and 2 (Q8_0)",
                path.display()
            ))
            .at(path));
        }
        let raw: [i32; 7] = std::array::from_fn(|k| le_i32(bytes, 8 + 4 * k));
        let gs = (version == 2).then(|| le_i32(bytes, 37));
        (version as u32, raw, Some(bytes[36]), gs, Some(EXT_OFFSET))
    } else {
        if len < V0_HEADER_BYTES {
            return Err(corrupted(
                path,
                format!(
                    "the file has {len} bytes, fewer than the {V0_HEADER_BYTES}-byte header of a llama2.c version 0 \
                     file (and it does not start with the 'ak42' magic of versions 1 and 2)"
                ),
            ));
        }
        let raw: [i32; 7] = std::array::from_fn(|k| le_i32(bytes, 4 * k));
        if raw[0] > MAX_V0_DIM {
            return Err(corrupted(
                path,
                format!(
                    "this is not a llama2.c checkpoint: it does not start with the magic 'ak42' of versions 1 and 2 \
                     (found bytes {:02x} {:02x} {:02x} {:02x}, expected 32 34 6b 61), and read as version 0, whose \
                     header has no magic, its dim would be {}, beyond any model",
                    bytes[0], bytes[1], bytes[2], bytes[3], raw[0]
                ),
            ));
        }
        (0, raw, None, None, None)
    };

    let names = ["dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"];
    let mut values = [0usize; 7];
    for (k, (&v, name)) in raw.iter().zip(names).enumerate() {
        // Version 0 stores an unshared classifier as a negative vocab_size.
        let v = if version == 0 && name == "vocab_size" { v.unsigned_abs() as i64 } else { v as i64 };
        if v <= 0 {
            return Err(invalid(format!("has {name} = {}; it must be positive", raw[k])));
        }
        values[k] = v as usize;
    }
    let [dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len] = values;
    if !dim.is_multiple_of(n_heads) {
        return Err(invalid(format!("has dim = {dim}, not a multiple of n_heads = {n_heads}")));
    }
    if !(dim / n_heads).is_multiple_of(2) {
        return Err(invalid(format!(
            "has a head size dim / n_heads = {} which is odd; RoPE rotates pairs",
            dim / n_heads
        )));
    }
    if n_kv_heads > n_heads || !n_heads.is_multiple_of(n_kv_heads) {
        return Err(invalid(format!("has n_heads = {n_heads}, not a multiple of n_kv_heads = {n_kv_heads}")));
    }
    let shared_classifier = match shared_byte {
        None => raw[5] > 0,
        Some(0) => false,
        Some(1) => true,
        Some(b) => return Err(invalid(format!("has shared_classifier = {b} (byte 36); it must be 0 or 1"))),
    };
    let group_size = match group_size {
        None => None,
        Some(gs) if gs > 0 => Some(gs as usize),
        Some(gs) => return Err(invalid(format!("has group_size = {gs} (byte 37); it must be positive"))),
    };
    let (rope_theta, rms_norm_eps) = match ext_at {
        Some(at) if &bytes[at..at + 4] == EXT_MAGIC => {
            let ext_version = u32::from_le_bytes([bytes[at + 4], bytes[at + 5], bytes[at + 6], bytes[at + 7]]);
            if ext_version != EXT_VERSION {
                return Err(KylinError::model_version_incompatible(format!(
                    "{} carries Kylin's llama2.c header extension version {ext_version}; this Kylin reads version \
                     {EXT_VERSION}",
                    path.display()
                ))
                .at(path));
            }
            let theta = le_f64(bytes, at + 8);
            let eps = le_f64(bytes, at + 16);
            if !(theta.is_finite() && theta > 1.0) {
                return Err(invalid(format!("extension has rope_theta = {theta}; it must be a number > 1")));
            }
            if !(eps.is_finite() && eps > 0.0 && eps < 1.0) {
                return Err(invalid(format!("extension has rms_norm_eps = {eps}; it must be in (0, 1)")));
            }
            (Some(theta), Some(eps))
        }
        _ => (None, None),
    };
    Ok(BinHeader {
        version,
        dim,
        hidden_dim,
        n_layers,
        n_heads,
        n_kv_heads,
        vocab_size,
        seq_len,
        shared_classifier,
        group_size,
        rope_theta,
        rms_norm_eps,
    })
}

/// Validates a whole llama2.c file held in memory and lists its tensors; `path` is only used
/// in messages. Nothing is allocated from a header value before the file size is checked.
pub fn parse(path: &Path, bytes: &[u8]) -> Result<BinLayout> {
    let header = read_header(path, bytes)?;
    let groups = header.groups();
    let actual = bytes.len() as u64;
    match header.expected_file_bytes(&groups)? {
        Some(expected) if expected == actual => {}
        Some(expected) => {
            let (diff, how) =
                if expected > actual { (expected - actual, "missing") } else { (actual - expected, "too many") };
            return Err(corrupted(
                path,
                format!(
                    "the llama2.c version {} header ({}) implies a file of {expected} bytes, but it has {actual} \
                     bytes ({diff} bytes {how})",
                    header.version,
                    header.describe()
                ),
            ));
        }
        None => {
            return Err(corrupted(
                path,
                format!(
                    "the llama2.c version {} header ({}) implies a file larger than 2^64 bytes, but it has \
                     {actual} bytes",
                    header.version,
                    header.describe()
                ),
            ));
        }
    }
    // From here on the file holds every byte the header describes, so the section list (its
    // length bounded by the file size) and every offset are real.
    let sections = header.sections()?;
    Ok(BinLayout { header, sections })
}

impl BinHeader {
    /// Every tensor in file order, with its offset. Call only for a header whose file size fits
    /// in memory (checked by [`parse`], or a header made from a loaded model).
    pub(crate) fn sections(&self) -> Result<Vec<Section>> {
        let mut sections = Vec::new();
        let mut offset = self.header_bytes() as usize;
        for g in &self.groups() {
            let shape: Vec<usize> = g.part.shape(self).iter().map(|&d| d as usize).collect();
            let bytes = self.tensor_bytes(g.part, g.encoding)?.unwrap_or(0) as usize;
            for i in 0..g.count {
                let layer = g.part.per_layer().then_some(i);
                sections.push(Section {
                    part: g.part,
                    layer,
                    shape: shape.clone(),
                    encoding: g.encoding,
                    offset,
                    bytes,
                });
                offset += bytes;
            }
        }
        Ok(sections)
    }
}

/// The row of a llama2.c `wq`/`wk` that holds Hugging Face row `hf_row`. Per head of
/// `head_size` rows, HF's rotate-half pairs rows `i` and `i + head_size / 2`; llama2.c's
/// interleaved RoPE pairs rows `2i` and `2i + 1` (`export.py`'s `permute_reverse`).
pub fn bin_row_of_hf_row(hf_row: usize, head_size: usize) -> usize {
    let (head, k) = (hf_row / head_size, hf_row % head_size);
    let half = head_size / 2;
    head * head_size + 2 * (k % half) + k / half
}

/// The inverse of [`bin_row_of_hf_row`]: the HF row that llama2.c row `bin_row` holds
/// (transformers' `permute` in `convert_llama_weights_to_hf.py`).
pub fn hf_row_of_bin_row(bin_row: usize, head_size: usize) -> usize {
    let (head, k) = (bin_row / head_size, bin_row % head_size);
    let half = head_size / 2;
    head * head_size + (k % 2) * half + k / 2
}

/// Writes a section's values as f32 into `dst` (little-endian), taking destination row `r` from
/// source row `row_of(r)`: the q/k un-permutation, or the identity. Q8_0 values are dequantized
/// (`q × scale` of their group, as llama2.c's `dequantize`).
fn fill_f32(dst: &mut [u8], file: &[u8], s: &Section, group_size: usize, row_of: impl Fn(usize) -> usize) {
    let cols = *s.shape.last().unwrap_or(&1);
    let src = &file[s.offset..s.offset + s.bytes];
    match s.encoding {
        Encoding::F32 => {
            let row_bytes = cols * 4;
            for (r, out) in dst.chunks_exact_mut(row_bytes).enumerate() {
                let from = row_of(r) * row_bytes;
                out.copy_from_slice(&src[from..from + row_bytes]);
            }
        }
        Encoding::Q8_0 => {
            let n = s.elements();
            let (values, scales) = src.split_at(n);
            for (r, out) in dst.chunks_exact_mut(cols * 4).enumerate() {
                // The row's values, in runs that share a group (and so a scale).
                let mut i = row_of(r) * cols;
                let mut out = out;
                while !out.is_empty() {
                    let group = i / group_size;
                    let run = ((group + 1) * group_size - i).min(out.len() / 4);
                    let at = group * 4;
                    let scale = f32::from_le_bytes([scales[at], scales[at + 1], scales[at + 2], scales[at + 3]]);
                    let (head, rest) = out.split_at_mut(run * 4);
                    for (o, &q) in head.chunks_exact_mut(4).zip(&values[i..i + run]) {
                        o.copy_from_slice(&((q as i8) as f32 * scale).to_le_bytes());
                    }
                    out = rest;
                    i += run;
                }
            }
        }
    }
}

/// The alignment of tensors in owned memory.
const CACHE_LINE: usize = 64;

/// The model bound from a validated file.
pub(crate) struct BoundBin {
    pub weights: ModelWeights,
    /// Bytes made at load (un-permuted q/k, dequantized version 2 matrices).
    pub owned_bytes: u64,
}

/// Binds every role of the Llama block to the file's tensors: f32 tensors as views into the
/// map, except `wq`/`wk` (un-permuted) and Q8_0 tensors (dequantized), which go to one owned
/// buffer.
pub(crate) fn bind(layout: &BinLayout, map: Arc<Storage>) -> Result<BoundBin> {
    let h = &layout.header;
    let head_size = h.head_size();
    let group_size = h.group_size.unwrap_or(1);
    let owned = |s: &Section| {
        s.part.role().is_some() && (matches!(s.part, Part::Wq | Part::Wk) || s.encoding == Encoding::Q8_0)
    };

    // One owned buffer for everything copied; its size is at most four times the file's. Every
    // tensor starts on a cache line, as the map's do (a vector load then never splits a line).
    let aligned = |n: usize| n.next_multiple_of(CACHE_LINE);
    let owned_len: usize = layout.sections.iter().filter(|s| owned(s)).map(|s| aligned(s.elements() * 4)).sum();
    let mut buffer = vec![0u8; owned_len + CACHE_LINE];
    let mut at = buffer.as_ptr().align_offset(CACHE_LINE).min(CACHE_LINE);
    let mut owned_at = Vec::new();
    for s in layout.sections.iter().filter(|s| owned(s)) {
        let dst = &mut buffer[at..at + s.elements() * 4];
        if matches!(s.part, Part::Wq | Part::Wk) {
            fill_f32(dst, map.bytes(), s, group_size, |r| bin_row_of_hf_row(r, head_size));
        } else {
            fill_f32(dst, map.bytes(), s, group_size, |r| r);
        }
        owned_at.push(at);
        at += aligned(s.elements() * 4);
    }
    let buffer = Arc::new(Storage::Owned(buffer));

    let internal = |name: &str| KylinError::file_corrupted(format!("internal: tensor '{name}' does not fit its file"));
    let mut found: BTreeMap<(usize, Role), WeightTensor> = BTreeMap::new();
    let mut owned_iter = owned_at.into_iter();
    for s in &layout.sections {
        let (Some(role), Some(name)) = (s.part.role(), s.hf_name()) else { continue };
        let bytes = s.elements() * 4;
        let view = if owned(s) {
            let offset = owned_iter.next().ok_or_else(|| internal(&name))?;
            WeightTensor::new(name.clone(), DType::F32, s.shape.clone(), Arc::clone(&buffer), offset, bytes)
        } else {
            WeightTensor::new(name.clone(), DType::F32, s.shape.clone(), Arc::clone(&map), s.offset, bytes)
        };
        found.insert((s.layer.unwrap_or(usize::MAX), role), view.ok_or_else(|| internal(&name))?);
    }

    let embed_tokens = arch::take(&mut found, usize::MAX, Role::Embed)?;
    let final_norm = arch::take(&mut found, usize::MAX, Role::FinalNorm)?;
    let (lm_head, head) = if h.shared_classifier {
        let why = if h.version == 0 { "vocab_size is positive" } else { "shared_classifier is 1" };
        (
            embed_tokens.clone(),
            HeadBinding {
                tied: true,
                reason: format!("the llama2.c header's {why}: the head uses the embedding matrix"),
            },
        )
    } else {
        let why = if h.version == 0 { "vocab_size is negative" } else { "shared_classifier is 0" };
        (
            arch::take(&mut found, usize::MAX, Role::LmHead)?,
            HeadBinding {
                tied: false,
                reason: format!("the llama2.c header's {why}: the head is wcls (lm_head.weight)"),
            },
        )
    };
    let mut layers = Vec::with_capacity(h.n_layers);
    for i in 0..h.n_layers {
        let mut tensors = std::collections::BTreeMap::new();
        for role in [
            Role::AttnNorm,
            Role::QProj,
            Role::KProj,
            Role::VProj,
            Role::OProj,
            Role::MlpNorm,
            Role::GateProj,
            Role::UpProj,
            Role::DownProj,
        ] {
            tensors.insert(role, arch::take(&mut found, i, role)?);
        }
        layers.push(LayerWeights { tensors, experts: Vec::new() });
    }
    Ok(BoundBin {
        weights: ModelWeights {
            embed_tokens,
            final_norm,
            lm_head,
            head,
            globals: Default::default(),
            layers,
            scales: Default::default(),
            published: Default::default(),
        },
        owned_bytes: layout.sections.iter().filter(|s| owned(s)).map(|s| s.elements() as u64 * 4).sum(),
    })
}

/// Tensors of one kind as `inspect` lists them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TensorGroupInfo {
    /// `export.py`'s name (`wq`, `rms_att`, ...).
    pub name: &'static str,
    /// The Hugging Face name it becomes (`{layer}` for per-layer tensors); `None` for the RoPE
    /// tables, which are skipped.
    pub hf_name: Option<String>,
    /// Tensors of this kind (the layer count for per-layer tensors).
    pub count: usize,
    pub shape: Vec<usize>,
    pub encoding: Encoding,
    /// Bytes of all of them in the file.
    pub bytes: u64,
}

/// What `inspect` shows of a llama2.c file.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BinInfo {
    pub header: BinHeader,
    pub header_bytes: u64,
    /// Tensor kinds in file order.
    pub tensors: Vec<TensorGroupInfo>,
    /// Bytes copied into memory at load: `wq`/`wk` un-permuted, version 2's matrices dequantized.
    pub owned_bytes: u64,
    /// How the file was bound, in sentences.
    pub notes: Vec<String>,
}

impl BinInfo {
    pub(crate) fn new(layout: &BinLayout, owned_bytes: u64) -> BinInfo {
        let h = &layout.header;
        let mut tensors: Vec<TensorGroupInfo> = Vec::new();
        for s in &layout.sections {
            match tensors.last_mut() {
                Some(t) if t.name == s.part.name() => {
                    t.count += 1;
                    t.bytes += s.bytes as u64;
                }
                _ => tensors.push(TensorGroupInfo {
                    name: s.part.name(),
                    hf_name: s.part.role().and_then(|r| {
                        arch::table(Architecture::LLAMA).into_iter().find(|t| t.role == r).map(|t| t.name.to_string())
                    }),
                    count: 1,
                    shape: s.shape.clone(),
                    encoding: s.encoding,
                    bytes: s.bytes as u64,
                }),
            }
        }
        let mut notes = vec![
            "wq and wk are un-permuted at load from llama2.c's interleaved RoPE order to Hugging Face's \
             rotate-half order, into owned memory"
                .to_string(),
        ];
        if h.version == 2 {
            notes.push(format!(
                "Q8_0 matrices (group size {}) are dequantized to F32 at load, into owned memory: the native \
                 engine has no kernel for this layout yet",
                h.group_size.unwrap_or(0)
            ));
        } else {
            notes.push("every other tensor is used in place from the read-only map".into());
        }
        if h.version == 0 {
            notes.push("the freq_cis tables are skipped: the engine computes its RoPE tables".into());
        }
        match (h.rope_theta, h.rms_norm_eps) {
            (Some(t), Some(e)) => {
                notes.push(format!("rope_theta {t} and rms_norm_eps {e} come from Kylin's header extension"))
            }
            _ => notes
                .push(format!("rope_theta {ROPE_THETA} and rms_norm_eps {RMS_NORM_EPS} are llama2.c's fixed values")),
        }
        BinInfo { header: h.clone(), header_bytes: h.header_bytes(), tensors, owned_bytes, notes }
    }
}

/// The tokenizer files looked for beside a `.bin`, in order, for messages.
const TOKENIZER_FILES: &str = "tokenizer.bin, then tokenizer.json, then vocab.json + merges.txt";

/// Loads a llama2.c checkpoint for the native engine: the header becomes the [`ModelConfig`],
/// the tensors are bound as the module documentation says, and the tokenizer is `tokenizer.bin`
/// beside the file, else the Hugging Face tokenizer files beside it (`tokenizer.json`, with
/// `tokenizer_config.json`), else none (token ids only). A `generation_config.json` beside it
/// gives the sampling defaults.
pub(crate) fn load(file: &Path, opts: &LoadOptions) -> Result<LoadedModel> {
    if opts.tensor_map.is_some() {
        return Err(KylinError::input_invalid(format!(
            "a tensor map renames the tensors of safetensors checkpoints; {} is a llama2.c checkpoint, whose \
             tensors have fixed places",
            file.display()
        )));
    }
    let t0 = Instant::now();
    let map = map_read_only(file, 0, "a llama2.c header")?;
    let layout = parse(file, &map)?;
    let file_bytes = map.len() as u64;
    let bound = bind(&layout, Arc::new(Storage::Mmap(map)))?;
    if opts.prefetch {
        for tensor in bound.weights.tensors() {
            tensor.advise_will_need();
        }
    }
    let config = layout.header.model_config();
    let weights_ms = t0.elapsed().as_secs_f64() * 1e3;

    let mut warnings = Vec::new();
    let dir = parent_dir(file);
    let t1 = Instant::now();
    let tokenizer_bin = dir.join("tokenizer.bin");
    let tokenizer = if tokenizer_bin.is_file() {
        let bytes = std::fs::read(&tokenizer_bin).map_err(|e| KylinError::io(&tokenizer_bin, "cannot read", &e))?;
        let vocab = tokenizer::parse_vocab(
            &tokenizer_bin,
            &bytes,
            config.vocab_size,
            opts.allow_vocab_mismatch,
            &mut warnings,
        )?;
        Some(tokenizer::build(&tokenizer_bin, &vocab, &mut warnings)?)
    } else {
        crate::tokenizer::load_tokenizer(dir, &mut warnings)?
    };
    let tokenizer_ms = t1.elapsed().as_secs_f64() * 1e3;
    check_tokenizer(dir, TOKENIZER_FILES, &config, tokenizer.as_ref(), opts, &mut warnings)?;
    let generation = GenerationDefaults::load(&dir.join("generation_config.json"))?;
    let eos_ids = eos_union(&config, &generation, tokenizer.as_ref());

    let mut dtypes = BTreeMap::new();
    for s in &layout.sections {
        *dtypes.entry(s.encoding.as_str().to_string()).or_insert(0) += 1;
    }
    Ok(LoadedModel {
        format: Format::LegacyBin { file: file.to_path_buf(), version: layout.header.version as i32 },
        files: vec![WeightFile { path: file.to_path_buf(), bytes: file_bytes }],
        tensor_count: layout.sections.len(),
        total_bytes: layout.sections.iter().map(|s| s.bytes as u64).sum(),
        dtypes,
        unused_tensors: Vec::new(),
        not_run: Vec::new(),
        vision: None,
        mtp: None,
        task: crate::task::ModelTask::Generate,
        llama2c: Some(BinInfo::new(&layout, bound.owned_bytes)),
        config,
        weights: bound.weights,
        tokenizer,
        generation,
        eos_ids,
        warnings,
        timings: LoadTimings { weights_ms, tokenizer_ms },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_maps_are_inverse_and_match_export_py() {
        // export.py: w.view(n_heads, 2, hd // 2, dim).transpose(1, 2): llama2.c row (h, i, j) is HF row (h, j, i).
        let hd = 8;
        let want_bin_to_hf = [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15];
        for (bin, &hf) in want_bin_to_hf.iter().enumerate() {
            assert_eq!(hf_row_of_bin_row(bin, hd), hf);
            assert_eq!(bin_row_of_hf_row(hf, hd), bin);
        }
    }

    fn header(version: u32) -> BinHeader {
        BinHeader {
            version,
            dim: 64,
            hidden_dim: 192,
            n_layers: 2,
            n_heads: 8,
            n_kv_heads: 4,
            vocab_size: 1024,
            seq_len: 2048,
            shared_classifier: false,
            group_size: (version == 2).then_some(64),
            rope_theta: None,
            rms_norm_eps: None,
        }
    }

    #[test]
    fn headers_round_trip_through_their_bytes() {
        for version in 0..=2 {
            let mut h = header(version);
            if version > 0 {
                h.rope_theta = Some(100000.0);
                h.rms_norm_eps = Some(1e-6);
            }
            let mut bytes = h.to_bytes().unwrap();
            let size = h.file_bytes().unwrap().unwrap();
            bytes.resize(size as usize, 0);
            let layout = parse(Path::new("m.bin"), &bytes).unwrap();
            assert_eq!(layout.header, h);
            let last = layout.sections.last().unwrap();
            assert_eq!(last.offset + last.bytes, bytes.len());
            assert_eq!(last.part, Part::Wcls);
        }
    }
}
