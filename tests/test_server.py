"""The OpenAI-compatible server (`python -m pijax.serve`) through the official `openai` client.

One server process (default model, host weights, 512-token context, --max_queue=8) serves
every test here (the `server` fixture). Greedy replies are checked against transformers'
greedy decoding of the same prompt ids (the oracle), up to its first near-tie.
"""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import openai
import pytest

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write a very long story about a dragon and a knight."}]


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server["base"] + "/v1", api_key="unused", max_retries=0,
                       timeout=120)


def _sse(server, path, body):
  """Raw SSE lines ("data: ...") of a streamed request."""
  with httpx.Client(timeout=120) as c:
    with c.stream("POST", server["base"] + path, json=body) as r:
      assert r.status_code == 200
      assert r.headers["content-type"].startswith("text/event-stream")
      return [line for line in r.iter_lines() if line]


def _tokens_seen(server) -> float:
  """Tokens the worker has generated so far, cancelled requests included (/metrics)."""
  text = httpx.get(server["base"] + "/metrics").text
  total = 0.0
  for line in text.splitlines():
    if line.startswith(("pijax_time_to_first_token_seconds_count",
                        "pijax_time_per_output_token_seconds_count")):
      total += float(line.split()[-1])
  return total


def _hold_worker(server, max_tokens):
  """Starts a long streamed completion that keeps the worker busy until the returned event is
  set; returns (event, thread)."""
  release = threading.Event()

  def hold():
    with httpx.Client(timeout=60) as c:
      with c.stream("POST", server["base"] + "/v1/completions",
                    json={"prompt": "Once upon a time", "max_tokens": max_tokens,
                          "stream": True, "temperature": 0}) as r:
        for _ in r.iter_lines():
          if release.is_set():
            return

  thread = threading.Thread(target=hold)
  thread.start()
  return release, thread


def _hf_ids(hf_tokenizer, messages):
  ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
  if isinstance(ids, dict) or hasattr(ids, "input_ids"):
    ids = ids["input_ids"]
  return list(ids)


def _check_against_oracle(hf_model, hf_tokenizer, prompt_ids, text):
  from test_model import _hf_greedy
  ref, ambiguous_at = _hf_greedy(hf_model, prompt_ids, 24)
  got = hf_tokenizer.encode(text, add_special_tokens=False)
  n = min(ambiguous_at, len(got), 24) - 1  # The last token may re-tokenize with what follows.
  assert n >= 4, (ambiguous_at, got)
  assert got[:n] == ref[:n]


def test_health_was_503_while_loading_then_ok(server):
  statuses = [s for s, _ in server["health"]]
  assert statuses[-1] == 200 and server["health"][-1][1] == {"status": "ok"}
  loading = [body for s, body in server["health"] if s == 503]
  assert loading, "never saw the loading state"
  assert set(loading[0]["error"]) == {"message", "type", "param", "code"}


def test_models_lists_the_served_model(client, server):
  models = client.models.list().data
  assert [m.id for m in models] == [server["model"]] == ["SmolLM2-135M-Instruct.Q4_1"]


def test_chat_greedy_matches_transformers(client, server, hf_model, hf_tokenizer):
  r = client.chat.completions.create(model=server["model"], messages=QUESTION, temperature=0,
                                     max_tokens=24)
  assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
  choice = r.choices[0]
  assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
  assert "Paris" in choice.message.content
  ids = _hf_ids(hf_tokenizer, QUESTION)
  assert r.usage.prompt_tokens == len(ids)
  assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
  _check_against_oracle(hf_model, hf_tokenizer, ids, choice.message.content)


def test_chat_stream_chunks_and_usage(client, server):
  kw = dict(model=server["model"], messages=STORY, temperature=0.8, top_p=0.95, seed=7,
            max_tokens=40)
  whole = client.chat.completions.create(**kw).choices[0].message.content
  chunks = list(client.chat.completions.create(**kw, stream=True,
                                               stream_options={"include_usage": True}))
  assert chunks[0].choices[0].delta.role == "assistant"
  assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
  assert len({c.created for c in chunks}) == 1
  assert all(c.object == "chat.completion.chunk" for c in chunks)
  finish = chunks[-2]
  assert finish.choices[0].finish_reason == "length" and not finish.choices[0].delta.content
  assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
  usage = chunks[-1]
  assert usage.choices == [] and usage.usage.completion_tokens == 40
  assert all(c.usage is None for c in chunks[:-1])
  streamed = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
  assert streamed == whole and len(whole) > 20


