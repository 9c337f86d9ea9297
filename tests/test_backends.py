"""Conformance of every backend on every tiny family (SwiGLU, ReGLU, dReLU; both RoPE layouts).

Oracles: transformers (CPU, f32) on the same weights; and the backends against each other on the
same inputs (the host backend keeps Q8_0 blocks, so it is checked against the XLA backend running
the same dequantized values). Also: decode compiles once per backend, a backend refuses what it
cannot run by name, and two models / two interleaved sequences give the tokens of separate runs.
"""

import dataclasses

import numpy as np
import pytest

import pijax
import tiny_models
from pijax.formats import bundle as bundle_lib
from pijax import config as config_lib
from pijax.arch import registry
from pijax.backends import host as host_backend
from pijax.backends import hybrid as hybrid_backend
from pijax.backends import xla as xla_backend
from pijax.errors import GGUFError, UnsupportedError

FAMILIES = [("swiglu", "silu", None, False), ("reglu", "relu", "relu", False),
            ("drelu", "relu", "drelu", True)]
IDS = [3, 17, 99, 4, 250, 11, 42, 7, 128, 64, 5, 200]


def _hf_logits(hf, ids):
  import torch
  with torch.no_grad():
    return hf(torch.tensor([ids])).logits[0].float().numpy()


def _tiny(tmp_path, family, act, activation, tied, rope, qtype="F32", seed=3):
  """(transformers model, pijax Model) of one tiny family in one RoPE layout."""
  hf = tiny_models.make_hf_llama(hidden_act=act, tied=tied, seed=seed)
  if family == "drelu":
    tiny_models.use_drelu(hf)
  path = tiny_models.write_gguf(hf, tmp_path / f"{family}_{rope}_{qtype}.gguf",
                                ffn_activation=activation, qtype=qtype,
                                interleave_rope=rope == config_lib.ROPE_ADJACENT)
  model = pijax.load(path, max_seq_len=64)
  assert model.config.ffn_family == family
  if rope == config_lib.ROPE_HALF:  # The file keeps HF's row order: tell every backend so.
    model.config = dataclasses.replace(model.config, rope_style=config_lib.ROPE_HALF)
    model.use_backend(xla_backend.XlaBackend(model.config, model.params, model.dtype))
  return hf, model


def _tiny_bundle(model, hot_ratio=0.5):
  """An in-memory bundle of a tiny model: identity neuron order, MLP predictors that mark every
  neuron active (bias-free fc2 of zeros against a cut below 0)."""
  cfg = model.config
  f, d = cfg.intermediate_size, cfg.hidden_size
  perm = np.tile(np.arange(f, dtype=np.int32), (cfg.n_layers, 1))
  hot = int(round(hot_ratio * f))
  rank = 8
  model.sparse = bundle_lib.SparseBundle(
      path="(in memory)", manifest={"layers": [{"predictor_rank": rank}] * cfg.n_layers,
                                    "placement": {"tile": 16}},
      ffn=bundle_lib.permute_ffn(model.params, cfg.n_layers, perm),
      predictors={f"layers_{i}": {"fc1": np.zeros((d, rank), np.float32),
                                  "fc2": np.zeros((rank, f), np.float32)}
                  for i in range(cfg.n_layers)},
      cuts=np.full(cfg.n_layers, -1.0, np.float32),
      thresholds=np.zeros(cfg.n_layers, np.float32),
      rms_bounds=np.full(cfg.n_layers, np.inf, np.float32),
      frequencies=np.ones((cfg.n_layers, f), np.float32), perm=perm,
      hot_counts=[hot] * cfg.n_layers)
  return model


def _backends(model, path):
  """name -> backend for one tiny model (the host one on a Q8_0 copy is separate)."""
  return {
      "xla": xla_backend.XlaBackend(model.config, model.params, model.dtype),
      # f32 rows: the hybrid's exact oracle row format (the split and merge alone).
      "hybrid_oracle": hybrid_backend.for_model(_tiny_bundle(model), "oracle",
                                                hot_ratio=0.5, oracle_threshold=0.0,
                                                row_format="f32"),
      "hybrid_predictor": hybrid_backend.for_model(_tiny_bundle(model), "predictor",
                                                   hot_ratio=0.25, predictor_kind="mlp",
                                                   host_predict=False, row_format="f32"),
      # int8 rows (the product): int8 hot rows, the host engine's rows of the file for the cold.
      "hybrid_int8": hybrid_backend.for_model(_tiny_bundle(model), "oracle", hot_ratio=0.5,
                                              oracle_threshold=0.0),
  }


