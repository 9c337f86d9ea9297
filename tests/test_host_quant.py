"""Quantized host weights (issue 5): block formats, host matmuls, the host decoder, the engine mode.

Oracles: gguf's own dequantizer (`gguf.quants.dequantize`) for the block bytes; float64 NumPy
references for the kernels and the whole decoder; transformers (CPU, f32) on the real GGUF.
"""

import os
import pathlib
import subprocess
import sys

import gguf
import numpy as np
import pytest

from host_ops import common
from host_ops import decoder as decoder_lib
from host_ops import qdot
from host_ops import qmatmul
from host_ops.common import HostOpError

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _gguf_q4_1_bytes(rng, n, dim):
  """Random Q4_1 rows in GGUF's byte layout: per block f16 d, f16 m, 16 bytes of nibbles."""
  nb = dim // 32
  d = rng.uniform(0.001, 0.05, (n, nb)).astype(np.float16)
  m = rng.uniform(-0.3, 0.0, (n, nb)).astype(np.float16)
  qs = rng.integers(0, 256, (n, nb, 16), dtype=np.uint8)
  blocks = np.concatenate([d.view(np.uint8).reshape(n, nb, 2), m.view(np.uint8).reshape(n, nb, 2),
                           qs], axis=2)
  return blocks.reshape(n, nb * 20)


def _gguf_q8_0_bytes(rng, n, dim):
  """Random Q8_0 rows in GGUF's byte layout: per block f16 d, 32 int8."""
  nb = dim // 32
  d = rng.uniform(0.001, 0.05, (n, nb)).astype(np.float16)
  q = rng.integers(-127, 128, (n, nb, 32), dtype=np.int8)
  blocks = np.concatenate([d.view(np.uint8).reshape(n, nb, 2), q.view(np.uint8)], axis=2)
  return blocks.reshape(n, nb * 34)


def _gguf_q4_0_bytes(rng, n, dim):
  """Random Q4_0 rows in GGUF's byte layout: per block f16 d, 16 bytes of nibbles."""
  nb = dim // 32
  d = rng.uniform(0.001, 0.05, (n, nb)).astype(np.float16)
  qs = rng.integers(0, 256, (n, nb, 16), dtype=np.uint8)
  return np.concatenate([d.view(np.uint8).reshape(n, nb, 2), qs], axis=2).reshape(n, nb * 18)


_MAKERS = {"q4_1": (_gguf_q4_1_bytes, gguf.GGMLQuantizationType.Q4_1),
           "q4_0": (_gguf_q4_0_bytes, gguf.GGMLQuantizationType.Q4_0),
           "q8_0": (_gguf_q8_0_bytes, gguf.GGMLQuantizationType.Q8_0)}


def _random_matrix(rng, kind, n, dim):
  make, _ = _MAKERS[kind]
  return qmatmul.from_gguf_blocks(kind, make(rng, n, dim), (n, dim))


