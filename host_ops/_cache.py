"""numba's on-disk cache for host_ops, keyed on every host_ops source, not on one file.

numba stamps a cached function with the hash of the file that defines it. The host kernels
inline and link kernels from other files (`layers.layers_kernel` runs `qdot`'s, `gated_ffn`'s
and `common`'s), so after an edit to `qdot.py` a cache of `layers_kernel` still loaded and ran
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
def _stamp(directory: str, files: tuple[tuple[str, int, int, int], ...]) -> bytes:
  digest = hashlib.sha256()
  for name, *_ in files:
    try:
      data = (pathlib.Path(directory) / name).read_bytes()
    except OSError:  # Gone since the listing: stamped as missing.
      data = b"\0missing"
    digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
  return digest.digest()


def package_stamp(directory: str | os.PathLike[str] = _DIR) -> bytes:
  """SHA-256 (32 bytes) over the names and contents of directory/*.py, in name order, skipping
  hidden names (editor lock files such as `.#qdot.py`) and files that cannot be read; re-read
  when a file's mtime, ctime or size changes."""
  directory = pathlib.Path(directory)
  files = []
  for p in directory.glob("*.py"):
    if p.name.startswith("."):
      continue
    try:
      st = p.stat()
    except OSError:  # A dangling link, or removed since the listing.
      continue
    files.append((p.name, st.st_mtime_ns, st.st_ctime_ns, st.st_size))
  return _stamp(str(directory), tuple(sorted(files)))


class PackageLocator:
  """A numba cache locator for functions defined in host_ops (see the module docstring): numba's
  own locator for the path and disambiguator, `package_stamp()` for the source stamp."""

  def __init__(self, inner):
    self._inner = inner
    self._py_file = getattr(inner, "_py_file", None)  # numba's warnings read it.

  def __getattr__(self, name):  # Anything else numba asks of a locator: the inner one's.
    return getattr(self._inner, name)

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
