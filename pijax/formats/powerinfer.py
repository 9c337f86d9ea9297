"""PowerInfer's own files: its model GGUFs (magic b"PWRI") and its GPU placement files.

What they hold, as PowerInfer's converters (convert.py, convert-hf-to-powerinfer-gguf.py), its
quantizer and its loader (llama.cpp in SJTU-IPADS/PowerInfer) write and read them:

Model file: a GGUF (version 3) whose first 4 bytes are overwritten with b"PWRI"; that magic is
what switches PowerInfer to its sparse path. Architecture `llama` (ReluLLaMA, ProSparse: ReGLU,
relu(gate x) * (up x)) or `bamboo` (Bamboo: dReLU, relu(gate x) * relu(up x)); PowerInfer's `opt`
and `falcon` files are families pijax does not run. Beside llama's tensors, per layer i:
  blk.i.fc1.weight       NumPy [r_i, n_embd] (ggml ne {n_embd, r_i}), the predictor's first layer;
  blk.i.fc2.weight       NumPy [n_ff, r_i]   (ggml ne {r_i, n_ff}), its second; r_i per layer;
  blk.i.ffn_down_t.weight NumPy [n_ff, n_embd] (ggml ne {n_embd, n_ff}): the down projection
                         transposed, one neuron's down column per row. The converters *rename*
                         ffn_down, so the file has no blk.i.ffn_down.weight.
fc1/fc2 are F32 or F16 as converted; llama.cpp's quantizer then makes them Q4_0 in a Q4_0
file and Q5_0 in any other quantized one (output.weight: Q6_K, Q8_0 where ne0 % 256 != 0).
KV `powerinfer.sparse_threshold` (f32, optional; PowerInfer uses 0 when absent and lets the
environment variable LLAMA_SPARSE_PRED_THRESHOLD override it).
Predictor: logits = fc2 @ relu(fc1 @ x), no biases, x the residual stream entering the FFN block
(attention output added, before ffn_norm); neuron j is predicted active iff logits[j] >= the
threshold (its kernels skip rows whose logit is < threshold).

Placement file `<model>.generated.gpuidx`: a GGUF with the same magic, architecture
`generic.gpu_index`, KVs `generic.gpu_index.block_count` and `split.vram_capacity` (u64 bytes:
the budget it was solved for); per layer i, in this order, `blk.i.gpu_idx` (I32[n_ff], 1 for a
neuron on the GPU, else 0) and `blk.i.gpu_bucket` (I32[k], the sorted ids of those neurons).
PowerInfer reads its tensors by position (2i, 2i + 1); pijax reads them by name and checks them.

pijax reads a PowerInfer model file as the llama GGUF it was converted from: `GGUFFile` lists,
beside the file's tensors, a derived `blk.i.ffn_down.weight` (the transpose of ffn_down_t,
`dense_views`), so every engine runs it dense; this module gives the predictors, the threshold,
the neuron-major down rows and the placement to a sparse runtime.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Mapping, Sequence

import gguf
import numpy as np

from pijax.arch import llama
from pijax.errors import GGUFError
from pijax.formats import gguf as gguf_io

MAGIC = gguf_io.POWERINFER_MAGIC
THRESHOLD_KEY = "powerinfer.sparse_threshold"
VRAM_CAPACITY_KEY = "split.vram_capacity"
GPU_INDEX_ARCH = "generic.gpu_index"
GPU_IDX = "blk.{i}.gpu_idx"
GPU_BUCKET = "blk.{i}.gpu_bucket"
FC1 = llama.POWERINFER_TENSORS.names["fc1"]
FC2 = llama.POWERINFER_TENSORS.names["fc2"]
DOWN_T = llama.POWERINFER_TENSORS.names["down_t"]
DENSE_DOWN = llama.TENSORS.names["down"]
# Types whose transpose is a view of the same type (no blocks along a row).
_PLAIN = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
          gguf.GGMLQuantizationType.F64}
_DOWN_T_NAME = re.compile(r"blk\.(\d+)\.ffn_down_t\.weight")
_REDO = "the file is corrupt, re-convert it"


def is_powerinfer(path: str | os.PathLike[str]) -> bool:
  """Whether the file starts with PowerInfer's magic b"PWRI" (False when unreadable)."""
  try:
    with open(path, "rb") as fh:
      return fh.read(4) == MAGIC
  except OSError:
    return False