@pytest.fixture(autouse=True)
def _two_threads():
  common.set_host_threads(2)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_blocks_match_gguf_dequantizer(kind):
  rng = np.random.default_rng(0)
  make, ggml_type = _MAKERS[kind]
  raw = make(rng, 37, 96)
  ref = gguf.quants.dequantize(raw, ggml_type).reshape(37, 96)
  w = qmatmul.from_gguf_blocks(kind, raw, (37, 96))
  np.testing.assert_array_equal(w.dequantize(), ref.astype(np.float32))
  np.testing.assert_array_equal(qmatmul.dequantize_reference(w), ref.astype(np.float64))
  assert w.file_bytes() == raw.size
  np.testing.assert_array_equal(w.rows_f32([5, 0, 36]), ref[[5, 0, 36]].astype(np.float32))


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("b", [1, 3, qmatmul.GEMV_MAX_ROWS, qmatmul.GEMV_MAX_ROWS + 1, 40])
def test_matmul_matches_reference(kind, b):
  """Both kernels (gemv for small b, dequantize-row-then-dot above) on random data."""
  rng = np.random.default_rng(b)
  make, ggml_type = _MAKERS[kind]
  raw = make(rng, 200, 160)
  w = qmatmul.from_gguf_blocks(kind, raw, (200, 160))
  x = rng.standard_normal((b, 160)).astype(np.float32)
  ref = x.astype(np.float64) @ gguf.quants.dequantize(raw, ggml_type).reshape(200, 160).T
  got = w.matmul(x)
  assert got.shape == (b, 200) and got.dtype == np.float32
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
  np.testing.assert_allclose(qmatmul.matmul_reference(w, x), ref, rtol=1e-6, atol=1e-6)
  # 1-D x is a one-row product (the gemv kernel: another summation order than b > 8 rows).
  np.testing.assert_array_equal(w.matmul(x[0]), w.matmul(x[:1])[0])
  np.testing.assert_allclose(w.matmul(x[0]), ref[0], rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_quantize_q8_0_and_stack_rows():
  rng = np.random.default_rng(1)
  rows = rng.standard_normal((10, 64)).astype(np.float32)
  w = qmatmul.quantize_q8_0(rows)
  scale = np.abs(rows.reshape(10, 2, 32)).max(-1) / 127
  err = np.abs(qmatmul.dequantize_reference(w) - rows).reshape(10, 2, 32)
  # Half a step of rounding, plus the f16 scale's own rounding (2^-11 relative) on |q| <= 127.
  assert (err <= scale[..., None] * (0.5 + 127 * 2.0 ** -11) + 1e-7).all()
  assert (err > scale[..., None] / 2 + 1e-7).any()  # The f16 scale is what is stored.
  a, b = _random_matrix(rng, "q4_1", 3, 64), _random_matrix(rng, "q4_1", 5, 64)
  both = qmatmul.stack_rows([a, b])
  np.testing.assert_array_equal(both.dequantize(), np.concatenate([a.dequantize(),
                                                                  b.dequantize()]))
  with pytest.raises(HostOpError):
    qmatmul.stack_rows([a, w.take_rows([0, 1])])
  with pytest.raises(HostOpError, match="expected"):
    qmatmul.from_gguf_blocks("q4_1", np.zeros(7, np.uint8), (1, 32))
  with pytest.raises(HostOpError, match="x must be"):
    a.matmul(np.zeros((2, 63), np.float32))


def _tiny_decoder(rng, kind, *, adjacent, family="swiglu", layer_kinds=None, dot="f32"):
  """2 layers in `kind` (or layer i's matrices in layer_kinds[i]); Q8_0 tied embedding."""
  d, f, n, k, hd, vocab = 64, 96, 4, 2, 16, 50
  ls = []
  for layer_kind in layer_kinds or [kind, kind]:
    mat = lambda rows, cols: _random_matrix(rng, layer_kind, rows, cols)  # noqa: E731
    ls.append(decoder_lib.HostLayer(
        attn_norm=rng.uniform(0.5, 1.5, d).astype(np.float32), qkv=mat((n + 2 * k) * hd, d),
        attn_out=mat(d, n * hd), ffn_norm=rng.uniform(0.5, 1.5, d).astype(np.float32),
        gate=mat(f, d), up=mat(f, d), down=mat(d, f)))
  emb = _random_matrix(rng, "q8_0", vocab, d)
  return decoder_lib.HostDecoder(emb, ls, rng.uniform(0.5, 1.5, d).astype(np.float32), emb,
                                 eps=1e-5, family=family, n_heads=n, n_kv_heads=k, head_dim=hd,
                                 rope_theta=10000.0, rope_dim=hd, rope_adjacent=adjacent, dot=dot)


def _masked_acts(rng, b, f, frac):
  """Random activations f32[b, f] kept on a mask: none (0.0), one neuron ("single"), a random
  fraction, or all (1.0). Returns (acts, keep)."""
  acts = rng.standard_normal((b, f)).astype(np.float32)
  if frac == "single":
    keep = np.zeros((b, f), bool)
    keep[:, f // 3] = True
  else:
    keep = rng.random((b, f)) < frac
  return np.where(keep, acts, np.float32(0.0)), keep


def _assert_logits_match(got, ref, dot):
  """f32: 2e-4 of the range. int8: f32 vs float64 activations can round a code the other way
  (a step of max|block| / 127), which a random model amplifies: measured <= 6.5e-3 of the range
  at most (1.3e-2 with a ReGLU gate mask) and 5.7e-4 on average, while against the f32-mode reference an int8 run is
  1.6e-2..5.8e-2 / 2.2e-3..6.1e-3 off, so the mean bound tells the two apart."""
  if dot == "int8" and qdot.AVAILABLE:
    err = np.abs(got - ref) / np.abs(ref).max()
    assert err.max() <= 2e-2 and err.mean() <= 1e-3, (err.max(), err.mean())
  else:
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())


@pytest.mark.parametrize("dot", ["f32", "int8"])
@pytest.mark.parametrize("kind,adjacent,family", [("q4_1", True, "swiglu"),
                                                  ("q8_0", False, "reglu"),
                                                  ("q4_1", False, "drelu")])
def test_decoder_prefill_then_decode_matches_reference(kind, adjacent, family, dot):
  """A 7-token prompt in one pass, then 4 single-token steps, equal the float64 reference
  over the whole 11-token sequence (RoPE, causal GQA attention, KV cache, FFN, head); with
  dot="int8" the reference quantizes every product's input as the integer kernels do."""
  rng = np.random.default_rng(7)
  dec = _tiny_decoder(rng, kind, adjacent=adjacent, family=family, dot=dot)
  assert dec.dot == (dot if qdot.AVAILABLE else "f32")
  tokens = rng.integers(0, 50, 11)
  ref = decoder_lib.decoder_reference(dec, tokens)
  cid = dec.new_cache(1, 16)
  got = [dec.forward(cid, tokens[None, :7], 0)]
  for i in range(7, 11):
    got.append(dec.forward(cid, tokens[None, i:i + 1], i))
  got = np.concatenate(got)
  _assert_logits_match(got, ref, dec.dot)
  if dec.dot == "int8":
    return
  # Selected rows of a batch of 2 identical sequences.
  cid = dec.new_cache(2, 16)
  two = dec.forward(cid, np.stack([tokens[:7], tokens[:7]]), 0, rows=[6, 13])
  np.testing.assert_allclose(two, np.stack([ref[6], ref[6]]), rtol=2e-4,
                             atol=2e-4 * np.abs(ref).max())


def _solo_and_batched(dec, a, b, prefill_a=10, prefill_b=7):
  """Sequences a and b (int arrays) each alone (a cache of one slot: prompt prefix in one pass,
  then one token per pass) and together (one cache of two slots: both prefixes in one ragged
  pass, then one pass per step carrying a token of each while both last, then a's rest alone).
  Returns (solo: [logits of a, logits of b], batched: the same), f32[len, V] each."""
  solo = []
  for seq, n in ((a, prefill_a), (b, prefill_b)):
    cache = dec.new_cache(1, 32)
    out = [dec.forward(cache, seq[None, :n], 0)]
    out += [dec.forward(cache, seq[None, i:i + 1], i) for i in range(n, len(seq))]
    solo.append(np.concatenate(out))
  cache = dec.new_cache(2, 32)
  both = dec.forward_rows(cache, np.concatenate([a[:prefill_a], b[:prefill_b]]),
                          [0] * prefill_a + [1] * prefill_b,
                          np.concatenate([np.arange(prefill_a), np.arange(prefill_b)]))
  got = [[both[:prefill_a]], [both[prefill_a:]]]
  ia, ib = prefill_a, prefill_b
  while ia < len(a):
    if ib < len(b):  # One token of each sequence, at its own position.
      out = dec.forward_rows(cache, [a[ia], b[ib]], [0, 1], [ia, ib])
      got[0].append(out[:1])
      got[1].append(out[1:])
      ib += 1
    else:  # b has finished: a goes on alone in the same cache.
      got[0].append(dec.forward_rows(cache, [a[ia]], [0], [ia]))
    ia += 1
  return solo, [np.concatenate(g) for g in got]


@pytest.mark.parametrize("dot", ["f32", "int8"])
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("family,down", [(None, None), ("swiglu", "q8_0"), ("drelu", "q8_0"),
                                         ("swiglu", "default"), ("drelu", "default"),
                                         ("reglu", "q8_0")])
def test_decoder_batched_rows_equal_solo_runs(kind, dot, family, down):
  """Two sequences of different lengths run together (one ragged prefill pass, then decode
  passes of one token each, the shorter one finishing first) give each sequence's logits of
  its run alone: bit for bit with int8 products (every kernel's output depends on its own row
  only); with f32 products (fastmath: numba vectorizes the f32 dots per call shape, and
  prefills of more than `pool.GEMV_MAX_ROWS` rows take the tiled kernel) to 1e-5. Dense (family
  None) and with the gate-first FFN (calibrated SwiGLU cuts, exact ReLU families; Q8_0
  neuron-major down rows, and the default: the file's own blocks for Q4_1 layers). The layers'
  matrices are views of one aligned pool, and the phase counters (`--profile_layers`) count every phase of every layer without changing results."""
  rng = np.random.default_rng(5)
  dec = _tiny_decoder(rng, kind, adjacent=True, dot=dot, family=family or "swiglu")
  assert dec.pool.pool.ctypes.data % 64 == 0
  for layer in dec.layers:
    for name in decoder_lib.ROLES:
      role = getattr(layer, name)
      assert all(np.shares_memory(part.stored(), dec.pool.pool) for part in role.parts)
  if family is not None:
    cuts = dec.calibrate_gate_cuts([rng.integers(0, 50, 12) for _ in range(3)], 0.4)
    dec.enable_gated(cuts, down_format=None if down == "default" else down)
    assert dec.down_format == (down if down != "default" else "file" if kind == "q4_1" else "q8_0")
    assert all(a.ctypes.data % 64 == 0 for a in dec._stacked_down_t)
  a, b = rng.integers(0, 50, 14), rng.integers(0, 50, 10)
  phases = np.zeros((dec.n_layers, len(decoder_lib.PHASES)), np.int64)
  dec.phase_cycles = phases
  solo, batched = _solo_and_batched(dec, a, b)
  predictor = decoder_lib.PHASES.index("predictor")  # Timed by the predicted FFN only.
  assert (np.delete(phases, predictor, axis=1) > 0).all() and (phases[:, predictor] == 0).all()
  dec.phase_cycles = None
  unphased, _ = _solo_and_batched(dec, a, b)
  for s, u in zip(solo, unphased):
    np.testing.assert_array_equal(s, u)
  for s, g, n in zip(solo, batched, (10, 7)):
    if dec.dot == "int8":
      np.testing.assert_array_equal(g, s)
    else:
      np.testing.assert_allclose(g, s, rtol=1e-5, atol=1e-5 * np.abs(s).max())
  if family is None:
    assert (dec.last_active == 1).all()
  else:
    assert (dec.last_active > 0).all() and (dec.last_active < 1).all()
  if family in ("drelu", "reglu"):
    # The gated up pass reads the records: their up scales moved between neurons move the
    # logits; put back, the logits are back.
    scales = dec._up[1][0]
    saved = scales.copy()
    def prefill():
      return dec.forward(dec.new_cache(1, 16), a[None, :10], 0)
    scales[...] = np.roll(saved, 1, axis=0)
    assert not np.array_equal(prefill(), solo[0][:10])
    scales[...] = saved
    np.testing.assert_array_equal(prefill(), solo[0][:10])
  for bad in (np.zeros((dec.n_layers, 2), np.int64), np.zeros(phases.shape, np.int32)):
    dec.phase_cycles = bad
    with pytest.raises(HostOpError, match="phase_cycles"):
      dec.forward(dec.new_cache(2, 16), a[None, :1], 0)
  dec.phase_cycles = None
  cache = dec.new_cache(2, 16)
  for bad in (([1, 2], [0], [0, 1]), ([1, 2], [0, 0], [3, 3]), ([1], [2], [0]), ([1], [0], [16]),
              ([], [], [])):
    with pytest.raises(HostOpError, match="forward_rows|outside the KV cache"):
      dec.forward_rows(cache, *bad)


def test_forward_rows_refuses_what_it_would_misread():
  """Non-integer ids, slots, positions or rows (floats, bools, strings), rows out of range, a
  cache whose values differ from its keys (shape, dtype, read-only), and a cache larger than the
  machine's memory are HostOpErrors: nothing is rounded, wrapped or written out of bounds."""
  rng = np.random.default_rng(3)
  dec = _tiny_decoder(rng, "q4_1", adjacent=True)
  cache = dec.new_cache(2, 16)
  good = dict(tokens=[1, 2], slots=[0, 1], positions=[3, 3])
  bad = [dict(tokens=[1.7, 2]), dict(slots=[0.5, 1]), dict(positions=[1.9, 3]),
         dict(tokens=[True, 2]), dict(tokens=["a", "b"]), dict(tokens=[None, 1]),
         dict(positions=[float("nan"), 1]), dict(rows=[-1]), dict(rows=[2]), dict(rows=[0.5]),
         dict(rows=[True]), dict(rows=[])]
  for change in bad:
    with pytest.raises(HostOpError, match="forward_rows"):
      dec.forward_rows(cache, **{**good, **change})
  got = dec.forward_rows(cache, **good, rows=[1])
  assert got.shape == (1, dec.vocab_size)
  for v in (cache.v[:, :1].copy(), cache.v.astype(np.float64), np.zeros_like(cache.v)[..., :8]):
    with pytest.raises(HostOpError, match="HostKVCache"):
      dec.forward_rows(decoder_lib.HostKVCache(cache.k, v), **good)
  frozen = cache.v.copy()
  frozen.flags.writeable = False
  with pytest.raises(HostOpError, match="HostKVCache"):
    dec.forward_rows(decoder_lib.HostKVCache(cache.k, frozen), **good)
  with pytest.raises(HostOpError, match="KV cache of .* GiB"):
    dec.new_cache(2 ** 40, 16)


def test_decoder_mixed_formats_match_reference():
  """Layers whose formats differ share the pool and the one layer body; the decoder still
  matches the reference."""
  rng = np.random.default_rng(6)
  dec = _tiny_decoder(rng, "q4_1", adjacent=False, layer_kinds=["q4_1", "q8_0"])
  tokens = rng.integers(0, 50, 9)
  ref = decoder_lib.decoder_reference(dec, tokens)
  got = dec.forward(dec.new_cache(1, 9), tokens[None], 0)
  _assert_logits_match(got, ref, dec.dot)


def test_quantize_q4_1_matches_gguf_quantizer():
  """`qmatmul.quantize_q4_1` writes the bytes gguf's own Q4_1 quantizer writes (random rows,
  a constant block, a zero block)."""
  rng = np.random.default_rng(12)
  rows = rng.standard_normal((37, 96)).astype(np.float32)
  rows[3, 32:64] = 0.25
  rows[5, :32] = 0.0
  w = qmatmul.quantize_q4_1(rows, chunk_rows=8)
  raw = gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q4_1).reshape(37, 3, 20)
  np.testing.assert_array_equal(w.arrays[1], raw[:, :, 0:2].copy().view(np.uint16)[..., 0])
  np.testing.assert_array_equal(w.arrays[2], raw[:, :, 2:4].copy().view(np.uint16)[..., 0])
  np.testing.assert_array_equal(w.arrays[0], raw[:, :, 4:].reshape(37, 48))
  with pytest.raises(HostOpError):
    qmatmul.quantize_q4_1(rows[:, :40])


