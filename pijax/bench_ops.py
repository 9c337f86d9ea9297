"""`python -m pijax.bench_ops`: the sparse FFN operators at real layer shapes, weights from DRAM.

  python -m pijax.bench_ops                 # LLaMA-2 7B/13B/70B layers, host f32 + q8 (+ Pallas)
  python -m pijax.bench_ops --shapes=smollm2-135m --sparsities=0,90 --formats=f32 --seconds=0.2
  python -m pijax.bench_ops --shapes=llama2-7b --sparsities=0,90 -o json

Ops (b = 1 token, family swiglu, so every active neuron reads its gate, up and down rows):
  host    `host_ops.sparse_ffn.HostFFNWeights` (numba, `--threads` threads), weight formats "f32"
          and "q8" (`host_ops.quant`: int8 + one f32 scale per 32 values, 1.125 bytes/weight).
          Time per call = one Python call `w(x, ids)` (wrapper, id checks and the final reduction
          included), median over every timed call.
  pallas  `pallas_kernels.sparse_ffn.sparse_ffn` (Triton, default blocks), formats "f32" and
          "bf16"; only where `jax.default_backend() == "gpu"`. Timed inside one jitted fori_loop
          of data-dependent calls (x <- x + 1e-6 * y, as inside a decode step: no per-call
          dispatch), time per call = loop time / calls, median over 5 loops.

Active sets (the power law; neurons sorted by frequency as in our bundles, neuron 0 the hottest):
neuron i (0-based) of a layer with n neurons is active, independently per call, with probability

  p_i = min(1, c * (i + 1) ** -alpha)          alpha = --alpha (default 1.0)

with c > 0 solved (bisection, float64) so that sum_i p_i = (1 - sparsity) * n: the expected active
fraction is exactly the target and the id lists are sorted ascending. At alpha = 1 and 90% sparsity
on n = 11008 the first ~220 neurons are always active, the last fires with p ~ 0.02, and the top
26% of neurons carry ~74% of the activations. Each row draws 16 id sets with
`np.random.default_rng([seed, n, round(sparsity * 1e4)])` (--seed, default 0), so every op and
format at one (shape, sparsity) sees the same sets; the weights are N(0, 1/D) from
`np.random.default_rng([seed, n, D])` (host) or `jax.random.key(seed)` (pallas).

Rows come from DRAM, not cache. The layer is stored `copies` times in one array of copies * n
neurons (copy c = rows [c n, (c + 1) n), its ids offset by c n), and successive calls cycle over
the copies, so the bytes read between two reads of one copy (the "reuse distance") are
copies * (bytes per call). With power-law sets the hot head of a layer is read by every call, so
one copy of a layer bigger than the cache is not enough at high sparsity (70B f32 at 95%: 141 MB
per call, 260 MB L3). Host: copies are as many as `--max_gb` allows, up to what the sparsest row
needs; when copies * bytes per call stay under the cold target (--cold_mb, default 2.3 x the L3
size: /sys, else lscpu, else 260 MiB -> 627 MB), each call is preceded by an untimed read of
(cold - copies * bytes per call) / copies bytes of a separate buffer (CacheFlusher), so every row
reads weights last touched at least `cold` bytes ago. Memory: copies * layer bytes (3 * n * D * 4
f32; 3 * n * D * 1.125 q8) + the flush buffer (cold bytes) <= --max_gb (default 6 GB; 70B f32 is
2.82 GB a copy, so one); layers are generated and quantized 4096 rows at a time (no full f32 layer
beside the q8 one). Pallas: copies fill up to 40% of the
device memory and the int32 offset limit of the kernel (copies * n * D < 2**31), no flush; the
JSON says per row whether the reuse distance reached the cold target.

Columns: time/call (median), bytes read = mean over the timed calls of (active neurons) * (bytes
per neuron: 3 D * 4 f32, 3 D * 1.125 q8, 3 D * 2 bf16), GB/s = bytes read / time/call, vs dense =
this row's GB/s / GB/s of the same op, format and shape at 0% sparsity ("-" when 0 is not among
--sparsities). Issue target: >= 70% at 90% sparsity, LLaMA-2-7B shapes.

Dense decode matvecs (`--matvec`, on by default): `host_ops.qmatmul.QMatrix.matmul` of one row
x over each shape's gate [n, D] and down [D, n] matrices in the GGUF block formats q4_1 and q8_0
(random codes and scales), with dot "f32" (x kept f32) and "int8" (x quantized per block, integer
SIMD products: `host_ops.qdot`). Copies of the matrix are cycled so each call reads it from DRAM
(as the host op above). Columns: time/call (median), G weights/s, GB/s of the GGUF block bytes,
and that as a share of the measured read bandwidth.

The machine line also gives the memory read bandwidth (`read_bandwidth`: the best of 5 integer-sum
passes over a buffer of the cold target's size, with --threads threads; --nobandwidth skips it),
the ceiling of every bandwidth-bound row, and the same over a random half of 2560-byte rows
(`gathered_read_bandwidth`: a 7B Q4_1 up row), the ceiling of the sparse kernels, which read only
the rows of active neurons.
"""

