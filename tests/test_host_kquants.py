"""GGML block formats on the host (`host_ops.qblocks` through `qmatmul.QMatrix`): Q4_0, Q5_0, Q5_1,
Q4_K, Q5_K, Q6_K, F16 and BF16 matrices used from the file's own bytes.

Oracles: gguf's own dequantizer (`gguf.quants.dequantize`) on random block bytes (every code
byte random, f16 scales random normal * 0.01, never zero), float64 products for the kernels,
NumPy's f16 conversion on all 65536 halves. Odd row counts; D = 256, 512 (K-quants) or 64, 96.
"""

import gguf
import numba
import numpy as np
import pytest
from llvmlite import ir
from numba.core import cgutils
from numba.core import types
from numba.extending import intrinsic

from host_ops import common
from host_ops import llvm_ir
from host_ops import qblocks
from host_ops import qdot
from host_ops import qmatmul
from host_ops.common import HostOpError

K_KINDS = ("q4_k", "q5_k", "q6_k")
KINDS = qmatmul.RAW_KINDS
GGML = {kind: gguf.GGMLQuantizationType[name] for name, kind in qmatmul.GGML_KINDS.items()}
# Byte offsets of each block's f16 scales (d, and dmin / m where the format has one).
_F16_AT = {"q4_0": (0,), "q5_0": (0,), "q5_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2),
           "q6_k": (208,)}


@pytest.fixture(autouse=True)
def _two_threads():
  common.set_host_threads(2)


def _dims(kind):
  return (256, 512) if kind in K_KINDS else (64, 96)


def _gguf_data(rng, kind, n, dim):
  """What gguf.GGUFReader's `tensor.data` holds for n random rows: u8[n, row bytes] for the
  block formats and BF16, f16[n, D] for F16."""
  if kind == "f16":
    return rng.standard_normal((n, dim)).astype(np.float16)
  if kind == "bf16":
    top = rng.standard_normal((n, dim)).astype(np.float32).view(np.uint32) >> 16
    return top.astype(np.uint16).view(np.uint8)
  values, nbytes = qblocks.GEOMETRY[kind]
  nb = dim // values
  raw = rng.integers(0, 256, (n, nb, nbytes), dtype=np.uint8)
  for at in _F16_AT[kind]:
    scale = (rng.standard_normal((n, nb, 1)) * 0.01).astype(np.float16)
    scale[scale == 0] = np.float16(0.01)
    raw[:, :, at:at + 2] = scale.view(np.uint8)
  return raw.reshape(n, nb * nbytes)


def _gguf_values(kind, data, n, dim):
  return gguf.quants.dequantize(data, GGML[kind]).reshape(n, dim)


def _cases():
  return [(kind, dim) for kind in KINDS for dim in _dims(kind)]


@pytest.mark.parametrize("kind,dim", _cases())
def test_dequantize_matches_gguf(kind, dim):
  """(a) kernels and (b) the NumPy reference give gguf's values; rows_f32; zero copy."""
  rng = np.random.default_rng(dim)
  n = 33
  data = _gguf_data(rng, kind, n, dim)
  ref = _gguf_values(kind, data, n, dim)
  w = qmatmul.from_gguf_blocks(kind, data, (n, dim))
  assert w.shape == (n, dim) and w.file_bytes() == data.nbytes == w.nbytes
  assert np.shares_memory(w.arrays[0], data)  # The file's bytes, not a copy.
  np.testing.assert_array_equal(w.dequantize(), ref)
  ref64 = qmatmul.dequantize_reference(w)
  assert ref64.dtype == np.float64
  # Every product before gguf's last f32 rounding is exact, so rounding the float64 reference
  # once gives gguf's f32 values bit for bit.
  np.testing.assert_array_equal(ref64.astype(np.float32), ref)
  np.testing.assert_array_equal(w.rows_f32([n - 1, 0, 7, 7]), ref[[n - 1, 0, 7, 7]])
  part = np.full((20, dim), np.nan, np.float32)
  w.dequantize(5, 17, part)
  np.testing.assert_array_equal(part[:12], ref[5:17])
  assert np.isnan(part[12:]).all()


