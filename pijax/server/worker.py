"""One generation worker: a FIFO of jobs run one at a time, with prefix-reusing KV cache slots.

The HTTP handlers (asyncio) tokenize a request, submit a `Job` and read its events; the worker
thread runs the model (`Model.generate_ids`) and posts events back to the handler's event loop.
A job whose client went away (`Job.cancel`) stops before its next decode step and frees the
worker. The queue is bounded: `submit` raises `QueueFull` when `max_queue` jobs already wait.

Prefix reuse: the worker keeps up to `cache_slots` `pijax.engine.Session`s (each one KV cache of
max_seq_len tokens). A job runs in the slot whose cached tokens share the longest prefix with
its prompt (the previous turn of the same conversation, usually), else in the least recently
used slot, so a follow-up turn prefills only its new tokens (llama-server's `cache_prompt`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from typing import Any, Callable

import numpy as np

from pijax.errors import PijaxError
from pijax.generation import STOP_STRING, TextOut

FINISH_REASONS = {"eos": "stop", STOP_STRING: "stop", "length": "length"}


class QueueFull(Exception):
  """The worker's queue holds `max_queue` waiting jobs already."""


@dataclasses.dataclass
class Delta:
  """Text that became safe to emit, with the tokens that produced it (for logprobs)."""
  text: str
  tokens: list[dict[str, Any]]


@dataclasses.dataclass
class Done:
  finish_reason: str
  prompt_tokens: int
  completion_tokens: int
  cached_tokens: int


@dataclasses.dataclass
class Failed:
  status: int
  message: str
  type: str = "server_error"
  code: str | None = None


@dataclasses.dataclass
class Cancelled:
  """The job was cancelled (its client left, or the server shuts down) and will not finish."""


class Job:
  """One request's generation; its events arrive in `events` on the submitting loop.

  Args:
    ids: prompt token ids (they fit max_seq_len).
    max_tokens: generated tokens at most (None: up to the context's end).
    sampling: keyword arguments of `Model.generate_ids` (temperature, top_p, seed, ...,
      logit_bias, response_format: a compiled `pijax.grammar.Grammar`).
    stop: stop strings.
    top_logprobs: None (no logprobs) or how many alternatives per token (0..20).
  """

  def __init__(self, ids: list[int], *, max_tokens: int | None, sampling: dict[str, Any],
               stop: list[str], top_logprobs: int | None,
               loop: asyncio.AbstractEventLoop | None = None):
    self.ids = ids
    self.max_tokens = max_tokens
    self.sampling = sampling
    self.stop = stop
    self.top_logprobs = top_logprobs
    self.loop = loop or asyncio.get_running_loop()
    self.events: asyncio.Queue = asyncio.Queue()
    self.cancelled = threading.Event()
    self.submitted = time.perf_counter()

  def cancel(self) -> None:
    """Stops the generation before its next step (or before it starts); the job then ends
    with a `Cancelled` event."""
    self.cancelled.set()

  def post(self, event) -> None:
    try:
      self.loop.call_soon_threadsafe(self.events.put_nowait, event)
    except RuntimeError:  # The loop closed (server shutting down): nobody is listening.
      self.cancel()


