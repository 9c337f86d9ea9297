"""Integer dot kernels (`host_ops.qdot`, issue 11): 8-bit block-quantized activations times the
file's Q4_1 / Q8_0 blocks, against NumPy references on random blocks (never zeros), odd sizes,
every batch size the gemv path takes, and the f32 product they approximate."""

import numpy as np
import pytest

from host_ops import common
from host_ops import qdot
from host_ops import qmatmul
from host_ops.common import HostOpError

needs_simd = pytest.mark.skipif(not qdot.AVAILABLE, reason="integer kernels need x86 AVX2")


@pytest.fixture(autouse=True)
def _two_threads():
  common.set_host_threads(2)


def _random(rng, kind, n, dim, *, extreme=False):
  """Random blocks; extreme: every Q8_0 code at -128/127 and Q4_1 at 15 (largest i16 pair sums)."""
  nb = dim // 32
  d = qmatmul.f16_bits(rng.uniform(0.001, 0.05, (n, nb)))
  if kind == "q4_1":
    qs = np.full((n, dim // 2), 255, np.uint8) if extreme else \
        rng.integers(0, 256, (n, dim // 2), dtype=np.uint8)
    m = qmatmul.f16_bits(rng.uniform(-0.3, 0.1, (n, nb)))
    return qmatmul.QMatrix(kind, (qs, d, m))
  q = rng.choice(np.array([-128, 127], np.int8), (n, dim)) if extreme else \
      rng.integers(-128, 128, (n, dim), dtype=np.int8)
  return qmatmul.QMatrix(kind, (q, d))


def _x(rng, b, dim):
  x = rng.standard_normal((b, dim)).astype(np.float32) * rng.uniform(0.1, 10, (b, 1))
  x[:, :32] *= 50  # A block of outliers, as real activations have.
  if dim >= 96:
    x[0, 32:64] = 0.0  # An all-zero block: scale 0, codes 0.
  return x.astype(np.float32)


@needs_simd
@pytest.mark.parametrize("dim", [32, 96, 576, 1536])
def test_quantize_x_matches_reference(dim):
  rng = np.random.default_rng(dim)
  x = _x(rng, 5, dim)
  xq, dx, xsum = qdot.quantize_x(x)
  rq, rdx, rsum = qdot.quantize_x_reference(x)
  np.testing.assert_array_equal(xq, rq)
  np.testing.assert_allclose(dx, rdx, rtol=1e-6)
  np.testing.assert_allclose(xsum, rsum, rtol=1e-6, atol=1e-6 * np.abs(x).max())
  np.testing.assert_allclose(xsum, (xq.reshape(5, -1, 32).sum(-1) * dx), rtol=1e-6)
  assert np.abs(xq.astype(np.int32)).max() == 127  # Each block's largest value maps to +-127.
  # Dequantized codes are within half a step of x.
  err = np.abs(xq.reshape(5, -1, 32) * dx[..., None] - x.reshape(5, -1, 32))
  assert (err <= dx[..., None] * 0.5 * (1 + 1e-5) + 1e-30).all()


@needs_simd
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
# 2080: rows of >= qdot.SPREAD_MIN_BYTES code bytes in both formats (the next row prefetched
# over the current one), an odd 65 blocks. Q4_1 takes blocks in pairs, scales in groups of 8:
# 32 and 96 a lone last block, 224 three left-over pairs, 448 a group and three pairs. 6208:
# past common.FAR_BYTES in both formats (the next row prefetched into L2), a left-over pair.
@pytest.mark.parametrize("n,dim", [(1, 32), (37, 96), (7, 224), (5, 448), (300, 576), (65, 1536),
                                   (9, 2080), (5, 6208)])
@pytest.mark.parametrize("b", [1, 3, qmatmul.GEMV_MAX_ROWS])
def test_gemv_matches_reference(kind, n, dim, b):
  rng = np.random.default_rng(n * dim + b)
  w = _random(rng, kind, n, dim)
  x = _x(rng, b, dim)
  got = w.matmul(x, dot="int8")
  ref = qdot.matmul_reference(kind, w.arrays, x)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
  # The f32 product it approximates: the activation rounding only (~1/254 of a block's max).
  exact = qmatmul.matmul_reference(w, x)
  assert np.abs(got - exact).max() <= 3e-2 * np.abs(exact).max()


def test_far_rows_prefetch_into_l2_past_the_measured_crossover():
  # (D, code bytes per row): 7B's Q4_1 up rows and Q8_0 rows of 4096 stay in L1, its Q4_1 down
  # rows (11008) and Q8_0 rows of 5376 go to L2 (the measurements at common.FAR_BYTES).
  assert not common.far_rows(4096, 2048) and not common.far_rows(5376, 2688)
  assert not common.far_rows(4096, 4096) and not common.far_rows(576, 576)
  assert common.far_rows(7168, 3584) and common.far_rows(11008, 5504)
  assert common.far_rows(5376, 5376) and common.far_rows(6208, 3104)


@pytest.mark.parametrize("shape,dtype", [((3, 1000), np.uint8), ((2, 7, 5), np.uint16),
                                         ((0, 4), np.float32), ((5,), np.int8)])
def test_empty_aligned_starts_on_a_cache_line(shape, dtype):
  rng = np.random.default_rng(len(shape))
  for _ in range(4):  # Several allocations: NumPy's own start varies.
    a = common.empty_aligned(shape, dtype)
    assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous
    assert a.ctypes.data % 64 == 0 or a.size == 0
  parts = [rng.integers(0, 100, shape).astype(dtype) for _ in range(3)]
  stacked = common.stack_aligned(parts)
  np.testing.assert_array_equal(stacked, np.stack(parts))
  assert stacked.dtype == dtype and (stacked.ctypes.data % 64 == 0 or stacked.size == 0)


@needs_simd
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_gemv_extreme_codes_do_not_saturate(kind):
  """The largest codes (Q4_1 15, Q8_0 -128/127) times activations at +-127: the 16-bit pair
  sums of vpmaddubsw stay below 2^15, so results are exact."""
  rng = np.random.default_rng(3)
  w = _random(rng, kind, 17, 128, extreme=True)
  x = np.where(rng.random((2, 128)) < 0.5, -1.0, 1.0).astype(np.float32)  # codes exactly +-127
  ref = qdot.matmul_reference(kind, w.arrays, x)
  np.testing.assert_allclose(w.matmul(x, dot="int8"), ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


@needs_simd
def test_matmul_vector_and_many_rows():
  """A 1-D x is one row; above GEMV_MAX_ROWS rows dot="int8" stays integer, each row its own
  dot (the same bits as that row alone), and dot="f32" takes the tiled f32 product."""
  rng = np.random.default_rng(9)
  for kind in ("q4_1", "q8_0"):
    w = _random(rng, kind, 40, 64)
    x = _x(rng, qmatmul.GEMV_MAX_ROWS + 3, 64)
    np.testing.assert_array_equal(w.matmul(x[0], dot="int8"), w.matmul(x[:1], dot="int8")[0])
    many = w.matmul(x, dot="int8")
    np.testing.assert_array_equal(many[7], w.matmul(x[7:8], dot="int8")[0])
    ref = qdot.matmul_reference(kind, w.arrays, x)
    np.testing.assert_allclose(many, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
    assert not np.array_equal(many, w.matmul(x, dot="f32"))
  with pytest.raises(HostOpError, match="dot must be"):
    w.matmul(x, dot="int4")


def test_unavailable_falls_back_to_f32(monkeypatch):
  """Where the integer kernels cannot run, dot="int8" gives the f32 kernels' result."""
  rng = np.random.default_rng(10)
  w = _random(rng, "q8_0", 24, 64)
  x = _x(rng, 2, 64)
  monkeypatch.setattr(qdot, "AVAILABLE", False)
  np.testing.assert_array_equal(w.matmul(x, dot="int8"), w.matmul(x, dot="f32"))


_SAME_BITS_SCRIPT = """
import sys
import numpy as np
from host_ops import common, qdot, qmatmul
common.set_host_threads(2)
rng = np.random.default_rng(21)
out = {}
for n, dim in ((1536, 576), (40, 2048)):
  xs = rng.standard_normal((2, dim)).astype(np.float32)
  qs = rng.integers(0, 256, (n, dim // 2), dtype=np.uint8)
  d = qmatmul.f16_bits(rng.uniform(0.001, 0.05, (n, dim // 32)))
  m = qmatmul.f16_bits(rng.uniform(-0.3, 0.1, (n, dim // 32)))
  q = rng.integers(-128, 128, (n, dim), dtype=np.int8)
  o = np.empty((2, n), np.float32)
  qdot.gemv_q4_1(qs, d, m, xs, o)
  out[f"q4_1_{dim}"] = o.copy()
  qdot.gemv_q8_0(q, d, xs, o)
  out[f"q8_0_{dim}"] = o.copy()
from host_ops import attention, qpack
qkv = rng.standard_normal((5, 15, 64)).astype(np.float32)
ang = rng.uniform(0, 3, (5, 32)).astype(np.float32)
none = np.zeros(0, np.float32)
out["attention"] = attention.attention(
    qkv, np.zeros((1, 8, 3, 64), np.float32), np.zeros((1, 8, 3, 64), np.float32),
    np.zeros(5, np.int64), np.arange(5), np.cos(ang), np.sin(ang), False, 9, 3,
    np.float32(0.125), 0, none, none, np.float32(1e-5))
for kind, values, nbytes in (("q4_k", 256, 144), ("q4_1", 32, 20), ("q6_k", 256, 210)):
  raw = rng.integers(0, 256, (64, 512 // values, nbytes), dtype=np.uint8)
  at = {"q4_k": (0, 2), "q4_1": (0, 2), "q6_k": (208,)}[kind]
  for a in at:
    raw[:, :, a:a + 2] = qmatmul.f16_bits(rng.uniform(0.001, 0.05, (64, 512 // values, 1))).view(
        np.uint8).reshape(64, 512 // values, 2)
  packed = qpack.pack(kind, raw.reshape(64, -1))
  out[f"packed_{kind}"] = qpack.matmul(kind, packed, rng.standard_normal((5, 512)).astype(
      np.float32))
np.savez(sys.argv[1], **out)
"""


@needs_simd
@pytest.mark.slow
def test_integer_dots_same_bits_compiled_or_loaded_from_cache(tmp_path):
  """The gemvs, the packed products and the attention kernel give the same bits in the process
  that compiles them as in one that loads them from numba's disk cache. Under fastmath the two ran differently
  optimized code (111 of 1536 Q4_1 outputs, 644 of 2880 SmolLM2 attention outputs differed in
  the last bit), which int8 activations turned into other greedy text (BUILD_NOTES.md, issue
  11); the intrinsics' float ops keep IEEE order, attention compiles without reassoc."""
  import os
  import pathlib
  import subprocess
  import sys
  root = pathlib.Path(__file__).resolve().parents[1]
  env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(root))
  runs = []
  for k in range(2):
    out = tmp_path / f"run{k}.npz"
    proc = subprocess.run([sys.executable, "-c", _SAME_BITS_SCRIPT, str(out)], env=env,
                          cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    if k == 0:  # The second run loads what the first compiled.
      assert list((tmp_path / "cache").rglob("qdot.gemv_q4_1-*.nbc"))
    runs.append(np.load(out))
  assert sorted(runs[0].files) == sorted(runs[1].files) and len(runs[0].files) == 8
  for name in runs[0].files:
    np.testing.assert_array_equal(runs[0][name], runs[1][name], err_msg=name)