@pytest.mark.parametrize("rope", [config_lib.ROPE_ADJACENT, config_lib.ROPE_HALF])
@pytest.mark.parametrize("family,act,activation,tied", FAMILIES)
def test_device_backends_match_transformers(tmp_path, family, act, activation, tied, rope):
  """XLA and hybrid (every neuron active: the hot half on the device, the cold half through
  the host callback) give transformers' logits, prefill and decode, through the engine; the
  hybrid on int8 rows within int8 rounding of them."""
  hf, model = _tiny(tmp_path, family, act, activation, tied, rope)
  ref = _hf_logits(hf, IDS)
  for name, backend in _backends(model, model.path).items():
    model.use_backend(backend)
    got = model.prompt_logits(IDS)
    err = np.abs(got - ref).max()
    if name == "hybrid_int8":
      assert backend.spec.row_format == "int8" and err <= 5e-2 * np.abs(ref).max(), err
      assert model.generate(IDS[:5], max_new_tokens=6, temperature=0.0).token_ids
      continue
    assert err <= 1e-4 * np.abs(ref).max(), (name, err)
    # Greedy decode through the engine equals transformers' greedy continuation.
    result = model.generate(IDS[:5], max_new_tokens=6, temperature=0.0)
    want = list(IDS[:5])
    for _ in range(len(result.token_ids)):
      want.append(int(_hf_logits(hf, want)[-1].argmax()))
    assert result.token_ids == want[5:], name
    assert model.compile_count("decode") == 1, name


@pytest.mark.parametrize("rope", [config_lib.ROPE_ADJACENT, config_lib.ROPE_HALF])
@pytest.mark.parametrize("family,act,activation,tied", FAMILIES)
def test_host_backend_matches_xla_on_the_same_blocks(tmp_path, family, act, activation, tied,
                                                     rope):
  """On a Q8_0 file the host backend (blocks kept) with f32 products and the XLA backend
  (blocks dequantized to f32) compute the same function; both stay close to transformers'
  unquantized model. With int8 products (the default) the host backend computes its float64
  reference's int8 arithmetic."""
  hf, model = _tiny(tmp_path, family, act, activation, tied, rope, qtype="Q8_0")
  xla_logits = model.prompt_logits(IDS)
  xla_tokens = model.generate(IDS[:5], max_new_tokens=6, temperature=0.0).token_ids
  model.use_backend(host_backend.build(model.config, model.path, "gguf"))
  dec = model.backend.decoder
  if dec.dot == "int8":
    from host_ops import decoder as decoder_lib
    got, ref8 = model.prompt_logits(IDS), decoder_lib.decoder_reference(dec, IDS)
    err = np.abs(got - ref8) / np.abs(ref8).max()
    assert err.max() <= 2e-2 and err.mean() <= 1e-3, (err.max(), err.mean())
  model.use_backend(host_backend.build(model.config, model.path, "gguf", dot="f32"))
  assert model.backend.decoder.lm_head.kind == "q8_0"
  host_logits = model.prompt_logits(IDS)
  np.testing.assert_allclose(host_logits, xla_logits, rtol=1e-4,
                             atol=1e-4 * np.abs(xla_logits).max())
  result = model.generate(IDS[:5], max_new_tokens=6, temperature=0.0)
  assert result.token_ids == xla_tokens
  assert model.compile_count("decode") == 1
  assert model.backend.live_states == 0  # The engine released its host KV caches.
  ref = _hf_logits(hf, IDS)
  assert np.abs(host_logits - ref).max() <= 0.05 * np.abs(ref).max()


def test_backends_refuse_what_they_do_not_implement(tmp_path):
  """A family switch a backend does not implement is refused by name (the hybrid backend runs
  llama-family bundles only; the dense ones run every family); so is an unknown architecture."""
  _, model = _tiny(tmp_path, "swiglu", "silu", None, False, config_lib.ROPE_ADJACENT)
  for switch, value in (("qk_norm", True), ("qkv_bias", True),
                        ("norm_placement", config_lib.NORM_SANDWICH), ("sliding_window", 512)):
    cfg = dataclasses.replace(model.config, **{switch: value})
    assert cfg.variant_switches() == {switch: value}
    for cls in (xla_backend.XlaBackend, host_backend.HostBackend):
      cls.supports(cfg)
    with pytest.raises(UnsupportedError, match=f"hybrid backend .*{switch}"):
      hybrid_backend.HybridBackend.supports(cfg)
  assert model.config.variant_switches() == {}
  with pytest.raises(GGUFError, match="architecture 'falcon' is not supported"):
    registry.get_family("falcon", "m.gguf")
  with pytest.raises(GGUFError, match="not supported"):
    registry.config_from_metadata({"general.architecture": None}, "m.gguf", set())


