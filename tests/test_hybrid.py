"""Hybrid sparse execution on the real SmolLM2 bundle: split/merge exactness, oracle, predictor."""

import numpy as np
import pytest

import pijax
from pijax import bundle_load

pytestmark = pytest.mark.slow

PROMPT = "The old lighthouse keeper climbed the stairs every evening to light the lamp."


@pytest.fixture(scope="module")
def bundle_model(converted):
  opts, _ = converted
  return pijax.load(opts.out)


@pytest.fixture(scope="module")
def prompt_ids(bundle_model):
  return bundle_model.tokenizer.encode(PROMPT)


def _rel(a, b):
  return np.abs(a - b).max() / np.abs(b).max()


@pytest.mark.parametrize("hot_ratio", [0.0, 0.3, 1.0])
def test_oracle_threshold_zero_equals_dense(bundle_model, prompt_ids, hot_ratio):
  """Every neuron active: the device/host split and merge reproduce the dense logits (the f32
  row format, kept as the exact oracle of the split; int8 rows: below)."""
  bundle_model.configure_host_weights("off")  # f32 XLA dense
  dense = bundle_model.prompt_logits(prompt_ids)
  dense_gen = bundle_model.generate(prompt_ids, max_new_tokens=6).token_ids
  bundle_model.configure_sparse("oracle", hot_ratio=hot_ratio, oracle_threshold=0.0,
                                row_format="f32")
  assert bundle_model.backend.spec.hot_counts[0] == min(1536, round(hot_ratio * 1536 / 64) * 64)
  logits, active = bundle_model.prompt_logits(prompt_ids, return_active=True)
  assert _rel(logits, dense) <= 1e-5
  np.testing.assert_allclose(active, 1.0)
  result = bundle_model.generate(prompt_ids, max_new_tokens=6)
  assert result.token_ids == dense_gen  # Decode path too (one callback per layer).
  assert result.stats.ffn_sparsity == 0.0
  bundle_model.configure_host_weights("off")  # f32 XLA dense


def _masked_dense_oracle(hf_model, masks, perm, ids):
  """transformers' Llama whose MLP in layer l zeroes the neurons that masks[l] marks inactive.

  masks: bool[L, T, F] in the bundle's (permuted) neuron order; perm[l, j] is the original
  index of stored neuron j.
  """
  import torch
  patched = []
  for i, layer in enumerate(hf_model.model.layers):
    mlp = layer.mlp
    keep = np.zeros(masks.shape[1:], np.float32)
    keep[:, perm[i]] = masks[i]
    keep = torch.tensor(keep)[None]  # [1, T, F] in original order.

    def forward(x, mlp=mlp, keep=keep):
      a = torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x)
      return mlp.down_proj(a * keep)

    patched.append((mlp, mlp.forward))
    mlp.forward = forward
  try:
    with torch.no_grad():
      return hf_model(torch.tensor([ids])).logits[0].float().numpy()
  finally:
    for mlp, original in patched:
      mlp.forward = original


@pytest.mark.parametrize("hot_ratio", [1.0, 0.3, 0.0])
def test_oracle_equals_dense_with_same_neurons_zeroed(bundle_model, prompt_ids, hf_model,
                                                      hot_ratio):
  """Real thresholds: the hybrid run equals transformers' dense run zeroing the same neurons.

  (Runs with different splits are not compared with each other: float rounding moves neurons
  across the threshold, and each flip legitimately changes the function.)
  """
  import jax
  import jax.numpy as jnp
  from pijax.nn import hybrid
  bundle_model.configure_sparse("oracle", hot_ratio=hot_ratio, row_format="f32")
  run = jax.jit(lambda p, t: hybrid.forward_with_masks(p, t, config=bundle_model.config,
                                                       sparse=bundle_model.backend.spec))
  logits, masks = run(bundle_model.backend.params, jnp.asarray([prompt_ids], jnp.int32))
  bundle_model.configure_host_weights("off")  # f32 XLA dense
  logits, masks = np.asarray(logits[0]), np.asarray(masks[:, 0])
  assert 0.3 < 1.0 - masks.mean() < 0.7  # Target sparsity 0.5 on calibration text.
  ref = _masked_dense_oracle(hf_model, masks, bundle_model.sparse.perm, prompt_ids)
  assert (logits.argmax(-1) == ref.argmax(-1)).all()
  assert _rel(logits, ref) <= 1e-4


