//! The quantized checkpoints people publish: compressed-tensors (`int-quantized`,
//! `pack-quantized`, `float-quantized`, written by llm-compressor), transformers' fine-grained
//! FP8 (Qwen's `*-FP8` releases), GPTQ and AWQ.
//!
//! Three steps, each at the boundary:
//! 1. [`PublishedQuantization::parse`] reads `quantization_config`: the method, the bits, the
//!    group size, symmetry, which modules stay unquantized. A variant Kylin does not run is
//!    `OPERATOR_UNSUPPORTED` naming the field and its value.
//! 2. [`bind_matrix`] finds a quantized linear layer's tensors and checks each one's shape and
//!    dtype against what the config and the matrix's `[rows, cols]` imply (`TENSOR_MISSING`,
//!    `TENSOR_SHAPE_MISMATCH`, `TENSOR_DTYPE_UNSUPPORTED`, naming the tensor, expected vs. got).
//! 3. [`PublishedMatrix::integers`] and [`PublishedMatrix::dequantize`] decode the stored
//!    numbers (checking the values the shapes cannot: a group index out of range, a
//!    `weight_shape` that disagrees). Every integer format becomes one [`IntMatrix`]:
//!    `w[r][c] = scale[r][g] · (code[r][c] − zero[r][g])` with `g` the column's group, which the
//!    engine dequantizes exactly (`--precision f32`) or repacks for its integer kernels.
//!
//! The packings, as their producers write them (the fixtures' script cross-checks them with
//! the producers' unpacking code):
//! - compressed-tensors `pack-quantized`: `weight_packed` I32 `[out, in · bits / 32]`, value
//!   `c` of a row in bits `bits · (c mod 32/bits)` of word `c / (32/bits)`, stored offset by
//!   `2^(bits−1)`; `weight_zero_point` (asymmetric) I32 `[out · bits / 32, groups]` packed the
//!   same way along the rows, offset too; `weight_scale` `[out, groups]`; `weight_shape` I64
//!   `[2]`; `weight_g_idx` I32 `[in]` with `actorder`.
//! - compressed-tensors `int-quantized`: `weight` I8 `[out, in]`, `weight_scale` `[out, 1]`
//!   (channel), `[out, groups]` (group) or `[1]` (tensor).
//! - `float-quantized` and fine-grained FP8: `weight` F8_E4M3 `[out, in]`, `weight_scale`
//!   (compressed-tensors: `[1]`, `[out, 1]`, `[out, in / group]` or `[⌈out/bh⌉, ⌈in/bw⌉]`) or
//!   `weight_scale_inv` (fine-grained: blocks; despite the name, multiplied by).
//! - GPTQ: `qweight` I32 `[in · bits / 32, out]` (input `i` in bits `bits · (i mod 8)` of row
//!   `i / 8` for 4 bits), `qzeros` I32 `[groups, out · bits / 32]` (output `o` in bits
//!   `bits · (o mod 8)`), holding `zero − 1` in the v1 checkpoint format; `scales` F16
//!   `[groups, out]`; `g_idx` I32 `[in]`.
//! - AWQ (GEMM): `qweight` I32 `[in, out / 8]`, nibble `i` of word `w` holding output
//!   `8w + [0, 2, 4, 6, 1, 3, 5, 7][i]`; `qzeros` I32 `[groups, out / 8]` the same way (the zero
//!   itself); `scales` F16 `[groups, out]`.

use serde::Serialize;
use serde_json::{Map, Value};

use crate::config::field as get;
use crate::error::{KylinError, Result};
use crate::safetensors_file::TensorIndex;
use crate::tensor::{DType, WeightTensor};

/// Who wrote the checkpoint's quantization, as `quant_method` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum PublishedMethod {
    CompressedTensors,
    Fp8,
    Gptq,
    Awq,
    /// gpt-oss's `mxfp4`: the experts in MXFP4, everything else as stored.
    Mxfp4,
}

impl PublishedMethod {
    pub fn name(self) -> &'static str {
        match self {
            PublishedMethod::CompressedTensors => "compressed-tensors",
            PublishedMethod::Fp8 => "fp8",
            PublishedMethod::Gptq => "gptq",
            PublishedMethod::Awq => "awq",
            PublishedMethod::Mxfp4 => "mxfp4",
        }
    }
}

/// How the integers of an integer scheme are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum IntPacking {
    /// compressed-tensors `int-quantized`: one I8 per weight, `X.weight`.
    CtInt8,
    /// compressed-tensors `pack-quantized`: `X.weight_packed`.
    CtPacked,
    /// GPTQ `qweight` / `qzeros` / `scales`; `v1` stores zero points minus one.
    Gptq { v1: bool },
    /// AWQ GEMM `qweight` / `qzeros` / `scales`.
    Awq,
}

/// Where an FP8 matrix's scales apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Fp8Scales {
    /// One scale for the matrix, `[1]`.
    Tensor,
    /// One per output row, `[out, 1]`.
    Channel,
    /// One per row and group of columns, `[out, in / group]`.
    Group(usize),
    /// One per block of `rows × cols`, `[⌈out / rows⌉, ⌈in / cols⌉]`.
    Block(usize, usize),
}

/// What a quantized layer's input is rounded to at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum ActivationType {
    /// Integers in `-128..=127` (`type: int`, `num_bits: 8`), rounded half to even.
    Int8,
    /// FP8 E4M3 (`type: float`, `num_bits: 8`; fine-grained FP8), rounded to nearest even.
    Fp8E4M3,
}

/// Where a layer input's quantization scales apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum ActivationScales {
    /// One scale per token, from that token's values (`strategy: token`, dynamic).
    Token,
    /// One per token and group of this many columns, from the group's values (`strategy:
    /// group`, dynamic; fine-grained FP8's `activation_scheme: dynamic`, groups of the weight
    /// block's width).
    Group(usize),
    /// One per call, from every value of the call's input (`strategy: tensor`, dynamic): the
    /// scale depends on what shares the batch.
    DynamicTensor,
    /// One stored scale per layer (`strategy: tensor`, not dynamic): `X.input_scale` `[1]`.
    Static,
}

/// How a scheme quantizes the input of each quantized linear layer at run time
/// (compressed-tensors' `input_activations`, fine-grained FP8's `activation_scheme`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ActivationScheme {
    pub kind: ActivationType,
    pub scales: ActivationScales,
    /// Symmetric (no zero point); only int8 may be asymmetric, and only when dynamic.
    pub symmetric: bool,
}

impl ActivationScheme {
    /// `int8 per token, dynamic, symmetric` (for `inspect` and errors).
    pub fn describe(&self) -> String {
        format!(
            "{} {}, {}",
            match self.kind {
                ActivationType::Int8 => "int8",
                ActivationType::Fp8E4M3 => "fp8 e4m3",
            },
            match self.scales {
                ActivationScales::Token => "per token, dynamic".to_string(),
                ActivationScales::Group(g) => format!("per token and group of {g}, dynamic"),
                ActivationScales::DynamicTensor => "per tensor, dynamic".to_string(),
                ActivationScales::Static => "per tensor, static (input_scale)".to_string(),
            },
            if self.symmetric { "symmetric" } else { "asymmetric" }
        )
    }
}

/// What the stored numbers of every quantized matrix are.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum Scheme {
    /// Integers of `bits` with a scale per row and group of `group` columns (`None`: one
    /// group per row), with zero points unless `symmetric`; `actorder`: a stored group index
    /// per column instead of `column / group`.
    Int { bits: u32, group: Option<usize>, symmetric: bool, actorder: bool, packing: IntPacking },
    /// FP8 E4M3 values times `scales`; `inverse_name`: the scale tensor is `weight_scale_inv`.
    Float8 { scales: Fp8Scales, inverse_name: bool },
    /// FP4 E2M1 codes, two per byte (`_blocks` `[rows, cols / 32, 16]`), times an E8M0 scale
    /// per block of 32 (`_scales` `[rows, cols / 32]`): gpt-oss's stacked experts.
    Mxfp4,
}

