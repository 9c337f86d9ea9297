"""Batched decode on the host weights: B independent sequences, one host pass per step.

A CPU decode step is bound by reading the weights (BUILD_NOTES.md, issue 30), so B sequences
decoded in one pass cost little more than one: `HostDecoder.forward_rows` runs one token of
each live sequence, each at its own position in its own slot of one KV cache, and reads every
weight once for all of them (llama.cpp's `llama-batched-bench`, vLLM's continuous batching).

`BatchGenerator` is the slot scheduler a server drives (continuous batching): a sequence joins
with `add` (its prompt prefilled alone in a free slot, its first token sampled), every `step`
decodes one token of each live sequence, a sequence leaves when it stops (its slot is free for
the next `add`) or when `cancel`led. `generate_batch` runs a fixed list of prompts to the end.
With `add(..., prefill=False)` the prompt is instead fed by the following steps, at most
`prefill_tokens` prompt tokens per step in the same pass as the running sequences' decode rows
(chunked prefill, as vLLM and llama-server mix prompt and decode tokens): a long prompt then
delays each running stream's next token by one chunk's time, not by its whole prefill.

Each sequence samples with its own key, parameters and recent tokens, as `Model.generate_ids`
does for it alone; with int8 products every kernel's output depends only on its own row, so
its tokens are those of its unbatched run (greedy: always; sampled: with the same seed).
A sequence may also carry `logit_bias` / `response_format` (its own `pijax.grammar.Constraint`,
whose bias row is added to its logits before sampling, as the engine does) and ask for
log-probabilities. A free slot keeps the keys and values of its last sequence: `add` picks the
free slot whose cached tokens share the longest prefix with the prompt (the previous turn of a
conversation) and prefills only the rest (`Session`'s prefix reuse; llama-server's slots).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Sequence

import jax
import numpy as np

from pijax import sampling as sampling_lib
from pijax.errors import ConfigError, ContextError
from pijax.sampler import check_int, prng_seed
from pijax.generation import (STOP_EOS, STOP_LENGTH, STOP_STRING, GenerationResult,
                              GenerationStats, TextOut, TokenStep)


def _sample_row(logits, key, params, recent, bias=None):
  """One row as the engine's `_sample` draws it alone: (token i32[], next key); bias: None or
  f32[V] added after the penalties (`sampling.sample`)."""
  key, sub = jax.random.split(key)
  bias = None if bias is None else bias[None]
  return sampling_lib.sample(logits[None], sub, params, recent[None], bias)[0], key


def log_softmax(logits: np.ndarray) -> np.ndarray:
  """f32[V] log-probabilities of one row of raw logits f32[V] (what `TokenStep.logprobs` holds)."""
  x = np.asarray(logits, np.float32)
  m = x.max()
  return x - (m + np.log(np.exp(x - m).sum(dtype=np.float32)))


# One row with its own logits f32[V], key, SamplingParams (scalars) and recent i32[W]; called per
# row: under vmap lax.cond would run the sorting branch for greedy rows too (105 ms for 8 rows
# of SmolLM2's 49152 logits against 0.1 ms of argmax).
_sample_one = jax.jit(_sample_row)


@dataclasses.dataclass
class _Sequence:
  key: Any  # Its PRNG key (advanced once per sampled token, as in `Model.generate_ids`).
  params: sampling_lib.SamplingParams
  recent: collections.deque  # The last repeat_last_n tokens (prompt included).
  max_new_tokens: int
  stats: GenerationStats
  ignore_eos: bool = False
  greedy: bool = False  # Temperature 0 and no penalties: the argmax of the raw logits.
  pos: int = 0  # Where its next input token goes.
  token: int = -1  # Its next input token (the last sampled one).
  produced: int = 0
  constraint: Any = None  # Its `pijax.grammar.Constraint` (logit_bias, response_format) or None.
  logprobs: bool = False  # Each TokenStep carries f32[V] log-probabilities of the raw logits.
  fed: list = dataclasses.field(default_factory=list)  # Tokens whose keys/values its slot holds.
  prompt: list | None = None  # Its whole prompt while part of it is still to be prefilled.


class BatchGenerator:
  """Up to `max_batch` sequences decoded together on a model's host weights.

  Args:
    model: a `pijax.Model` on host weights (`Model.host_weights` "gguf" or "q8_0":
      `configure_host_weights("auto")`, what the CLIs do by default).
    max_batch: slots of the shared KV cache (host RAM: max_batch x `Model.max_seq_len` tokens).
    prefill_tokens: prompt tokens of sequences added with `prefill=False` fed per `step` while
      other sequences decode (tokens; the bound on how long a newcomer delays them); with no
      sequence decoding a step feeds up to `engine.PREFILL_CHUNK` of them.

  Raises:
    ConfigError: a model not on host weights, max_batch < 1, prefill_tokens < 1.
  """

  def __init__(self, model, max_batch: int, prefill_tokens: int = 128):
    if model.backend.name != "host":  # Never switched here: that would change its weights.
      raise ConfigError("batched decode runs on host weights (a quantized GGUF on a CPU "
                        f"backend); this model runs on {model.backend.name!r}: call "
                        "model.configure_host_weights('auto') first.")
    if isinstance(max_batch, bool) or not isinstance(max_batch, (int, np.integer)) or \
        max_batch < 1:
      raise ConfigError(f"max_batch={max_batch!r} must be an integer >= 1.")
    self.prefill_tokens = check_int("prefill_tokens", prefill_tokens, 1)
    from pijax import engine  # The engine's chunk: bounds a pass's scratch (rows x F).
    self.prefill_chunk = engine.PREFILL_CHUNK  # Prompt tokens per pass when none decodes.
    self.model = model
    self.backend = model.backend
    self.decoder = model.backend.decoder
    self.max_batch = int(max_batch)
    self.cache = self.decoder.new_cache(self.max_batch, model.max_seq_len)
    self._free = list(range(self.max_batch))
    self._live: dict[int, _Sequence] = {}
    # Per slot: the tokens whose keys/values it holds (kept while free, for prefix reuse), and
    # when it was last freed (a prompt that reuses nothing takes the least recently used slot).
    self._cached: list[list[int]] = [[] for _ in range(self.max_batch)]
    self._freed_at = [0] * self.max_batch
    self._clock = 0
    self.last_reused = 0  # Prompt tokens the latest `add` took from its slot's cache.

  @property
  def live(self) -> list[int]:
    """Slots of the sequences still decoding."""
    return sorted(self._live)

  @property
  def n_live(self) -> int:
    """How many sequences hold a slot (safe to read from another thread)."""
    return len(self._live)

  @property
  def free_slots(self) -> int:
    return len(self._free)

  def add(self, ids: Sequence[int], *, max_new_tokens: int = 128, temperature: float = 0.0,
          top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, repeat_penalty: float = 1.0,
          presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
          repeat_last_n: int = 64, seed: int = 0, ignore_eos: bool = False,
          logprobs: bool = False, logit_bias: dict[int, float] | None = None,
          response_format: Any = None,
          prefill: bool = True) -> tuple[int, GenerationStats, list[TokenStep]]:
    """Prefills a prompt alone in a free slot and samples its first token (or, with
    `prefill=False`, claims the slot and leaves the prompt to the next steps).

    The slot is the free one whose cached tokens share the longest prefix with `ids` (only the
    rest is prefilled; `last_reused` says how many were reused), else the least recently used.

    Args:
      ids: the prompt's token ids (`Model.encode_prompt`), 1..max_seq_len of them.
      max_new_tokens, temperature, ..., seed: as for `Model.generate_ids`.
      ignore_eos: end-of-sequence tokens do not end it (benchmarks: fixed lengths).
      logprobs, logit_bias, response_format: as for `Model.generate_ids` (each TokenStep then
        carries f32[vocab] log-probabilities; the bias / grammar is this sequence's own).
      prefill: False: prefill nothing now; the following `step`s feed the prompt in chunks
        (`prefill_tokens` per step) beside the decode rows, and the step that feeds its last
        token returns its first token.

    Returns:
      (slot, stats, events): stats is the sequence's GenerationStats, filled as it runs; events
      is [TokenStep(first token)] and, when the sequence already ends, a final
      TokenStep(-1, STOP_EOS | STOP_LENGTH) (its slot is then free again); [] with
      prefill=False (but for max_new_tokens=0: the final TokenStep).

    Raises:
      ConfigError: no free slot, invalid sampling values or logit_bias. GrammarError: a
        response_format that does not compile. ContextError: ids that do not fit.
    """
    self._check_backend()
    if not self._free:
      raise ConfigError(f"all {self.max_batch} slots are decoding; wait for one to finish.")
    model = self.model
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 0)
    repeat_last_n = check_int("repeat_last_n", repeat_last_n, 1)
    seed = prng_seed(seed)
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) and not (
        isinstance(ids, np.ndarray) and ids.ndim == 1):
      raise ConfigError(f"add needs the prompt's token ids (a list of ints; Model.encode_prompt "
                        f"makes them from text), got {type(ids).__name__}.")
    params = sampling_lib.make_sampling_params(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty)
    ids = model.encode_prompt(list(ids))
    constraint = None
    if logit_bias or response_format is not None:
      from pijax import grammar as grammar_lib
      constraint = grammar_lib.make_constraint(
          model.tokenizer, model.config.vocab_size, response_format=response_format,
          logit_bias=logit_bias)
    stats = GenerationStats(prompt_tokens=len(ids), load_s=model.load_s,
                            weights=model.weights_label)
    recent = collections.deque([-1] * repeat_last_n, maxlen=repeat_last_n)
    recent.extend(ids[-repeat_last_n:])
    seq = _Sequence(jax.random.PRNGKey(seed), params, recent, max_new_tokens, stats,
                    bool(ignore_eos), temperature <= 0 and repeat_penalty == 1 and
                    presence_penalty == 0 and frequency_penalty == 0,
                    constraint=constraint, logprobs=bool(logprobs))
    slot, reused = self._pick_slot(ids)
    if max_new_tokens == 0:
      self.last_reused = 0
      return slot, stats, [TokenStep(-1, STOP_LENGTH)]
    self._free.remove(slot)
    self.last_reused = reused
    if not prefill:  # The steps feed ids[reused:]; fed grows as their keys/values land.
      seq.fed, seq.pos, seq.prompt = list(ids[:reused]), reused, list(ids)
      self._live[slot] = seq
      return slot, stats, []
    self._cached[slot] = []  # Unknown until the sequence ends (a failed pass leaves garbage).
    seq.fed = list(ids)
    t0 = time.perf_counter()
    n = len(ids)
    chunk = self.prefill_chunk
    try:
      for start in range(reused, n, chunk):
        end = min(n, start + chunk)
        logits = self.decoder.forward_rows(self.cache, ids[start:end],
                                           np.full(end - start, slot), np.arange(start, end),
                                           rows=[end - start - 1])
    except BaseException:  # The slot is free again, its cache unknown (nothing to reuse).
      self._free.append(slot)
      raise
    stats.prefill_s = time.perf_counter() - t0
    seq.pos = n
    self._live[slot] = seq
    token, lp = self._sample({slot: logits[0]})[slot]
    return slot, stats, self._advance(slot, token, lp)

  def step(self, prefill_tokens: int | None = None) -> dict[int, list[TokenStep]]:
    """Decodes one token of every decoding sequence and feeds a chunk of the prompts still to
    be prefilled (`add(..., prefill=False)`, oldest first), all in one host pass.

    Args:
      prefill_tokens: prompt tokens to feed in this pass at most (default: the generator's
        `prefill_tokens`; with no sequence decoding, `engine.PREFILL_CHUNK`).

    Returns:
      {slot: events} for each live sequence: [TokenStep(token)] for a decoding one and for one
      whose prompt this pass finished (its first token), [] for one still prefilling; a
      sequence that ends here gets a final TokenStep(-1, STOP_EOS | STOP_LENGTH) (its slot is
      free again).
    """
    self._check_backend()
    if not self._live:
      return {}
    decoding = sorted(s for s, q in self._live.items() if q.prompt is None)
    if prefill_tokens is None:
      prefill_tokens = self.prefill_tokens if decoding else self.prefill_chunk
    budget = check_int("prefill_tokens", prefill_tokens, 1)
    tokens = [self._live[s].token for s in decoding]
    slots = list(decoding)
    positions = [self._live[s].pos for s in decoding]
    rows = list(range(len(decoding)))  # Logits of each decode row and of each finished prompt.
    fed: list[tuple[int, int]] = []  # (slot, prompt tokens fed this pass)
    for s in self._prefilling():
      if budget == 0:
        break
      q = self._live[s]
      k = min(budget, len(q.prompt) - q.pos)
      tokens += q.prompt[q.pos:q.pos + k]
      slots += [s] * k
      positions += range(q.pos, q.pos + k)
      budget -= k
      fed.append((s, k))
      if q.pos + k == len(q.prompt):
        rows.append(len(tokens) - 1)
    t0 = time.perf_counter()
    # A pass of prompt chunks alone that finishes none still needs one logits row (discarded).
    logits = self.decoder.forward_rows(self.cache, tokens, slots, positions,
                                       rows=rows or [len(tokens) - 1])
    for s in decoding:  # The pass wrote each input token's keys/values at its position.
      q = self._live[s]
      q.fed.append(q.token)
      q.pos += 1
    done = []  # Slots whose prompt this pass finished: they sample their first token.
    for s, k in fed:
      q = self._live[s]
      q.fed += q.prompt[q.pos:q.pos + k]
      q.pos += k
      if q.pos == len(q.prompt):
        q.prompt = None
        done.append(s)
    sampled = self._sample(dict(zip(decoding + done, logits)))
    dt = time.perf_counter() - t0
    active = float(self.decoder.last_active.mean())
    for s in decoding:
      q = self._live[s]
      q.stats.decode_s += dt
      q.stats.decode_steps += 1
      q.stats.active_sum += active
    for s, _ in fed:
      self._live[s].stats.prefill_s += dt
    events = {s: [] for s, _ in fed}
    events.update({s: self._advance(s, *sampled[s]) for s in decoding + done})
    return events

  def _prefilling(self) -> list[int]:
    """Slots whose prompt is still being fed, oldest `add` first."""
    return [s for s, q in self._live.items() if q.prompt is not None]

  def _check_backend(self) -> None:
    if self.model.backend is not self.backend:
      raise ContextError("the model was reconfigured (configure_sparse / configure_host_weights)"
                         " since this BatchGenerator was made; make a new one.")

  def cancel(self, slot: int) -> None:
    """Ends a live sequence now (a client went away); its slot is free again."""
    q = self._live.pop(slot, None)
    if q is not None:
      self._release(slot, q)

  def _release(self, slot: int, q: _Sequence) -> None:
    """Frees a slot, keeping the tokens whose keys/values it holds for a later prompt."""
    self._cached[slot] = q.fed
    self._clock += 1
    self._freed_at[slot] = self._clock
    self._free.append(slot)

  def _pick_slot(self, ids: list[int]) -> tuple[int, int]:
    """(slot, reused): the free slot holding the longest prefix of ids (at most len(ids) - 1:
    the last prompt token is always run, its logits give the first token), ties and no reuse
    going to the least recently freed one."""
    def reusable(slot: int) -> int:
      cached, n, i = self._cached[slot], min(len(self._cached[slot]), len(ids) - 1), 0
      while i < n and cached[i] == ids[i]:
        i += 1
      return i
    best = max(self._free, key=lambda s: (reusable(s), -self._freed_at[s], -s))
    return best, reusable(best)

  def _sample(self, rows: dict[int, np.ndarray]) -> dict[int, tuple]:
    """{slot: (token, f32[V] log-probabilities or None)}: each slot's row sampled with its own
    key, parameters, recent tokens and bias (greedy rows by NumPy's argmax: the first maximum,
    as jnp.argmax)."""
    out = {}
    for slot, logits in rows.items():
      q = self._live[slot]
      lp = log_softmax(logits) if q.logprobs else None
      # f32[V] or None: its logit_bias and the grammar's -inf on forbidden tokens.
      bias = None if q.constraint is None else np.asarray(q.constraint.bias(), np.float32)
      if q.greedy:
        out[slot] = (int(np.argmax(logits if bias is None else logits + bias)), lp)
        continue
      token, q.key = _sample_one(logits, q.key, q.params, np.asarray(q.recent, np.int32), bias)
      out[slot] = (int(token), lp)
    return out

  def _advance(self, slot: int, token: int, lp: np.ndarray | None = None) -> list[TokenStep]:
    q = self._live[slot]
    q.produced += 1
    q.stats.new_tokens = q.produced
    events = [TokenStep(token, None, lp)]
    reason = None
    if token in self.model.tokenizer.stop_ids and not q.ignore_eos:
      reason = STOP_EOS
    elif q.produced >= q.max_new_tokens or q.pos >= self.model.max_seq_len:
      reason = STOP_LENGTH
    if reason is not None:
      events.append(TokenStep(-1, reason))
      del self._live[slot]
      self._release(slot, q)
    else:
      q.token = token
      q.recent.append(token)
      if q.constraint is not None:  # The grammar moves past the token before the next mask.
        q.constraint.advance(token)
    return events


def generate_batch(model, prompts: Sequence[str | Sequence[int]], *, max_batch: int | None = None,
                   chat: bool = False, stop: str | Sequence[str] | None = None,
                   seed: int | Sequence[int] = 0, parse_special: bool = False,
                   **sampling) -> list[GenerationResult]:
  """Generates a reply to each prompt, up to `max_batch` (default: all) decoded together.

  Args:
    model: as for `BatchGenerator`.
    prompts: each text, token ids, or with `chat` a list of messages (`Model.stream`).
    stop: stop strings for every prompt (the text ends before the earliest; stop_reason "stop").
    seed: one seed for all, or a list of one per prompt.
    parse_special: as for `Model.stream`.
    sampling: max_new_tokens, temperature, top_k, top_p, min_p, repeat_penalty,
      presence_penalty, frequency_penalty, repeat_last_n, logit_bias, response_format (as for
      `Model.generate_ids`; log-probabilities are `BatchGenerator.add`'s, not returned here).

  Returns:
    GenerationResult per prompt, in order; each one's tokens are those of
    `model.generate(prompt, ...)` alone (module docstring). Its stats' decode_s is the wall time
    of the batched steps it took part in.

  Raises:
    ConfigError, ContextError: as `BatchGenerator.add`; prompts, seeds, stop strings and
      lengths are checked for every prompt before any is decoded.
  """
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
    raise ConfigError(f"prompts must be a list (of texts, token id lists or chats), got "
                      f"{type(prompts).__name__}.")
  prompts = list(prompts)
  if not prompts:
    return []
  if max_batch is not None:
    check_int("max_batch", max_batch, 1)
  if sampling.get("logprobs"):
    raise ConfigError("generate_batch returns texts; for log-probabilities use "
                      "BatchGenerator.add(..., logprobs=True).")
  if isinstance(seed, (list, tuple)):
    seeds = [prng_seed(s) for s in seed]
  else:
    seeds = [prng_seed(seed)] * len(prompts)
  if len(seeds) != len(prompts):
    raise ConfigError(f"seed: one for all or one per prompt ({len(prompts)}), got {len(seeds)}.")
  stop = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
  if not all(isinstance(s, str) for s in stop):
    raise ConfigError(f"stop must be a string or a list of strings, got {stop!r}.")
  ids = [model.encode_prompt(p, chat=chat, parse_special=parse_special) for p in prompts]
  for p in ids:
    if len(p) > model.max_seq_len:
      raise ContextError(f"a prompt of {len(p)} tokens does not fit max_seq_len "
                         f"{model.max_seq_len}.")
  gen = BatchGenerator(model, max_batch or len(prompts))
  outs = [TextOut(model.tokenizer, stop) for _ in prompts]
  texts: list[list[str]] = [[] for _ in prompts]
  tokens: list[list[int]] = [[] for _ in prompts]
  reasons: list[str | None] = [None] * len(prompts)
  stats: list[GenerationStats | None] = [None] * len(prompts)
  owner: dict[int, int] = {}  # slot -> prompt index

  def take(i: int, events: list[TokenStep]) -> None:
    for ev in events:
      if reasons[i] is not None:
        return
      if ev.stop_reason is not None:
        reasons[i] = ev.stop_reason
        return
      tokens[i].append(ev.token_id)
      texts[i].append(outs[i].push(ev.token_id))
      if outs[i].stopped:
        reasons[i] = STOP_STRING

  waiting = list(range(len(prompts)))
  while waiting or gen.live:
    while waiting and gen.free_slots:
      i = waiting.pop(0)
      slot, stats[i], events = gen.add(ids[i], seed=seeds[i], **sampling)
      owner[slot] = i
      take(i, events)
      if reasons[i] is not None:
        gen.cancel(slot)  # Ended by its first token (a no-op when the generator ended it).
    for slot, events in gen.step().items():
      i = owner[slot]
      take(i, events)
      if reasons[i] is not None:
        gen.cancel(slot)  # A stop string ended it.
  results = []
  for i in range(len(prompts)):
    tail = outs[i].finish()
    results.append(GenerationResult(
        text="".join(texts[i]) + tail, token_ids=tokens[i], stop_reason=reasons[i] or STOP_LENGTH,
        stats=stats[i] or GenerationStats(prompt_tokens=len(ids[i]))))
  return results
