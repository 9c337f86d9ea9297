"""The host attention kernel (`host_ops.attention.attention`, blocked) against a float64 NumPy
reference, and its block-invariance: a token's output is the same bits whether it runs in a
prompt chunk, alone (decode) or beside other sequences."""

import numpy as np
import pytest

from host_ops import attention


def _reference(qkv, cache_k, cache_v, slots, positions, cos, sin, n_heads, n_kv, scale, window):
  """Float64: RoPE (NeoX pairs), causal softmax(q k^T scale) v per head over each token's own
  slot, keys and values of this call written first. Returns f32[N, N_h H]."""
  n, _, hd = qkv.shape
  half = cos.shape[1]
  ck = cache_k.astype(np.float64)
  cv = cache_v.astype(np.float64)

  def rope(v, i):
    out = v.copy()
    a, b = v[:half], v[half:2 * half]
    out[:half] = a * cos[i] - b * sin[i]
    out[half:2 * half] = a * sin[i] + b * cos[i]
    return out

  for i in range(n):
    for kv in range(n_kv):
      ck[slots[i], positions[i], kv] = rope(qkv[i, n_heads + kv].astype(np.float64), i)
      cv[slots[i], positions[i], kv] = qkv[i, n_heads + n_kv + kv]
  out = np.zeros((n, n_heads * hd))
  group = n_heads // n_kv
  for i in range(n):
    last = positions[i]
    first = max(0, last - window + 1) if window > 0 else 0
    for h in range(n_heads):
      q = rope(qkv[i, h].astype(np.float64), i)
      k = ck[slots[i], first:last + 1, h // group]
      v = cv[slots[i], first:last + 1, h // group]
      s = k @ q * scale
      with np.errstate(invalid="ignore"):  # an infinite key: inf - inf is NaN, as it should be
        p = np.exp(s - s.max())
      out[i, h * hd:(h + 1) * hd] = (p / p.sum()) @ v
  return out.astype(np.float32)


def _case(rng, n_heads, n_kv, hd, slots, positions, cache_len=96):
  n = len(slots)
  qkv = rng.standard_normal((n, n_heads + 2 * n_kv, hd)).astype(np.float32)
  cache_k = rng.standard_normal((2, cache_len, n_kv, hd)).astype(np.float32)
  cache_v = rng.standard_normal((2, cache_len, n_kv, hd)).astype(np.float32)
  ang = rng.uniform(0, 6, (n, hd // 2)).astype(np.float32)
  return qkv, cache_k, cache_v, np.cos(ang), np.sin(ang)


def _run(args, slots, positions, n_heads, n_kv, window):
  qkv, cache_k, cache_v, cos, sin = (a.copy() for a in args)
  empty = np.zeros(0, np.float32)
  hd = qkv.shape[2]
  out = attention.attention(qkv, cache_k, cache_v, np.asarray(slots, np.int64),
                            np.asarray(positions, np.int64), cos, sin, False, n_heads, n_kv,
                            np.float32(hd ** -0.5), window, empty, empty, np.float32(1e-6))
  return out, cache_k, cache_v


@pytest.mark.parametrize("n_heads,n_kv,hd,window", [
    (9, 3, 64, 0),  # SmolLM2's heads
    (4, 1, 256, 0), (4, 1, 256, 7),  # Gemma 3's, global and sliding-window layers
    (8, 8, 48, 0),  # no grouping, a head dim below the 64-column step
    (2, 1, 72, 5),  # a head dim that is not a multiple of 16
])
def test_attention_matches_reference(n_heads, n_kv, hd, window):
  """A ragged batch (a 21-token chunk of slot 0 at positions 40.., 17 tokens of slot 1 from 0)
  against the float64 reference, and the keys and values written to the cache."""
  rng = np.random.default_rng(hd + window)
  slots = [0] * 21 + [1] * 17
  positions = list(range(40, 61)) + list(range(17))
  args = _case(rng, n_heads, n_kv, hd, slots, positions)
  got, cache_k, cache_v = _run(args, slots, positions, n_heads, n_kv, window)
  ref = _reference(*args[:3], np.asarray(slots), np.asarray(positions), args[3], args[4],
                   n_heads, n_kv, hd ** -0.5, window)
  np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * np.abs(ref).max())
  np.testing.assert_array_equal(cache_v[0, 40:61], args[0][:21, n_heads + n_kv:])
  assert not np.array_equal(cache_k[0, 40:61], args[1][0, 40:61])  # overwritten (roped)


@pytest.mark.parametrize("window", [0, 6])
def test_attention_is_block_invariant(window):
  """Each token's output alone (a decode step per token, in order) equals its output in the
  chunk, bit for bit; so do two sequences batched against each run alone."""
  rng = np.random.default_rng(7)
  n_heads, n_kv, hd = 9, 3, 64
  slots = [0] * 37 + [1] * 5
  positions = list(range(3, 40)) + list(range(5))
  args = _case(rng, n_heads, n_kv, hd, slots, positions)
  chunk, _, _ = _run(args, slots, positions, n_heads, n_kv, window)
  qkv, cache_k, cache_v, cos, sin = (a.copy() for a in args)
  empty = np.zeros(0, np.float32)
  for i in range(len(slots)):  # Token by token: each its own block.
    one = attention.attention(qkv[i:i + 1], cache_k, cache_v, np.asarray(slots[i:i + 1]),
                              np.asarray(positions[i:i + 1]), cos[i:i + 1], sin[i:i + 1],
                              False, n_heads, n_kv, np.float32(0.125), window, empty, empty,
                              np.float32(1e-6))
    np.testing.assert_array_equal(one[0], chunk[i])
  solo, _, _ = _run(tuple(a[:37] if a.shape[0] == 42 else a for a in args), slots[:37],
                    positions[:37], n_heads, n_kv, window)
  np.testing.assert_array_equal(solo, chunk[:37])


def test_query_blocks_split_runs():
  """Blocks are runs of one slot at consecutive positions, at most `block` long."""
  slots = np.asarray([0, 0, 0, 1, 1, 0, 0], np.int64)
  positions = np.asarray([5, 6, 7, 0, 2, 8, 9], np.int64)
  got = attention.query_blocks(slots, positions, 2)
  assert got.tolist() == [[0, 2], [2, 1], [3, 1], [4, 1], [5, 2]]


@pytest.mark.parametrize("where", ["query", "key", "key_inf"])
def test_attention_keeps_nan(where):
  """A NaN query or cached key (or an infinite key) makes the attending rows NaN, as the
  reference's softmax does, instead of a finite mix of the other keys."""
  rng = np.random.default_rng(9)
  n_heads, n_kv, hd = 4, 2, 32
  slots, positions = [0] * 5, list(range(20, 25))
  args = _case(rng, n_heads, n_kv, hd, slots, positions)
  qkv, cache_k = args[0], args[1]
  if where == "query":
    qkv[2, 1, 5] = np.nan  # token 2, head 1 (KV head 0)
  else:
    cache_k[0, 7, 1, 3] = np.nan if where == "key" else np.inf  # key 7 of KV head 1
  got, _, _ = _run(args, slots, positions, n_heads, n_kv, 0)
  ref = _reference(*args[:3], np.asarray(slots), np.asarray(positions), args[3], args[4],
                   n_heads, n_kv, hd ** -0.5, 0)
  np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
  assert np.isnan(got).any()
  np.testing.assert_allclose(got[~np.isnan(ref)], ref[~np.isnan(ref)], rtol=0,
                             atol=2e-5 * np.abs(ref[~np.isnan(ref)]).max())