/// A checkpoint's `quantization_config`, decided.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PublishedQuantization {
    pub method: PublishedMethod,
    pub scheme: Scheme,
    /// Modules left unquantized, as written (`ignore`, `modules_to_not_convert`, GPTQ's
    /// `lm_head: false`).
    pub ignore: Vec<String>,
    /// How `ignore` entries match a module name.
    #[serde(skip)]
    matcher: IgnoreRule,
    /// How the scheme quantizes each quantized layer's input at run time (`None`: the
    /// activations stay as they are, as in the weight-only `A16` schemes). `--precision f32`
    /// computes it; the integer kernels quantize activations their own way.
    pub input: Option<ActivationScheme>,
    /// Whether the producer quantized the activations to int8 (`W8A8`): the engine then runs
    /// the int8 activations of its integer kernels; every other scheme keeps 16-bit
    /// activations where the CPU has BF16 kernels.
    pub int8_activations: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum IgnoreRule {
    /// compressed-tensors: the module's name, its class (`Linear`), or `re:PATTERN` matched
    /// at the start of the name (Python's `re.match`).
    CompressedTensors,
    /// transformers' `modules_to_not_convert`: any entry contained in the name.
    Substring,
}

/// A wrong value of `quantization_config.FIELD` (`CONFIG_INVALID`, as config.json's other fields).
fn bad(field: &str, expected: &str, got: &Value) -> KylinError {
    crate::config::bad(&format!("quantization_config.{field}"), expected, got)
}

fn unsupported(field: &str, value: &dyn std::fmt::Display, what: &str) -> KylinError {
    KylinError::operator_unsupported(format!("config.json quantization_config.{field} is {value}; {what}"))
}

fn get_u64(obj: &Map<String, Value>, path: &str, name: &str) -> Result<Option<u64>> {
    match get(obj, name) {
        None => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| bad(&format!("{path}{name}"), "a non-negative integer", v)),
    }
}

fn get_i64(obj: &Map<String, Value>, path: &str, name: &str) -> Result<Option<i64>> {
    match get(obj, name) {
        None => Ok(None),
        Some(v) => v.as_i64().map(Some).ok_or_else(|| bad(&format!("{path}{name}"), "an integer", v)),
    }
}

fn get_bool(obj: &Map<String, Value>, path: &str, name: &str) -> Result<Option<bool>> {
    match get(obj, name) {
        None => Ok(None),
        Some(v) => v.as_bool().map(Some).ok_or_else(|| bad(&format!("{path}{name}"), "true or false", v)),
    }
}

fn get_str<'a>(obj: &'a Map<String, Value>, path: &str, name: &str) -> Result<Option<&'a str>> {
    match get(obj, name) {
        None => Ok(None),
        Some(v) => v.as_str().map(Some).ok_or_else(|| bad(&format!("{path}{name}"), "a string", v)),
    }
}

fn get_strings(obj: &Map<String, Value>, path: &str, name: &str) -> Result<Vec<String>> {
    match get(obj, name) {
        None => Ok(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_str().map(str::to_string).ok_or_else(|| bad(&format!("{path}{name}"), "a list of strings", v))
            })
            .collect(),
        Some(v) => Err(bad(&format!("{path}{name}"), "a list of strings", v)),
    }
}

/// The largest group size or block side accepted (a bound on what a config can make Kylin
/// allocate or loop over before the tensors are checked).
const MAX_GROUP: u64 = 1 << 20;

fn group_size(v: Option<i64>, path: &str) -> Result<Option<usize>> {
    match v {
        None | Some(-1) => Ok(None),
        Some(g) if g > 0 && g as u64 <= MAX_GROUP && (g % 32 == 0) => Ok(Some(g as usize)),
        Some(g) => Err(unsupported(
            path,
            &g,
            "Kylin runs groups of a multiple of 32 columns (up to 2^20), or -1 for one group per row",
        )),
    }
}

/// Decides compressed-tensors' `input_activations` (at `path`): 8-bit integers or FP8 E4M3,
/// dynamic per token, per group or per tensor, or static per tensor.
fn input_activations(a: &Map<String, Value>, path: &str) -> Result<ActivationScheme> {
    let kind = match (get_str(a, path, "type")?.unwrap_or("int"), get_u64(a, path, "num_bits")?.unwrap_or(8)) {
        ("int", 8) => ActivationType::Int8,
        ("float", 8) => ActivationType::Fp8E4M3,
        (kind, bits) => {
            return Err(unsupported(
                &format!("{path}type"),
                &format!("'{kind}' with num_bits {bits}"),
                "Kylin runs activations quantized to int8 or FP8 E4M3",
            ));
        }
    };
    let symmetric = get_bool(a, path, "symmetric")?.unwrap_or(true);
    let dynamic = match get(a, "dynamic") {
        None | Some(Value::Bool(false)) => false,
        Some(Value::Bool(true)) => true,
        Some(v) => {
            return Err(unsupported(
                &format!("{path}dynamic"),
                v,
                "Kylin runs dynamic (true) or static (false) activation scales",
            ));
        }
    };
    if let Some(v) = get(a, "scale_dtype").filter(|v| !v.is_null()) {
        return Err(unsupported(
            &format!("{path}scale_dtype"),
            v,
            "Kylin computes activation scales in float32, as the scheme does when scale_dtype is null",
        ));
    }
    let strategy = get_str(a, path, "strategy")?.unwrap_or("tensor");
    let scales = match (strategy, dynamic) {
        ("token", true) => ActivationScales::Token,
        ("group", true) => match get_i64(a, path, "group_size")? {
            Some(g) if g > 0 && g as u64 <= MAX_GROUP => ActivationScales::Group(g as usize),
            Some(g) => {
                return Err(unsupported(&format!("{path}group_size"), &g, "expected a group of 1 to 2^20 columns"));
            }
            None => {
                return Err(KylinError::config_invalid(format!(
                    "config.json quantization_config.{path}strategy is 'group' but group_size is missing"
                )));
            }
        },
        ("tensor", true) => ActivationScales::DynamicTensor,
        ("tensor", false) => ActivationScales::Static,
        (other, dynamic) => {
            return Err(unsupported(
                &format!("{path}strategy"),
                &format!("'{other}' ({})", if dynamic { "dynamic" } else { "static" }),
                "Kylin runs activations quantized per token, per group or per tensor when dynamic, per tensor when static",
            ));
        }
    };
    if !symmetric && (kind == ActivationType::Fp8E4M3 || scales == ActivationScales::Static) {
        return Err(unsupported(
            &format!("{path}symmetric"),
            &false,
            "Kylin runs asymmetric activations only as dynamic int8 (no stored zero points)",
        ));
    }
    Ok(ActivationScheme { kind, scales, symmetric })
}

impl PublishedQuantization {
    /// Decides a `quantization_config` whose `quant_method` is `method` (one of
    /// `compressed-tensors`, `fp8`, `gptq`, `awq`); `None` for any other method.
    pub fn parse(method: &str, q: &Map<String, Value>) -> Result<Option<Self>> {
        let parsed = match method {
            "compressed-tensors" => Self::compressed_tensors(q)?,
            "fp8" => Self::fine_grained_fp8(q)?,
            "gptq" => Self::gptq(q)?,
            "awq" => Self::awq(q)?,
            "mxfp4" => PublishedQuantization {
                method: PublishedMethod::Mxfp4,
                scheme: Scheme::Mxfp4,
                ignore: get_strings(q, "", "modules_to_not_convert")?,
                matcher: IgnoreRule::Substring,
                input: None,
                int8_activations: false,
            },
            _ => return Ok(None),
        };
        Ok(Some(parsed))
    }