def test_family_tensor_map_is_the_one_the_loaders_read():
  names = registry.get_family("llama").tensors
  assert names.name("q", 3) == "blk.3.attn_q.weight"
  assert names.name("lm_head") == "output.weight"
  assert set(registry.LAYER_ROLES + registry.GLOBAL_ROLES) == set(names.names)
  phi3 = registry.get_family("phi3").tensors
  cfg = registry.config_from_metadata(
      {"general.architecture": "phi3", "phi3.embedding_length": 64,
       "phi3.attention.head_count": 4, "phi3.attention.head_count_kv": 2,
       "phi3.feed_forward_length": 160, "phi3.block_count": 2, "phi3.vocab_size": 256},
      "m.gguf", {})
  assert phi3.locate("up", 2, cfg) == registry.TensorSlice("blk.2.ffn_up.weight", 160, 320, 320)
  assert phi3.locate("v", 0, cfg) == registry.TensorSlice("blk.0.attn_qkv.weight", 96, 128, 128)
  assert phi3.locate("o", 1, cfg) == registry.TensorSlice("blk.1.attn_output.weight")


@pytest.mark.parametrize("backend", ["xla", "host", "hybrid"])
def test_two_models_and_interleaved_sequences(tmp_path, backend):
  """Two Models in one process, and two interleaved streams of one Model, give the tokens of
  separate runs (sampled, so the PRNG state of each sequence is separate too)."""
  paths = [tiny_models.write_random_quantized_gguf(tmp_path / f"m{s}.gguf", layer_type="Q8_0",
                                                   seed=s) for s in (0, 1)]
  models = [pijax.load(p, max_seq_len=64) for p in paths]
  for model in models:
    if backend == "host":
      model.configure_host_weights("gguf")
    elif backend == "hybrid":
      _tiny_bundle(model)
      model.configure_sparse("oracle", hot_ratio=0.5, oracle_threshold=0.0)
    assert model.backend.name == backend
  prompts = [[0, 5, 9, 77], [0, 7, 3]]
  kwargs = dict(max_new_tokens=8, temperature=0.9, top_k=20, seed=11)
  alone = {(m, p): models[m].generate(prompts[p], **kwargs).token_ids
           for m in (0, 1) for p in (0, 1)}
  assert alone[0, 0] != alone[1, 0]  # Different weights, different tokens.
  streams = {(m, p): models[m].stream(prompts[p], **kwargs) for m in (0, 1) for p in (0, 1)}
  pending = dict(streams)
  while pending:  # Round-robin one piece at a time over two models x two sequences.
    for key, stream in list(pending.items()):
      if next(stream, None) is None and stream.result is not None:
        del pending[key]
  for key, stream in streams.items():
    assert stream.result.token_ids == alone[key], key
  if backend == "host":
    assert all(m.backend.live_states == 0 for m in models)


def test_host_pass_runs_on_the_calling_thread(tmp_path):
  """The host backend's whole-pass callback runs on the thread that called the step (XLA:CPU
  runs a step inline when its state is donated): numba's thread pool lives there, and from XLA's
  worker thread the same pass ran 3x slower (BUILD_NOTES.md, issue 10)."""
  import threading
  path = tiny_models.write_random_quantized_gguf(tmp_path / "m.gguf", layer_type="Q8_0")
  model = pijax.load(path, max_seq_len=64)
  model.configure_host_weights("gguf")
  backend = model.backend
  threads = []
  inner = backend._forward_cb

  def spy(*args):
    threads.append(threading.current_thread())
    return inner(*args)

  backend._forward_cb = spy
  model.generate([0, 5, 9], max_new_tokens=4, temperature=0.0)
  assert len(threads) >= 2 and set(threads) == {threading.current_thread()}
  # Steps chained on device arrays, no host sync between them (as pijax.bench runs decode):
  # the sampler runs apart (loop emitters), and a step whose inputs were still being computed
  # would run its callback on XLA's thread; each step returns them ready instead.
  import jax
  import jax.numpy as jnp
  from pijax import sampling
  threads.clear()
  token, key = jnp.asarray([0], jnp.int32), jax.random.PRNGKey(0)
  sparams, recent = sampling.make_sampling_params(temperature=0.7), jnp.full((1, 4), -1,
                                                                             jnp.int32)
  cache = model.new_cache(1)
  args = (model.step_params, cache, token, jnp.asarray(0, jnp.int32), key, sparams, recent)
  exe = model.compiled("decode", model.kv_bucket(8), args)
  for pos in range(6):
    token, cache, key, _ = exe(model.step_params, cache, token, jnp.asarray(pos, jnp.int32),
                               key, sparams, recent)
  model.release_cache(cache)
  assert len(threads) == 6 and set(threads) == {threading.current_thread()}


