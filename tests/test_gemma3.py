"""Gemma 3 270M Q4_K_M (the second real model) on both dense backends against transformers.

Oracle: transformers' Gemma3ForCausalLM loading the same GGUF (CPU, f32; its loader dequantizes
the file's Q5_0/Q4_K/Q6_K/Q8_0 blocks with gguf.quants). Greedy continuations are compared up to
the oracle's first near-tie (a top-2 logit margin a backend's rounding may flip).
"""

import numpy as np
import pytest

import pijax

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
N_NEW = 24


@pytest.fixture(scope="module")
def oracle(gemma3_path):
  """prompt -> (prompt ids, greedy ids, f32[len, V] teacher-forced logits of prompt + greedy)."""
  import os
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer
  folder, name = os.path.split(gemma3_path)
  tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
  hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
  out = {}
  with torch.no_grad():
    for prompt in PROMPTS:
      ids = tok(prompt, return_tensors="pt").input_ids
      gen = hf.generate(ids, max_new_tokens=N_NEW, do_sample=False)[0]
      logits = hf(gen[None]).logits[0].float().numpy()
      out[prompt] = (ids[0].tolist(), gen[ids.shape[1]:].tolist(), logits)
  return out


def _agree_until_near_tie(got, want, logits, n_prompt, margin):
  """got == want up to (not including) the first greedy step whose top-2 margin < margin."""
  for step, token in enumerate(want):
    top2 = np.sort(logits[n_prompt - 1 + step])[-2:]
    if top2[1] - top2[0] < margin:
      break
    assert got[step] == token, (step, got, want)
  else:
    step = len(want)
  return step


@pytest.mark.parametrize("weights,dot", [("off", None), ("gguf", "f32")])
def test_greedy_matches_transformers(gemma3_path, oracle, weights, dot):
  """Prompt ids equal transformers', prompt logits close to its, and greedy 24 tokens equal up
  to the first near-tie (margin 0.05), on the XLA backend (f32) and the host backend (the
  file's own Q5_0/Q4_K/Q6_K/Q8_0 blocks, f32 activations)."""
  model = pijax.load(gemma3_path, max_seq_len=128)
  assert model.config.arch == "gemma3" and model.config.ffn_family == "geglu"
  kwargs = {} if dot is None else {"dot": dot}
  assert model.configure_host_weights(weights, **kwargs) == weights
  checked = 0
  for prompt, (ids, want, logits) in oracle.items():
    assert model.tokenizer.encode(prompt) == ids
    got_logits = model.prompt_logits(ids)
    ref = logits[:len(ids)]
    assert np.abs(got_logits - ref).max() <= 2e-3 * np.abs(ref).max(), prompt
    got = model.generate(ids, max_new_tokens=N_NEW, temperature=0.0).token_ids
    checked += _agree_until_near_tie(got, want, logits, len(ids), 0.05)
  assert checked >= 40  # Most of the 72 greedy steps are compared.


def test_int8_decode_follows_transformers(gemma3_path, oracle):
  """The default host run (decode products on 8-bit activations): every decode step of the
  oracle's sequences, teacher-forced, picks the oracle's token wherever its top-2 margin is at
  least 0.5 logit, and its logits stay within 5% of the oracle's range."""
  model = pijax.load(gemma3_path, max_seq_len=128)
  assert model.configure_host_weights("gguf", dot="int8") == "gguf"
  dec = model.backend.decoder
  assert dec.dot == "int8" or not dec.dot  # "f32" only where the CPU lacks AVX2.
  agree = total = 0
  for ids, want, logits in oracle.values():
    seq = ids + want
    cache = dec.new_cache(1, len(seq))
    dec.forward(cache, np.asarray([ids[:-1]]), 0)
    for pos in range(len(ids) - 1, len(seq) - 1):
      got = dec.forward(cache, np.asarray([[seq[pos]]]), pos)[0]
      ref = logits[pos]
      assert np.abs(got - ref).max() <= 0.05 * (ref.max() - ref.min()), pos
      top2 = np.sort(ref)[-2:]
      if top2[1] - top2[0] >= 0.5:
        total += 1
        agree += int(got.argmax() == ref.argmax())
  assert total >= 30 and agree >= 0.95 * total, (agree, total)
