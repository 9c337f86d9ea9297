"""The engine on the real default model: compile counts, context limits, streaming, seeds."""

import numpy as np
import pytest

from pijax.engine import Model
from pijax.errors import ConfigError, ContextError

pytestmark = pytest.mark.slow


def _with_context(model, max_seq_len):
  """The same weights with another KV cache length (no reload)."""
  return Model(model.config, model.params, model.tokenizer, model.metadata,
               max_seq_len=max_seq_len, dtype="float32", path=model.path)


def test_decoding_64_tokens_compiles_once(smollm2):
  model = _with_context(smollm2, 2048)
  result = model.generate("Once upon a time", max_new_tokens=64, temperature=0.0)
  assert len(result.token_ids) == 64 or result.stop_reason == "eos"
  assert result.stats.decode_steps == len(result.token_ids) - 1
  assert model.compile_count("decode") == 1
  assert model.compile_count("prefill") == 1
  model.generate("A different prompt of other length", max_new_tokens=16, temperature=0.7,
                 top_k=40, seed=3)
  assert model.compile_count("decode") == 1  # Sampling values are traced, not static.


def test_prompt_longer_than_context_is_refused(smollm2):
  """Case C1: max_seq_len 64, a 100-token prompt: an error naming both numbers."""
  model = _with_context(smollm2, 64)
  ids = list(range(1000, 1100))
  with pytest.raises(ContextError) as err:
    model.generate(ids, max_new_tokens=4)
  assert "100" in str(err.value) and "64" in str(err.value)


def test_generation_stops_at_context(smollm2):
  """Case C2: prompt + max_new_tokens beyond the context stops there with reason 'length'."""
  model = _with_context(smollm2, 64)
  ids = smollm2.tokenizer.encode("The history of the Roman Empire begins with")
  result = model.generate(ids, max_new_tokens=500, temperature=0.0, repeat_penalty=1.3)
  assert result.stop_reason in ("length", "eos")
  assert len(ids) + len(result.token_ids) <= 64 + 1
  if result.stop_reason == "length":
    assert len(ids) + len(result.token_ids) == 64 + 1  # The last token is sampled, not stored.


def test_empty_prompt_is_a_clear_error(smollm2):
  """Case C3."""
  with pytest.raises(ContextError, match="empty"):
    smollm2.generate("", max_new_tokens=4)


def test_stream_pieces_join_to_text(smollm2):
  stream = smollm2.stream("Write a haiku about llamas 🦙 and emoji:", max_new_tokens=40,
                          temperature=0.9, seed=1)
  pieces = list(stream)
  result = stream.result
  assert "".join(pieces) == result.text
  body = [t for t in result.token_ids if t not in smollm2.tokenizer.stop_ids]
  assert result.text == smollm2.tokenizer.decode(body)
  assert all("\ufffd" not in p for p in pieces[:-1])


def test_seeds(smollm2):
  """Cases S2/S5 end to end: same seed same text, top_k 0 really samples."""
  kw = dict(max_new_tokens=12, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
  a = smollm2.generate("My favourite animal is", seed=11, **kw)
  b = smollm2.generate("My favourite animal is", seed=11, **kw)
  assert a.token_ids == b.token_ids
  outs = {tuple(smollm2.generate("My favourite animal is", seed=s, **kw).token_ids)
          for s in range(5)}
  assert len(outs) > 1


def test_chat_stops_at_end_of_turn(smollm2):
  result = smollm2.generate("What is the capital of France?", chat=True, max_new_tokens=64)
  assert result.stop_reason == "eos"
  assert result.token_ids[-1] in smollm2.tokenizer.stop_ids
  assert "Paris" in result.text
  assert "<|im_end|>" not in result.text


def test_bad_sampling_values(smollm2):
  for kwargs in ({"temperature": -1.0}, {"repeat_penalty": 0.0}, {"top_p": 2.0}):
    with pytest.raises(ConfigError):
      smollm2.generate("hi", max_new_tokens=2, **kwargs)
  with pytest.raises(ConfigError):
    smollm2.generate("hi", max_new_tokens=-1)


def test_prefill_chunks_match_single_pass(smollm2):
  """A prompt longer than one prefill chunk gives the same logits as one pass would."""
  import pijax.engine as engine
  ids = smollm2.tokenizer.encode(" ".join(["The quick brown fox jumps over the lazy dog."] * 60))
  assert len(ids) > engine.PREFILL_CHUNK
  chunked = smollm2.prompt_logits(ids[:600])
  old = engine.PREFILL_CHUNK
  engine.PREFILL_CHUNK = 1024
  try:
    single = _with_context(smollm2, 2048).prompt_logits(ids[:600])
  finally:
    engine.PREFILL_CHUNK = old
  np.testing.assert_allclose(chunked, single, atol=2e-3 * np.abs(single).max())
