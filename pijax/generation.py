"""What a generation returns: its text and ids, why it stopped, and its timings; and the output
shaping that makes its text from token ids (detokenizing, stop strings): `Model.stream` and
`Model.generate` are `stream` and `generate` here, over the engine's `Model.generate_ids`."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Generator, Iterator, Sequence

import numpy as np

from pijax.errors import ConfigError

if TYPE_CHECKING:
  from pijax.session import Session

STOP_EOS = "eos"  # An end-of-sequence / end-of-turn token was sampled.
STOP_LENGTH = "length"  # max_new_tokens reached, or the context (max_seq_len) is full.
STOP_STRING = "stop"  # A stop string was generated (the text ends before it).


@dataclasses.dataclass
class GenerationStats:
  """Timings of one generation (seconds, tokens/s); compile time is excluded from rates."""

  prompt_tokens: int = 0
  new_tokens: int = 0
  load_s: float = 0.0
  compile_s: float = 0.0
  prefill_s: float = 0.0
  decode_s: float = 0.0
  decode_steps: int = 0
  active_sum: float = 0.0  # Sum over decode steps of the mean active FFN fraction.
  weights: str = "float32"  # How the weights are held (`Model.weights_label`).

  def add_active(self, active: np.ndarray) -> None:
    """Records one decode step's per-layer active FFN fractions."""
    self.active_sum += float(np.mean(active))

  @property
  def ffn_sparsity(self) -> float:
    """Measured FFN sparsity of decode: fraction of FFN neurons skipped, over layers, steps."""
    return 1.0 - self.active_sum / self.decode_steps if self.decode_steps else 0.0

  @property
  def prefill_tokens_per_s(self) -> float:
    return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

  @property
  def decode_tokens_per_s(self) -> float:
    return self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0

  def summary(self, stop_reason: str) -> str:
    return (f"prompt tokens: {self.prompt_tokens}, new tokens: {self.new_tokens}, "
            f"load: {self.load_s:.2f} s, compile: {self.compile_s:.2f} s, "
            f"prefill: {self.prefill_tokens_per_s:.1f} tok/s, "
            f"decode: {self.decode_tokens_per_s:.1f} tok/s, "
            f"FFN sparsity: {self.ffn_sparsity:.1%}, weights: {self.weights}, "
            f"stop: {stop_reason}")


@dataclasses.dataclass
class TokenStep:
  """One event of `Model.generate_ids`.

  token_id: the sampled id (-1 on the final event).
  stop_reason: None, except on the final event (STOP_EOS or STOP_LENGTH).
  logprobs: f32[vocab], log-softmax of the raw logits the token was sampled from (only when
    asked for), else None.
  """

  token_id: int
  stop_reason: str | None = None
  logprobs: np.ndarray | None = None


class StopStrings:
  """Cuts streamed text at the first stop string to complete, never emitting any part of one.

  "First to complete" is where token-by-token generation meets a stop, so the cut is the same
  however the text is split into pieces: in "aaba" with stops ("b", "aba") "b" completes
  first and the text is "aa" (of two stops completing together, the one that starts first).

  `push(piece)` returns the text that is safe to emit: text that is neither part of a match nor
  a suffix that could still grow into one (held back until the next piece decides). After a
  match, `stopped` is True and the text before it has been returned. `flush()` returns what is
  held at the end of generation. A stop string that spans several tokens is found all the same.
  """

  def __init__(self, stops: "tuple[str, ...] | list[str]"):
    self.stops = tuple(s for s in stops if s)
    self._held = ""
    self.stopped = False
    self.matched: str | None = None

  def push(self, piece: str) -> str:
    if self.stopped:
      return ""
    if not self.stops:
      return piece
    text = self._held + piece
    hits = [(text.find(s), s) for s in self.stops]
    hits = [(at + len(s), at, s) for at, s in hits if at >= 0]  # (end, start, stop)
    if hits:
      _, at, self.matched = min(hits)
      self.stopped = True
      self._held = ""
      return text[:at]
    # Hold back the longest suffix of `text` that is a proper prefix of some stop string.
    keep = 0
    for stop in self.stops:
      for n in range(min(len(stop) - 1, len(text)), keep, -1):
        if text.endswith(stop[:n]):
          keep = n
          break
    self._held = text[len(text) - keep:] if keep else ""
    return text[:len(text) - keep]

  def flush(self) -> str:
    held, self._held = ("" if self.stopped else self._held), ""
    return held


class TextOut:
  """Generated token ids -> the text that is safe to emit, one id at a time.

  Detokenizes incrementally (never half a UTF-8 character), drops end-of-turn / stop tokens,
  and cuts at the first stop string to complete (`StopStrings`). `push` per id, `finish` once at the
  end; `stopped` says a stop string ended the text.
  """

  def __init__(self, tokenizer, stop: "tuple[str, ...] | list[str]" = ()):
    self._decoder = tokenizer.stream()
    self._stops = StopStrings(stop)
    self._stop_ids = tokenizer.stop_ids

  @property
  def stopped(self) -> bool:
    return self._stops.stopped

  def push(self, token_id: int) -> str:
    if token_id in self._stop_ids:
      return ""
    return self._stops.push(self._decoder.push(token_id))

  def finish(self) -> str:
    """The held text (bytes of an incomplete character flushed once, as U+FFFD: case T3)."""
    if self._stops.stopped:
      return ""
    tail = self._stops.push(self._decoder.flush())
    return tail if self._stops.stopped else tail + self._stops.flush()


