"""Who may call the server (pijax.server.access): the Host allow-list and --api_key, as units and
through the official `openai` client against an in-process server on a tiny model."""

import asyncio
import contextlib
import threading
import time

import httpx2 as httpx
import openai
import pytest

from pijax.errors import ConfigError
from pijax.server import access

KEY = "sk-test-0123456789"


@pytest.mark.parametrize("header, name", [
    ("localhost", "localhost"), ("LocalHost:8080", "localhost"), ("[::1]:8080", "::1"),
    ("[::1]", "::1"), ("127.0.0.1:80", "127.0.0.1"), ("example.com.", "example.com"),
    ("::1", "::1"), (" Evil.Example:1 ", "evil.example"),
])
def test_host_name(header, name):
  assert access.host_name(header) == name


def test_loopback_bind_answers_loopback_names_only():
  policy = access.HostPolicy("127.0.0.1")
  for ok in ("localhost", "localhost:1234", "127.0.0.1", "127.0.0.2:8080", "[::1]:8080", None):
    assert policy.allows(ok), ok
  for bad in ("evil.example", "localhost.evil.example", "10.0.0.1", "0.0.0.0", "[::2]", "",
              "evil.example:8080@localhost"):
    assert not policy.allows(bad), bad


def test_allowed_hosts_and_bound_address():
  policy = access.HostPolicy("192.0.2.7", ["My.Box.lan", ""])
  assert policy.allows("my.box.lan:8080") and policy.allows("192.0.2.7:8080")
  assert policy.allows("localhost") and not policy.allows("other.lan")
  assert access.HostPolicy("127.0.0.1", ["*"]).allows("anything.example")


def test_wildcard_bind_answers_the_machines_own_names():
  import socket
  policy = access.HostPolicy("0.0.0.0")
  assert policy.allows(socket.gethostname()) and policy.allows("127.0.0.1:9")
  assert not policy.allows("192.0.2.99") and not policy.allows("evil.example")


def test_key_matches_in_constant_time_and_only_as_bearer():
  assert access.key_matches(f"Bearer {KEY}", KEY)
  assert access.key_matches(f"bearer  {KEY} ", KEY)
  for bad in (None, "", KEY, f"Basic {KEY}", f"Bearer {KEY}x", "Bearer", f"Bearer {KEY[:-1]}",
              "Bearer \u00e9"):
    assert not access.key_matches(bad, KEY), bad


@pytest.mark.parametrize("key", ["", "two words", "tab\tkey", "caf\u00e9"])
def test_bad_api_keys_are_refused(key):
  with pytest.raises(ConfigError, match="--api_key"):
    access.check_api_key(key)


def test_is_loopback_bind():
  assert access.is_loopback_bind("127.0.0.1") and access.is_loopback_bind("localhost")
  assert not access.is_loopback_bind("0.0.0.0")


@contextlib.contextmanager
def _serve(tmp_path, **state_kwargs):
  """An in-process server (uvicorn in a thread) on a tiny model; yields its base URL."""
  import uvicorn
  import pijax
  from conftest import free_port
  from tiny_models import make_hf_llama, write_gguf
  from pijax.server.app import ServerState, create_app
  path = write_gguf(make_hf_llama(), tmp_path / "tiny.gguf",
                    chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
  state = ServerState("tiny", **state_kwargs)
  state.attach(pijax.load(str(path), max_seq_len=64))
  port = free_port()
  server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port,
                                         log_level="warning"))
  thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
  thread.start()
  try:
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
      time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
  finally:
    server.should_exit = True
    thread.join(timeout=30)
    state.worker.close()


def test_api_key_is_enforced(tmp_path):
  with _serve(tmp_path, api_key=KEY, allowed_hosts=("pijax.lan",)) as base:
    # The official client: the right key just works, a wrong one is AuthenticationError (401).
    good = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60)
    r = good.completions.create(model="tiny", prompt="ab", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens >= 1
    assert [m.id for m in good.models.list().data] == ["tiny"]
    wrong = openai.OpenAI(base_url=base + "/v1", api_key=KEY + "x", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as err:
      wrong.completions.create(model="tiny", prompt="ab", max_tokens=2)
    body = err.value.body
    assert set(body) == {"message", "type", "param", "code"}
    assert body["code"] == "invalid_api_key" and KEY not in body["message"]
    # No key at all: 401 with a message saying how to send one.
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                         ("POST", "/v1/completions"), ("GET", "/metrics"),
                         ("GET", "/v1/nowhere")):
      r = httpx.request(method, base + path, json={"prompt": "ab", "max_tokens": 1})
      assert r.status_code == 401, (path, r.text)
      assert r.headers["www-authenticate"] == "Bearer"
      assert "Authorization: Bearer" in r.json()["error"]["message"]
    # /health and the chat page stay open (the page asks for the key itself).
    assert httpx.get(base + "/health").status_code == 200
    page = httpx.get(base + "/")
    assert page.status_code == 200 and "Authorization" in page.text
    # The Host check comes first, key or not; --allowed_hosts adds a name.
    headers = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(base + "/v1/models", headers={**headers, "Host": "evil.example"}
                     ).status_code == 403
    assert httpx.get(base + "/v1/models", headers={**headers, "Host": "pijax.lan:8080"}
                     ).status_code == 200
    assert httpx.get(base + "/v1/models", headers={"Host": "pijax.lan"}).status_code == 401


def test_serve_refuses_a_bad_api_key_in_one_line():
  """Checked before the model or the port: one stderr line, exit status 2."""
  import subprocess
  import sys
  from conftest import ROOT
  proc = subprocess.run([sys.executable, "-m", "pijax.serve", "--api_key=two words", "--port=1"],
                        capture_output=True, text=True, cwd=str(ROOT), timeout=300)
  assert proc.returncode == 2, proc.stderr
  lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
  assert len(lines) == 1 and "--api_key" in lines[0] and "Traceback" not in proc.stderr, lines