def test_stream_ends_with_done_and_no_usage_unless_asked(server):
  lines = _sse(server, "/v1/chat/completions",
               {"messages": QUESTION, "stream": True, "max_tokens": 5, "temperature": 0})
  assert lines[-1] == "data: [DONE]"
  bodies = [json.loads(line[6:]) for line in lines[:-1]]
  assert all("usage" not in b for b in bodies)
  assert bodies[-1]["choices"][0]["delta"] == {}
  assert bodies[-1]["choices"][0]["finish_reason"] is not None


def test_completions_text_and_token_ids(client, server, hf_model, hf_tokenizer):
  prompt = "The capital of France is"
  r = client.completions.create(model=server["model"], prompt=prompt, temperature=0,
                                max_tokens=16)
  assert r.id.startswith("cmpl-") and r.object == "text_completion"
  ids = hf_tokenizer.encode(prompt)
  _check_against_oracle(hf_model, hf_tokenizer, ids, r.choices[0].text)
  by_ids = client.completions.create(model=server["model"], prompt=ids, temperature=0,
                                     max_tokens=16)
  assert by_ids.choices[0].text == r.choices[0].text
  chunks = list(client.completions.create(model=server["model"], prompt=prompt, temperature=0,
                                          max_tokens=16, stream=True))
  assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
  assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def _span_stop(client, server):
  """A stop string made of the end of one streamed token and the start of the next."""
  chunks = list(client.completions.create(model=server["model"], prompt="Once upon a time",
                                          temperature=0, max_tokens=40, stream=True))
  pieces = [c.choices[0].text for c in chunks if c.choices[0].text]
  full = "".join(pieces)
  for i in range(4, len(pieces) - 1):
    a, b = pieces[i], pieces[i + 1]
    if len(a) >= 2 and len(b) >= 2:
      stop = a[-2:] + b[:2]
      return full, stop, full[:full.find(stop)]
  raise AssertionError(f"no two adjacent multi-character pieces in {pieces}")


def test_stop_string_spanning_two_tokens(client, server):
  full, stop, expected = _span_stop(client, server)
  kw = dict(model=server["model"], prompt="Once upon a time", temperature=0, max_tokens=40,
            stop=["zzzz-never", stop])
  r = client.completions.create(**kw)
  assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
  chunks = list(client.completions.create(**kw, stream=True))
  texts = [c.choices[0].text for c in chunks]
  assert "".join(texts) == expected
  assert chunks[-1].choices[0].finish_reason == "stop"
  # Chat: the same rule through /v1/chat/completions, streamed and not.
  chat = client.chat.completions.create(model=server["model"], messages=STORY, temperature=0,
                                        max_tokens=30).choices[0].message.content
  stop = chat[10:14]
  expected = chat[:chat.find(stop)]
  r = client.chat.completions.create(model=server["model"], messages=STORY, temperature=0,
                                     max_tokens=30, stop=stop)
  assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
  chunks = list(client.chat.completions.create(model=server["model"], messages=STORY,
                                               temperature=0, max_tokens=30, stop=stop,
                                               stream=True))
  assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected


@pytest.mark.parametrize("change,param", [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.1}, "top_p"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"n": 2}, "n"),
    ({"model": "gpt-4o"}, "model"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"top_logprobs": 3}, None),
])
def test_bad_chat_requests_are_400(client, server, change, param):
  kw = dict(model=server["model"], messages=QUESTION, max_tokens=4)
  kw.update(change)
  with pytest.raises(openai.BadRequestError) as err:
    client.chat.completions.create(**kw)
  body = err.value.body
  assert set(body) == {"message", "type", "param", "code"}
  assert body["type"] == "invalid_request_error" and body["message"]
  if param is not None:
    assert body["param"] == param
  if "model" in change:
    assert body["code"] == "model_not_found"


