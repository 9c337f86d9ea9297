"""PowerInfer's predicted sparse FFN on the host engine (issue 32): the kernels and the decoder.

Oracles: float64 NumPy references (`predicted_ffn.predicted_ffn_reference`, `decoder_reference`)
on random blocks (never zeros), with empty, partial and full predicted sets; the dense decoder
for a predicted set that holds every active neuron.
"""

import zlib

import numpy as np
import pytest

from host_ops import common
from host_ops import decoder as decoder_lib
from host_ops import gated_down
from host_ops import predicted_ffn
from host_ops import qblocks
from host_ops import qdot
from host_ops import qmatmul
from host_ops.common import HostOpError

from test_host_quant import _assert_logits_match, _random_matrix, _tiny_decoder

HUGE = 1e30  # A threshold no logit reaches (+) or every logit reaches (-).


def _q4_0(rng, n, dim):
  return _random_matrix(rng, "q4_0", n, dim)


@pytest.fixture(autouse=True)
def _two_threads():
  common.set_host_threads(2)


def _safe_threshold(logits, lo=0.3, hi=0.7):
  """A threshold between the lo and hi quantiles of logits at the middle of their widest gap,
  so that rounding differences between kernel and reference cannot move a neuron across it."""
  v = np.sort(np.asarray(logits, np.float64).reshape(-1))
  a, b = int(lo * (v.size - 1)), int(hi * (v.size - 1))
  k = a + int(np.argmax(np.diff(v[a:b + 1])))
  return float((v[k] + v[k + 1]) / 2)


@pytest.mark.parametrize("dot", ["f32", "int8"])
@pytest.mark.parametrize("family", ["reglu", "drelu"])
@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("case", ["empty", "some", "full"])
@pytest.mark.parametrize("b", [1, 5])
def test_predicted_ffn_matches_reference(kind, family, dot, case, b):
  """The FFN alone (an odd neuron count, 37): output and the rows read per token equal the
  float64 reference; an empty set gives exactly 0, a full one the dense FFN."""
  rng = np.random.default_rng(zlib.crc32(repr((kind, family, dot, case, b)).encode()))
  f, d, r = 37, 64, 32
  fc1, fc2 = _q4_0(rng, r, d), _q4_0(rng, f, r)
  gate, up = _random_matrix(rng, kind, f, d), _random_matrix(rng, kind, f, d)
  down_t = qmatmul.quantize_q8_0(rng.standard_normal((f, d)).astype(np.float32))
  x = rng.standard_normal((b, d)).astype(np.float32) * 3
  h = rng.standard_normal((b, d)).astype(np.float32)
  args = (fc1, fc2)
  z = np.maximum(predicted_ffn._product_reference(fc1, x, dot == "int8" and qdot.AVAILABLE),
                 0).astype(np.float32)
  logits = predicted_ffn._product_reference(fc2, z, dot == "int8" and qdot.AVAILABLE)
  threshold = {"empty": HUGE, "full": -HUGE, "some": _safe_threshold(logits)}[case]
  got = predicted_ffn.predicted_ffn(x, h, *args, threshold, gate, up, down_t, family=family,
                                    dot=dot)
  ref = predicted_ffn.predicted_ffn_reference(x, h, *args, threshold, gate, up, down_t,
                                              family=family, dot=dot)
  y, predicted, passed, nonzero = got
  assert y.shape == (b, d) and y.dtype == np.float32
  for g, want in zip(got[1:], ref[1:]):
    np.testing.assert_array_equal(g, want)
  if case == "empty":
    assert (predicted == 0).all() and (y == 0).all()
    return
  if case == "some":
    assert 0 < predicted.sum() < b * f
  assert (passed <= predicted).all() and (nonzero <= passed).all()
  np.testing.assert_allclose(y, ref[0], rtol=1e-4, atol=1e-4 * np.abs(ref[0]).max())
  if case == "full":  # The dense FFN: every gate computed, the ReLU zeros skipped exactly.
    a = np.asarray(_dense_acts(gate, up, h, family, dot), np.float32)
    dense = gated_down.down_reference(a, down_t, dot=dot)
    np.testing.assert_allclose(y, dense, rtol=1e-4, atol=1e-4 * np.abs(dense).max())


def _dense_acts(gate, up, h, family, dot):
  int8 = dot == "int8" and qdot.AVAILABLE
  g = predicted_ffn._product_reference(gate, h, int8)
  u = predicted_ffn._product_reference(up, h, int8)
  return common.activation_reference(g, u, family)


