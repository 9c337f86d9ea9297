"""scripts/gpu_check.sh: the CPU smoke mode end to end, and its closing table."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def _report(tmp_path, rows, kernel_log=None):
  results = tmp_path / "results.tsv"
  results.write_text("".join("\t".join(r) + "\n" for r in rows))
  cmd = [sys.executable, str(SCRIPTS / "gpu_check_report.py"), str(results)]
  if kernel_log is not None:
    log = tmp_path / "kernels.log"
    log.write_text(kernel_log)
    cmd += ["--kernel-log", str(log)]
  return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


KERNEL_LOG = """\
| shape | dtype | active % | bn/bd/warps/stages | status | max err | ref err (f64) | kernel us \
| kernel us (in jit) | ref us | ref us (in jit) | dense us (in jit) | GB/s (in jit) | GB/s (call) |
|""" + " --- |" * 14 + """
| tiny (d=64, n_hot=96) | float32 | 10% | 32/auto/auto/auto | ok | 8.94e-08 | 6.37e-08 | 59.1 \
| 37.0 | 52.8 | 22.7 | 26.8 | 0.2 | 0.1 |
| llama7b (d=4096, n_hot=11008) | bfloat16 | 10% | 32/auto/auto/auto | ok | 2.00e-06 | 1e-07 \
| 90.0 | 41.5 | 80.0 | 70.0 | 300.0 | 650.1 | 300.2 |
| llama7b (d=4096, n_hot=11008) | bfloat16 | 50% | 32/auto/auto/auto | FAIL (ValueError) | - \
| 1e-07 | - | - | 80.0 | 70.0 | 300.0 | - | - |
"""


def test_report_table_and_exit_status(tmp_path):
  ok = _report(tmp_path, [("kernels", "PASS", "", ""), ("x [tiny]", "PASS", "1.0 tok/s", "d")],
               KERNEL_LOG)
  assert ok.returncode == 0, ok.stdout + ok.stderr
  lines = ok.stdout.strip().splitlines()
  assert lines[0].startswith("| step") and lines[-1].startswith("| overall") and "PASS" in lines[-1]
  kernels = next(line for line in lines if line.startswith("| kernels"))
  assert "2/3 ok" in kernels and "worst err 2.0e-06" in kernels
  assert "llama7b bfloat16 10%: kernel 41.5 us in jit vs dense 300.0 us" in kernels

  bad = _report(tmp_path, [("a", "PASS", "", ""), ("b", "FAIL", "", "ValueError: boom")])
  assert bad.returncode == 1
  assert "ValueError: boom" in bad.stdout and "1 of 2 rows failed" in bad.stdout
  assert _report(tmp_path, []).returncode == 1  # No rows at all is a failure.


@pytest.mark.slow
def test_cpu_smoke_mode_passes(tmp_path):
  """GPU_CHECK_CPU=1: interpreted kernel on the tiny shape, hybrid checks on a 2-layer model."""
  env = dict(os.environ, GPU_CHECK_CPU="1", GPU_CHECK_MODEL="tiny", GPU_CHECK_TINY_LAYERS="2",
             GPU_CHECK_OUT=str(tmp_path / "out"), PYTHON=sys.executable, JAX_PLATFORMS="cpu")
  proc = subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh")], capture_output=True, text=True,
                        env=env, timeout=600, cwd=ROOT)
  out = proc.stdout
  assert proc.returncode == 0, out[-4000:] + proc.stderr[-2000:]
  table = out[out.rindex("| step"):].strip().splitlines()
  assert table[-1].startswith("| overall") and "PASS" in table[-1]
  body = "\n".join(table)
  for step in ("environment", "kernels", "hybrid model",
               "oracle thr=0 hot=0.3 f32 rows vs dense [tiny]",
               "oracle thr=0 hot=1.0 f32 rows vs dense [tiny]",
               "oracle thr=0 hot=0.3 int8 rows vs dense [tiny]", "oracle thresholds hot=0.3",
               "bench tg32 dense [tiny]", "bench tg32 predictor hot=0.3 [tiny]"):
    assert step in body, body
  assert "| FAIL" not in body