def test_unknown_fields_are_ignored(server):
  r = httpx.post(server["base"] + "/v1/chat/completions",
                 json={"messages": QUESTION, "max_tokens": 3, "temperature": 0,
                       "some_future_field": {"x": 1}, "tools_choice_v9": None})
  assert r.status_code == 200, r.text


def test_malformed_json_is_400(server):
  r = httpx.post(server["base"] + "/v1/chat/completions", content=b"{not json",
                 headers={"content-type": "application/json"})
  assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_context_overflow_is_400_naming_both_counts(client, server):
  long = [{"role": "user", "content": "word " * 700}]
  with pytest.raises(openai.BadRequestError) as err:
    client.chat.completions.create(model=server["model"], messages=long, max_tokens=4)
  body = err.value.body
  assert body["code"] == "context_length_exceeded"
  assert "512" in body["message"]
  n = int(body["message"].split("resulted in ")[1].split()[0])
  assert n > 512
  with pytest.raises(openai.BadRequestError) as err:
    client.completions.create(model=server["model"], prompt="word " * 700, max_tokens=4)
  assert err.value.body["code"] == "context_length_exceeded"


def test_prompt_plus_max_tokens_overflow_stops_with_length(client, server):
  prompt = "word " * 495
  r = client.completions.create(model=server["model"], prompt=prompt, max_tokens=200,
                                temperature=0)
  assert r.choices[0].finish_reason == "length"
  assert r.usage.prompt_tokens + r.usage.completion_tokens <= 512 + 1
  assert 0 < r.usage.completion_tokens < 200


def test_eight_concurrent_clients(client, server):
  prompts = [f"Count from {i} to {i + 5}:" for i in range(8)]
  expected = [client.completions.create(model=server["model"], prompt=p, temperature=0,
                                        max_tokens=12).choices[0].text for p in prompts]

  def ask(p):
    return client.completions.create(model=server["model"], prompt=p, temperature=0,
                                     max_tokens=12).choices[0].text

  with ThreadPoolExecutor(8) as pool:
    got = list(pool.map(ask, prompts))
  assert got == expected


def test_streaming_client_that_disconnects_frees_the_worker(server):
  before = _tokens_seen(server)
  body = {"messages": STORY, "stream": True, "max_tokens": 400, "temperature": 0}
  with httpx.Client(timeout=60) as c:
    with c.stream("POST", server["base"] + "/v1/chat/completions", json=body) as r:
      lines = []
      for line in r.iter_lines():
        if line:
          lines.append(line)
        if len(lines) == 3:
          break  # Leaving the block closes the connection.
  r = httpx.post(server["base"] + "/v1/chat/completions",
                 json={"messages": QUESTION, "max_tokens": 5, "temperature": 0}, timeout=60)
  assert r.status_code == 200
  # The abandoned generation stopped: far fewer than its 400 tokens were generated.
  assert _tokens_seen(server) - before < 60


def test_non_streaming_client_that_disconnects_frees_the_worker(server):
  before = _tokens_seen(server)
  with pytest.raises(httpx.TimeoutException):
    httpx.post(server["base"] + "/v1/chat/completions",
               json={"messages": STORY, "max_tokens": 400, "temperature": 0}, timeout=0.5)
  r = httpx.post(server["base"] + "/v1/chat/completions",
                 json={"messages": QUESTION, "max_tokens": 5, "temperature": 0}, timeout=60)
  assert r.status_code == 200
  assert _tokens_seen(server) - before < 150


def test_full_queue_is_503_and_the_server_recovers(server):
  # One long streamed request holds the worker; 8 more wait (--max_queue=8); the next is 503.
  stop, holder = _hold_worker(server, 480)
  time.sleep(0.5)
  clients = [httpx.Client(timeout=60) for _ in range(9)]
  try:
    with ThreadPoolExecutor(9) as pool:
      futures = [pool.submit(c.post, server["base"] + "/v1/completions",
                             json={"prompt": "Hi", "max_tokens": 1}) for c in clients[:8]]
      time.sleep(0.5)
      r = clients[8].post(server["base"] + "/v1/completions",
                          json={"prompt": "Hi", "max_tokens": 1})
      stop.set()
      statuses = [f.result().status_code for f in futures]
  finally:
    stop.set()
    holder.join()
    for c in clients:
      c.close()
  assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy"
  assert statuses == [200] * 8
  assert httpx.get(server["base"] + "/health").status_code == 200


