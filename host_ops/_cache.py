"""numba's on-disk cache for host_ops, keyed on every host_ops source, not on one file.

numba stamps a cached function with the hash of the file that defines it. The host kernels
inline and link kernels from other files (`decoder._layers_kernel` runs `qdot`'s, `gated_ffn`'s
and `_common`'s), so after an edit to `qdot.py` a cache of `_layers_kernel` still loaded and ran
the old kernels: stale code after a `git pull`, and wrong timings in development (BUILD_NOTES.md,
issue 11). `install()` puts `PackageLocator` first among numba's cache locators: for functions
defined in host_ops it keeps the directory numba would have chosen and stamps the entry with
`package_stamp()` (SHA-256 over every host_ops/*.py), so a change to any of them invalidates
every host_ops cache entry; other functions are left to numba.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib

from numba.core import caching

_DIR = pathlib.Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def _stamp(directory: str, files: tuple[tuple[str, int, int], ...]) -> bytes:
  digest = hashlib.sha256()
  for name, _, _ in files:
    digest.update(name.encode() + b"\0")
    digest.update((pathlib.Path(directory) / name).read_bytes())
  return digest.digest()


def package_stamp(directory: str | os.PathLike[str] = _DIR) -> bytes:
  """SHA-256 (32 bytes) over the names and contents of directory/*.py, in name order; re-read
  when a file's mtime or size changes. Raises OSError when a file cannot be read."""
  directory = pathlib.Path(directory)
  files = tuple(sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size)
                       for p in directory.glob("*.py")))
  return _stamp(str(directory), files)


class PackageLocator:
  """A numba cache locator for functions defined in host_ops (see the module docstring): numba's
  own locator for the path and disambiguator, `package_stamp()` for the source stamp."""

  def __init__(self, inner):
    self._inner = inner

  @classmethod
  def from_function(cls, py_func, py_file):
    """The locator for py_func, or None (numba tries its own) outside host_ops."""
    try:
      if pathlib.Path(py_file).resolve().parent != _DIR:
        return None
    except OSError:
      return None
    for base in caching.CacheImpl._locator_classes:
      if base is cls:
        continue
      inner = base.from_function(py_func, py_file)
      if inner is not None:
        return cls(inner)
    return None

  def ensure_cache_path(self):
    self._inner.ensure_cache_path()

  def get_cache_path(self):
    return self._inner.get_cache_path()

  def get_source_stamp(self):
    return package_stamp()

  def get_disambiguator(self):
    return self._inner.get_disambiguator()


def install() -> bool:
  """Puts PackageLocator first in numba's locator list (once). False, and nothing changed, where
  this numba keeps no such list (then each file keys its own functions, as numba does)."""
  classes = getattr(caching.CacheImpl, "_locator_classes", None)
  if not isinstance(classes, list):
    return False
  if PackageLocator not in classes:
    classes.insert(0, PackageLocator)
  return True