def has_predictors(path: str | os.PathLike[str]) -> bool:
  """Whether the file is a PowerInfer GGUF listing a predictor (`blk.N.fc1.weight`), from its
  header (False when unreadable; `read_predictors` checks every layer at load)."""
  if not is_powerinfer(path):
    return False
  try:
    reader, _ = gguf_io.open_gguf(os.fspath(path))
  except (GGUFError, OSError, ValueError):
    return False
  return any(t.name == FC1.format(i=0) for t in reader.tensors)


def gpuidx_path(model_path: str | os.PathLike[str]) -> str:
  """Where PowerInfer looks for a model's placement file: `<model>.generated.gpuidx`."""
  return os.fspath(model_path) + ".generated.gpuidx"


def stamp_magic(path: str | os.PathLike[str]) -> None:
  """Overwrites the first 4 bytes of a GGUF written by `gguf.GGUFWriter` with b"PWRI", as
  PowerInfer's converters do. Raises OSError."""
  with open(path, "r+b") as fh:
    if fh.read(4) not in gguf_io.MAGICS:
      raise OSError(f"{path} is not a GGUF file")
    fh.seek(0)
    fh.write(MAGIC)


# ------------------------------------------------------------------------------ dense reading
def dense_views(tensors: Sequence[gguf_io.TensorInfo]) -> list[gguf_io.TensorInfo]:
  """The `blk.N.ffn_down.weight` of every layer that has only PowerInfer's ffn_down_t: its
  transpose, NumPy [n_embd, n_ff] (see `gguf_io.TensorInfo.source`). Exact: F32/F16/F64
  sources are transposed views of the memory map (a reader copies them when it needs rows);
  block-quantized ones (BF16 too: its rows are read as bytes) are listed as F32 and
  dequantized then transposed by
  `pijax.formats.loader.dequantize` when read (the host engine re-quantizes those to Q8_0).
  Tensors of the wrong rank are left to `check_layout` to report."""
  names = {t.name for t in tensors}
  out = []
  for t in tensors:
    m = _DOWN_T_NAME.fullmatch(t.name)
    dense = DENSE_DOWN.format(i=m[1]) if m else None
    if dense is None or dense in names or len(t.shape) != 2:
      continue
    ne0, ne1 = (int(d) for d in t.shape)  # ggml {n_embd, n_ff}.
    if t.tensor_type in _PLAIN:
      ttype, data, n_bytes = t.tensor_type, t.data.T, t.n_bytes
    else:
      ttype, n_bytes = gguf.GGMLQuantizationType.F32, 4 * ne0 * ne1
      data = np.broadcast_to(np.float32(np.nan), (ne0, ne1))
    out.append(gguf_io.TensorInfo(dense, ttype, np.array([ne1, ne0], np.uint64), ne0 * ne1,
                                  n_bytes, t.data_offset, data, source=t))
  return out


def _numpy_shape(t: Any) -> tuple[int, ...]:
  return tuple(int(d) for d in reversed(t.shape))


def check_layout(tensors: Mapping[str, Any], n_layers: int, hidden: int, ffn: int,
                 path: str) -> None:
  """Checks the shapes of a PowerInfer file's own tensors (no data is read): per layer,
  fc1 [r, hidden] and fc2 [ffn, r] together or neither, with the same rank r > 0, and
  ffn_down_t [ffn, hidden] where present.

  Raises:
    GGUFError: naming the first tensor of the wrong shape, or a predictor half missing.
  """
  for i in range(n_layers):
    fc1, fc2, down_t = (tensors.get(p.format(i=i)) for p in (FC1, FC2, DOWN_T))
    if (fc1 is None) != (fc2 is None):
      have, miss = (FC1, FC2) if fc2 is None else (FC2, FC1)
      raise GGUFError(f"{path}: PowerInfer predictor tensor {have.format(i=i)!r} is there but "
                      f"{miss.format(i=i)!r} is missing; {_REDO}.")
    if fc1 is not None:
      s1, s2 = _numpy_shape(fc1), _numpy_shape(fc2)
      if len(s1) != 2 or s1[1] != hidden or s1[0] < 1:
        raise GGUFError(f"{path}: PowerInfer predictor tensor {FC1.format(i=i)!r} has shape "
                        f"{s1}, expected (rank, {hidden}) (fc1 maps the {hidden}-wide residual "
                        f"to the predictor's rank); {_REDO}.")
      if s2 != (ffn, s1[0]):
        raise GGUFError(f"{path}: PowerInfer predictor tensor {FC2.format(i=i)!r} has shape "
                        f"{s2}, expected {(ffn, s1[0])} (fc2 maps the rank {s1[0]} of "
                        f"{FC1.format(i=i)!r} to the {ffn} FFN neurons); {_REDO}.")
    if down_t is not None and _numpy_shape(down_t) != (ffn, hidden):
      raise GGUFError(f"{path}: tensor {DOWN_T.format(i=i)!r} has shape "
                      f"{_numpy_shape(down_t)}, expected {(ffn, hidden)} (the down projection "
                      f"transposed: one row per FFN neuron); {_REDO}.")


