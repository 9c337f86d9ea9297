"""`python -m pijax.perplexity -f FILE -c 512 --chunks N`: llama-perplexity's definition.

The text is tokenized once and cut into chunks of n_ctx tokens; each chunk is evaluated from
position 0 (BOS replaces its first token when the model adds BOS), and only the second half of
each chunk is scored, so every scored token sees at least n_ctx/2 tokens of context. Prints a
running `[i]ppl` list and `Final estimate: PPL = X +/- Y` (Y: the standard error of the mean
negative log-likelihood, propagated through exp). With --kl_divergence_base=FILE it saves the
dense log-probs of the scored positions; with --kl_divergence it compares this run to them:
mean KL(base || this run) and top-1 agreement. In sparse modes it also prints the measured FFN
sparsity (fraction of FFN neurons skipped, averaged over layers and tokens).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np

from pijax.errors import ConfigError


@dataclasses.dataclass
class PerplexityResult:
  """ppl: exp(mean NLL); ppl_err: its standard error; nll: f64[n] per scored token."""

  ppl: float
  ppl_err: float
  nll: np.ndarray
  chunk_ppl: list[float]
  ffn_sparsity: float
  kld: float | None = None
  kld_err: float | None = None
  top1_agreement: float | None = None


def _log_softmax(logits: np.ndarray) -> np.ndarray:
  x = logits.astype(np.float64)
  x -= x.max(axis=-1, keepdims=True)
  return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def perplexity(model, text: str, *, n_ctx: int = 512, chunks: int | None = None,
               kl_base_path: str | None = None, kl_save_path: str | None = None,
               log=None) -> PerplexityResult:
  """Computes llama-perplexity-style perplexity (see the module docstring).

  Args:
    model: a loaded `pijax.engine.Model` (dense or with a sparse mode configured).
    text: the evaluation text.
    n_ctx: tokens per chunk (even, <= max_seq_len).
    chunks: evaluate at most this many chunks (None: all).
    kl_base_path: compare against log-probs saved by a previous run (KL divergence).
    kl_save_path: save this run's log-probs (f16 .npy, [chunks * n_ctx/2, vocab]) for later
      comparisons; written to a temp file, then renamed.
    log: callable(str) for the running output (default: stderr).

  Raises:
    ConfigError: bad n_ctx/chunks, too little text, a KL base of another shape.
  """
  log = log or (lambda s: (sys.stderr.write(s), sys.stderr.flush()))
  if n_ctx < 2 or n_ctx % 2 or n_ctx > model.max_seq_len:
    raise ConfigError(f"-c {n_ctx} must be even, >= 2 and <= max_seq_len {model.max_seq_len}.")
  if chunks is not None and chunks < 1:
    raise ConfigError(f"--chunks {chunks} must be >= 1.")
  ids = model.tokenizer.encode(text, add_special=False)
  available = len(ids) // n_ctx
  n_chunks = available if chunks is None else min(chunks, available)
  if n_chunks < 1:
    raise ConfigError(f"the text has {len(ids)} tokens; need at least {n_ctx} (one chunk of "
                      "-c tokens).")
  first = n_ctx // 2
  n_scored = n_chunks * (n_ctx - first)
  base = None
  if kl_base_path:
    if not os.path.exists(kl_base_path):
      raise ConfigError(f"{kl_base_path}: no such KL-divergence base; make it with "
                        "--kl_divergence_base on the reference run.")
    try:
      base = np.load(kl_base_path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError):
      raise ConfigError(f"{kl_base_path}: not a .npy log-prob file; make it with "
                        "--kl_divergence_base on the reference run.") from None
    if not isinstance(base, np.ndarray) or base.shape != (n_scored, model.config.vocab_size):
      raise ConfigError(f"{kl_base_path}: holds {base.shape} log-probs but this run scores "
                        f"{(n_scored, model.config.vocab_size)}; use the same -f, -c, --chunks.")
  save = None
  if kl_save_path:
    tmp_save = kl_save_path + ".tmp.npy"
    save = np.lib.format.open_memmap(tmp_save, mode="w+", dtype=np.float16,
                                     shape=(n_scored, model.config.vocab_size))
  nll = np.zeros(n_scored, np.float64)
  kld = np.zeros(n_scored, np.float64) if base is not None else None
  agree = np.zeros(n_scored, bool) if base is not None else None
  active = []
  chunk_ppl = []
  log(f"perplexity: {n_chunks} chunks, n_ctx={n_ctx}, scoring {n_ctx - first} tokens each\n")
  for c in range(n_chunks):
    toks = list(ids[c * n_ctx:(c + 1) * n_ctx])
    if model.tokenizer.add_bos and model.tokenizer.bos_id is not None:
      toks[0] = model.tokenizer.bos_id
    logits, frac = model.prompt_logits(toks, return_active=True)
    active.append(frac)
    logp = _log_softmax(logits[first - 1:n_ctx - 1])  # predicts toks[first:]
    targets = np.asarray(toks[first:])
    rows = slice(c * (n_ctx - first), (c + 1) * (n_ctx - first))
    nll[rows] = -logp[np.arange(len(targets)), targets]
    if save is not None:
      save[rows] = logp.astype(np.float16)
    if base is not None:
      b = np.asarray(base[rows], np.float64)
      kld[rows] = (np.exp(b) * (b - logp)).sum(axis=-1)
      agree[rows] = b.argmax(-1) == logp.argmax(-1)
    running = float(np.exp(nll[:rows.stop].mean()))
    chunk_ppl.append(running)
    log(f"[{c + 1}]{running:.4f},")
  log("\n")
  if save is not None:
    save.flush()
    del save
    os.replace(kl_save_path + ".tmp.npy", kl_save_path)
  mean = nll.mean()
  err = nll.std(ddof=1) / np.sqrt(len(nll)) if len(nll) > 1 else 0.0
  ppl = float(np.exp(mean))
  result = PerplexityResult(ppl=ppl, ppl_err=float(ppl * err), nll=nll, chunk_ppl=chunk_ppl,
                            ffn_sparsity=float(1.0 - np.mean(active)))
  if base is not None:
    result.kld = float(kld.mean())
    result.kld_err = float(kld.std(ddof=1) / np.sqrt(len(kld))) if len(kld) > 1 else 0.0
    result.top1_agreement = float(agree.mean())
  return result


def format_result(result: PerplexityResult, sparse_mode: str) -> str:
  lines = [f"Final estimate: PPL = {result.ppl:.4f} +/- {result.ppl_err:.5f}"]
  if sparse_mode != "off":
    lines.append(f"FFN sparsity ({sparse_mode}): {result.ffn_sparsity:.4f}")
  if result.kld is not None:
    lines.append(f"Mean KLD: {result.kld:.6f} +/- {result.kld_err:.6f}")
    lines.append(f"Same top p: {100 * result.top1_agreement:.3f} %")
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  from absl import flags
  import pijax
  from pijax import cli
  from pijax import sparse_flags
  del argv
  f = flags.FLAGS
  if not f.file:
    raise ConfigError("-f FILE is required.")
  if f.ctx_size < 2 or f.ctx_size % 2:
    raise ConfigError(f"-c {f.ctx_size} must be even and >= 2 (tokens per chunk).")
  if f.chunks < 0:
    raise ConfigError(f"--chunks {f.chunks} must be >= 0 (0 = every chunk).")
  if f.kl_divergence and not f.kl_divergence_base:
    raise ConfigError("--kl_divergence needs --kl_divergence_base=FILE, written by a reference "
                      "run without --kl_divergence.")
  if f.kl_divergence_base and not f.kl_divergence:
    folder = os.path.dirname(os.path.abspath(f.kl_divergence_base))
    if not os.path.isdir(folder):
      raise ConfigError(f"--kl_divergence_base={f.kl_divergence_base}: no folder {folder} to "
                        "write it in.")
    if os.path.isdir(f.kl_divergence_base) or f.kl_divergence_base.endswith(os.sep):
      raise ConfigError(f"--kl_divergence_base={f.kl_divergence_base} is a folder; name the file "
                        "to write (e.g. base.npy).")
  # --hot_ratio etc.: refused before the load, even for a plain GGUF.
  sparse_flags.check(model=f.model)
  calibration = sparse_flags.CALIBRATION_FILE.value
  if calibration and os.path.isfile(calibration) and os.path.isfile(f.file) and \
      os.path.samefile(calibration, f.file):
    raise ConfigError(f"--calibration_file={calibration} is the evaluation text (-f): calibrate "
                      "on other text (e.g. ../shared/data/tinyshakespeare/input.txt).")
  text = cli.read_text(f.file, "the text")
  model = pijax.load(f.model, max_seq_len=max(f.ctx_size, 16))
  sparse_flags.configure(model, per_token_prefill=True)
  result = perplexity(model, text, n_ctx=f.ctx_size, chunks=f.chunks or None,
                      kl_base_path=f.kl_divergence_base if f.kl_divergence else None,
                      kl_save_path=None if f.kl_divergence else f.kl_divergence_base)
  sys.stdout.write(format_result(result, model.sparse_mode) + "\n")


if __name__ == "__main__":
  from absl import flags
  from pijax import cli
  from pijax import sparse_flags  # noqa: F401  (defines --sparse, --hot_ratio, ...)
  flags.DEFINE_string("model", "default", "GGUF, bundle, or 'default'.", short_name="m")
  flags.DEFINE_string("file", None, "Text file to evaluate.", short_name="f")
  flags.DEFINE_integer("ctx_size", 512, "Tokens per chunk (n_ctx).", short_name="c")
  flags.DEFINE_integer("chunks", 0, "Evaluate at most this many chunks (0 = all).")
  flags.DEFINE_string("kl_divergence_base", None, "Log-prob file: written by a reference run, "
                      "read with --kl_divergence.")
  flags.DEFINE_boolean("kl_divergence", False, "Compare with --kl_divergence_base.")
  cli.run(main, "pijax.perplexity")
