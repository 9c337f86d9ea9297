"""Batched decode (`pijax.batching`): each sequence's tokens equal its run alone."""

import subprocess
import sys

import numpy as np
import pytest

import pijax
from pijax import batching
from pijax.errors import ConfigError, ContextError

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village by the sea, there lived an old fisherman who",
           "1, 2, 3,"]


@pytest.fixture(scope="module")
def model(smollm2_path):
  model = pijax.load(smollm2_path, max_seq_len=256)
  assert model.configure_host_weights("auto") == "gguf"
  return model


@pytest.mark.parametrize("dot", ["int8", "f32"])
def test_generate_batch_equals_separate_runs(model, dot):
  """Greedy, mixed prompt lengths (5-18 tokens), different max_new_tokens so sequences finish
  early, two slots for four prompts (the later ones join as slots free up): every reply's
  tokens and text equal `generate` of that prompt alone, int8 and f32 products."""
  dec = model.backend.decoder
  dec.dot = dot
  try:
    lengths = [12, 5, 20, 9]
    got = []
    for p, n in zip(PROMPTS, lengths):  # One generation per prompt, with its own length.
      got.append(model.generate_batch([p], max_new_tokens=n)[0])
    both = model.generate_batch(PROMPTS, max_new_tokens=20, max_batch=2)
    for p, n, alone_b, batched in zip(PROMPTS, lengths, got, both):
      solo = model.generate(p, max_new_tokens=n)
      assert alone_b.token_ids == solo.token_ids and alone_b.text == solo.text
      solo20 = model.generate(p, max_new_tokens=20)
      assert batched.token_ids == solo20.token_ids, p
      assert batched.text == solo20.text and batched.stop_reason == solo20.stop_reason
      assert batched.stats.prompt_tokens == len(model.encode_prompt(p))
  finally:
    dec.dot = "int8"


def test_generator_sampled_rows_and_early_stops(model):
  """Sampled rows (temperature, top_p, repeat_penalty; one seed each) beside greedy ones in one
  generator: each equals its solo run with that seed. An end-of-turn token ends a chat reply
  early (stop_reason eos) while the others go on; its slot serves a later prompt."""
  gen = batching.BatchGenerator(model, 3)
  kw = [dict(temperature=0.8, top_p=0.9, seed=1, repeat_penalty=1.1), dict(seed=0),
        dict(temperature=1.2, top_k=40, seed=7)]
  ids = [model.encode_prompt(p) for p in PROMPTS[:3]]
  chat = model.encode_prompt("Say hi.", chat=True)
  owner, done = {}, {}  # slot -> prompt index; prompt index -> its events
  for i, (p, k) in enumerate(zip(ids, kw)):
    slot, _, events = gen.add(p, max_new_tokens=24 if i != 1 else 6, **k)
    owner[slot], done[i] = i, list(events)
  with pytest.raises(ConfigError, match="slots"):
    gen.add(ids[0])
  chat_slot = None
  while gen.live:
    for slot, events in gen.step().items():
      done[owner[slot]].extend(events)
      if events[-1].stop_reason is not None and chat_slot is None:
        chat_slot, _, events = gen.add(chat, max_new_tokens=48)  # The freed slot, reused.
        assert chat_slot == slot
        owner[chat_slot], done[3] = 3, list(events)
  for i in range(3):
    solo = list(model.generate_ids(ids[i], max_new_tokens=24 if i != 1 else 6, **kw[i]))
    assert [e.token_id for e in done[i]] == [e.token_id for e in solo]
    assert done[i][-1].stop_reason == solo[-1].stop_reason
  solo = list(model.generate_ids(chat, max_new_tokens=48))
  assert [e.token_id for e in done[3]] == [e.token_id for e in solo]
  assert done[3][-1].stop_reason == "eos"  # The chat reply ends with its end-of-turn token.
  assert chat_slot in range(3) and gen.free_slots == 3


def _wikitext_ids(model, start: int, n: int) -> list[int]:
  import os
  path = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "wikitext-2-raw",
                      "wiki.test.raw")
  with open(path, encoding="utf-8") as f:
    text = f.read()[start:start + 8 * n]
  ids = model.tokenizer.encode(text)[:n]
  assert len(ids) == n
  return ids


@pytest.mark.parametrize("dot", ["int8", "f32"])
def test_chunked_prefill_beside_decoding_rows(model, dot):
  """Two sequences decode (greedy and seeded sampling) while two long prompts (170 and 90
  tokens) join with prefill=False and are fed 37 prompt tokens a step in the same passes, the
  older first: the newcomers' steps are [] until the pass that finishes their prompt, and every
  sequence's tokens equal its solo run."""
  dec = model.backend.decoder
  dec.dot = dot
  try:
    gen = batching.BatchGenerator(model, 4)
    short = [model.encode_prompt(p) for p in PROMPTS[:2]]
    kw = [dict(max_new_tokens=30), dict(max_new_tokens=30, temperature=0.9, top_p=0.95, seed=3)]
    longs = [_wikitext_ids(model, 3000, 170), _wikitext_ids(model, 9000, 90)]
    got, owner = {}, {}
    for i, (ids, k) in enumerate(zip(short, kw)):
      slot, _, events = gen.add(ids, **k)
      owner[slot], got[i] = i, [e.token_id for e in events]
    for slot, events in gen.step().items():  # Both decode before the newcomers come.
      got[owner[slot]].extend(e.token_id for e in events)
    for j, ids in enumerate(longs):
      slot, stats, events = gen.add(ids, max_new_tokens=12, prefill=False)
      assert events == [] and slot in gen.live
      owner[slot], got[2 + j] = 2 + j, []
    firsts = {}  # prompt index -> the step at which its first token came
    step = 0
    while gen.live:
      step += 1
      for slot, events in gen.step(prefill_tokens=37).items():
        i = owner[slot]
        if i >= 2 and not got[i] and events:
          firsts[i] = step
        got[i].extend(e.token_id for e in events)
    # 170 tokens at 37 a step take 5 steps; the 90 behind it start in step 5 and end in step 8.
    assert firsts == {2: 5, 3: 8}
    for i, (ids, k) in enumerate(zip(short + longs, kw + [dict(max_new_tokens=12)] * 2)):
      assert got[i] == [e.token_id for e in model.generate_ids(ids, **k)], i
  finally:
    dec.dot = "int8"