def test_predictor_mode_generates(bundle_model):
  bundle_model.configure_sparse("predictor", hot_ratio=0.3, host_threads=2)
  result = bundle_model.generate("The capital of France is", max_new_tokens=16)
  assert result.stats.decode_steps == len(result.token_ids) - 1
  assert 0.0 < result.stats.ffn_sparsity < 1.0
  assert bundle_model.compile_count("decode") == 1
  assert result.text.strip()
  bundle_model.configure_host_weights("off")  # f32 XLA dense


def test_sparse_mode_needs_a_bundle(smollm2):
  from pijax.errors import ConfigError
  with pytest.raises(ConfigError, match="bundle"):
    smollm2.configure_sparse("predictor")
  with pytest.raises(ConfigError):
    smollm2.configure_sparse("sometimes")


@pytest.mark.parametrize("hot_ratio", [0.0, 0.3])
def test_lowbit_predictor_masks_and_logits(bundle_model, prompt_ids, hf_model, hot_ratio):
  """Low-bit predictor mode (device-predicted, so the whole mask is visible): the mask is the
  NumPy estimate >= cut, and the logits equal transformers' dense model zeroing exactly the
  neurons the predictor skipped."""
  import jax
  import jax.numpy as jnp
  from pijax.nn import hybrid
  from pijax.nn import transformer as model_lib
  from pijax.offline import predictor as predictor_lib
  bundle_model.configure_sparse("predictor", hot_ratio=hot_ratio, predictor_kind="lowbit",
                                host_predict=False, row_format="f32")
  assert bundle_model.backend.spec.predictor_kind == "lowbit"
  run = jax.jit(lambda p, t: hybrid.forward_with_masks(p, t, config=bundle_model.config,
                                                       sparse=bundle_model.backend.spec))
  logits, masks = run(bundle_model.backend.params, jnp.asarray([prompt_ids], jnp.int32))
  bundle_model.configure_host_weights("off")  # f32 XLA dense
  logits, masks = np.asarray(logits[0]), np.asarray(masks[:, 0])
  assert 0.3 < 1.0 - masks.mean() < 0.7
  ref = _masked_dense_oracle(hf_model, masks, bundle_model.sparse.perm, prompt_ids)
  assert (logits.argmax(-1) == ref.argmax(-1)).all()
  assert _rel(logits, ref) <= 1e-4
  # The masks follow the independent NumPy estimate on each layer's FFN input (the sparse
  # run's own residual stream, which differs from the dense run's after layer 0).
  cfg = bundle_model.config
  bundle_model.configure_sparse("predictor", hot_ratio=hot_ratio, predictor_kind="lowbit",
                                host_predict=False, row_format="f32")
  spec, hparams = bundle_model.backend.spec, bundle_model.backend.params
  bundle_model.configure_host_weights("off")  # f32 XLA dense
  t = len(prompt_ids)
  _, state = jax.jit(lambda p, ids: model_lib.Transformer(cfg, t, spec).apply(
      {"params": p}, ids, jnp.zeros((), jnp.int32), model_lib.init_cache(cfg, 1, t), None,
      mutable=["intermediates"]))(hparams, jnp.asarray([prompt_ids], jnp.int32))
  inputs = [np.asarray(state["intermediates"][f"layers_{i}"]["ffn_input"][0])[0]
            for i in range(cfg.n_layers)]
  for layer in (0, 14, 29):
    p = bundle_model.params[f"layers_{layer}"]
    x = inputs[layer].astype(np.float64)
    h = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps)
    h = h * np.asarray(p["ffn_norm"]["scale"], np.float64)
    rows = bundle_load.rows(bundle_model)[f"layers_{layer}"]
    params = predictor_lib.lowbit_params(np.asarray(rows["gate"]), np.asarray(rows["up"]))
    est = predictor_lib.lowbit_contribution_reference(params, h, cfg.ffn_family)
    cut = float(bundle_model.sparse.thresholds[layer])
    clear = np.abs(est - cut) > 1e-4 * cut  # Float rounding may flip exact near-ties.
    assert clear.mean() > 0.99
    np.testing.assert_array_equal(masks[layer][clear], (est >= cut)[clear])