@pytest.mark.parametrize("dot", ["f32", "int8"])
@pytest.mark.parametrize("f,dim,b", [(96, 64, 3), (77, 160, 2)])
def test_down_pass_matches_reference(dot, f, dim, b):
  """The down pass over neuron-major Q8_0 rows (`gated_ffn.down_pass`) on random rows and
  random activations: empty, single, partial (odd counts, so the four-row tail runs) and full
  active sets, against `down_reference` and the exact product."""
  from host_ops import gated_ffn
  rng = np.random.default_rng(13)
  rows = rng.standard_normal((f, dim)).astype(np.float32)
  down_t = qmatmul.quantize_q8_0(rows)
  exact_rows = qmatmul.dequantize_reference(down_t)
  for frac in (0.0, "single", 0.37, 1.0):
    acts, keep = _masked_acts(rng, b, f, frac)
    y, counts = gated_ffn.down_pass(acts, down_t.arrays, 2, np.int64(32), dot == "int8")
    np.testing.assert_array_equal(counts, keep.sum(axis=1))
    ref = gated_ffn.down_reference(acts, down_t, dot=dot)
    scale = max(1.0, np.abs(ref).max())
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * scale)
    exact = acts.astype(np.float64) @ exact_rows
    if frac == 0.0:
      assert (y == 0).all()
    else:
      assert np.linalg.norm(y - exact) <= 1e-5 * np.linalg.norm(exact)


@pytest.mark.parametrize("dot", ["f32", "int8"])
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("family,cut", [("swiglu", 0.05), ("swiglu", 0.0), ("reglu", 0.0),
                                        ("drelu", 0.0), ("swiglu", 1e9)])
