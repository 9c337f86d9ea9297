"""Continuous batching in `python -m pijax.serve` (`--parallel`), through the official `openai` client.

One server process (default model, host weights, 512-token context, 4 slots, --max_queue=8)
serves every test here. A request's reply in a batch is the reply it gets alone: greedy and
seeded sampling, stop strings, logprobs, logit_bias and response_format included; a client that
leaves frees its slot; more requests than slots wait and all complete. No timing assertions.
"""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import openai
import pytest

pytestmark = pytest.mark.slow

SLOTS = 4


@pytest.fixture(scope="module")
def server():
  from conftest import spawn_server
  yield from spawn_server("--max_seq_len=512", f"--parallel={SLOTS}", "--max_queue=8",
                          "--host_threads=2")


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server["base"] + "/v1", api_key="unused", max_retries=0,
                       timeout=300)


def _metric(server, name: str) -> float:
  for line in httpx.get(server["base"] + "/metrics").text.splitlines():
    if line.startswith(name + " "):
      return float(line.split()[-1])
  raise AssertionError(f"{name} is not in /metrics")


def _generated(server) -> float:
  """Tokens generated so far, cancelled requests included (/metrics)."""
  return (_metric(server, "pijax_time_to_first_token_seconds_count") +
          _metric(server, "pijax_time_per_output_token_seconds_count"))


def _wait_idle(server, timeout: float = 120.0) -> None:
  """Polls /metrics until no request runs (a liveness bound, not a speed check)."""
  deadline = time.time() + timeout
  while _metric(server, "pijax_requests_running") > 0:
    assert time.time() < deadline, "requests still running"
    time.sleep(0.2)


