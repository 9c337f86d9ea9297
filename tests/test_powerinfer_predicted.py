"""--sparse=predictor on PowerInfer's own files (issue 32): the file's fc1/fc2 and threshold run
the host engine's predicted FFN (`host_ops.predicted_ffn`), from the library, generate and bench;
a plain GGUF without predictors is refused in one line.

Oracles: the float64 reference decoder (`decoder_reference`: the dense model with the
unpredicted neurons zeroed, the predictor's products as the pool computes them) and the file's
own predictor bytes (`powerinfer.Predictors.nbytes`).
"""

import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import make_synthetic_gguf  # noqa: E402
import synthetic_powerinfer as spi  # noqa: E402

import pijax  # noqa: E402
from host_ops import decoder as decoder_lib  # noqa: E402
from pijax import bench  # noqa: E402
from pijax.errors import ConfigError  # noqa: E402
from pijax.formats import powerinfer  # noqa: E402
from test_host_quant import _assert_logits_match  # noqa: E402

CONFIG = "--config=" + str(ROOT / "configs" / "smollm2_135m.py")
IDS = [1, 5, 9, 300, 42, 7]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """Tiny PowerInfer files (Q4_0 ReGLU and dReLU) and a plain GGUF without predictors."""
  folder = tmp_path_factory.mktemp("predicted")
  out = {}
  for activation in ("relu", "drelu"):
    out[activation] = str(folder / f"tiny-{activation}.q4_0.gguf")
    spi.write(out[activation], shape="tiny", qtype="Q4_0", activation=activation)
  out["plain"] = str(folder / "tiny-plain.q4_1.gguf")
  make_synthetic_gguf.write(out["plain"], shape="tiny", qtype="Q4_1", activation="drelu")
  return out


@pytest.mark.parametrize("activation", ["relu", "drelu"])
def test_library_runs_the_files_predictors(files, activation):
  """configure_sparse("predictor"): the host engine with the file's predictors and threshold;
  logits equal the reference decoder; the bytes per token count the predictors."""
  model = pijax.load(files[activation], max_seq_len=64)
  model.configure_sparse("predictor")
  dec = model.backend.decoder
  pred = powerinfer.read_predictors(files[activation])
  assert model.backend.mode == "predictor"
  assert dec.thresholds == [pytest.approx(pred.threshold)] * dec.n_layers
  assert dec.predictor_bytes() == pred.nbytes
  got = np.asarray(model.prompt_logits(IDS))
  _assert_logits_match(got, decoder_lib.decoder_reference(dec, IDS), dec.dot)
  assert 0.0 < dec.last_active.mean() < 1.0  # The predicted (computed) share.
  rows = bench.run(model, n_prompt=0, n_gen=4, reps=1, threads=2)
  row = rows[0]
  assert row["mode"] == "predictor" and 0.0 < row["ffn_sparsity"] < 1.0
  assert row["weight_bytes_per_token"] == dec.bytes_per_token(1.0 - row["ffn_sparsity"])
  assert row["weight_bytes_per_token"] > pred.nbytes + dec.lm_head.file_bytes()
  assert row["ideal_speedup"] == pytest.approx(
      dec.bytes_per_token() / row["weight_bytes_per_token"])
  if activation == "relu":  # Interleaved with the dense and gate-first FFNs on the same weights.
    rows = bench.run(model, n_prompt=0, n_gen=3, reps=1, threads=2, interleave_dense=True,
                     interleave_gate=True)
    assert [r["mode"] for r in rows] == ["predictor", "gate", "off"]
    assert model.backend.mode == "predictor"  # Left in its own mode.
    own, gate, off = rows
    assert own["vs_dense"] == pytest.approx(own["t_s_mean"] / off["t_s_mean"])
    assert own["vs_gate"] == pytest.approx(own["t_s_mean"] / gate["t_s_mean"])
    assert off["weight_bytes_per_token"] == off["dense_weight_bytes_per_token"] == \
        dec.bytes_per_token()
    # Gate-first reads every gate row and no predictor: its own accounting, not predictor's.
    assert gate["weight_bytes_per_token"] > dec.bytes_per_token() - (
        sum(layer.up.file_bytes() for layer in dec.layers) +
        sum(layer.down.file_bytes() for layer in dec.layers))
    assert own["weight_bytes_per_token"] < gate["weight_bytes_per_token"]
  model.configure_sparse("off")
  assert model.backend.mode == "off"
  with pytest.raises(ConfigError, match="--interleave_gate"):
    bench.run(model, n_prompt=0, n_gen=3, reps=1, threads=2, interleave_gate=True)


def test_library_refuses_predictor_without_predictors(files):
  model = pijax.load(files["plain"], max_seq_len=64)
  with pytest.raises(ConfigError, match="needs predictors: a PowerInfer GGUF"):
    model.configure_sparse("predictor")


def _generate(path, *flags):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "pijax.generate", CONFIG, f"--model={path}",
                         "--prompt=ab", "--max_new_tokens=4", "--temperature=0", *flags],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_generate_cli_sparse_modes_on_a_powerinfer_file(files):
  """predictor runs and reports the share of neurons not computed; gate and off keep working
  (gate on Q4_0 up rows, the file blocks' gathered pass)."""
  for flags in (["--sparse=predictor"], ["--sparse=gate", "--host_weights=gguf"],
                ["--sparse=off", "--host_weights=gguf"]):
    proc = _generate(files["relu"], *flags)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = re.search(r"FFN sparsity: ([\d.]+)%", proc.stderr)
    assert found, proc.stderr[-2000:]
    sparsity = float(found[1])
    assert (sparsity == 0.0) == (flags[0] == "--sparse=off"), (flags, sparsity)


def test_generate_cli_refuses_predictor_on_a_plain_gguf(files):
  proc = _generate(files["plain"], "--sparse=predictor")
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
  assert len(lines) == 1 and "--sparse=predictor needs predictors" in lines[0], proc.stderr
