"""`python -m pijax.bench_kernels`: G weights/s of the packed integer matmul per block kind.

  python -m pijax.bench_kernels -t 2 --rows 1,8,128

For every kind with a packed layout (`host_ops.qpack`: Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
Q6_K, Q8_0) one LLaMA-7B up-projection-shaped matrix [11008, 4096] of random blocks is timed against
b activation rows: b = 1 is decode (every weight read once per token: the copies are cycled
through `--cold_mb` of memory so they come from DRAM), b = 8 batched decode, b = 128 prefill
(both from cache: arithmetic bound). Each row: weights x b / s in 10^9 (G weights/s), and for
b = 1 the file bytes read per second (GB/s) beside `pijax.measure.bandwidth.read_bandwidth`'s
pass over the same memory. Activation quantization is included (it runs once per matmul).
`--row_kernels` adds the same product through the row kernels (`QMatrix.matmul(dot="int8")`,
what runs where a matrix is not packed) beside each packed figure.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from pijax.errors import ConfigError

SHAPE = (11008, 4096)
MAX_ROWS = 4096  # Activation rows per matmul --rows accepts.


def _rate(call, copies, seconds):
  """Seconds per call(copy) over `seconds` (at least one pass over the copies; one warm-up)."""
  call(copies[0])
  calls, t0 = 0, time.perf_counter()
  while True:
    call(copies[calls % len(copies)])
    calls += 1
    elapsed = time.perf_counter() - t0
    if elapsed >= seconds and calls >= len(copies):
      return elapsed / calls


def kernel_rate(kind: str, rows: int, threads: int, cold_bytes: float, seconds: float,
                seed: int = 0, row_kernels: bool = False) -> dict:
  """{"kind", "rows", "g_weights_s", "gb_s"} of `qpack.matmul` on `kind` blocks: mean over
  `seconds` of calls (b = 1 cycles through copies filling cold_bytes, so weights come from
  DRAM; else one copy). gb_s: file bytes of the matrix per second. row_kernels: also
  "rows_g_weights_s", the same product by `QMatrix.matmul(dot="int8")` (the file's rows)."""
  from host_ops import common
  from host_ops import qblocks
  from host_ops import qpack
  common.set_host_threads(threads)
  common.ensure_host_threads()
  rng = np.random.default_rng(seed)
  n, d = SHAPE
  per, nbytes = qblocks.GEOMETRY[kind]
  raw = rng.integers(0, 256, (n, d // per * nbytes), dtype=np.uint8)
  # Scales as small finite f16 values (random bytes could be inf/NaN).
  raw_blocks = raw.reshape(n, d // per, nbytes)
  scale_at = {"q4_k": (0, 4), "q5_k": (0, 4), "q6_k": (nbytes - 2, nbytes)}.get(kind, (0, 2))
  halves = rng.uniform(1e-3, 1e-2, raw_blocks.shape[:2] + ((scale_at[1] - scale_at[0]) // 2,))
  raw_blocks[:, :, scale_at[0]:scale_at[1]] = halves.astype(np.float16).view(np.uint8).reshape(
      raw_blocks.shape[:2] + (-1,))
  if kind in ("q4_1", "q5_1"):  # The m (offset) half beside d.
    raw_blocks[:, :, 2:4] = halves[..., :1].astype(np.float16).view(np.uint8).reshape(
        raw_blocks.shape[:2] + (-1,))
  first = qpack.pack(kind, raw)
  copies = [first]
  if rows == 1:
    copies += [first.copy() for _ in range(max(0, int(cold_bytes // first.nbytes)))]
  x = rng.standard_normal((rows, d)).astype(np.float32)
  out = np.empty((rows, n), np.float32)
  per_call = _rate(lambda p: qpack.matmul(kind, p, x, out), copies, seconds)
  row = {"kind": kind, "rows": rows, "g_weights_s": n * d * rows / per_call / 1e9,
         "gb_s": raw.nbytes / per_call / 1e9}
  if row_kernels:
    from host_ops import qmatmul
    del copies
    mats = [qmatmul.from_gguf_blocks(kind, raw, SHAPE)]
    if rows == 1:
      mats += [qmatmul.from_gguf_blocks(kind, raw.copy(), SHAPE)
               for _ in range(max(0, int(cold_bytes // raw.nbytes)))]
    per_call = _rate(lambda w: w.matmul(x, out, dot="int8"), mats, seconds)
    row["rows_g_weights_s"] = n * d * rows / per_call / 1e9
  return row


def main(argv: list[str]) -> None:
  del argv
  from absl import flags
  from host_ops import qpack
  from pijax.measure import bandwidth as bandwidth_lib
  from pijax.measure import tables
  f = flags.FLAGS
  try:
    rows = [int(r) for r in f.rows]
  except ValueError:
    rows = []
  if not rows or min(rows) < 1:
    raise ConfigError(f"--rows={','.join(f.rows)} must be row counts >= 1, e.g. 1,8,128.")
  if f.output not in ("md", "json"):
    raise ConfigError(f"-o {f.output!r} must be md or json.")
  if len(set(rows)) != len(rows) or max(rows) > MAX_ROWS:
    raise ConfigError(f"--rows={','.join(f.rows)}: distinct row counts <= {MAX_ROWS}.")
  kinds = f.kinds or list(qpack.KINDS)
  if len(set(kinds)) != len(kinds):
    raise ConfigError(f"--kinds={','.join(kinds)}: each kind once.")
  bad = [k for k in kinds if k not in qpack.KINDS]
  if bad:
    raise ConfigError(f"--kinds: {', '.join(bad)} have no packed kernel; choose from "
                      f"{', '.join(qpack.KINDS)}.")
  if f.threads < 1 or not 0 < f.seconds < 3600:
    raise ConfigError("-t must be >= 1 and --seconds in (0, 3600).")
  from host_ops import common
  ram = common.physical_memory_bytes() or float("inf")
  if not 0 <= f.cold_mb * 1e6 <= ram / 2:
    raise ConfigError(f"--cold_mb={f.cold_mb} must be in [0, {ram / 2e6:.0f}] (half this "
                      "machine's memory; 0: every row from cache).")
  cold = f.cold_mb * 1e6
  # 0: b = 1 from cache too (the arithmetic's own speed); no bandwidth to compare with.
  bandwidth = bandwidth_lib.read_bandwidth(cold, f.threads) if cold else float("nan")
  table = [kernel_rate(k, r, f.threads, cold, f.seconds, row_kernels=f.row_kernels)
           for k in kinds for r in rows]
  if f.output == "json":
    sys.stdout.write(json.dumps({"threads": f.threads, "read_gb_s": bandwidth if cold else None,
                                 "shape": SHAPE,
                                 "rows": table}, indent=1) + "\n")
    return
  read = (f"read bandwidth {bandwidth:.1f} GB/s (bench_ops pass over {f.cold_mb:.0f} MB)"
          if cold else "every row from cache (--cold_mb 0)")
  cells = []
  for k in kinds:
    mine = [t for t in table if t["kind"] == k]
    one = [t["gb_s"] for t in mine if t["rows"] == 1]
    share = f" ({100 * one[0] / bandwidth:.0f}%)" if one and cold else ""
    cells.append([k, *(f"{t['g_weights_s']:.1f}" + (f" ({t['rows_g_weights_s']:.1f})"
                                                     if f.row_kernels else "") for t in mine),
                  f"{one[0]:.1f}{share}" if one else "-"])
  lines = [f"threads {f.threads}, [{SHAPE[0]}, {SHAPE[1]}] per kind, {read}", "",
           *tables.markdown_table(["kind", *(f"b={r} G weights/s" for r in rows), "b=1 GB/s"],
                                  "l" + "r" * (len(rows) + 1), cells)]
  if f.row_kernels:
    lines.append("(in parentheses: the row kernels, QMatrix.matmul(dot='int8'))")
  sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  from absl import flags as absl_flags
  from pijax import cli
  absl_flags.DEFINE_list("rows", ["1", "8", "128"], "Activation rows per matmul.")
  absl_flags.DEFINE_list("kinds", [], "Block kinds (default: every packed kind).")
  absl_flags.DEFINE_integer("threads", 2, "Host threads.", short_name="t")
  absl_flags.DEFINE_float("seconds", 1.0, "Time per row of the table.")
  absl_flags.DEFINE_float("cold_mb", 2000.0, "Memory the b=1 copies fill (MB), beyond the "
                          "caches; 0 times b=1 from cache.")
  absl_flags.DEFINE_string("output", "md", "md or json.", short_name="o")
  absl_flags.DEFINE_bool("row_kernels", False, "Also time the row kernels (QMatrix.matmul "
                         "with dot='int8') on the same blocks.")
  cli.run(main, "pijax.bench_kernels")
