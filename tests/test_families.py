"""Every supported family (qwen2, qwen3, gemma3, phi3, llama with LLaMA-3.1 RoPE factors,
Mistral-style sliding window) on both dense backends.

Oracles: the transformers model the tiny GGUF was written from (CPU, f32; the file follows
llama.cpp's converter conventions, see tiny_families.py); the host backend against the XLA
backend on the same Q8_0 blocks, and against its float64 NumPy reference.
"""

import dataclasses

import numpy as np
import pytest

import pijax
import tiny_families
from host_ops import decoder as decoder_lib
from pijax.arch import registry
from pijax.backends import host as host_backend
from pijax.backends import hybrid as hybrid_backend
from pijax.errors import GGUFError, UnsupportedError

IDS = [3, 17, 99, 4, 250, 11, 42, 7, 128, 64, 5, 200]
# The switch each family sets, and its value when turned off: turning it off must change the
# logits far beyond the tolerance (the test can see the feature).
SWITCH_OFF = {"qwen2": {"qkv_bias": False}, "qwen3": {"qk_norm": False},
              "gemma3": {"sliding_window": 0, "rope_local_theta": 0.0},
              "phi3": {"sliding_window": 0}, "llama3": {"rope_freq_factors": ()},
              "mistral_swa": {"sliding_window": 0},
              "qwen2_yarn": {"rope_freq_factors": (), "attn_scale": 0.0}}
ARCH = {"llama3": "llama", "mistral_swa": "llama", "qwen2_yarn": "qwen2"}


def _hf_logits(hf, ids):
  import torch
  with torch.no_grad():
    return hf(torch.tensor([ids])).logits[0].float().numpy()


def _greedy_hf(hf, prompt, n):
  ids = list(prompt)
  for _ in range(n):
    ids.append(int(_hf_logits(hf, ids)[-1].argmax()))
  return ids[len(prompt):]


@pytest.fixture(scope="module", params=tiny_families.FAMILIES)
def family(request, tmp_path_factory):
  """(name, transformers model, F32 GGUF path, Q8_0 GGUF path)."""
  name = request.param
  hf = tiny_families.make_hf(name)
  tmp = tmp_path_factory.mktemp(name)
  return (name, hf, tiny_families.write_gguf(hf, name, tmp / "f32.gguf"),
          tiny_families.write_gguf(hf, name, tmp / "q8.gguf", qtype="Q8_0"))


def test_xla_matches_transformers(family):
  """Prompt logits and a greedy continuation through the engine equal transformers'."""
  name, hf, path, _ = family
  model = pijax.load(path, max_seq_len=64)
  assert model.config.arch == ARCH.get(name, name)
  assert model.backend.name == "xla"
  ref = _hf_logits(hf, IDS)
  got = model.prompt_logits(IDS)
  tol = 1e-4 * np.abs(ref).max()
  assert np.abs(got - ref).max() <= tol
  assert model.generate(IDS[:5], max_new_tokens=8, temperature=0.0).token_ids == \
      _greedy_hf(hf, IDS[:5], 8)
  assert model.compile_count("decode") == 1
  # The family's switch matters on this input: without it the logits move far off.
  off = dataclasses.replace(model.config, **SWITCH_OFF[name])
  from pijax.nn import transformer as model_lib
  import jax.numpy as jnp
  cache = model_lib.init_cache(off, 1, 64)
  wrong, _ = model_lib.prefill(model.params, cache, jnp.asarray([IDS]), jnp.int32(len(IDS)),
                               config=off, kv_len=64, all_logits=True)
  assert np.abs(np.asarray(wrong)[0] - ref).max() > 100 * tol


def test_host_matches_xla_on_the_same_blocks(family):
  """On a Q8_0 file the host backend (blocks kept, one layer body for every pass) computes the
  XLA backend's function on the same dequantized values, prefill and decode; its float64
  reference agrees, with f32 products and with int8 ones (the reference quantizes each
  product's input as the kernels do); both stay close to transformers."""
  name, hf, _, path = family
  model = pijax.load(path, max_seq_len=64)
  xla_logits = model.prompt_logits(IDS)
  xla_tokens = model.generate(IDS[:5], max_new_tokens=8, temperature=0.0).token_ids
  model.use_backend(host_backend.build(model.config, model.path, "gguf", dot="f32"))
  dec = model.backend.decoder
  host_logits = model.prompt_logits(IDS)
  atol = 1e-4 * np.abs(xla_logits).max()
  np.testing.assert_allclose(host_logits, xla_logits, rtol=1e-4, atol=atol)
  assert model.generate(IDS[:5], max_new_tokens=8, temperature=0.0).token_ids == xla_tokens
  ref = decoder_lib.decoder_reference(dec, IDS)
  np.testing.assert_allclose(host_logits, ref, rtol=1e-4, atol=atol)
  dec.dot = "int8"
  if dec.dot == "int8":
    int8_logits = model.prompt_logits(IDS)
    ref8 = decoder_lib.decoder_reference(dec, IDS)
    err = np.abs(int8_logits - ref8) / np.abs(ref8).max()
    assert err.max() <= 2e-2 and err.mean() <= 1e-3, (err.max(), err.mean())
  hf_ref = _hf_logits(hf, IDS)
  assert np.abs(host_logits - hf_ref).max() <= 0.1 * np.abs(hf_ref).max()


