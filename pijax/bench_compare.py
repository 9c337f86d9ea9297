"""`python -m pijax.bench_compare`: pijax's and llama.cpp's pp/tg on one GGUF, side by side.

  python -m pijax.bench_compare -m default -p 512 -n 128 -r 5 -t 2
  python -m pijax.bench_compare -m bundles/smollm2_135m --sparse=predictor --hot_ratio=0 -o json

The pijax side is `pijax.bench.run`, so its figures are the ones `python -m pijax.bench` prints.
The llama.cpp side runs in the same process through llama-cpp-python (the `compare` extra,
`make bench-compare`) on the same GGUF (a bundle's source GGUF) with the same thread count, timed
as llama-bench does: pp<P> = one `eval` of P random token ids (BOS first) into an empty KV cache;
tg<N> = N single-token `eval`s from an empty KV cache (BOS, then random ids), no sampling. Both
sides run each test once as a warm-up, then -r times; t/s is mean +- sd over the runs, and the
ratio is pijax mean / llama.cpp mean (> 1: pijax is faster). llama.cpp is timed first, before
pijax compiles or runs anything, so no XLA or numba worker thread competes with it.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from typing import Any, Sequence

import numpy as np

from pijax import bench as bench_lib
from pijax.errors import ConfigError, PijaxError
from pijax.measure import machine
from pijax.measure import tables

MISSING_LLAMA_CPP = ("llama-cpp-python is not installed: run `make bench-compare` "
                     "(installs the compare extra)")


class LlamaCppMissingError(PijaxError):
  """llama-cpp-python (the optional `compare` extra) cannot be imported."""


def import_llama_cpp():
  """The `llama_cpp` module.

  Raises:
    LlamaCppMissingError: it is not installed (or its native library does not load).
  """
  try:
    import llama_cpp
  except ImportError:
    raise LlamaCppMissingError(MISSING_LLAMA_CPP) from None
  except (OSError, RuntimeError) as err:  # Installed, but libllama does not load.
    raise LlamaCppMissingError(f"llama-cpp-python is installed but does not load ({err}); "
                               "reinstall it with `make bench-compare`.") from None
  return llama_cpp


def gguf_path(model) -> str:
  """The GGUF file behind a loaded pijax Model (a bundle's source GGUF for bundles)."""
  if model.sparse is not None:
    return model.sparse.manifest["source"]["path"]
  return model.path


def make_llama(path: str, *, threads: int, n_ctx: int, n_batch: int = 512):
  """A llama_cpp.Llama on `path` set up like llama-bench: CPU, `threads` for batch and decode.

  Args:
    path: GGUF file.
    threads: n_threads and n_threads_batch.
    n_ctx: KV cache length (tokens).
    n_batch: logical batch (tokens per llama_decode call; physical ubatch 512).
  """
  llama_cpp = import_llama_cpp()
  return llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=threads,
                         n_threads_batch=threads, n_batch=n_batch, verbose=False,
                         logits_all=False)


def _clear(llm) -> None:
  """Empties the KV cache: position 0 for the next eval, no cells kept."""
  llm.reset()
  ctx = getattr(llm, "_ctx", None)  # llama_cpp's internal context; stand-ins have none.
  if ctx is not None:
    ctx.kv_cache_clear()


def _synchronize(llm) -> None:
  """Waits for llama_decode's work to finish (llama-bench calls llama_synchronize too)."""
  ctx = getattr(llm, "_ctx", None)
  if ctx is not None:
    import llama_cpp
    llama_cpp.llama_synchronize(ctx.ctx)


def bench_llama(llm, *, n_prompt: int, n_gen: int, reps: int,
                seed: int = 0) -> list[bench_lib.BenchResult]:
  """llama-bench's pp<n_prompt> and tg<n_gen> on a Llama-like object (0 skips a test).

  Args:
    llm: `llama_cpp.Llama`, or anything with reset(), eval(list[int]), n_vocab(), token_bos().
    n_prompt: prompt tokens of the pp test, evaluated in one eval call.
    n_gen: single-token eval calls of the tg test.
    reps: timed repetitions after one warm-up.
    seed: seed of the random token ids (numpy; the pp ids are pijax.bench's, with BOS first).

  Returns:
    One BenchResult per test (tokens_per_s per repetition; compile_s = 0).
  """
  n_vocab = int(llm.n_vocab())
  bos = llm.token_bos()
  bos = int(bos) if bos is not None and bos >= 0 else None
  rng = np.random.default_rng(seed)
  results = []
  # pp: all ids in one eval call; tg: one eval call per id (llama-bench's two tests).
  for name, n, batches in (("pp", n_prompt, lambda ids: [ids]),
                           ("tg", n_gen, lambda ids: [[t] for t in ids])):
    if not n:
      continue
    tokens = [int(t) for t in rng.integers(0, n_vocab, n)]
    if bos is not None:
      tokens[0] = bos
    rates = []
    for rep in range(reps + 1):
      _clear(llm)
      t0 = time.perf_counter()
      for batch in batches(tokens):
        llm.eval(batch)
        _synchronize(llm)
      if rep:  # Repetition 0 is the warm-up.
        rates.append(n / (time.perf_counter() - t0))
    results.append(bench_lib.BenchResult(f"{name}{n}", rates, 0.0))
  return results


def llama_rows(results: Sequence[bench_lib.BenchResult], *, path: str,
               threads: int) -> list[dict[str, Any]]:
  """Rows like pijax.bench.run's (test, t_s_mean, t_s_sd, reps) for llama.cpp results."""
  return [{"model": path, "backend": "llama.cpp", "threads": threads, "test": r.test,
           "t_s_mean": r.mean, "t_s_sd": r.sd, "tokens_per_s": list(r.tokens_per_s),
           "reps": len(r.tokens_per_s)} for r in results]


