"""Dense decode matvecs and the sparse down pass, timed on random GGUF blocks read from DRAM.

Dense: `host_ops.qmatmul.QMatrix.matmul` of one row over a [rows, cols] matrix of q4_1 or q8_0
blocks. Sparse down pass: `host_ops.gated_ffn`'s down pass over neuron-major rows of which a
fraction is active. Copies of the matrix are cycled so each call reads one from DRAM.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from pijax.measure.sparse_op import MAX_CALLS, MIN_CALLS

MATVEC_FORMATS = ("q4_1", "q8_0")
DOWN_ACTIVE = (0.25, 0.5, 1.0)  # Fractions of neurons active in the down-pass table.


@dataclasses.dataclass
class MatvecRow:
  """One dense matvec row: a matrix of a shape in a GGUF block format, with a dot mode."""

  shape: str  # a `pijax.bench_ops.SHAPES` name
  matrix: str  # "gate" ([n, D]) | "down" ([D, n])
  rows: int
  cols: int
  format: str  # "q4_1" | "q8_0"
  dot: str  # "f32" | "int8"
  time_s: float  # median seconds per call
  g_weights_s: float  # rows * cols / time_s / 1e9
  gb_s: float  # GGUF block bytes / time_s / 1e9
  copies: int
  from_dram: bool  # copies * bytes >= the cold target
  vs_bandwidth: float | None = None  # gb_s / the machine's read bandwidth


def matvec_copies(rows: int, cols: int, fmt: str, copies: int, seed: int = 0):
  """`copies` random QMatrix views of one [copies * rows, cols] block array (codes uniform, scales
  in [0.001, 0.02], Q4_1 offsets in [-0.1, 0.1])."""
  from host_ops import qmatmul
  rng = np.random.default_rng([seed, rows, cols])
  nb = cols // qmatmul.BLOCK
  total = copies * rows
  d = qmatmul.f16_bits(rng.uniform(0.001, 0.02, (total, nb)))
  if fmt == "q4_1":
    arrays = (rng.integers(0, 256, (total, cols // 2), dtype=np.uint8), d,
              qmatmul.f16_bits(rng.uniform(-0.1, 0.1, (total, nb))))
  else:
    arrays = (rng.integers(-128, 128, (total, cols), dtype=np.int8), d)
  return [qmatmul.QMatrix(fmt, tuple(a[c * rows:(c + 1) * rows] for a in arrays))
          for c in range(copies)]


def _time_calls(fn, n_copies: int, seconds: float) -> float:
  """Median seconds of fn(i) over calls cycling i through the copies (two warm-up calls: compile
  or load the numba cache), for `seconds` and at least MIN_CALLS calls."""
  for i in range(min(2, n_copies)):
    fn(i)
  times = []
  i = 0
  deadline = time.perf_counter() + seconds
  while (time.perf_counter() < deadline or i < MIN_CALLS) and i < MAX_CALLS:
    t0 = time.perf_counter()
    fn(i % n_copies)
    times.append(time.perf_counter() - t0)
    i += 1
  return float(np.median(times))


def bench_matvec(mats, dot: str, *, seconds: float, cold_bytes: float,
                 seed: int = 0) -> dict[str, Any]:
  """Times `QMatrix.matmul` of one f32 row over the copies in turn (median s per call)."""
  w0 = mats[0]
  x = np.random.default_rng([seed, w0.shape[1]]).standard_normal((1, w0.shape[1])).astype(
      np.float32)
  out = np.empty((1, w0.shape[0]), np.float32)
  t = _time_calls(lambda i: mats[i].matmul(x, out=out, dot=dot), len(mats), seconds)
  n, dim = w0.shape
  return dict(time_s=t, g_weights_s=n * dim / t / 1e9, gb_s=w0.file_bytes() / t / 1e9,
              copies=len(mats), from_dram=len(mats) * w0.file_bytes() >= cold_bytes)


@dataclasses.dataclass
class DownPassRow:
  """One row of the sparse down pass (`host_ops.gated_ffn.down_pass`): neuron-major rows of a
  format, a fraction of them active, against the dense Q4_1 down matvec of the same shape."""

  shape: str
  rows: int  # F: neurons (rows of the neuron-major matrix)
  cols: int  # D: hidden size
  format: str  # "q8_0" | "q4_1" | "file" (the file's Q4_1 blocks transposed)
  dot: str  # "f32" | "int8" (Q4_1: integer products on quantized coefficients)
  active: float  # fraction of the F rows read
  time_s: float  # median seconds per call
  g_weights_s: float  # active rows * cols / time_s / 1e9
  gb_s: float  # block bytes of the active rows / time_s / 1e9
  dense_time_s: float  # the dense Q4_1 down matvec ([D, F], same dot), median s per call
  vs_dense: float  # dense_time_s / time_s
  copies: int
  from_dram: bool
  vs_bandwidth: float | None = None


def down_rows_copies(d: int, n: int, fmt: str, copies: int, seed: int = 0):
  """`copies` random neuron-major down matrices of F = n rows of D = d values in `fmt` (a
  `host_ops.gated_ffn.DOWN_KINDS` name; "file": the file's [D, F] Q4_1 blocks, transposed)."""
  from host_ops import gated_ffn
  from host_ops import qmatmul
  if fmt == gated_ffn.DOWN_FILE:  # The file's [D, F] Q4_1 blocks, transposed.
    return [gated_ffn.FileDownRows.from_down(w) for w in
            matvec_copies(d, n, qmatmul.Q4_1, copies, seed)]
  return matvec_copies(n, d, fmt, copies, seed)


def time_down_pass(mats, acts: np.ndarray, dot: str, *, threads: int, seconds: float) -> float:
  """Median seconds of the sparse down pass of acts (f32[1, F], zero where inactive) over the
  copies in turn (`mats`: `down_rows_copies`; dot "f32" or "int8")."""
  from host_ops import gated_ffn
  from host_ops import qmatmul
  return _time_calls(lambda i: gated_ffn.down_pass(
      acts, mats[i].arrays, threads, np.int64(qmatmul.BLOCK), dot == qmatmul.DOT_INT8),
      len(mats), seconds)
