"""Writes a copy of a GGUF with every quantized matrix dequantized to F16 or BF16.

  .venv/bin/python scripts/gguf_to_float.py --type F16 --out /tmp/smollm2-f16.gguf  # default model
  .venv/bin/python scripts/gguf_to_float.py --type BF16 --src M.gguf --out M-bf16.gguf

The files people run in F16/BF16 are the unquantized releases (llama.cpp's convert_hf_to_gguf
output); none is installed here (nothing is downloaded), so this writes one from a quantized file:
the same model, metadata and tokenizer, each Q* matrix as its dequantized values rounded to the
16-bit type (gguf's own dequantizer and converter), F32 tensors (norms) kept. Used to measure the
host engine's F16/BF16 path against llama.cpp on the same file (BUILD_NOTES, issue 30).

The copy is written to a temp name beside --out and renamed when complete (an interrupted run,
Ctrl-C or SIGTERM, leaves nothing). Bad input (a missing or non-GGUF --src, an unknown --type, an
--out that cannot be written or is the source) exits 2 with one line, before any work.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import numpy as np

TYPES = ("F16", "BF16")
# general.file_type values (llama.cpp's LLAMA_FTYPE_MOSTLY_F16 / _BF16).
FILE_TYPES = {"F16": 1, "BF16": 32}


def convert(src: str, out: str, qtype: str) -> int:
  """Writes the copy; returns the number of matrices converted (every 2-D matrix not already of
  `qtype`: quantized ones and the other 16-bit float type).

  Raises:
    ValueError: src is not a readable GGUF.
  """
  import gguf  # pylint: disable=import-outside-toplevel
  try:
    reader = gguf.GGUFReader(src)
  except Exception as e:  # gguf raises ValueError / struct errors on a bad header.
    raise ValueError(f"{src} is not a readable GGUF ({e})") from e
  target = gguf.GGMLQuantizationType[qtype]
  keep = (gguf.GGMLQuantizationType.F32, target)
  arch = reader.fields["general.architecture"].contents()
  tmp = f"{out}.tmp{os.getpid()}"
  try:  # From the writer's first byte: an interrupted run leaves no temp file.
    writer = gguf.GGUFWriter(tmp, arch, endianess=reader.endianess)
    for field in reader.fields.values():
      if field.name == "general.architecture" or field.name.startswith("GGUF."):
        continue
      value = FILE_TYPES[qtype] if field.name == "general.file_type" else field.contents()
      sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
      writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
    if "general.file_type" not in reader.fields:
      writer.add_file_type(FILE_TYPES[qtype])
    converted = 0
    for t in reader.tensors:
      kind = gguf.GGMLQuantizationType(t.tensor_type)
      if kind in keep or len(t.shape) < 2:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=kind)
        continue
      values = gguf.quants.dequantize(t.data, kind)  # f32[rows, cols]
      data = gguf.quants.quantize(values.astype(np.float32), target)
      writer.add_tensor(t.name, data, raw_dtype=target)  # u8 bytes of a BF16 matrix: shape from them
      converted += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
  return converted


def _check_out(src: str, out: str) -> str | None:
  """Why --out cannot be written (None if it can), checked before any work."""
  folder = os.path.dirname(os.path.abspath(out))
  if os.path.isdir(out):
    return f"--out {out!r} is a directory; give a file path"
  if not os.path.isdir(folder):
    return f"--out {out!r}: folder {folder!r} does not exist; create it or pick another path"
  if not os.access(folder, os.W_OK):
    return f"--out {out!r}: folder {folder!r} is not writable; pick another path"
  if os.path.exists(out) and os.path.samefile(src, out):
    return f"--out {out!r} is the source file; write the copy to another path"
  return None


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--src", default="default",
                      help="source GGUF ('default': the SmolLM2-135M-Instruct Q4_1 file)")
  parser.add_argument("--type", default="F16", help="F16 or BF16")
  parser.add_argument("--out", required=True, help="output GGUF path")
  args = parser.parse_args(argv)
  if args.type.upper() not in TYPES:
    print(f"error: --type must be one of {', '.join(TYPES)}, got {args.type!r}", file=sys.stderr)
    return 2
  src = args.src
  if src == "default":
    from pijax.formats import gguf as gguf_format  # pylint: disable=import-outside-toplevel
    src = gguf_format.default_model_path()
  if not os.path.isfile(src):
    print(f"error: --src {src!r} is not a file; pass a GGUF path", file=sys.stderr)
    return 2
  problem = _check_out(src, args.out)
  if problem:
    print(f"error: {problem}", file=sys.stderr)
    return 2
  # SIGTERM unwinds like Ctrl-C, so `convert` removes its temp file.
  signal.signal(signal.SIGTERM, signal.default_int_handler)
  try:
    n = convert(src, args.out, args.type.upper())
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"interrupted: nothing written to {args.out}", file=sys.stderr)
    return 130
  print(f"{args.out}: {n} matrices written as {args.type.upper()}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
