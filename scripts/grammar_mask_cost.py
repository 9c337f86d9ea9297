"""Per-token cost of a grammar engine's token mask on the default model's vocabulary.

`python scripts/grammar_mask_cost.py [--reps=5]` walks fixed JSON replies token by token (the
default model's tokenizer, 49,152 tokens) under llguidance (pijax's engine, `pijax.grammar`) and,
when it is importable, xgrammar, and prints per grammar: the compile time, and per token the
mask's microseconds (median, mean, p95) and the advance (consume) step; for llguidance also the
bias row pijax builds from the mask (f32[vocab]: -inf / logit_bias). No model weights are read.

`--decode_tokens=N` then also loads the default model (host weights, as `pijax.serve` runs it)
and times whole decode steps, N tokens a reply, alternating rounds of: no constraint, a
logit_bias, json_object and the json_schema below; it prints the median milliseconds per token
after the first (mask, bias row, its transfer and the biased sampling step included) per mode.
Numbers go to BUILD_NOTES.md (issue 31).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {
            "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "email", "tags", "role", "address"],
    "additionalProperties": False,
}
REPLY = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com",
         "tags": ["math", "engines", "poetry"], "role": "admin",
         "address": {"city": "London", "zip": "12345"}}
FREE = {"title": "A walk", "steps": [1, 2, 3], "done": False, "notes": None,
        "nested": {"a": [{"b": "c"}, {"d": 1.5e3}], "text": "Hello, world! \u00e9"}}


def _stats(us: list[float]) -> str:
  a = np.asarray(us)
  return (f"median {np.median(a):7.1f}  mean {a.mean():7.1f}  p95 {np.percentile(a, 95):7.1f}"
          f"  max {a.max():8.1f} us")


def run_llguidance(tokenizer, vocab: int, cases, reps: int) -> None:
  from pijax import grammar as grammar_lib
  import llguidance.numpy as llnp
  t0 = time.perf_counter()
  grammar_lib.llg_tokenizer(tokenizer, vocab)
  print(f"llguidance: tokenizer {1e3 * (time.perf_counter() - t0):.0f} ms")
  for label, schema, reply in cases:
    t0 = time.perf_counter()
    g = grammar_lib.json_schema_grammar(tokenizer, schema, vocab_size=vocab)
    compile_ms = 1e3 * (time.perf_counter() - t0)
    ids = tokenizer.encode(json.dumps(reply, ensure_ascii=False), add_special=False)
    mask, bias, advance = [], [], []
    for _ in range(reps):
      c = grammar_lib.Constraint(vocab, g, {ids[0]: 1.0})
      bits = np.empty((1, (vocab + 31) // 32), np.int32)
      row = np.empty(vocab, np.float32)
      for t in ids + [None]:
        s = time.perf_counter_ns()
        llnp.fill_next_token_bitmask(c.matcher, bits)
        mask.append((time.perf_counter_ns() - s) / 1e3)
        s = time.perf_counter_ns()
        grammar_lib._expand(bits[0], c._added, row)
        bias.append((time.perf_counter_ns() - s) / 1e3)
        if t is None:
          assert c.done and np.isfinite(row).sum() == len(tokenizer.stop_ids), "EOS only"
          break
        assert np.isfinite(row[t]), (label, t)
        s = time.perf_counter_ns()
        c.advance(t)
        advance.append((time.perf_counter_ns() - s) / 1e3)
    print(f"  {label}: {len(ids)} tokens, compile {compile_ms:.1f} ms")
    print(f"    mask    {_stats(mask)}")
    print(f"    bias    {_stats(bias)}")
    print(f"    advance {_stats(advance)}")


def run_xgrammar(tokenizer, vocab: int, cases, reps: int) -> None:
  try:
    import xgrammar as xgr
  except ImportError:
    print("xgrammar: not installed (pip install xgrammar to compare)")
    return
  special = tokenizer.special_ids
  t0 = time.perf_counter()
  vocab_bytes = [b"" if i in special else tokenizer.token_bytes(i)
                 for i in range(tokenizer.vocab_size)]
  info = xgr.TokenizerInfo(vocab_bytes, xgr.VocabType.RAW, vocab_size=vocab,
                           stop_token_ids=sorted(tokenizer.stop_ids))
  compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
  print(f"xgrammar: tokenizer {1e3 * (time.perf_counter() - t0):.0f} ms")
  for label, schema, reply in cases:
    t0 = time.perf_counter()
    g = compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)
    compile_ms = 1e3 * (time.perf_counter() - t0)
    ids = tokenizer.encode(json.dumps(reply, ensure_ascii=False), add_special=False)
    mask, advance = [], []
    bits = np.full((1, (vocab + 31) // 32), -1, np.int32)
    for _ in range(reps):
      m = xgr.GrammarMatcher(g)
      for t in ids + [None]:
        s = time.perf_counter_ns()
        m.fill_next_token_bitmask(bits)
        mask.append((time.perf_counter_ns() - s) / 1e3)
        if t is None:
          break
        s = time.perf_counter_ns()
        assert m.accept_token(t), (label, t)
        advance.append((time.perf_counter_ns() - s) / 1e3)
    print(f"  {label}: {len(ids)} tokens, compile {compile_ms:.1f} ms")
    print(f"    mask    {_stats(mask)}")
    print(f"    advance {_stats(advance)}")


def run_decode(tokens: int, rounds: int) -> None:
  import pijax
  model = pijax.load("default", max_seq_len=1024)
  model.configure_host_weights("auto")
  prompt = model.encode_prompt([{"role": "user", "content": "Describe a user account as a JSON "
                                 "object with a name, an age, an email and tags."}], chat=True)
  modes = {"none": {}, "logit_bias": {"logit_bias": {42: 5.0}},
           "json_object": {"response_format": {"type": "json_object"}},
           "json_schema": {"response_format": {"type": "json_schema",
                                               "json_schema": {"name": "u", "schema": SCHEMA}}}}
  per_token = {name: [] for name in modes}
  for kwargs in modes.values():  # Compile every program before timing.
    for _ in model.generate_ids(prompt, max_new_tokens=2, **kwargs):
      pass
  for _ in range(rounds):
    for name, kwargs in modes.items():
      times = []
      for step in model.generate_ids(prompt, max_new_tokens=tokens, temperature=0.9, seed=1,
                                     **kwargs):
        times.append(time.perf_counter())
      if len(times) > 3:  # The last step only reports the stop; the first follows the prefill.
        per_token[name].append(1e3 * (times[-2] - times[0]) / (len(times) - 2))
  print(f"decode ({model.weights_label}, {tokens} tokens a reply at most, {rounds} rounds):")
  for name, ms in per_token.items():
    print(f"  {name:12s} median {np.median(ms):6.2f} ms/token  (rounds: "
          f"{', '.join(f'{m:.2f}' for m in ms)})")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--reps", type=int, default=5, help="walks of each reply")
  parser.add_argument("--decode_tokens", type=int, default=0,
                      help="also time decode steps on the default model, N tokens a reply")
  parser.add_argument("--rounds", type=int, default=3, help="alternated rounds of --decode")
  args = parser.parse_args()
  from pijax.formats.gguf import default_model_path, read_metadata
  from pijax.text.tokenizer import Tokenizer
  tokenizer = Tokenizer.from_metadata(read_metadata(default_model_path()))
  vocab = tokenizer.vocab_size
  print(f"vocabulary: {vocab} tokens")
  cases = [("json_object", {"type": "object"}, FREE), ("json_schema", SCHEMA, REPLY)]
  run_llguidance(tokenizer, vocab, cases, args.reps)
  run_xgrammar(tokenizer, vocab, cases, args.reps)
  if args.decode_tokens > 0:
    run_decode(args.decode_tokens, args.rounds)


if __name__ == "__main__":
  main()