# ------------------------------------------------------------------------------- predictors
@dataclasses.dataclass(frozen=True)
class StoredMatrix:
  """One matrix as a PowerInfer file stores it, nothing copied or converted.

  Attributes:
    name: the GGUF tensor name.
    ggml_type: its GGML type name ("F16", "Q4_0", "Q5_0", ...).
    shape: (rows, cols) in NumPy order ([out, in]).
    data: a read-only view of the file's memory map: u8[rows, cols / block * block bytes] for
      block types (BF16 included), f16/f32[rows, cols] for F16/F32 (`TensorInfo.data`); what
      `host_ops.qmatmul.from_gguf_blocks(ggml_type, data, shape)` takes for the types a host
      kernel reads (`qmatmul.GGML_KINDS`).
    path: the file (for error messages).
  """

  name: str
  ggml_type: str
  shape: tuple[int, int]
  data: np.ndarray
  path: str
  _tensor: Any = dataclasses.field(repr=False, compare=False, default=None)

  @property
  def nbytes(self) -> int:
    """Bytes of the stored blocks (what reading every row costs)."""
    return int(self._tensor.n_bytes)

  def f32(self) -> np.ndarray:
    """f32[rows, cols]: the stored values, dequantized exactly. Raises GGUFError (a type
    gguf.quants cannot read, NaN or inf)."""
    from pijax.formats import loader
    arr = loader.dequantize(self._tensor, self.path)
    if not np.isfinite(arr).all():
      raise GGUFError(f"{self.path}: tensor {self.name!r} holds NaN or inf values; {_REDO}.")
    return arr


def _stored(t: Any, path: str) -> StoredMatrix:
  return StoredMatrix(t.name, t.tensor_type.name, _numpy_shape(t), t.data, path, t)


@dataclasses.dataclass(frozen=True)
class LayerPredictor:
  """One layer's predictor: logits f32[n_ff] = fc2 @ relu(fc1 @ x).

  fc1: [rank, n_embd]; fc2: [n_ff, rank] (`StoredMatrix`)."""

  fc1: StoredMatrix
  fc2: StoredMatrix

  @property
  def rank(self) -> int:
    return self.fc1.shape[0]

  def f32(self) -> tuple[np.ndarray, np.ndarray]:
    """(fc1 f32[rank, n_embd], fc2 f32[n_ff, rank]). Raises GGUFError."""
    return self.fc1.f32(), self.fc2.f32()


@dataclasses.dataclass(frozen=True)
class Predictors:
  """A PowerInfer file's predictors (`read_predictors`).

  Attributes:
    path: the model file.
    threshold: neuron j is predicted active iff logits[j] >= threshold (the file's
      `powerinfer.sparse_threshold`, 0.0 when absent).
    layers: one `LayerPredictor` per transformer block, in order.
  """

  path: str
  threshold: float
  layers: tuple[LayerPredictor, ...]

  @property
  def ranks(self) -> tuple[int, ...]:
    """Each layer's predictor rank r_i (fc1's rows)."""
    return tuple(p.rank for p in self.layers)

  @property
  def nbytes(self) -> int:
    """Bytes of every fc1 and fc2 as stored (what a decode token reads for prediction)."""
    return sum(p.fc1.nbytes + p.fc2.nbytes for p in self.layers)

  def f32(self) -> list[tuple[np.ndarray, np.ndarray]]:
    """[(fc1 f32[r_i, n_embd], fc2 f32[n_ff, r_i])] per layer. Raises GGUFError."""
    return [p.f32() for p in self.layers]


def predictor_logits(fc1: np.ndarray, fc2: np.ndarray, x: np.ndarray) -> np.ndarray:
  """PowerInfer's predictor, the NumPy reference: fc2 relu(fc1 x).

  Args:
    fc1: f32[rank, hidden]; fc2: f32[ffn, rank].
    x: f32[..., hidden], the residual stream entering the FFN block (before ffn_norm).

  Returns:
    f32[..., ffn] logits (compare with `Predictors.threshold`: >= is active).
  """
  # [..., rank]
  h = np.maximum(np.asarray(x, np.float32) @ fc1.T, 0.0)
  return h @ fc2.T