@pytest.mark.parametrize("kind,dim", _cases())
def test_matmul_matches_float64(kind, dim):
  """(c) gemv (b <= GEMV_MAX_ROWS) and tiled gemm (b > GEMV_MAX_ROWS) against x @ W.T."""
  rng = np.random.default_rng(dim + 1)
  n = 7
  data = _gguf_data(rng, kind, n, dim)
  w_values = _gguf_values(kind, data, n, dim).astype(np.float64)
  w = qmatmul.from_gguf_blocks(kind, data, (n, dim))
  for b in (1, 3, qmatmul.GEMV_MAX_ROWS, 13):
    x = rng.standard_normal((b, dim)).astype(np.float32)
    exact = x.astype(np.float64) @ w_values.T
    # f32 accumulation: the error is a small multiple of eps times sum |x_j w_j|.
    bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(w_values).T)
    got = w.matmul(x)
    assert got.shape == (b, n) and got.dtype == np.float32
    assert (np.abs(got - exact) <= bound).all(), (b, np.abs(got - exact).max())
    np.testing.assert_allclose(qmatmul.matmul_reference(w, x), exact, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(w.matmul(x[0]), w.matmul(x[:1])[0])  # 1-D x: one row.
  out = np.empty((13, n), np.float32)
  assert w.matmul(x, out=out) is out


@pytest.mark.skipif(not qdot.AVAILABLE, reason="integer kernels need x86 AVX2")
@pytest.mark.parametrize("kind,dim", [(k, d) for k in qblocks.INT8_KINDS if k in qmatmul.RAW_KINDS
                                      for d in _dims(k)])
def test_int8_dot_matches_reference(kind, dim):
  """dot="int8": W . x_hat with x_hat = x quantized per 32 values, as qdot's Q4_1/Q8_0 gemv, for
  any number of rows."""
  rng = np.random.default_rng(dim + 2)
  n = 33
  data = _gguf_data(rng, kind, n, dim)
  w_values = _gguf_values(kind, data, n, dim).astype(np.float64)
  w = qmatmul.from_gguf_blocks(kind, data, (n, dim))
  for b in (1, 3, qmatmul.GEMV_MAX_ROWS):
    x = rng.standard_normal((b, dim)).astype(np.float32) * rng.uniform(0.1, 10, (b, 1))
    x[:, :32] *= 50  # A block of outliers.
    x[0, 32:64] = 0.0  # An all-zero block: scale 0, codes 0.
    x = x.astype(np.float32)
    abs_prod = np.abs(x).astype(np.float64) @ np.abs(w_values).T
    got = w.matmul(x, dot="int8")
    ref = qmatmul.matmul_int8_reference(w, x)
    assert (np.abs(got - ref) <= 1e-5 * abs_prod).all()
    # The activation rounding (at most half a step dx / 2 per value) bounds the distance to
    # the f32 product.
    _, dx, _ = qdot.quantize_x_reference(x)
    rounding = np.repeat(dx.astype(np.float64) / 2, 32, axis=1) @ np.abs(w_values).T
    exact = x.astype(np.float64) @ w_values.T
    assert (np.abs(got - exact) <= rounding * 1.001 + 1e-5 * abs_prod).all()
    assert not np.array_equal(got, w.matmul(x))  # It did take the integer path.
  # Above GEMV_MAX_ROWS (prefill) the integer kernels run too, each row its own dot: a row's
  # result is the same bits alone or among 12 others.
  x = rng.standard_normal((13, dim)).astype(np.float32)
  many = w.matmul(x, dot="int8")
  np.testing.assert_allclose(many, qmatmul.matmul_int8_reference(w, x), rtol=1e-5,
                             atol=1e-5 * np.abs(many).max())
  np.testing.assert_array_equal(many[5], w.matmul(x[5:6], dot="int8")[0])


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_float_rows_of_any_length(kind):
  """F16/BF16 rows need not be a multiple of 32 values (the rest runs outside the vector loop)."""
  rng = np.random.default_rng(3)
  n, dim = 5, 40
  data = _gguf_data(rng, kind, n, dim)
  ref = _gguf_values(kind, data, n, dim)
  w = qmatmul.from_gguf_blocks(kind, data, (n, dim))
  np.testing.assert_array_equal(w.dequantize(), ref)
  halves = data.view(np.uint16)  # 16-bit words (a reader may give BF16 so): the same bytes.
  w16 = qmatmul.from_gguf_blocks(kind.upper(), halves, (n, dim))
  assert np.shares_memory(w16.arrays[0], data)
  np.testing.assert_array_equal(w16.dequantize(), ref)
  x = rng.standard_normal((3, dim)).astype(np.float32)
  exact = x.astype(np.float64) @ ref.astype(np.float64).T
  np.testing.assert_allclose(w.matmul(x), exact, rtol=1e-5, atol=1e-5 * np.abs(exact).max())
  np.testing.assert_allclose(w.matmul(np.tile(x, (5, 1))), np.tile(exact, (5, 1)), rtol=1e-5,
                             atol=1e-5 * np.abs(exact).max())
  np.testing.assert_array_equal(w.matmul(x, dot="int8"), w.matmul(x))


def test_from_gguf_reader_memory_map(tmp_path):
  """A real GGUF file: gguf.GGUFReader's read-only memory-mapped tensors are used in place."""
  rng = np.random.default_rng(4)
  writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
  shapes = {kind: (9, _dims(kind)[0]) for kind in KINDS}
  written = {}
  for kind, (n, dim) in shapes.items():
    data = _gguf_data(rng, kind, n, dim)
    written[kind] = data
    if kind == "f16":
      writer.add_tensor(kind, data)
    else:
      writer.add_tensor(kind, data, raw_shape=data.shape, raw_dtype=GGML[kind])
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
  for t in reader.tensors:
    kind = qmatmul.GGML_KINDS[t.tensor_type.name]
    n, dim = shapes[kind]
    assert (int(t.shape[1]), int(t.shape[0])) == (n, dim)
    w = qmatmul.from_gguf_blocks(t.tensor_type.name, t.data, (n, dim))
    assert w.kind == kind and np.shares_memory(w.arrays[0], t.data)
    assert not w.arrays[0].flags.writeable  # Still the read-only map.
    ref = _gguf_values(kind, written[kind], n, dim)
    np.testing.assert_array_equal(w.dequantize(), ref)
    x = rng.standard_normal(dim).astype(np.float32)
    exact = ref.astype(np.float64) @ x
    np.testing.assert_allclose(w.matmul(x), exact, rtol=1e-5, atol=1e-5 * np.abs(exact).max())


def test_stack_take_rows_and_errors():
  rng = np.random.default_rng(5)
  for kind in KINDS:
    dim = _dims(kind)[0]
    a = qmatmul.from_gguf_blocks(kind, _gguf_data(rng, kind, 3, dim), (3, dim))
    b = qmatmul.from_gguf_blocks(kind, _gguf_data(rng, kind, 5, dim), (5, dim))
    both = qmatmul.stack_rows([a, b])
    assert both.kind == kind and both.shape == (8, dim)
    np.testing.assert_array_equal(both.dequantize(), np.concatenate([a.dequantize(),
                                                                    b.dequantize()]))
    np.testing.assert_array_equal(both.take_rows([6, 1]).dequantize(),
                                  both.dequantize()[[6, 1]])
    assert f"{kind}" in repr(both)
    # (f) A byte count that does not match the format.
    with pytest.raises(HostOpError, match="expected"):
      qmatmul.from_gguf_blocks(kind, _gguf_data(rng, kind, 3, dim)[:, :-2], (3, dim))
    with pytest.raises(HostOpError):
      qmatmul.stack_rows([a, qmatmul.from_gguf_blocks(kind, _gguf_data(rng, kind, 3, 2 * dim),
                                                      (3, 2 * dim))])
  with pytest.raises(HostOpError, match="multiple of 256"):
    qmatmul.from_gguf_blocks("Q4_K", np.zeros((2, 144), np.uint8), (2, 128))
  with pytest.raises(HostOpError, match="multiple of 32"):
    qmatmul.from_gguf_blocks("q5_0", np.zeros((2, 22), np.uint8), (2, 16))
  with pytest.raises(HostOpError, match="no GGUF block reader"):
    qmatmul.from_gguf_blocks("Q3_K", np.zeros((2, 110), np.uint8), (2, 256))
  with pytest.raises(HostOpError, match="144-byte block"):
    qmatmul.QMatrix("q4_k", (np.zeros((2, 100), np.uint8),))
  w = qmatmul.from_gguf_blocks("q4_0", _gguf_data(rng, "q4_0", 3, 64), (3, 64))
  with pytest.raises(HostOpError, match="x must be"):
    w.matmul(np.zeros((2, 63), np.float32))
  with pytest.raises(HostOpError, match="row id"):
    w.rows_f32([3])
  with pytest.raises(HostOpError, match="out must be"):
    w.dequantize(0, 3, np.zeros((3, 64), np.float64))


def test_ggml_kinds_and_sizes():
  assert set(qmatmul.GGML_KINDS.values()) == set(qmatmul.KINDS)
  for name, kind in qmatmul.GGML_KINDS.items():
    values, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    assert qmatmul.block_size(name) == qmatmul.block_size(kind) == values
    dim = 512
    w = qmatmul.from_gguf_blocks(name, np.ones((1, dim // values * nbytes), np.uint8), (1, dim))
    assert w.kind == kind and w.file_bytes() == dim // values * nbytes
    assert w.bits_per_weight == 8 * nbytes / values


@pytest.mark.parametrize("kind", KINDS)
def test_all_finite_finds_nan_and_inf_scales(kind):
  rng = np.random.default_rng(6)
  dim = _dims(kind)[1]
  data = _gguf_data(rng, kind, 7, dim)
  assert qmatmul.from_gguf_blocks(kind, data, (7, dim)).all_finite()
  raw = data.reshape(-1).view(np.uint8).reshape(7, -1).copy()
  values, nbytes = qblocks.GEOMETRY[kind]
  at = nbytes * (dim // values - 1)  # The last block of a row.
  field = at + qmatmul.F16_FIELDS[kind][-1]
  for bad in (np.inf, -np.inf, np.nan):
    row = raw.copy()
    if kind == "bf16":
      bits = np.array([bad], np.float32).view(np.uint32) >> 16
      row[5, field:field + 2] = bits.astype(np.uint16).view(np.uint8)
    else:
      row[5, field:field + 2] = np.array([bad], np.float16).view(np.uint8)
    assert not qmatmul.from_gguf_blocks(kind, row, (7, dim)).all_finite(), bad
  # Codes are never scales: all-ones code bytes stay finite.
  if kind not in ("f16", "bf16"):
    row = raw.copy()
    codes = [k for k in range(nbytes) if all(not f <= k < f + 2 for f in qmatmul.F16_FIELDS[kind])]
    row[:, [b * nbytes + k for b in range(dim // values) for k in codes]] = 255
    assert qmatmul.from_gguf_blocks(kind, row, (7, dim)).all_finite()


@intrinsic
def _halves_soft(typingctx, src, dst):
  """dst[32 k: 32 k + 32] = f32 of the halves src[32 k: ...] by the vector integer method."""
  def codegen(context, builder, signature, args):
    s, d = (context.make_array(t)(context, builder, a) for t, a in zip(signature.args, args))
    count = builder.udiv(builder.extract_value(s.shape, 0), ir.Constant(ir.IntType(64), 32))
    with cgutils.for_range(builder, count) as loop:
      at = builder.mul(loop.index, ir.Constant(ir.IntType(64), 32))
      h = llvm_ir.load(builder, s.data, at, ir.VectorType(ir.IntType(16), 32))
      v = llvm_ir.half_to_float(builder, h, hw=False)
      builder.store(v, builder.bitcast(builder.gep(d.data, [at]), v.type.as_pointer()), align=4)
    return context.get_dummy_value()
  return types.void(src, dst), codegen


@numba.njit(fastmath=True)
def _convert_all(bits, hw, soft, vec_soft, bf):
  for i in range(bits.shape[0]):
    hw[i] = qblocks.f16_to_f32(bits[i])
    soft[i] = qblocks.f16_to_f32_soft(bits[i])
    bf[i] = qblocks.bf16_to_f32(bits[i])
  _halves_soft(bits, vec_soft)


def test_half_conversions_exact_on_all_bit_patterns():
  """Every f16 (zeros, subnormals, normals, inf, NaN), both conversion paths, scalar and vector."""
  bits = np.arange(65536, dtype=np.uint16)
  outs = [np.empty(65536, np.float32) for _ in range(4)]
  _convert_all(bits, *outs)
  want = bits.view(np.float16).astype(np.float32)
  nan = np.isnan(want)
  for got in outs[:3]:
    assert (np.isnan(got) == nan).all()
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
  want_bf = (bits.astype(np.uint32) << 16).view(np.float32)
  np.testing.assert_array_equal(outs[3].view(np.uint32), want_bf.view(np.uint32))


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_split_kinds_copied_in_chunks_match_gguf(kind, monkeypatch):
  """Q4_1/Q8_0 are split into codes and f32 scales row chunk by row chunk (so a load can drop
  each chunk's file pages): gguf's values on random blocks with a chunk smaller than the
  matrix, and `copied` reports every row exactly once, in order."""
  rng = np.random.default_rng(7)
  n, dim = 37, 96
  nbytes = {"q4_1": 20, "q8_0": 34}[kind]
  raw = rng.integers(0, 256, (n, dim // 32, nbytes), dtype=np.uint8)
  for at in ((0, 2) if kind == "q4_1" else (0,)):
    scale = (rng.standard_normal((n, dim // 32, 1)) * 0.01).astype(np.float16)
    scale[scale == 0] = np.float16(0.01)
    raw[:, :, at:at + 2] = scale.view(np.uint8)
  data = raw.reshape(n, -1)
  monkeypatch.setattr(qmatmul, "_COPY_CHUNK_BYTES", 5 * data.shape[1])  # 5 rows per chunk.
  seen = []
  w = qmatmul.from_gguf_blocks(kind.upper(), data, (n, dim),
                               copied=lambda lo, hi: seen.append((lo, hi)))
  assert seen == [(lo, min(lo + 5, n)) for lo in range(0, n, 5)]
  want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind.upper()]).reshape(n, dim)
  np.testing.assert_array_equal(w.rows_f32(np.arange(n)), want)
