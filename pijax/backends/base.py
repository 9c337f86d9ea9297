"""The backend protocol: the one seam between the engine and the ways a model can run.

A backend owns its weights (device params, host blocks, or both) and knows how to run one
forward pass over an explicit state (the KV cache). The engine (`pijax.engine`) holds one backend
and runs the same loop over every backend: tokenize, chunked prefill, decode, sample, stream.
Modelled on JetStream's `engine_api.Engine` (prefill / generate / init_decode_state).

Every step method is traceable: the engine calls it inside `jax.jit` with the backend static
(closed over), `params` and `state` as arguments, and the state donated. How a step is compiled
(`compile_step`) and which attention window it is compiled for (`attention_window`) are the
backend's to say: the engine never branches on which backend it holds.
"""

from __future__ import annotations

import abc
from typing import Any, Callable

import jax

from pijax import steps as steps_lib
from pijax.arch.spec import ModelConfig
from pijax.errors import UnsupportedError

StepOut = tuple[jax.Array, Any, jax.Array]  # (logits, state, active f32[L])


class Backend(abc.ABC):
  """One way to run a model. Subclasses set `name` and implement the abstract methods.

  Attributes:
    config: the model's ModelConfig.
    name: "xla" | "host" | "hybrid".
  """

  name: str = "backend"
  # Family switches (`ModelConfig.variant_switches`) this backend implements.
  implemented_switches: frozenset[str] = frozenset()

  def __init__(self, config: ModelConfig):
    type(self).supports(config)
    self.config = config

  # ----------------------------------------------------------------------------- what it runs
  @classmethod
  def supports(cls, config: ModelConfig) -> None:
    """Raises UnsupportedError naming what this backend cannot run of `config`."""
    missing = sorted(set(config.variant_switches()) - cls.implemented_switches)
    if missing:
      raise UnsupportedError(
          f"the {cls.name} backend cannot run architecture {config.arch!r}: it does not "
          f"implement {', '.join(f'{m}={getattr(config, m)!r}' for m in missing)}.")

  @property
  def mode(self) -> str:
    """FFN sparsity mode: "off" (dense), "oracle", "predictor", "gate" or "contribution"."""
    return "off"

  @property
  @abc.abstractmethod
  def label(self) -> str:
    """How the weights are held, for stats lines and benches (e.g. "float32", "q4_1 host")."""

  @property
  def weights_format(self) -> str:
    """The host weight format ("gguf" | "q8_0"), or "off" when no host weights run."""
    return "off"

  # ----------------------------------------------------------------------------- state
  @property
  @abc.abstractmethod
  def params(self) -> Any:
    """The pytree the step functions take as their `params` argument."""

  @abc.abstractmethod
  def init_state(self, batch: int, max_seq_len: int) -> Any:
    """A fresh decode state (KV cache) for `batch` rows of `max_seq_len` tokens."""

  def release_state(self, state: Any) -> None:
    """Frees what the state holds outside JAX (host KV caches). `state` must be readable: the
    one init_state returned or the latest step's output (a state passed to a step was donated);
    see `releaser`."""
    self.releaser(state)()

  def releaser(self, state: Any) -> Callable[[], None]:
    """A callable freeing what `state` holds outside JAX, taken right after `init_state` (it
    stays valid after the state has been donated to steps)."""
    del state
    return lambda: None

  # ----------------------------------------------------------------------------- steps
  @abc.abstractmethod
  def prefill(self, params: Any, state: Any, tokens: jax.Array, length: jax.Array,
              pos: jax.Array, *, kv_len: int, all_logits: bool) -> StepOut:
    """Processes tokens i32[B, T] (right-padded; `length` i32[] real ones) at positions
    pos + [0, T); traceable.

    Returns:
      logits f32[B, V] of token length - 1 (f32[B, T, V] with all_logits), the state with
      [pos, pos + T) written, and active f32[L]: each layer's fraction of FFN neurons computed.
    """

  @abc.abstractmethod
  def decode(self, params: Any, state: Any, tokens: jax.Array, pos: jax.Array, *,
             kv_len: int) -> StepOut:
    """One token per row, tokens i32[B] at position pos; returns (logits f32[B, V], state,
    active f32[L]); traceable."""

  # ----------------------------------------------------------------------------- compiling
  def attention_window(self, needed: int, max_seq_len: int) -> int:
    """The kv_len to compile a pass that needs `needed` positions for: a power-of-two bucket
    (`pijax.steps.kv_bucket`), so decoding N tokens compiles once per bucket. A backend whose
    passes attend exactly [0, pos + T) whatever kv_len says returns one value for all."""
    return steps_lib.kv_bucket(needed, max_seq_len)

  def compile_step(self, kind: str, kv_len: int, args: tuple, shared: dict) -> Callable:
    """The engine's step `kind` (a key of `pijax.steps.STEPS`) compiled ahead of time for
    `args` (params first, the state second and donated): a callable with the step's arguments
    and results. `shared`: the engine's cache, for executables several steps can share.
    Default: one XLA program (`pijax.steps.compile_fused`)."""
    del shared
    return steps_lib.compile_fused(kind, self, kv_len, args)

  # ----------------------------------------------------------------------------- accounting
  @abc.abstractmethod
  def weight_bytes_per_token(self, ffn_sparsity: float = 0.0) -> tuple[int, int]:
    """(weight bytes one decoded token reads at this FFN sparsity, bytes a dense token reads)."""

  @abc.abstractmethod
  def weight_bytes(self) -> int:
    """Bytes of weights held for inference."""

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self.config.arch}, {self.label}, mode={self.mode})"