# This module holds the flags, their checks and the run; the measuring is in `pijax.measure`
# (`machine`, `bandwidth`, `active_sets`, `sparse_op`, `matvec`), the report in its `tables`.

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys
import time

import numba
import numpy as np

import host_ops
from pijax.errors import ConfigError
from pijax.measure import tables
from pijax.measure.active_sets import DEFAULT_ALPHA, ID_SETS, draw_sets
from pijax.measure.bandwidth import (GATHER_FRACTION, GATHER_ROW_BYTES, CacheFlusher,
                                     gathered_read_bandwidth, read_bandwidth)
from pijax.measure.machine import format_machine, l3_bytes, machine_info
from pijax.measure.matvec import (DOWN_ACTIVE, MATVEC_FORMATS, DownPassRow, MatvecRow,
                                  bench_matvec, down_rows_copies, matvec_copies, time_down_pass)
from pijax.measure.sparse_op import (FORMATS, HOST_FORMATS, I32_LIMIT, OP_HOST, OP_PALLAS,
                                     PALLAS_FORMATS, Row, add_vs_dense, bench_host, bench_pallas,
                                     bytes_per_neuron, gpu_pool_bytes, host_layer_copies,
                                     pallas_layer_copies, plan_copies)

# name -> (hidden D, intermediate n) of one FFN layer.
SHAPES = {
    "smollm2-135m": (576, 1536),
    "llama2-7b": (4096, 11008),
    "llama2-13b": (5120, 13824),
    "llama2-70b": (8192, 28672),
}
DEFAULT_SHAPES = ("llama2-7b", "llama2-13b", "llama2-70b")
DEFAULT_SPARSITIES = (0.0, 0.5, 0.8, 0.9, 0.95)
COLD_FACTOR = 2.3  # cold target = 2.3 x L3 (627 MB on the 260 MiB L3 of the dev machines).
DEFAULT_MAX_GB = 6.0


@dataclasses.dataclass
class Options:
  """Validated settings of one run (see the flags)."""

  shapes: list[str]
  sparsities: list[float]  # fractions in [0, 1)
  formats: list[str]
  ops: list[str]
  threads: int
  seconds: float
  output: str
  alpha: float = DEFAULT_ALPHA
  seed: int = 0
  max_bytes: float = DEFAULT_MAX_GB * 1e9
  cold_bytes: float | None = None  # None: COLD_FACTOR * l3_bytes()
  backend: str | None = None  # jax.default_backend(), when it was asked

  def cold_target(self) -> float:
    """Bytes read between two reads of one copy: cold_bytes, else COLD_FACTOR x the L3 size."""
    return self.cold_bytes or COLD_FACTOR * l3_bytes()


def _split(text: str) -> list[str]:
  return [v.strip() for v in str(text).split(",") if v.strip()]


