"""The functional model against transformers (the oracle) on tiny random and real models."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pijax import config as config_lib
from pijax.arch.spec import ModelConfig
from pijax.nn import transformer as model_lib
from pijax.formats.loader import load_gguf

import tiny_models


def _hf_logits(hf, ids):
  import torch
  with torch.no_grad():
    return hf(torch.tensor([ids])).logits[0].float().numpy()


def _pijax_logits(cfg, params, ids, max_seq_len=64):
  cache = model_lib.init_cache(cfg, 1, max_seq_len)
  logits, _ = model_lib.prefill(params, cache, jnp.asarray([ids], jnp.int32), len(ids),
                                config=cfg, kv_len=max_seq_len, all_logits=True)
  return np.asarray(logits[0])


@pytest.mark.parametrize("family,hidden_act,tied", [
    ("swiglu", "silu", False),
    ("reglu", "relu", False),
    ("drelu", "relu", True),
])
def test_tiny_model_matches_transformers(tmp_path, family, hidden_act, tied):
  hf = tiny_models.make_hf_llama(hidden_act=hidden_act, tied=tied, seed=3)
  activation = {"swiglu": None, "reglu": "relu", "drelu": "drelu"}[family]
  if family == "drelu":
    tiny_models.use_drelu(hf)
  path = tiny_models.write_gguf(hf, tmp_path / "tiny.gguf", ffn_activation=activation)
  cfg, params, _ = load_gguf(path)
  assert cfg.ffn_family == family
  assert cfg.tied_output == tied
  assert (cfg.n_heads, cfg.n_kv_heads) == (4, 2)
  ids = list(np.random.default_rng(0).integers(0, cfg.vocab_size, 24))
  ours = _pijax_logits(cfg, params, ids)
  ref = _hf_logits(hf, ids)
  err = np.abs(ours - ref).max()
  assert err <= 1e-4 * np.abs(ref).max(), err
  assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_activation_from_config_when_file_is_silent(tmp_path):
  hf = tiny_models.make_hf_llama(hidden_act="relu", seed=5)
  path = tiny_models.write_gguf(hf, tmp_path / "relu_no_key.gguf")
  cfg, params, _ = load_gguf(path, ffn_activation="relu")
  assert cfg.ffn_family == config_lib.FFN_REGLU
  ids = [3, 17, 99, 4, 250, 11]
  np.testing.assert_allclose(_pijax_logits(cfg, params, ids), _hf_logits(hf, ids),
                             rtol=0, atol=1e-4 * np.abs(_hf_logits(hf, ids)).max())


def test_decode_steps_equal_prefill(tmp_path):
  """Incremental decoding through the KV cache equals one prefill over the whole sequence."""
  hf = tiny_models.make_hf_llama(seed=7)
  cfg, params, _ = load_gguf(tiny_models.write_gguf(hf, tmp_path / "t.gguf"))
  ids = list(np.random.default_rng(1).integers(0, cfg.vocab_size, 12))
  full = _pijax_logits(cfg, params, ids)
  cache = model_lib.init_cache(cfg, 1, 64)
  # Prefill 5 tokens right-padded to 8, then decode the rest one at a time.
  toks = np.zeros((1, 8), np.int32)
  toks[0, :5] = ids[:5]
  logits, cache = model_lib.prefill(params, cache, jnp.asarray(toks), 5, config=cfg, kv_len=64)
  np.testing.assert_allclose(np.asarray(logits[0]), full[4], atol=1e-4)
  step = jax.jit(model_lib.decode_step, static_argnames=("config", "kv_len"), donate_argnums=1)
  for i in range(5, len(ids)):
    logits, cache = step(params, cache, jnp.asarray([ids[i]], jnp.int32), i, config=cfg,
                         kv_len=32)
    np.testing.assert_allclose(np.asarray(logits[0]), full[i], atol=1e-4)


def test_rms_norm_fp16_does_not_overflow():
  """Case N1: 576 fp16 values of 300.0 (300^2 overflows fp16) normalise to the weight."""
  x = jnp.full((576,), 300.0, jnp.float16)
  weight = jnp.asarray(np.random.default_rng(0).uniform(0.5, 2.0, 576), jnp.float16)
  out = model_lib.rms_norm(x, weight, 1e-5)
  assert out.dtype == jnp.float16
  assert np.isfinite(np.asarray(out, np.float32)).all()
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(weight, np.float32),
                             rtol=1e-3)


def test_rope_styles_agree_under_permutation():
  """Adjacent-pair RoPE on interleaved dims equals half-split RoPE on the original dims."""
  cfg = ModelConfig(
      arch="llama", vocab_size=8, hidden_size=16, intermediate_size=8, n_layers=1, n_heads=2,
      n_kv_heads=2, head_dim=8, rope_theta=10000.0, rope_style=config_lib.ROPE_HALF,
      rope_dim=8, rms_norm_eps=1e-5, context_length=64, ffn_family="swiglu",
      tied_output=True)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 5, 2, 8)), jnp.float32)
  cos, sin = model_lib.rope_angles(jnp.arange(5)[None] + 3, cfg)
  half = model_lib.apply_rope(x, cos, sin, config_lib.ROPE_HALF)
  perm = np.stack([np.arange(4), np.arange(4) + 4], axis=1).reshape(-1)  # 0,4,1,5,...
  adjacent = model_lib.apply_rope(x[..., perm], cos, sin, config_lib.ROPE_ADJACENT)
  np.testing.assert_allclose(np.asarray(adjacent), np.asarray(half)[..., perm], atol=1e-6)


# ------------------------------------------------------------------ real model (SmolLM2 GGUF)
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    if n <= 1:\n        return n\n",
    "Water boils at 100 degrees Celsius. The chemical formula of water is",
]


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompt_logits_match_transformers(smollm2, hf_model, hf_tokenizer, prompt):
  ids = hf_tokenizer.encode(prompt)
  ref = _hf_logits(hf_model, ids)
  ours = smollm2.prompt_logits(ids)
  assert ours.shape == ref.shape
  assert (ours.argmax(-1) == ref.argmax(-1)).all()
  err = np.abs(ours - ref).max()
  assert err <= 1e-3 * np.abs(ref).max(), (err, np.abs(ref).max())


def _hf_greedy(hf, ids, n):
  """Oracle greedy tokens, and the first step whose top-2 logit margin is below 0.05."""
  import torch
  out = []
  ambiguous_at = n
  seq = list(ids)
  with torch.no_grad():
    for step in range(n):
      logits = hf(torch.tensor([seq])).logits[0, -1].float()
      top2 = torch.topk(logits, 2).values
      if ambiguous_at == n and float(top2[0] - top2[1]) < 0.05:
        ambiguous_at = step
      tok = int(torch.argmax(logits))
      out.append(tok)
      seq.append(tok)
  return out, ambiguous_at


@pytest.mark.slow
@pytest.mark.parametrize("prompt,chat", [
    ("The capital of France is", False),
    ("Once upon a time", False),
    ("def fibonacci(n):", False),
    ("What is the capital of France?", True),
])
def test_greedy_matches_transformers(smollm2, hf_model, hf_tokenizer, prompt, chat):
  """24 greedy tokens equal the oracle's.

  Compared up to the first step where the oracle's top-2 logit margin is < 0.05: past a
  near-tie, float rounding may legitimately pick the other token and the texts diverge.
  """
  if chat:
    ids = hf_tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                           add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
      ids = ids["input_ids"]
    assert smollm2.encode_prompt(prompt, chat=True) == list(ids)
  else:
    ids = hf_tokenizer.encode(prompt)
    assert smollm2.encode_prompt(prompt) == ids
  ref, ambiguous_at = _hf_greedy(hf_model, ids, 24)
  # Stop tokens end generation in pijax; the oracle keeps going, so compare up to the stop.
  result = smollm2.generate(list(ids), max_new_tokens=24, temperature=0.0)
  n = min(ambiguous_at, len(result.token_ids))
  assert n >= 8 or len(result.token_ids) < 8, (ambiguous_at, result.token_ids)
  assert result.token_ids[:n] == ref[:n]
  if result.stop_reason == "eos":
    assert ref[len(result.token_ids) - 1] == result.token_ids[-1]