def test_follow_up_turn_reuses_the_prefix(client, server, hf_model, hf_tokenizer, smollm2):
  first = client.chat.completions.create(model=server["model"], messages=QUESTION,
                                         temperature=0, max_tokens=24)
  turn2 = QUESTION + [{"role": "assistant", "content": first.choices[0].message.content},
                      {"role": "user", "content": "And what is the capital of Germany?"}]
  r = client.chat.completions.create(model=server["model"], messages=turn2, temperature=0,
                                     max_tokens=24)
  cached = r.usage.prompt_tokens_details.cached_tokens
  assert r.usage.prompt_tokens - 20 < cached < r.usage.prompt_tokens
  # A fresh run: the same engine without a cache, and the transformers oracle.
  fresh = smollm2.generate(turn2, chat=True, max_new_tokens=24, temperature=0)
  assert r.choices[0].message.content == fresh.text
  _check_against_oracle(hf_model, hf_tokenizer, _hf_ids(hf_tokenizer, turn2),
                        r.choices[0].message.content)


def test_logprobs(client, server):
  r = client.chat.completions.create(model=server["model"], messages=QUESTION, temperature=0,
                                     max_tokens=6, logprobs=True, top_logprobs=3)
  content = r.choices[0].logprobs.content
  assert len(content) == r.usage.completion_tokens
  for entry in content:
    assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
    # Greedy: the chosen token is the most likely one.
    assert entry.top_logprobs[0].token == entry.token
    assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    assert [t.logprob for t in entry.top_logprobs] == sorted(
        (t.logprob for t in entry.top_logprobs), reverse=True)
  text = "".join(e.token for e in content if e.token != "<|im_end|>")
  assert text == r.choices[0].message.content


def test_metrics(server):
  text = httpx.get(server["base"] + "/metrics").text
  values = {line.split()[0]: float(line.split()[-1]) for line in text.splitlines()
            if line and not line.startswith("#")}
  assert values["pijax_prompt_tokens_total"] > 0
  assert values["pijax_generation_tokens_total"] > 0
  assert values["pijax_request_latency_seconds_count"] > 0
  assert 'pijax_requests_total{finish_reason="stop"}' in values
  assert "pijax_requests_waiting" in values