@pytest.mark.parametrize("dot", ["f32", "int8"])
@pytest.mark.parametrize("n,dim", [(37, 96), (64, 4096), (5, 32)])
@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0"])
def test_records_match_file_rows(kind, n, dim, dot):
  """Rows as records (`predicted_ffn.records`) hold the file's codes, scales and offsets, and
  their gathered dots equal the file blocks' (and the f64 product) for odd row and block
  counts, empty, partial and full id lists."""
  rng = np.random.default_rng(n + dim)
  w = _random_matrix(rng, kind, n, dim)
  rows = predicted_ffn.file_rows(w)
  code = qblocks.KIND_CODES[kind]
  records, layout = predicted_ffn.gather_rows(rows, code, True)
  code_bytes, head = predicted_ffn.RECORD_BLOCKS[code]
  nb, nq = dim // 32, dim // 32 * code_bytes
  assert layout == predicted_ffn.RECORDS + code and records.shape[1] % 64 == 0
  blocks = rows.reshape(n, nb, code_bytes + head)
  np.testing.assert_array_equal(records[:, :nq], blocks[:, :, head:].reshape(n, -1))
  for k in range(head // 2):  # Scales, then (Q4_1) offsets.
    np.testing.assert_array_equal(records[:, nq + 2 * nb * k:nq + 2 * nb * (k + 1)],
                                  blocks[:, :, 2 * k:2 * k + 2].reshape(n, -1))
  int8 = dot == "int8" and qdot.AVAILABLE
  h = rng.standard_normal((3, dim)).astype(np.float32)
  ids = np.tile(np.arange(n, dtype=np.int32), (3, 1))
  ids[1, :n // 2] = np.sort(rng.choice(n, n // 2, replace=False))
  counts = np.array([0, n // 2, n], np.int64)
  xq, dx, xs = predicted_ffn.row_activations(h, int8)
  got = predicted_ffn.gathered_dots(layout, records, ids, counts, xq, dx, xs, h, int8, 2)
  want = predicted_ffn.gathered_dots(code, rows, ids, counts, xq, dx, xs, h, int8, 2)
  ref = predicted_ffn._product_reference(w, h, int8)
  for r in range(3):
    c = counts[r]
    scale = np.abs(ref[r]).max()
    np.testing.assert_allclose(got[r, :c], want[r, :c], rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(got[r, :c], ref[r, ids[r, :c]], rtol=0, atol=1e-5 * scale)


def test_predicted_ffn_refuses_what_it_cannot_run():
  rng = np.random.default_rng(0)
  fc1, fc2, gate = _q4_0(rng, 32, 64), _q4_0(rng, 40, 32), _q4_0(rng, 40, 64)
  down_t = qmatmul.quantize_q8_0(rng.standard_normal((40, 64)).astype(np.float32))
  x = rng.standard_normal((1, 64)).astype(np.float32)
  with pytest.raises(HostOpError, match="ReLU families"):
    predicted_ffn.predicted_ffn(x, x, fc1, fc2, 0.0, gate, gate, down_t, family="swiglu")
  with pytest.raises(HostOpError, match="do not match"):
    predicted_ffn.predicted_ffn(x, x, fc1, _q4_0(rng, 39, 32), 0.0, gate, gate, down_t,
                                family="reglu")
  with pytest.raises(HostOpError, match="finite"):
    predicted_ffn.predicted_ffn(x, x, fc1, fc2, np.nan, gate, gate, down_t, family="reglu")


def _transposable_q8_0(rng, n, dim, scale=2.0 ** -7):
  """A Q8_0 [n, dim] matrix s Q whose re-quantization along the other axis (the neuron-major
  down rows) is exact: codes |Q| <= 127 with a +-127 in every 32-block of every row and
  column (at (o - j) % 32 == 0), so every block's scale is s (f16-exact) either way."""
  q = rng.integers(-126, 127, (n, dim)).astype(np.float32)
  o, j = np.indices((n, dim))
  q[(o - j) % 32 == 0] = 127 * rng.choice([-1.0, 1.0], int(((o - j) % 32 == 0).sum()))
  w = qmatmul.quantize_q8_0(q * np.float32(scale))
  assert np.array_equal(qmatmul.dequantize_reference(w), q * scale)
  return w


def _relu_decoder(rng, family, dot):
  """`_tiny_decoder`'s shapes in Q4_0 (as PowerInfer's Q4_0 files) but for a down projection
  that the neuron-major Q8_0 rows hold exactly (`_transposable_q8_0`), so that the sparse
  paths and the dense one multiply the same values."""
  dec = _tiny_decoder(rng, "q4_0", adjacent=False, family=family, dot=dot)
  d, f = dec.hidden_size, dec.intermediate_size
  layers = [decoder_lib.HostLayer(
      attn_norm=layer.attn_norm.copy(), qkv=layer.qkv.parts[0].qmatrix(),
      attn_out=layer.attn_out.parts[0].qmatrix(), ffn_norm=layer.ffn_norm.copy(),
      gate=layer.gate.parts[0].qmatrix(), up=layer.up.parts[0].qmatrix(),
      down=_transposable_q8_0(rng, d, f)) for layer in dec.layers]
  return decoder_lib.HostDecoder(
      dec.embedding, layers, dec.final_norm, dec.lm_head, eps=dec.eps, family=family,
      n_heads=dec.n_heads, n_kv_heads=dec.n_kv_heads, head_dim=dec.head_dim,
      rope_theta=dec.rope_theta, rope_dim=dec.rope_dim, rope_adjacent=False, dot=dot)


def _predictors(rng, dec, rank=32):
  """Random Q4_0 (fc1 [rank, D], fc2 [F, rank]) per layer."""
  d, f = dec.hidden_size, dec.intermediate_size
  return [_q4_0(rng, rank, d) for _ in range(dec.n_layers)], \
      [_q4_0(rng, f, rank) for _ in range(dec.n_layers)]


def _run(dec, tokens, prefill=6):
  """Logits of a prompt's first `prefill` tokens in one pass, then one token per step."""
  cache = dec.new_cache(1, 16)
  got = [dec.forward(cache, tokens[None, :prefill], 0)]
  got += [dec.forward(cache, tokens[None, i:i + 1], i) for i in range(prefill, len(tokens))]
  return np.concatenate(got)


def _safe_thresholds(dec, fc1s, fc2s, tokens):
  """Per layer a `_safe_threshold` of the reference's logits, layer by layer (a layer's
  logits depend on the thresholds before it)."""
  thresholds = [-HUGE] * dec.n_layers
  for li in range(dec.n_layers):
    dec.enable_predicted(fc1s, fc2s, thresholds)
    trace = {}
    decoder_lib.decoder_reference(dec, tokens, trace)
    thresholds[li] = _safe_threshold(trace[li])
  return thresholds


@pytest.mark.parametrize("dot", ["f32", "int8"])
@pytest.mark.parametrize("family,kind", [("reglu", "q4_0"), ("drelu", "q4_0"),
                                         ("reglu", "q8_0")])
def test_decoder_predicted_matches_reference(family, kind, dot):
  """A prefill of 6 tokens then 3 decode steps with the predicted FFN equal the float64
  reference decoder (the dense model with the unpredicted neurons zeroed); the rows read and
  the bytes per token follow the stated formula."""
  rng = np.random.default_rng(11)
  dec = _tiny_decoder(rng, kind, adjacent=True, family=family, dot=dot)
  fc1s, fc2s = _predictors(rng, dec)
  tokens = rng.integers(0, 50, 9)
  thresholds = _safe_thresholds(dec, fc1s, fc2s, tokens)
  dec.enable_predicted(fc1s, fc2s, thresholds)
  assert dec.thresholds == thresholds and dec.gate_cuts is None
  ref = decoder_lib.decoder_reference(dec, tokens)
  got = _run(dec, tokens)
  _assert_logits_match(got, ref, dec.dot)
  assert 0.0 < dec.last_active.mean() < 1.0  # Predicted (gate rows read) in the last step.
  assert (dec.last_passed <= dec.last_active).all()
  assert (dec.last_nonzero <= dec.last_passed).all()
  # Bytes: predictor + p gate + p_up up + down rows of p_down (Q8_0: 34 bytes per 32 weights).
  gates, passed, nonzero = dec.pred_read_sums
  assert gates > passed >= nonzero > 0
  pred_bytes = sum(m.file_bytes() for m in fc1s + fc2s)
  assert dec.predictor_bytes() == pred_bytes
  gate = sum(layer.gate.file_bytes() for layer in dec.layers)
  up = sum(layer.up.file_bytes() for layer in dec.layers)
  down_t = sum(layer.down.shape[0] * layer.down.shape[1] for layer in dec.layers) // 32 * 34
  want = pred_bytes + 0.3 * gate + 0.3 * passed / gates * up + 0.3 * nonzero / gates * down_t
  assert dec.ffn_bytes_per_token(0.3) == pytest.approx(want, abs=1)
  attn = sum(w.file_bytes() for layer in dec.layers for w in (layer.qkv, layer.attn_out))
  assert dec.bytes_per_token(0.3) == pytest.approx(want + attn + dec.lm_head.file_bytes(),
                                                   abs=1)
  dense = dec.bytes_per_token()
  assert dec.sparse_nbytes() > 0
  # Gate and up rows as records with int8 dots, file blocks with f32, switched with the dot.
  records = dec.dot == "int8" and kind in ("q4_0", "q8_0")
  assert (dec._pred_rows[2] >= predicted_ffn.RECORDS) == records
  dec.dot = "f32" if dec.dot == "int8" else "int8"
  assert dec.thresholds == thresholds
  assert (dec._pred_rows[2] >= predicted_ffn.RECORDS) == (dec.dot == "int8")
  _assert_logits_match(_run(dec, tokens), decoder_lib.decoder_reference(dec, tokens), dec.dot)
  dec.enable_predicted(None)
  assert dec.thresholds is None and dec.bytes_per_token() == dense


@pytest.mark.parametrize("dot", ["f32", "int8"])
@pytest.mark.parametrize("family", ["reglu", "drelu"])
def test_decoder_predicted_sets_that_hold_every_active_neuron_equal_dense(family, dot):
  """Oracle form: thresholds that predict every neuron (so every truly active one) give the
  dense decoder's logits and the gate-first decoder's; thresholds that predict none give
  the decoder whose FFNs output exactly 0 (the reference)."""
  rng = np.random.default_rng(3)
  dec = _relu_decoder(rng, family, dot)
  fc1s, fc2s = _predictors(rng, dec)
  tokens = rng.integers(0, 50, 9)
  dense = _run(dec, tokens)
  dec.enable_predicted(fc1s, fc2s, [-HUGE] * dec.n_layers)
  full = _run(dec, tokens)
  assert (dec.last_active == 1.0).all() and (dec.last_passed < 1.0).all()
  _assert_logits_match(full, decoder_lib.decoder_reference(dec, tokens), dec.dot)
  if dec.dot == "f32":  # The same values and arithmetic up to summation order.
    _assert_logits_match(full, dense, dec.dot)
  else:  # The dense down matvec reads the activations quantized per 32, the sparse down
    # pass over Q8_0 rows reads them in f32 (as gate-first): one int8 rounding apart
    # (measured 1.1e-2 of the range at most, 1.8e-3 on average).
    err = np.abs(full - dense) / np.abs(dense).max()
    assert err.max() <= 3e-2 and err.mean() <= 4e-3, (err.max(), err.mean())
  dec.enable_gated([0.0] * dec.n_layers)  # Gate-first on the same (Q4_0) up rows.
  assert dec.thresholds is None
  gated = _run(dec, tokens)
  np.testing.assert_allclose(full, gated, rtol=1e-5, atol=1e-5 * np.abs(gated).max())
  _assert_logits_match(gated, decoder_lib.decoder_reference(dec, tokens), dec.dot)
  dec.enable_predicted(fc1s, fc2s, [HUGE] * dec.n_layers)
  assert dec.gate_cuts is None
  none = _run(dec, tokens)
  assert (dec.last_active == 0.0).all() and (dec.last_nonzero == 0.0).all()
  _assert_logits_match(none, decoder_lib.decoder_reference(dec, tokens), dec.dot)
  dec.dot = "f32" if dec.dot == "int8" else "int8"  # The predictor's pool follows the dot.
  _assert_logits_match(_run(dec, tokens), decoder_lib.decoder_reference(dec, tokens), dec.dot)


def test_enable_predicted_refuses_what_it_cannot_run():
  rng = np.random.default_rng(0)
  dec = _tiny_decoder(rng, "q4_0", adjacent=True, family="swiglu")
  fc1s, fc2s = _predictors(rng, dec)
  with pytest.raises(HostOpError, match="ReLU families"):
    dec.enable_predicted(fc1s, fc2s, [0.0, 0.0])
  dec = _tiny_decoder(rng, "q4_0", adjacent=True, family="reglu")
  with pytest.raises(HostOpError, match="one per layer"):
    dec.enable_predicted(fc1s[:1], fc2s, [0.0, 0.0])
  with pytest.raises(HostOpError, match="expected"):
    dec.enable_predicted(fc2s, fc1s, [0.0, 0.0])
  with pytest.raises(HostOpError, match="not finite"):
    dec.enable_predicted(fc1s, fc2s, [0.0, np.inf])
  with pytest.raises(HostOpError, match="down_format"):
    dec.enable_predicted(fc1s, fc2s, [0.0, 0.0], down_format="q4_1")
  assert dec.thresholds is None
  with pytest.raises(HostOpError, match="contribution"):  # Q4_0 up rows: no contribution rule.
    dec.enable_gated([0.0, 0.0], contribution_cuts=[0.1, 0.1])
