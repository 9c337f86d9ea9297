"""numba's on-disk cache of the host kernels follows edits to any host_ops file (`host_ops._cache`)."""

import os
import pathlib
import shutil
import subprocess
import sys

import numba

from host_ops import _cache
from host_ops import qdot

HOST_OPS = pathlib.Path(_cache.__file__).resolve().parent


def test_package_stamp_follows_every_source_file(tmp_path):
  step = [10**9]

  def write(name, text):  # Each write gets its own mtime, whatever the clock's granularity.
    path = tmp_path / name
    path.write_text(text)
    step[0] += 10**9
    os.utime(path, ns=(step[0], step[0]))

  write("a.py", "x = 1\n")
  write("b.py", "y = 2\n")
  first = _cache.package_stamp(tmp_path)
  assert len(first) == 32 and _cache.package_stamp(tmp_path) == first
  (tmp_path / "notes.txt").write_text("not a source")
  os.symlink("me@host.1:1", tmp_path / ".#a.py")  # An editor's lock file: a dangling link.
  os.symlink("gone.py", tmp_path / "d.py")  # A dangling source link: skipped, no error.
  assert _cache.package_stamp(tmp_path) == first
  write("b.py", "y = 3\n")  # Same size, other content.
  assert _cache.package_stamp(tmp_path) != first
  write("b.py", "y = 2\n")
  assert _cache.package_stamp(tmp_path) == first
  write("c.py", "")
  assert _cache.package_stamp(tmp_path) != first


@numba.njit(cache=True)
def _outside(x):
  return x + 1


def test_host_ops_functions_are_stamped_with_the_package():
  assert _outside(1) == 2
  locator = qdot.gemv_q4_1._cache._impl.locator
  assert isinstance(locator, _cache.PackageLocator)
  assert locator.get_source_stamp() == _cache.package_stamp()
  assert pathlib.Path(locator.get_cache_path()).name == "__pycache__" or \
      os.environ.get("NUMBA_CACHE_DIR")
  # Functions outside host_ops keep numba's own locator and stamp.
  assert not isinstance(_outside._cache._impl.locator, _cache.PackageLocator)
  # numba's warnings about uncachable functions read the locator's file.
  assert pathlib.Path(locator._py_file).resolve() == HOST_OPS / "qdot.py"


_RUN = """
import numpy as np
from host_ops import layers
g = np.full((1, 3), 2.0, np.float32)
y = layers.activation_kernel(g, g, 1)
print(float(y[0, 0]), sum(layers.activation_kernel.stats.cache_hits.values()))
"""


def test_cached_kernel_reruns_an_edit_in_another_file(tmp_path):
  """`layers.activation_kernel` inlines `common.activation`. In a copy of host_ops, edit
  common.py only: the next process must run the edited activation, not the cached kernel
  (numba alone keys the kernel on layers.py and loaded the stale one)."""
  pkg = tmp_path / "host_ops"
  shutil.copytree(HOST_OPS, pkg, ignore=shutil.ignore_patterns("__pycache__"))
  env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
  env["PYTHONPATH"] = str(tmp_path)

  def run():
    proc = subprocess.run([sys.executable, "-c", _RUN], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    value, hits = proc.stdout.split()
    return float(value), int(hits)

  assert run() == (4.0, 0)  # ReGLU: relu(2) * 2, compiled.
  assert run() == (4.0, 1)  # Loaded from the copy's cache.
  common = pkg / "common.py"
  text = common.read_text()
  old = "  if code == 1:\n    if g > 0:\n      return np.float32(g * u)\n"
  assert old in text
  common.write_text(text.replace(old, "  if code == 1:\n    if g > 0:\n"
                                      "      return np.float32(g * u + 1)\n"))
  assert run() == (5.0, 0)  # The edit runs: recompiled, not the stale entry.
  assert run() == (5.0, 1)
