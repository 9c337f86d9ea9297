"""What `pijax.load` checks of a model file before any weight is read: that a KV cache of the
asked length fits in RAM, and (file stamps) that the file has not changed since its metadata
was read, when its weights are read later (lazily)."""

from __future__ import annotations

import os
from typing import Any

from pijax.errors import ConfigError, GGUFError

FileStamp = tuple[int, int, int]  # (size, mtime_ns, inode)


def check_kv_fits(config: Any, seq: int, path: str) -> None:
  """ConfigError when an f32 KV cache of `seq` tokens would not fit in this machine's RAM (a
  128k-token context, or a lying `context_length`), before anything is allocated."""
  from pijax.nn import transformer as model_lib
  need = model_lib.kv_cache_bytes(config, 1, seq, 4)
  try:
    have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError, AttributeError):
    return
  if need > have:
    raise ConfigError(f"{path}: a KV cache of {seq} tokens needs {need / 2**30:.1f} GiB, more "
                      f"than this machine's {have / 2**30:.1f} GiB of RAM; pass a smaller "
                      "--max_seq_len (e.g. 4096).")


def file_stamp(path: str) -> FileStamp | None:
  """The file's (size, mtime_ns, inode) now; None when it cannot be read."""
  try:
    st = os.stat(path)
  except OSError:
    return None
  return st.st_size, st.st_mtime_ns, st.st_ino


def check_unchanged(path: str, stamp: FileStamp | None) -> None:
  """Raises GGUFError when the model file changed (size, mtime or inode: a symlink re-pointed,
  a file replaced) since `load` read its metadata: weights read later (lazily) would not
  match the config."""
  now = file_stamp(path)
  if stamp is not None and now is not None and now != stamp:
    raise GGUFError(f"{path}: the file changed since it was loaded; load it again.")
