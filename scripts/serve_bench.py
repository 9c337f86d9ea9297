"""Load test of `python -m pijax.serve` on loopback: vLLM-style TTFT / TPOT / ITL and requests/s.

  .venv/bin/python scripts/serve_bench.py --spawn --concurrency 1,8 --requests 32
  .venv/bin/python scripts/serve_bench.py --base_url http://127.0.0.1:8080 --concurrency 8

Each request is a streamed /v1/completions call (temperature 0, `--max_tokens` tokens at most)
on a WikiText-2 passage of about `--prompt_tokens` tokens (../shared/data, a different passage
per request so the prefix cache does not help). Metrics as vLLM's benchmark_serving defines
them:
  TTFT  time from sending the request to the first generated text (ms);
  TPOT  (latency - TTFT) / (completion tokens - 1) per request (ms);
  ITL   time between consecutive streamed chunks, over all requests (ms);
  req/s completed requests / wall time; out tok/s generated tokens / wall time.
With --spawn the script starts the server itself (default model, --host_threads as given) on a
free port and stops it at the end.

`--long_prompt_tokens N` measures instead what a long prompt does to running streams: per
concurrency c, c streams run (`--max_tokens` each, ignore_eos), and once each has streamed a few
chunks one request with a ~N-token prompt arrives; it prints the newcomer's TTFT, the longest
gap between two chunks of a running stream while the newcomer was being prefilled, and the
running streams' median ITL outside that window (`--prefill_chunk` is passed to a spawned server).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIKITEXT = os.path.join(ROOT, "..", "shared", "data", "wikitext-2-raw", "wiki.test.raw")


def _passages(n: int, words: int) -> list[str]:
  with open(WIKITEXT, encoding="utf-8") as f:
    text = " ".join(line.strip() for line in f if line.strip() and not line.startswith(" ="))
  toks = text.split()
  return [" ".join(toks[i * words:(i + 1) * words]) for i in range(n)]


async def _one(client, base: str, prompt: str, max_tokens: int) -> dict:
  body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
          "stream_options": {"include_usage": True}}
  start = time.perf_counter()
  arrivals = []
  usage = None
  async with client.stream("POST", base + "/v1/completions", json=body) as r:
    if r.status_code != 200:
      raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()}")
    async for line in r.aiter_lines():
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      chunk = json.loads(line[6:])
      if chunk.get("usage"):
        usage = chunk["usage"]
      if chunk["choices"] and chunk["choices"][0]["text"]:
        arrivals.append(time.perf_counter())
  end = time.perf_counter()
  n = usage["completion_tokens"] if usage else len(arrivals)
  ttft = arrivals[0] - start if arrivals else end - start
  return {"ttft": ttft, "latency": end - start, "tokens": n,
          "prompt_tokens": usage["prompt_tokens"] if usage else 0,
          "tpot": (end - start - ttft) / (n - 1) if n > 1 else None,
          "itl": list(np.diff(arrivals))}


async def _run(base: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
  import httpx2 as httpx
  sem = asyncio.Semaphore(concurrency)
  async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as client:
    async def task(p):
      async with sem:
        return await _one(client, base, p, max_tokens)
    start = time.perf_counter()
    results = await asyncio.gather(*(task(p) for p in prompts))
    wall = time.perf_counter() - start
  return {"results": results, "wall": wall}


async def _gap_run(base: str, shorts: list[str], long_prompt: str, max_tokens: int) -> dict:
  """c running streams, then one long prompt: its TTFT and the running streams' gaps."""
  import httpx2 as httpx
  c = len(shorts)
  started = asyncio.Event()
  ready = [0]

  async def stream(client, prompt, n, times, signal):
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True}
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
      async for line in r.aiter_lines():
        if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
          times.append(time.perf_counter())
          if signal and len(times) == 3:
            ready[0] += 1
            if ready[0] == c:
              started.set()

  async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as client:
    runs = [[] for _ in shorts]
    tasks = [asyncio.create_task(stream(client, p, max_tokens, t, True))
             for p, t in zip(shorts, runs)]
    await started.wait()
    sent, new = time.perf_counter(), []
    await stream(client, long_prompt, 4, new, False)
    await asyncio.gather(*tasks)
  first = new[0]
  inside, outside = [], []
  for times in runs:
    for a, b in zip(times, times[1:]):
      (inside if b > sent and a < first else outside).append(b - a)
  return {"ttft": first - sent, "max_gap": max(inside) if inside else float("nan"),
          "itl": float(np.median(outside)) if outside else float("nan"),
          "finished_before": sum(1 for t in runs if t[-1] < first)}


