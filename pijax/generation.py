"""What a generation returns: its text and ids, why it stopped, and its timings."""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

STOP_EOS = "eos"  # An end-of-sequence / end-of-turn token was sampled.
STOP_LENGTH = "length"  # max_new_tokens reached, or the context (max_seq_len) is full.


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