def test_gated_ffn_matches_reference(kind, family, cut, dot):
  """Gate-first sparse FFN on random blocks, Q8_0 down rows: full (cut 0), partial and empty
  active sets; with dot="int8" the up rows are integer dots on h quantized per block (so is the
  reference)."""
  from host_ops import gated_ffn
  rng = np.random.default_rng(11)
  up = _random_matrix(rng, kind, 96, 64)
  rows = rng.standard_normal((96, 64)).astype(np.float32)
  down_t = qmatmul.quantize_q8_0(rows)
  h = rng.standard_normal((3, 64)).astype(np.float32)
  g = rng.standard_normal((3, 96)).astype(np.float32)
  y, active, passed = gated_ffn.gated_ffn(g, h, up, down_t, cut=cut, family=family, dot=dot)
  ref, ref_active, ref_passed = gated_ffn.gated_ffn_reference(g, h, up, down_t, cut=cut,
                                                              family=family, dot=dot)
  np.testing.assert_array_equal(active, ref_active)
  np.testing.assert_array_equal(passed, ref_passed)
  assert (passed >= active).all()
  if family == "drelu":  # Up rows read for g > 0; down rows only where u > 0 too.
    assert (passed > active).all()
  np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(ref).max()))
  if cut >= 1e9:
    assert (active == 0).all() and (y == 0).all()
  if family == "swiglu" and cut == 0.0:
    assert (active == 96).all()
  if family != "swiglu":
    assert (active < 96).all() and (active > 0).all()
  with pytest.raises(HostOpError):
    gated_ffn.gated_ffn(g, h, up, down_t.take_rows(np.arange(95)), cut=cut, family=family)
  with pytest.raises(HostOpError):
    gated_ffn.gated_ffn(g, h, up, down_t, cut=float("nan"), family=family)


@pytest.mark.parametrize("family,dot", [("swiglu", "f32"), ("swiglu", "int8"), ("drelu", "int8")])
def test_gated_ffn_contribution_cut_matches_reference(family, dot):
  """The contribution cut keeps the down rows of neurons with |act(g, u)| >= cut only: against
  the float64 reference on random blocks (a cut halfway between two of the reference's |act|,
  so no neuron sits on it), the empty set (a huge cut), and cut 0 equal to no cut at all."""
  from host_ops import gated_ffn
  rng = np.random.default_rng(13)
  up = _random_matrix(rng, "q4_1", 96, 64)
  rows = rng.standard_normal((96, 64)).astype(np.float32)
  down_t = qmatmul.quantize_q8_0(rows)
  h = rng.standard_normal((3, 64)).astype(np.float32)
  g = rng.standard_normal((3, 96)).astype(np.float32)
  if dot == "int8" and qdot.AVAILABLE:
    u = qdot.matmul_reference(up.kind, up.arrays, h).astype(np.float64)
  else:
    u = h.astype(np.float64) @ qmatmul.dequantize_reference(up).T
  acts = np.sort(np.abs(common.activation_reference(g.astype(np.float64), u, family)).ravel())
  acts = acts[acts > 0]
  k = len(acts) // 2
  cut = float(acts[k - 1] + acts[k]) / 2
  run = lambda c: gated_ffn.gated_ffn(g, h, up, down_t, cut=0.0, family=family, dot=dot,  # noqa
                                      contribution_cut=c)
  y, active, passed = run(cut)
  ref, ref_active, ref_passed = gated_ffn.gated_ffn_reference(
      g, h, up, down_t, cut=0.0, family=family, dot=dot, contribution_cut=cut)
  np.testing.assert_array_equal(active, ref_active)
  np.testing.assert_array_equal(passed, ref_passed)
  assert active.sum() == len(acts) - k and (active < passed).all() and (active > 0).all()
  if family == "swiglu":
    assert (passed == 96).all()  # Gate cut 0: every up row read.
  np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(ref).max()))
  y0, active0, _ = run(0.0)
  plain = gated_ffn.gated_ffn(g, h, up, down_t, cut=0.0, family=family, dot=dot)
  np.testing.assert_array_equal(y0, plain[0])
  np.testing.assert_array_equal(active0, plain[1])
  y_none, active_none, passed_none = run(1e9)
  assert (active_none == 0).all() and (y_none == 0).all() and (passed_none == passed).all()
  for bad in (float("nan"), -1.0, float("inf"), 1e300, None, "0.1", True, np.array([0.1, 0.2])):
    with pytest.raises(HostOpError, match="contribution_cut"):
      run(bad)


@pytest.mark.parametrize("dot", ["f32", "int8"])
def test_decoder_contribution_cuts_match_reference(dot):
  """SwiGLU with calibrated contribution cuts (gate cuts 0): every up row read, about the
  calibrated fraction of down rows skipped; the decoder equals the float64 reference decoder
  with the same masks (prefill then decode)."""
  rng = np.random.default_rng(5)
  dec = _tiny_decoder(rng, "q4_1", adjacent=True, family="swiglu", dot=dot)
  calib = [rng.integers(0, 50, 12) for _ in range(3)]
  ccuts = dec.calibrate_gate_cuts(calib, 0.5, contribution=True)
  assert all(c > 0 for c in ccuts)
  assert ccuts != dec.calibrate_gate_cuts(calib, 0.5)  # |act(g, u)|, not |silu(g)|.
  dec.enable_gated([0.0, 0.0], contribution_cuts=ccuts)
  assert dec.contribution_cuts == ccuts and dec.gate_cuts == [0.0, 0.0]
  tokens = rng.integers(0, 50, 9)
  ref = decoder_lib.decoder_reference(dec, tokens)
  cid = dec.new_cache(1, 16)
  got = [dec.forward(cid, tokens[None, :6], 0)]
  for i in range(6, 9):
    got.append(dec.forward(cid, tokens[None, i:i + 1], i))
    assert 0.2 < dec.last_active.mean() < 0.8 and (dec.last_passed == 1.0).all()
  _assert_logits_match(np.concatenate(got), ref, dec.dot)
  dec.enable_gated(None)
  assert dec.contribution_cuts is None and dec.gate_cuts is None
  for bad in ([0.1], [None, None], ["x", "x"], 0.5, [1e300, 1.0], [0.1, -0.1]):
    with pytest.raises(HostOpError, match="contribution_cuts"):
      dec.enable_gated([0.0, 0.0], contribution_cuts=bad)
    assert dec.gate_cuts is None  # A refused call changes nothing.
  with pytest.raises(HostOpError, match="contribution_cuts need cuts"):
    dec.enable_gated(None, contribution_cuts=ccuts)
  with pytest.raises(HostOpError, match="at least one chunk"):
    dec.calibrate_gate_cuts([], 0.5, contribution=True)