def compare_rows(pijax_rows: Sequence[dict[str, Any]],
                 llama_rows_: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """One row per test found on both sides: t/s mean and sd of each, ratio = pijax / llama.cpp."""
  llama_by_test = {r["test"]: r for r in llama_rows_}
  out = []
  for p in pijax_rows:
    q = llama_by_test.get(p["test"])
    if q is None:
      continue
    out.append({"test": p["test"], "pijax_t_s": p["t_s_mean"], "pijax_t_s_sd": p["t_s_sd"],
                "llama_cpp_t_s": q["t_s_mean"], "llama_cpp_t_s_sd": q["t_s_sd"],
                "ratio": p["t_s_mean"] / q["t_s_mean"] if q["t_s_mean"] > 0 else float("nan")})
  return out


def machine_name() -> str:
  """lscpu's "Model name" (else /proc/cpuinfo's "model name", else platform's guess)."""
  return machine.cpu_name() or platform.processor() or platform.machine() or "unknown"


def header(info: dict[str, Any]) -> str:
  """The line above the table: model path and sizes, threads, machine, versions."""
  mode = "dense" if info["pijax_mode"] == "off" else f"--sparse={info['pijax_mode']}"
  return (f"model: {info['gguf']} (file {info['file_size_bytes'] / 2 ** 30:.3f} GiB; pijax "
          f"{mode}, {info['pijax_dtype']} weights {info['pijax_size_gib']:.3f} GiB in "
          f"memory), threads: {info['threads']}, machine: {info['machine']} "
          f"({info['cpu_count']} cores), pijax backend: {info['pijax_backend']}, "
          f"llama-cpp-python {info['llama_cpp_version']}")


def format_markdown(info: dict[str, Any], rows: Sequence[dict[str, Any]]) -> str:
  """Header line, llama.cpp's system info line, then | test | pijax | llama.cpp | ratio |."""
  table = tables.markdown_table(
      ("test", "pijax t/s", "llama.cpp t/s", "ratio (pijax / llama.cpp)"), "lrrr",
      ([f"{r['test']}", f"{r['pijax_t_s']:.2f} ± {r['pijax_t_s_sd']:.2f}",
        f"{r['llama_cpp_t_s']:.2f} ± {r['llama_cpp_t_s_sd']:.2f}", f"{r['ratio']:.3f}"]
       for r in rows))
  return "\n".join([header(info), f"llama.cpp system info: {info['llama_cpp_system_info']}", "",
                    *table])


def run(model, llm, *, n_prompt: int, n_gen: int, reps: int, threads: int,
        system_info: str = "", llama_cpp_version: str = "") -> dict[str, Any]:
  """Both benches on one model: {"info": ..., "pijax": rows, "llama_cpp": rows, "compare": rows}.

  Args:
    model: a loaded pijax Model (sparse mode already configured).
    llm: a Llama on the same GGUF (see `make_llama`), or a stand-in (see `bench_llama`).
    n_prompt, n_gen, reps, threads: as in `pijax.bench.run`.
    system_info, llama_cpp_version: reported as they are.
  """
  path = gguf_path(model)
  # llama.cpp first: XLA has then run nothing but the load, so none of its threads are busy.
  lrows = llama_rows(bench_llama(llm, n_prompt=n_prompt, n_gen=n_gen, reps=reps), path=path,
                     threads=threads)
  pijax_rows = bench_lib.run(model, n_prompt=n_prompt, n_gen=n_gen, reps=reps, threads=threads)
  info = {"gguf": path, "model": model.path,
          "file_size_bytes": os.path.getsize(path) if os.path.exists(path) else 0,
          "pijax_size_gib": bench_lib.weights_size_bytes(model) / 2 ** 30,
          "pijax_dtype": bench_lib.weights_label(model), "pijax_mode": model.sparse_mode,
          "pijax_backend": pijax_rows[0]["backend"] if pijax_rows else "",
          "threads": threads, "machine": machine_name(), "cpu_count": os.cpu_count(),
          "llama_cpp_version": llama_cpp_version, "llama_cpp_system_info": system_info,
          "reps": reps}
  return {"info": info, "pijax": pijax_rows, "llama_cpp": lrows,
          "compare": compare_rows(pijax_rows, lrows)}


def main(argv: list[str]) -> None:
  del argv
  from absl import flags
  f = flags.FLAGS
  bench_lib.check_flags(f)
  if f.interleave_dense:
    raise ConfigError("--interleave_dense is pijax.bench's (sparse vs dense in one process); "
                      "bench_compare alternates pijax with llama.cpp: drop it.")
  llama_cpp = import_llama_cpp()  # Before the (slow) pijax load.
  model, threads = bench_lib.load_for_bench(f)
  llm = make_llama(gguf_path(model), threads=threads, n_ctx=max(f.n_prompt, f.n_gen + 1))
  system_info = llama_cpp.llama_print_system_info()
  if isinstance(system_info, bytes):
    system_info = system_info.decode("utf-8", "replace")
  result = run(model, llm, n_prompt=f.n_prompt, n_gen=f.n_gen, reps=f.repetitions,
               threads=threads, system_info=" ".join(system_info.split()),
               llama_cpp_version=getattr(llama_cpp, "__version__", "?"))
  llm.close()
  if f.output == "json":
    sys.stdout.write(json.dumps(result, indent=1) + "\n")
  else:
    sys.stdout.write(format_markdown(result["info"], result["compare"]) + "\n")


if __name__ == "__main__":
  from pijax import cli
  bench_lib.define_flags("Threads: llama.cpp's n_threads(_batch) and pijax's numba host "
                         "threads (XLA uses every core). Default: every core.")
  cli.run(main, "pijax.bench_compare")