def sparse_threshold(metadata: Mapping[str, Any], path: str) -> float:
  """The file's `powerinfer.sparse_threshold` (0.0 when absent).

  Raises:
    GGUFError: a value that is not a finite number.
  """
  value = metadata.get(THRESHOLD_KEY, 0.0)
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    raise GGUFError(f"{path}: metadata {THRESHOLD_KEY}={value!r} must be a finite number; "
                    f"{_REDO}.")
  return float(value)


def _open_model(path: str | os.PathLike[str]) -> tuple[str, Any, dict[str, Any], Any]:
  """(path, config, metadata, {name: TensorInfo}) of a PowerInfer model file, checked by
  `loader.read_gguf`. Raises GGUFError (also for a file without PowerInfer's magic)."""
  from pijax.formats import loader
  path = os.fspath(path)
  cfg, metadata = loader.read_gguf(path)
  reader, _ = gguf_io.open_gguf(path)
  if not reader.powerinfer:
    raise GGUFError(f"{path}: not a PowerInfer file (magic {reader.magic!r}, expected "
                    f"{MAGIC!r}); PowerInfer's predictors come in files made by its converters "
                    "(or scripts/make_synthetic_gguf.py --format powerinfer).")
  return path, cfg, metadata, {t.name: t for t in reader.tensors}


def read_predictors(path: str | os.PathLike[str]) -> Predictors:
  """Reads a PowerInfer file's per-layer predictors and threshold (views of the file: nothing
  is copied until `.f32()` or a kernel's block reader asks).

  Args:
    path: a PowerInfer model GGUF (magic b"PWRI").

  Returns:
    `Predictors` (threshold, per-layer fc1 [r_i, n_embd] and fc2 [n_ff, r_i] as stored).

  Raises:
    GGUFError: not a PowerInfer file, any problem `loader.read_gguf` finds, a layer without
      its predictor, a predictor of the wrong shape, a type gguf.quants cannot read, or a bad
      threshold.
  """
  from pijax.formats import loader
  path, cfg, metadata, tensors = _open_model(path)
  layers = []
  for i in range(cfg.n_layers):
    fc1, fc2 = tensors.get(FC1.format(i=i)), tensors.get(FC2.format(i=i))
    if fc1 is None:
      raise GGUFError(f"{path}: layer {i} has no PowerInfer predictor ({FC1.format(i=i)!r} is "
                      "missing); run it dense (--sparse=off) or re-convert it with predictors.")
    for t in (fc1, fc2):  # One row through the dequantizer: an unreadable type fails here.
      loader.dequantize(t, path, rows=(0, 1))
    layers.append(LayerPredictor(_stored(fc1, path), _stored(fc2, path)))
  return Predictors(path, sparse_threshold(metadata, path), tuple(layers))


def read_down_t(path: str | os.PathLike[str]) -> tuple[StoredMatrix, ...]:
  """Each layer's `ffn_down_t` as stored: [n_ff, n_embd], row j = neuron j's down weights
  (the rows a sparse FFN reads for the active neurons).

  Raises:
    GGUFError: not a PowerInfer file, a layer without ffn_down_t, or see `loader.read_gguf`.
  """
  path, cfg, _, tensors = _open_model(path)
  out = []
  for i in range(cfg.n_layers):
    t = tensors.get(DOWN_T.format(i=i))
    if t is None:
      raise GGUFError(f"{path}: tensor {DOWN_T.format(i=i)!r} is missing; {_REDO}.")
    out.append(_stored(t, path))
  return tuple(out)


# -------------------------------------------------------------------------------- placement
@dataclasses.dataclass(frozen=True)
class GpuIndex:
  """A PowerInfer placement file (`read_gpuidx`).

  Attributes:
    path: the file.
    vram_capacity_bytes: the `split.vram_capacity` it was solved for.
    gpu_masks: per layer bool[n_ff], True for a neuron PowerInfer keeps on the GPU.
    gpu_buckets: per layer i32[k], the sorted ids of those neurons.
  """

  path: str
  vram_capacity_bytes: int
  gpu_masks: tuple[np.ndarray, ...]
  gpu_buckets: tuple[np.ndarray, ...]

  @property
  def n_layers(self) -> int:
    return len(self.gpu_masks)

  @property
  def hot_counts(self) -> tuple[int, ...]:
    """GPU neurons per layer."""
    return tuple(len(b) for b in self.gpu_buckets)


def _int_vector(t: Any, path: str) -> np.ndarray:
  if t.tensor_type != gguf.GGMLQuantizationType.I32 or len(t.shape) != 1:
    raise GGUFError(f"{path}: tensor {t.name!r} is {t.tensor_type.name} "
                    f"{_numpy_shape(t)}, expected a 1-D I32 vector; {_REDO}.")
  return np.array(t.data, np.int32)