class Worker:
  """Runs jobs on `model` one at a time in FIFO order, in one daemon thread.

  Args:
    model: a loaded `pijax.engine.Model`.
    max_queue: waiting jobs at most (the running one not counted); more -> `QueueFull`.
    cache_slots: KV caches kept for prefix reuse (each max_seq_len tokens of keys and values).
    on_token: optional callback(job, seconds since the job's previous token or its start).
  """

  def __init__(self, model, *, max_queue: int = 16, cache_slots: int = 2,
               on_token: Callable[[Job, float], None] | None = None):
    from pijax import engine
    self.model = model
    self.max_queue = int(max_queue)
    self._queue: collections.deque[Job] = collections.deque()
    self._cond = threading.Condition()
    self._closing = False
    self._slots = [engine.Session(model) for _ in range(max(1, int(cache_slots)))]
    self._used = [0.0] * len(self._slots)
    self.on_token = on_token
    self.running: Job | None = None
    self._thread = threading.Thread(target=self._loop, name="pijax-worker", daemon=True)
    self._thread.start()

  @property
  def waiting(self) -> int:
    """Jobs queued behind the running one (cancelled ones and one about to start not counted)."""
    with self._cond:
      return self._waiting_locked()

  def _waiting_locked(self) -> int:
    live = sum(1 for job in self._queue if not job.cancelled.is_set())
    # A job queued while the worker is idle starts at once: it does not wait.
    return max(0, live - (1 if self.running is None else 0))

  def submit(self, job: Job) -> None:
    """Queues a job (FIFO). Raises QueueFull when max_queue jobs already wait."""
    with self._cond:
      if self._closing:
        raise QueueFull("the server is shutting down; retry later.")
      self._queue = collections.deque(j for j in self._queue if not j.cancelled.is_set())
      if self._waiting_locked() >= self.max_queue:
        raise QueueFull(f"the server is busy: {self._waiting_locked()} requests are already "
                        f"waiting (--max_queue={self.max_queue}); retry later.")
      self._queue.append(job)
      self._cond.notify()

  def shutdown(self) -> None:
    """Cancels the running and queued jobs (each ends with a `Failed` 503 event) and refuses
    new ones; the thread stops after the current decode step."""
    with self._cond:
      self._closing = True
      jobs = list(self._queue) + ([self.running] if self.running is not None else [])
      self._queue.clear()
      self._cond.notify()
    for job in jobs:
      job.cancel()
      job.post(Failed(503, "the server is shutting down; retry later.", code="server_busy"))

  def close(self, timeout: float = 30.0) -> None:
    """`shutdown`, then waits for the thread and frees the cache slots."""
    self.shutdown()
    self._thread.join(timeout=timeout)
    if not self._thread.is_alive():
      for slot in self._slots:
        slot.close()

  def _loop(self) -> None:
    while True:
      with self._cond:
        while not self._queue and not self._closing:
          self._cond.wait()
        if self._closing:
          return
        job = self._queue.popleft()
        if job.cancelled.is_set():
          job.post(Cancelled())
          continue
        self.running = job
      try:
        self._run(job)
      except PijaxError as err:
        job.post(Failed(400, str(err), "invalid_request_error"))
      except Exception as err:  # One request's failure must not stop the worker.
        logging.exception("generation failed")
        job.post(Failed(500, f"generation failed: {type(err).__name__}: {err}"))
      finally:
        with self._cond:
          self.running = None

  def _slot_for(self, ids: list[int]) -> int:
    best = max(range(len(self._slots)), key=lambda i: (self._slots[i].reusable(ids),
                                                       -self._used[i]))
    if self._slots[best].reusable(ids) == 0:
      best = min(range(len(self._slots)), key=lambda i: self._used[i])
    return best

  def _token_entry(self, token_id: int, logprobs: np.ndarray, top: int) -> dict[str, Any]:
    tok = self.model.tokenizer
    data = tok.token_bytes(token_id)
    entry = {"token": data.decode("utf-8", "replace"), "bytes": list(data),
             "logprob": float(logprobs[token_id]), "top_logprobs": []}
    if top:
      best = np.argpartition(-logprobs, top - 1)[:top]
      best = best[np.argsort(-logprobs[best], kind="stable")]
      for i in best:
        alt = tok.token_bytes(int(i))
        entry["top_logprobs"].append({"token": alt.decode("utf-8", "replace"),
                                      "bytes": list(alt), "logprob": float(logprobs[i])})
    return entry

  def _run(self, job: Job) -> None:
    model = self.model
    slot_index = self._slot_for(job.ids)
    self._used[slot_index] = time.perf_counter()
    slot = self._slots[slot_index]
    # No max_tokens: up to the context's end, where the engine stops with "length".
    limit = model.max_seq_len if job.max_tokens is None else job.max_tokens
    want_logprobs = job.top_logprobs is not None
    steps = model.generate_ids(job.ids, max_new_tokens=limit, session=slot,
                               logprobs=want_logprobs, **job.sampling)
    out = TextOut(model.tokenizer, job.stop)
    produced = 0
    reason = "length"
    pending: list[dict[str, Any]] = []  # Logprob entries of tokens not yet posted.
    last = job.submitted
    try:
      for step in steps:
        if job.cancelled.is_set():
          job.post(Cancelled())
          return
        if step.stop_reason is not None:
          reason = step.stop_reason
          break
        produced += 1
        now = time.perf_counter()
        if self.on_token is not None:
          self.on_token(job, now - last)
        last = now
        if want_logprobs:
          pending.append(self._token_entry(step.token_id, step.logprobs, job.top_logprobs))
        text = out.push(step.token_id)
        if text or (pending and not out.stopped):
          job.post(Delta(text, pending))
          pending = []
        if out.stopped:
          break
      tail = out.finish()
      if tail or pending:
        job.post(Delta(tail, pending))
      if out.stopped:
        reason = STOP_STRING
    finally:
      steps.close()  # Stops the generation and stores the slot's cache.
    job.post(Done(FINISH_REASONS.get(reason, reason), len(job.ids), produced,
                  slot.last_reused))


def warm_up(model, stop: threading.Event | None = None) -> float:
  """Compiles the decode step and the prefill of every prompt bucket up to one chunk (16, 32,
  ..., 512 tokens), so no request waits for a compile, and the biased sampling step of
  logit_bias / response_format requests (with the grammar engine's tokenizer); returns the
  seconds spent."""
  from pijax import engine
  from pijax import grammar as grammar_lib
  from pijax.errors import ConfigError
  start = time.perf_counter()
  # Any ids compile the same executables; a vocabulary that cannot spell "Hello" gets token 0.
  ids = model.tokenizer.encode("Hello") or [0]
  for _ in model.generate_ids(ids, max_new_tokens=2):
    pass
  try:  # A json_object grammar: the biased steps, and llguidance's view of the vocabulary.
    json_object = grammar_lib.response_format_grammar(
        model.tokenizer, {"type": "json_object"}, vocab_size=model.config.vocab_size)
  except ConfigError as err:  # No llguidance: such requests get a 400 saying so.
    logging.warning("structured output is off: %s", err)
    json_object = None
  for _ in model.generate_ids(ids, max_new_tokens=2, logit_bias={ids[0]: 0.0},
                             response_format=json_object):
    pass
  n = 2 * engine.MIN_PREFILL_BUCKET
  while n <= min(engine.PREFILL_CHUNK, model.max_seq_len):
    if stop is not None and stop.is_set():
      break
    for _ in model.generate_ids((ids * n)[:n], max_new_tokens=1):
      pass
    n *= 2
  return time.perf_counter() - start