    fn compressed_tensors(q: &Map<String, Value>) -> Result<Self> {
        let groups = match get(q, "config_groups") {
            Some(Value::Object(groups)) => groups,
            Some(v) => return Err(bad("config_groups", "an object", v)),
            None => return Err(KylinError::config_invalid("config.json quantization_config has no 'config_groups'")),
        };
        if let Some(Value::Object(sparsity)) = get(q, "sparsity_config")
            && !sparsity.is_empty()
        {
            return Err(unsupported("sparsity_config", &"set", "Kylin runs dense compressed-tensors checkpoints only"));
        }
        if let Some(v) = get(q, "kv_cache_scheme") {
            return Err(unsupported(
                "kv_cache_scheme",
                v,
                "Kylin keeps its own KV cache (--kv-dtype) and reads no stored KV scales",
            ));
        }
        if let Some(Value::Object(t)) = get(q, "transform_config")
            && !t.is_empty()
        {
            return Err(unsupported("transform_config", &"set", "Kylin runs no rotation transforms"));
        }
        let mut entries = groups.iter();
        let (name, group) = match (entries.next(), entries.next()) {
            (Some((name, Value::Object(group))), None) => (name, group),
            (Some((name, v)), None) => return Err(bad(&format!("config_groups.{name}"), "an object", v)),
            (None, _) => {
                return Err(KylinError::config_invalid("config.json quantization_config.config_groups is empty"));
            }
            (Some(_), Some(_)) => {
                return Err(unsupported(
                    "config_groups",
                    &format!("{} groups", groups.len()),
                    "Kylin runs checkpoints with one scheme for every quantized module",
                ));
            }
        };
        let path = format!("config_groups.{name}.");
        let targets = get_strings(group, &path, "targets")?;
        if targets.iter().any(|t| t != "Linear") {
            return Err(unsupported(
                &format!("{path}targets"),
                &format!("{targets:?}"),
                "Kylin runs schemes that target every Linear module (with 'ignore' for the exceptions)",
            ));
        }
        let weights = match get(group, "weights") {
            Some(Value::Object(w)) => w,
            Some(v) => return Err(bad(&format!("{path}weights"), "an object", v)),
            None => {
                return Err(unsupported(
                    &format!("{path}weights"),
                    &"missing",
                    "Kylin runs weight-quantized checkpoints",
                ));
            }
        };
        let wpath = format!("{path}weights.");
        let format = get_str(group, &path, "format")?.or(get_str(q, "", "format")?).unwrap_or("");
        let kind = get_str(weights, &wpath, "type")?.unwrap_or("int");
        let bits = get_u64(weights, &wpath, "num_bits")?.unwrap_or(8);
        let symmetric = get_bool(weights, &wpath, "symmetric")?.unwrap_or(true);
        let strategy = get_str(weights, &wpath, "strategy")?.unwrap_or("tensor");
        let group_size = group_size(get_i64(weights, &wpath, "group_size")?, &format!("{wpath}group_size"))?;
        if get_bool(weights, &wpath, "dynamic")?.unwrap_or(false) {
            return Err(unsupported(&format!("{wpath}dynamic"), &true, "Kylin runs weights quantized ahead of time"));
        }
        let actorder = match get(weights, "actorder") {
            None | Some(Value::Bool(false)) => false,
            Some(Value::String(s)) if s == "weight" || s == "group" => true,
            Some(Value::Bool(true)) => true,
            Some(v) => return Err(bad(&format!("{wpath}actorder"), "null, \"group\" or \"weight\"", v)),
        };
        let input = match get(group, "input_activations") {
            None | Some(Value::Null) => None,
            Some(Value::Object(a)) => Some(input_activations(a, &format!("{path}input_activations."))?),
            Some(v) => return Err(bad(&format!("{path}input_activations"), "an object or null", v)),
        };
        match get(group, "output_activations") {
            None | Some(Value::Null) => {}
            Some(v) => {
                return Err(unsupported(
                    &format!("{path}output_activations"),
                    v,
                    "Kylin quantizes a layer's input as the scheme says, never its output",
                ));
            }
        }
        let int8_activations = input.is_some_and(|a| a.kind == ActivationType::Int8);
        let grouped = |what: &str| -> Result<Option<usize>> {
            match strategy {
                "channel" => Ok(None),
                "group" => group_size.map(Some).ok_or_else(|| {
                    KylinError::config_invalid(format!(
                        "config.json quantization_config.{wpath}strategy is 'group' but group_size is missing ({what})"
                    ))
                }),
                other => Err(unsupported(
                    &format!("{wpath}strategy"),
                    &format!("'{other}'"),
                    &format!("Kylin runs {what} with strategy 'channel' or 'group'"),
                )),
            }
        };
        let scheme = match (format, kind) {
            ("int-quantized", "int") => {
                if bits != 8 {
                    return Err(unsupported(
                        &format!("{wpath}num_bits"),
                        &bits,
                        "int-quantized checkpoints hold 8-bit integers",
                    ));
                }
                if !symmetric {
                    return Err(unsupported(
                        &format!("{wpath}symmetric"),
                        &false,
                        "Kylin runs symmetric int-quantized weights",
                    ));
                }
                Scheme::Int {
                    bits: 8,
                    group: grouped("int-quantized weights")?,
                    symmetric,
                    actorder,
                    packing: IntPacking::CtInt8,
                }
            }
            ("pack-quantized", "int") => {
                if bits != 4 && bits != 8 {
                    return Err(unsupported(
                        &format!("{wpath}num_bits"),
                        &bits,
                        "Kylin runs 4- and 8-bit pack-quantized weights",
                    ));
                }
                Scheme::Int {
                    bits: bits as u32,
                    group: grouped("pack-quantized weights")?,
                    symmetric,
                    actorder,
                    packing: IntPacking::CtPacked,
                }
            }
            ("float-quantized" | "naive-quantized", "float") => {
                if bits != 8 {
                    return Err(unsupported(
                        &format!("{wpath}num_bits"),
                        &bits,
                        "Kylin runs 8-bit (E4M3) float weights",
                    ));
                }
                if !symmetric {
                    return Err(unsupported(&format!("{wpath}symmetric"), &false, "Kylin runs symmetric FP8 weights"));
                }
                let scales = match strategy {
                    "tensor" => Fp8Scales::Tensor,
                    "channel" => Fp8Scales::Channel,
                    "group" => Fp8Scales::Group(grouped("FP8 weights")?.unwrap_or(0)),
                    "block" => {
                        let block = match get(weights, "block_structure") {
                            Some(Value::Array(b)) if b.len() == 2 => b,
                            Some(v) => {
                                return Err(bad(&format!("{wpath}block_structure"), "a list of two integers", v));
                            }
                            None => {
                                return Err(KylinError::config_invalid(format!(
                                    "config.json quantization_config.{wpath}strategy is 'block' but block_structure is missing"
                                )));
                            }
                        };
                        let side = |v: &Value| {
                            v.as_u64()
                                .filter(|&s| s > 0 && s <= MAX_GROUP)
                                .map(|s| s as usize)
                                .ok_or_else(|| bad(&format!("{wpath}block_structure"), "two integers in 1..=2^20", v))
                        };
                        Fp8Scales::Block(side(&block[0])?, side(&block[1])?)
                    }
                    other => {
                        return Err(unsupported(
                            &format!("{wpath}strategy"),
                            &format!("'{other}'"),
                            "Kylin runs FP8 weights with strategy tensor, channel, group or block",
                        ));
                    }
                };
                Scheme::Float8 { scales, inverse_name: false }
            }
            (format, kind) => {
                return Err(unsupported(
                    "format",
                    &format!("'{format}' with weights of type '{kind}'"),
                    "Kylin runs compressed-tensors 'int-quantized', 'pack-quantized' (int) and 'float-quantized' (float) checkpoints",
                ));
            }
        };
        Ok(PublishedQuantization {
            method: PublishedMethod::CompressedTensors,
            scheme,
            ignore: get_strings(q, "", "ignore")?,
            matcher: IgnoreRule::CompressedTensors,
            input,
            int8_activations,
        })
    }

    fn fine_grained_fp8(q: &Map<String, Value>) -> Result<Self> {
        let block = match get(q, "weight_block_size") {
            Some(Value::Array(b)) if b.len() == 2 => {
                let side = |v: &Value| {
                    v.as_u64()
                        .filter(|&s| s > 0 && s <= MAX_GROUP)
                        .map(|s| s as usize)
                        .ok_or_else(|| bad("weight_block_size", "two integers in 1..=2^20", v))
                };
                (side(&b[0])?, side(&b[1])?)
            }
            Some(v) => return Err(bad("weight_block_size", "a list of two integers", v)),
            None => {
                return Err(unsupported(
                    "weight_block_size",
                    &"missing",
                    "Kylin runs fine-grained FP8 (per-block weight_scale_inv); per-tensor FP8 is not supported",
                ));
            }
        };
        if let Some(fmt) = get_str(q, "", "fmt")?
            && fmt != "e4m3"
        {
            return Err(unsupported("fmt", &format!("'{fmt}'"), "Kylin runs E4M3 FP8 weights"));
        }
        // transformers' `FP8Linear` quantizes each token's input to FP8 E4M3 per group of the
        // block's width (`amax / 448` per group) before its FP8 product; `static` would read a
        // stored per-tensor scale instead.
        match get_str(q, "", "activation_scheme")?.unwrap_or("dynamic") {
            "dynamic" => {}
            other => {
                return Err(unsupported(
                    "activation_scheme",
                    &format!("'{other}'"),
                    "Kylin runs fine-grained FP8 with dynamic activation scales",
                ));
            }
        }
        Ok(PublishedQuantization {
            method: PublishedMethod::Fp8,
            scheme: Scheme::Float8 { scales: Fp8Scales::Block(block.0, block.1), inverse_name: true },
            ignore: with_head(get_strings(q, "", "modules_to_not_convert")?),
            matcher: IgnoreRule::Substring,
            input: Some(ActivationScheme {
                kind: ActivationType::Fp8E4M3,
                scales: ActivationScales::Group(block.1),
                symmetric: true,
            }),
            int8_activations: false,
        })
    }

