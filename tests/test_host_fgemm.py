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
  raw, x = _rows(rng, "f16", 20, 64), np.ones((9, 64), np.float32)
  for out in (np.zeros((9, 10), np.float32), np.zeros((9, 20)),
              np.zeros((9, 40), np.float32)[:, ::2]):
    with pytest.raises(HostOpError, match="out must be"):
      fgemm.gemm("f16", raw, x, out)
  with pytest.raises(HostOpError, match="raw rows"):
    fgemm.gemm("f16", np.zeros((20, 64), np.float32), x)
  assert fgemm.gemm("f16", raw[:0], x).shape == (9, 0)


def test_qmatrix_product_into_a_strided_out():
  """QMatrix.matmul of F16 rows above 8 activation rows into a strided `out` (fgemm takes only
  contiguous ones; the tiled kernel the rest): the right values either way."""
  from host_ops import qmatmul
  rng = np.random.default_rng(6)
  raw = _rows(rng, "f16", 35, 64)
  m = qmatmul.from_gguf_blocks("F16", raw, (35, 64))
  x = rng.standard_normal((12, 64)).astype(np.float32)
  ref = fgemm.gemm_reference("f16", raw, x)
  wide = np.zeros((12, 70), np.float32)
  m.matmul(x, out=wide[:, ::2], dot="f32")
  np.testing.assert_allclose(wide[:, ::2], ref, rtol=0, atol=3e-6 * np.abs(ref).max())
  np.testing.assert_array_equal(wide[:, 1::2], 0.0)


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


def test_gguf_to_float_script(tmp_path):
  """scripts/gguf_to_float.py: every quantized matrix becomes F16 / BF16 with gguf's own
  dequantized values rounded once, norms stay F32, metadata and file type follow; bad --out is
  one line and exit 2 before any work; an F16 file converts to BF16 too."""
  import importlib.util
  import pathlib

  import gguf
  from tiny_models import write_random_quantized_gguf
  root = pathlib.Path(__file__).resolve().parents[1]
  spec = importlib.util.spec_from_file_location("gguf_to_float", root / "scripts/gguf_to_float.py")
  tool = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tool)
  src = write_random_quantized_gguf(tmp_path / "q41.gguf", layer_type="Q4_1")
  before = {t.name: t for t in gguf.GGUFReader(str(src)).tensors}
  for qtype, code in (("F16", 1), ("BF16", 32)):
    out = tmp_path / f"{qtype}.gguf"
    assert tool.main(["--src", str(src), "--type", qtype.lower(), "--out", str(out)]) == 0
    reader = gguf.GGUFReader(str(out))
    assert reader.fields["general.file_type"].contents() == code
    for t in reader.tensors:
      old = before[t.name]
      kind = gguf.GGMLQuantizationType(old.tensor_type)
      if len(old.shape) < 2 or kind == gguf.GGMLQuantizationType.F32:
        assert t.tensor_type == old.tensor_type
        continue
      assert t.tensor_type == gguf.GGMLQuantizationType[qtype]
      want = gguf.quants.dequantize(old.data, kind)
      got = gguf.quants.dequantize(t.data, t.tensor_type)
      np.testing.assert_allclose(got, want, rtol=2 ** -8 if qtype == "BF16" else 2 ** -11)
  f16 = tmp_path / "F16.gguf"
  assert tool.main(["--src", str(f16), "--type", "BF16", "--out", str(tmp_path / "b.gguf")]) == 0
  types = {gguf.GGMLQuantizationType(t.tensor_type) for t in
           gguf.GGUFReader(str(tmp_path / "b.gguf")).tensors}
  assert gguf.GGMLQuantizationType.F16 not in types
  for out in (str(src), str(tmp_path), str(tmp_path / "no" / "x.gguf")):
    assert tool.main(["--src", str(src), "--out", out]) == 2
  assert tool.main(["--src", str(src), "--type", "Q4", "--out", str(tmp_path / "x.gguf")]) == 2
  assert sorted(p.name for p in tmp_path.iterdir()) == ["BF16.gguf", "F16.gguf", "b.gguf",
                                                       "q41.gguf"]