@pytest.mark.parametrize("dot", ["f32", "int8"])
@pytest.mark.parametrize("family", ["swiglu", "reglu", "drelu"])
def test_decoder_gated_matches_reference(family, dot):
  """The decoder with the gate-first FFN (calibrated cuts for SwiGLU) equals the float64
  reference decoder with the same masks, prefill then decode."""
  rng = np.random.default_rng(5)
  dec = _tiny_decoder(rng, "q4_1", adjacent=True, family=family, dot=dot)
  cuts = dec.calibrate_gate_cuts([rng.integers(0, 50, 12) for _ in range(3)], 0.5)
  assert all(c > 0 for c in cuts)
  dec.enable_gated(cuts if family == "swiglu" else [0.0, 0.0])
  tokens = rng.integers(0, 50, 9)
  ref = decoder_lib.decoder_reference(dec, tokens)
  cid = dec.new_cache(1, 16)
  got = [dec.forward(cid, tokens[None, :6], 0)]
  for i in range(6, 9):
    got.append(dec.forward(cid, tokens[None, i:i + 1], i))
    assert 0.0 < dec.last_active.mean() < 1.0
  _assert_logits_match(np.concatenate(got), ref, dec.dot)
  dense = dec.bytes_per_token()
  assert dec.bytes_per_token(0.5) < dense
  # Bytes count up rows for the neurons whose gate passed: dReLU reads more up rows than down.
  active_sum, passed_sum = dec.read_sums
  if family == "drelu":
    assert passed_sum > active_sum > 0
  else:
    assert passed_sum == pytest.approx(active_sum)
  gate = sum(layer.gate.file_bytes() for layer in dec.layers)
  up = sum(layer.up.file_bytes() for layer in dec.layers)
  weights = sum(layer.down.shape[0] * layer.down.shape[1] for layer in dec.layers)
  assert dec.down_format == "file"  # The default for Q4_1 down projections.
  dec.enable_gated(dec.gate_cuts, down_format="q8_0")  # 34 bytes per 32 weights.
  down_t = weights // 32 * 34
  assert dec.ffn_bytes_per_token(0.25, 0.5) == pytest.approx(gate + 0.5 * up + 0.25 * down_t,
                                                             abs=1)
  assert dec.ffn_bytes_per_token(0.25) == pytest.approx(
      gate + 0.25 * passed_sum / active_sum * up + 0.25 * down_t, abs=1)
  # Back to the file's own blocks (16 bytes per 32 of an active neuron, 4 for every neuron's
  # scales), against the reference with those rows.
  dec.enable_gated(dec.gate_cuts, down_format="file")
  assert dec.down_format == "file"
  assert dec.ffn_bytes_per_token(0.25, 0.5) == pytest.approx(
      gate + 0.5 * up + 0.25 * weights // 32 * 16 + weights // 32 * 4, abs=1)
  cid = dec.new_cache(1, 16)  # Passes of <= 8 rows, as the reference's int8 products model.
  got = [dec.forward(cid, tokens[None, :6], 0)]
  got += [dec.forward(cid, tokens[None, i:i + 1], i) for i in range(6, 9)]
  _assert_logits_match(np.concatenate(got), decoder_lib.decoder_reference(dec, tokens), dec.dot)
  with pytest.raises(HostOpError):
    dec.enable_gated(dec.gate_cuts, down_format="q4_1")  # Re-quantized Q4_1 rows: removed.
  dec.enable_gated(None)
  assert dec.gate_cuts is None and dec.bytes_per_token() == dense
  with pytest.raises(HostOpError):
    dec.enable_gated([0.1])


@pytest.mark.parametrize("family", ["swiglu", "drelu"])
def test_decoder_nbytes_counts_the_sparse_copies(family):
  """`nbytes` grows by the neuron-major down rows (file layout: F x D/2 codes plus the f16 d
  and m of every 32 neurons and output) and the up rows (ReLU families: records, each row's
  codes and scales on whole cache lines; SwiGLU: split arrays); they stay counted while the sparse FFN is off."""
  rng = np.random.default_rng(11)
  dec = _tiny_decoder(rng, "q4_1", adjacent=True, family=family)
  dense = dec.nbytes()
  assert dec.sparse_nbytes() == 0
  dec.enable_gated([0.0, 0.0])
  f, dim = dec.layers[0].down.shape[1], dec.layers[0].down.shape[0]
  down_t = 2 * (f * dim // 2 + f // 32 * 2 * dim * 2)
  # Up rows: ReLU families one record per row (16 code + 2 d + 2 m bytes -> one 64-byte line);
  # SwiGLU the split Q4_1 arrays, as many bytes as the file's (the pool holds them packed).
  up_rows = 2 * f * 64 if family == "drelu" else sum(l.up.file_bytes() for l in dec.layers)
  assert dec.sparse_nbytes() == down_t + up_rows
  assert dec.nbytes() == dense + down_t + up_rows
  dec.enable_gated(None)
  assert dec.nbytes() == dense + down_t + up_rows


def test_decoder_caches_are_independent_and_checked():
  """Two caches of one decoder interleave: each sequence equals its own reference; a cache
  that does not fit, or is not a HostKVCache, is refused."""
  rng = np.random.default_rng(3)
  dec = _tiny_decoder(rng, "q4_1", adjacent=True)
  a_tok, b_tok = rng.integers(0, 50, 6), rng.integers(0, 50, 6)
  ca, cb = dec.new_cache(1, 8), dec.new_cache(1, 8)
  got_a = [dec.forward(ca, a_tok[None, :3], 0)]
  got_b = [dec.forward(cb, b_tok[None, :4], 0)]
  for i in range(3, 6):  # Interleaved single-token steps.
    got_a.append(dec.forward(ca, a_tok[None, i:i + 1], i))
    if i + 1 < 6:
      got_b.append(dec.forward(cb, b_tok[None, i + 1:i + 2], i + 1))
  for got, tok in ((got_a, a_tok), (got_b, b_tok)):
    ref = decoder_lib.decoder_reference(dec, tok)
    np.testing.assert_allclose(np.concatenate(got), ref, rtol=2e-4,
                               atol=2e-4 * np.abs(ref).max())
  with pytest.raises(HostOpError, match="do not fit"):
    dec.forward(ca, np.zeros((1, 4), np.int64), 6)
  with pytest.raises(HostOpError, match="out of range"):
    dec.forward(ca, np.full((1, 1), 50), 0)
  with pytest.raises(HostOpError, match="HostKVCache"):
    dec.forward(7, np.zeros((1, 1), np.int64), 0)


# ------------------------------------------------------------------ the real model
@pytest.fixture(scope="module")
def host_model(smollm2_path):
  import pijax
  model = pijax.load(smollm2_path, max_seq_len=512)
  assert model.configure_host_weights("auto") == "gguf"  # CPU backend, Q4_1/Q8_0 file.
  return model


@pytest.mark.slow
def test_host_weights_match_transformers(host_model, hf_model, hf_tokenizer):
  """Logits of the host path (Q4_1 blocks kept) with f32 products equal transformers' f32 model
  on the GGUF; with int8 products (the default, prefill included) they stay close."""
  import torch
  dec = host_model.backend.decoder
  assert {w.kind for layer in dec.layers for w in layer.matrices()} == {"q4_1"}
  assert dec.lm_head.kind == "q8_0" and dec.bytes_per_token() < 100e6
  for prompt in ("The capital of France is", "def fibonacci(n):\n    if n <= 1:"):
    ids = hf_tokenizer.encode(prompt)
    with torch.no_grad():
      ref = hf_model(torch.tensor([ids])).logits[0].float().numpy()
    int8 = host_model.prompt_logits(ids)
    dec.dot = "f32"
    try:
      ours = host_model.prompt_logits(ids)
    finally:
      dec.dot = "int8"
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    assert np.abs(ours - ref).max() <= 1e-3 * np.abs(ref).max()
    if dec.dot == "int8":
      assert (int8.argmax(-1) == ref.argmax(-1)).mean() >= 0.8
      assert np.abs(int8 - ref).max() <= 0.1 * np.abs(ref).max()
  result = host_model.generate("The capital of France is", max_new_tokens=8, temperature=0.0)
  assert "Paris" in result.text


@pytest.mark.slow
def test_int8_decode_close_to_f32(host_model):
  """The default int8 decode products (activations quantized per block, llama.cpp's arithmetic)
  against the f32 ones, teacher-forced one token per pass over 128 WikiText-2 tokens: mean KL
  divergence and top-1 agreement (scripts/decode_quality.py over 512 tokens: KLD 0.0027,
  97.5%, perplexity 28.91 vs 28.75; with Q4_1's offset term on the exact x sums, a design a
  tester caught, it was 0.0135 and 93.2%)."""
  dec = host_model.backend.decoder
  if not qdot.AVAILABLE:
    assert dec.dot == "f32"
    return
  assert dec.dot == "int8"
  text = (ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw").read_text()
  ids = host_model.tokenizer.encode(text[:20000], add_special=False)[:128]
  logp = {}
  try:
    for dot in ("f32", "int8"):
      dec.dot = dot
      cache = dec.new_cache(1, len(ids))
      z = np.stack([dec.forward(cache, np.asarray([[t]]), i)[0] for i, t in enumerate(ids)])
      z = z.astype(np.float64) - z.max(-1, keepdims=True)
      logp[dot] = z - np.log(np.exp(z).sum(-1, keepdims=True))
  finally:
    dec.dot = "int8"
  # The same 128 tokens in one int8 prefill pass: each row's products are those of its
  # decode step (per-row kernels), so the logits are the token-by-token ones.
  whole = dec.forward(dec.new_cache(1, len(ids)), np.asarray([ids]), 0)
  z = whole.astype(np.float64) - whole.max(-1, keepdims=True)
  np.testing.assert_allclose(z - np.log(np.exp(z).sum(-1, keepdims=True)), logp["int8"],
                             atol=1e-4)
  kld = (np.exp(logp["f32"]) * (logp["f32"] - logp["int8"])).sum(-1)
  agree = (logp["f32"].argmax(-1) == logp["int8"].argmax(-1)).mean()
  print(f"int8 vs f32: mean KLD {kld.mean():.5f}, top-1 {agree:.3f}")
  assert kld.mean() <= 0.01 and agree >= 0.9, (kld.mean(), agree)
  result = host_model.generate("The capital of France is", max_new_tokens=8, temperature=0.0)
  assert "Paris" in result.text


@pytest.mark.slow
def test_host_weights_decode_compiled_once(host_model):
  """Decoding across KV-length buckets (250-token prompt + 20 tokens > 256) compiles one decode
  executable: the host attends exactly [0, pos + 1)."""
  ids = host_model.encode_prompt(" ".join(["word"] * 400))[:250]
  host_model.use_backend(host_model.backend)  # Drops the compiled steps.
  result = host_model.generate(ids, max_new_tokens=20, temperature=0.8, seed=3)
  assert len(result.token_ids) >= 8  # Decode positions 250.. cross the 256 bucket.
  assert host_model.compile_count("decode") == 1


@pytest.mark.slow
def test_q8_0_host_weights_close_to_f32(smollm2_path, hf_model, hf_tokenizer):
  """Every matrix re-quantized to Q8_0 (8-bit blocks of the 4-bit values), f32 products: top-1
  kept at >= 90% of positions, logits within 5% of the oracle's range, 1% on average (measured
  3.5% / 0.57%).
  Its perplexity is in BUILD_NOTES.md."""
  import torch
  import pijax
  model = pijax.load(smollm2_path, max_seq_len=256)
  assert model.configure_host_weights("q8_0") == "q8_0"
  ids = hf_tokenizer.encode("Once upon a time, in a small village by the sea,")
  with torch.no_grad():
    ref = hf_model(torch.tensor([ids])).logits[0].float().numpy()
  int8 = model.prompt_logits(ids)
  model.backend.decoder.dot = "f32"  # The weights' own error: f32 products.
  ours = model.prompt_logits(ids)
  assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
  assert np.abs(ours - ref).max() <= 5e-2 * np.abs(ref).max()
  assert np.abs(ours - ref).mean() <= 1e-2 * np.abs(ref).max()
  # int8 products on top (the default; measured 5.7% / 0.8%).
  assert (int8.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
  assert np.abs(int8 - ref).max() <= 1e-1 * np.abs(ref).max()
  assert np.abs(int8 - ref).mean() <= 1.5e-2 * np.abs(ref).max()
  assert model.configure_host_weights("off") == "off" and model.backend.name == "xla"


def _cli(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=900)


@pytest.mark.slow
def test_cli_host_weights():
  proc = _cli("-m", "pijax.generate", "--config=configs/smollm2_135m.py",
              "--prompt=The capital of France is", "--max_new_tokens=6", "--temperature=0")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "Paris" in proc.stdout and "weights: q4_1+q8_0 host int8" in proc.stderr
  proc = _cli("-m", "pijax.bench", "-m", "default", "-p", "8", "-n", "4", "-r", "1",
              "--host_weights=q8_0")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "| q8_0 host int8 |" in proc.stdout
  proc = _cli("-m", "pijax.bench", "-m", "default", "-n", "4", "--host_weights=q5")
  assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
  proc = _cli("-m", "pijax.bench", "-m", "default", "-n", "4", "--host_dot=f32",
              "--host_weights=off")
  assert proc.returncode == 2 and "drop --host_dot" in proc.stderr
  proc = _cli("-m", "pijax.bench", "-m", "default", "-n", "4", "--host_dot=int4")
  assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
  assert "host_dot" in proc.stderr and "Traceback" not in proc.stderr


# ------------------------------------------------------------------ choice, lifetime, errors
def test_auto_needs_every_matrix_block_quantized(tmp_path):
  """auto: Q4_1 layers with a Q8_0 tied embedding -> gguf, equal to the XLA path with f32
  products, to the int8 reference with int8; the same
  layers with an F32 embedding/head (no host kernel reads F32 matrices) -> off."""
  import pijax
  import tiny_models
  good = tiny_models.write_random_quantized_gguf(tmp_path / "q41_q8.gguf")
  model = pijax.load(good, max_seq_len=64)
  ref = model.prompt_logits([0, 5, 9, 77, 3])
  assert model.configure_host_weights("auto") == "gguf"
  got = model.prompt_logits([0, 5, 9, 77, 3])  # int8 products (the default): the reference's.
  _assert_logits_match(got, decoder_lib.decoder_reference(model.backend.decoder,
                                                          [0, 5, 9, 77, 3]), "int8")
  model.backend.decoder.dot = "f32"  # The same weights with f32 products: equal to rounding.
  got = model.prompt_logits([0, 5, 9, 77, 3])
  np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
  mixed = tiny_models.write_random_quantized_gguf(tmp_path / "q41_f32.gguf", embd_type="F32",
                                                  output_type="F32")
  model = pijax.load(mixed, max_seq_len=64)
  assert model.configure_host_weights("auto") == "off"
  assert model.configure_host_weights("gguf") == "gguf"  # Asked for: F32 ones re-quantized.
  assert model.backend.decoder.lm_head.kind == "q8_0"


def test_interleaved_generations_and_reconfigure(tmp_path):
  """Two generations of one host-weights model interleave and equal separate runs; each
  releases its host KV cache; reconfiguring mid-generation raises instead of mixing states."""
  import pijax
  import tiny_models
  from pijax.errors import ConfigError, ContextError
  path = tiny_models.write_random_quantized_gguf(tmp_path / "m.gguf")
  model = pijax.load(path, max_seq_len=64)
  model.configure_host_weights("gguf")
  alone = [model.generate(p, max_new_tokens=6, temperature=0.0).token_ids
           for p in ([0, 5, 9], [0, 7])]
  first = model.stream([0, 5, 9], max_new_tokens=6, temperature=0.0)
  second = model.stream([0, 7], max_new_tokens=6, temperature=0.0)
  for _ in range(2):
    next(first, None)
    next(second, None)
  list(first)
  list(second)
  assert [first.result.token_ids, second.result.token_ids] == alone
  assert model.backend.live_states == 0
  # A failed switch to a sparse mode (plain GGUF) leaves the host weights on.
  with pytest.raises(ConfigError):
    model.configure_sparse("oracle")
  assert model.host_weights == "gguf"
  third = model.stream([0, 5], max_new_tokens=6, temperature=0.0)
  next(third)
  model.configure_host_weights("off")
  with pytest.raises(ContextError, match="reconfigured"):
    list(third)


@pytest.mark.parametrize("prog,args", [
    ("pijax.serve", ["--model=default", "--host_dot=int8", "--host_weights=off"]),
    ("pijax.generate", ["--config=configs/smollm2_135m.py", "--host_dot=f32",
                        "--host_weights=off", "--prompt=hi"])])
def test_host_dot_combinations_refused_before_loading(prog, args):
  """Refused by the model-free flag check: one line, exit 2, and the server never starts
  loading (it printed 'listening' and loaded the model first, found by a tester)."""
  proc = _cli("-m", prog, *args)
  assert proc.returncode == 2 and "--host_dot" in proc.stderr
  assert len(proc.stderr.strip().splitlines()) == 1 and "listening" not in proc.stderr


@pytest.mark.parametrize("prog,args,names", [
    ("pijax.serve", ["--model=default", "--gate_down=q8_0"], ("--gate_down", "--sparse=gate")),
    ("pijax.bench", ["-m", "default", "--gate_down=file", "--sparse=off"],
     ("--gate_down", "--sparse=off")),
    ("pijax.serve", ["--model=default", "--sparse=gate", "--host_weights=off"],
     ("--sparse=gate", "--host_weights=off")),
    ("pijax.serve", ["--model=default", "--sparse=contribution"],
     ("--sparse=contribution", "--calibration_file")),
    ("pijax.serve", ["--model=default", "--sparse=contribution",
                     "--calibration_file=/nonexistent/cal.txt"], ("--calibration_file",)),
    ("pijax.serve", ["--model=default", "--sparse=oracle"], ("--sparse=oracle", "bundle")),
    ("pijax.generate", ["--config=configs/smollm2_135m.py", "--sparse=predictor",
                        "--prompt=hi"], ("--sparse=predictor", "pijax.convert")),
    # The flags --sparse replaced: one line naming it.
    ("pijax.serve", ["--model=default", "--gate_sparse"], ("--gate_sparse", "--sparse=gate")),
    ("pijax.generate", ["--config=configs/smollm2_135m.py", "--gate_rule=gate", "--prompt=hi"],
     ("--gate_rule", "--sparse=contribution")),
    ("pijax.bench", ["-m", "default", "--sparse=nope"], ("--sparse",)),
    ("pijax.perplexity", ["-m", "default", "-f", "../shared/data/tinyshakespeare/input.txt",
                          "--sparse=gate", "--calibration_file=../shared/data/tinyshakespeare/"
                          "input.txt"], ("--calibration_file", "evaluation text"))])
def test_gate_flag_combinations_refused_before_loading(prog, args, names):
  """One sparse vocabulary (`pijax.sparse_modes`): gate options without --sparse=gate or
  contribution, a host mode with --host_weights=off, a bundle mode on a plain GGUF, the
  removed --gate_sparse / --gate_rule: one line naming the flags, exit 2, before the server
  listens (a tester found two lines, the first 'listening')."""
  proc = _cli("-m", prog, *args)
  assert proc.returncode == 2 and all(n in proc.stderr for n in names), proc.stderr
  assert len(proc.stderr.strip().splitlines()) == 1 and "listening" not in proc.stderr


@pytest.mark.parametrize("prog,model_flag", [("pijax.serve", "--model"), ("pijax.bench", "-m")])
def test_file_down_rows_of_another_type_refused_before_loading(tmp_path, prog, model_flag):
  """--gate_down=file on a file whose down projections are not Q4_1: refused from the file's
  header, one line naming the types, before the server listens (it was refused only after the
  weights had loaded, in the server's loader thread)."""
  import tiny_models
  path = tiny_models.write_random_quantized_gguf(tmp_path / "q8.gguf", layer_type="Q8_0")
  proc = _cli("-m", prog, model_flag, str(path), "--sparse=gate", "--gate_down=file")
  assert proc.returncode == 2 and "--gate_down=file" in proc.stderr and "Q8_0" in proc.stderr
  assert len(proc.stderr.strip().splitlines()) == 1 and "listening" not in proc.stderr


def test_failed_down_format_switch_leaves_the_sparse_ffn_off(monkeypatch):
  """A format switch that fails part way (here the second layer's quantization) leaves the
  gate-first FFN off and the decoder dense, never half-built rows under the old format (a
  tester found finite, wrong logits); the old rows are not held beside the new ones."""
  rng = np.random.default_rng(5)
  dec = _tiny_decoder(rng, "q4_1", adjacent=True, dot="int8", family="drelu")
  tokens = rng.integers(0, 50, (1, 5))
  dense = dec.forward(dec.new_cache(1, 8), tokens, 0)
  dec.enable_gated([0.0, 0.0], down_format="file")
  calls = []
  real = qmatmul.quantize_q8_0

  def failing(rows, *args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
      raise MemoryError("test")
    return real(rows, *args, **kwargs)

  monkeypatch.setattr(qmatmul, "quantize_q8_0", failing)
  with pytest.raises(MemoryError):
    dec.enable_gated([0.0, 0.0], down_format="q8_0")
  assert dec.gate_cuts is None and dec.down_format is None
  np.testing.assert_array_equal(dec.forward(dec.new_cache(1, 8), tokens, 0), dense)
  monkeypatch.setattr(qmatmul, "quantize_q8_0", real)
  dec.enable_gated([0.0, 0.0], down_format="q8_0")
  got = dec.forward(dec.new_cache(1, 8), tokens, 0)
  _assert_logits_match(got, decoder_lib.decoder_reference(dec, tokens[0]), dec.dot)
  for gone in ("q5_0", "q4_1"):  # q4_1: re-quantized Q4_1 rows were removed (issue 33).
    with pytest.raises(HostOpError):
      dec.enable_gated(None, down_format=gone)


@pytest.mark.parametrize("dot", ["f32", "int8"])
@pytest.mark.parametrize("f,dim,b", [(96, 64, 3), (160, 96, 2), (96, 1600, 2)])
def test_file_down_rows_match_reference_and_dense(dot, f, dim, b):
  """`FileDownRows` (the file's Q4_1 down blocks, transposed) hold exactly the file's weights,
  and the down pass over them on random blocks (empty, single, partial with odd counts per
  neuron block, full) equals the float64 reference and the *dense* down matvec of the same
  activations (`qdot.matmul_reference` for int8: activations quantized per block of 32
  neurons as the dense kernel does; the exact product for f32): nothing is rounded twice."""
  from host_ops import gated_ffn
  rng = np.random.default_rng(17)
  down = qmatmul.quantize_q4_1(rng.standard_normal((dim, f)).astype(np.float32))  # W [D, F]
  rows = gated_ffn.FileDownRows.from_down(down)
  assert rows.shape == (f, dim) and rows.kind == "file"
  file_w = qmatmul.dequantize_reference(down)  # f64 [D, F], the file's values.
  np.testing.assert_array_equal(rows.dequantize(), file_w.T)
  assert rows.nbytes == sum(a.nbytes for a in down.arrays)  # The file's bytes, no more.
  for frac in (0.0, "single", 0.37, 1.0):
    acts, keep = _masked_acts(rng, b, f, frac)
    y, counts = gated_ffn.down_pass(acts, rows.arrays, 2, np.int64(32), dot == "int8")
    np.testing.assert_array_equal(counts, keep.sum(axis=1))
    ref = gated_ffn.down_reference(acts, rows, dot=dot)
    scale = max(1.0, np.abs(ref).max())
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * scale)
    if dot == "int8" and qdot.AVAILABLE:
      dense = qdot.matmul_reference("q4_1", down.arrays, acts)
    else:
      dense = acts.astype(np.float64) @ file_w.T
    np.testing.assert_allclose(y, dense, rtol=1e-5, atol=1e-5 * scale)
    if frac == 0.0:
      assert (y == 0).all()


def test_file_down_rows_refuse_other_formats():
  from host_ops import gated_ffn
  rng = np.random.default_rng(3)
  with pytest.raises(HostOpError, match="--gate_down=file needs a Q4_1"):
    gated_ffn.FileDownRows.from_down(_random_matrix(rng, "q8_0", 64, 96))
  with pytest.raises(HostOpError, match="file down rows need"):
    gated_ffn.FileDownRows(np.zeros((96, 32), np.uint8), np.zeros((3, 2, 32), np.uint16))


@pytest.mark.parametrize("family,cut,ccut", [("swiglu", 0.05, 0.0), ("swiglu", 0.0, 0.3),
                                             ("drelu", 0.0, 0.0), ("swiglu", 0.0, 1e9)])
@pytest.mark.parametrize("dot", ["f32", "int8"])
def test_gated_ffn_with_file_rows_matches_reference(family, cut, ccut, dot):
  """The gate-first FFN with `FileDownRows` on random blocks against the float64 reference:
  the gate rule, the contribution rule, exact dReLU and the empty set."""
  from host_ops import gated_ffn
  rng = np.random.default_rng(19)
  up = _random_matrix(rng, "q4_1", 96, 64)
  rows = gated_ffn.FileDownRows.from_down(_random_matrix(rng, "q4_1", 64, 96))
  h = rng.standard_normal((3, 64)).astype(np.float32)
  g = rng.standard_normal((3, 96)).astype(np.float32)
  y, active, passed = gated_ffn.gated_ffn(g, h, up, rows, cut=cut, family=family, dot=dot,
                                          contribution_cut=ccut)
  ref, ref_active, ref_passed = gated_ffn.gated_ffn_reference(
      g, h, up, rows, cut=cut, family=family, dot=dot, contribution_cut=ccut)
  np.testing.assert_array_equal(active, ref_active)
  np.testing.assert_array_equal(passed, ref_passed)
  np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(ref).max()))
  if ccut >= 1e9:
    assert (active == 0).all() and (y == 0).all()
  else:
    assert (active > 0).all() and (active < 96).all()


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("family,cut", [("drelu", 0.0), ("swiglu", 0.05)])
def test_gated_ffn_rows_prefetched_into_l2_match_reference(kind, family, cut):
  """Up rows of >= 1 KB of codes take the kernels that prefetch into L2 (`common.far_gather`;
  the file down pass always does): the same results as the float64 reference on random blocks,
  integer dots."""
  from host_ops import common
  from host_ops import gated_ffn
  rng = np.random.default_rng(23)
  dim, f = 2048, 96
  up = _random_matrix(rng, kind, f, dim)
  rows = gated_ffn.FileDownRows.from_down(_random_matrix(rng, "q4_1", dim, f))
  assert common.far_gather(up.arrays[0].shape[1])
  h = rng.standard_normal((2, dim)).astype(np.float32)
  g = rng.standard_normal((2, f)).astype(np.float32)
  y, active, passed = gated_ffn.gated_ffn(g, h, up, rows, cut=cut, family=family, dot="int8")
  ref, ref_active, ref_passed = gated_ffn.gated_ffn_reference(g, h, up, rows, cut=cut,
                                                              family=family, dot="int8")
  np.testing.assert_array_equal(active, ref_active)
  np.testing.assert_array_equal(passed, ref_passed)
  assert (active > 0).all() and (passed < f).all()
  np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(ref).max()))


