"""pallas_kernels.sparse_ffn: kernel vs jnp reference vs float64 NumPy.

Laid out like jax's tests/pallas/gpu_paged_attention_test.py: `SparseFfnTest`
runs the kernel natively and is skipped unless `jax.default_backend() ==
"gpu"` (run with JAX_PLATFORMS=cuda: tests/conftest.py defaults to cpu);
`SparseFfnInterpretTest` runs the same tests with `interpret=True` on any
backend. Every comparison prints max and mean abs error (`pytest -s`).
"""

import functools

from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import sparse_ffn as sf

FAMILIES = ("swiglu", "reglu", "drelu")
F32_TOL = 1e-5  # times (1 + max |want|)
BF16_VS_F32_TOL = 2e-2  # bf16-rounded weights vs the original f32 weights

SHAPES = {"tiny": (64, 64), "smollm2_d": (300, 576)}  # name: (n_hot, d)


def _problem(seed: int, n_hot: int, d: int, b: int):
  """Random (never zero) x f32[b, d] and gate/up/down f32[n_hot, d]."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((b, d)).astype(np.float32)
  scale = 1.0 / np.sqrt(d)
  gate, up, down = (
      (rng.standard_normal((n_hot, d)) * scale).astype(np.float32)
      for _ in range(3))
  return x, gate, up, down


def _active(seed: int, n_hot: int, kind: str) -> np.ndarray:
  """Unique active ids of one kind: empty/single/few/half/full."""
  rng = np.random.default_rng(seed + 1)
  n = {"empty": 0, "single": 1, "few": 5, "half": n_hot // 2,
       "full": n_hot}[kind]
  return np.sort(rng.choice(n_hot, size=n, replace=False)).astype(np.int32)


def _numpy_ffn(x, gate, up, down, ids, family):
  """Independent float64 NumPy FFN over the active ids: f64[b, d]."""
  x, gate, up, down = (np.asarray(a, np.float64) for a in (x, gate, up, down))
  ids = np.asarray(ids, np.int64)
  g = x @ gate[ids].T  # [b, k]
  u = x @ up[ids].T  # [b, k]
  if family == "swiglu":
    a = g / (1.0 + np.exp(-g)) * u
  elif family == "reglu":
    a = np.maximum(g, 0.0) * u
  else:
    a = np.maximum(g, 0.0) * np.maximum(u, 0.0)
  return a @ down[ids]  # [b, d]


def _check(name, got, want, tol):
  """Prints max/mean abs error and asserts max <= tol * (1 + max |want|)."""
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  assert got.shape == want.shape, (name, got.shape, want.shape)
  err = np.abs(got - want)
  max_err = float(err.max()) if err.size else 0.0
  mean_err = float(err.mean()) if err.size else 0.0
  scale = 1.0 + (float(np.abs(want).max()) if want.size else 0.0)
  print(f"{name}: max abs err {max_err:.3e}, mean abs err {mean_err:.3e},"
        f" max |want| {scale - 1:.3f}")
  assert max_err <= tol * scale, f"{name}: max abs err {max_err} > {tol * scale}"


class SparseFfnTest(parameterized.TestCase):
  """Runs `sparse_ffn` natively (GPU only)."""

  INTERPRET = False

  def setUp(self):
    super().setUp()
    if not self.INTERPRET and jax.default_backend() != "gpu":
      self.skipTest("native Pallas kernels need a GPU backend")

  def _kernel(self, x, gate, up, down, idx, dtype=jnp.float32, **kwargs):
    w = [jnp.asarray(a, dtype) for a in (gate, up, down)]
    return sf.sparse_ffn(jnp.asarray(x), *w, jnp.asarray(idx),
                         interpret=self.INTERPRET, **kwargs)

  def _compare_all(self, name, x, gate, up, down, ids, family, **kwargs):
    """Kernel vs reference vs NumPy on ids padded to a power of two."""
    idx = sf.pad_indices(ids, sf.next_pow2(max(len(ids), 1)))
    got = self._kernel(x, gate, up, down, idx, family=family, **kwargs)
    ref = sf.sparse_ffn_reference(
        jnp.asarray(x), jnp.asarray(gate), jnp.asarray(up), jnp.asarray(down),
        jnp.asarray(idx), family=family)
    want = _numpy_ffn(x, gate, up, down, ids, family)
    _check(f"{name} kernel-vs-numpy", got, want, F32_TOL)
    _check(f"{name} reference-vs-numpy", ref, want, F32_TOL)
    _check(f"{name} kernel-vs-reference", got, ref, F32_TOL)
    return np.asarray(got)

  @parameterized.product(family=FAMILIES, b=[1, 3], shape=sorted(SHAPES))
  def test_matches_reference_and_numpy(self, family, b, shape):
    n_hot, d = SHAPES[shape]
    x, gate, up, down = _problem(7, n_hot, d, b)
    rng = np.random.default_rng(11)
    ids = np.sort(rng.choice(n_hot, size=int(0.45 * n_hot), replace=False))
    self._compare_all(f"{family} b={b} {shape}", x, gate, up, down, ids, family)

  @parameterized.product(
      kind=["empty", "single", "few", "half", "full"],
      shape_family=[("tiny", "swiglu"), ("smollm2_d", "drelu")])
  def test_active_sets(self, kind, shape_family):
    shape, family = shape_family
    n_hot, d = SHAPES[shape]
    x, gate, up, down = _problem(3, n_hot, d, 3)
    ids = _active(3, n_hot, kind)
    got = self._compare_all(f"{kind} {shape} {family}", x, gate, up, down, ids,
                            family)
    if kind == "empty":
      assert np.all(got == 0.0)

  def test_unsorted_ids(self):
    n_hot, d = SHAPES["smollm2_d"]
    x, gate, up, down = _problem(5, n_hot, d, 1)
    ids = np.random.default_rng(5).permutation(n_hot)[:37]
    self._compare_all("unsorted", x, gate, up, down, ids, "swiglu")

  @parameterized.parameters(*FAMILIES)
  def test_bf16_weights_accumulate_in_f32(self, family):
    n_hot, d = SHAPES["smollm2_d"]
    x, gate, up, down = _problem(13, n_hot, d, 3)
    ids = _active(13, n_hot, "half")
    idx = sf.pad_indices(ids, sf.next_pow2(len(ids)))
    got = self._kernel(x, gate, up, down, idx, dtype=jnp.bfloat16,
                       family=family)
    assert got.dtype == jnp.float32
    w16 = [jnp.asarray(a, jnp.bfloat16) for a in (gate, up, down)]
    ref = sf.sparse_ffn_reference(jnp.asarray(x), *w16, jnp.asarray(idx),
                                  family=family)
    # Same bf16 values, f32 math: only the summation order differs.
    rounded = [np.asarray(w.astype(jnp.float32)) for w in w16]
    want16 = _numpy_ffn(x, *rounded, ids, family)
    _check(f"bf16 {family} kernel-vs-numpy(bf16 weights)", got, want16, F32_TOL)
    _check(f"bf16 {family} kernel-vs-reference", got, ref, F32_TOL)
    # Against the unrounded f32 weights: the bf16 storage error only.
    want32 = _numpy_ffn(x, gate, up, down, ids, family)
    _check(f"bf16 {family} kernel-vs-numpy(f32 weights)", got, want32,
           BF16_VS_F32_TOL)

  @parameterized.parameters((576, 1024), (100, 64))
  def test_padded_hidden(self, d, multiple):
    n_hot, b = 96, 3
    x, gate, up, down = _problem(17, n_hot, d, b)
    ids = _active(17, n_hot, "half")
    idx = sf.pad_indices(ids, sf.next_pow2(len(ids)))
    padded = [sf.pad_hidden(a, multiple) for a in (x, gate, up, down)]
    assert padded[0].shape[-1] % multiple == 0
    got = np.asarray(self._kernel(*padded, idx, family="reglu"))
    want = _numpy_ffn(x, gate, up, down, ids, "reglu")
    _check(f"pad_hidden d={d}->{got.shape[-1]}", got[:, :d], want, F32_TOL)
    assert np.all(got[:, d:] == 0.0)

  @parameterized.parameters((16, 32), (64, 64), (8, 16))
  def test_block_sizes(self, block_n, block_d):
    n_hot, d = SHAPES["smollm2_d"]
    x, gate, up, down = _problem(19, n_hot, d, 3)
    ids = _active(19, n_hot, "half")
    self._compare_all(f"block_n={block_n} block_d={block_d}", x, gate, up,
                      down, ids, "swiglu", block_n=block_n, block_d=block_d)

  @parameterized.parameters(16, 40)
  def test_batch_tiles_use_dot_path(self, b):
    n_hot, d = SHAPES["tiny"]
    plan = sf._plan(b, d, 64, 32, None)
    assert plan.use_dot and plan.block_b == min(sf.next_pow2(b), 32)
    x, gate, up, down = _problem(23, n_hot, d, b)
    ids = _active(23, n_hot, "half")
    self._compare_all(f"prefill b={b}", x, gate, up, down, ids, "swiglu")

  def test_sentinels_anywhere_are_ignored(self):
    n_hot, d = SHAPES["tiny"]
    x, gate, up, down = _problem(29, n_hot, d, 1)
    ids = np.array([5, 9, 40, 63, 0, 17], np.int32)
    # -1, out-of-range ids and a fully-sentinel middle block, all ignored.
    idx = np.full((32,), -1, np.int32)
    idx[[0, 3, 4, 20, 21, 31]] = ids
    idx[[1, 7]] = [n_hot, 1000]
    idx[2] = -7
    got = self._kernel(x, gate, up, down, idx, family="drelu", block_n=8)
    ref = sf.sparse_ffn_reference(
        jnp.asarray(x), jnp.asarray(gate), jnp.asarray(up), jnp.asarray(down),
        jnp.asarray(idx), family="drelu")
    want = _numpy_ffn(x, gate, up, down, ids, "drelu")
    _check("sentinels kernel-vs-numpy", got, want, F32_TOL)
    _check("sentinels reference-vs-numpy", ref, want, F32_TOL)

  def test_vector_x(self):
    n_hot, d = SHAPES["tiny"]
    x, gate, up, down = _problem(31, n_hot, d, 1)
    ids = _active(31, n_hot, "few")
    idx = sf.pad_indices(ids, 8)
    got = self._kernel(x[0], gate, up, down, idx)
    assert got.shape == (d,)
    _check("x: [d]", got, _numpy_ffn(x, gate, up, down, ids, "swiglu")[0],
           F32_TOL)

  @parameterized.parameters(*[
      (dict(family="gelu"), "family"),
      (dict(x=np.ones((2, 2, 64), np.float32)), "x must be"),
      (dict(x=np.ones((1, 32), np.float32)), "hidden size"),
      (dict(x=np.ones((1, 64), np.int32)), "floating"),
      (dict(up=np.ones((64, 32), np.float32)), "up_rows"),
      (dict(down=np.ones((64, 64), np.float16)), "dtype"),
      (dict(idx=np.zeros((12,), np.int32)), "power of two"),
      (dict(idx=np.zeros((16,), np.int16)), "int32"),
      (dict(idx=np.zeros((4, 4), np.int32)), "indices must be"),
      (dict(block_n=24), "block_n"),
      (dict(block_d=48), "block_d"),
      (dict(block_d=128), "block_d"),
  ])
  def test_validation_errors(self, change, message):
    args = dict(x=np.ones((1, 64), np.float32),
                gate=np.ones((64, 64), np.float32),
                up=np.ones((64, 64), np.float32),
                down=np.ones((64, 64), np.float32),
                idx=np.zeros((16,), np.int32))
    change = dict(change)
    kwargs = {k: change.pop(k) for k in ("family", "block_n", "block_d")
              if k in change}
    args.update(change)
    with self.assertRaisesRegex(ValueError, message):
      sf.sparse_ffn(*(jnp.asarray(args[k])
                      for k in ("x", "gate", "up", "down", "idx")),
                    interpret=self.INTERPRET, **kwargs)


  @parameterized.product(family=FAMILIES, kind=("empty", "single", "half", "full"),
                         b=(1, 3, 16))
  def test_int8_rows_match_reference_and_numpy(self, family, kind, b):
    """Int8 rows with one f32 scale per 32 values (Q8_0 layout): the kernel equals the jnp
    reference and a float64 NumPy FFN on the dequantized rows, for empty, single, half and
    full active sets, decode and dot-path batch tiles; and stays within the 8-bit rounding
    of the f32 rows it was quantized from."""
    n_hot, d = 96, 160  # d = 5 tiles of 32: not a power of two.
    x, gate, up, down = _problem(11, n_hot, d, b)
    quant = [sf.quantize_rows_q8(w) for w in (gate, up, down)]
    q = [jnp.asarray(qw) for qw, _ in quant]
    scales = tuple(sc for _, sc in quant)
    deq = [np.asarray(qw, np.float64) * np.repeat(np.asarray(sc, np.float64), 32, axis=1)
           for qw, sc in quant]
    ids = _active(3, n_hot, kind)
    idx = sf.pad_indices(ids, sf.next_pow2(max(len(ids), 1)))
    got = sf.sparse_ffn(jnp.asarray(x), *q, jnp.asarray(idx), family=family,
                        scales=scales, block_n=16, interpret=self.INTERPRET)
    ref = sf.sparse_ffn_reference(jnp.asarray(x), *q, jnp.asarray(idx), family=family,
                                  scales=scales)
    want = _numpy_ffn(x, *deq, ids, family)
    _check(f"q8 {family} {kind} b={b} kernel-vs-numpy", got, want, F32_TOL)
    _check(f"q8 {family} {kind} b={b} reference-vs-numpy", ref, want, F32_TOL)
    if kind == "empty":
      assert not np.asarray(got).any()
    else:
      _check(f"q8 {family} {kind} vs f32 rows", got,
             _numpy_ffn(x, gate, up, down, ids, family), 5e-2)

  def test_int8_rows_validation(self):
    x, gate, up, down = _problem(2, 32, 64, 1)
    (qg, sg), (qu, su), (qd, sd) = (sf.quantize_rows_q8(w) for w in (gate, up, down))
    idx = jnp.asarray(sf.pad_indices(np.arange(4), 4))
    run = functools.partial(sf.sparse_ffn, interpret=self.INTERPRET)
    with self.assertRaisesRegex(ValueError, "need scales"):
      run(jnp.asarray(x), qg, qu, qd, idx)
    with self.assertRaisesRegex(ValueError, "scales are for int8 rows"):
      run(jnp.asarray(x), *(jnp.asarray(w) for w in (gate, up, down)), idx,
          scales=(sg, su, sd))
    with self.assertRaisesRegex(ValueError, "up scales must be"):
      run(jnp.asarray(x), qg, qu, qd, idx, scales=(sg, su[:, :1], sd))
    with self.assertRaisesRegex(ValueError, "tiles of 32"):
      run(jnp.asarray(x), qg, qu, qd, idx, scales=(sg, su, sd), block_d=64)


class SparseFfnInterpretTest(SparseFfnTest):
  """The same tests through the Pallas interpreter (any backend)."""

  INTERPRET = True


def test_odd_hidden_size_asks_for_padding():
  with pytest.raises(ValueError, match="pad_hidden"):
    sf._plan(1, 100, 16, 16, None)


def test_compiling_without_gpu_is_a_clear_error():
  if jax.default_backend() == "gpu":
    pytest.skip("a GPU is present")
  w = jnp.ones((64, 64))
  with pytest.raises(ValueError, match="sparse_ffn_reference"):
    sf.sparse_ffn(jnp.ones((1, 64)), w, w, w, jnp.zeros((16,), jnp.int32))


def test_quantize_rows_q8():
  rng = np.random.default_rng(4)
  rows = rng.standard_normal((5, 64)).astype(np.float32)
  rows[1, :32] = 0.0  # An all-zero block: scale 0, codes 0.
  q, sc = sf.quantize_rows_q8(rows)
  q, sc = np.asarray(q), np.asarray(sc)
  assert q.dtype == np.int8 and sc.shape == (5, 2) and sc[1, 0] == 0 and not q[1, :32].any()
  np.testing.assert_allclose(sc, np.abs(rows.reshape(5, 2, 32)).max(-1) / 127, rtol=1e-6)
  err = np.abs(q.reshape(5, 2, 32) * sc[..., None] - rows.reshape(5, 2, 32))
  assert (err <= sc[..., None] / 2 * (1 + 1e-5) + 1e-12).all()
  assert np.abs(q).max() == 127
  with pytest.raises(ValueError, match="multiple of 32"):
    sf.quantize_rows_q8(rows[:, :48])


def test_next_pow2():
  assert [sf.next_pow2(n) for n in (0, 1, 2, 3, 4, 5, 1536, 2048)] == [
      1, 1, 2, 4, 4, 8, 2048, 2048]


def test_pad_indices_numpy_and_jax():
  got = sf.pad_indices(np.array([3, 1, 2]), 8)
  assert got.dtype == np.int32 and isinstance(got, np.ndarray)
  np.testing.assert_array_equal(got, [3, 1, 2, -1, -1, -1, -1, -1])
  got_j = jax.jit(sf.pad_indices, static_argnums=1)(jnp.array([4, 5]), 4)
  assert got_j.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(got_j), [4, 5, -1, -1])
  np.testing.assert_array_equal(sf.pad_indices(np.array([], np.int32), 2),
                                [-1, -1])
  with pytest.raises(ValueError, match="unique"):
    sf.pad_indices(np.array([1, 1]), 4)
  with pytest.raises(ValueError, match="fit"):
    sf.pad_indices(np.arange(5), 4)
  with pytest.raises(ValueError, match=">= 0"):
    sf.pad_indices(np.array([-2]), 4)


def test_pad_hidden():
  rows = np.arange(12, dtype=np.float32).reshape(2, 6)
  got = sf.pad_hidden(rows, 4)
  assert got.shape == (2, 8) and np.all(got[:, 6:] == 0)
  np.testing.assert_array_equal(got[:, :6], rows)
  assert sf.pad_hidden(rows, 3) is rows
  got_j = sf.pad_hidden(jnp.asarray(rows, jnp.bfloat16), 4)
  assert got_j.dtype == jnp.bfloat16 and got_j.shape == (2, 8)


@pytest.mark.parametrize("b,n_hot,d,n_idx,dtype", [
    (1, 1536, 576, 256, jnp.float32),  # SmolLM2 decode, unpadded d
    (1, 11008, 4096, 2048, jnp.bfloat16),  # LLaMA-7B decode
    (3, 300, 576, 64, jnp.float32),  # small batch, broadcast path
    (40, 300, 576, 512, jnp.bfloat16),  # prefill, dot path, 2 batch tiles
])
def test_lowers_to_triton_ir(b, n_hot, d, n_idx, dtype, monkeypatch):
  """Lowers for CUDA on any machine and verifies the Triton module.

  Catches primitives without a Triton lowering and non-power-of-two tiles,
  which interpret mode accepts. (PTX compilation still needs a GPU.)
  """
  from jax.experimental.pallas import triton as plgpu
  try:
    from jax._src.pallas.triton import lowering as triton_lowering
  except ImportError as e:  # jaxlib without the Triton dialect
    pytest.skip(f"no Triton lowering: {e}")
  verified = []
  original = triton_lowering.lower_jaxpr_to_triton_module

  def lower_and_verify(*args, **kwargs):
    result = original(*args, **kwargs)
    verified.append(result.module.operation.verify())
    return result

  monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module",
                      lower_and_verify)
  fn = functools.partial(
      sf._sparse_ffn_impl, family="swiglu", block_n=32, block_d=None,
      interpret=False,
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2))
  args = ((jax.ShapeDtypeStruct((b, d), jnp.float32),)
          + (jax.ShapeDtypeStruct((n_hot, d), dtype),) * 3
          + (jax.ShapeDtypeStruct((n_idx,), jnp.int32),))
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "triton" in text
  assert verified == [True]
