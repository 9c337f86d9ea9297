"""A sequence whose KV cache outlives a generation: the prefix cache of multi-turn chat and of the
server's slots (`pijax.server.worker`)."""

from __future__ import annotations

from typing import Sequence

from pijax.errors import ContextError


class Session:
  """One sequence whose KV cache outlives a generation, so the next one reuses its prefix.

  Pass it to `Model.generate_ids` / `Model.stream`: a prompt that starts with the tokens
  already in the cache (the previous prompt and reply, as in a multi-turn chat) prefills only
  the rest. The greedy output equals a fresh run's. Not thread-safe: one generation at a time.
  Call `close` (or use `with`) to free the cache; `clear` forgets the cached tokens.

  Args:
    model: the `pijax.engine.Model` whose cache it keeps (its backend's state).

  Attributes:
    ids: the tokens whose keys and values are in the cache, in order.
    last_reused: how many prompt tokens the latest generation took from the cache.
  """

  def __init__(self, model):
    self.model = model
    self.ids: list[int] = []
    self.last_reused = 0
    self._state = None
    self._backend = None
    self._release = None
    self._busy = False

  def reusable(self, ids: Sequence[int]) -> int:
    """How many leading tokens of `ids` the cache holds (at most len(ids) - 1: the last
    prompt token is always run, its logits give the first new token)."""
    if self._state is None or self._backend is not self.model.backend:
      return 0
    n = min(len(self.ids), len(ids) - 1)
    i = 0
    while i < n and self.ids[i] == ids[i]:
      i += 1
    return i

  def acquire(self, ids: Sequence[int]):
    """(state, reused): the cache to prefill `ids` into and how many tokens it already holds.
    Called by the engine as a generation starts; `store` gives the state back.

    Raises:
      ContextError: a generation of this session is still running.
    """
    if self._busy:
      raise ContextError("this Session is already generating; finish or close that "
                         "generation first (one generation per session at a time).")
    reused = self.reusable(ids)
    if self._state is None or self._backend is not self.model.backend:
      self.clear()
      self._backend = self.model.backend
      self._state = self.model.new_cache(1)
      self._release = self._backend.releaser(self._state)
    self._busy = True
    self.ids = []  # Unknown until the generation stores what it fed.
    self.last_reused = reused
    return self._state, reused

  def store(self, state, fed: list[int] | None) -> None:
    """Keeps the latest state and the tokens in it (the engine, as a generation ends); None:
    the state was lost mid-step."""
    self._busy = False
    if fed is None:
      self.clear()
      return
    self._state = state
    self.ids = fed

  def clear(self) -> None:
    """Frees the cache (a later generation starts from an empty one)."""
    if self._release is not None:
      self._release()
    self._state = self._backend = self._release = None
    self.ids = []
    self._busy = False

  close = clear

  def __enter__(self) -> "Session":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
