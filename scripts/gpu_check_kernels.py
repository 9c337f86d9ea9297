"""Checks and times pallas_kernels.sparse_ffn natively on a GPU.

For SmolLM2-135M FFN shapes (d = 576, n_hot = 1536; unpadded, and padded to
640 with pad_hidden) and LLaMA-7B shapes (d = 4096, n_hot = 11008), f32 and
bf16 weights, active fractions 0.1 / 0.5 / 1.0:
  * compiles the kernel (interpret=False, Triton lowering),
  * checks it against sparse_ffn_reference (max abs err), and the reference
    against float64 NumPy on the same (rounded) weights,
  * times kernel, reference and the dense FFN over all n_hot rows: median of
    --runs calls after --warmup, each ended by block_until_ready ("call");
    and per iteration of a jitted fori_loop of --inner data-dependent calls
    ("in jit", no dispatch overhead, as inside the engine's step),
  * prints a markdown table; exits 1 if any check failed or raised.

Effective GB/s = bytes of the active rows (3 * k * d * itemsize, unpadded d)
/ kernel time.

  python scripts/gpu_check_kernels.py                 # on the GPU machine
  python scripts/gpu_check_kernels.py --interpret     # CPU smoke test
  python scripts/gpu_check_kernels.py --block_n=16,32,64 --num_warps=4,8 \\
      --shapes=llama7b --dtypes=bfloat16 --fractions=0.5   # small sweep

Needs only jax and numpy (no network, nothing to install).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
from jax import lax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import sparse_ffn as sf  # noqa: E402

TOL = 1e-4  # max abs err <= TOL * (1 + max |want|)


@dataclasses.dataclass(frozen=True)
class Shape:
  name: str
  d: int  # model hidden size
  n_hot: int  # device-resident neurons
  pad_to: int | None = None  # pad_hidden multiple, None = unpadded


GPU_SHAPES = (
    Shape("smollm2", 576, 1536),
    Shape("smollm2_pad640", 576, 1536, pad_to=128),
    Shape("llama7b", 4096, 11008),
)
SMOKE_SHAPES = (
    Shape("tiny", 64, 96),
    Shape("tiny576", 576, 80),
    Shape("tiny576_pad640", 576, 80, pad_to=128),
)


def _ints(text: str) -> list[int | None]:
  return [None if t in ("", "auto", "none") else int(t)
          for t in text.split(",")]


def _parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--interpret", action="store_true",
                 help="CPU smoke test: tiny shapes, Pallas interpreter")
  p.add_argument("--shapes", default="",
                 help="comma-separated shape names (default: all)")
  p.add_argument("--dtypes", default="float32,bfloat16")
  p.add_argument("--fractions", default="0.1,0.5,1.0")
  p.add_argument("--family", default="swiglu", choices=sf.FAMILIES)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--block_n", default="32", help="comma list")
  p.add_argument("--block_d", default="auto", help="comma list; auto")
  p.add_argument("--num_warps", default="auto", help="comma list; auto")
  p.add_argument("--num_stages", default="auto", help="comma list; auto")
  p.add_argument("--runs", type=int, default=None, help="default 20 (3)")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--inner", type=int, default=None,
                 help="calls per jitted loop, default 10 (2)")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  if args.runs is None:
    args.runs = 3 if args.interpret else 20
  if args.inner is None:
    args.inner = 2 if args.interpret else 10
  return args


def _median_us(fn, args, runs: int, warmup: int) -> float:
  """Median wall time of fn(*args).block_until_ready() in microseconds."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(runs):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times) * 1e6


def _looped(ffn, inner: int):
  """jit of `inner` data-dependent calls ffn(x, *rest) -> x + 1e-6 * y."""
  def run(x, *rest):
    def body(_, x):
      return x + 1e-6 * ffn(x, *rest)
    return lax.fori_loop(0, inner, body, x)
  return jax.jit(run)