def parse_options(*, shapes: str, sparsities: str, formats: str, ops: str, threads: int,
                  seconds: float, output: str, alpha: float = DEFAULT_ALPHA, seed: int = 0,
                  max_gb: float = DEFAULT_MAX_GB, cold_mb: float | None = None,
                  backend: str | None = None, sparse_ops: bool = True) -> Options:
  """Checks flag values; raises ConfigError with one line naming the bad flag.

  ops "auto" = host, plus pallas when backend == "gpu". backend: jax.default_backend() (only
  needed when ops is "auto" or names pallas).
  """
  names = _split(shapes)
  bad = [s for s in names if s not in SHAPES]
  if not names or bad:
    raise ConfigError(f"--shapes={shapes!r}: unknown shape {bad[0] if bad else ''!r}; choose from "
                      f"{', '.join(SHAPES)} (comma list).")
  try:
    pcts = [float(v) for v in _split(sparsities)]
  except ValueError:
    raise ConfigError(f"--sparsities={sparsities!r} must be a comma list of percentages, "
                      f"e.g. 0,50,90.") from None
  if not pcts or any(not 0.0 <= p < 100.0 for p in pcts):
    raise ConfigError(f"--sparsities={sparsities!r}: each value must be a percentage in [0, 100).")
  fmts = _split(formats)
  bad = [f for f in fmts if f not in FORMATS]
  if not fmts or bad:
    raise ConfigError(f"--formats={formats!r}: unknown format {bad[0] if bad else ''!r}; choose "
                      f"from {', '.join(FORMATS)} (host: f32, q8; pallas: f32, bf16).")
  op_names = _split(ops)
  if op_names == ["auto"]:
    op_list = [OP_HOST] + ([OP_PALLAS] if backend == "gpu" else [])
  else:
    bad = [o for o in op_names if o not in (OP_HOST, OP_PALLAS)]
    if not op_names or bad:
      raise ConfigError(f"--ops={ops!r} must be auto or a comma list of {OP_HOST}, {OP_PALLAS}.")
    if OP_PALLAS in op_names and backend != "gpu":
      raise ConfigError(f"--ops={ops!r}: the pallas op needs a GPU backend, "
                        f"jax.default_backend() is {backend!r}.")
    op_list = [o for o in (OP_HOST, OP_PALLAS) if o in op_names]
  usable = [(o, f) for o in op_list for f in fmts
            if f in (HOST_FORMATS if o == OP_HOST else PALLAS_FORMATS)]
  if not usable and sparse_ops:
    raise ConfigError(f"--formats={formats!r}: no format for the ops run here "
                      f"({', '.join(op_list)}; host: f32, q8; pallas: f32, bf16).")
  limit = numba.config.NUMBA_NUM_THREADS
  if not 1 <= threads <= limit:
    raise ConfigError(f"--threads={threads} must be in [1, {limit}] (NUMBA_NUM_THREADS).")
  if not seconds > 0:
    raise ConfigError(f"--seconds={seconds} must be > 0.")
  if output not in ("md", "json"):
    raise ConfigError(f"--output={output!r} must be md or json.")
  if not alpha >= 0:
    raise ConfigError(f"--alpha={alpha} must be >= 0.")
  if not max_gb > 0:
    raise ConfigError(f"--max_gb={max_gb} must be > 0.")
  if cold_mb is not None and not cold_mb > 0:
    raise ConfigError(f"--cold_mb={cold_mb} must be > 0.")
  opts = Options(shapes=list(dict.fromkeys(names)),
                 sparsities=list(dict.fromkeys(p / 100.0 for p in pcts)),
                 formats=list(dict.fromkeys(fmts)), ops=op_list, threads=int(threads),
                 seconds=float(seconds), output=output, alpha=float(alpha), seed=int(seed),
                 max_bytes=float(max_gb) * 1e9,
                 cold_bytes=None if cold_mb is None else float(cold_mb) * 1e6, backend=backend)
  if OP_HOST in op_list and sparse_ops:  # The sparse table's layer copies must fit.
    cold = opts.cold_target()
    for name in opts.shapes:
      d, n = SHAPES[name]
      for f in opts.formats:
        need = n * bytes_per_neuron(d, f) + cold
        if f in HOST_FORMATS and need > opts.max_bytes:
          raise ConfigError(
              f"--max_gb={max_gb:g}: {name} {f} needs {need / 1e9:.2f} GB (one layer copy + the "
              f"{cold / 1e6:.0f} MB flush buffer); raise --max_gb.")
  return opts


