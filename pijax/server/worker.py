"""One generation worker: a FIFO of jobs, up to `parallel` of them decoded together.

The HTTP handlers (asyncio) tokenize a request, submit a `Job` and read its events; the worker
thread runs the model and posts events back to the handler's event loop. The queue is bounded:
`submit` raises `QueueFull` when `max_queue` jobs already wait for a slot.

Continuous batching (a model on host weights, the CPU default): one `pijax.batching.
BatchGenerator` of `parallel` slots. Between two decode steps, queued jobs join in FIFO order
while slots are free; every step then decodes one token of every running job and feeds up to
`prefill_tokens` tokens of the newcomers' prompts, in one host pass (chunked prefill: a long
prompt delays the running streams by one chunk a step, not by its whole prefill), and each
job's text streams as its tokens come. A job leaves when it stops (end of sequence, max_tokens, a stop string) or when its
client went away (`Job.cancel`: its slot is freed before the next step). Every job is batched:
logprobs, logit_bias and response_format are per sequence in the generator. Each slot keeps the
keys/values of its last job, and a newcomer takes the free slot sharing the longest prefix with
its prompt (a conversation's next turn prefills only its new tokens; llama-server's
`cache_prompt`). A job's tokens are those of its run alone (greedy; seeded sampling).

Other models (XLA / device placements, sparse modes) run one job at a time through
`Model.generate_ids`, with up to `cache_slots` `pijax.session.Session`s kept for prefix reuse.
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
    ignore_eos: end-of-sequence tokens do not end the reply (llama.cpp's extra; benchmarks).
      Honoured by the batched worker only.
  """

  def __init__(self, ids: list[int], *, max_tokens: int | None, sampling: dict[str, Any],
               stop: list[str], top_logprobs: int | None, ignore_eos: bool = False,
               loop: asyncio.AbstractEventLoop | None = None):
    self.ids = ids
    self.ignore_eos = bool(ignore_eos)
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


class _Reply:
  """Turns one job's token events into Delta / Done events (stop strings, logprobs, usage)."""

  def __init__(self, worker: "Worker", job: Job):
    self.worker = worker
    self.job = job
    self.out = TextOut(worker.model.tokenizer, job.stop)
    self.produced = 0
    self.pending: list[dict[str, Any]] = []  # Logprob entries of tokens not yet posted.
    self.last = job.submitted  # When its previous token came (seconds, perf_counter).
    self.cached_tokens = 0  # Prompt tokens taken from a cache (usage's cached_tokens).

  def feed(self, steps) -> bool:
    """Posts what `steps` (TokenSteps) make of the reply; True once the job is done (its Done
    posted: a stop reason came, or a stop string matched)."""
    job = self.job
    for step in steps:
      if step.stop_reason is not None:
        return self.finish(step.stop_reason)
      self.produced += 1
      now = time.perf_counter()
      if self.worker.on_token is not None:
        self.worker.on_token(job, now - self.last)
      self.last = now
      if job.top_logprobs is not None:
        self.pending.append(self.worker._token_entry(step.token_id, step.logprobs,
                                                     job.top_logprobs))
      text = self.out.push(step.token_id)
      if text or (self.pending and not self.out.stopped):
        job.post(Delta(text, self.pending))
        self.pending = []
      if self.out.stopped:
        return self.finish(STOP_STRING)
    return False

  def finish(self, reason: str) -> bool:
    """Posts the held-back text and Done; returns True."""
    tail = self.out.finish()
    if tail or self.pending:
      self.job.post(Delta(tail, self.pending))
      self.pending = []
    if self.out.stopped:
      reason = STOP_STRING
    self.job.post(Done(FINISH_REASONS.get(reason, reason), len(self.job.ids), self.produced,
                       self.cached_tokens))
    return True