def test_overlapped_host_part_equals_serial(bundle_model, prompt_ids):
  """The overlapped variant (host part in a worker thread between two callbacks) computes the
  same function as the serial one: threshold 0 gives the dense logits, and the predictor run
  gives the serial run's logits bit for bit (same kernels, same order of sums)."""
  bundle_model.configure_host_weights("off")  # f32 XLA dense
  dense = bundle_model.prompt_logits(prompt_ids)
  bundle_model.configure_sparse("oracle", hot_ratio=0.3, oracle_threshold=0.0, overlap=True,
                                row_format="f32")
  assert bundle_model.backend.spec.overlap
  assert _rel(bundle_model.prompt_logits(prompt_ids), dense) <= 1e-5
  runs = {}
  for overlap in (False, True):
    bundle_model.configure_sparse("predictor", hot_ratio=0.3, predictor_kind="lowbit",
                                  overlap=overlap, host_predict=False)
    logits = bundle_model.prompt_logits(prompt_ids)
    result = bundle_model.generate(prompt_ids, max_new_tokens=8)
    runs[overlap] = (logits, result.token_ids, result.stats.ffn_sparsity)
  bundle_model.configure_host_weights("off")  # f32 XLA dense
  np.testing.assert_array_equal(runs[True][0], runs[False][0])
  assert runs[True][1] == runs[False][1]
  assert runs[True][2] == runs[False][2] > 0.2


def test_predictor_perplexity_within_5_percent_at_30_percent_sparsity(bundle_model):
  """Issue 4's bar: 20 chunks x 512 tokens of WikiText-2 test (never calibrated on), the
  predictor mode (auto = low-bit for SwiGLU) within +5% of dense at >= 30% measured sparsity;
  greedy text for the README prompt stays coherent (names the capital)."""
  import os
  from pijax import perplexity as ppl_lib
  path = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "wikitext-2-raw",
                      "wiki.test.raw")
  with open(path, encoding="utf-8") as f:
    text = f.read()
  quiet = lambda s: None  # noqa: E731
  bundle_model.configure_host_weights("off")  # f32 XLA dense
  dense = ppl_lib.perplexity(bundle_model, text, n_ctx=512, chunks=20, log=quiet)
  dense_text = bundle_model.generate("The capital of France is", max_new_tokens=12).text
  bundle_model.configure_sparse("predictor", hot_ratio=0.3)
  assert bundle_model.backend.spec.predictor_kind == "lowbit"
  sparse = ppl_lib.perplexity(bundle_model, text, n_ctx=512, chunks=20, log=quiet)
  sparse_text = bundle_model.generate("The capital of France is", max_new_tokens=12).text
  bundle_model.configure_host_weights("off")  # f32 XLA dense
  assert sparse.ffn_sparsity >= 0.30
  assert sparse.ppl <= 1.05 * dense.ppl
  assert "Paris" in dense_text and "Paris" in sparse_text


def test_eval_predictors_lowbit_on_new_text(bundle_model):
  """pijax.eval_predictors on WikiText (never calibrated on): the low-bit predictor recalls
  nearly every truly active neuron while skipping a third or more."""
  import os
  from pijax import eval_predictors
  path = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "wikitext-2-raw",
                      "wiki.test.raw")
  with open(path, encoding="utf-8") as f:
    text = f.read()[:20000]
  rows = eval_predictors.evaluate_predictors(bundle_model, text, max_tokens=1024,
                                             predictor_kind="lowbit", progress=False)
  assert len(rows) == bundle_model.config.n_layers
  recall = np.mean([r["recall"] for r in rows])
  skipped = np.mean([r["predicted_sparsity"] for r in rows])
  assert recall >= 0.9 and skipped >= 0.3
  table = eval_predictors.format_table(rows, bundle_model.sparse.manifest, "lowbit")
  assert table.splitlines()[0].startswith("| layer | predictor | recall |")
  assert table.splitlines()[-1].startswith("| mean |")