def _pct(values, q) -> float:
  return float(np.percentile(np.asarray(values) * 1e3, q)) if len(values) else float("nan")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--base_url", default=None)
  ap.add_argument("--spawn", action="store_true", help="start pijax.serve here")
  ap.add_argument("--model", default="default")
  ap.add_argument("--host_threads", type=int, default=None)
  ap.add_argument("--concurrency", default="1,8")
  ap.add_argument("--requests", type=int, default=32)
  ap.add_argument("--max_tokens", type=int, default=128)
  ap.add_argument("--prompt_tokens", type=int, default=128)
  ap.add_argument("--long_prompt_tokens", type=int, default=0,
                  help="measure running streams' gaps while a prompt this long arrives")
  ap.add_argument("--prefill_chunk", type=int, default=None, help="passed to --spawn's server")
  args = ap.parse_args()
  proc = None
  base = args.base_url
  if args.spawn:
    port = _free_port()
    cmd = [sys.executable, "-m", "pijax.serve", f"--model={args.model}", f"--port={port}",
           f"--max_queue={max(16, args.requests)}"]
    if args.host_threads:
      cmd.append(f"--host_threads={args.host_threads}")
    if args.prefill_chunk:
      cmd.append(f"--prefill_chunk={args.prefill_chunk}")
    import tempfile
    log = tempfile.NamedTemporaryFile("w+", prefix="serve_bench-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    import httpx2 as httpx
    while True:
      try:
        if httpx.get(base + "/health").status_code == 200:
          break
      except httpx.TransportError:
        pass
      if proc.poll() is not None:
        sys.exit("the server exited: " + open(log.name).read())
      time.sleep(0.2)
  if base is None:
    sys.exit("give --base_url or --spawn")
  try:
    # Words per passage: about 0.75 words per token on WikiText-2 with SmolLM2's tokenizer.
    words = max(1, int(args.prompt_tokens * 0.75))
    levels = [int(c) for c in args.concurrency.split(",")]
    all_prompts = _passages(args.requests * (len(levels) + 1), words)
    asyncio.run(_run(base, all_prompts[:2], 1, 8))  # Warm-up: compile the prompt bucket.
    if args.long_prompt_tokens:
      long_words = int(args.long_prompt_tokens * 0.75)
      print("| running streams | newcomer prompt words | newcomer TTFT ms | longest gap ms "
            "| ITL p50 ms (outside) |")
      print("| ---: | ---: | ---: | ---: | ---: |")
      for i, c in enumerate(levels):
        long_prompt = _passages(len(levels) + 1, long_words)[i + 1]  # A new one each time.
        out = asyncio.run(_gap_run(base, all_prompts[i * c:(i + 1) * c], long_prompt,
                                   args.max_tokens))
        print(f"| {c} | {long_words} | {out['ttft'] * 1e3:.0f} | {out['max_gap'] * 1e3:.0f} "
              f"| {out['itl'] * 1e3:.1f} |", flush=True)
      return
    print(f"| clients | requests | req/s | out tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
          f"| ITL p50 / p99 ms | prompt / output tokens (mean) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for i, c in enumerate(levels):
      prompts = all_prompts[(i + 1) * args.requests:(i + 2) * args.requests]
      out = asyncio.run(_run(base, prompts, c, args.max_tokens))
      res, wall = out["results"], out["wall"]
      ttft = [r["ttft"] for r in res]
      tpot = [r["tpot"] for r in res if r["tpot"] is not None]
      itl = [x for r in res for x in r["itl"]]
      toks = sum(r["tokens"] for r in res)
      print(f"| {c} | {len(res)} | {len(res) / wall:.2f} | {toks / wall:.1f} "
            f"| {_pct(ttft, 50):.0f} / {_pct(ttft, 99):.0f} "
            f"| {_pct(tpot, 50):.2f} / {_pct(tpot, 99):.2f} "
            f"| {_pct(itl, 50):.2f} / {_pct(itl, 99):.2f} "
            f"| {np.mean([r['prompt_tokens'] for r in res]):.0f} / {toks / len(res):.0f} |",
            flush=True)
  finally:
    if proc is not None:
      proc.terminate()
      proc.wait(timeout=30)


if __name__ == "__main__":
  main()