def read_gpuidx(path: str | os.PathLike[str], *, n_layers: int | None = None,
                ffn: int | None = None) -> GpuIndex:
  """Reads a PowerInfer placement file (`<model>.generated.gpuidx`, see the module doc).

  Args:
    path: the file (magic b"PWRI" as PowerInfer writes it, or b"GGUF").
    n_layers, ffn: the model's layers and FFN neurons per layer, to check the file against.

  Returns:
    `GpuIndex` (copies: the file is not kept open).

  Raises:
    GGUFError: not a placement file, a missing or bad `split.vram_capacity`, a layer's
      gpu_idx or gpu_bucket missing, not I32, not 0/1, or disagreeing with each other or with
      `n_layers` / `ffn`.
  """
  path = os.fspath(path)
  reader, metadata = gguf_io.open_gguf(path)
  arch = metadata.get("general.architecture")
  if arch != GPU_INDEX_ARCH:
    raise GGUFError(f"{path}: not a PowerInfer placement file (architecture {arch!r}, "
                    f"expected {GPU_INDEX_ARCH!r}).")
  vram = metadata.get(VRAM_CAPACITY_KEY)
  if isinstance(vram, bool) or not isinstance(vram, int) or vram < 0:
    raise GGUFError(f"{path}: metadata {VRAM_CAPACITY_KEY}={vram!r} must be an integer >= 0 "
                    f"(bytes); {_REDO}.")
  tensors = {t.name: t for t in reader.tensors}
  layers = sum(1 for name in tensors if re.fullmatch(r"blk\.\d+\.gpu_idx", name))
  declared = metadata.get(f"{GPU_INDEX_ARCH}.block_count", layers)
  for want, what in ((declared, f"{GPU_INDEX_ARCH}.block_count"), (n_layers, "the model")):
    if want is not None and want != layers:
      raise GGUFError(f"{path}: holds the placement of {layers} layers but {what} has "
                      f"{want}; it belongs to another model (delete it, or regenerate it).")
  masks, buckets = [], []
  for i in range(layers):
    names = GPU_IDX.format(i=i), GPU_BUCKET.format(i=i)
    for name in names:
      if name not in tensors:
        raise GGUFError(f"{path}: tensor {name!r} is missing; {_REDO}.")
    idx, bucket = (_int_vector(tensors[n], path) for n in names)
    if ffn is not None and len(idx) != ffn:
      raise GGUFError(f"{path}: {names[0]!r} places {len(idx)} neurons but the model has "
                      f"{ffn} per layer; it belongs to another model.")
    if not np.isin(idx, (0, 1)).all():
      raise GGUFError(f"{path}: {names[0]!r} holds values other than 0 and 1; {_REDO}.")
    if not np.array_equal(bucket, np.flatnonzero(idx)):
      raise GGUFError(f"{path}: {names[1]!r} is not the sorted ids of the neurons "
                      f"{names[0]!r} marks; {_REDO}.")
    masks.append(idx.astype(bool))
    buckets.append(bucket)
  return GpuIndex(path, int(vram), tuple(masks), tuple(buckets))


def write_gpuidx(path: str | os.PathLike[str], gpu_masks: Sequence[np.ndarray],
                 vram_capacity_bytes: int) -> None:
  """Writes a placement file as PowerInfer's powerinfer-py does (see the module doc), to a
  temp name renamed when complete.

  Args:
    gpu_masks: per layer bool[n_ff] (True: the neuron is on the GPU).
    vram_capacity_bytes: the budget the placement was made for (`split.vram_capacity`).

  Raises:
    ValueError: no layers or a negative budget; OSError.
  """
  if not len(gpu_masks) or vram_capacity_bytes < 0:
    raise ValueError(f"need at least one layer and a budget >= 0 (got {len(gpu_masks)}, "
                     f"{vram_capacity_bytes})")
  path = os.fspath(path)
  tmp = path + ".tmp"
  try:
    w = gguf.GGUFWriter(tmp, GPU_INDEX_ARCH)
    for i, mask in enumerate(gpu_masks):
      mask = np.asarray(mask, bool)
      w.add_tensor(GPU_IDX.format(i=i), mask.astype(np.int32),
                   raw_dtype=gguf.GGMLQuantizationType.I32)
      w.add_tensor(GPU_BUCKET.format(i=i), np.flatnonzero(mask).astype(np.int32),
                   raw_dtype=gguf.GGMLQuantizationType.I32)
    w.add_block_count(len(gpu_masks))
    w.add_uint64(VRAM_CAPACITY_KEY, int(vram_capacity_bytes))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    stamp_magic(tmp)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
