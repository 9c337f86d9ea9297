"""What a generation returns: its text and ids, why it stopped, and its timings."""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

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