def test_hybrid_refuses_families_it_does_not_run(family, tmp_path):
  """Sparse bundles run plain llama files only: the hybrid backend and `pijax.convert` (before
  profiling) refuse every other family and llama's RoPE-factor / sliding-window variants."""
  from pijax import convert
  _, _, path, _ = family
  model = pijax.load(path, max_seq_len=64)
  with pytest.raises(UnsupportedError, match="hybrid backend cannot run"):
    hybrid_backend.HybridBackend.supports(model.config)
  opts = convert.ConvertOptions(calibration="unused.txt", out=str(tmp_path / "b"), hot_ratio=0.5)
  with pytest.raises(UnsupportedError, match=f"architecture '{model.config.arch}'"):
    convert.convert(model, opts)
  assert not (tmp_path / "b").exists()


def _meta(arch, **extra):
  meta = {"general.architecture": arch, f"{arch}.embedding_length": 64,
          f"{arch}.attention.head_count": 4, f"{arch}.feed_forward_length": 160,
          f"{arch}.block_count": 2, f"{arch}.vocab_size": 256}
  meta.update({f"{arch}.{k}": v for k, v in extra.items()})
  return meta


class _Tensor:
  def __init__(self, data):
    self.data = np.asarray(data, np.float32)


@pytest.mark.parametrize("extra", [{"rope.freq_base": 1.0},
                                   {"rope.scaling.yarn_beta_fast": 1e308},
                                   {"rope.scaling.yarn_beta_slow": 1e308}])
def test_yarn_values_its_formula_cannot_take_are_one_error(extra):
  """Found by a tester: theta = 1 divided by log(1) = 0 and a beta of 1e308 took log(0): a
  ZeroDivisionError / ValueError traceback, now one GGUFError."""
  meta = _meta("llama", **{"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                           "rope.scaling.original_context_length": 64, **extra})
  with pytest.raises(GGUFError, match="YaRN RoPE scaling needs"):
    registry.config_from_metadata(meta, "m.gguf", {})


def test_config_parsing_refuses_what_it_cannot_run():
  """Unknown architectures, LongRoPE, bad rope_freqs and bad windows: one GGUFError each."""
  with pytest.raises(GGUFError, match="architecture 'falcon' is not supported"):
    registry.config_from_metadata(_meta("falcon"), "m.gguf", {})
  with pytest.raises(GGUFError, match="LongRoPE"):
    registry.config_from_metadata(_meta("phi3"), "m.gguf",
                                  {"rope_factors_long.weight": _Tensor([1.0])})
  for bad, message in (([1.0] * 3, "vector of 8"), ([[1.0] * 4] * 2, "vector of 8"),
                       ([1.0] * 7 + [0.0], "not positive and finite"),
                       ([1.0] * 7 + [np.nan], "not positive and finite")):
    with pytest.raises(GGUFError, match=f"rope_freqs.weight .*{message}"):
      registry.config_from_metadata(_meta("llama"), "m.gguf",
                                    {"rope_freqs.weight": _Tensor(bad)})
  # A window of 2**40 (or any >= the context) is the context: no int32 overflow downstream.
  huge = registry.config_from_metadata(
      _meta("phi3", **{"attention.sliding_window": 1 << 40, "context_length": 4096}), "m.gguf",
      {})
  assert huge.sliding_window == 4096
  with pytest.raises(GGUFError, match="sliding_window"):
    registry.config_from_metadata(_meta("llama", **{"attention.sliding_window": -1}), "m.gguf",
                                  {})
  with pytest.raises(GGUFError, match="value_length"):
    registry.config_from_metadata(_meta("qwen3", **{"attention.key_length": 16,
                                                    "attention.value_length": 32}), "m.gguf", {})
  gemma = registry.config_from_metadata(
      _meta("gemma3", **{"attention.sliding_window": 512, "block_count": 18}), "m.gguf", {})
  assert [i for i in range(18) if not gemma.is_local(i)] == [5, 11, 17]
  assert gemma.rope_params(0)[0] == 10000.0 and gemma.rope_params(5)[0] == 10000.0 * 0 + \
      gemma.rope_theta
  assert gemma.ffn_family == "geglu" and gemma.embedding_scale == 8.0