    fn gptq(q: &Map<String, Value>) -> Result<Self> {
        let bits = get_u64(q, "", "bits")?
            .ok_or_else(|| KylinError::config_invalid("config.json quantization_config has no 'bits'"))?;
        if bits != 4 && bits != 8 {
            return Err(unsupported("bits", &bits, "Kylin runs 4- and 8-bit GPTQ checkpoints"));
        }
        let group = group_size(get_i64(q, "", "group_size")?, "group_size")?;
        let v1 = match get_str(q, "", "checkpoint_format")?.unwrap_or("gptq") {
            "gptq" => true,
            "gptq_v2" => false,
            other => {
                return Err(unsupported(
                    "checkpoint_format",
                    &format!("'{other}'"),
                    "Kylin runs GPTQ checkpoint formats 'gptq' (v1) and 'gptq_v2'",
                ));
            }
        };
        let ignore =
            if get_bool(q, "", "lm_head")?.unwrap_or(false) { Vec::new() } else { vec!["lm_head".to_string()] };
        let mut ignore = ignore;
        ignore.extend(get_strings(q, "", "modules_to_not_convert")?);
        Ok(PublishedQuantization {
            method: PublishedMethod::Gptq,
            scheme: Scheme::Int {
                bits: bits as u32,
                group,
                symmetric: get_bool(q, "", "sym")?.unwrap_or(true),
                actorder: get_bool(q, "", "desc_act")?.unwrap_or(false),
                packing: IntPacking::Gptq { v1 },
            },
            ignore,
            matcher: IgnoreRule::Substring,
            input: None,
            int8_activations: false,
        })
    }

    fn awq(q: &Map<String, Value>) -> Result<Self> {
        let bits = get_u64(q, "", "bits")?.or(get_u64(q, "", "w_bit")?).unwrap_or(4);
        if bits != 4 {
            return Err(unsupported("bits", &bits, "Kylin runs 4-bit AWQ checkpoints"));
        }
        let version = get_str(q, "", "version")?.unwrap_or("gemm").to_ascii_lowercase();
        if version != "gemm" {
            return Err(unsupported("version", &format!("'{version}'"), "Kylin runs AWQ's GEMM packing"));
        }
        let group_field = if get(q, "group_size").is_some() { "group_size" } else { "q_group_size" };
        let group = group_size(get_i64(q, "", group_field)?, group_field)?;
        let zero_point = get_bool(q, "", "zero_point")?.unwrap_or(true);
        Ok(PublishedQuantization {
            method: PublishedMethod::Awq,
            scheme: Scheme::Int { bits: 4, group, symmetric: !zero_point, actorder: false, packing: IntPacking::Awq },
            ignore: with_head(get_strings(q, "", "modules_to_not_convert")?),
            matcher: IgnoreRule::Substring,
            input: None,
            int8_activations: false,
        })
    }

    /// Whether `module` (`model.layers.0.mlp.down_proj`, `lm_head`) stays unquantized.
    pub fn ignores(&self, module: &str) -> bool {
        self.ignore.iter().any(|entry| match self.matcher {
            IgnoreRule::Substring => module.contains(entry.as_str()),
            IgnoreRule::CompressedTensors => match entry.strip_prefix("re:") {
                Some(pattern) => regex_match_start(pattern, module),
                None => entry == module || entry == "Linear",
            },
        })
    }

    /// One line for `inspect` and the logs: method, bits, group size, unquantized modules.
    pub fn describe(&self) -> String {
        let scheme = match &self.scheme {
            Scheme::Int { bits, group, symmetric, actorder, packing } => format!(
                "int{bits} weights ({}), {}, {}{}",
                match packing {
                    IntPacking::CtInt8 => "int-quantized".to_string(),
                    IntPacking::CtPacked => "pack-quantized".to_string(),
                    IntPacking::Gptq { v1 } => format!("gptq {}", if *v1 { "v1" } else { "v2" }),
                    IntPacking::Awq => "awq gemm".to_string(),
                },
                group.map_or("one scale per output channel".to_string(), |g| format!("groups of {g}")),
                if *symmetric { "symmetric" } else { "asymmetric (zero points)" },
                if *actorder { ", activation order (g_idx)" } else { "" }
            ),
            Scheme::Mxfp4 => "mxfp4 experts (fp4 e2m1, e8m0 scale per 32)".to_string(),
            Scheme::Float8 { scales, .. } => format!(
                "fp8 e4m3 weights, scales {}",
                match scales {
                    Fp8Scales::Tensor => "per tensor".to_string(),
                    Fp8Scales::Channel => "per output channel".to_string(),
                    Fp8Scales::Group(g) => format!("per group of {g}"),
                    Fp8Scales::Block(r, c) => format!("per {r} x {c} block"),
                }
            ),
        };
        let ignore = if self.ignore.is_empty() {
            "every linear layer quantized".to_string()
        } else {
            format!("unquantized: {}", self.ignore.join(", "))
        };
        let activations = self.input.as_ref().map_or(String::new(), |a| format!("; activations: {}", a.describe()));
        format!("{}: {scheme}; {ignore}{activations}", self.method.name())
    }

    /// Bits per stored weight value (for reports).
    pub fn bits(&self) -> u32 {
        match &self.scheme {
            Scheme::Int { bits, .. } => *bits,
            Scheme::Float8 { .. } => 8,
            Scheme::Mxfp4 => 4,
        }
    }

    /// Whether the checkpoint quantizes 2-D linear layers (matrix by matrix); MXFP4
    /// quantizes only the stacked experts, which bind through their own table entries.
    pub fn quantizes_linear_layers(&self) -> bool {
        self.scheme != Scheme::Mxfp4
    }
}

/// Python's `re.match(pattern, text)` for the patterns compressed-tensors configs use:
/// anchored at the start, not at the end.
/// `modules_to_not_convert` of transformers' FP8 and AWQ quantizers, which never quantize the
/// head (the output embedding is among their default skips; AutoAWQ and Qwen's FP8 releases keep
/// `lm_head` in the model's dtype).
fn with_head(mut ignore: Vec<String>) -> Vec<String> {
    if !ignore.iter().any(|m| "lm_head".contains(m.as_str()) && !m.is_empty()) {
        ignore.insert(0, "lm_head".to_string());
    }
    ignore
}

fn regex_match_start(pattern: &str, text: &str) -> bool {
    // An invalid pattern matches nothing (compressed-tensors would raise; the module is then
    // treated as quantized, and a missing tensor names it).
    regex::Regex::new(&format!("^(?:{pattern})")).is_ok_and(|re| re.is_match(text))
}

/// A quantized matrix's tensors, checked against its config and shape.
#[derive(Debug, Clone)]
pub struct PublishedMatrix {
    /// The module (`model.layers.0.self_attn.q_proj`).
    pub module: String,
    pub rows: usize,
    pub cols: usize,
    pub scheme: Scheme,
    /// The integers or FP8 values (`weight`, `weight_packed`, `qweight`).
    pub values: WeightTensor,
    /// `weight_scale`, `weight_scale_inv` or `scales`.
    pub scale: WeightTensor,
    pub zero: Option<WeightTensor>,
    pub g_idx: Option<WeightTensor>,
    /// compressed-tensors' `weight_shape`.
    pub shape: Option<WeightTensor>,
    /// [`PublishedQuantization::int8_activations`].
    pub int8_activations: bool,
    /// How the scheme quantizes this layer's input ([`PublishedQuantization::input`]).
    pub input: Option<ActivationScheme>,
    /// The stored input scale of a static scheme (`X.input_scale`, `[1]`).
    pub input_scale: Option<WeightTensor>,
}

/// A problem with one tensor, sorted by [`bind_matrix`]'s caller into the error of its kind.
#[derive(Debug)]
pub enum BindProblem {
    Missing(String),
    Shape(String),
    DType(String),
}