@pytest.mark.parametrize("hot_ratio", [0.0, 0.3])
def test_host_predicted_cold_part(bundle_model, prompt_ids, hot_ratio):
  """host_predict (the default for the low-bit predictor): the host predicts its own neurons
  in its callback; the run computes the same function as the device-predicted one up to float
  rounding of the estimates near the cut, and decode compiles once."""
  runs = {}
  for host_predict in (False, True):
    bundle_model.configure_sparse("predictor", hot_ratio=hot_ratio, predictor_kind="lowbit",
                                  host_predict=host_predict)
    assert bundle_model.backend.spec.host_predict == host_predict
    logits, active = bundle_model.prompt_logits(prompt_ids, return_active=True)
    result = bundle_model.generate(prompt_ids, max_new_tokens=8)
    assert bundle_model.compile_count("decode") == 1
    runs[host_predict] = (logits, float(1.0 - np.mean(active)), result)
  bundle_model.configure_host_weights("off")  # f32 XLA dense
  (l0, s0, r0), (l1, s1, r1) = runs[False], runs[True]
  assert abs(s0 - s1) < 0.005 and 0.3 < s1 < 0.7
  assert (l0.argmax(-1) == l1.argmax(-1)).mean() >= 0.9
  assert _rel(l1, l0) <= 0.05
  assert abs(r0.stats.ffn_sparsity - r1.stats.ffn_sparsity) < 0.02


def test_sparse_knobs_are_validated(bundle_model):
  from pijax.errors import ConfigError
  for kwargs, needle in (({"threshold_scale": float("nan")}, "threshold_scale"),
                         ({"threshold_scale": float("inf")}, "threshold_scale"),
                         ({"threshold_scale": -1.0}, "threshold_scale"),
                         ({"cut_offset": float("nan")}, "cut_offset"),
                         ({"device_budget_gb": float("inf")}, "device_budget_gb"),
                         ({"overlap": True, "host_predict": True}, "--overlap")):
    with pytest.raises(ConfigError, match=needle):
      bundle_model.configure_sparse("predictor", **kwargs)
  bundle_model.configure_sparse("predictor", hot_ratio=0.0, overlap=True)  # Implies device ids.
  assert not bundle_model.backend.spec.host_predict and bundle_model.backend.spec.overlap
  bundle_model.configure_host_weights("off")  # f32 XLA dense


def test_bundle_runs_on_the_host_engine(bundle_model, smollm2, prompt_ids):
  """Issue 32, item 2: on a CPU backend a bundle's --sparse=off and predictor run on the host
  engine over the source GGUF's own blocks. off equals the plain GGUF's host run bit for bit;
  predictor is the exact contribution rule at the bundle's thresholds, the same function as
  the plain GGUF's host engine with those cuts (whose kernel tests/test_host_quant.py checks
  against the float64 reference decoder), skipping about the calibrated share of down rows;
  threshold_scale=0 keeps every neuron."""
  from pijax.backends import host
  try:
    bundle_model.configure_sparse("off")
    assert isinstance(bundle_model.backend, host.HostBackend)
    assert bundle_model.sparse_mode == "off" and "host" in bundle_model.weights_label
    off = bundle_model.prompt_logits(prompt_ids)
    smollm2.configure_host_weights("gguf")
    np.testing.assert_array_equal(off, smollm2.prompt_logits(prompt_ids))

    bundle_model.configure_sparse("predictor")
    assert bundle_model.sparse_mode == "predictor"
    thresholds = [float(t) for t in bundle_model.sparse.thresholds]
    assert bundle_model.backend.decoder.contribution_cuts == thresholds
    got, active = bundle_model.prompt_logits(prompt_ids, return_active=True)
    smollm2.use_backend(host.build(smollm2.config, smollm2.path, "gguf", gate_cuts=True,
                                   gate_rule="contribution", contribution_cuts=thresholds))
    np.testing.assert_array_equal(got, smollm2.prompt_logits(prompt_ids))
    assert 0.3 < 1.0 - float(np.mean(active)) < 0.7
    result = bundle_model.generate("The capital of France is", max_new_tokens=12)
    assert "Paris" in result.text and 0.3 < result.stats.ffn_sparsity < 0.7, result
    from pijax import bench  # `pijax.bench --interleave_dense` times it beside dense.
    sparse_row, dense_row = bench.run(bundle_model, n_prompt=0, n_gen=4, reps=1, threads=1,
                                      interleave_dense=True)
    assert (sparse_row["mode"], dense_row["mode"]) == ("predictor", "off")
    assert bundle_model.backend.decoder.contribution_cuts == thresholds  # Restored after.

    # Every neuron kept (threshold_scale 0): dense, to f32 rounding with f32 products (int8
    # ones round the neuron-major down rows' products apart from the dense matmul's).
    bundle_model.configure_sparse("off", host_dot="f32")
    off32 = bundle_model.prompt_logits(prompt_ids)
    bundle_model.configure_sparse("predictor", threshold_scale=0.0, host_dot="f32")
    every, active = bundle_model.prompt_logits(prompt_ids, return_active=True)
    np.testing.assert_allclose(active, 1.0)
    assert _rel(every, off32) <= 1e-4
    # Hot neurons asked for: the hybrid backend (int8 hot rows, the host engine's cold rows);
    # hot_ratio 0 is the host engine's.
    bundle_model.configure_sparse("predictor", hot_ratio=0.0)
    assert bundle_model.backend.name == "host"
    bundle_model.configure_sparse("predictor", hot_ratio=0.3)
    assert bundle_model.backend.name == "hybrid"
  finally:
    bundle_model.configure_host_weights("off")
    smollm2.configure_host_weights("off")


