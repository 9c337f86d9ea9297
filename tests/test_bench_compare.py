"""pijax.bench_compare without llama-cpp-python: llama-side timing on a stand-in, table, errors."""

import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from pijax import bench_compare

ROOT = pathlib.Path(__file__).resolve().parents[1]


class FakeLlama:
  """A Llama-like stand-in: eval() runs a real matmul per token and records the calls."""

  def __init__(self, n_vocab=1000, bos=1, hidden=64):
    rng = np.random.default_rng(0)
    self.emb = rng.standard_normal((n_vocab, hidden)).astype(np.float32)
    self.w = rng.standard_normal((hidden, n_vocab)).astype(np.float32)
    self._n_vocab, self._bos = n_vocab, bos
    self.n_tokens = 0
    self.calls = []  # ("reset",) or ("eval", tokens, n_past)

  def n_vocab(self):
    return self._n_vocab

  def token_bos(self):
    return self._bos

  def reset(self):
    self.n_tokens = 0
    self.calls.append(("reset",))

  def eval(self, tokens):
    self.calls.append(("eval", list(tokens), self.n_tokens))
    self.last_logits = self.emb[np.asarray(tokens)] @ self.w  # f32[T, V]
    self.n_tokens += len(tokens)


def _evals(calls):
  return [c for c in calls if c[0] == "eval"]


def test_bench_llama_on_stand_in():
  llm = FakeLlama()
  results = bench_compare.bench_llama(llm, n_prompt=24, n_gen=5, reps=2)
  assert [r.test for r in results] == ["pp24", "tg5"]
  for r in results:
    assert len(r.tokens_per_s) == 2 and all(v > 0 for v in r.tokens_per_s)
  evals = _evals(llm.calls)
  # pp: warm-up + 2 reps, each one eval of 24 ids from an empty cache, BOS first, same ids.
  pp = evals[:3]
  assert all(len(c[1]) == 24 and c[2] == 0 and c[1][0] == 1 for c in pp)
  assert pp[0][1] == pp[1][1] == pp[2][1]
  assert all(0 <= t < 1000 for t in pp[0][1])
  # tg: warm-up + 2 reps of 5 single-token evals from an empty cache (positions 0..4).
  tg = evals[3:]
  assert len(tg) == 15 and all(len(c[1]) == 1 for c in tg)
  assert [c[2] for c in tg] == [0, 1, 2, 3, 4] * 3
  assert tg[0][1] == [1]
  # The cache is reset before every repetition of every test.
  assert sum(c[0] == "reset" for c in llm.calls) == 6
  assert llm.calls[0] == ("reset",)
  # 0 skips a test.
  assert [r.test for r in bench_compare.bench_llama(FakeLlama(), n_prompt=0, n_gen=3,
                                                     reps=1)] == ["tg3"]


def test_compare_rows_and_markdown_ratio():
  pijax_rows = [{"test": "pp16", "t_s_mean": 300.0, "t_s_sd": 3.0},
                {"test": "tg8", "t_s_mean": 40.0, "t_s_sd": 0.5}]
  llama = [{"test": "tg8", "t_s_mean": 80.0, "t_s_sd": 1.0},
           {"test": "pp16", "t_s_mean": 1200.0, "t_s_sd": 9.0}]
  rows = bench_compare.compare_rows(pijax_rows, llama)
  assert [r["test"] for r in rows] == ["pp16", "tg8"]
  for r in rows:
    assert r["ratio"] == pytest.approx(r["pijax_t_s"] / r["llama_cpp_t_s"])


@pytest.mark.slow
def test_table_with_real_pijax_rows(smollm2, smollm2_path):
  """A tiny real pijax bench plus the stand-in's llama-side rows, through `run` and the table."""
  llm = FakeLlama(n_vocab=smollm2.config.vocab_size, bos=smollm2.tokenizer.bos_id or 0)
  result = bench_compare.run(smollm2, llm, n_prompt=16, n_gen=8, reps=1, threads=2,
                             system_info="CPU : AVX2 = 1 |", llama_cpp_version="0.0-test")
  assert [r["test"] for r in result["pijax"]] == ["pp16", "tg8"]
  assert [r["test"] for r in result["llama_cpp"]] == ["pp16", "tg8"]
  assert result["info"]["gguf"] == smollm2_path and result["info"]["threads"] == 2
  assert result["info"]["file_size_bytes"] == os.path.getsize(smollm2_path)
  json.dumps(result)  # -o json must serialize.
  by_test = {r["test"]: r for r in result["llama_cpp"]}
  for p, c in zip(result["pijax"], result["compare"]):
    assert c["test"] == p["test"]
    assert c["pijax_t_s"] == p["t_s_mean"] > 0
    assert c["llama_cpp_t_s"] == by_test[p["test"]]["t_s_mean"] > 0
    assert c["ratio"] == pytest.approx(c["pijax_t_s"] / c["llama_cpp_t_s"])
  text = bench_compare.format_markdown(result["info"], result["compare"])
  lines = text.splitlines()
  assert lines[0].startswith(f"model: {smollm2_path} (file ") and "threads: 2" in lines[0]
  assert "machine: " in lines[0] and "llama-cpp-python 0.0-test" in lines[0]
  assert lines[1] == "llama.cpp system info: CPU : AVX2 = 1 |"
  assert "| test | pijax t/s | llama.cpp t/s | ratio (pijax / llama.cpp) |" in lines
  for c in result["compare"]:
    m = re.search(rf"^\| {c['test']} \| ([0-9.]+) ± [0-9.]+ \| ([0-9.]+) ± [0-9.]+ \| "
                  r"([0-9.]+) \|$", text, re.M)
    assert m, text
    a, b, ratio = map(float, m.groups())
    assert ratio == pytest.approx(a / b, rel=0.02, abs=2e-3)  # Printed values are rounded.


def _run_without_llama_cpp(*args):
  """Runs `python -m pijax.bench_compare ARGS` with `import llama_cpp` made to fail."""
  code = ("import runpy, sys; sys.modules['llama_cpp'] = None; "
          f"sys.argv = ['pijax.bench_compare', *{list(args)!r}]; "
          "runpy.run_module('pijax.bench_compare', run_name='__main__', alter_sys=True)")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)


def test_missing_llama_cpp_exits_2_with_one_line():
  proc = _run_without_llama_cpp("-m", "default", "-p", "8", "-n", "4", "-r", "1")
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stdout == ""
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].endswith(bench_compare.MISSING_LLAMA_CPP), proc.stderr


@pytest.mark.parametrize("args", [("-r", "0"), ("-o", "xml"), ("-t", "0"),
                                  ("-p", "0", "-n", "0"), ("--sparse", "sometimes")])
def test_bad_flags_exit_2_with_one_line(args):
  proc = _run_without_llama_cpp(*args)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
  assert "llama-cpp-python" not in proc.stderr  # Flags are checked first.


@pytest.mark.slow
def test_real_llama_cpp_tiny(smollm2_path):
  """Only where the compare extra is installed: the real Llama through the same timing code."""
  pytest.importorskip("llama_cpp")
  llm = bench_compare.make_llama(smollm2_path, threads=1, n_ctx=16)
  try:
    results = bench_compare.bench_llama(llm, n_prompt=8, n_gen=4, reps=1)
  finally:
    llm.close()
  assert [r.test for r in results] == ["pp8", "tg4"]
  assert all(r.mean > 0 for r in results)
