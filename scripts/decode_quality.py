"""Quality of the int8 decode products (`--host_dot=int8`) against f32 ones, teacher-forced.

Prefill runs the f32 tiled product whatever --host_dot says, so `pijax.perplexity` does not see
the integer kernels; here every token is its own decode-shaped pass (1 row) through the host
decoder, once with each `dot`, on chunks of the evaluation text. Prints perplexity (second half
of each chunk scored, as `pijax.perplexity`), mean KL(f32 || int8) and top-1 agreement.

  .venv/bin/python scripts/decode_quality.py -f ../shared/data/wikitext-2-raw/wiki.test.raw \
      -c 256 --chunks 4
"""

import argparse
import sys

import numpy as np


def _log_softmax(x):
  x = x.astype(np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _fail(message):
  print(f"decode_quality: error: {message}", file=sys.stderr)
  sys.exit(2)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("-m", "--model", default="default")
  parser.add_argument("-f", "--file", required=True)
  parser.add_argument("-c", "--ctx_size", type=int, default=256)
  parser.add_argument("--chunks", type=int, default=4)
  parser.add_argument("-t", "--threads", type=int, default=2)
  args = parser.parse_args()
  if args.ctx_size < 4 or args.ctx_size % 2:
    _fail(f"-c {args.ctx_size} must be even and >= 4 (tokens per chunk).")
  if args.chunks < 1:
    _fail(f"--chunks {args.chunks} must be >= 1.")
  try:
    with open(args.file, encoding="utf-8") as fh:
      text = fh.read()
  except (OSError, UnicodeDecodeError) as err:
    _fail(f"-f {args.file}: cannot read the text ({err}).")
  import host_ops
  import pijax
  from pijax.errors import PijaxError
  try:
    host_ops.set_host_threads(args.threads)
    model = pijax.load(args.model, max_seq_len=args.ctx_size)
    weights = model.configure_host_weights("auto")
  except (PijaxError, host_ops.HostOpError) as err:
    _fail(str(err))
  if weights == "off":
    _fail(f"{args.model} does not run on host weights (its matrices are not all Q4_1/Q8_0).")
  dec = model.backend.decoder
  if dec.dot != "int8":
    _fail("the integer kernels do not run on this CPU (no AVX2).")
  ids = model.tokenizer.encode(text, add_special=False)
  n, first = args.ctx_size, args.ctx_size // 2
  if len(ids) < n * args.chunks:
    _fail(f"-f {args.file} holds {len(ids)} tokens; -c {n} --chunks {args.chunks} needs "
          f"{n * args.chunks}.")
  nll = {"f32": [], "int8": []}
  kld, agree = [], []
  for c in range(args.chunks):
    toks = list(ids[c * n:(c + 1) * n])
    if model.tokenizer.add_bos and model.tokenizer.bos_id is not None:
      toks[0] = model.tokenizer.bos_id
    logp = {}
    for dot in ("f32", "int8"):
      dec.dot = dot
      cache = dec.new_cache(1, n)
      rows = [dec.forward(cache, np.asarray([[t]]), i)[0] for i, t in enumerate(toks[:-1])]
      logp[dot] = _log_softmax(np.stack(rows[first - 1:]))
      nll[dot].extend(-logp[dot][np.arange(n - first), toks[first:]])
    kld.extend((np.exp(logp["f32"]) * (logp["f32"] - logp["int8"])).sum(-1))
    agree.extend(logp["f32"].argmax(-1) == logp["int8"].argmax(-1))
    print(f"[{c + 1}] ppl f32 {np.exp(np.mean(nll['f32'])):.4f} int8 "
          f"{np.exp(np.mean(nll['int8'])):.4f}", file=sys.stderr)
  dec.dot = "int8"
  for dot in ("f32", "int8"):
    v = np.asarray(nll[dot])
    ppl = np.exp(v.mean())
    print(f"{dot}: PPL = {ppl:.4f} +/- {ppl * v.std(ddof=1) / np.sqrt(len(v)):.5f}")
  kld = np.asarray(kld)
  print(f"Mean KLD(f32 || int8): {kld.mean():.6f} +/- {kld.std(ddof=1) / np.sqrt(len(kld)):.6f}")
  print(f"Same top p: {100 * np.mean(agree):.3f} %  ({len(kld)} tokens)")


if __name__ == "__main__":
  main()