def _dense_ffn(x, gate, up, down, *, family):
  """Dense FFN over all n_hot rows, as a dense model would run it: f32[b, d].

  f32 weights: f32 matmuls (HIGHEST); bf16 weights: bf16 inputs, f32 accum.
  """
  prec = lax.Precision.HIGHEST if gate.dtype == jnp.float32 else None
  xw = x.astype(gate.dtype)
  g = jnp.einsum("bd,nd->bn", xw, gate, precision=prec,
                 preferred_element_type=jnp.float32)
  u = jnp.einsum("bd,nd->bn", xw, up, precision=prec,
                 preferred_element_type=jnp.float32)
  a = sf._activation(g, u, family).astype(down.dtype)
  return jnp.einsum("bn,nd->bd", a, down, precision=prec,
                    preferred_element_type=jnp.float32)


def _numpy_ffn(x, gate, up, down, ids, family):
  """float64 NumPy FFN over the active rows only: f64[b, d]."""
  x = np.asarray(x, np.float64)
  g = x @ gate[ids].T.astype(np.float64)
  u = x @ up[ids].T.astype(np.float64)
  if family == "swiglu":
    a = g / (1.0 + np.exp(-g)) * u
  elif family == "reglu":
    a = np.maximum(g, 0.0) * u
  else:
    a = np.maximum(g, 0.0) * np.maximum(u, 0.0)
  return a @ down[ids].astype(np.float64)


def _err(got, want) -> tuple[float, float]:
  """(max abs err, max |want|)."""
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  return float(np.abs(got - want).max()), float(np.abs(want).max())


def _make_weights(shape: Shape, dtype, seed: int):
  """Random gate/up/down rows [n_hot, d(padded)] on device, plus host f32."""
  keys = jax.random.split(jax.random.key(seed), 3)
  scale = 1.0 / np.sqrt(shape.d)
  ws = [(jax.random.normal(k, (shape.n_hot, shape.d), jnp.float32) * scale
         ).astype(dtype) for k in keys]
  host = [np.asarray(w.astype(jnp.float32)) for w in ws]  # rounded values
  if shape.pad_to:
    ws = [sf.pad_hidden(w, shape.pad_to) for w in ws]
  return ws, host


def _fmt(v, spec=".1f"):
  return "-" if v is None else format(v, spec)