def test_cancel_while_prefilling_keeps_the_fed_prefix(model):
  """A sequence cancelled after two 40-token chunks of its 150-token prompt frees its slot,
  which keeps exactly those 80 tokens: the same prompt added again reuses 80 and its tokens
  equal its solo run; an empty step (nothing live) returns {}."""
  gen = batching.BatchGenerator(model, 1, prefill_tokens=40)
  ids = _wikitext_ids(model, 15000, 150)
  gen.add(model.encode_prompt(PROMPTS[0]), max_new_tokens=3)  # Something decoding beside it.
  while gen.live:
    gen.step()
  slot, _, _ = gen.add(ids, max_new_tokens=10, prefill=False)
  gen.step(prefill_tokens=40)
  gen.step(prefill_tokens=40)
  gen.cancel(slot)
  assert gen.step() == {} and gen.free_slots == 1
  slot, _, events = gen.add(ids, max_new_tokens=10)
  assert gen.last_reused == 80
  tokens = [e.token_id for e in events]
  while gen.live:
    tokens += [e.token_id for e in gen.step()[slot]]
  assert tokens == [e.token_id for e in model.generate_ids(ids, max_new_tokens=10)]
  with pytest.raises(ConfigError, match="prefill_tokens"):
    batching.BatchGenerator(model, 1, prefill_tokens=0)


def test_batch_errors(model, tmp_path):
  gen = batching.BatchGenerator(model, 1)
  with pytest.raises(ConfigError, match="max_batch"):
    batching.BatchGenerator(model, 0)
  with pytest.raises(ConfigError, match="temperature"):
    gen.add([1, 2], temperature=-1)
  with pytest.raises(ContextError):
    gen.add([1] * 300)
  assert gen.free_slots == 1  # Refused input takes no slot.
  slot, _, _ = gen.add([1, 2, 3], max_new_tokens=50)
  gen.cancel(slot)
  assert gen.live == [] and gen.free_slots == 1 and gen.step() == {}
  with pytest.raises(ConfigError, match="seed"):
    model.generate_batch(PROMPTS[:2], seed=[1, 2, 3])
  assert model.generate_batch([]) == []
  # Refused before anything is decoded: a bare string (not split into characters), bad seeds
  # (as generate refuses them), max_batch 0, log-probabilities it would drop.
  for kwargs in (dict(prompts="hello"), dict(prompts=None), dict(seed=None), dict(seed=1.5),
                 dict(seed=2 ** 64), dict(seed=[1, "x"]), dict(max_batch=0),
                 dict(logprobs=True)):
    args = {"prompts": PROMPTS[:2], **kwargs}
    with pytest.raises(ConfigError):
      model.generate_batch(args.pop("prompts"), max_new_tokens=2, **args)
  with pytest.raises(ConfigError, match="token ids"):
    gen.add("hello")
  with pytest.raises(ConfigError, match="seed"):
    gen.add([1, 2], seed=2 ** 64)


def test_batch_needs_host_weights_and_notices_reconfiguration(smollm2_path):
  """A model on XLA is refused (its weights are never switched behind the caller's back); a
  generator whose model is reconfigured raises instead of decoding on the old weights."""
  m = pijax.load(smollm2_path, max_seq_len=64)
  assert m.backend.name == "xla"
  with pytest.raises(ConfigError, match="configure_host_weights"):
    m.generate_batch(["hi"], max_new_tokens=2)
  assert m.backend.name == "xla"
  m.configure_host_weights("auto")
  gen = batching.BatchGenerator(m, 2)
  gen.add(m.encode_prompt("Hello"), max_new_tokens=8)
  m.configure_host_weights("off")
  with pytest.raises(ContextError, match="reconfigured"):
    gen.step()
  with pytest.raises(ContextError, match="reconfigured"):
    gen.add([1, 2])


def test_bench_parallel_rows(smollm2_path):
  """`pijax.bench --parallel`: one JSON row per batch size with n_parallel; a bad list is one
  line and exit 2."""
  import json
  cmd = [sys.executable, "-m", "pijax.bench", "-m", smollm2_path, "-p", "8", "-n", "4", "-r",
         "1", "-o", "json", "--parallel", "1,2"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = json.loads(proc.stdout)
  assert [r["n_parallel"] for r in rows] == [1, 2]
  assert all(r["t_s_mean"] > 0 and r["test"] == "pp8+tg4" for r in rows)
  assert rows[0]["vs_parallel_1"] == 1.0
  bad = subprocess.run(cmd[:-1] + ["1,x"], capture_output=True, text=True, timeout=300)
  assert bad.returncode == 2 and "--parallel" in bad.stderr
  assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
