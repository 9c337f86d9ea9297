"""The hybrid backend's cold part on the host engine's quantized rows (`host_ops.cold_ffn`):
the kernel against its float64 NumPy reference on random blocks (never zeros), empty / partial /
full active sets, per-row and shared id lists, padding anywhere."""

import zlib

import numpy as np
import pytest

from host_ops import cold_ffn
from host_ops import common
from host_ops import lowbit as lowbit_lib
from host_ops import qmatmul
from host_ops.common import HostOpError
from pijax.offline import predictor as predictor_lib

from test_host_kquants import _gguf_data
from test_host_quant import _random_matrix


def _matrix(rng, kind, n, d):
  if kind == "q4_k":  # Random K-quant blocks (test_host_kquants' maker).
    return qmatmul.from_gguf_blocks(kind, _gguf_data(rng, kind, n, d), (n, d))
  return _random_matrix(rng, kind, n, d)


@pytest.fixture(autouse=True)
def _two_threads():
  common.set_host_threads(2)


def _layer(rng, kind, family, dot, n=45, d=64):
  gate, up = _matrix(rng, kind, n, d), _matrix(rng, kind, n, d)
  down_t = qmatmul.quantize_q8_0(rng.standard_normal((n, d)).astype(np.float32))
  w = cold_ffn.QuantColdFFN(gate, up, down_t, family, dot=dot)
  w.source = (gate, up)  # The test's own copies (the layer keeps only the dots' layout).
  # The values the references read are the given rows' (records laid back into blocks).
  np.testing.assert_array_equal(w.values("gate"), qmatmul.dequantize_reference(gate))
  np.testing.assert_array_equal(w.values("up"), qmatmul.dequantize_reference(up))
  return w


def _ids(rng, case, b, n):
  """Per-row lists with -1 padding scattered among the ids."""
  out = np.full((b, n + 3), -1, np.int32)
  for r in range(b):
    k = {"empty": 0, "some": n // 3 + r, "full": n}[case]
    chosen = rng.permutation(n)[:k]
    slots = np.sort(rng.permutation(n + 3)[:k])
    out[r, slots] = chosen
  return out


@pytest.mark.parametrize("dot", ["f32", "int8"])
@pytest.mark.parametrize("family", ["swiglu", "reglu", "drelu"])
@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0", "q4_k"])
@pytest.mark.parametrize("case", ["empty", "some", "full"])
def test_cold_ffn_matches_reference(kind, family, dot, case):
  rng = np.random.default_rng(zlib.crc32(repr((kind, family, dot, case)).encode()))
  d = 256 if kind == "q4_k" else 64
  w = _layer(rng, kind, family, dot, d=d)
  b = 3
  x = rng.standard_normal((b, d)).astype(np.float32)
  ids = _ids(rng, case, b, w.n)
  y = w(x, ids)
  ref = w.reference(x, ids)
  assert y.shape == (b, d) and y.dtype == np.float32
  if case == "empty":
    np.testing.assert_array_equal(y, 0.0)
  else:
    scale = np.abs(ref).max()
    assert scale > 0
    np.testing.assert_allclose(y, ref, atol=2e-5 * scale, rtol=0)
  # One row as a 1-D input; a shared list serves every row.
  np.testing.assert_allclose(w(x[1], ids[1]), y[1], atol=1e-6 * max(np.abs(y).max(), 1))
  shared = ids[0]
  np.testing.assert_allclose(w(x, shared), w.reference(x, shared),
                             atol=2e-5 * max(np.abs(w.reference(x, shared)).max(), 1e-6))


def test_cold_ffn_full_set_is_the_dense_ffn():
  """Every neuron listed: the dense FFN over the same rows (int8 dots on h per 32 values)."""
  rng = np.random.default_rng(7)
  w = _layer(rng, "q4_1", "swiglu", "int8", n=64)
  x = rng.standard_normal((2, 64)).astype(np.float32)
  from host_ops import qpack_reference
  xk = qpack_reference.x_hat_reference(qmatmul.Q4_0, x)
  g = xk @ qmatmul.dequantize_reference(w.source[0]).T
  u = xk @ qmatmul.dequantize_reference(w.source[1]).T
  dense = (g / (1 + np.exp(-g)) * u) @ qmatmul.dequantize_reference(w.down_t)
  y = w(x, np.arange(64, dtype=np.int32))
  np.testing.assert_allclose(y, dense, atol=2e-5 * np.abs(dense).max(), rtol=0)


def test_cold_ffn_host_predicted_matches_its_ids():
  """run_predicted: the low-bit predictor's ids, then the same kernel."""
  rng = np.random.default_rng(3)
  n, d = 40, 64
  w = _layer(rng, "q4_0", "swiglu", "int8", n=n, d=d)
  gate_f = qmatmul.dequantize_reference(w.source[0]).astype(np.float32)
  up_f = qmatmul.dequantize_reference(w.source[1]).astype(np.float32)
  p = predictor_lib.lowbit_params(gate_f, up_f)
  w.lowbit = lowbit_lib.LowbitPredictor(p["gate_codes"], p["gate_scales"].astype(np.float32),
                                        p["up_codes"], p["up_scales"].astype(np.float32), 0.3)
  x = rng.standard_normal((2, d)).astype(np.float32)
  y, active = w.run_predicted(x)
  ids, counts = w.lowbit.active_ids(x, "swiglu")
  assert 0 < active.min() and active.max() < n
  np.testing.assert_array_equal(active, counts)
  np.testing.assert_allclose(y, w.reference(x, ids), atol=2e-5 * np.abs(y).max(), rtol=0)


def test_cold_ffn_refuses_bad_input():
  rng = np.random.default_rng(1)
  w = _layer(rng, "q4_0", "swiglu", "int8")
  x = rng.standard_normal((2, 64)).astype(np.float32)
  with pytest.raises(HostOpError, match="out of range"):
    w(x, np.array([0, w.n], np.int32))
  with pytest.raises(HostOpError, match="ids must be"):
    w(x, np.zeros((3, 4), np.int32))
  with pytest.raises(HostOpError, match="x must be"):
    w(np.zeros((2, 63), np.float32), np.zeros(1, np.int32))
  with pytest.raises(HostOpError, match="NaN or inf"):
    w(np.where(np.arange(64) == 5, np.nan, x), np.arange(4, dtype=np.int32))
  # A repeated id counts once; a negative id of any width is padding, never wrapped.
  once = w(x, np.array([3], np.int32))
  np.testing.assert_array_equal(w(x, np.array([3] * 60, np.int64)), once)
  np.testing.assert_array_equal(w(x, np.array([3, -2**32 + 5, -1], np.int64)), once)
  with pytest.raises(HostOpError, match="Q8_0 down_t"):
    cold_ffn.QuantColdFFN(*w.source, w.source[0], "swiglu")
  with pytest.raises(HostOpError, match="unknown FFN family"):
    cold_ffn.QuantColdFFN(*w.source, w.down_t, "gelu")