def test_host_sampler_compiled_apart_gives_the_fused_steps_tokens(tmp_path):
  """The host backend compiles sampling as its own executable (XLA's loop emitters, for memory)
  and calls the forward pass directly (`eager_forward`, no XLA program around the host pass):
  the same tokens and log-probs as the fused, traced forward+sample step (the host pass through
  its io_callback), one sampler for prefill and decode."""
  import jax
  path = tiny_models.write_random_quantized_gguf(tmp_path / "m.gguf", layer_type="Q8_0")
  model = pijax.load(path, max_seq_len=64)
  model.configure_host_weights("gguf")
  kwargs = dict(max_new_tokens=10, temperature=0.8, top_k=30, top_p=0.9, seed=5,
                logprobs=True)

  def run():
    steps = [s for s in model.generate_ids([0, 5, 9, 77], **kwargs) if s.token_id >= 0]
    return [s.token_id for s in steps], np.stack([s.logprobs for s in steps])

  split_ids, split_lp = run()
  assert model.backend.sampler_compiler_options is not None
  assert sum(1 for key in model._compiled if key[0] == "sample") == 1
  split = [exe for key, exe in model._compiled.items()
           if key[0] in ("prefill_logprobs", "decode_logprobs")]
  assert len(split) == 2 and not any(isinstance(exe.forward, jax.stages.Compiled)
                                     for exe in split)
  model.backend.sampler_compiler_options = None  # This instance only: the fused step.
  model._compiled.clear()
  fused_ids, fused_lp = run()
  assert not any(key[0] == "sample" for key in model._compiled)
  assert split_ids == fused_ids
  np.testing.assert_allclose(split_lp, fused_lp, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("factor", [0.0, float("nan"), -2.0, "x"])
def test_rope_scaling_factor_is_checked(factor):
  meta = {"general.architecture": "llama", "llama.embedding_length": 64,
          "llama.attention.head_count": 4, "llama.feed_forward_length": 160,
          "llama.block_count": 2, "llama.vocab_size": 256, "llama.rope.scaling.type": "linear",
          "llama.rope.scaling.factor": factor}
  with pytest.raises(GGUFError, match="rope.scaling.factor"):
    registry.config_from_metadata(meta, "m.gguf", set())


def test_host_states_are_not_shared_between_backends_and_bytes_are_refused(tmp_path):
  """A decode state of one host backend names no cache of another (ids are process-unique);
  bytes are not token ids, in prompt_logits as in generate."""
  from pijax.errors import ConfigError
  path = tiny_models.write_random_quantized_gguf(tmp_path / "m.gguf", layer_type="Q8_0")
  a, b = (pijax.load(path, max_seq_len=32) for _ in range(2))
  for m in (a, b):
    m.configure_host_weights("gguf")
  state_a, state_b = a.new_cache(), b.new_cache()
  assert b.backend.host_cache(state_b) is not None
  with pytest.raises(ConfigError, match="released"):
    b.backend.host_cache(state_a)
  a.release_cache(state_a)
  b.release_cache(state_b)
  assert a.backend.live_states == b.backend.live_states == 0
  with pytest.raises(ConfigError, match="bytes"):
    a.prompt_logits(b"hello")


def test_the_engine_asks_the_backend_how_to_compile(tmp_path):
  """The engine never branches on which backend it holds: the attention window and the compiled
  step are the backend's answers (`attention_window`, `compile_step`), and a backend that
  overrides them is obeyed (same tokens as the default)."""
  path = tiny_models.write_random_quantized_gguf(tmp_path / "m.gguf", layer_type="Q8_0")
  model = pijax.load(path, max_seq_len=64)
  want = model.generate_ids([0, 5, 9], max_new_tokens=4)
  want = [s.token_id for s in want]
  asked = []

  class Recording(xla_backend.XlaBackend):
    def attention_window(self, needed, max_seq_len):
      asked.append(("window", needed))
      return max_seq_len  # One window for every length.

    def compile_step(self, kind, kv_len, args, shared):
      asked.append((kind, kv_len))
      return super().compile_step(kind, kv_len, args, shared)

  model.use_backend(Recording(model.config, model.params, model.dtype))
  got = [s.token_id for s in model.generate_ids([0, 5, 9], max_new_tokens=4)]
  assert got == want
  n = len([t for t in got if t >= 0])  # Sampled tokens: the prefill's, then one per decode.
  assert n > 1 and ("prefill", 64) in asked and ("decode", 64) in asked
  assert sum(1 for a in asked if a[0] == "decode") == 1  # Compiled once for every step.
  assert sum(1 for a in asked if a[0] == "window") == n  # The prefill chunk, each decode.
