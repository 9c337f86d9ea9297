"""Prometheus metrics of the server (prometheus_client, one registry per server).

Counters: prompt tokens, cached prompt tokens, generated tokens, requests by finish reason,
rejected requests. Histograms (seconds): request latency, time to first token, time per output
token; and the batch size (requests in each batched host pass). Gauges: requests running
(slots busy), requests waiting, slots (--parallel), slots the batch generator holds (decoding
or being prefilled; 0 when idle: what a soak checks for leaks), and the process's resident
memory (prometheus_client's process collector: process_resident_memory_bytes). Gauges: requests running (slots busy: the batch size of the next decode step), requests
waiting, and slots (requests decoded together at most, --parallel). Names follow vLLM's and llama-server's metrics.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                               generate_latest)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class Metrics:
  """The server's counters; the worker thread and the event loop both record into it."""

  def __init__(self):
    self.registry = CollectorRegistry()
    r = self.registry
    self.prompt_tokens = Counter("pijax_prompt_tokens", "Prompt tokens received.", registry=r)
    self.cached_tokens = Counter("pijax_prompt_tokens_cached",
                                 "Prompt tokens taken from a cached prefix.", registry=r)
    self.generation_tokens = Counter("pijax_generation_tokens", "Tokens generated.",
                                     registry=r)
    self.requests = Counter("pijax_requests", "Finished requests by finish reason.",
                            ["finish_reason"], registry=r)
    self.rejected_requests = Counter("pijax_requests_rejected",
                                     "Requests refused because the queue was full.", registry=r)
    self.latency = Histogram("pijax_request_latency_seconds",
                             "Seconds from submission to the last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
    self.ttft = Histogram("pijax_time_to_first_token_seconds",
                          "Seconds from submission to the first generated token.",
                          buckets=_TOKEN_BUCKETS + (5.12, 10.24, 20.48), registry=r)
    self.tpot = Histogram("pijax_time_per_output_token_seconds",
                          "Seconds between consecutive generated tokens.",
                          buckets=_TOKEN_BUCKETS, registry=r)
    self.batch_size = Histogram("pijax_batch_size",
                                "Requests in each batched pass (decoding or being prefilled).",
                                buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
    self.running = Gauge("pijax_requests_running", "Requests generating now.", registry=r)
    self.waiting = Gauge("pijax_requests_waiting", "Requests waiting in the queue.",
                         registry=r)
    self.slots = Gauge("pijax_slots", "Requests decoded together at most (--parallel).",
                       registry=r)
    self.slots_live = Gauge("pijax_slots_live", "Slots the batch generator holds (a request "
                            "decoding or being prefilled).", registry=r)
    ProcessCollector(registry=r)  # process_resident_memory_bytes, CPU seconds, open fds.
    self._first = set()
    self._lock = threading.Lock()

  def started(self, job, prompt_tokens: int) -> None:
    self.prompt_tokens.inc(prompt_tokens)

  def rejected(self) -> None:
    self.rejected_requests.inc()

  def on_token(self, job, seconds: float) -> None:
    """Called by the worker per generated token: the gap since the job's previous token
    (the first gap, from submission, is the time to first token)."""
    with self._lock:
      first = id(job) not in self._first
      if first:
        self._first.add(id(job))
    (self.ttft if first else self.tpot).observe(seconds)

  def finished(self, job, finish_reason: str, completion_tokens: int = 0,
               cached_tokens: int = 0) -> None:
    with self._lock:
      self._first.discard(id(job))
    self.requests.labels(finish_reason=finish_reason).inc()
    self.generation_tokens.inc(completion_tokens)
    self.cached_tokens.inc(cached_tokens)
    if finish_reason not in ("error", "cancelled"):
      self.latency.observe(time.perf_counter() - job.submitted)

  def render(self, *, waiting: int, running: int, slots: int = 0,
             slots_live: int = 0) -> tuple[bytes, str]:
    """(Prometheus text exposition, its content type)."""
    self.slots_live.set(slots_live)
    self.waiting.set(waiting)
    self.running.set(running)
    self.slots.set(slots)
    return generate_latest(self.registry), CONTENT_TYPE_LATEST
