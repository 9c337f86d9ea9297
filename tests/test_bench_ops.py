"""pijax.bench_ops and pijax.measure: power-law active sets, the measuring functions and the CLI
on tiny settings.

No speed assertions (the machine may be shared); the CLI runs use a small cold target and memory
cap so each takes a few seconds.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from pijax import bench_ops as bo
from pijax.errors import ConfigError
from pijax.measure import active_sets
from pijax.measure import bandwidth
from pijax.measure import matvec
from pijax.measure import sparse_op
from pijax.measure import tables

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ("--shapes=smollm2-135m", "--seconds=0.05", "--cold_mb=32", "--max_gb=0.2")
ROW_KEYS = {"op", "format", "shape", "hidden", "intermediate", "sparsity", "active_neurons",
            "bytes_read", "time_s", "gb_s", "vs_dense", "calls", "copies", "reuse_mb", "flush_mb",
            "from_dram", "time_s_min"}


def _run(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "pijax.bench_ops", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("sparsity", [0.5, 0.8, 0.9, 0.95])
def test_power_law_probs_hit_the_expected_sparsity(sparsity):
  n = 11008
  p = active_sets.power_law_probs(n, sparsity)
  assert p.shape == (n,) and p.max() <= 1.0 and p.min() > 0.0
  assert np.all(np.diff(p) <= 0)  # Sorted by frequency: neuron 0 the hottest.
  np.testing.assert_allclose(p.sum(), (1 - sparsity) * n, rtol=1e-9)


def test_power_law_active_sparsity_and_skew():
  n = 200_000
  rng = np.random.default_rng(0)
  for sparsity in (0.5, 0.9):
    ids = active_sets.power_law_active(n, sparsity, rng)
    assert ids.dtype == np.int32 and np.all(np.diff(ids) > 0) and ids.max() < n
    assert abs(1 - len(ids) / n - sparsity) < 0.005
  active = np.zeros(n, bool)
  active[active_sets.power_law_active(n, 0.9, rng)] = True
  first, last = active[:n // 10].mean(), active[-(n // 10):].mean()
  assert first > 10 * last  # Skewed: the first decile fires far more often than the last.
  # alpha = 0: every neuron with the same probability.
  np.testing.assert_allclose(active_sets.power_law_probs(100, 0.9, alpha=0.0), 0.1)


def test_power_law_active_empty_and_full():
  rng = np.random.default_rng(1)
  empty = active_sets.power_law_active(1000, 1.0, rng)
  assert empty.dtype == np.int32 and empty.shape == (0,)
  np.testing.assert_array_equal(active_sets.power_law_active(1000, 0.0, rng), np.arange(1000))
  assert active_sets.power_law_active(0, 0.5, rng).shape == (0,)
  with pytest.raises(ValueError):
    active_sets.power_law_probs(10, 1.5)


def test_draw_sets_reproducible():
  a = active_sets.draw_sets(1536, 0.9, 1.0, seed=3)
  b = active_sets.draw_sets(1536, 0.9, 1.0, seed=3)
  c = active_sets.draw_sets(1536, 0.9, 1.0, seed=4)
  assert len(a) == active_sets.ID_SETS
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_plan_copies_and_bytes():
  assert sparse_op.bytes_per_neuron(4096, "f32") == 3 * 4096 * 4
  assert sparse_op.bytes_per_neuron(4096, "q8") == 3 * 4096 * 1.125
  assert sparse_op.bytes_per_neuron(4096, "bf16") == 3 * 4096 * 2
  # Enough copies for the cold target, capped by the pool, at least one.
  assert sparse_op.plan_copies(100, 10, 95, 10_000) == 10
  assert sparse_op.plan_copies(100, 10, 95, 350) == 3
  assert sparse_op.plan_copies(1000, 10, 95, 500) == 1
  assert sparse_op.plan_copies(100, 10, 95, 10_000, max_copies=4) == 4


@pytest.mark.parametrize("fmt", ["f32", "q8"])
def test_host_layer_copies_and_bench_host(fmt):
  d, n, copies = 64, 40, 3
  w = sparse_op.host_layer_copies(d, n, fmt, copies, seed=0)
  assert (w.n, w.d, w.weight_format) == (copies * n, d, fmt)
  gate = w.gate if fmt == "f32" else w.gate.q
  np.testing.assert_array_equal(gate[2 * n:3 * n], gate[:n])  # Copies hold the same layer.
  x = np.random.default_rng(0).standard_normal(d).astype(np.float32)
  ids = np.array([0, 5, 39], np.int32)
  np.testing.assert_array_equal(w(x, ids + 2 * n), w(x, ids))
  np.testing.assert_allclose(w(x, ids), w.reference(x, ids), rtol=1e-4, atol=1e-5)

  sets = active_sets.draw_sets(n, 0.5, 1.0, seed=0, count=4)
  m = sparse_op.bench_host(w, n, copies, sets, seconds=0.02, cold_bytes=1e6,
                    flusher=bandwidth.CacheFlusher(int(1e6)))
  assert m["calls"] >= sparse_op.MIN_CALLS and m["time_s"] > 0 and m["time_s_min"] <= m["time_s"]
  assert m["bytes_read"] == pytest.approx(m["active_neurons"] * w.bytes_per_neuron)
  assert m["gb_s"] == pytest.approx(m["bytes_read"] / m["time_s"] / 1e9)
  assert m["from_dram"] and m["reuse_mb"] == pytest.approx(1.0)  # The flush fills the gap.


def test_bench_pallas_interpret():
  d, n, copies = 64, 96, 2
  w = sparse_op.pallas_layer_copies(d, n, "bf16", copies, seed=0)
  assert w[0].shape == (copies * n, d) and w[0].dtype.name == "bfloat16"
  sets = active_sets.draw_sets(n, 0.5, 1.0, seed=0, count=4)
  m = sparse_op.bench_pallas(w, n, copies, sets, seconds=0.02, cold_bytes=1e9, interpret=True)
  assert m["calls"] >= sparse_op.PALLAS_LOOPS * max(copies, len(sets)) and m["time_s"] > 0
  assert m["bytes_read"] == pytest.approx(m["active_neurons"] * 3 * d * 2)
  assert not m["from_dram"]  # 2 tiny copies never reach a 1 GB reuse distance.


def _row(**kw):
  base = dict(op="host", format="f32", shape="llama2-7b", hidden=4096, intermediate=11008,
              sparsity=0.0, active_neurons=11008, bytes_read=5.4e8, time_s=0.05, gb_s=10.8,
              time_s_min=0.05, calls=20, copies=9, reuse_mb=4800, flush_mb=0, from_dram=True)
  base.update(kw)
  return sparse_op.Row(**base)


def test_format_markdown_and_vs_dense():
  rows = sparse_op.add_vs_dense([_row(), _row(sparsity=0.9, gb_s=8.1, time_s=6.7e-3),
                          _row(format="q8", sparsity=0.9, gb_s=5.0)])
  assert rows[1].vs_dense == pytest.approx(0.75) and rows[2].vs_dense is None
  text = tables.format_markdown(rows).splitlines()
  assert text[0] == tables.MD_HEADER
  assert text[2] == ("| host | f32 | llama2-7b | 4096 | 11008 | 0% | 11008 | 50.00 ms | 10.80 "
                     "| 100% |")
  assert text[3].endswith("| 90% | 11008 | 6700.0 us | 8.10 | 75% |")
  assert text[4].endswith("| 5.00 | - |")


def test_parse_options_errors():
  ok = dict(shapes="smollm2-135m", sparsities="0,90", formats="f32", ops="host", threads=1,
            seconds=0.1, output="md")
  opts = bo.parse_options(**ok)
  assert opts.sparsities == [0.0, 0.9] and opts.ops == ["host"]
  assert bo.parse_options(**dict(ok, ops="auto"), backend="gpu").ops == ["host", "pallas"]
  for bad in (dict(sparsities="120"), dict(sparsities="x"), dict(sparsities="-5"),
              dict(shapes="nope"), dict(shapes=""), dict(formats="q4"), dict(formats="bf16"),
              dict(ops="pallas"), dict(ops="gpu"), dict(threads=0), dict(threads=10_000),
              dict(seconds=0), dict(output="csv"), dict(shapes="llama2-70b", formats="f32")):
    with pytest.raises(ConfigError) as err:
      bo.parse_options(**dict(ok, **bad), max_gb=1.0)
    assert "\n" not in str(err.value)


def test_cli_markdown():
  proc = _run(*TINY, "--sparsities=0,90", "--formats=f32")
  assert proc.returncode == 0, proc.stderr[-2000:]
  lines = proc.stdout.splitlines()
  assert lines[0].startswith("machine: ") and "cores" in lines[0] and "numba" in lines[0]
  assert tables.MD_HEADER in lines
  rows = [line for line in lines if line.startswith("| host ")]
  assert len(rows) == 2
  assert rows[0].startswith("| host | f32 | smollm2-135m | 576 | 1536 | 0% | 1536 |")
  assert rows[0].endswith("| 100% |")
  assert re.match(r"\| host \| f32 \| smollm2-135m \| 576 \| 1536 \| 90% \| \d+ \| [0-9.]+ (us|ms) "
                  r"\| [0-9.]+ \| \d+% \|$", rows[1]), rows[1]


def test_cli_json():
  proc = _run(*TINY, "--sparsities=90", "--formats=f32,q8", "--ops=host", "-o", "json",
              "--noprogress")
  assert proc.returncode == 0, proc.stderr[-2000:]
  doc = json.loads(proc.stdout)
  assert {"machine", "settings", "rows"} <= set(doc)
  assert {"cpu", "cores", "l3_bytes", "numba", "threads"} <= set(doc["machine"])
  assert doc["machine"]["read_gb_s"] > 0 and doc["machine"]["gathered_read_gb_s"] > 0
  assert (doc["machine"]["gathered_row_bytes"], doc["machine"]["gathered_fraction"]) == (2560, 0.5)
  assert [(r["format"], r["sparsity"]) for r in doc["rows"]] == [("f32", 0.9), ("q8", 0.9)]
  for r in doc["rows"]:
    assert set(r) == ROW_KEYS and r["op"] == "host" and r["vs_dense"] is None
    assert r["gb_s"] > 0 and r["from_dram"]


@pytest.mark.parametrize("flag", ["--sparsities=120", "--shapes=nope", "--threads=abc"])
def test_cli_bad_flags(flag):
  proc = _run(flag)
  assert proc.returncode == 2
  err = proc.stderr.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("pijax.bench_ops: error:"), proc.stderr
  assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_read_bandwidth_is_a_positive_rate():
  gb_s = bandwidth.read_bandwidth(64e6, threads=2, repeats=2)
  assert 0.1 < gb_s < 10_000


def test_read_rows_sums_exactly_the_chosen_rows():
  rng = np.random.default_rng(5)
  for row_bytes in (320, 2560):  # Prefetched into L1, and into L2 (rows of >= 1 KB).
    rows = rng.integers(-2**40, 2**40, (37, row_bytes // 8), dtype=np.int64)
    for ids in ([], [0], [3, 4, 17, 36], list(range(37))):
      ids = np.asarray(ids, np.int64)
      for threads in (1, 2):
        assert bandwidth._read_rows(rows, ids, threads) == int(rows[ids].sum())


def test_gathered_read_bandwidth_is_a_positive_rate():
  for fraction in (0.5, 1.0):
    gb_s = bandwidth.gathered_read_bandwidth(16e6, threads=2, fraction=fraction, repeats=2)
    assert 0.1 < gb_s < 10_000
  for bad in ({"row_bytes": 100}, {"row_bytes": 0}, {"fraction": 0.0}, {"fraction": 1.5}):
    with pytest.raises(ValueError, match="row_bytes must be"):
      bandwidth.gathered_read_bandwidth(1e6, threads=1, **bad)


def test_cli_prints_the_read_bandwidth():
  proc = _run(*TINY, "--sparsities=0", "--formats=f32", "--noprogress")
  assert proc.returncode == 0, proc.stderr[-2000:]
  first = proc.stdout.splitlines()[0]
  m = re.search(r"read bandwidth ([0-9.]+) GB/s \(\d+ threads\), 50% of 2560-byte rows "
                r"([0-9.]+) GB/s;", first)
  assert m and float(m.group(1)) > 0 and float(m.group(2)) > 0, first


def test_matvec_copies_are_views_of_random_blocks():
  from host_ops import qmatmul
  mats = matvec.matvec_copies(40, 64, "q4_1", 3)
  assert len(mats) == 3 and all(w.shape == (40, 64) and w.kind == "q4_1" for w in mats)
  assert mats[0].arrays[0].base is mats[2].arrays[0].base  # Views of one array.
  assert len({w.arrays[0].tobytes() for w in mats}) == 3  # Each copy has its own codes.
  q8 = matvec.matvec_copies(8, 32, "q8_0", 2)[1]
  assert q8.arrays[0].dtype == np.int8 and np.abs(q8.arrays[0]).max() > 0
  m = matvec.bench_matvec(mats, qmatmul.DOT_F32, seconds=0.01, cold_bytes=1e3)
  assert m["time_s"] > 0 and m["g_weights_s"] > 0 and m["from_dram"]


def test_cli_matvec_table():
  from host_ops import qdot
  proc = _run(*TINY, "--nosparse_ops", "-o", "json", "--noprogress")
  assert proc.returncode == 0, proc.stderr[-2000:]
  doc = json.loads(proc.stdout)
  assert doc["rows"] == []
  dots = ["f32", "int8"] if qdot.AVAILABLE else ["f32"]
  got = [(r["matrix"], r["format"], r["dot"]) for r in doc["matvec"]]
  assert got == [(m, f, d) for m in ("gate", "down") for f in ("q4_1", "q8_0") for d in dots]
  for r in doc["matvec"]:
    assert r["g_weights_s"] > 0 and r["vs_bandwidth"] > 0
    assert (r["rows"], r["cols"]) == ((1536, 576) if r["matrix"] == "gate" else (576, 1536))
  # The sparse down pass: neuron-major rows of every format at each active fraction, each with
  # the dense Q4_1 down matvec's time and the ratio; bytes count the active rows (and the file
  # layout's scales, read whatever the active set).
  got = [(r["format"], r["dot"]) for r in doc["down_pass"]]
  assert got == [(f, d) for f in ("q8_0", "file") for _ in matvec.DOWN_ACTIVE for d in dots]
  for r in doc["down_pass"]:
    assert (r["rows"], r["cols"]) == (1536, 576) and 0 < r["active"] <= 1
    per_row = 576 // 32 * {"q4_1": 20, "file": 16}.get(r["format"], 34)
    fixed = 1536 * 576 // 8 if r["format"] == "file" else 0
    assert r["gb_s"] == pytest.approx((r["active"] * 1536 * per_row + fixed) / r["time_s"] / 1e9)
    assert r["vs_dense"] == pytest.approx(r["dense_time_s"] / r["time_s"])
    assert r["vs_bandwidth"] > 0
  assert sorted({r["active"] for r in doc["down_pass"]}) == list(matvec.DOWN_ACTIVE)
  proc = _run(*TINY, "--nosparse_ops", "--noprogress", "--nobandwidth")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "| smollm2-135m | gate | 1536 x 576 | q4_1 | f32 |" in proc.stdout
  assert "| smollm2-135m | 1536 x 576 | q8_0 | f32 | " in proc.stdout


def test_bench_kernels_rows_and_bad_flags():
  """`pijax.bench_kernels`: one JSON row per (kind, rows) with positive rates; bad flags are one
  line and exit 2 (no speed asserted)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  run = lambda *a: subprocess.run([sys.executable, "-m", "pijax.bench_kernels", *a], cwd=ROOT,
                                  env=env, capture_output=True, text=True, timeout=600)
  proc = run("--kinds", "q4_0,q6_k", "--rows", "1,9", "--cold_mb", "0", "--seconds", "0.05",
             "-o", "json")
  assert proc.returncode == 0, proc.stderr[-2000:]
  doc = json.loads(proc.stdout)
  assert [(r["kind"], r["rows"]) for r in doc["rows"]] == [("q4_0", 1), ("q4_0", 9),
                                                           ("q6_k", 1), ("q6_k", 9)]
  assert all(r["g_weights_s"] > 0 and r["gb_s"] > 0 for r in doc["rows"])
  for bad, name in ((["--rows", "0"], "--rows"), (["--kinds", "q2_k"], "--kinds"),
                    (["--cold_mb", "-1"], "--cold_mb")):
    proc = run(*bad)
    assert proc.returncode == 2 and name in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_markdown_table_lines():
  lines = tables.markdown_table(("a", "b"), "lr", [["x", "1"], ["", "2.5"]])
  assert lines == ["| a | b |", "| --- | ---: |", "| x | 1 |", "|  | 2.5 |"]
  with pytest.raises(ValueError, match="one letter per column"):
    tables.markdown_table(("a", "b"), "l", [])
