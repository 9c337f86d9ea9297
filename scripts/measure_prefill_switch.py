"""Where should a sparse prefill switch to computing every neuron? (issue 4, BUILD_NOTES.md)

For prompt lengths T it times the hybrid prefill with every token's own predicted active set
(prefill_dense_tokens=0) against the same pass computing every neuron (prefill_dense_tokens=1),
via `pijax.bench.bench_prefill`, and reports the union of the predicted active sets of T
consecutive tokens of real text (the share of neurons whose rows a T-token pass must read).

  python scripts/measure_prefill_switch.py --model=BUNDLE --hot_ratio=0.3 \\
      --text=../shared/data/wikitext-2-raw/wiki.test.raw
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

import pijax
from pijax import bench
from pijax.nn import hybrid

_MODEL = flags.DEFINE_string("model", None, "Bundle folder.", required=True)
_HOT_RATIO = flags.DEFINE_float("hot_ratio", 0.3, "Device-resident share of each layer.")
_TEXT = flags.DEFINE_string("text", "../shared/data/wikitext-2-raw/wiki.test.raw",
                            "Text for the union measurement.")
_LENGTHS = flags.DEFINE_list("lengths", ["1", "2", "4", "8", "16", "32", "64", "128"],
                             "Prompt lengths T.")
_REPS = flags.DEFINE_integer("reps", 3, "Timed repetitions per cell.")
_KIND = flags.DEFINE_string("predictor_kind", "auto", "Predictor kind.")


def main(argv):
  del argv
  lengths = [int(v) for v in _LENGTHS.value]
  from pijax.errors import ConfigError
  if not lengths or min(lengths) < 1 or _REPS.value < 1:
    raise ConfigError("--lengths must be integers >= 1 and --reps >= 1.")
  model = pijax.load(_MODEL.value, max_seq_len=max(512, max(lengths)))
  if model.sparse is None:
    raise ConfigError(f"{_MODEL.value} is not a bundle; convert it with pijax.convert first.")
  model.configure_sparse("predictor", hot_ratio=_HOT_RATIO.value,
                         predictor_kind=_KIND.value, host_predict=False)  # Whole masks visible.
  with open(_TEXT.value, encoding="utf-8") as f:
    ids = model.tokenizer.encode(f.read()[:20000], add_special=False)[:512]
  run = jax.jit(lambda p, t: hybrid.forward_with_masks(p, t, config=model.config,
                                                       sparse=model.backend.spec))
  # bool[L, T, F] per-token predicted active sets over 512 tokens of real text.
  masks = np.asarray(run(model.step_params, jnp.asarray([ids], jnp.int32))[1][:, 0])
  rows = []
  for t in lengths:
    windows = [masks[:, s:s + t].any(axis=1).mean() for s in range(0, 512 - t + 1, max(t, 8))]
    union = float(np.mean(windows))
    rates = {}
    for dense_tokens in (0, 1):
      model.configure_sparse("predictor", hot_ratio=_HOT_RATIO.value,
                             predictor_kind=_KIND.value, prefill_dense_tokens=dense_tokens)
      r = bench.bench_prefill(model, t, _REPS.value)
      rates[dense_tokens] = (r.mean, r.sd, r.ffn_sparsity)
    rows.append((t, union, rates))
  print(f"model {_MODEL.value}, predictor {model.backend.spec.predictor_kind}, hot_ratio "
        f"{_HOT_RATIO.value}, backend {jax.default_backend()}")
  print("| T | union of T tokens' active sets | per-token sets t/s | every neuron t/s | "
        "faster |")
  print("| ---: | ---: | ---: | ---: | --- |")
  for t, union, rates in rows:
    (s_mean, s_sd, _), (d_mean, d_sd, _) = rates[0], rates[1]
    print(f"| {t} | {union:.3f} | {s_mean:.1f} ± {s_sd:.1f} | {d_mean:.1f} ± {d_sd:.1f} | "
          f"{'per-token' if s_mean > d_mean else 'every neuron'} |")


if __name__ == "__main__":
  from pijax import cli
  cli.run(main, "measure_prefill_switch")