def run(opts: Options, log=None) -> list[Row]:
  """Runs every (op, format, shape, sparsity) of `opts`; returns the rows (vs_dense filled).

  log(str): progress lines (stderr in the CLI), one per layer built and per row.
  """
  log = log or (lambda s: None)
  cold = opts.cold_target()
  rows: list[Row] = []
  max_sp = max(opts.sparsities)
  sets = {(name, sp): draw_sets(SHAPES[name][1], sp, opts.alpha, opts.seed)
          for name in opts.shapes for sp in opts.sparsities}
  min_k = {name: max(min(np.mean([len(s) for s in sets[(name, sp)]]) for sp in opts.sparsities), 1)
           for name in opts.shapes}
  for op in (o for o in (OP_HOST, OP_PALLAS) if o in opts.ops):
    if op == OP_HOST:
      host_ops.set_host_threads(opts.threads)
      formats, pool = HOST_FORMATS, opts.max_bytes - cold
      build, bench = host_layer_copies, functools.partial(bench_host,
                                                          flusher=CacheFlusher(int(cold)))
    else:  # Device copies: a share of its memory, no flush.
      formats, pool = PALLAS_FORMATS, gpu_pool_bytes()
      build, bench = pallas_layer_copies, bench_pallas
    for name in opts.shapes:
      d, n = SHAPES[name]
      for fmt in (f for f in opts.formats if f in formats):
        per_layer = n * bytes_per_neuron(d, fmt)
        copies = plan_copies(per_layer, min_k[name] * bytes_per_neuron(d, fmt), cold, pool,
                             max_copies=I32_LIMIT // (n * d) if op == OP_PALLAS else None)
        t0 = time.perf_counter()
        weights = build(d, n, fmt, copies, opts.seed)
        log(f"{op} {fmt} {name}: {copies} layer copies ({copies * per_layer / 1e9:.2f} GB) built "
            f"in {time.perf_counter() - t0:.1f} s"
            + (f" (max sparsity {max_sp:.0%})" if op == OP_HOST else ""))
        for sp in opts.sparsities:
          m = bench(weights, n, copies, sets[(name, sp)], seconds=opts.seconds, cold_bytes=cold,
                    seed=opts.seed)
          rows.append(Row(op=op, format=fmt, shape=name, hidden=d, intermediate=n, sparsity=sp,
                          copies=copies, **m))
          log(_progress(rows[-1]))
        del weights
  return add_vs_dense(rows)


def _progress(r: Row) -> str:
  return (f"  {r.op} {r.format} {r.shape} {tables.pct(r.sparsity)}: {tables.fmt_time(r.time_s)}, "
          f"{r.gb_s:.1f} GB/s, {r.calls} calls, reuse {r.reuse_mb:.0f} MB "
          f"(flush {r.flush_mb:.1f} MB/call)")


def _host_dots(threads: int) -> list[str]:
  """Sets the host threads; the dot modes to time: f32, and int8 where `host_ops.qdot` runs."""
  from host_ops import qdot
  from host_ops import qmatmul
  host_ops.set_host_threads(threads)
  return [qmatmul.DOT_F32] + ([qmatmul.DOT_INT8] if qdot.AVAILABLE else [])


def run_matvec(opts: Options, read_gb_s: float | None, log=None) -> list[MatvecRow]:
  """Every (shape, gate/down, format, dot) of the dense matvec table."""
  log = log or (lambda s: None)
  cold, dots = opts.cold_target(), _host_dots(opts.threads)
  out = []
  for name in opts.shapes:
    d, n = SHAPES[name]
    for matrix, (rows, cols) in (("gate", (n, d)), ("down", (d, n))):
      for fmt in MATVEC_FORMATS:
        per = rows * (cols // 32) * (20 if fmt == "q4_1" else 34)
        held = rows * cols * (0.5 if fmt == "q4_1" else 1.0) + rows * cols / 32 * (
            8 if fmt == "q4_1" else 4)
        copies = max(1, min(math.ceil(cold / per), int(opts.max_bytes // held)))
        mats = matvec_copies(rows, cols, fmt, copies, opts.seed)
        for dot in dots:
          m = bench_matvec(mats, dot, seconds=opts.seconds, cold_bytes=cold, seed=opts.seed)
          row = MatvecRow(shape=name, matrix=matrix, rows=rows, cols=cols, format=fmt, dot=dot,
                          vs_bandwidth=m["gb_s"] / read_gb_s if read_gb_s else None, **m)
          out.append(row)
          log(f"  matvec {fmt} {dot} {name} {matrix}: {tables.fmt_time(row.time_s)}, "
              f"{row.g_weights_s:.1f} G weights/s, {row.gb_s:.1f} GB/s")
        del mats
  return out


def run_down_pass(opts: Options, read_gb_s: float | None, log=None) -> list[DownPassRow]:
  """Every (shape, format, dot, active fraction) of the sparse down-pass table. Rows are random
  blocks (`matvec_copies`), activations standard normal on a uniformly drawn set of exactly
  round(fraction * F) neurons."""
  from host_ops import gated_ffn
  from host_ops import qmatmul
  log = log or (lambda s: None)
  cold, dots = opts.cold_target(), _host_dots(opts.threads)
  rng = np.random.default_rng(opts.seed)
  out = []
  for name in opts.shapes:
    d, n = SHAPES[name]
    dense_per = d * (n // 32) * 20
    dense = matvec_copies(d, n, qmatmul.Q4_1, max(1, min(math.ceil(cold / dense_per),
                                                          int(opts.max_bytes // dense_per))),
                          opts.seed)
    dense_t = {dot: bench_matvec(dense, dot, seconds=opts.seconds, cold_bytes=cold,
                                 seed=opts.seed)["time_s"] for dot in dots}
    del dense
    for fmt in gated_ffn.DOWN_KINDS:
      # Bytes per active row, and bytes read whatever the active set (the file layout's scales).
      active_bytes, fixed_bytes = gated_ffn.DOWN_BLOCK_BYTES[fmt]
      per_row = (d // 32) * active_bytes
      fixed = n * d // 32 * fixed_bytes
      size = n * per_row + fixed
      copies = max(1, min(math.ceil(cold / size), int(opts.max_bytes // size)))
      mats = down_rows_copies(d, n, fmt, copies, opts.seed)
      for active in DOWN_ACTIVE:
        k = max(1, round(active * n))
        acts = np.zeros((1, n), np.float32)
        acts[0, rng.choice(n, k, replace=False)] = rng.standard_normal(k).astype(np.float32)
        for dot in dots:
          t = time_down_pass(mats, acts, dot, threads=opts.threads, seconds=opts.seconds)
          gb_s = (k * per_row + fixed) / t / 1e9
          row = DownPassRow(shape=name, rows=n, cols=d, format=fmt, dot=dot, active=k / n,
                            time_s=t, g_weights_s=k * d / t / 1e9, gb_s=gb_s,
                            dense_time_s=dense_t[dot], vs_dense=dense_t[dot] / t,
                            copies=len(mats), from_dram=copies * size >= cold,
                            vs_bandwidth=gb_s / read_gb_s if read_gb_s else None)
          out.append(row)
          log(f"  down pass {fmt} {dot} {name} {active:.0%}: {tables.fmt_time(t)}, "
              f"{row.g_weights_s:.1f} G weights/s, {gb_s:.1f} GB/s, {row.vs_dense:.2f}x dense")
      del mats
  return out


def main(argv: list[str]) -> None:
  del argv
  from absl import flags
  f = flags.FLAGS
  backend = None
  if _split(f.ops) != [OP_HOST]:
    import jax
    backend = jax.default_backend()
  opts = parse_options(shapes=f.shapes, sparsities=f.sparsities, formats=f.formats, ops=f.ops,
                       threads=f.threads, seconds=f.seconds, output=f.output, alpha=f.alpha,
                       seed=f.seed, max_gb=f.max_gb, cold_mb=f.cold_mb, backend=backend,
                       sparse_ops=f.sparse_ops)
  if not f.sparse_ops and not ((f.matvec or f.down_pass) and OP_HOST in opts.ops):
    raise ConfigError("nothing to run: --nosparse_ops and no matvec or down-pass table (they "
                      "need --matvec or --down_pass and the host op in --ops); drop "
                      "--nosparse_ops or add --matvec or --down_pass.")
  info = machine_info(opts.threads, backend if OP_PALLAS in opts.ops else None)
  cold = opts.cold_bytes or COLD_FACTOR * info["l3_bytes"]
  opts.cold_bytes = cold
  if OP_HOST in opts.ops and f.bandwidth:
    info["read_gb_s"] = read_bandwidth(min(cold, opts.max_bytes / 2), opts.threads)
    info.update(gathered_read_gb_s=gathered_read_bandwidth(min(cold, opts.max_bytes / 2),
                                                           opts.threads, seed=opts.seed),
                gathered_row_bytes=GATHER_ROW_BYTES, gathered_fraction=GATHER_FRACTION)
  progress = (lambda s: print(s, file=sys.stderr, flush=True)) if f.progress else None
  rows = run(opts, log=progress) if f.sparse_ops else []
  matvec = (run_matvec(opts, info.get("read_gb_s"), log=progress)
            if f.matvec and OP_HOST in opts.ops else [])
  down = (run_down_pass(opts, info.get("read_gb_s"), log=progress)
          if f.down_pass and OP_HOST in opts.ops else [])
  if opts.output == "json":
    doc = {"machine": info,
           "settings": {"alpha": opts.alpha, "seed": opts.seed, "seconds": opts.seconds,
                        "threads": opts.threads, "cold_bytes": cold, "max_bytes": opts.max_bytes,
                        "id_sets": ID_SETS, "ops": opts.ops},
           "rows": [dataclasses.asdict(r) for r in rows],
           "matvec": [dataclasses.asdict(r) for r in matvec],
           "down_pass": [dataclasses.asdict(r) for r in down]}
    sys.stdout.write(json.dumps(doc, indent=1) + "\n")
  else:
    text = format_machine(info) + "\n"
    if rows:
      text += ("\n" + tables.format_markdown(rows) + "\n\n" + tables.format_notes(rows, opts, cold)
               + "\n")
    if matvec:
      text += ("\nDense decode matvecs (b = 1, GGUF block bytes):\n\n"
               + tables.format_matvec(matvec) + "\n")
    if down:
      text += ("\nSparse down pass over neuron-major rows (b = 1; speedup: the dense Q4_1 down "
               "matvec's time over this one's):\n\n" + tables.format_down_pass(down) + "\n")
    sys.stdout.write(text)


if __name__ == "__main__":
  from absl import flags
  from pijax import cli
  flags.DEFINE_string("shapes", ",".join(DEFAULT_SHAPES),
                      f"Comma list of layer shapes: {', '.join(SHAPES)}.")
  flags.DEFINE_string("sparsities", ",".join(f"{s * 100:g}" for s in DEFAULT_SPARSITIES),
                      "Comma list of target sparsities in percent, each in [0, 100).")
  flags.DEFINE_string("formats", "f32,q8,bf16",
                      "Comma list of weight formats; host runs f32/q8, pallas f32/bf16.")
  flags.DEFINE_string("ops", "auto", "auto (host, plus pallas on a GPU backend), host, pallas.")
  flags.DEFINE_integer("threads", 2, "Numba threads of the host op (set_host_threads).")
  flags.DEFINE_float("seconds", 1.0, "Time budget per row, seconds.")
  flags.DEFINE_string("output", "md", "md or json.", short_name="o")
  flags.DEFINE_float("alpha", DEFAULT_ALPHA, "Power-law exponent of the neuron frequencies.")
  flags.DEFINE_integer("seed", 0, "Seed of the weights and the active sets.")
  flags.DEFINE_float("max_gb", DEFAULT_MAX_GB,
                     "Host memory cap in GB (1e9 bytes): layer copies + the flush buffer.")
  flags.DEFINE_float("cold_mb", None, "Bytes (MB) read between two reads of one layer copy; "
                     "default 2.3 x the L3 size.")
  flags.DEFINE_boolean("progress", True, "Progress lines on stderr.")
  flags.DEFINE_boolean("sparse_ops", True, "Run the sparse FFN op table.")
  flags.DEFINE_boolean("matvec", True, "Run the dense decode matvec table (host: q4_1 and q8_0 "
                       "blocks, f32 and int8 dots).")
  flags.DEFINE_boolean("down_pass", True, "Run the sparse down-pass table (host: neuron-major "
                       "q8_0 and q4_1 rows and the file's Q4_1 blocks transposed, at 25/50/100% "
                       "active, against the dense Q4_1 down matvec).")
  flags.DEFINE_boolean("bandwidth", True, "Measure the memory read bandwidth (a pass over "
                       "--cold_mb of memory, default 2.3 x L3; and over half of its 2560-byte "
                       "rows) and print it on the machine line.")
  cli.run(main, "pijax.bench_ops")
