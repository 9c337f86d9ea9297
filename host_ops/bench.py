"""Micro-benchmark of the host sparse FFN (f32 and Q8) at real model shapes.

  python -m host_ops.bench [--threads=2] [--seconds=1.5]

For each shape (LLaMA-2-7B: D=4096, n=11008; SmolLM2-135M: D=576, n=1536) and sparsity
(0/50/90%, random active sets, sorted ids, b=1, swiglu so every active neuron reads its gate, up and
down rows),
it cycles over enough distinct copies of the layer to exceed `--cold_mb` (default 600 MB, over the
260 MB L3 of the dev machines) so rows come from DRAM, and reports the time per call (Python
wrapper included; median of the best of 5 timing windows, and the median over all of them) and the
effective bandwidth: bytes of the rows actually read / time.
With --real_layers it also reports SmolLM2 cycling over its real 30 layers (what decode sees;
Q8 at 30 layers, 90 MB, fits in that L3).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from host_ops import quant
from host_ops import sparse_ffn as sf

SHAPES = {"llama2-7b": (4096, 11008), "smollm2-135m": (576, 1536)}
SPARSITIES = (0.0, 0.5, 0.9)


def _layers(d: int, n: int, weight_format: str, count: int, rng) -> list[sf.HostFFNWeights]:
  """`count` distinct copies (separate memory) of one random layer."""
  rows = [(rng.standard_normal((n, d), dtype=np.float32) / np.sqrt(d)) for _ in range(3)]
  if weight_format == sf.WEIGHT_F32:
    base = sf.HostFFNWeights(*rows, "swiglu")
    make = lambda: sf.HostFFNWeights(*(r.copy() for r in rows), "swiglu")  # noqa: E731
  else:
    mats = [quant.quantize_q8(r) for r in rows]
    base = sf.HostFFNWeights.from_q8(*mats, "swiglu")
    make = lambda: sf.HostFFNWeights.from_q8(  # noqa: E731
        *(quant.Q8Rows(m.q.copy(), m.scales.copy()) for m in mats), "swiglu")
  return [base] + [make() for _ in range(count - 1)]


def bench_one(layers, sparsity: float, seconds: float, rng,
              windows: int = 5) -> tuple[float, float, float]:
  """Times `windows` windows of seconds / windows each.

  Returns (median seconds per call of the best window, the median over all calls, effective GB/s
  of rows read at the best window). On a machine shared with other jobs, calls that lose a core
  to another process stall for a scheduler time slice; the best window shows the kernel, the
  overall median shows what this machine gave.
  """
  n, d = layers[0].n, layers[0].d
  k = int(round(n * (1.0 - sparsity)))
  id_sets = [np.sort(rng.permutation(n)[:k]).astype(np.int32) for _ in range(16)]
  x = rng.standard_normal(d).astype(np.float32)
  for w in layers[:2]:
    w(x, id_sets[0])  # Compile / warm.
  medians, everything = [], []
  i = 0
  for _ in range(windows):
    times = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds / windows or len(times) < len(layers):
      w = layers[i % len(layers)]
      ids = id_sets[i % len(id_sets)]
      t = time.perf_counter()
      w(x, ids)
      times.append(time.perf_counter() - t)
      i += 1
    medians.append(float(np.median(times)))
    everything += times
  best = min(medians)
  return best, float(np.median(everything)), k * layers[0].bytes_per_neuron / best / 1e9


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--threads", type=int, default=2)
  p.add_argument("--seconds", type=float, default=1.5, help="timing window per configuration")
  p.add_argument("--cold_mb", type=float, default=600.0, help="distinct weight bytes cycled over")
  p.add_argument("--real_layers", action="store_true", help="also SmolLM2 over its 30 layers")
  p.add_argument("--only", default="", help="comma list: run only these shape names")
  p.add_argument("--formats", default="f32,q8", help="comma list of weight formats")
  args = p.parse_args(argv)
  sf.set_host_threads(args.threads)
  rng = np.random.default_rng(0)
  print(f"threads={args.threads}  b=1  family=swiglu  (median per call in the best of 5 windows; "
        f"GB/s = rows read / time)")
  runs = [(name, d, n, None) for name, (d, n) in SHAPES.items()]
  if args.real_layers:
    runs.append(("smollm2-135m-x30layers", 576, 1536, 30))
  only = [o for o in args.only.split(",") if o]
  for name, d, n, fixed in runs:
    if only and name not in only:
      continue
    for fmt in args.formats.split(","):
      per_layer = (4 if fmt == sf.WEIGHT_F32 else 1 + 4 / quant.Q8_BLOCK) * 3 * n * d
      count = fixed or max(1, int(np.ceil(args.cold_mb * 1e6 / per_layer)))
      layers = _layers(d, n, fmt, count, rng)
      for sp in SPARSITIES:
        dt, dt_all, gbs = bench_one(layers, sp, args.seconds, rng)
        print(f"{name:24s} {fmt:3s} sparsity {sp:4.0%}  {dt * 1e6:9.1f} us  {gbs:5.1f} GB/s  "
              f"(all windows: {dt_all * 1e6:.1f} us; {count} layer copies, "
              f"{count * per_layer / 1e6:.0f} MB)", flush=True)
      del layers


if __name__ == "__main__":
  main()