@dataclasses.dataclass
class GenerationResult:
  """text: the generated text; token_ids: the generated ids (stop token included)."""

  text: str
  token_ids: list[int]
  stop_reason: str
  stats: GenerationStats


class Stream:
  """Iterator over generated text pieces; `result` is set once it is exhausted."""

  def __init__(self, pieces: Iterator[str]):
    self._pieces = pieces
    self.result: GenerationResult | None = None

  def __iter__(self) -> "Stream":
    return self

  def __next__(self) -> str:
    try:
      return next(self._pieces)
    except StopIteration as stop:
      self.result = stop.value
      raise StopIteration from None

  def close(self) -> None:
    """Stops the generation now (no further decode step runs); `result` stays None."""
    close = getattr(self._pieces, "close", None)
    if close is not None:
      close()


def stop_list(stop: str | Sequence[str] | None) -> list[str]:
  """`stop` as `Model.stream` takes it (None, a string or a list of them) as a list.

  Raises:
    ConfigError: anything else.
  """
  stop = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
  if not all(isinstance(s, str) for s in stop):
    raise ConfigError(f"stop must be a string or a list of strings, got {stop!r}.")
  return stop


def text_stream(tokenizer, steps: Generator[TokenStep, None, None], stop: Sequence[str],
                stats: GenerationStats) -> Stream:
  """The text of a generation's `TokenStep`s (`Model.generate_ids`) as a `Stream`: pieces cut
  at the first stop string (`TextOut`); its result's stop_reason is the steps' own, or
  STOP_STRING. Closing the stream closes `steps`."""

  def pieces() -> Iterator[str]:
    out = TextOut(tokenizer, stop)
    out_ids: list[int] = []
    text: list[str] = []
    reason = STOP_LENGTH
    try:
      for step in steps:
        if step.stop_reason is not None:
          reason = step.stop_reason
          break
        out_ids.append(step.token_id)
        piece = out.push(step.token_id)
        if piece:
          text.append(piece)
          yield piece
        if out.stopped:
          break
      tail = out.finish()
      if tail:
        text.append(tail)
        yield tail
      if out.stopped:
        reason = STOP_STRING
    finally:
      steps.close()
    return GenerationResult(text="".join(text), token_ids=out_ids, stop_reason=reason,
                            stats=stats)

  return Stream(pieces())


def stream(model, prompt: str | Sequence[int], *, max_new_tokens: int = 128,
           temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
           repeat_penalty: float = 1.0, repeat_last_n: int = 64, seed: int = 0,
           chat: bool = False, parse_special: bool = False,
           stop: str | Sequence[str] | None = None,
           session: Session | None = None, presence_penalty: float = 0.0,
           frequency_penalty: float = 0.0, logit_bias: dict[int, float] | None = None,
           response_format: Any = None) -> Stream:
  """`Model.stream`: generates text, yielding pieces as they are decoded (never half a UTF-8
  character).

  Args:
    model: the `pijax.engine.Model` (self, as a method).
    prompt: text, a list of token ids (used as is), or with `chat` a list of messages
      ([{"role": "system" | "user" | "assistant", "content": str}, ...]).
    max_new_tokens: upper bound on generated tokens.
    temperature, top_k, top_p, min_p, repeat_penalty: see `pijax.sampling`
      (temperature 0 = greedy; top_k 0 = off; repeat_penalty 1 = off).
    repeat_last_n: how many recent tokens the repetition penalties look at.
    seed: PRNG seed (same seed, same output).
    chat: wrap the prompt as one user message (or render the messages) with the model's chat
      template.
    parse_special: text that looks like a special token becomes that token (default: plain
      text; chat templates always insert real special tokens).
    stop: a stop string or a list of them: the text ends before the earliest one generated
      (stop_reason "stop"); no part of it is ever yielded, even when it spans tokens.
    session: a `Session` to reuse the cached prefix of (multi-turn chat) and keep the cache.
    presence_penalty, frequency_penalty: OpenAI's additive penalties (0 = off).
    logit_bias: OpenAI's {token id: bias in [-100, 100]}, added to the logits before sampling.
    response_format: constrain the text (`pijax.grammar`): {"type": "json_object"}, {"type":
      "json_schema", "json_schema": {"name": ..., "schema": {...}}}, or a compiled
      `pijax.grammar.Grammar` (e.g. `lark_grammar`). The reply ends when the grammar is
      complete; cut by max_new_tokens or a stop string, it may be incomplete.

  Returns:
    A `Stream`; iterate it for text pieces, then read `.result` (GenerationResult).

  Raises:
    ConfigError: invalid sampling parameters or logit_bias, or no chat template.
    GrammarError: a response_format that does not compile.
    ContextError: empty prompt or a prompt longer than max_seq_len.
  """
  stats = GenerationStats()
  stop = stop_list(stop)
  ids = model.encode_prompt(prompt, chat=chat, parse_special=parse_special)
  steps = model.generate_ids(ids, max_new_tokens=max_new_tokens, temperature=temperature,
                             top_k=top_k, top_p=top_p, min_p=min_p,
                             repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
                             frequency_penalty=frequency_penalty, repeat_last_n=repeat_last_n,
                             seed=seed, session=session, stats=stats, logit_bias=logit_bias,
                             response_format=response_format)
  return text_stream(model.tokenizer, steps, stop, stats)


def generate(model, prompt: str | Sequence[int], **kwargs) -> GenerationResult:
  """`Model.generate`: like `stream` but returns the whole GenerationResult."""
  out = stream(model, prompt, **kwargs)
  for _ in out:
    pass
  assert out.result is not None
  return out.result
