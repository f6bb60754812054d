//! Tensors as views into read-only memory maps, in their stored dtype.

use std::sync::Arc;

use serde::Serialize;

/// Stored element types. BF16, F16 and F32 are computed on; the others hold the quantized
/// checkpoints' integers, FP8 values and packed planes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum DType {
    F32,
    F16,
    BF16,
    I8,
    U8,
    F8E4M3,
    /// Packed integers of published quantized checkpoints (GPTQ, AWQ, compressed-tensors).
    I32,
    I64,
}

impl DType {
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I8 | DType::U8 | DType::F8E4M3 => 1,
            DType::I32 => 4,
            DType::I64 => 8,
        }
    }

    /// The safetensors spelling (`BF16`, `F8_E4M3`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::I8 => "I8",
            DType::U8 => "U8",
            DType::F8E4M3 => "F8_E4M3",
            DType::I32 => "I32",
            DType::I64 => "I64",
        }
    }

    /// The safetensors crate's dtype, for writing tensors.
    pub fn safetensors_dtype(self) -> safetensors::Dtype {
        match self {
            DType::F32 => safetensors::Dtype::F32,
            DType::F16 => safetensors::Dtype::F16,
            DType::BF16 => safetensors::Dtype::BF16,
            DType::I8 => safetensors::Dtype::I8,
            DType::U8 => safetensors::Dtype::U8,
            DType::F8E4M3 => safetensors::Dtype::F8_E4M3,
            DType::I32 => safetensors::Dtype::I32,
            DType::I64 => safetensors::Dtype::I64,
        }
    }

    /// Whether the native engine computes on this dtype directly.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }
}

/// The bytes behind tensors: a read-only shared memory map (one per file) or, for tests and
/// future quantization, an owned buffer.
#[derive(Debug)]
pub enum Storage {
    Mmap(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    pub fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mmap(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// One tensor: a validated view of `len` bytes at `offset` in `storage`.
///
/// Invariant (checked when the view is made, never again): `offset + len <= storage.len()` and
/// `len == dtype.size_in_bytes() * shape.product()`.
#[derive(Debug, Clone)]
pub struct WeightTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    storage: Arc<Storage>,
    offset: usize,
    len: usize,
}

impl WeightTensor {
    /// Makes a view, checking the invariant; `None` if the range or length is inconsistent.
    pub fn new(
        name: String,
        dtype: DType,
        shape: Vec<usize>,
        storage: Arc<Storage>,
        offset: usize,
        len: usize,
    ) -> Option<Self> {
        let elements = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))?;
        let expected = elements.checked_mul(dtype.size_in_bytes())?;
        let end = offset.checked_add(len)?;
        if expected != len || end > storage.bytes().len() {
            return None;
        }
        Some(WeightTensor { name, dtype, shape, storage, offset, len })
    }

    /// A tensor over owned `bytes` (weights made at load, not read from a file); `None` if
    /// their length is not `shape`'s in `dtype`.
    pub fn owned(name: String, dtype: DType, shape: Vec<usize>, bytes: Vec<u8>) -> Option<Self> {
        let len = bytes.len();
        WeightTensor::new(name, dtype, shape, Arc::new(Storage::Owned(bytes)), 0, len)
    }

    /// The stored bytes, little-endian, in `dtype`.
    #[inline]
    pub fn bytes(&self) -> &[u8] {
        &self.storage.bytes()[self.offset..self.offset + self.len]
    }

    pub fn element_count(&self) -> usize {
        self.len / self.dtype.size_in_bytes()
    }

    /// Whether the bytes are read from a file's map (not made at load and owned).
    pub fn is_mapped(&self) -> bool {
        matches!(&*self.storage, Storage::Mmap(_))
    }

    pub fn byte_len(&self) -> usize {
        self.len
    }

    /// Asks the operating system to start reading this tensor's pages into memory in the
    /// background (`madvise(MADV_WILLNEED)`), so that a cold page cache is filled at disk speed
    /// instead of one page fault at a time on the first forward pass. A hint: failures are
    /// ignored, and owned storage needs nothing.
    pub fn advise_will_need(&self) {
        #[cfg(unix)]
        if let Storage::Mmap(map) = &*self.storage {
            let _ = map.advise_range(memmap2::Advice::WillNeed, self.offset, self.len);
        }
    }

    /// Tells the operating system this process no longer needs the tensor's pages
    /// (`madvise(MADV_DONTNEED)`), so they leave its resident memory: after the weights were
    /// quantized into copies. The map stays valid (it is a read-only file map): a later read
    /// faults the pages back in from the file. A hint: failures are ignored, and owned storage
    /// is left alone.
    pub fn advise_dont_need(&self) {
        #[cfg(unix)]
        if let Storage::Mmap(map) = &*self.storage {
            // SAFETY: the map is a read-only shared file mapping, so dropping its pages loses
            // nothing: they are read again from the file on the next access; no reference into
            // them observes a change.
            let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, self.offset, self.len) };
        }
    }

    /// A view of rows `r0..r1` of a 2-D tensor (a part of a fused projection), named `name`;
    /// `None` if the range is outside the tensor or it is not 2-D.
    pub fn rows(&self, r0: usize, r1: usize, name: String) -> Option<WeightTensor> {
        let [rows, cols] = self.shape[..] else { return None };
        if r0 > r1 || r1 > rows {
            return None;
        }
        let row_bytes = cols.checked_mul(self.dtype.size_in_bytes())?;
        let offset = self.offset.checked_add(r0.checked_mul(row_bytes)?)?;
        let len = (r1 - r0).checked_mul(row_bytes)?;
        WeightTensor::new(name, self.dtype, vec![r1 - r0, cols], Arc::clone(&self.storage), offset, len)
    }

    /// A view of entry `i` along the first dimension (one expert of a stacked `[experts, ...]`
    /// tensor), with the remaining dimensions, named `name`; `None` if `i` is out of range.
    pub fn entry(&self, i: usize, name: String) -> Option<WeightTensor> {
        let (&count, rest) = self.shape.split_first()?;
        if i >= count || rest.is_empty() {
            return None;
        }
        let entry_bytes = self.len / count;
        let offset = self.offset.checked_add(i.checked_mul(entry_bytes)?)?;
        WeightTensor::new(name, self.dtype, rest.to_vec(), Arc::clone(&self.storage), offset, entry_bytes)
    }

    /// Whether two views share the same bytes (a tied head bound to the embedding).
    pub fn same_bytes(&self, other: &WeightTensor) -> bool {
        Arc::ptr_eq(&self.storage, &other.storage) && self.offset == other.offset && self.len == other.len
    }
}
