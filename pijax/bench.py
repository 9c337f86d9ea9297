"""`python -m pijax.bench`: llama-bench's figures (pp512, tg128) for pijax.

  python -m pijax.bench -m default -p 512 -n 128 -r 5
  python -m pijax.bench -m bundles/smollm2_135m --sparse=predictor --hot_ratio=0 -o json

pp<P>: prefill of P random token ids into an empty KV cache (one forward pass; tokenization and
sampling excluded). tg<N>: N single-token decode steps after a 1-token prompt (greedy sampling is
fused into the step, as in generation). Each test runs once as a warm-up (compilation happens
there and is reported separately), then -r times; t/s is reported as mean +- sd over the runs.
Also printed: bytes of weights read per generated token (dense: every weight once; sparse: the
attention, head, predictors, the hot rows and the measured share of cold rows) and the implied
GB/s.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pijax import sampling as sampling_lib
from pijax.errors import ConfigError
from pijax.measure import tables


@dataclasses.dataclass
class BenchResult:
  """One test: name ("pp512"/"tg128"), tokens/s per repetition, compile seconds."""

  test: str
  tokens_per_s: list[float]
  compile_s: float
  ffn_sparsity: float = 0.0

  @property
  def mean(self) -> float:
    return statistics.fmean(self.tokens_per_s)

  @property
  def sd(self) -> float:
    return statistics.stdev(self.tokens_per_s) if len(self.tokens_per_s) > 1 else 0.0


def _compiled(model, kind, kv_len, args):
  before = model.compile_s
  exe = model.compiled(kind, kv_len, args)
  return exe, model.compile_s - before


def bench_prefill(model, n_prompt: int, reps: int, seed: int = 0) -> BenchResult:
  """pp<n_prompt>: tokens/s of one prefill over n_prompt random ids, mean over reps."""
  if not 1 <= n_prompt <= model.max_seq_len:
    raise ConfigError(f"-p {n_prompt} must be in [1, max_seq_len={model.max_seq_len}].")
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(0, model.config.vocab_size, (1, n_prompt)), jnp.int32)
  kv_len = model.kv_bucket(n_prompt)
  sparams = sampling_lib.make_sampling_params()
  recent = jnp.full((1, 1), -1, jnp.int32)
  key = jax.random.PRNGKey(seed)

  def args():
    return (model.step_params, model.new_cache(1), tokens, jnp.asarray(n_prompt, jnp.int32),
            jnp.asarray(0, jnp.int32), key, sparams, recent)

  a = args()
  exe, compile_s = _compiled(model, "prefill", kv_len, a)
  model.release_cache(a[1])
  rates, active = [], []
  for rep in range(reps + 1):
    a = args()
    jax.block_until_ready(a[1])
    t0 = time.perf_counter()
    out = exe(*a)
    jax.block_until_ready(out)
    model.release_cache(out[1])
    if rep:  # Repetition 0 is the warm-up.
      rates.append(n_prompt / (time.perf_counter() - t0))
      active.append(float(np.mean(np.asarray(out[3]))))
  return BenchResult(f"pp{n_prompt}", rates, compile_s, 1.0 - float(np.mean(active)))


def bench_decode(model, n_gen: int, reps: int, seed: int = 0, switch=None, before_rep=None,
                 modes=(False, True)):
  """tg<n_gen>: tokens/s of n_gen decode steps after a 1-token prompt, mean over reps.

  switch: None, or switch(mode) putting the loaded model's FFN into mode, one of `modes` (by
  default False: dense, True: sparse); then every repetition times each mode in turn,
  interleaved in this process on the same weights, the last mode is left on, and the result is
  {mode: BenchResult}.
  before_rep: None, or called with (mode, rep) before each repetition (mode None, or one of
  modes; rep 0 is the warm-up): `profile_layers` points the phase counters at the mode's, or at
  scratch for the warm-up.
  """
  if not 1 <= n_gen < model.max_seq_len:
    raise ConfigError(f"-n {n_gen} must be in [1, max_seq_len={model.max_seq_len}).")
  kv_len = model.kv_bucket(n_gen + 1)
  sparams = sampling_lib.make_sampling_params()
  recent = jnp.full((1, 1), -1, jnp.int32)
  first = jnp.asarray([model.tokenizer.bos_id or 0], jnp.int32)
  args0 = (model.step_params, model.new_cache(1), first, jnp.asarray(0, jnp.int32),
           jax.random.PRNGKey(seed), sparams, recent)
  exe, compile_s = _compiled(model, "decode", kv_len, args0)
  model.release_cache(args0[1])

  def one_rep() -> tuple[float, float]:
    cache, token, key = model.new_cache(1), first, jax.random.PRNGKey(seed)
    steps = []
    t0 = time.perf_counter()
    for pos in range(n_gen):
      token, cache, key, act = exe(model.step_params, cache, token, jnp.asarray(pos, jnp.int32),
                                   key, sparams, recent)
      steps.append(act)
    jax.block_until_ready(token)
    rate = n_gen / (time.perf_counter() - t0)
    model.release_cache(cache)
    return rate, float(np.mean(np.asarray(jnp.stack(steps))))

  modes = (None,) if switch is None else tuple(modes)
  rates = {m: [] for m in modes}
  active = {m: [] for m in modes}
  try:
    for rep in range(reps + 1):
      for m in modes:
        if switch is not None:
          switch(m)
        if before_rep is not None:
          before_rep(m, rep)
        rate, act = one_rep()
        if rep:
          rates[m].append(rate)
          active[m].append(act)
  finally:
    if switch is not None:
      switch(modes[-1])
  results = {m: BenchResult(f"tg{n_gen}", rates[m], compile_s, 1.0 - float(np.mean(active[m])))
             for m in modes}
  return results[None] if switch is None else results


def _mode_switches(model, *, dense: bool, gate: bool) -> dict[str, Any]:
  """{mode: fn()} putting the loaded host decoder's FFN into each mode to interleave: "off"
  (dense) with dense, "gate" (gate-first, exact ReLU zeros) with gate, and the model's own
  sparse mode last (its cuts, or its predictors and thresholds, as configured)."""
  dec = model.backend.decoder
  mode = model.sparse_mode
  down = dec.down_format
  if dec.thresholds is not None:  # PowerInfer's predictors (a bundle's predictor: gated cuts).
    roles, thresholds = list(dec.predictor_roles), list(dec.thresholds)
    own = lambda: dec.enable_predicted([a for a, _ in roles], [b for _, b in roles],  # noqa: E731
                                       thresholds, down)
  else:
    cuts, ccuts = list(dec.gate_cuts), dec.contribution_cuts
    own = lambda: dec.enable_gated(cuts, down, ccuts)  # noqa: E731
  switches = {}
  if dense:
    switches["off"] = lambda: (dec.enable_gated(None), dec.enable_predicted(None))
  if gate:
    switches["gate"] = lambda: dec.enable_gated([0.0] * dec.n_layers, down)
  switches[mode] = own
  return switches


def weight_bytes_per_token(model, ffn_sparsity: float) -> tuple[int, int]:
  """(bytes read per decoded token, dense bytes per token) of weights (the backend's count)."""
  return model.backend.weight_bytes_per_token(ffn_sparsity)


def weights_label(model) -> str:
  """How the weights are held: the dtype ("float32", XLA), or e.g. "q4_1+q8_0 host int8"."""
  return model.weights_label


def weights_size_bytes(model) -> int:
  """Bytes of weights held for inference (the host blocks with host weights)."""
  return model.backend.weight_bytes()


def _phase_decoder(model):
  """The host decoder whose layer loop `--profile_layers` times; ConfigError when there is none
  (the model does not run on host weights)."""
  import platform
  from host_ops import common as host_common
  if not host_common.IS_X86:
    raise ConfigError("--profile_layers reads the x86 cycle counter (rdtsc); this machine is "
                      f"{platform.machine()}: drop the flag.")
  dec = getattr(model.backend, "decoder", None)
  if dec is None:
    raise ConfigError("--profile_layers times the host weights' layer loop: use a quantized "
                      "GGUF on a CPU run (host weights), or drop the flag.")
  return dec


def run(model, *, n_prompt: int, n_gen: int, reps: int, threads: int,
        interleave_dense: bool = False, profile_layers: bool = False,
        interleave_gate: bool = False) -> list[dict[str, Any]]:
  """The bench rows (dicts). interleave_dense: with the host gate-first sparse FFN on, tg also
  times the same model's dense FFN in alternate repetitions (a row with mode "off", and
  "vs_dense" on the sparse row: the ratio of mean tokens/s); with --sparse=predictor too.
  interleave_gate: with --sparse=predictor, also the gate-first FFN (a row with mode "gate",
  and "vs_gate" on the predictor row). profile_layers: each tg row gets
  "layer_us", the mean microseconds per layer and decoded token of each phase of the host
  layer loop (`host_ops.decoder.PHASES`, from the CPU's cycle counter, x86 only; over the timed
  repetitions, as tokens/s).
  Raises ConfigError when interleave_dense / interleave_gate are asked for any other mode, or
  profile_layers without host weights."""
  if profile_layers and not n_gen:
    raise ConfigError("--profile_layers times decode: give -n > 0, or drop the flag.")
  dec_phases = _phase_decoder(model) if profile_layers else None
  own_mode = model.sparse_mode  # The switches below change what the backend reports.
  switch, switches = None, {}
  if interleave_dense and (model.sparse_mode not in ("gate", "contribution", "predictor")
                           or not n_gen or getattr(model.backend, "decoder", None) is None):
    raise ConfigError("--interleave_dense times the dense FFN beside --sparse=gate|contribution"
                      "|predictor decode on host weights: add one of them and -n > 0, or drop "
                      "it.")
  if interleave_gate and (model.sparse_mode != "predictor" or not n_gen
                          or getattr(model.backend, "decoder", None) is None):
    raise ConfigError("--interleave_gate times the gate-first FFN beside --sparse=predictor "
                      "decode of a PowerInfer GGUF: add --sparse=predictor and -n > 0, or drop "
                      "it.")
  if interleave_dense or interleave_gate:
    switches = _mode_switches(model, dense=interleave_dense, gate=interleave_gate)
    switch = lambda m: switches[m]()  # noqa: E731
  tests = []
  if n_prompt:
    tests.append((bench_prefill(model, n_prompt, reps), model.sparse_mode))
  layer_us = {}
  if n_gen:
    before_rep = None
    if dec_phases is not None:
      from host_ops import common as host_common
      from host_ops import decoder as host_decoder
      shape = (dec_phases.n_layers, len(host_decoder.PHASES))
      counts = {m: np.zeros(shape, np.int64) for m in (tuple(switches) or (None,))}
      warm_up = np.zeros(shape, np.int64)  # Rep 0 is counted apart, as its tokens/s are.
      before_rep = lambda m, rep: setattr(  # noqa: E731
          dec_phases, "phase_cycles", counts[m] if rep else warm_up)
      c0, t0 = host_common.read_cycle_counter(), time.perf_counter()
    try:
      r = bench_decode(model, n_gen, reps, switch=switch, before_rep=before_rep,
                       modes=tuple(switches) or (False, True))
    finally:
      if dec_phases is not None:
        dec_phases.phase_cycles = None
    if dec_phases is not None:
      hz = (host_common.read_cycle_counter() - c0) / (time.perf_counter() - t0)
      if not hz > 0:
        raise ConfigError("--profile_layers: the cycle counter did not advance on this "
                          "machine; drop the flag.")
      steps = reps * n_gen * dec_phases.n_layers  # Forward calls (one per decoded token) x L.
      layer_us = {m: {p: float(c[:, k].sum() / hz / steps * 1e6)
                      for k, p in enumerate(host_decoder.PHASES)} for m, c in counts.items()}
    # The model's own mode first, then the interleaved ones (off last).
    tests += [(r[m], m) for m in reversed(tuple(switches))] if switch else \
        [(r, model.sparse_mode)]
  size = weights_size_bytes(model)
  rows = []
  for r, mode in tests:
    row = {"model": model.path, "size_gib": size / 2 ** 30, "weights": weights_label(model),
           "params_m": model.config.n_params() / 1e6,
           "backend": jax.default_backend(), "threads": threads, "mode": mode,
           "test": r.test, "t_s_mean": r.mean, "t_s_sd": r.sd, "compile_s": r.compile_s,
           "ffn_sparsity": r.ffn_sparsity, "reps": len(r.tokens_per_s)}
    if r.test.startswith("tg"):
      if switch:  # Each interleaved mode's bytes with its own rows and read counts.
        switch(mode)
      read, dense = weight_bytes_per_token(model, r.ffn_sparsity)
      if mode == "off":
        read = dense
      row.update(weight_bytes_per_token=read, dense_weight_bytes_per_token=dense,
                 implied_gb_s=read * r.mean / 1e9, ideal_speedup=dense / read)
      if layer_us:
        # Keys: None for a single mode (dense or sparse), else the interleaved modes.
        row["layer_us"] = layer_us[None if not switch else mode]
    rows.append(row)
  if switch:  # Ratios of mean tokens/s to the interleaved modes, on the model's own row.
    switch(own_mode)
    tg = {row["mode"]: row for row in rows if row["test"].startswith("tg")}
    own = tg[own_mode]
    for other, key in (("off", "vs_dense"), ("gate", "vs_gate")):
      if other in tg and other != own_mode:
        own[key] = own["t_s_mean"] / tg[other]["t_s_mean"]
  return rows


def bench_parallel(model, n_prompt: int, n_gen: int, reps: int, batches: list[int],
                   threads: int, seed: int = 0) -> list[dict[str, Any]]:
  """Aggregate decode tokens/s of B sequences decoded together (`pijax.batching`), per B in
  batches (llama-batched-bench's -npl): each sequence gets its own n_prompt random ids
  (prefilled alone, not timed), then n_gen decode steps of all B are timed (B * n_gen tokens;
  end-of-sequence ignored). One warm-up repetition per B. Rows carry "n_parallel" and
  "vs_parallel_1" (the ratio to the B=1 row when B=1 was asked for).

  Raises ConfigError: a model not on host weights, B < 1."""
  from pijax import batching
  rng = np.random.default_rng(seed)
  vocab = model.config.vocab_size
  rows = []
  for b in batches:
    rates = []
    for rep in range(reps + 1):
      gen = batching.BatchGenerator(model, b)
      for _ in range(b):
        gen.add(rng.integers(0, vocab, max(1, n_prompt)).tolist(),
                max_new_tokens=n_gen + 1, ignore_eos=True)
      t0 = time.perf_counter()
      for _ in range(n_gen):
        gen.step()
      if rep:
        rates.append(b * n_gen / (time.perf_counter() - t0))
    read, _ = weight_bytes_per_token(model, 0.0)
    r = BenchResult(f"pp{n_prompt}+tg{n_gen}", rates, 0.0)
    rows.append({"model": model.path, "size_gib": weights_size_bytes(model) / 2 ** 30,
                 "weights": weights_label(model), "params_m": model.config.n_params() / 1e6,
                 "backend": jax.default_backend(), "threads": threads, "mode": model.sparse_mode,
                 "test": r.test, "n_parallel": b, "t_s_mean": r.mean, "t_s_sd": r.sd,
                 "compile_s": 0.0, "ffn_sparsity": 0.0, "reps": reps,
                 "implied_gb_s": read * r.mean / b / 1e9})
  one = [r["t_s_mean"] for r in rows if r["n_parallel"] == 1]
  for r in rows:
    if one:
      r["vs_parallel_1"] = r["t_s_mean"] / one[0]
  return rows


def format_markdown(rows: list[dict[str, Any]]) -> str:
  out = tables.markdown_table(
      ("model", "size", "params", "weights", "backend", "threads", "mode", "test", "t/s"),
      "lrrllrllr",
      ([r["model"].split("/")[-1], f"{r['size_gib']:.2f} GiB", f"{r['params_m']:.1f} M",
        f"{r.get('weights', '')}", f"{r['backend']}", f"{r['threads']}", f"{r['mode']}",
        f"{r['test']}", f"{r['t_s_mean']:.2f} ± {r['t_s_sd']:.2f}"] for r in rows))
  for r in rows:
    if "n_parallel" in r:
      ratio = f", {r['vs_parallel_1']:.2f}x B=1" if "vs_parallel_1" in r else ""
      out.append(f"{r['test']} x{r['n_parallel']}: aggregate decode {r['t_s_mean']:.2f} t/s"
                 f"{ratio}, weights read {r['implied_gb_s']:.1f} GB/s (once per step)")
      continue
    extra = f"{r['test']}: compile {r['compile_s']:.2f} s"
    if r["mode"] != "off":
      extra += f", FFN sparsity {r['ffn_sparsity']:.3f}"
    if "weight_bytes_per_token" in r:
      extra += (f", weights read per token {r['weight_bytes_per_token'] / 1e6:.1f} MB "
                f"(dense {r['dense_weight_bytes_per_token'] / 1e6:.1f} MB), implied "
                f"{r['implied_gb_s']:.1f} GB/s, ideal speedup vs dense "
                f"{r['ideal_speedup']:.2f}x")
    if "vs_dense" in r:
      gain = (r["vs_dense"] - 1) / (r["ideal_speedup"] - 1) if r["ideal_speedup"] > 1 else 0.0
      extra += (f"; vs the dense FFN interleaved in this process {r['vs_dense']:.3f}x "
                f"({100 * gain:.0f}% of the ideal gain)")
    if "vs_gate" in r:
      extra += f"; vs the gate-first FFN interleaved in this process {r['vs_gate']:.3f}x"
    out.append(extra)
    if "layer_us" in r:
      phases = " | ".join(f"{p} {us:.0f}" for p, us in r["layer_us"].items())
      out.append(f"{r['test']} ({r['mode']}) us per layer per token: {phases} | sum "
                 f"{sum(r['layer_us'].values()):.0f}")
  return "\n".join(out)


def define_flags(threads_help: str = "Host threads (numba; XLA uses every core).") -> None:
  """Defines llama-bench's flags (-m -p -n -r -t -o), shared with `pijax.bench_compare`."""
  from absl import flags
  from pijax import sparse_flags  # noqa: F401  (defines --sparse, --hot_ratio, ...)
  flags.DEFINE_string("model", "default", "GGUF, bundle, or 'default'.", short_name="m")
  flags.DEFINE_integer("n_prompt", 512, "Prompt tokens for the pp test (0 = skip).",
                       short_name="p")
  flags.DEFINE_integer("n_gen", 128, "Generated tokens for the tg test (0 = skip).",
                       short_name="n")
  flags.DEFINE_integer("repetitions", 5, "Timed repetitions after one warm-up.", short_name="r")
  flags.DEFINE_integer("threads", None, threads_help, short_name="t")
  flags.DEFINE_string("output", "md", "md or json.", short_name="o")
  flags.DEFINE_bool("interleave_dense", False, "With --sparse=gate|contribution|predictor: also "
                    "time the same loaded model's dense FFN, alternating repetitions in this "
                    "process, and print the sparse/dense ratio (steadier than two runs on a "
                    "noisy machine).")
  flags.DEFINE_bool("interleave_gate", False, "With --sparse=predictor: also time the same "
                    "loaded model's gate-first FFN (exact ReLU zeros), alternating repetitions, "
                    "and print the predictor/gate ratio.")


def check_flags(f) -> None:
  """Validates the flags of `define_flags`; raises ConfigError naming the bad one."""
  if f.repetitions < 1:
    raise ConfigError(f"-r {f.repetitions} must be >= 1.")
  if f.output not in ("md", "json"):
    raise ConfigError(f"-o {f.output!r} must be md or json.")
  if f.threads is not None and f.threads < 1:
    raise ConfigError(f"-t {f.threads} must be >= 1.")
  if f.n_prompt < 0 or f.n_gen < 0 or not (f.n_prompt or f.n_gen):
    raise ConfigError(f"-p {f.n_prompt} / -n {f.n_gen}: both must be >= 0 (0 skips a test), "
                      "one > 0.")
  from pijax import sparse_flags
  # --hot_ratio etc.: refused before the load, even for a plain GGUF.
  sparse_flags.check(model=f.model)


def load_for_bench(f):
  """Loads -m, checks -p/-n against its context, applies the sparse flags and -t.

  Returns (model, threads). Raises ConfigError when -p/-n do not fit the context.
  """
  import os
  import pijax
  from pijax import sparse_flags
  # --parallel: each sequence holds its prompt and its generated tokens.
  parallel = bool(getattr(f, "parallel", None))
  model = pijax.load(f.model, max_seq_len=max(f.n_prompt + f.n_gen + 1 if parallel else
                                              max(f.n_prompt, f.n_gen + 1), 256))
  if f.n_prompt > model.max_seq_len or f.n_gen + 1 > model.max_seq_len:
    raise ConfigError(f"-p {f.n_prompt} / -n {f.n_gen} do not fit the model's context of "
                      f"{model.max_seq_len} tokens (-p <= {model.max_seq_len}, "
                      f"-n < {model.max_seq_len}).")
  sparse_flags.configure(model)
  if f.threads:
    from host_ops import sparse_ffn as host_ffn
    host_ffn.set_host_threads(f.threads)
  return model, f.threads or os.cpu_count()


MAX_PARALLEL = 1024  # Sequences per batch --parallel accepts (llama-batched-bench: -npl).


def _batches(values: list[str]) -> list[int]:
  try:
    batches = [int(v) for v in values]
  except ValueError:
    batches = []
  if not batches or min(batches) < 1 or max(batches) > MAX_PARALLEL:
    raise ConfigError(f"--parallel={','.join(values)} must be batch sizes in [1, "
                      f"{MAX_PARALLEL}], e.g. 1,2,4,8.")
  return batches


def main(argv: list[str]) -> None:
  del argv
  from absl import flags
  f = flags.FLAGS
  check_flags(f)
  if f["parallel"].present:
    _batches(f.parallel)  # Refused before the load (an empty list too).
    if not f.n_gen:
      raise ConfigError("--parallel times decode: give -n > 0.")
  model, threads = load_for_bench(f)
  if f.parallel:
    if f.n_prompt + f.n_gen + 1 > model.max_seq_len:
      raise ConfigError(f"--parallel: each sequence holds -p {f.n_prompt} + -n {f.n_gen} + 1 "
                        f"tokens, more than the model's context of {model.max_seq_len}.")
    rows = bench_parallel(model, f.n_prompt, f.n_gen, f.repetitions, _batches(f.parallel),
                          threads)
  else:
    rows = run(model, n_prompt=f.n_prompt, n_gen=f.n_gen, reps=f.repetitions, threads=threads,
               interleave_dense=f.interleave_dense, profile_layers=f.profile_layers,
               interleave_gate=f.interleave_gate)
  if f.output == "json":
    sys.stdout.write(json.dumps(rows, indent=1) + "\n")
  else:
    sys.stdout.write(format_markdown(rows) + "\n")


if __name__ == "__main__":
  from absl import flags as absl_flags
  from pijax import cli
  define_flags()
  absl_flags.DEFINE_bool("profile_layers", False, "Host weights: also print the microseconds "
                         "per layer and token of each phase of the layer loop (q/k/v, "
                         "attention, output, gate, up, down; the up and down passes with "
                         "--sparse=gate|contribution), from the CPU's cycle counter.")
  absl_flags.DEFINE_list("parallel", [], "Host weights: aggregate decode tokens/s of B "
                         "sequences decoded together for each B given (e.g. 1,2,4,8; "
                         "llama-batched-bench's -npl), each after its own -p token prompt.")
  cli.run(main, "pijax.bench")