fn shape_text(shape: &[usize]) -> String {
    format!("[{}]", shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "))
}

/// Finds and checks the tensors of the quantized matrix `module` (`[rows, cols]`); `used`
/// receives every tensor name read.
pub(crate) fn bind_matrix(
    q: &PublishedQuantization,
    index: &TensorIndex,
    module: &str,
    rows: usize,
    cols: usize,
    used: &mut Vec<String>,
) -> std::result::Result<PublishedMatrix, BindProblem> {
    let what = format!(
        "{} {}",
        q.method.name(),
        match q.scheme {
            Scheme::Int { bits, .. } => format!("int{bits}"),
            Scheme::Float8 { .. } => "fp8".to_string(),
            Scheme::Mxfp4 => "mxfp4".to_string(),
        }
    );
    let mut fetch =
        |suffix: &str, shape: &[usize], dtypes: &[DType]| -> std::result::Result<WeightTensor, BindProblem> {
            let name = format!("{module}.{suffix}");
            let Some(raw) = index.raw(&name) else {
                return Err(BindProblem::Missing(name));
            };
            used.push(name.clone());
            if raw.shape != shape {
                return Err(BindProblem::Shape(format!(
                    "tensor '{name}' has shape {}; expected {} ({what} of a [{rows}, {cols}] matrix)",
                    shape_text(&raw.shape),
                    shape_text(shape)
                )));
            }
            match (raw.dtype, index.view(&name)) {
                (Some(dt), Some(view)) if dtypes.contains(&dt) => Ok(view),
                _ => Err(BindProblem::DType(format!(
                    "tensor '{name}' is stored as {}; {what} stores it as {}",
                    raw.dtype_name,
                    dtypes.iter().map(|d| d.as_str()).collect::<Vec<_>>().join(" or ")
                ))),
            }
        };
    const FLOATS: &[DType] = &[DType::BF16, DType::F16, DType::F32];
    let divides = |unit: usize, n: usize, what: &str| -> std::result::Result<usize, BindProblem> {
        if unit == 0 || !n.is_multiple_of(unit) {
            return Err(BindProblem::Shape(format!(
                "module '{module}': its [{rows}, {cols}] matrix's {what} ({n}) is not a multiple of {unit}, as {} needs",
                q.method.name()
            )));
        }
        Ok(n / unit)
    };
    let scheme = q.scheme.clone();
    if scheme == Scheme::Mxfp4 {
        // MXFP4 quantizes stacked experts only; they bind through their own table entries.
        return Err(BindProblem::Missing(format!("{module} (an MXFP4 checkpoint quantizes only its experts)")));
    }
    let (values, scale, zero, g_idx, shape) = match &scheme {
        Scheme::Int { bits, group, symmetric, actorder, packing } => {
            let bits = *bits as usize;
            let per_word = 32 / bits;
            let group_cols = group.unwrap_or(cols);
            let groups = divides(group_cols, cols, "columns")?;
            match packing {
                IntPacking::CtInt8 => {
                    let values = fetch("weight", &[rows, cols], &[DType::I8])?;
                    let scale = fetch("weight_scale", &[rows, groups], FLOATS)?;
                    (values, scale, None, None, None)
                }
                IntPacking::CtPacked => {
                    let words = divides(per_word, cols, "columns")?;
                    let values = fetch("weight_packed", &[rows, words], &[DType::I32])?;
                    let scale = fetch("weight_scale", &[rows, groups], FLOATS)?;
                    let shape = fetch("weight_shape", &[2], &[DType::I64, DType::I32])?;
                    let zero = if *symmetric {
                        None
                    } else {
                        let packed_rows = divides(per_word, rows, "rows")?;
                        Some(fetch("weight_zero_point", &[packed_rows, groups], &[DType::I32])?)
                    };
                    let g_idx = if *actorder { Some(fetch("weight_g_idx", &[cols], &[DType::I32])?) } else { None };
                    (values, scale, zero, g_idx, Some(shape))
                }
                IntPacking::Gptq { .. } => {
                    let packed_cols = divides(per_word, cols, "columns")?;
                    let packed_rows = divides(per_word, rows, "rows")?;
                    let values = fetch("qweight", &[packed_cols, rows], &[DType::I32])?;
                    let zero = fetch("qzeros", &[groups, packed_rows], &[DType::I32])?;
                    let scale = fetch("scales", &[groups, rows], FLOATS)?;
                    // GPTQ writes `g_idx` whether or not `desc_act` is set.
                    let g_idx = match index.raw(&format!("{module}.g_idx")) {
                        Some(_) => Some(fetch("g_idx", &[cols], &[DType::I32])?),
                        None if *actorder => return Err(BindProblem::Missing(format!("{module}.g_idx"))),
                        None => None,
                    };
                    (values, scale, Some(zero), g_idx, None)
                }
                IntPacking::Awq => {
                    let packed_rows = divides(8, rows, "rows")?;
                    let values = fetch("qweight", &[cols, packed_rows], &[DType::I32])?;
                    let zero = fetch("qzeros", &[groups, packed_rows], &[DType::I32])?;
                    let scale = fetch("scales", &[groups, rows], FLOATS)?;
                    (values, scale, Some(zero), None, None)
                }
            }
        }
        Scheme::Float8 { scales, inverse_name } => {
            let values = fetch("weight", &[rows, cols], &[DType::F8E4M3])?;
            let scale_shape = match *scales {
                // compressed-tensors writes a per-tensor scale as `[1]`; a scalar `[]` is refused.
                Fp8Scales::Tensor => vec![1],
                Fp8Scales::Channel => vec![rows, 1],
                Fp8Scales::Group(g) => vec![rows, divides(g, cols, "columns")?],
                Fp8Scales::Block(br, bc) => vec![rows.div_ceil(br), cols.div_ceil(bc)],
            };
            let name = if *inverse_name { "weight_scale_inv" } else { "weight_scale" };
            let scale = fetch(name, &scale_shape, FLOATS)?;
            (values, scale, None, None, None)
        }
        Scheme::Mxfp4 => unreachable!("returned above"),
    };
    let input_scale = match q.input {
        Some(ActivationScheme { scales: ActivationScales::Static, .. }) => Some(fetch("input_scale", &[1], FLOATS)?),
        _ => None,
    };
    Ok(PublishedMatrix {
        module: module.to_string(),
        rows,
        cols,
        scheme,
        values,
        scale,
        zero,
        g_idx,
        shape,
        int8_activations: q.int8_activations,
        input: q.input,
        input_scale,
    })
}

/// An integer matrix decoded: `w[r][c] = scale[r·groups + g] · (code[r·cols + c] − zero[r·groups + g])`
/// with `g = group_of(c)`.
#[derive(Debug, Clone)]
pub struct IntMatrix {
    pub bits: u32,
    pub rows: usize,
    pub cols: usize,
    /// Groups per row.
    pub groups: usize,
    /// Unsigned codes, `0..2^bits`, row-major `[rows, cols]`.
    pub codes: Vec<u8>,
    /// Row-major `[rows, groups]`.
    pub scales: Vec<f32>,
    /// Row-major `[rows, groups]`, in code units (`2^(bits−1)` for a symmetric scheme).
    pub zeros: Vec<i32>,
    /// The group of every column: `None` when it is `column / (cols / groups)`.
    pub group_of: Option<Vec<u32>>,
}

impl IntMatrix {
    /// Column `c`'s group.
    #[inline]
    pub fn group(&self, c: usize) -> usize {
        match &self.group_of {
            Some(g) => g[c] as usize,
            None => c / (self.cols / self.groups),
        }
    }

    /// The weights in f32, exactly: `(code − zero) · scale` (an integer of at most 9 bits
    /// times a BF16, F16 or F32 scale, as the producers' dequantization computes it).
    pub fn dequantize_into(&self, out: &mut [f32]) {
        let (cols, groups) = (self.cols, self.groups);
        assert_eq!(out.len(), self.rows * cols);
        if cols == 0 || groups == 0 {
            return;
        }
        // Row by row, and without a division per weight: along whole groups of columns when
        // they are consecutive, else through each column's group.
        let rows = out.chunks_exact_mut(cols).zip(self.codes.chunks_exact(cols));
        for (r, (out, codes)) in rows.enumerate() {
            let (zeros, scales) =
                (&self.zeros[r * groups..(r + 1) * groups], &self.scales[r * groups..(r + 1) * groups]);
            let value = |code: u8, g: usize| (code as i32 - zeros[g]) as f32 * scales[g];
            match &self.group_of {
                Some(group_of) => {
                    for ((o, &code), &g) in out.iter_mut().zip(codes).zip(group_of) {
                        *o = value(code, g as usize);
                    }
                }
                None => {
                    let span = (cols / groups).max(1);
                    for (g, (out, codes)) in out.chunks_mut(span).zip(codes.chunks(span)).enumerate() {
                        for (o, &code) in out.iter_mut().zip(codes) {
                            *o = value(code, g);
                        }
                    }
                }
            }
        }
    }
}

fn words_i32(t: &WeightTensor) -> impl Iterator<Item = u32> + '_ {
    t.bytes().chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// The values of a BF16, F16 or F32 tensor as f32.
pub fn floats(t: &WeightTensor) -> Vec<f32> {
    let b = t.bytes();
    match t.dtype {
        DType::BF16 => b.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        DType::F16 => b.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        DType::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        // Scales were bound as floats only.
        _ => Vec::new(),
    }
}

/// FP8 E4M3 (`float8_e4m3fn`: no infinities, `S.1111.111` is NaN) to f32, exactly, in
/// operations that vectorize: with E4M3's sign, exponent and mantissa fields placed at f32's,
/// the bits are the value times 2^−120 (a normal f32 for a normal code, a denormal one for a
/// subnormal code: `m · 2^−9` is `m · 2^20 · 2^−149`), and the product by 2^120 is exact.
#[inline]
pub fn fp8_e4m3_to_f32(b: u8) -> f32 {
    let code = b as u32;
    let value = f32::from_bits(((code & 0x80) << 24) | ((code & 0x7F) << 20)) * f32::from_bits((127 + 120) << 23);
    if code & 0x7F == 0x7F { f32::NAN } else { value }
}

impl Fp8Scales {
    /// Row `r`'s stored scales among `s` (the scale tensor, whose shape was checked against
    /// the layout when the matrix was bound) and how many consecutive columns each covers
    /// (the last may cover fewer, where a block of columns is cut short).
    fn row(self, s: &[f32], r: usize, cols: usize) -> (&[f32], usize) {
        match self {
            Fp8Scales::Tensor => (&s[..1], cols),
            Fp8Scales::Channel => (&s[r..r + 1], cols),
            Fp8Scales::Group(g) => (&s[r * (cols / g)..(r + 1) * (cols / g)], g),
            Fp8Scales::Block(br, bc) => {
                let per_row = cols.div_ceil(bc);
                (&s[(r / br) * per_row..(r / br + 1) * per_row], bc)
            }
        }
    }
}

impl PublishedMatrix {
    /// The integers, scales and zero points of an integer scheme; `None` for FP8.
    /// `FILE_CORRUPTED` for a value the shapes could not rule out (a group index out of
    /// range), `TENSOR_SHAPE_MISMATCH` for a `weight_shape` that is not `[rows, cols]`.
    pub fn integers(&self) -> Result<Option<IntMatrix>> {
        let Scheme::Int { bits, group, symmetric, packing, .. } = &self.scheme else { return Ok(None) };
        let (rows, cols, bits) = (self.rows, self.cols, *bits);
        let groups = cols / group.unwrap_or(cols);
        let per_word = (32 / bits) as usize;
        let mask = (1u32 << bits) - 1;
        let offset = 1i32 << (bits - 1);
        let mut codes = vec![0u8; rows * cols];
        let mut zeros = vec![offset; rows * groups];
        // `scales` is `[rows, groups]` for compressed-tensors and `[groups, rows]` for GPTQ / AWQ.
        let stored_scales = floats(&self.scale);
        let scales: Vec<f32> = match packing {
            IntPacking::Gptq { .. } | IntPacking::Awq => {
                (0..rows * groups).map(|i| stored_scales[(i % groups) * rows + i / groups]).collect()
            }
            _ => stored_scales,
        };
        if let Some(shape) = &self.shape {
            let b = shape.bytes();
            let dims: Vec<i64> = match shape.dtype {
                DType::I64 => b.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect(),
                _ => b.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64).collect(),
            };
            if dims != [rows as i64, cols as i64] {
                return Err(KylinError::tensor_shape_mismatch(format!(
                    "tensor '{}' says the matrix is {dims:?}; the model's config implies [{rows}, {cols}]",
                    shape.name
                )));
            }
        }
        match packing {
            IntPacking::CtInt8 => {
                for (code, &b) in codes.iter_mut().zip(self.values.bytes()) {
                    *code = (b as i8 as i32 + 128) as u8;
                }
                zeros.fill(128);
            }
            IntPacking::CtPacked => {
                let words: Vec<u32> = words_i32(&self.values).collect();
                let words_per_row = cols / per_word;
                for r in 0..rows {
                    for c in 0..cols {
                        let w = words[r * words_per_row + c / per_word];
                        codes[r * cols + c] = ((w >> (bits as usize * (c % per_word))) & mask) as u8;
                    }
                }
                if let (false, Some(z)) = (*symmetric, &self.zero) {
                    // `[rows / per_word, groups]`, packed along the rows.
                    let zw: Vec<u32> = words_i32(z).collect();
                    for r in 0..rows {
                        for g in 0..groups {
                            let w = zw[(r / per_word) * groups + g];
                            zeros[r * groups + g] = ((w >> (bits as usize * (r % per_word))) & mask) as i32;
                        }
                    }
                }
            }
            IntPacking::Gptq { v1 } => {
                // `qweight [cols / per_word, rows]`: input `c` in bits `bits · (c mod per_word)`.
                let words: Vec<u32> = words_i32(&self.values).collect();
                for c in 0..cols {
                    for r in 0..rows {
                        let w = words[(c / per_word) * rows + r];
                        codes[r * cols + c] = ((w >> (bits as usize * (c % per_word))) & mask) as u8;
                    }
                }
                if let Some(z) = &self.zero {
                    // `qzeros [groups, rows / per_word]`: output `r` in bits `bits · (r mod per_word)`.
                    let zw: Vec<u32> = words_i32(z).collect();
                    let packed_rows = rows / per_word;
                    for g in 0..groups {
                        for r in 0..rows {
                            let w = zw[g * packed_rows + r / per_word];
                            let stored = ((w >> (bits as usize * (r % per_word))) & mask) as i32;
                            zeros[r * groups + g] = if *v1 { stored + 1 } else { stored };
                        }
                    }
                }
            }
            IntPacking::Awq => {
                const ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];
                // Output `8w + ORDER[i]` sits in nibble `i` of word `w`: the nibble of output
                // `8w + k` is the `i` with `ORDER[i] == k`.
                let mut nibble_of = [0usize; 8];
                for (i, &k) in ORDER.iter().enumerate() {
                    nibble_of[k] = i;
                }
                let words: Vec<u32> = words_i32(&self.values).collect();
                let packed_rows = rows / 8;
                for c in 0..cols {
                    for r in 0..rows {
                        let w = words[c * packed_rows + r / 8];
                        codes[r * cols + c] = ((w >> (4 * nibble_of[r % 8])) & 0xF) as u8;
                    }
                }
                if let Some(z) = &self.zero {
                    let zw: Vec<u32> = words_i32(z).collect();
                    for g in 0..groups {
                        for r in 0..rows {
                            let w = zw[g * packed_rows + r / 8];
                            zeros[r * groups + g] = ((w >> (4 * nibble_of[r % 8])) & 0xF) as i32;
                        }
                    }
                }
                if *symmetric {
                    zeros.fill(offset);
                }
            }
        }
        let group_of = match &self.g_idx {
            None => None,
            Some(t) => {
                let idx: Vec<u32> = words_i32(t).collect();
                if let Some((c, &g)) = idx.iter().enumerate().find(|(_, g)| **g as usize >= groups) {
                    return Err(KylinError::file_corrupted(format!(
                        "tensor '{}' gives column {c} the group {}; the matrix has {groups} groups",
                        t.name, g as i32
                    )));
                }
                let trivial = idx.iter().enumerate().all(|(c, &g)| g as usize == c / (cols / groups));
                (!trivial).then_some(idx)
            }
        };
        Ok(Some(IntMatrix { bits, rows, cols, groups, codes, scales, zeros, group_of }))
    }

    /// An FP8 matrix's E4M3 codes (row-major `[rows, cols]`, as stored) and one scale per row
    /// and block of 32 columns (row-major `[rows, cols / 32]`), when its scales are that fine
    /// or coarser along whole blocks (per tensor, per channel, groups or blocks of a multiple
    /// of 32 columns); `Ok(None)` for an integer scheme or scales that split a block of 32.
    /// `FILE_CORRUPTED` for a NaN code (`0x7F`, `0xFF`), which no producer writes.
    pub fn fp8_codes(&self) -> Result<Option<(&[u8], Vec<f32>)>> {
        let Scheme::Float8 { scales, .. } = &self.scheme else { return Ok(None) };
        let (rows, cols) = (self.rows, self.cols);
        let whole = |g: usize| g.is_multiple_of(32);
        let aligned = cols.is_multiple_of(32)
            && match *scales {
                Fp8Scales::Tensor | Fp8Scales::Channel => true,
                Fp8Scales::Group(g) => whole(g),
                Fp8Scales::Block(_, bc) => whole(bc),
            };
        if !aligned {
            return Ok(None);
        }
        let codes = self.values.bytes();
        // A whole-slice test first (it vectorizes; `position` stops at each byte to ask).
        let nan = |b: u8| b & 0x7F == 0x7F;
        if codes.chunks(1 << 16).any(|chunk| chunk.iter().fold(false, |any, &b| any | nan(b)))
            && let Some(at) = codes.iter().position(|&b| nan(b))
        {
            return Err(KylinError::file_corrupted(format!(
                "tensor '{}': FP8 E4M3 value {} (row {}, column {}) is NaN",
                self.values.name,
                codes[at],
                at / cols,
                at % cols
            )));
        }
        let s = floats(&self.scale);
        let blocks = cols / 32;
        let mut block_scales = Vec::with_capacity(rows * blocks);
        for r in 0..rows {
            // Each stored scale covers whole blocks of 32 (`aligned`).
            let (row_scales, span) = scales.row(&s, r, cols);
            let per_scale = span / 32;
            for &scale in row_scales {
                // The last scale of a row may cover fewer blocks (a partial block of columns).
                let n = per_scale.min(blocks * (r + 1) - block_scales.len());
                block_scales.extend(std::iter::repeat_n(scale, n));
            }
        }
        Ok(Some((codes, block_scales)))
    }

    /// The weights in f32, row-major `[rows, cols]`, exactly as the producers dequantize them.
    pub fn dequantize(&self) -> Result<Vec<f32>> {
        let mut out = vec![0.0f32; self.rows * self.cols];
        if self.scheme == Scheme::Mxfp4 {
            // `fp4(code) · 2^(e - 127)`, exactly, as transformers dequantizes (255 is refused).
            const FP4: [f32; 16] =
                [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];
            let (blocks, scales) = (self.values.bytes(), self.scale.bytes());
            let nb = self.cols / 32;
            for r in 0..self.rows {
                for b in 0..nb {
                    let e = scales[r * nb + b];
                    if e == 255 {
                        return Err(KylinError::file_corrupted(format!(
                            "tensor '{}' row {r} block {b} has the E8M0 scale 255 (NaN)",
                            self.scale.name
                        )));
                    }
                    // 2^(e - 127): the float with that exponent field (e = 0 is the subnormal 2^-127).
                    let s = if e == 0 { f32::from_bits(0x0040_0000) } else { f32::from_bits((e as u32) << 23) };
                    for k in 0..32 {
                        let c = b * 32 + k;
                        let byte = blocks[r * self.cols / 2 + c / 2];
                        let code = if c % 2 == 0 { byte & 15 } else { byte >> 4 };
                        out[r * self.cols + c] = FP4[code as usize] * s;
                    }
                }
            }
            return Ok(out);
        }
        if let Some(ints) = self.integers()? {
            ints.dequantize_into(&mut out);
            return Ok(out);
        }
        let Scheme::Float8 { scales, .. } = &self.scheme else { return Ok(out) };
        let s = floats(&self.scale);
        let cols = self.cols;
        if cols == 0 {
            return Ok(out);
        }
        // Row by row, along the columns that share a scale, without a division per weight.
        for (r, (out, codes)) in out.chunks_exact_mut(cols).zip(self.values.bytes().chunks_exact(cols)).enumerate() {
            let (row_scales, span) = scales.row(&s, r, cols);
            for ((out, codes), &scale) in out.chunks_mut(span).zip(codes.chunks(span)).zip(row_scales) {
                for (o, &b) in out.iter_mut().zip(codes) {
                    *o = fp8_e4m3_to_f32(b) * scale;
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorCode;

    fn parse(method: &str, q: Value) -> Result<PublishedQuantization> {
        let Value::Object(q) = q else { panic!("an object") };
        PublishedQuantization::parse(method, &q).map(|p| p.expect("a published method"))
    }

    #[test]
    fn compressed_tensors_ignore_entries_match_by_name_or_regex_from_the_start() {
        let q = parse(
            "compressed-tensors",
            serde_json::json!({
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "ignore": ["lm_head", "re:.*mlp\\.down_proj$"],
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": 4, "type": "int", "symmetric": true, "strategy": "group", "group_size": 128}}}
            }),
        )
        .unwrap();
        assert!(q.ignores("lm_head"));
        assert!(q.ignores("model.layers.3.mlp.down_proj"));
        assert!(!q.ignores("model.layers.3.mlp.up_proj"));
        assert!(!q.ignores("model.lm_head_extra"), "a plain entry is an exact name");
        assert_eq!(q.bits(), 4);
    }

    #[test]
    fn fp8_and_awq_never_quantize_the_head_gptq_only_with_lm_head_true() {
        let fp8 = parse("fp8", serde_json::json!({"quant_method": "fp8", "weight_block_size": [128, 128]})).unwrap();
        assert!(fp8.ignores("lm_head") && !fp8.ignores("model.layers.0.self_attn.q_proj"));
        let awq =
            parse("awq", serde_json::json!({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}))
                .unwrap();
        assert!(awq.ignores("lm_head"));
        let gptq = |head: bool| {
            parse("gptq", serde_json::json!({"quant_method": "gptq", "bits": 8, "group_size": -1, "lm_head": head}))
                .unwrap()
        };
        assert!(gptq(false).ignores("lm_head"));
        assert!(!gptq(true).ignores("lm_head"));
        assert!(matches!(gptq(true).scheme, Scheme::Int { bits: 8, group: None, .. }), "group_size -1 is per channel");
    }

    fn ct_int8(input: Value) -> Result<PublishedQuantization> {
        parse(
            "compressed-tensors",
            serde_json::json!({
                "quant_method": "compressed-tensors",
                "format": "int-quantized",
                "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": input, "weights": {
                    "num_bits": 8, "type": "int", "symmetric": true, "strategy": "channel"}}}
            }),
        )
    }

    #[test]
    fn input_activations_are_decided_or_refused_naming_the_field() {
        let token = ct_int8(
            serde_json::json!({"num_bits": 8, "type": "int", "symmetric": true, "strategy": "token", "dynamic": true}),
        )
        .unwrap();
        let want = ActivationScheme { kind: ActivationType::Int8, scales: ActivationScales::Token, symmetric: true };
        assert_eq!(token.input, Some(want));
        assert!(token.int8_activations);
        assert!(token.describe().contains("int8 per token, dynamic"), "{}", token.describe());
        let fp8 = |v: Value| {
            ct_int8(
                serde_json::json!({"num_bits": 8, "type": "float", "symmetric": true, "strategy": "group", "group_size": 128, "dynamic": v}),
            )
        };
        let group = fp8(Value::Bool(true)).unwrap();
        assert_eq!(group.input.map(|a| a.scales), Some(ActivationScales::Group(128)));
        assert!(!group.int8_activations);
        let err = fp8(Value::from("local")).unwrap_err();
        assert_eq!(err.code, ErrorCode::OperatorUnsupported);
        assert!(err.message.contains("input_activations.dynamic"), "{err}");
        let stat =
            ct_int8(serde_json::json!({"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": false})).unwrap();
        assert_eq!(stat.input.map(|a| a.scales), Some(ActivationScales::Static));
        let per_tensor =
            ct_int8(serde_json::json!({"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": true})).unwrap();
        assert_eq!(per_tensor.input.map(|a| a.scales), Some(ActivationScales::DynamicTensor));
        for (input, field) in [
            (serde_json::json!({"num_bits": 4, "type": "int", "strategy": "token", "dynamic": true}), "type"),
            (serde_json::json!({"num_bits": 8, "type": "int", "strategy": "channel", "dynamic": false}), "strategy"),
            (
                serde_json::json!({"num_bits": 8, "type": "int", "strategy": "token", "dynamic": true, "scale_dtype": "torch.bfloat16"}),
                "scale_dtype",
            ),
            (
                serde_json::json!({"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": false, "symmetric": false}),
                "symmetric",
            ),
        ] {
            let err = ct_int8(input).unwrap_err();
            assert_eq!(err.code, ErrorCode::OperatorUnsupported, "{err}");
            assert!(err.message.contains(&format!("input_activations.{field}")), "{err}");
        }
        let err = parse(
            "compressed-tensors",
            serde_json::json!({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": {
                "targets": ["Linear"], "output_activations": {"num_bits": 8, "type": "int"},
                "weights": {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "channel"}}}}),
        )
        .unwrap_err();
        assert!(err.message.contains("output_activations"), "{err}");
        // Fine-grained FP8: FP8 per token and group of the block's width, dynamic only.
        let fp8 = parse("fp8", serde_json::json!({"quant_method": "fp8", "weight_block_size": [128, 64]})).unwrap();
        assert_eq!(
            fp8.input,
            Some(ActivationScheme {
                kind: ActivationType::Fp8E4M3,
                scales: ActivationScales::Group(64),
                symmetric: true
            })
        );
        let err = parse(
            "fp8",
            serde_json::json!({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}),
        )
        .unwrap_err();
        assert_eq!(err.code, ErrorCode::OperatorUnsupported);
        assert!(err.message.contains("activation_scheme") && err.message.contains("static"), "{err}");
    }

    #[test]
    fn gptq_v2_and_unsupported_fields_are_named() {
        let v2 = parse(
            "gptq",
            serde_json::json!({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "gptq_v2", "desc_act": true}),
        )
        .unwrap();
        assert!(matches!(
            v2.scheme,
            Scheme::Int { bits: 4, group: Some(32), actorder: true, packing: IntPacking::Gptq { v1: false }, .. }
        ));
        let err = parse("gptq", serde_json::json!({"quant_method": "gptq", "bits": 2, "group_size": 128})).unwrap_err();
        assert_eq!(err.code, ErrorCode::OperatorUnsupported);
        assert!(err.message.contains("bits") && err.message.contains('2'), "{err}");
        let err =
            parse("fp8", serde_json::json!({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}))
                .unwrap_err();
        assert_eq!(err.code, ErrorCode::OperatorUnsupported);
        assert!(err.message.contains("fmt") && err.message.contains("e5m2"), "{err}");
    }

    /// Every FP8 E4M3 code's value is its definition's: `±(1 + m/8) · 2^(e − 7)`, subnormals
    /// `±m · 2^−9`, both zeros, NaN for `S.1111.111`.
    #[test]
    fn fp8_values_are_the_definition() {
        for b in 0..=255u8 {
            let (sign, e, m) = (if b & 0x80 != 0 { -1.0f64 } else { 1.0 }, ((b >> 3) & 0xF) as i32, (b & 7) as f64);
            let got = fp8_e4m3_to_f32(b);
            if e == 15 && m == 7.0 {
                assert!(got.is_nan(), "code {b:#04x}");
                continue;
            }
            let want = if e == 0 { sign * m * 2f64.powi(-9) } else { sign * (1.0 + m / 8.0) * 2f64.powi(e - 7) };
            assert_eq!(got.to_bits(), (want as f32).to_bits(), "code {b:#04x}");
        }
    }

    /// An FP8 matrix `m` of `codes` (`[rows, cols]`) with the scales `s` (`scale_shape`).
    fn fp8_matrix(
        rows: usize,
        cols: usize,
        scales: Fp8Scales,
        codes: Vec<u8>,
        scale_shape: Vec<usize>,
        s: &[f32],
    ) -> PublishedMatrix {
        let tensor = |name: &str, dtype, shape, bytes| WeightTensor::owned(name.into(), dtype, shape, bytes).unwrap();
        PublishedMatrix {
            module: "m".into(),
            rows,
            cols,
            scheme: Scheme::Float8 { scales, inverse_name: false },
            values: tensor("m.weight", DType::F8E4M3, vec![rows, cols], codes),
            scale: tensor("m.weight_scale", DType::F32, scale_shape, s.iter().flat_map(|v| v.to_le_bytes()).collect()),
            zero: None,
            g_idx: None,
            shape: None,
            int8_activations: false,
            input: None,
            input_scale: None,
        }
    }

    /// Dequantization walks rows and runs of columns that share a scale; every weight is the
    /// definition's, computed per weight: FP8 under every scale layout (blocks cut short on
    /// both axes included), and its scale per block of 32 where the layout allows one;
    /// integers with consecutive groups and with a group per column.
    #[test]
    fn dequantized_weights_are_the_definition_per_weight() {
        let (rows, cols) = (5usize, 96usize);
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        // Every code but the NaNs.
        let codes: Vec<u8> =
            (0..rows * cols).map(|_| (next() % 256) as u8).map(|b| if b & 0x7F == 0x7F { 0 } else { b }).collect();
        let layouts = [
            (Fp8Scales::Tensor, vec![1]),
            (Fp8Scales::Channel, vec![rows, 1]),
            (Fp8Scales::Group(32), vec![rows, cols / 32]),
            (Fp8Scales::Block(2, 40), vec![rows.div_ceil(2), cols.div_ceil(40)]),
            (Fp8Scales::Block(2, 64), vec![rows.div_ceil(2), cols.div_ceil(64)]),
        ];
        for (scales, shape) in layouts {
            let n: usize = shape.iter().product();
            let s: Vec<f32> = (0..n).map(|i| 0.5 + i as f32 * 0.25).collect();
            let m = fp8_matrix(rows, cols, scales, codes.clone(), shape, &s);
            let got = m.dequantize().unwrap();
            // The codes and a scale per block of 32, where the scales do not split one.
            let blocks = m.fp8_codes().unwrap().map(|(_, block_scales)| block_scales);
            assert_eq!(blocks.is_none(), matches!(scales, Fp8Scales::Block(_, 40)), "{scales:?}");
            for r in 0..rows {
                for c in 0..cols {
                    let scale = match scales {
                        Fp8Scales::Tensor => s[0],
                        Fp8Scales::Channel => s[r],
                        Fp8Scales::Group(g) => s[r * (cols / g) + c / g],
                        Fp8Scales::Block(br, bc) => s[(r / br) * cols.div_ceil(bc) + c / bc],
                    };
                    let want = fp8_e4m3_to_f32(codes[r * cols + c]) * scale;
                    assert_eq!(got[r * cols + c].to_bits(), want.to_bits(), "{scales:?}, row {r}, column {c}");
                    if let Some(blocks) = &blocks {
                        assert_eq!(blocks.len(), rows * cols / 32);
                        assert_eq!(
                            blocks[r * cols / 32 + c / 32],
                            scale,
                            "{scales:?} block scale, row {r}, column {c}"
                        );
                    }
                }
            }
        }
        // A NaN code is refused, named by its place.
        let mut nan_codes = codes.clone();
        nan_codes[3 * cols + 70] = 0xFF;
        let m = fp8_matrix(rows, cols, Fp8Scales::Tensor, nan_codes, vec![1], &[1.0]);
        let err = m.fp8_codes().unwrap_err();
        assert_eq!(err.code, ErrorCode::FileCorrupted);
        assert!(err.message.contains("row 3, column 70") && err.message.contains("m.weight"), "{err}");
        let groups = 3;
        for group_of in [None, Some((0..cols).map(|c| ((c * 7) % groups) as u32).collect::<Vec<_>>())] {
            let m = IntMatrix {
                bits: 4,
                rows,
                cols,
                groups,
                codes: (0..rows * cols).map(|_| (next() % 16) as u8).collect(),
                scales: (0..rows * groups).map(|i| 0.125 + i as f32 * 0.5).collect(),
                zeros: (0..rows * groups).map(|i| (i % 16) as i32).collect(),
                group_of,
            };
            let mut got = vec![f32::NAN; rows * cols];
            m.dequantize_into(&mut got);
            for r in 0..rows {
                for c in 0..cols {
                    let g = r * groups + m.group(c);
                    let want = (m.codes[r * cols + c] as i32 - m.zeros[g]) as f32 * m.scales[g];
                    assert_eq!(
                        got[r * cols + c].to_bits(),
                        want.to_bits(),
                        "group_of {}, row {r}, column {c}",
                        m.group_of.is_some()
                    );
                }
            }
        }
    }
}
