"""The packed Q8_0 kernel (`host_ops.qpack`, kind "q8_0") and the packed LM head
(`host_ops.pool.PackedMatrix`) against their NumPy references.

Oracles: gguf's own dequantizer (`gguf.quants.dequantize`) on random Q8_0 blocks (every code
byte random, -128 included; f16 scales random normal * 0.01, never zero), times the activations
as the kernel quantizes them (`qpack_reference.matmul_reference`: float64). Row counts of 1 to 17 groups
(tiles of GEMM_TILE groups and their tails), activation rows 1 to 13 (blocks of R <= MAX_R and
the streamed / tiled split at STREAM_MAX_ROWS), D of 1, 3 and 18 blocks.
"""

import gguf
import numpy as np
import pytest

from host_ops import common
from host_ops import decoder as decoder_lib
from host_ops import pool as pool_lib
from host_ops import qdot
from host_ops import qmatmul
from host_ops import qpack
from host_ops import qpack_reference
from host_ops.common import HostOpError

needs_simd = pytest.mark.skipif(not qdot.AVAILABLE, reason="integer kernels need x86 AVX2")


@pytest.fixture(autouse=True)
def _two_threads():
  common.set_host_threads(2)


def _q8_0_blocks(rng, n, dim):
  """u8[n, D / 32 * 34]: random Q8_0 blocks (f16 d never zero, then 32 random code bytes)."""
  raw = rng.integers(0, 256, (n, dim // 32, 34), dtype=np.uint8)
  d = (rng.standard_normal((n, dim // 32, 1)) * 0.01).astype(np.float16)
  d[d == 0] = np.float16(0.01)
  raw[:, :, 0:2] = d.view(np.uint8)
  return raw.reshape(n, -1)


def _values(raw, n, dim):
  return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).reshape(n, dim)


@pytest.mark.parametrize("groups,dim", [(1, 32), (3, 96), (17, 576)])
def test_q8_0_layout_round_trips(groups, dim):
  """pack -> unpack_reference gives the file's bytes back; `out=` writes in place; rows of the
  packed matrix read back as gguf's values."""
  rng = np.random.default_rng(groups)
  n = qpack.G * groups
  raw = _q8_0_blocks(rng, n, dim)
  packed = qpack.pack("q8_0", raw)
  assert packed.shape == (groups, dim // 32 * qpack.UNIT_BYTES["q8_0"])
  assert packed.ctypes.data % 64 == 0
  np.testing.assert_array_equal(qpack.unpack_reference("q8_0", packed), raw)
  out = np.zeros_like(packed)
  assert qpack.pack("q8_0", raw, out) is out
  np.testing.assert_array_equal(out, packed)
  ids = np.asarray([n - 1, 0, 7, 7, n // 2])
  rows = np.empty((ids.size, dim), np.float32)
  pool_lib.rows_q8_0_kernel(packed, ids, rows)
  np.testing.assert_array_equal(rows, _values(raw, n, dim)[ids])


@needs_simd
@pytest.mark.parametrize("b", [1, 2, 3, 5, 8, 9, 13])
@pytest.mark.parametrize("groups,dim", [(1, 32), (3, 96), (17, 576)])
def test_q8_0_packed_matmul_matches_reference(groups, dim, b):
  """qpack.matmul("q8_0") = x_hat @ W.T (x quantized per 32 values) up to f32 summation
  order, for every b; each output depends only on its own row (the first row alone gives the
  same bits)."""
  rng = np.random.default_rng(100 * groups + b)
  n = qpack.G * groups
  raw = _q8_0_blocks(rng, n, dim)
  w = _values(raw, n, dim).astype(np.float64)
  packed = qpack.pack("q8_0", raw)
  x = rng.standard_normal((b, dim)).astype(np.float32)
  got = qpack.matmul("q8_0", packed, x)
  ref = qpack_reference.matmul_reference("q8_0", w, x)
  assert got.shape == (b, n) and got.dtype == np.float32
  bound = 1e-5 * (np.abs(qpack_reference.x_hat_reference("q8_0", x)) @ np.abs(w).T) + 1e-30
  assert (np.abs(got - ref) <= bound).all(), np.abs(got - ref).max()
  np.testing.assert_array_equal(qpack.matmul("q8_0", packed, x[:1]), got[:1])
  np.testing.assert_array_equal(qpack.matmul("q8_0", packed, x[0]), got[0])  # 1-D x.


@needs_simd
def test_q8_0_extreme_codes_do_not_saturate():
  """Codes of -128 and 127 against activations at +-127 (the largest |w| x |x| pairs of
  vpmaddubsw): exact integer sums, as the reference."""
  n, dim = 32, 64
  raw = np.zeros((n, dim // 32, 34), np.uint8)
  raw[:, :, 0:2] = np.float16(0.5).reshape(1).view(np.uint8)
  raw[: n // 2, :, 2:] = np.uint8(128)  # -128
  raw[n // 2:, :, 2:] = np.uint8(127)
  raw = raw.reshape(n, -1)
  x = np.where(np.arange(dim) % 3 == 0, -1.0, 1.0).astype(np.float32)[None].repeat(5, 0)
  got = qpack.matmul("q8_0", qpack.pack("q8_0", raw), x)
  np.testing.assert_array_equal(got, qpack_reference.matmul_reference("q8_0", _values(raw, n, dim), x))


def test_packed_matrix_from_chunks_and_back(monkeypatch):
  """PackedMatrix.from_rows in chunks (each chunk reported to `copied`) equals one pack;
  qmatrix() gives the QMatrix back; all_finite sees an inf scale; misuse is refused."""
  rng = np.random.default_rng(5)
  n, dim = 16 * 7, 96
  raw = _q8_0_blocks(rng, n, dim)
  monkeypatch.setattr(pool_lib, "_PACK_CHUNK_BYTES", 2 * qpack.G * raw.shape[1])
  seen = []
  m = pool_lib.PackedMatrix.from_rows("q8_0", lambda lo, hi: raw[lo:hi], (n, dim),
                                      lambda lo, hi: seen.append((lo, hi)))
  assert seen == [(0, 32), (32, 64), (64, 96), (96, 112)]
  np.testing.assert_array_equal(m.packed, qpack.pack("q8_0", raw))
  assert m.file_bytes() == raw.nbytes and m.shape == (n, dim) and m.all_finite()
  q = qmatmul.from_gguf_blocks("q8_0", raw, (n, dim))
  back = m.qmatrix()
  assert all((a == b).all() for a, b in zip(back.arrays, q.arrays))
  np.testing.assert_array_equal(m.rows_f32([3, n - 1]), q.rows_f32([3, n - 1]))
  again = pool_lib.PackedMatrix.from_qmatrix(q)
  np.testing.assert_array_equal(again.packed, m.packed)
  with pytest.raises(HostOpError, match="int8"):
    m.matmul(np.zeros((1, dim), np.float32), dot="f32")
  with pytest.raises(HostOpError, match="out of range"):
    m.rows_f32([n])
  bad = raw.copy().reshape(n, -1, 34)
  bad[5, 1, 0:2] = np.float16(np.inf).reshape(1).view(np.uint8)
  assert not pool_lib.PackedMatrix.from_rows("q8_0", lambda lo, hi: bad.reshape(n, -1)[lo:hi],
                                             (n, dim)).all_finite()
  assert not pool_lib.head_packable("q8_0", (n + 1, dim), False)
  assert not pool_lib.head_packable("q4_k", (n, 256), True)  # No K-quant rows read back.
  assert pool_lib.head_packable("q4_k", (n, 256), False)


def _tiny_decoder(rng, vocab, dot):
  """2 Q4_1 layers with a Q8_0 embedding tied to the head, `vocab` rows."""
  d, f, nh, kv, hd = 64, 96, 4, 2, 16

  def mat(rows, cols):
    return qmatmul.quantize_q4_1(rng.standard_normal((rows, cols)).astype(np.float32) * 0.1)

  layers = [decoder_lib.HostLayer(
      attn_norm=rng.uniform(0.5, 1.5, d).astype(np.float32), qkv=mat((nh + 2 * kv) * hd, d),
      attn_out=mat(d, nh * hd), ffn_norm=rng.uniform(0.5, 1.5, d).astype(np.float32),
      gate=mat(f, d), up=mat(f, d), down=mat(d, f)) for _ in range(2)]
  emb = qmatmul.from_gguf_blocks("q8_0", _q8_0_blocks(rng, vocab, d), (vocab, d))
  return decoder_lib.HostDecoder(emb, layers, rng.uniform(0.5, 1.5, d).astype(np.float32), emb,
                                 eps=1e-5, family="swiglu", n_heads=nh, n_kv_heads=kv,
                                 head_dim=hd, rope_theta=10000.0, rope_dim=hd, dot=dot)


@needs_simd
def test_decoder_packs_a_tied_q8_0_head_and_matches_reference():
  """With int8 products a tied Q8_0 head of 16 x k rows is packed once (embedding and head the
  same PackedMatrix); prefill + decode logits match the float64 reference; two sequences batched
  give each one's solo bits; switching to f32 products gives a QMatrix head back, and back."""
  rng = np.random.default_rng(11)
  dec = _tiny_decoder(rng, 80, "int8")
  assert isinstance(dec.lm_head, pool_lib.PackedMatrix) and dec.embedding is dec.lm_head
  tokens = rng.integers(0, 80, 11)
  ref = decoder_lib.decoder_reference(dec, tokens)
  cache = dec.new_cache(1, 16)
  got = np.concatenate([dec.forward(cache, tokens[None, :7], 0)] +
                       [dec.forward(cache, tokens[None, i:i + 1], i) for i in range(7, 11)])
  err = np.abs(got - ref) / np.abs(ref).max()
  assert err.max() <= 2e-2 and err.mean() <= 1e-3, (err.max(), err.mean())
  other = rng.integers(0, 80, 5)
  solo = dec.forward(dec.new_cache(1, 16), other[None], 0)
  both = dec.forward_rows(dec.new_cache(2, 16), np.concatenate([tokens[:7], other]),
                          [0] * 7 + [1] * 5, np.concatenate([np.arange(7), np.arange(5)]))
  np.testing.assert_array_equal(both[7:], solo)
  np.testing.assert_array_equal(both[:7], got[:7])
  dec.dot = "f32"
  assert isinstance(dec.lm_head, qmatmul.QMatrix) and dec.embedding is dec.lm_head
  dec.dot = "int8"
  assert isinstance(dec.lm_head, pool_lib.PackedMatrix) and dec.embedding is dec.lm_head
  np.testing.assert_array_equal(dec.forward(dec.new_cache(1, 16), tokens[None, :7], 0), got[:7])
  # A vocabulary of no whole groups keeps the row kernels.
  assert isinstance(_tiny_decoder(rng, 50, "int8").lm_head, qmatmul.QMatrix)


@needs_simd
@pytest.mark.slow
def test_default_model_packed_head_equals_row_head(smollm2_path):
  """SmolLM2 (the default model): its tied Q8_0 [49152, 576] head is packed at load; the
  prompt's logits equal those of the row kernel (qdot.gemv_q8_0) on the same final hidden
  states up to f32 summation order, and greedy decoding gives the same tokens."""
  import pijax
  model = pijax.load(smollm2_path, max_seq_len=256)
  assert model.configure_host_weights("auto") == "gguf"
  dec = model.backend.decoder
  assert isinstance(dec.lm_head, pool_lib.PackedMatrix) and dec.embedding is dec.lm_head
  assert dec.lm_head.shape == (49152, 576) and dec.lm_head.kind == "q8_0"
  ids = model.encode_prompt("The capital of France is")
  packed = dec.forward(dec.new_cache(1, 64), np.asarray([ids]), 0)
  head = dec.lm_head
  rows = head.qmatrix()
  try:
    dec.lm_head = dec.embedding = rows  # The row kernels, same weights.
    row_logits = dec.forward(dec.new_cache(1, 64), np.asarray([ids]), 0)
    row_text = model.generate("The capital of France is", max_new_tokens=12,
                              temperature=0.0).token_ids
  finally:
    dec.lm_head = dec.embedding = head
  np.testing.assert_allclose(packed, row_logits, rtol=0, atol=1e-4 * np.abs(row_logits).max())
  assert (packed.argmax(-1) == row_logits.argmax(-1)).all()
  assert model.generate("The capital of France is", max_new_tokens=12,
                        temperature=0.0).token_ids == row_text


# Byte offsets of each block's f16 scales (d, and m / dmin where the format has one).
_F16_AT = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q4_k": (0, 2),
           "q5_k": (0, 2), "q6_k": (208,), "q8_0": (0,)}


@needs_simd
@pytest.mark.parametrize("kind", qpack.KINDS)
def test_every_packed_kind_matches_reference(kind):
  """Every packed kind (Q8_0 beside the others) on random blocks: the layout round-trips and
  the product is x_hat @ W.T (K-quants: x per 256 values; else per 32) up to f32 order, for
  streamed (b <= 8) and tiled (b > 8) row counts and a tail of groups past GEMM_TILE."""
  rng = np.random.default_rng(len(kind) + qpack.KIND_CODES[kind])
  values, nbytes = qpack.UNIT_VALUES[kind], qpack.FILE_BYTES[kind]
  n, dim = qpack.G * (qpack.GEMM_TILE + 1), 3 * values
  raw = rng.integers(0, 256, (n, dim // values, nbytes), dtype=np.uint8)
  for at in _F16_AT[kind]:
    scale = (rng.standard_normal((n, dim // values, 1)) * 0.01).astype(np.float16)
    scale[scale == 0] = np.float16(0.01)
    raw[:, :, at:at + 2] = scale.view(np.uint8)
  raw = raw.reshape(n, -1)
  ggml = gguf.GGMLQuantizationType[kind.upper()]
  w = gguf.quants.dequantize(raw, ggml).reshape(n, dim).astype(np.float64)
  packed = qpack.pack(kind, raw)
  np.testing.assert_array_equal(qpack.unpack_reference(kind, packed), raw)
  for b in (1, 5, 13):
    x = rng.standard_normal((b, dim)).astype(np.float32)
    got = qpack.matmul(kind, packed, x)
    ref = qpack_reference.matmul_reference(kind, w, x)
    bound = 1e-5 * (np.abs(qpack_reference.x_hat_reference(kind, x)) @ np.abs(w).T) + 1e-30
    assert (np.abs(got - ref) <= bound).all(), (b, np.abs(got - ref).max())
