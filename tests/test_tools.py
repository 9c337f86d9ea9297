"""pijax.bench and pijax.perplexity on tiny settings: output format and reproducibility."""

import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(module, *args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=900)


def test_bench_json_and_markdown():
  proc = _run("pijax.bench", "-m", "default", "-p", "16", "-n", "8", "-r", "2", "-o", "json")
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = json.loads(proc.stdout)
  assert [r["test"] for r in rows] == ["pp16", "tg8"]
  for r in rows:
    assert r["t_s_mean"] > 0 and r["reps"] == 2 and r["mode"] == "off"
  assert rows[1]["weight_bytes_per_token"] == rows[1]["dense_weight_bytes_per_token"]
  proc = _run("pijax.bench", "-m", "default", "-p", "0", "-n", "4", "-r", "1")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert re.search(r"\| tg4 \| [0-9.]+ ± [0-9.]+ \|", proc.stdout), proc.stdout


def test_bench_bad_flags():
  proc = _run("pijax.bench", "-r", "0")
  assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


def test_perplexity_reproducible_and_kld(shared_dir, tmp_path, smollm2):
  from pijax.perplexity import perplexity
  text = (shared_dir / "data" / "wikitext-2-raw" / "wiki.test.raw").read_text()
  base = str(tmp_path / "base.npy")
  logs = []
  a = perplexity(smollm2, text, n_ctx=128, chunks=2, kl_save_path=base, log=logs.append)
  b = perplexity(smollm2, text, n_ctx=128, chunks=2, kl_base_path=base, log=logs.append)
  assert abs(a.ppl - b.ppl) <= 1e-6 * a.ppl
  assert a.nll.shape == (2 * 64,)
  assert b.kld < 1e-3 and b.top1_agreement == 1.0  # f16-rounded base vs itself.
  assert re.search(r"\[1\][0-9.]+,\[2\][0-9.]+,", "".join(logs))
  # The definition: exp(mean NLL of the second half of each chunk), checked by hand.
  ids = smollm2.tokenizer.encode(text, add_special=False)[:128]
  logits = smollm2.prompt_logits(ids)
  lp = logits[63:127] - np.log(np.exp(logits[63:127] - logits[63:127].max(-1, keepdims=True))
                               .sum(-1, keepdims=True)) - logits[63:127].max(-1, keepdims=True)
  nll = -lp[np.arange(64), ids[64:128]]
  np.testing.assert_allclose(a.nll[:64], nll, rtol=1e-4, atol=1e-4)


def test_perplexity_cli_format(shared_dir):
  proc = _run("pijax.perplexity", "-m", "default", "-f",
              str(shared_dir / "data" / "wikitext-2-raw" / "wiki.test.raw"), "-c", "128",
              "--chunks", "2")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert re.fullmatch(r"Final estimate: PPL = [0-9.]+ \+/- [0-9.]+\n", proc.stdout), proc.stdout
  proc = _run("pijax.perplexity", "-m", "default", "-f", "/nonexistent.txt")
  assert proc.returncode == 2 and "nonexistent" in proc.stderr


@pytest.mark.parametrize("module,args,needle", [
    ("pijax.bench", ["-p", "0", "-n", "0"], "one > 0"),
    ("pijax.eval_predictors", ["--model=default", "--text=README.md", "--chunk_len=0"],
     "--chunk_len=0"),
    ("pijax.eval_predictors", ["--model=default", "--text=README.md", "--max_tokens=-5"],
     "--max_tokens=-5"),
    ("pijax.eval_predictors", ["--model=default", "--text=/nonexistent.txt"],
     "/nonexistent.txt: cannot read text"),
    ("pijax.generate", ["--config=configs/smollm2_135m.py", "--prompt=Hi", "--sparse=predictor"],
     "--sparse=predictor needs predictors"),
    ("pijax.profile", ["--calibration=README.md", "--out=/tmp/pijax-unused", "--max_tokens=-5"],
     "--max_tokens=-5"),
    ("pijax.profile", ["--calibration=README.md", "--out=README.md"], "--out=README.md"),
    ("pijax.perplexity", ["-m", "default", "-f", "README.md", "--kl_divergence_base=/tmp/"],
     "is a folder"),
    ("pijax.perplexity", ["-m", "default", "-f", "README.md", "-c", "64", "--chunks", "1",
                          "--kl_divergence", "--kl_divergence_base=README.md"], "not a .npy"),
    ("pijax.place", ["--profile=/nonexistent", "--out=/tmp/pijax-unused.json",
                     "--device_budget_gb=inf"], "--device_budget_gb=inf"),
])
def test_tools_refuse_bad_flags_in_one_line(module, args, needle):
  proc = _run(module, *args)
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
  assert len(lines) == 1 and needle in lines[0], proc.stderr
  assert "Traceback" not in proc.stderr
