"""Probes of the machine: CPU model name, cores, L3 size, and the `machine:` line of the benches."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
from typing import Any

DEFAULT_L3_BYTES = 260 * 2**20  # When neither /sys nor lscpu gives the L3 size.


def parse_size(text: str) -> int | None:
  """"266240K" / "260 MiB" / "32 MB" -> bytes (binary units); None if unparsable."""
  m = re.match(r"\s*([0-9.]+)\s*([KMGT]?)(i?B)?", text, re.IGNORECASE)
  if not m:
    return None
  scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2).upper()]
  return int(float(m.group(1)) * scale)


def lscpu() -> str:
  """`lscpu`'s output in the C locale; "" when it cannot run."""
  try:
    return subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                          env=dict(os.environ, LC_ALL="C")).stdout
  except (OSError, subprocess.SubprocessError):
    return ""


def cpu_name() -> str | None:
  """lscpu's "Model name", else /proc/cpuinfo's "model name", else None."""
  m = re.search(r"^Model name:\s*(.+)$", lscpu(), re.MULTILINE)
  if m:
    return m.group(1).strip()
  try:
    m = re.search(r"^model name\s*:\s*(.+)$", pathlib.Path("/proc/cpuinfo").read_text(),
                  re.MULTILINE)
  except OSError:
    return None
  return m.group(1).strip() if m else None


def l3_bytes() -> int:
  """L3 size in bytes (one instance): /sys cpu0 cache, else lscpu "L3 cache", else 260 MiB."""
  best = (0, 0)  # (level, bytes) of the highest cache level seen
  for index in pathlib.Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
    try:
      level = int((index / "level").read_text())
      size = parse_size((index / "size").read_text())
    except (OSError, ValueError):
      continue
    if size and (level, size) > best:
      best = (level, size)
  if best[0] >= 3:
    return best[1]
  m = re.search(r"^L3 cache:\s*(.+)$", lscpu(), re.MULTILINE)
  size = parse_size(m.group(1)) if m else None
  return size or DEFAULT_L3_BYTES


def machine_info(threads: int | None = None, backend: str | None = None) -> dict[str, Any]:
  """The machine line's facts: cpu model (lscpu "Model name"), cores, L3 bytes, numba, jax."""
  import numba
  info = {"cpu": cpu_name() or "unknown cpu", "cores": os.cpu_count(), "l3_bytes": l3_bytes(),
          "numba": numba.__version__, "threads": threads, "backend": backend}
  if backend is not None:
    import jax
    info["jax"] = jax.__version__
    info["device"] = jax.devices()[0].device_kind
  return info


def format_machine(info: dict[str, Any]) -> str:
  """`machine: <lscpu Model name>, <cores> cores, L3 <MiB>[, read bandwidth <GB/s>[, <p>% of
  <n>-byte rows <GB/s>]]; numba <v>, <t> threads[; jax ...]`."""
  bandwidth = (f", read bandwidth {info['read_gb_s']:.1f} GB/s ({info['threads']} threads)"
               if info.get("read_gb_s") else "")
  if info.get("gathered_read_gb_s"):
    bandwidth += (f", {info['gathered_fraction']:.0%} of {info['gathered_row_bytes']}-byte rows "
                  f"{info['gathered_read_gb_s']:.1f} GB/s")
  line = (f"machine: {info['cpu']}, {info['cores']} cores, L3 {info['l3_bytes'] / 2**20:.0f} MiB"
          f"{bandwidth}; numba {info['numba']}, {info['threads']} threads")
  if info.get("backend"):
    line += f"; jax {info['jax']}, backend {info['backend']} ({info['device']})"
  return line
