"""Soak of `python -m pijax.serve` under faults, on loopback, bounded in requests and time.

  .venv/bin/python scripts/soak.py --spawn --requests 400 --clients 8
  .venv/bin/python scripts/soak.py --base_url http://127.0.0.1:8080 --requests 200

`--clients` threads send `--requests` requests (until `--seconds` have passed) drawn in a fixed
mix (`--seed`): streamed and whole completions and chats, a quarter of the streams dropped by
their client after 1-3 chunks, whole requests cancelled by a client timeout, malformed bodies
(bad JSON, wrong types, out-of-range values, text/plain, an oversized body), prompts longer
than the context, and structured requests (json_object, logprobs, stop strings). Then it checks:
  - no request got a 5xx (but 503 server_busy when the queue is full, counted apart);
  - every well-formed request that was not dropped or cancelled got 200 and a finish_reason,
    every malformed or oversized one a 4xx;
  - the server goes idle: no request running or waiting, no slot held (`pijax_slots_live`);
  - its resident memory (`process_resident_memory_bytes`) grew by at most `--rss_bound_mb`
    from after the warm-up requests to the end;
  - a fixed greedy request answers the same text before and after (no corrupted cache).
With `--overflow` a burst of 2 x (slots + queue) streams then overruns `--max_queue`: the
script reports how many got 200 and 503 (each 503 must carry code server_busy and Retry-After)
and checks that the server is idle again. Prints a table and one JSON line; exit status 1 when
a check failed. BUILD_NOTES.md (issue 31) has the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIKITEXT = os.path.join(ROOT, "..", "shared", "data", "wikitext-2-raw", "wiki.test.raw")
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# The request kinds and their shares of the mix.
MIX = (("stream", 0.30), ("drop", 0.25), ("whole", 0.12), ("cancel", 0.08),
       ("structured", 0.08), ("malformed", 0.12), ("oversized", 0.05))


def _passage_words() -> list[str]:
  with open(WIKITEXT, encoding="utf-8") as f:
    return f.read().split()


def _malformed(rng: random.Random) -> tuple[str, bytes, dict]:
  """(route, body bytes, headers) of one bad request."""
  cases = [
      ("/v1/completions", b'{"prompt": "Hello", "max_tokens": ', {}),  # Cut-off JSON.
      ("/v1/completions", b'["prompt", "Hello"]', {}),
      ("/v1/completions", json.dumps({"max_tokens": 8}).encode(), {}),  # No prompt.
      ("/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": -3}).encode(), {}),
      ("/v1/completions", json.dumps({"prompt": "Hi", "temperature": "hot"}).encode(), {}),
      ("/v1/completions", json.dumps({"prompt": [[1, 2], "x"], "max_tokens": 4}).encode(), {}),
      ("/v1/chat/completions", json.dumps({"messages": [{"role": "wizard", "content": "Hi"}]})
       .encode(), {}),
      ("/v1/chat/completions", json.dumps({"messages": []}).encode(), {}),
      ("/v1/chat/completions", json.dumps({"messages": "Hi"}).encode(), {}),
      ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "Hi"}],
                                           "response_format": {"type": "json_schema",
                                                               "json_schema": {"schema": 7}}})
       .encode(), {}),
      ("/v1/completions", b"prompt=Hello", {"Content-Type": "text/plain"}),
      ("/v1/completions", b"\xff\xfe\x00garbage", {}),
  ]
  if rng.random() < 0.1:  # Now and then a body over the server's 8 MiB limit (413).
    return "/v1/completions", b'{"prompt": "' + b"a" * (9 << 20) + b'"}', {}
  return rng.choice(cases)


class Soak:
  def __init__(self, base: str, args: argparse.Namespace):
    import httpx2 as httpx
    self.httpx = httpx
    self.base = base
    self.args = args
    self.words = _passage_words()
    self.lock = threading.Lock()
    self.counts: dict[str, dict[str, int]] = {}
    self.failures: list[str] = []

  def _count(self, kind: str, outcome: str) -> None:
    with self.lock:
      self.counts.setdefault(kind, {})
      self.counts[kind][outcome] = self.counts[kind].get(outcome, 0) + 1

  def _fail(self, message: str) -> None:
    with self.lock:
      if len(self.failures) < 50:
        self.failures.append(message)

  def metric(self, name: str) -> float:
    for line in self.httpx.get(self.base + "/metrics", timeout=30).text.splitlines():
      if line.startswith(name + " "):
        return float(line.split()[-1])
    raise KeyError(name)

  def _prompt(self, rng: random.Random, words: int) -> str:
    start = rng.randrange(0, len(self.words) - words)
    return " ".join(self.words[start:start + words])

  def _body(self, rng: random.Random, kind: str) -> tuple[str, dict]:
    chat = rng.random() < 0.5
    body: dict = {"max_tokens": rng.randint(4, self.args.max_tokens)}
    if rng.random() < 0.5:
      body.update(temperature=0.8, seed=rng.randrange(1 << 30))
    else:
      body["temperature"] = 0
    text = self._prompt(rng, rng.randint(5, 60))
    if kind == "oversized":  # Over the context: about 1.3 tokens a word.
      text = self._prompt(rng, int(self.args.max_seq_len * 1.2))
    if kind == "structured":
      extra = rng.choice([{"response_format": {"type": "json_object"}},
                          {"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2},
                          {"stop": [".", ","]}])
      chat = chat or "response_format" in extra
      body.update(extra)
    if chat:
      body["messages"] = [{"role": "user", "content": text}]
      return "/v1/chat/completions", body
    body["prompt"] = text
    return "/v1/completions", body

  def one(self, i: int) -> None:
    rng = random.Random(self.args.seed * 1_000_003 + i)
    r = rng.random()
    kind = MIX[-1][0]
    for name, share in MIX:
      if r < share:
        kind = name
        break
      r -= share
    httpx = self.httpx
    try:
      if kind == "malformed":
        route, data, headers = _malformed(rng)
        res = httpx.post(self.base + route, content=data,
                         headers={"Content-Type": "application/json", **headers}, timeout=120)
        self._check_status(kind, res.status_code, want_4xx=True, detail=data[:60])
        return
      route, body = self._body(rng, kind)
      if kind in ("whole", "oversized", "cancel"):
        timeout = httpx.Timeout(120, read=rng.uniform(0.05, 1.5)) if kind == "cancel" else 300
        try:
          res = httpx.post(self.base + route, json=body, timeout=timeout)
        except httpx.TimeoutException:
          self._count(kind, "cancelled by client")
          return
        self._check_status(kind, res.status_code, want_4xx=kind == "oversized",
                           detail=res.text[:200])
        if res.status_code == 200 and not res.json()["choices"][0].get("finish_reason"):
          self._fail(f"{kind}: 200 without a finish_reason")
        return
      body["stream"] = True
      drop_after = rng.randint(1, 3) if kind == "drop" else None
      with httpx.stream("POST", self.base + route, json=body, timeout=300) as res:
        if res.status_code != 200:
          self._check_status(kind, res.status_code, want_4xx=False, detail=res.read()[:200])
          return
        chunks, finish, done = 0, None, False
        for line in res.iter_lines():
          if line == "data: [DONE]":
            done = True
          elif line.startswith("data: {"):
            chunk = json.loads(line[6:])
            if "error" in chunk:
              self._fail(f"{kind}: error event {chunk['error']}")
            for choice in chunk.get("choices", []):
              finish = choice.get("finish_reason") or finish
            chunks += 1
            if drop_after is not None and chunks >= drop_after:
              break  # Leaving the block closes the connection mid-stream.
        if drop_after is not None and not done:
          self._count(kind, "dropped mid-stream")
          return
        if not done or finish is None:
          self._fail(f"{kind}: stream ended without finish_reason/[DONE] ({chunks} chunks)")
        self._count(kind, "200")
    except Exception as err:  # A transport failure on a request we did not cut is a failure.
      self._fail(f"{kind}: {type(err).__name__}: {err}")
      self._count(kind, "transport error")

  def _check_status(self, kind: str, status: int, *, want_4xx: bool, detail=b"") -> None:
    if status == 503:
      self._count(kind, "503")
      return
    self._count(kind, str(status))
    if status >= 500:
      self._fail(f"{kind}: {status} {detail!r}")
    elif want_4xx and not 400 <= status < 500:
      self._fail(f"{kind}: wanted a 4xx, got {status} {detail!r}")
    elif not want_4xx and status != 200:
      self._fail(f"{kind}: wanted 200, got {status} {detail!r}")

  def greedy_text(self) -> str:
    res = self.httpx.post(self.base + "/v1/completions", timeout=300, json={
        "prompt": "The history of the city of York", "max_tokens": 24, "temperature": 0})
    res.raise_for_status()
    return res.json()["choices"][0]["text"]

  def wait_idle(self, timeout: float) -> dict:
    deadline = time.time() + timeout
    while True:
      state = {name: self.metric(name) for name in (
          "pijax_requests_running", "pijax_requests_waiting", "pijax_slots_live")}
      if not any(state.values()) or time.time() > deadline:
        return state
      time.sleep(0.2)

  def overflow(self) -> dict:
    """A burst of 2 x (slots + queue) streams at once: how many got 200 and 503."""
    slots = int(self.metric("pijax_slots"))
    n = 2 * (slots + self.args.max_queue)
    statuses, bad = [], []
    barrier = threading.Barrier(n)

    def burst(i):
      body = {"prompt": self._prompt(random.Random(i), 20), "max_tokens": 16, "stream": True,
              "temperature": 0}
      barrier.wait(timeout=60)
      with self.httpx.stream("POST", self.base + "/v1/completions", json=body,
                             timeout=300) as res:
        if res.status_code == 503:
          err = json.loads(res.read())["error"]
          if err.get("code") != "server_busy" or res.headers.get("Retry-After") is None:
            bad.append(f"503 without server_busy/Retry-After: {err}")
        else:
          for _ in res.iter_lines():
            pass
        statuses.append(res.status_code)

    start = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
      list(pool.map(burst, range(n)))
    wall = time.perf_counter() - start
    for msg in bad[:5]:
      self._fail(f"overflow: {msg}")
    other = [s for s in statuses if s not in (200, 503)]
    if other:
      self._fail(f"overflow: statuses {sorted(set(other))}")
    return {"burst": n, "slots": slots, "max_queue": self.args.max_queue,
            "ok": statuses.count(200), "busy_503": statuses.count(503), "seconds": round(wall, 1)}


def _spawn(args) -> tuple[subprocess.Popen, str, str]:
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  cmd = [sys.executable, "-m", "pijax.serve", f"--model={args.model}", f"--port={port}",
         f"--max_queue={args.max_queue}", f"--parallel={args.parallel}",
         f"--max_seq_len={args.max_seq_len}", f"--host_threads={args.host_threads}"]
  log = tempfile.NamedTemporaryFile("w+", prefix="soak-", suffix=".log", delete=False)
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
  base = f"http://127.0.0.1:{port}"
  import httpx2 as httpx
  deadline = time.time() + 600
  while True:
    try:
      if httpx.get(base + "/health", timeout=5).status_code == 200:
        return proc, base, log.name
    except httpx.TransportError:
      pass
    if proc.poll() is not None or time.time() > deadline:
      proc.kill()
      sys.exit("soak: the server did not start:\n" + open(log.name).read()[-2000:])
    time.sleep(0.3)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--base_url", help="a running server on loopback (http://127.0.0.1:PORT)")
  ap.add_argument("--spawn", action="store_true", help="start pijax.serve here (default model)")
  ap.add_argument("--model", default="default")
  ap.add_argument("--requests", type=int, default=400)
  ap.add_argument("--clients", type=int, default=8)
  ap.add_argument("--seconds", type=float, default=1800, help="stop sending after this long")
  ap.add_argument("--max_tokens", type=int, default=48, help="reply tokens at most (4..N)")
  ap.add_argument("--warmup_requests", type=int, default=16,
                  help="requests before the resident-memory baseline")
  ap.add_argument("--rss_bound_mb", type=float, default=64.0)
  ap.add_argument("--overflow", action="store_true", help="then overrun --max_queue")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--parallel", type=int, default=8, help="with --spawn")
  ap.add_argument("--max_queue", type=int, default=16, help="the server's (--spawn sets it)")
  ap.add_argument("--max_seq_len", type=int, default=512, help="the server's (--spawn sets it)")
  ap.add_argument("--host_threads", type=int, default=2, help="with --spawn")
  args = ap.parse_args()
  for name in ("requests", "clients", "max_tokens", "max_queue", "parallel", "max_seq_len"):
    if getattr(args, name) < (4 if name == "max_tokens" else 1):
      print(f"soak: --{name}={getattr(args, name)} is too small.", file=sys.stderr)
      return 2
  if bool(args.spawn) == bool(args.base_url):
    print("soak: give --spawn or --base_url (one of them).", file=sys.stderr)
    return 2
  proc = None
  if args.spawn:
    proc, base, log = _spawn(args)
  else:
    host = urllib.parse.urlsplit(args.base_url).hostname
    if host not in LOOPBACK:
      print(f"soak: --base_url host {host!r} is not loopback ({', '.join(LOOPBACK)}); this "
            "script only loads a local server.", file=sys.stderr)
      return 2
    base = args.base_url.rstrip("/")
  try:
    soak = Soak(base, args)
    before = soak.greedy_text()
    start = time.perf_counter()
    deadline = time.time() + args.seconds
    n_warm = min(args.warmup_requests, args.requests)
    rss = {}

    def run(indices):
      with ThreadPoolExecutor(args.clients) as pool:
        list(pool.map(lambda i: soak.one(i) if time.time() < deadline else None, indices))

    run(range(n_warm))
    soak.wait_idle(120)
    rss["after_warmup_mb"] = soak.metric("process_resident_memory_bytes") / 2**20
    run(range(n_warm, args.requests))
    idle = soak.wait_idle(120)
    wall = time.perf_counter() - start
    rss["end_mb"] = soak.metric("process_resident_memory_bytes") / 2**20
    if any(idle.values()):
      soak._fail(f"not idle after the soak: {idle}")
    growth = rss["end_mb"] - rss["after_warmup_mb"]
    if growth > args.rss_bound_mb:
      soak._fail(f"resident memory grew {growth:.1f} MB (> {args.rss_bound_mb} MB)")
    after = soak.greedy_text()
    if after != before:
      soak._fail(f"the greedy reply changed: {before!r} -> {after!r}")
    result = {"requests": args.requests, "clients": args.clients, "seconds": round(wall, 1),
              "counts": soak.counts, "idle": idle,
              "rss_mb": {k: round(v, 1) for k, v in rss.items()},
              "rss_growth_mb": round(growth, 1)}
    if args.overflow:
      result["overflow"] = soak.overflow()
      idle = soak.wait_idle(120)
      result["idle_after_overflow"] = idle
      if any(idle.values()):
        soak._fail(f"not idle after the overflow burst: {idle}")
      if soak.greedy_text() != before:
        soak._fail("the greedy reply changed after the overflow burst")
    health = soak.httpx.get(base + "/health", timeout=30).status_code
    result["health"] = health
    if health != 200:
      soak._fail(f"/health answered {health}")
    result["failures"] = soak.failures
    print("| kind | outcomes |")
    print("| --- | --- |")
    for kind, outcomes in sorted(soak.counts.items()):
      print(f"| {kind} | {', '.join(f'{k}: {v}' for k, v in sorted(outcomes.items()))} |")
    print(json.dumps(result))
    for msg in soak.failures:
      print("FAIL", msg, file=sys.stderr)
    return 1 if soak.failures else 0
  finally:
    if proc is not None:
      proc.terminate()
      try:
        proc.wait(timeout=30)
      except subprocess.TimeoutExpired:
        proc.kill()


if __name__ == "__main__":
  sys.exit(main())