def test_eval_predictors_reports_the_host_rule(bundle_model):
  """`pijax.eval_predictors` with auto evaluates what the runtime runs, here the host engine's
  contribution rule: against the f32 model's true sets on text it was not calibrated on it
  recalls nearly every active neuron (only int8 products and drift move neurons at the cut)."""
  import os
  from pijax import eval_predictors
  assert eval_predictors.resolve_kind(bundle_model, "auto") == "contribution"
  path = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "wikitext-2-raw",
                      "wiki.test.raw")
  with open(path, encoding="utf-8") as f:
    text = f.read()[:20000]
  rows = eval_predictors.evaluate_predictors(bundle_model, text, max_tokens=512, chunk_len=256,
                                             predictor_kind="contribution", progress=False)
  recall = np.mean([r["recall"] for r in rows])
  precision = np.mean([r["precision"] for r in rows])
  skipped = np.mean([r["predicted_sparsity"] for r in rows])
  assert recall >= 0.9 and precision >= 0.9 and 0.3 <= skipped <= 0.7, (recall, precision,
                                                                         skipped)


@pytest.mark.parametrize("hot_ratio", [0.0, 0.3, 1.0])
def test_int8_rows_split_and_merge_exact(bundle_model, hot_ratio):
  """Issue 32, item 3: the hybrid FFN on int8 rows (hot: i8 + f32 scale per 32 on the device;
  cold: the source GGUF's Q4_1 gate/up blocks and Q8_0 down rows on the host) equals the
  float64 NumPy sum of its two halves on the same rows and mask, for each layer tried: the
  dequantized hot rows on f32 h, the cold rows as `QuantColdFFN.reference` (int8 products)."""
  import jax.numpy as jnp
  from pijax.nn import hybrid
  from pijax.offline import placement
  cfg = bundle_model.config
  bundle_model.configure_sparse("oracle", hot_ratio=hot_ratio)
  spec, params = bundle_model.backend.spec, bundle_model.backend.params
  bundle_model.configure_host_weights("off")
  assert spec.row_format == "int8"
  rng = np.random.default_rng(int(hot_ratio * 10))
  d, f = cfg.hidden_size, cfg.intermediate_size
  for layer in (0, 17):
    n_hot = spec.hot_counts[layer]
    p = params[f"layers_{layer}"]["ffn"]
    if n_hot:
      assert p["hot_gate"].dtype == jnp.int8 and p["hot_down_scale"].shape == (n_hot, d // 32)
      assert sum(p[f"hot_{k}"].nbytes + p[f"hot_{k}_scale"].nbytes
                 for k in ("gate", "up", "down")) == n_hot * placement.int8_neuron_bytes(cfg)
    cold = spec.host_layers[layer]
    assert (cold is None) == (n_hot == f)
    if cold is not None:
      assert cold.kind == "q4_1" and cold.down_t.kind == "q8_0"
    x = rng.standard_normal((1, 3, d)).astype(np.float32)
    h = rng.standard_normal((1, 3, d)).astype(np.float32)
    y, state = hybrid.HybridFFN(cfg, spec, layer).apply(
        {"params": p}, jnp.asarray(x), jnp.asarray(h), mutable=["intermediates", "masks"])
    mask = np.asarray(state["masks"]["mask"][0])[0]  # [T, F]
    assert 0.0 < mask.mean() < 1.0  # Some neurons on, some off (random h: most on).
    h2 = h[0].astype(np.float64)
    ref = np.zeros((3, d))
    if n_hot:
      rows = [np.asarray(hybrid.dequantize_rows(p[f"hot_{k}"], p[f"hot_{k}_scale"]), np.float64)
              for k in ("gate", "up", "down")]
      g, u = h2 @ rows[0].T, h2 @ rows[1].T
      ref += (g / (1 + np.exp(-g)) * u * mask[:, :n_hot]) @ rows[2]
    if cold is not None:
      ids = np.where(mask[:, n_hot:], np.arange(f - n_hot), -1).astype(np.int32)
      ref += cold.reference(h[0], ids)
    got = np.asarray(y[0], np.float64)
    assert np.abs(got - ref).max() <= 2e-5 * np.abs(ref).max()


def test_int8_rows_follow_the_f32_model(bundle_model, prompt_ids, hf_model):
  """The int8 hybrid with every neuron active stays within int8 rounding of transformers'
  f32 model (the host engine's int8 products move SmolLM2's logits by as much), and the
  predictor mode names the capital; bytes per token count the hot neurons' int8 rows."""
  import torch
  from pijax.offline import placement
  bundle_model.configure_sparse("oracle", hot_ratio=0.3, oracle_threshold=0.0)
  logits = bundle_model.prompt_logits(prompt_ids)
  cfg, spec = bundle_model.config, bundle_model.backend.spec
  read, total = bundle_model.backend.weight_bytes_per_token(0.0)
  assert bundle_model.weights_label == "float32 + int8 hot + q4_1/q8_0 host int8"
  bundle_model.configure_sparse("predictor", hot_ratio=0.3)
  result = bundle_model.generate("The capital of France is", max_new_tokens=12)
  bundle_model.configure_host_weights("off")
  with torch.no_grad():
    ref = hf_model(torch.tensor([prompt_ids])).logits[0].float().numpy()
  assert (logits.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
  assert _rel(logits, ref) <= 0.1
  assert "Paris" in result.text and 0.3 < result.stats.ffn_sparsity < 0.7, result
  hot = sum(spec.hot_counts) * placement.int8_neuron_bytes(cfg)
  cold = sum((cfg.intermediate_size - n) * w.bytes_per_neuron
             for n, w in zip(spec.hot_counts, spec.host_layers))
  ffn32 = 3 * cfg.hidden_size * cfg.intermediate_size * cfg.n_layers * 4
  assert read == total - ffn32 + hot + cold + 2 * ffn32 // 3  # Oracle: gate/up decide.
  assert bundle_model.sparse.manifest["device"]["bytes_per_hot_neuron"] == \
      placement.int8_neuron_bytes(cfg)


def test_int8_rows_pallas_kernel_in_interpret_mode(bundle_model, prompt_ids):
  """The hot part of decode through the Pallas int8 kernel (`use_pallas`; Pallas' interpreter
  on CPU) gives the plain-jnp path's greedy tokens, every neuron active and with the oracle's
  real thresholds."""
  runs = {}
  for threshold in (0.0, None):
    for use_pallas in (False, True):
      bundle_model.configure_sparse("oracle", hot_ratio=0.5, oracle_threshold=threshold,
                                    use_pallas=use_pallas)
      assert bundle_model.backend.spec.use_pallas == use_pallas
      runs[threshold, use_pallas] = bundle_model.generate(prompt_ids, max_new_tokens=4).token_ids
  bundle_model.configure_host_weights("off")
  for threshold in (0.0, None):
    assert runs[threshold, True] == runs[threshold, False]