def test_bad_flags_exit_2(server):
  import subprocess
  import sys
  port = int(server["base"].rsplit(":", 1)[1])
  for args, words in [([f"--port={port}"], "cannot listen"),
                      (["--port=70000"], "--port"),
                      (["--model=/nonexistent.gguf"], "does not exist"),
                      (["--max_queue=0"], "--max_queue")]:
    p = subprocess.run([sys.executable, "-m", "pijax.serve", *args], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2, (args, p.stderr)
    assert words in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


# ------------------------------------------------------------------ cases (../shared/cases V*)
def test_v2_a_cancelled_queued_client_does_not_disturb_the_next(server):
  """V2: two queued clients; the first cancels; the second's reply is complete and unchanged."""
  body = {"prompt": "The history of Rome", "max_tokens": 24, "temperature": 0.9, "seed": 5}
  expected = httpx.post(server["base"] + "/v1/completions", json=body, timeout=60).json()
  hold, holder = _hold_worker(server, 300)
  time.sleep(0.3)
  with pytest.raises(httpx.TimeoutException):  # Queued behind the stream, then gives up.
    httpx.post(server["base"] + "/v1/completions", json=dict(body, seed=6), timeout=0.3)
  result = {}
  second = threading.Thread(target=lambda: result.update(
      r=httpx.post(server["base"] + "/v1/completions", json=body, timeout=60)))
  second.start()
  time.sleep(0.3)
  hold.set()
  holder.join()
  second.join()
  r = result["r"]
  assert r.status_code == 200
  assert r.json()["choices"][0]["text"] == expected["choices"][0]["text"]
  assert r.json()["usage"]["completion_tokens"] == expected["usage"]["completion_tokens"]


def test_v3_streamed_emoji_is_valid_utf8_json_without_replacement_chars(server):
  body = {"messages": [{"role": "user", "content": "Repeat exactly: 🦙🦙🦙 llama 🦙"}],
          "max_tokens": 20, "temperature": 0}
  whole = httpx.post(server["base"] + "/v1/chat/completions", json=body,
                     timeout=60).json()["choices"][0]["message"]["content"]
  lines = _sse(server, "/v1/chat/completions", dict(body, stream=True))
  pieces = []
  for line in lines[:-1]:
    chunk = json.loads(line[6:])
    pieces.append(chunk["choices"][0]["delta"].get("content") or "")
  assert "🦙" in whole and "\ufffd" not in "".join(pieces)
  assert "".join(pieces) == whole


def test_sampling_values_the_engine_refuses_are_400_before_queueing(server):
  for change, param in [({"top_k": 3_000_000_000}, "top_k"),
                        ({"temperature": 1e-39}, "temperature"),
                        ({"repeat_penalty": 1e38}, "repeat_penalty")]:
    for stream in (False, True):
      body = {"messages": QUESTION, "max_tokens": 3, "stream": stream, **change}
      r = httpx.post(server["base"] + "/v1/chat/completions", json=body, timeout=60)
      assert r.status_code == 400, (change, r.text)
      assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("content,words,param", [
    (b"[]", "must be a JSON object", None),
    (b"", "body is empty", None),
    (json.dumps({"messages": QUESTION, "top_logprobs": 2}).encode(), "logprobs", "top_logprobs"),
    (json.dumps({"prompt": [1, 2.5]}).encode(), "list of token ids", "prompt"),
    (json.dumps({"messages": QUESTION, "model": "\ud800"}).encode(), "not served", "model"),
    (json.dumps({"messages": QUESTION, "stream": "yes"}).encode(), "stream", "stream"),
    (json.dumps({"messages": QUESTION, "max_tokens": True}).encode(), "max_tokens",
     "max_tokens"),
])
def test_malformed_bodies_get_a_message_naming_the_problem(server, content, words, param):
  path = "/v1/completions" if b'"prompt"' in content else "/v1/chat/completions"
  r = httpx.post(server["base"] + path, content=content,
                 headers={"content-type": "application/json"}, timeout=60)
  assert r.status_code == 400, r.text
  err = r.json()["error"]
  assert words in err["message"] and err["param"] == param
  # The connection and the server stay usable.
  assert httpx.get(server["base"] + "/health").status_code == 200


def test_oversized_body_is_413(server):
  r = httpx.post(server["base"] + "/v1/completions",
                 content=json.dumps({"prompt": "x" * (9 << 20)}).encode(),
                 headers={"content-type": "application/json"}, timeout=60)
  assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_v6_template_exception_is_400_with_its_message(tmp_path):
  """A chat that breaks the template's rules: 400 with the template's own message (in-process
  server on a tiny model whose template calls raise_exception)."""
  import asyncio
  import uvicorn
  import pijax
  from conftest import free_port
  from tiny_models import make_hf_llama, write_gguf
  from pijax.server.app import ServerState, create_app
  template = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
              "{{ raise_exception('System messages must come first') }}{% endif %}"
              "{{ m['content'] }}{% endfor %}")
  path = write_gguf(make_hf_llama(), tmp_path / "tiny.gguf", chat_template=template)
  model = pijax.load(str(path), max_seq_len=64)
  state = ServerState("tiny")
  state.attach(model)
  port = free_port()
  server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port,
                                         log_level="warning"))
  thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
  thread.start()
  try:
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
      time.sleep(0.05)
    msgs = [{"role": "user", "content": "ab"}, {"role": "system", "content": "b"}]
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                   json={"messages": msgs, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400
    assert "System messages must come first" in r.json()["error"]["message"]
    ok = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                    json={"messages": msgs[::-1], "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200, ok.text
  finally:
    server.should_exit = True
    thread.join(timeout=30)
    state.worker.close()


def test_server_max_tokens_caps_replies_that_name_no_limit(tmp_path):
  """--max_tokens (llama.cpp's -n): a chat naming no max_tokens stops there with "length";
  a request's own max_tokens wins (in-process server on a tiny model)."""
  import asyncio
  import uvicorn
  import pijax
  from conftest import free_port
  from tiny_models import make_hf_llama, write_gguf
  from pijax.server.app import ServerState, create_app
  path = write_gguf(make_hf_llama(), tmp_path / "tiny.gguf",
                    chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
  model = pijax.load(str(path), max_seq_len=64)
  state = ServerState("tiny", max_tokens=3)
  state.attach(model)
  port = free_port()
  server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port,
                                         log_level="warning"))
  thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
  thread.start()
  try:
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
      time.sleep(0.05)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    # Seeded sampling: deterministic, and this seed draws no end-of-turn token within 7.
    body = {"messages": [{"role": "user", "content": "abc"}], "temperature": 2.0, "seed": 1}
    capped = httpx.post(url, json=body, timeout=60).json()
    assert capped["usage"]["completion_tokens"] == 3, capped
    assert capped["choices"][0]["finish_reason"] == "length"
    own = httpx.post(url, json={**body, "max_tokens": 7}, timeout=60).json()
    assert own["usage"]["completion_tokens"] == 7, own
  finally:
    server.should_exit = True
    thread.join(timeout=30)
    state.worker.close()


@pytest.mark.parametrize("first,second_after", [("SIGINT", None), ("SIGINT", 0.05),
                                                ("SIGINT", 0.5), ("SIGTERM", None)])
def test_sigint_while_streaming_ends_the_stream_and_exits_cleanly(first, second_after):
  """Ctrl-C (or SIGTERM) during a reply: the stream ends with an error event and [DONE], the
  server shuts down gracefully (status 0, "stopped"), no traceback and no abort. A second
  Ctrl-C `second_after` seconds later (uvicorn's force quit, or during the clean-up) may cut
  the stream and quit with 130 ("interrupted"), still with no traceback and no abort. (SIGTERM
  used to kill the process by the signal: uvicorn raises it again after its shutdown.)"""
  import signal
  import subprocess
  import sys
  from conftest import ROOT, free_port, wait_ready
  port = free_port()
  proc = subprocess.Popen([sys.executable, "-m", "pijax.serve", "--model=default",
                           f"--port={port}", "--max_seq_len=1024", "--warmup=false"],
                          stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
  base = f"http://127.0.0.1:{port}"
  try:
    wait_ready(base, proc, timeout=120)
    lines, sent = [], False
    with httpx.Client(timeout=60) as c:
      with c.stream("POST", base + "/v1/chat/completions",
                    json={"messages": STORY, "max_tokens": 900, "stream": True}) as r:
        try:
          for line in r.iter_lines():
            if line:
              lines.append(line)
            if len(lines) >= 3 and not sent:  # Empty lines must not send it again.
              proc.send_signal(getattr(signal, first))
              if second_after is not None:
                time.sleep(second_after)
                proc.send_signal(signal.SIGINT)
              sent = True
        except httpx.HTTPError:
          assert second_after is not None  # A forced quit may close the connection mid-stream.
    _, err = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
  last = err.strip().splitlines()[-1]
  if second_after is None:
    assert lines[-1] == "data: [DONE]"
    assert "shutting down" in lines[-2]
    assert proc.returncode == 0 and last == "pijax.serve: stopped", err
  else:
    assert (proc.returncode, last) in ((0, "pijax.serve: stopped"),
                                       (130, "pijax.serve: interrupted")), err
  assert "Traceback" not in err and "Fatal" not in err and "terminate" not in err, err


@pytest.mark.parametrize("after", [0.1, 0.5])
def test_ctrl_c_while_the_server_starts_is_one_line(after):
  """Ctrl-C while `pijax.serve` still imports jax and numba (the first ~1 s) printed a
  KeyboardInterrupt traceback; now "interrupted" and status 130."""
  import signal
  import subprocess
  import sys
  from conftest import ROOT, free_port
  proc = subprocess.Popen([sys.executable, "-m", "pijax.serve", "--model=default",
                           f"--port={free_port()}", "--warmup=false"],
                          stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
  time.sleep(after)
  proc.send_signal(signal.SIGINT)
  try:
    _, err = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
  # On a fast machine the server may already be up at 0.5 s: then it stops gracefully.
  assert (proc.returncode, err.strip().splitlines()[-1]) in (
      (130, "pijax.serve: interrupted"), (0, "pijax.serve: stopped")), err
  assert "Traceback" not in err, err


# ------------------------------------------------------- structured output, logit_bias (issue 31)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
ASK_JSON = [{"role": "user", "content": "Describe a person as a JSON object."}]


def _check_person(text):
  value = json.loads(text)
  assert isinstance(value, dict) and set(value) == {"name", "age", "pet"}, value
  assert isinstance(value["name"], str) and len(value["name"]) <= 20
  assert isinstance(value["age"], int) and not isinstance(value["age"], bool)
  assert 0 <= value["age"] <= 120 and value["pet"] in ("cat", "dog", "none")


@pytest.fixture(scope="module")
def vocab(smollm2_path):
  """The default model's tokenizer (metadata only), for token ids."""
  from pijax.text.tokenizer import Tokenizer
  return Tokenizer.from_gguf(smollm2_path)


def test_json_schema_replies_parse_and_validate(client, server):
  """Sampled at temperature 0.9 with several seeds, on both routes and streamed: every reply
  is JSON that validates, and it ends (finish_reason "stop") when the JSON is complete."""
  fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                "strict": True}}
  for seed in range(4):
    r = client.chat.completions.create(model=server["model"], messages=ASK_JSON,
                                       temperature=0.9, seed=seed, max_tokens=120,
                                       response_format=fmt)
    assert r.choices[0].finish_reason == "stop", r
    _check_person(r.choices[0].message.content)
  r = client.completions.create(model=server["model"], prompt="A person, as JSON:",
                                temperature=0.9, seed=5, max_tokens=120,
                                extra_body={"response_format": fmt})
  assert r.choices[0].finish_reason == "stop"
  _check_person(r.choices[0].text)
  chunks = list(client.chat.completions.create(model=server["model"], messages=ASK_JSON,
                                               temperature=0.9, seed=6, max_tokens=120,
                                               response_format=fmt, stream=True))
  _check_person("".join(c.choices[0].delta.content or "" for c in chunks))
  assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_replies_are_json_objects(client, server):
  """json_object: a reply that ends by itself is one JSON object; one cut by max_tokens used
  them all (a free-form object at temperature 0.9 may ramble in a string)."""
  stopped = 0
  for seed in range(4):
    r = client.chat.completions.create(model=server["model"], messages=ASK_JSON,
                                       temperature=0.9, seed=seed, max_tokens=150,
                                       response_format={"type": "json_object"})
    choice = r.choices[0]
    if choice.finish_reason == "stop":
      stopped += 1
      assert isinstance(json.loads(choice.message.content), dict)
    else:
      assert r.usage.completion_tokens == 150
      assert choice.message.content.lstrip().startswith("{")
  assert stopped >= 2
  r = client.completions.create(model=server["model"], prompt="{", temperature=0,
                                max_tokens=150, extra_body={"response_format":
                                                            {"type": "json_object"}})
  assert r.choices[0].finish_reason != "stop" or isinstance(json.loads(r.choices[0].text), dict)


@pytest.mark.parametrize("fmt, words", [
    ({"type": "json_schema", "json_schema": {"name": "broken", "schema": {"type": "strin"}}},
     ["json_schema 'broken'", "strin"]),
    ({"type": "json_schema", "json_schema": {"name": "dangling", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}}}},
     ["json_schema 'dangling'", "nowhere"]),
    ({"type": "yaml"}, ["'yaml'"]),
])
def test_a_schema_that_does_not_compile_is_400_naming_it(client, server, fmt, words):
  for call in (lambda: client.chat.completions.create(model=server["model"], messages=QUESTION,
                                                      max_tokens=4, response_format=fmt),
               lambda: client.completions.create(model=server["model"], prompt="Hi",
                                                 max_tokens=4,
                                                 extra_body={"response_format": fmt})):
    with pytest.raises(openai.BadRequestError) as err:
      call()
    body = err.value.body
    assert set(body) == {"message", "type", "param", "code"}
    assert body["param"] == "response_format" and body["type"] == "invalid_request_error"
    for word in words:
      assert word in body["message"], body


