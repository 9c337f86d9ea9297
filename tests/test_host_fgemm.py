"""The F16 / BF16 prefill GEMM (`host_ops.fgemm`) against its float64 reference on random rows,
and the host decoder's use of it (an F16 copy of a tiny model: prefill close to the row kernels'
decode)."""

import numpy as np
import pytest

from host_ops import fgemm
from host_ops import qblocks
from host_ops.common import HostOpError


def _rows(rng, kind, n, dim):
  w = (rng.standard_normal((n, dim)) * 0.05).astype(np.float32)
  if kind == "f16":
    return w.astype(np.float16).view(np.uint8).reshape(n, -1)
  bits = (w.view(np.uint32) >> 16).astype(np.uint16)  # truncated to bf16
  return bits.view(np.uint8).reshape(n, -1)


@pytest.mark.parametrize("kind", ["f16", "bf16"])
@pytest.mark.parametrize("n,dim", [(1, 16), (7, 48), (37, 576), (64, 160), (130, 32)])
@pytest.mark.parametrize("b", [1, 5, 6, 9, 13, 64])
def test_gemm_matches_reference(kind, n, dim, b):
  """Every (weight rows mod 4) x (activation rows mod 6) tail, against float64 (f32 sums of
  exact products: within a few ulp of the dot's magnitude)."""
  rng = np.random.default_rng(n * 1000 + dim + b)
  raw = _rows(rng, kind, n, dim)
  x = rng.standard_normal((b, dim)).astype(np.float32)
  got = fgemm.gemm(kind, raw, x)
  ref = fgemm.gemm_reference(kind, raw, x)
  assert got.shape == (b, n)
  scale = float(np.abs(ref).max())
  np.testing.assert_allclose(got, ref, rtol=0, atol=3e-6 * max(scale, 1.0))


def test_gemm_rows_do_not_depend_on_the_batch():
  """An activation row's outputs are the same bits alone, in a batch of 13, or at any offset."""
  rng = np.random.default_rng(3)
  raw = _rows(rng, "f16", 37, 96)
  x = rng.standard_normal((13, 96)).astype(np.float32)
  full = fgemm.gemm("f16", raw, x)
  for r in (0, 5, 12):
    np.testing.assert_array_equal(fgemm.gemm("f16", raw, x[r:r + 1])[0], full[r])
  np.testing.assert_array_equal(fgemm.gemm("f16", raw, x[7:]), full[7:])


def test_gemm_into_a_column_offset():
  """The kernel writes its n outputs at column `col` of a wider output (the pool's q|k|v)."""
  rng = np.random.default_rng(4)
  raw = _rows(rng, "bf16", 20, 64)
  x = rng.standard_normal((11, 64)).astype(np.float32)
  out = np.full((11, 50), 7.0, np.float32)
  fgemm.gemm_kernel(qblocks.BF16, raw, x, out, 30)
  np.testing.assert_array_equal(out[:, :30], 7.0)
  np.testing.assert_array_equal(out[:, 30:], fgemm.gemm("bf16", raw, x))


def test_gemm_refuses_what_it_cannot_run():
  rng = np.random.default_rng(5)
  with pytest.raises(HostOpError, match="multiple of 16"):
    fgemm.gemm("f16", _rows(rng, "f16", 4, 40), np.zeros((9, 40), np.float32))
  with pytest.raises(HostOpError, match="f16 or bf16"):
    fgemm.gemm("q8_0", _rows(rng, "f16", 4, 32), np.zeros((9, 32), np.float32))
  with pytest.raises(HostOpError, match="x must be"):
    fgemm.gemm("f16", _rows(rng, "f16", 4, 32), np.zeros((9, 48), np.float32))


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_decoder_prefill_on_float_rows_matches_reference(kind):
  """A tiny decoder on F16 / BF16 rows: a 20-token prompt in one pass (more rows than the row
  kernels take: `fgemm` where the CPU has AVX-512, the tiled kernel else), then 3 single-token
  steps, against the float64 reference over the 23 tokens."""
  from host_ops import decoder as decoder_lib
  from host_ops import qmatmul
  rng = np.random.default_rng(11)
  d, f, n, k, hd, vocab = 64, 96, 4, 2, 16, 50

  def mat(rows, cols):
    return qmatmul.from_gguf_blocks(kind.upper(), _rows(rng, kind, rows, cols), (rows, cols))

  layers = [decoder_lib.HostLayer(
      attn_norm=rng.uniform(0.5, 1.5, d).astype(np.float32), qkv=mat((n + 2 * k) * hd, d),
      attn_out=mat(d, n * hd), ffn_norm=rng.uniform(0.5, 1.5, d).astype(np.float32),
      gate=mat(f, d), up=mat(f, d), down=mat(d, f)) for _ in range(2)]
  emb = mat(vocab, d)
  dec = decoder_lib.HostDecoder(emb, layers, rng.uniform(0.5, 1.5, d).astype(np.float32), emb,
                                eps=1e-5, family="swiglu", n_heads=n, n_kv_heads=k, head_dim=hd,
                                rope_theta=10000.0, rope_dim=hd, rope_adjacent=False, dot="f32")
  tokens = rng.integers(0, vocab, 23)
  ref = decoder_lib.decoder_reference(dec, tokens)
  cache = dec.new_cache(1, 32)
  got = [dec.forward(cache, tokens[None, :20], 0)]
  got += [dec.forward(cache, tokens[None, i:i + 1], i) for i in range(20, 23)]
  got = np.concatenate(got)
  np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())