@pytest.mark.parametrize("dot", ["f32", "int8"])
def test_decoder_with_file_rows(dot):
  """`enable_gated(down_format="file")`: the decoder with calibrated contribution cuts equals
  the float64 reference decoder with the same masks (prefill then decode); with every cut 0 (nothing skipped) it equals the dense decoder;
  bytes count 16 per 32 weights of an active neuron plus 4; Q8_0 weights are refused."""
  rng = np.random.default_rng(5)
  dec = _tiny_decoder(rng, "q4_1", adjacent=True, family="swiglu", dot=dot)
  tokens = rng.integers(0, 50, 9)

  def run():
    cid = dec.new_cache(1, 16)
    got = [dec.forward(cid, tokens[None, :6], 0)]
    got += [dec.forward(cid, tokens[None, i:i + 1], i) for i in range(6, 9)]
    return np.concatenate(got)

  dense = run()
  dec.enable_gated([0.0, 0.0], down_format="file")
  assert dec.down_format == "file"
  np.testing.assert_allclose(run(), dense, rtol=1e-5, atol=1e-5 * np.abs(dense).max())
  assert (dec.last_active == 1.0).all()
  ccuts = dec.calibrate_gate_cuts([rng.integers(0, 50, 12) for _ in range(3)], 0.5,
                                  contribution=True)
  dec.enable_gated([0.0, 0.0], down_format="file", contribution_cuts=ccuts)
  ref = decoder_lib.decoder_reference(dec, tokens)
  got = run()
  assert 0.2 < dec.last_active.mean() < 0.8
  _assert_logits_match(got, ref, dec.dot)
  gate = sum(layer.gate.file_bytes() for layer in dec.layers)
  up = sum(layer.up.file_bytes() for layer in dec.layers)
  blocks = sum(layer.down.shape[0] * layer.down.shape[1] for layer in dec.layers) // 32
  assert dec.ffn_bytes_per_token(0.25, 1.0) == pytest.approx(gate + up + (0.25 * 16 + 4) *
                                                             blocks, abs=1)
  q8 = _tiny_decoder(rng, "q8_0", adjacent=True, family="swiglu", dot=dot)
  with pytest.raises(HostOpError, match="Q4_1 down projection"):
    q8.enable_gated([0.0, 0.0], down_format="file")
  assert q8.gate_cuts is None and q8.down_format is None
  q8.enable_gated([0.0, 0.0])  # The default where the file's rows cannot be used.
  assert q8.down_format == "q8_0"
  dec.enable_gated([0.0, 0.0], down_format="q8_0")
  dec.enable_gated([0.0, 0.0])  # The default for Q4_1 down projections.
  assert dec.down_format == "file"