def main(argv=None) -> int:
  args = _parse_args(argv)
  backend = jax.default_backend()
  print(f"jax {jax.__version__}, backend {backend}, devices {jax.devices()}")
  if not args.interpret and backend != "gpu":
    print("no GPU backend: run with --interpret for the CPU smoke test")
    return 2
  shapes = SMOKE_SHAPES if args.interpret else GPU_SHAPES
  if args.shapes:
    wanted = args.shapes.split(",")
    shapes = tuple(s for s in shapes if s.name in wanted)
  dtypes = [jnp.dtype(t) for t in args.dtypes.split(",")]
  fractions = [float(f) for f in args.fractions.split(",")]
  configs = list(itertools.product(
      _ints(args.block_n), _ints(args.block_d), _ints(args.num_warps),
      _ints(args.num_stages)))
  rng = np.random.default_rng(args.seed)
  rows, failures = [], 0

  for shape, dtype in itertools.product(shapes, dtypes):
    ws, host = _make_weights(shape, dtype, args.seed)
    d_pad = ws[0].shape[1]
    x_host = rng.standard_normal((args.batch, shape.d)).astype(np.float32)
    x = jnp.asarray(sf.pad_hidden(x_host, shape.pad_to or 1))
    dense_us = None
    try:
      dense = _looped(lambda x, *w: _dense_ffn(x, *w, family=args.family),
                      args.inner)
      dense_us = _median_us(dense, (x, *ws), args.runs, args.warmup
                            ) / args.inner
    except Exception:  # noqa: BLE001 - report and go on
      traceback.print_exc()
    for frac in fractions:
      k = max(1, int(round(frac * shape.n_hot)))
      ids = np.sort(rng.choice(shape.n_hot, size=k, replace=False))
      idx = jnp.asarray(sf.pad_indices(ids, sf.next_pow2(k)))
      useful_bytes = 3 * k * shape.d * dtype.itemsize
      want = _numpy_ffn(x_host, *host, ids, args.family)
      ref_fn = lambda x, g, u, dn, i: sf.sparse_ffn_reference(
          x, g, u, dn, i, family=args.family)
      ref = np.asarray(ref_fn(x, *ws, idx))[:, :shape.d]
      ref_err, ref_scale = _err(ref, want)
      ref_ok = ref_err <= TOL * (1 + ref_scale)
      ref_us = _median_us(jax.jit(ref_fn), (x, *ws, idx), args.runs,
                          args.warmup)
      ref_loop_us = _median_us(_looped(ref_fn, args.inner), (x, *ws, idx),
                               args.runs, args.warmup) / args.inner
      for block_n, block_d, warps, stages in configs:
        cfg = f"{block_n}/{block_d or 'auto'}/{warps or 'auto'}/" \
              f"{stages or 'auto'}"
        row = dict(shape=f"{shape.name} (d={d_pad}, n_hot={shape.n_hot})",
                   dtype=dtype.name, frac=frac, cfg=cfg, ref_err=ref_err,
                   ref_us=ref_us, ref_loop_us=ref_loop_us, dense_us=dense_us)
        if block_d is not None and d_pad % block_d:
          rows.append(dict(row, status="skip (block_d)"))
          continue
        kern_fn = lambda x, g, u, dn, i: sf.sparse_ffn(
            x, g, u, dn, i, family=args.family, block_n=block_n,
            block_d=block_d, num_warps=warps, num_stages=stages,
            interpret=args.interpret)
        try:
          got = np.asarray(kern_fn(x, *ws, idx))[:, :shape.d]
          err, scale = _err(got, ref)
          ok = ref_ok and err <= TOL * (1 + scale)
          kern_us = _median_us(kern_fn, (x, *ws, idx), args.runs, args.warmup)
          loop_us = _median_us(_looped(kern_fn, args.inner), (x, *ws, idx),
                               args.runs, args.warmup) / args.inner
          row.update(status="ok" if ok else "FAIL", err=err, kern_us=kern_us,
                     loop_us=loop_us,
                     gbps=useful_bytes / (loop_us * 1e-6) / 1e9,
                     gbps_call=useful_bytes / (kern_us * 1e-6) / 1e9)
        except Exception as e:  # noqa: BLE001 - report and go on
          traceback.print_exc()
          row.update(status=f"FAIL ({type(e).__name__})")
        failures += not row["status"].startswith(("ok", "skip"))
        rows.append(row)
        print(f"{row['shape']} {row['dtype']} {frac:.0%} {cfg}:"
              f" {row['status']}", flush=True)

  print()
  print("| shape | dtype | active % | bn/bd/warps/stages | status | max err"
        " | ref err (f64) | kernel us | kernel us (in jit) | ref us"
        " | ref us (in jit) | dense us (in jit) | GB/s (in jit) | GB/s (call) |")
  print("|" + " --- |" * 14)
  for r in rows:
    print(f"| {r['shape']} | {r['dtype']} | {r['frac']:.0%} | {r['cfg']}"
          f" | {r['status']} | {_fmt(r.get('err'), '.2e')}"
          f" | {_fmt(r['ref_err'], '.2e')} | {_fmt(r.get('kern_us'))}"
          f" | {_fmt(r.get('loop_us'))} | {_fmt(r['ref_us'])}"
          f" | {_fmt(r['ref_loop_us'])} | {_fmt(r['dense_us'])}"
          f" | {_fmt(r.get('gbps'))} | {_fmt(r.get('gbps_call'))} |")
  print(f"\n{len(rows)} cases, {failures} failed")
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