def test_logit_bias_forces_and_bans_tokens(client, server, vocab):
  prompt = "The capital of France is"
  greedy = client.completions.create(model=server["model"], prompt=prompt, temperature=0,
                                     max_tokens=1).choices[0].text
  paris, = vocab.encode(greedy, add_special=False)
  london, = vocab.encode(" London", add_special=False)
  banned = client.completions.create(model=server["model"], prompt=prompt, temperature=0,
                                     max_tokens=1, logit_bias={str(paris): -100})
  assert banned.choices[0].text not in ("", greedy)
  forced = client.completions.create(model=server["model"], prompt=prompt, temperature=0.9,
                                     seed=1, max_tokens=3, logit_bias={str(london): 100})
  assert forced.choices[0].text == " London" * 3
  chat = client.chat.completions.create(model=server["model"], messages=QUESTION,
                                        temperature=0, max_tokens=2,
                                        logit_bias={str(london): 100})
  assert chat.choices[0].message.content == " London" * 2
  for bias in ({str(london): 150}, {"49152": 1}, {"x": 1}):
    with pytest.raises(openai.BadRequestError) as err:
      client.completions.create(model=server["model"], prompt=prompt, max_tokens=1,
                                logit_bias=bias)
    assert err.value.body["param"] == "logit_bias"