class Worker:
  """Runs jobs on `model` in FIFO order in one daemon thread, `parallel` at once when batched.

  Args:
    model: a loaded `pijax.engine.Model`.
    max_queue: jobs that may wait for a free slot at most; more -> `QueueFull`.
    cache_slots: KV caches kept for prefix reuse by the one-at-a-time path (each max_seq_len
      tokens of keys and values); the batched path reuses its own slots.
    parallel: jobs decoded together (slots of the batch's KV cache: parallel x max_seq_len
      tokens of host RAM) on a model on host weights; others run one at a time.
    prefill_tokens: newcomers' prompt tokens fed per decode step while others stream (the
      batched path; `pijax.batching.BatchGenerator`).
    on_token: optional callback(job, seconds since the job's previous token or its start).
    on_step: optional callback(jobs in the pass) before each batched pass.
  """

  def __init__(self, model, *, max_queue: int = 16, cache_slots: int = 2, parallel: int = 8,
               prefill_tokens: int = 128,
               on_token: Callable[[Job, float], None] | None = None,
               on_step: Callable[[int], None] | None = None):
    from pijax.session import Session
    self.model = model
    self.max_queue = int(max_queue)
    self._queue: collections.deque[Job] = collections.deque()
    self._cond = threading.Condition()
    self._closing = False
    self._batch = None
    if model.backend.name == "host":  # Continuous batching needs the host decoder.
      from pijax.batching import BatchGenerator
      self._batch = BatchGenerator(model, int(parallel), prefill_tokens)
    self.parallel = self._batch.max_batch if self._batch is not None else 1
    self._slots = [Session(model) for _ in range(max(1, int(cache_slots)))]
    self._used = [0.0] * len(self._slots)
    self.on_token = on_token
    self.on_step = on_step
    self._running: dict[int, Job] = {}  # slot (0 on the one-at-a-time path) -> its job
    self._thread = threading.Thread(target=self._loop, name="pijax-worker", daemon=True)
    self._thread.start()

  @property
  def running(self) -> int:
    """Jobs generating now (slots busy)."""
    with self._cond:
      return len(self._running)

  @property
  def slots_live(self) -> int:
    """Slots the batch generator holds (decoding or being prefilled); the one-at-a-time path:
    jobs running. 0 when idle (a slot held then is a leak)."""
    if self._batch is None:
      return self.running
    return self._batch.n_live

  @property
  def waiting(self) -> int:
    """Jobs queued for a slot (cancelled ones and ones about to start not counted)."""
    with self._cond:
      return self._waiting_locked()

  def _waiting_locked(self) -> int:
    live = sum(1 for job in self._queue if not job.cancelled.is_set())
    # A job queued while a slot is free starts at once: it does not wait.
    return max(0, live - (self.parallel - len(self._running)))

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
      jobs = list(self._queue) + list(self._running.values())
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
    if self._batch is not None:
      self._loop_batched()
      return
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
        self._running[0] = job
      try:
        self._run(job)
      except PijaxError as err:
        job.post(Failed(400, str(err), "invalid_request_error"))
      except Exception as err:  # One request's failure must not stop the worker.
        logging.exception("generation failed")
        job.post(Failed(500, f"generation failed: {type(err).__name__}: {err}"))
      finally:
        with self._cond:
          self._running.clear()

  def _loop_batched(self) -> None:
    """Admits queued jobs into free slots, then runs one decode step of all; until closed."""
    batch = self._batch
    replies: dict[int, _Reply] = {}  # slot -> its job's reply
    while True:
      with self._cond:
        while not self._queue and not replies and not self._closing:
          self._cond.wait()
        if self._closing:
          break
        newcomers = []
        while self._queue and batch.free_slots > len(newcomers):
          job = self._queue.popleft()
          if job.cancelled.is_set():
            job.post(Cancelled())
          else:
            newcomers.append(job)
      for job in newcomers:
        self._join(job, replies)
      for slot, reply in list(replies.items()):  # Clients gone: their slots are free now.
        if reply.job.cancelled.is_set():
          batch.cancel(slot)
          self._leave(slot, replies)
          reply.job.post(Cancelled())
      if not batch.live:
        continue
      try:
        if self.on_step is not None:
          self.on_step(len(replies))
        events = batch.step()
      except Exception as err:  # A failed pass: its jobs fail, the worker goes on.
        logging.exception("batched decode step failed")
        for slot in list(replies):
          batch.cancel(slot)
          replies[slot].job.post(Failed(500, f"generation failed: {type(err).__name__}: {err}"))
          self._leave(slot, replies)
        continue
      for slot, steps in events.items():
        if slot in replies and replies[slot].feed(steps):
          batch.cancel(slot)  # A stop string ended it (a no-op when the generator did).
          self._leave(slot, replies)
    for slot in list(replies):  # Closing: shutdown() already told their clients.
      batch.cancel(slot)

  def _join(self, job: Job, replies: dict[int, "_Reply"]) -> None:
    """Gives a job a free slot (its prompt is fed by the next steps) or posts its failure."""
    limit = self.model.max_seq_len if job.max_tokens is None else job.max_tokens
    reply = _Reply(self, job)
    try:
      slot, _, steps = self._batch.add(job.ids, max_new_tokens=limit, ignore_eos=job.ignore_eos,
                                       logprobs=job.top_logprobs is not None, prefill=False,
                                       **job.sampling)
    except PijaxError as err:
      job.post(Failed(400, str(err), "invalid_request_error"))
      return
    except Exception as err:  # One request's failure must not stop the worker.
      logging.exception("prefill failed")
      job.post(Failed(500, f"generation failed: {type(err).__name__}: {err}"))
      return
    reply.cached_tokens = self._batch.last_reused
    if reply.feed(steps):
      self._batch.cancel(slot)  # Ended by its first token (a no-op when the generator did).
      return
    with self._cond:
      self._running[slot] = job
    replies[slot] = reply

  def _leave(self, slot: int, replies: dict[int, "_Reply"]) -> None:
    replies.pop(slot, None)
    with self._cond:
      self._running.pop(slot, None)

  def _slot_for(self, ids: list[int]) -> int:
    best = max(range(len(self._slots)), key=lambda i: (self._slots[i].reusable(ids),
                                                       -self._used[i]))
    if self._slots[best].reusable(ids) == 0:
      best = min(range(len(self._slots)), key=lambda i: self._used[i])
    return best

  def _token_entry(self, token_id: int, logprobs: np.ndarray, top: int) -> dict[str, Any]:
    """One token's logprobs entry (OpenAI's shape) from its f32[vocab] log-probabilities."""
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
    """One job alone through `Model.generate_ids` (models off the host decoder)."""
    model = self.model
    slot_index = self._slot_for(job.ids)
    self._used[slot_index] = time.perf_counter()
    slot = self._slots[slot_index]
    # No max_tokens: up to the context's end, where the engine stops with "length".
    limit = model.max_seq_len if job.max_tokens is None else job.max_tokens
    steps = model.generate_ids(job.ids, max_new_tokens=limit, session=slot,
                               logprobs=job.top_logprobs is not None, **job.sampling)
    reply = _Reply(self, job)
    try:
      for step in steps:
        if job.cancelled.is_set():
          job.post(Cancelled())
          return
        reply.cached_tokens = slot.last_reused
        if reply.feed([step]):
          return
      reply.finish("length")
    finally:
      steps.close()  # Stops the generation and stores the slot's cache.


def warm_up(model, stop: threading.Event | None = None) -> float:
  """Compiles the decode step and the prefill of every prompt bucket up to one chunk (16, 32,
  ..., 512 tokens), so no request waits for a compile, and the biased sampling step of
  logit_bias / response_format requests (with the grammar engine's tokenizer); returns the
  seconds spent."""
  from pijax import engine
  from pijax import grammar as grammar_lib
  from pijax.errors import ConfigError, GrammarError
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
  try:
    for _ in model.generate_ids(ids, max_new_tokens=2, logit_bias={ids[0]: 0.0},
                               response_format=json_object):
      pass
  except GrammarError as err:  # A vocabulary that cannot spell JSON: the bias alone compiles.
    logging.warning("warm-up: %s; structured output will fail on this vocabulary", err)
    for _ in model.generate_ids(ids, max_new_tokens=2, logit_bias={ids[0]: 0.0}):
      pass
  n = 2 * engine.MIN_PREFILL_BUCKET
  while n <= min(engine.PREFILL_CHUNK, model.max_seq_len):
    if stop is not None and stop.is_set():
      break
    for _ in model.generate_ids((ids * n)[:n], max_new_tokens=1):
      pass
    n *= 2
  return time.perf_counter() - start