# Each: (route, body): chat or text completions, greedy or seeded, with the extras a batch
# must keep per request.
REQUESTS = [
    ("chat", {"messages": [{"role": "user", "content": "What is the capital of France?"}],
              "max_tokens": 24, "temperature": 0}),
    ("text", {"prompt": "The history of Rome", "max_tokens": 28, "temperature": 0}),
    ("text", {"prompt": "Once upon a time, in a small village by the sea, there lived an old "
                        "fisherman who", "max_tokens": 20, "temperature": 0.9, "seed": 7}),
    ("chat", {"messages": [{"role": "user", "content": "Name three colours."}],
              "max_tokens": 30, "temperature": 0, "stop": [","]}),
    ("chat", {"messages": [{"role": "user", "content": "Count from one to ten."}],
              "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 2}),
    ("chat", {"messages": [{"role": "user", "content": "Describe a cat as JSON."}],
              "max_tokens": 40, "temperature": 0, "response_format": {"type": "json_object"}}),
    ("text", {"prompt": "def fibonacci(n):", "max_tokens": 16, "temperature": 0,
              "logit_bias": {"198": -100}}),
    ("text", {"prompt": "1, 2, 3,", "max_tokens": 16, "temperature": 0.7, "seed": 3,
              "top_k": 20}),
]


def _streamed(client, model, route, body):
  """(text, finish_reason, usage, logprobs) of a streamed request."""
  extra = {k: body[k] for k in ("top_k", "logit_bias") if k in body}
  kwargs = {k: v for k, v in body.items() if k not in extra}
  kwargs["stream_options"] = {"include_usage": True}
  if route == "chat":
    stream = client.chat.completions.create(model=model, stream=True, extra_body=extra,
                                            **kwargs)
  else:
    stream = client.completions.create(model=model, stream=True, extra_body=extra, **kwargs)
  text, finish, usage, logprobs = [], None, None, []
  for chunk in stream:
    if chunk.usage is not None:
      usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
    if not chunk.choices:
      continue
    choice = chunk.choices[0]
    if route == "chat":
      text.append(choice.delta.content or "")
      if choice.logprobs is not None and choice.logprobs.content:
        logprobs += [(e.token, round(e.logprob, 4)) for e in choice.logprobs.content]
    else:
      text.append(choice.text or "")
    finish = choice.finish_reason or finish
  return "".join(text), finish, usage, logprobs


def test_concurrent_streams_equal_each_request_alone(client, server):
  """Eight streamed requests on four slots (the later ones join as slots free up, mid-stream
  of the others): each one's text, finish_reason, usage and logprobs equal its run alone."""
  alone = [_streamed(client, server["model"], route, body) for route, body in REQUESTS]
  with ThreadPoolExecutor(len(REQUESTS)) as pool:
    together = list(pool.map(lambda rb: _streamed(client, server["model"], *rb), REQUESTS))
  for (route, body), a, b in zip(REQUESTS, alone, together):
    assert b == a, (route, body)
  assert alone[3][1] == "stop" and "," not in alone[3][0]  # The stop string held.
  # response_format: a JSON object (whole when it was not cut by max_tokens).
  assert alone[5][0].lstrip().startswith("{")
  if alone[5][1] == "stop":
    json.loads(alone[5][0])
  assert len(alone[4][3]) == alone[4][2][1]  # One logprobs entry per token.
  _wait_idle(server)


def test_a_client_that_disconnects_frees_its_slot(server):
  """Every slot holds a long stream whose client leaves after three chunks: generation of
  all of them stops, no slot stays busy, and a later request completes."""
  before = _generated(server)
  opened = threading.Barrier(SLOTS)

  def leave_early(i):
    body = {"prompt": f"Chapter {i + 1}. The dragon", "max_tokens": 400, "stream": True,
            "temperature": 0}
    with httpx.Client(timeout=120) as c:
      with c.stream("POST", server["base"] + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = []
        for line in r.iter_lines():
          if line:
            lines.append(line)
          if len(lines) == 3:
            break
        opened.wait(timeout=120)  # All slots taken before any client leaves.
    # Leaving the block closes the connection.

  with ThreadPoolExecutor(SLOTS) as pool:
    list(pool.map(leave_early, range(SLOTS)))
  r = httpx.post(server["base"] + "/v1/completions",
                 json={"prompt": "Hello", "max_tokens": 5, "temperature": 0}, timeout=120)
  assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
  _wait_idle(server)
  # The abandoned generations stopped: far fewer than their 4 x 400 tokens were generated.
  assert _generated(server) - before < SLOTS * 100


def test_more_requests_than_slots_all_complete(client, server):
  """Ten non-streamed requests on four slots (six wait in the queue): all answer 200 with the
  text each gets alone."""
  prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(10)]
  ask = lambda p: client.completions.create(  # noqa: E731
      model=server["model"], prompt=p, max_tokens=12, temperature=0)
  alone = [ask(p) for p in prompts[:3]]
  with ThreadPoolExecutor(len(prompts)) as pool:
    together = list(pool.map(ask, prompts))
  for a, b in zip(alone, together):
    assert b.choices[0].text == a.choices[0].text
    assert b.usage.completion_tokens == a.usage.completion_tokens
  assert all(r.choices[0].finish_reason in ("stop", "length") for r in together)
  _wait_idle(server)
  assert _metric(server, "pijax_slots") == SLOTS
  assert _metric(server, "pijax_requests_waiting") == 0


def test_full_queue_is_503_and_the_server_recovers(server):
  """Four long streams fill the slots and eight requests wait (--max_queue=8): the next is
  503 server_busy; after the streams end every queued request completes."""
  release = threading.Event()

  def hold():
    with httpx.Client(timeout=120) as c:
      with c.stream("POST", server["base"] + "/v1/completions",
                    json={"prompt": "Once upon a time", "max_tokens": 480, "stream": True,
                          "temperature": 0}) as r:
        for _ in r.iter_lines():
          if release.is_set():
            return

  holders = [threading.Thread(target=hold) for _ in range(SLOTS)]
  for t in holders:
    t.start()
  deadline = time.time() + 120
  while _metric(server, "pijax_requests_running") < SLOTS:
    assert time.time() < deadline, "the holders did not start"
    time.sleep(0.1)
  clients = [httpx.Client(timeout=120) for _ in range(9)]
  try:
    with ThreadPoolExecutor(8) as pool:
      futures = [pool.submit(c.post, server["base"] + "/v1/completions",
                             json={"prompt": "Hi", "max_tokens": 1}) for c in clients[:8]]
      while _metric(server, "pijax_requests_waiting") < 8:
        assert time.time() < deadline, "the requests did not queue"
        time.sleep(0.1)
      r = clients[8].post(server["base"] + "/v1/completions",
                          json={"prompt": "Hi", "max_tokens": 1})
      release.set()
      statuses = [f.result().status_code for f in futures]
  finally:
    release.set()
    for t in holders:
      t.join()
    for c in clients:
      c.close()
  assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy"
  assert statuses == [200] * 8
  _wait_idle(server)


def test_a_long_prompt_is_prefilled_between_running_streams_tokens(server):
  """A 400-token prompt arrives while a stream runs (--prefill_chunk 128: its prompt takes 4
  passes): the running stream gets chunks between the newcomer's request and the newcomer's
  first token instead of stalling for its whole prefill; both replies equal their runs alone;
  /metrics counts the batched passes (pijax_batch_size)."""
  import os
  path = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data",
                      "wikitext-2-raw", "wiki.test.raw")
  with open(path, encoding="utf-8") as f:
    words = f.read()[20000:40000].split()
  long_prompt = " ".join(words[:300])  # ~400 tokens with SmolLM2's tokenizer.
  running = {"prompt": "The history of the Roman Empire", "max_tokens": 120, "stream": True,
             "temperature": 0, "ignore_eos": True}
  newcomer = {"prompt": long_prompt, "max_tokens": 8, "stream": True, "temperature": 0}

  def stream(body, times, started=None):
    text = []
    with httpx.Client(timeout=300) as c:
      with c.stream("POST", server["base"] + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
          if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
              text.append(chunk["choices"][0]["text"])
              times.append(time.perf_counter())
              if started is not None and len(times) == 3:
                started.set()
    return "".join(text)

  # The batched run comes first: run alone before, the prompt would be in a slot's prefix cache.
  batches_before = _metric(server, "pijax_batch_size_count")
  run_times, new_times, started = [], [], threading.Event()
  with ThreadPoolExecutor(2) as pool:
    first = pool.submit(stream, running, run_times, started)
    assert started.wait(timeout=120)
    sent = time.perf_counter()
    second = pool.submit(stream, newcomer, new_times)
    texts = [first.result(), second.result()]
  reply = httpx.post(server["base"] + "/v1/completions", json={**newcomer, "stream": False},
                     timeout=300).json()
  assert 300 < reply["usage"]["prompt_tokens"] <= 500
  assert texts == [stream(running, []), stream(newcomer, [])]
  during = [t for t in run_times if sent < t < new_times[0]]
  assert len(during) >= 2, (len(during), len(run_times))
  assert _metric(server, "pijax_batch_size_count") > batches_before
  _wait_idle(server)