# ------------------------------------------------------------------ who may call (issue 31)
def test_a_foreign_host_is_403(server):
  """DNS rebinding (Ollama's CVE-2024-28224 class): a request naming another server in Host is
  refused before anything runs; the names of this server pass, with or without the port."""
  port = server["base"].rsplit(":", 1)[1]
  for host in ("evil.example", f"evil.example:{port}", "localhost.evil.example", "10.0.0.1"):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                         ("GET", "/health"), ("GET", "/")):
      r = httpx.request(method, server["base"] + path, headers={"Host": host},
                        json={"messages": QUESTION, "max_tokens": 1}, timeout=60)
      assert r.status_code == 403, (host, path, r.text)
      err = r.json()["error"]
      assert set(err) == {"message", "type", "param", "code"}
      assert err["code"] == "host_not_allowed" and host in err["message"]
  for host in ("localhost", f"localhost:{port}", "LOCALHOST.", f"127.0.0.1:{port}",
               f"[::1]:{port}", "[::1]"):
    assert httpx.get(server["base"] + "/v1/models", headers={"Host": host}).status_code == 200


def test_text_plain_posts_are_400_and_there_is_no_cors_preflight(server):
  r = httpx.post(server["base"] + "/v1/chat/completions",
                 content=json.dumps({"messages": QUESTION, "max_tokens": 1}),
                 headers={"content-type": "text/plain"}, timeout=60)
  assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"]
  r = httpx.options(server["base"] + "/v1/chat/completions",
                    headers={"Origin": "http://evil.example",
                             "Access-Control-Request-Method": "POST"})
  assert r.status_code >= 400
  assert not any(h.lower().startswith("access-control-") for h in r.headers)


def test_non_loopback_bind_without_a_key_warns(tmp_path):
  """--host=0.0.0.0 and no --api_key: a warning line on stderr at start (the server is stopped
  while the model still loads)."""
  import signal
  import subprocess
  import sys
  from conftest import ROOT, free_port
  proc = subprocess.Popen([sys.executable, "-m", "pijax.serve", "--model=default",
                           "--host=0.0.0.0", f"--port={free_port()}", "--warmup=false"],
                          stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
  try:
    lines = [proc.stderr.readline(), proc.stderr.readline()]
    proc.send_signal(signal.SIGTERM)
    _, rest = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert "listening on http://0.0.0.0:" in lines[0]
  assert "warning" in lines[1] and "--api_key" in lines[1] and "network" in lines[1], lines
  assert "Traceback" not in rest
