"""Writes a LLaMA-2-7B-shaped GGUF of random quantized blocks, for speed and memory benchmarks.

  .venv/bin/python scripts/make_synthetic_gguf.py --out /tmp/synthetic-7b-drelu.q4_1.gguf \
      --activation drelu --type Q4_1
  .venv/bin/python scripts/make_synthetic_gguf.py --out /tmp/synthetic-7b.q4_k_m.gguf \
      --activation silu --type Q4_K_M

Shapes (LLaMA-2-7B): hidden_size 4096, intermediate_size 11008, 32 layers, 32 heads (32 KV
heads), head_dim 128, vocab 32000, rope_theta 10000. Every matrix is random blocks of `--type`
(Q4_1, Q8_0, or the Q4_K_M mix: llama.cpp's choice per tensor, below) with scales chosen so
weights have std ~0.02 and mean ~0 (Q4_1: d = 0.0043, m = -7.5 d, codes uniform), norms are ones,
and the
tokenizer is a placeholder BPE vocabulary ("a", "b", "ab", then "<t3>".."<t31999>"): prompts
can only use "a" and "b" (other characters have no token), the text it generates means nothing;
the bytes read per token are those of a 7B model. An existing --out file is replaced.

`--activation drelu` writes `pijax.ffn_activation = "drelu"` (relu(gate x) * relu(up x)), so with
gate and up independent and symmetric ~75% of FFN neurons are inactive per token by
construction: the case where gate-first sparsity (`--gate_sparse`) skips up and down rows
exactly. llama.cpp ignores the key and runs the file as a dense SwiGLU model (the same bytes).

`--format powerinfer` writes the model in PowerInfer's layout instead (magic b"PWRI", per-layer
fc1/fc2 predictors, ffn_down_t, `powerinfer.sparse_threshold`): a ReLU model whose neurons are
~90% inactive with a low-rank structure its analytically derived predictors find (see
synthetic_powerinfer.py), then measures their recall and precision on the file's activations
(`--measure_tokens`), and with `--gpuidx_bytes` writes PowerInfer's placement file beside it:

  .venv/bin/python scripts/make_synthetic_gguf.py --format powerinfer --activation relu \
      --type Q4_0 --out /tmp/syn/synthetic-7b-relu.powerinfer.q4_0.gguf

Tensors are written one at a time (streamed: memory stays ~ one tensor); the file goes to a
temp name and is renamed when complete.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

SHAPES = {"llama2-7b": dict(hidden=4096, ffn=11008, layers=32, heads=32, kv_heads=32,
                            vocab=32000),
          "tiny": dict(hidden=128, ffn=352, layers=2, heads=4, kv_heads=2, vocab=512),
          # The smallest shape on which Q4_K_M's per-layer mix shows (256-value blocks, 8 layers).
          "tiny-k": dict(hidden=256, ffn=512, layers=8, heads=4, kv_heads=2, vocab=512)}
# Bytes per block and values per block of each GGML type written here.
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q8_0": 34, "Q4_K": 144, "Q6_K": 210, "F16": 2}
BLOCK_VALUES = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q8_0": 32, "Q4_K": 256, "Q6_K": 256, "F16": 1}
TYPES = ("Q4_1", "Q8_0", "Q4_K_M", "Q4_0")
FORMATS = ("gguf", "powerinfer")


def tensor_type(qtype: str, name: str, layer: int | None, n_layers: int, cols: int) -> str:
  """The GGML type of one [rows, cols] matrix. Q4_K_M follows llama.cpp's mix
  (`llama_tensor_get_type`): Q4_K everywhere, Q6_K for output.weight and for attn_v / ffn_down in
  the first and last eighth of the layers and every third layer between them; Q8_0 where cols is
  not a multiple of 256 (the "tiny" shape)."""
  if qtype != "Q4_K_M":
    return qtype
  if cols % 256:
    return "Q8_0"
  if name == "output.weight":
    return "Q6_K"
  if layer is not None and (name.endswith("attn_v.weight") or name.endswith("ffn_down.weight")):
    eighth = n_layers // 8
    if layer < eighth or layer >= n_layers - eighth or (layer - eighth) % 3 == 2:
      return "Q6_K"
  return "Q4_K"


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
  """u8[..., 12]: Q4_K's eight 6-bit sub-block scales and mins, packed as ggml packs them."""
  out = np.zeros(sc.shape[:-1] + (12,), np.uint8)
  out[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
  out[..., 4:8] = (mn[..., 0:4] & 63) | ((mn[..., 4:8] >> 4) << 6)
  out[..., 8:12] = (sc[..., 4:8] & 15) | ((mn[..., 4:8] & 15) << 4)
  return out
_CHUNK_ROWS = 1024  # Rows generated at once (bounded memory for the 131k-row matrices).


def random_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: str,
                  std: float = 0.02) -> np.ndarray:
  """u8[rows, cols / block_values * block_bytes]: GGUF blocks of `qtype` (Q4_0, Q4_1, Q8_0,
  Q4_K, Q6_K) of random codes with weights of mean ~0 and standard deviation ~std."""
  nb = cols // BLOCK_VALUES[qtype]
  if qtype == "Q4_0":  # w = d (q - 8); q uniform 1..15, so q - 8 is symmetric (std 4.32).
    d = np.frombuffer(np.float16(std / 4.32).tobytes(), np.uint8)
    nib = rng.integers(1, 16, (rows, nb, 16, 2), dtype=np.uint8)
    codes = nib[..., 0] | (nib[..., 1] << 4)
    return np.concatenate([np.broadcast_to(d, (rows, nb, 2)), codes],
                          axis=2).reshape(rows, nb * 18)
  if qtype == "Q4_K":  # w = d sc q - dmin m per 32 values; q uniform 0..15 (mean 7.5, std 4.6).
    sc = rng.integers(24, 41, (rows, nb, 8), dtype=np.uint8)
    d = np.float16(std / (32 * 4.6))
    dd = np.frombuffer(np.array([d, np.float16(7.5) * d], np.float16).tobytes(), np.uint8)
    return np.concatenate([np.broadcast_to(dd, (rows, nb, 4)), _pack_k_scales(sc, sc),
                           rng.integers(0, 256, (rows, nb, 128), dtype=np.uint8)],
                          axis=2).reshape(rows, nb * 144)
  if qtype == "Q6_K":  # w = d scale (q - 32) per 16 values; q uniform 0..63 (std 18.5).
    scales = rng.integers(24, 41, (rows, nb, 16), dtype=np.int8).view(np.uint8)
    d = np.frombuffer(np.float16(std / (32 * 18.5)).tobytes(), np.uint8)
    return np.concatenate([rng.integers(0, 256, (rows, nb, 192), dtype=np.uint8), scales,
                           np.broadcast_to(d, (rows, nb, 2))], axis=2).reshape(rows, nb * 210)
  if qtype == "Q4_1":
    d = np.float16(std / 4.6)  # Uniform codes 0..15 have std 4.6.
    head = np.frombuffer(np.array([d, np.float16(-7.5) * d], np.float16).tobytes(), np.uint8)
    codes = rng.integers(0, 256, (rows, nb, 16), dtype=np.uint8)
  else:
    d = np.float16(std / 73.6)  # Uniform codes -128..127 have std 73.6.
    head = np.frombuffer(np.array([d], np.float16).tobytes(), np.uint8)
    codes = rng.integers(-128, 128, (rows, nb, 32), dtype=np.int8).view(np.uint8)
  heads = np.broadcast_to(head, (rows, nb, head.size))
  return np.concatenate([heads, codes], axis=2).reshape(rows, nb * BLOCK_BYTES[qtype])


def write(path: str, *, shape: str = "llama2-7b", qtype: str = "Q4_1",
          activation: str = "drelu", seed: int = 0) -> int:
  """Writes the file; returns its size in bytes. Raises ValueError on a bad argument."""
  import gguf
  if shape not in SHAPES or qtype not in TYPES or activation not in ("drelu", "silu",
                                                                            "relu"):
    raise ValueError(f"shape {shape!r} / type {qtype!r} / activation {activation!r}: use "
                     f"{', '.join(SHAPES)} / {', '.join(TYPES)} / drelu, silu, relu")
  if seed < 0:
    raise ValueError(f"seed must be >= 0, got {seed}")
  s = SHAPES[shape]
  tmp = path + ".tmp"
  try:
    _write_to(tmp, gguf, s, qtype, activation, seed, shape)
    os.replace(tmp, path)
  finally:  # No half-written file is left behind, whatever failed.
    if os.path.exists(tmp):
      os.remove(tmp)
  return os.path.getsize(path)


def add_shape_header(w, s: dict, name: str) -> None:
  """The llama-style hyperparameters of shape `s` (a SHAPES entry) on GGUFWriter `w`."""
  w.add_name(name)
  w.add_block_count(s["layers"])
  w.add_context_length(4096)
  w.add_embedding_length(s["hidden"])
  w.add_feed_forward_length(s["ffn"])
  w.add_head_count(s["heads"])
  w.add_head_count_kv(s["kv_heads"])
  w.add_rope_freq_base(10000.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_rope_dimension_count(s["hidden"] // s["heads"])
  w.add_vocab_size(s["vocab"])


def _write_to(tmp, gguf, s, qtype, activation, seed, shape) -> None:
  """Writes the file (see `write`) to `tmp`."""
  hidden, ffn, heads, kv, vocab = s["hidden"], s["ffn"], s["heads"], s["kv_heads"], s["vocab"]
  hd = hidden // heads
  w = gguf.GGUFWriter(tmp, "llama")
  add_shape_header(w, s, f"synthetic-{shape}-{activation}")
  w.add_file_type({"Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                   "Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M,
                   "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[qtype])
  if activation != "silu":
    w.add_string("pijax.ffn_activation", activation)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("default")  # llama.cpp refuses "gpt2" as a pre-tokenizer name.
  w.add_token_list(["a", "b", "ab"] + [f"<t{i}>" for i in range(3, vocab)])
  w.add_token_types([gguf.TokenType.NORMAL] * vocab)
  w.add_token_merges(["a b"])
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)

  n = s["layers"]
  plan = [("token_embd.weight", (vocab, hidden), tensor_type(qtype, "token_embd.weight", None, n,
                                                            hidden))]
  for i in range(n):
    p = f"blk.{i}."
    mats = [("attn_q.weight", (heads * hd, hidden)), ("attn_k.weight", (kv * hd, hidden)),
            ("attn_v.weight", (kv * hd, hidden)), ("attn_output.weight", (hidden, heads * hd)),
            ("ffn_gate.weight", (ffn, hidden)), ("ffn_up.weight", (ffn, hidden)),
            ("ffn_down.weight", (hidden, ffn))]
    plan += [(p + "attn_norm.weight", (hidden,), "F32"), (p + "ffn_norm.weight", (hidden,), "F32")]
    plan += [(p + m, shp, tensor_type(qtype, p + m, i, n, shp[1])) for m, shp in mats]
  plan += [("output_norm.weight", (hidden,), "F32"),
           ("output.weight", (vocab, hidden), tensor_type(qtype, "output.weight", None, n, hidden))]
  for name, shp, ttype in plan:
    if len(shp) == 1:
      w.add_tensor_info(name, shp, np.dtype(np.float32), 4 * shp[0])
    else:
      rows, cols = shp
      row_bytes = cols // BLOCK_VALUES[ttype] * BLOCK_BYTES[ttype]
      w.add_tensor_info(name, (rows, row_bytes), np.dtype(np.uint8), rows * row_bytes,
                        raw_dtype=getattr(gguf.GGMLQuantizationType, ttype))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_ti_data_to_file()
  rng = np.random.default_rng(seed)
  for name, shp, ttype in plan:
    if len(shp) == 1:
      w.write_tensor_data(np.ones(shp, np.float32))
      continue
    rows, cols = shp
    # Chunks of rows, written as they are made (write_tensor_data pads after the last one).
    parts = [random_blocks(rng, min(_CHUNK_ROWS, rows - lo), cols, ttype)
             for lo in range(0, rows, _CHUNK_ROWS)]
    w.write_tensor_data(np.concatenate(parts))
  w.close()


def _fail(message: str) -> None:
  print(f"make_synthetic_gguf: error: {message}", file=sys.stderr)
  sys.exit(2)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="GGUF file to write (replaced if it exists)")
  parser.add_argument("--shape", default="llama2-7b", choices=sorted(SHAPES))
  parser.add_argument("--format", default="gguf", choices=FORMATS,
                      help="gguf: random blocks; powerinfer: PowerInfer's layout with predictors")
  parser.add_argument("--type", default=None, choices=sorted(set(TYPES) | {"F16"}),
                      help="default Q4_1 (gguf), Q4_0 (powerinfer; Q8_0, F16 there too)")
  parser.add_argument("--activation", default=None, choices=["drelu", "silu", "relu"],
                      help="default drelu (gguf), relu (powerinfer: relu is ReGLU `llama`, drelu "
                      "dReLU `bamboo`)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--threshold", type=float, default=None,
                      help="powerinfer: the predictor threshold written to the file")
  parser.add_argument("--measure_tokens", type=int, default=256,
                      help="powerinfer: tokens to measure the predictors on (0: skip)")
  parser.add_argument("--gpuidx_bytes", type=int, default=None,
                      help="powerinfer: also write OUT.generated.gpuidx for this GPU budget")
  parser.add_argument("--dense_twin", default=None,
                      help="powerinfer: also write this plain GGUF of the same weights (down "
                      "re-blocked from ffn_down_t in the file's type)")
  args = parser.parse_args()
  # Everything checked before the first byte is written.
  if not args.out or args.out.endswith(os.sep) or os.path.isdir(args.out):
    _fail(f"--out={args.out!r} must name a file (e.g. /tmp/synthetic-7b.gguf), not a folder.")
  folder = os.path.dirname(os.path.abspath(args.out))
  if not os.path.isdir(folder):
    _fail(f"no folder {folder} for --out; create it first.")
  if not os.access(folder, os.W_OK):
    _fail(f"cannot write in {folder} (--out); choose a writable folder.")
  if args.seed < 0:
    _fail(f"--seed={args.seed} must be >= 0.")
  if args.format == "powerinfer":
    _main_powerinfer(args)
    return
  extra = [f"--{k}" for k in ("threshold", "gpuidx_bytes", "dense_twin")
           if getattr(args, k) is not None]
  if extra:
    _fail(f"{', '.join(extra)} need --format powerinfer.")
  qtype, activation = args.type or "Q4_1", args.activation or "drelu"
  if qtype not in TYPES:
    _fail(f"--type {qtype} is for --format powerinfer; use one of {', '.join(TYPES)}.")
  t0 = time.perf_counter()
  try:
    size = write(args.out, shape=args.shape, qtype=qtype, activation=activation, seed=args.seed)
  except OSError as err:
    _fail(f"writing {args.out} failed ({err.strerror or err}); nothing was written.")
  print(f"{args.out}: {size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s")


def _main_powerinfer(args: argparse.Namespace) -> None:
  """--format powerinfer: write, then place, measure and twin as asked; prints each result."""
  import synthetic_powerinfer as spi
  from pijax.errors import PijaxError
  qtype, activation = args.type or "Q4_0", args.activation or "relu"
  threshold = spi.DEFAULT_THRESHOLD if args.threshold is None else args.threshold
  if qtype not in spi.TYPES or activation not in spi.ACTIVATIONS:
    _fail(f"--format powerinfer writes --type {' / '.join(spi.TYPES)} with --activation "
          f"{' / '.join(spi.ACTIVATIONS)} (PowerInfer runs only ReLU families); got --type "
          f"{qtype} --activation {activation}.")
  if not math.isfinite(threshold) or args.measure_tokens < 0 or (args.gpuidx_bytes or 0) < 0:
    _fail("--threshold must be finite, --measure_tokens and --gpuidx_bytes >= 0.")
  t0 = time.perf_counter()
  try:
    size, design = spi.write(args.out, shape=args.shape, qtype=qtype, activation=activation,
                             seed=args.seed, threshold=threshold)
    print(f"{args.out}: {size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s "
          f"(PowerInfer layout, {qtype}, {activation}; predictors {design.types['predictor']}, "
          f"ranks {sorted(set(design.ranks))}, threshold {threshold:g})")
    masks = None
    if args.gpuidx_bytes is not None:
      out, masks = spi.write_gpuidx(args.out, design, args.gpuidx_bytes)
      hot = [int(m.sum()) for m in masks]
      print(f"{out}: {sum(hot)} GPU neurons for {args.gpuidx_bytes} bytes (per layer "
            f"{min(hot)}-{max(hot)})")
    if args.measure_tokens:
      t1 = time.perf_counter()
      stats = spi.measure(args.out, args.measure_tokens, gpu_masks=masks)
      _print_stats(stats, args.measure_tokens, time.perf_counter() - t1)
    if args.dense_twin:
      t1 = time.perf_counter()
      twin = spi.write_dense_twin(args.out, args.dense_twin)
      print(f"{args.dense_twin}: {twin / 1e9:.2f} GB plain GGUF twin in "
            f"{time.perf_counter() - t1:.1f} s")
  except OSError as err:
    _fail(f"writing {args.out} failed ({err.strerror or err}).")
  except PijaxError as err:
    _fail(str(err))


def _print_stats(stats, n_tokens: int, seconds: float) -> None:
  """One line per layer (the first 4 and last 2 of a deep model) and the mean."""
  def line(tag, s):
    share = "" if s.gpu_share is None else f"  on GPU {s.gpu_share:.3f}"
    return (f"  {tag:>6}  recall {s.recall:.3f}  precision {s.precision:.3f}  predicted "
            f"sparsity {s.predicted_sparsity:.3f}  true sparsity {s.true_sparsity:.3f}{share}")
  print(f"predictors on the file's own activations ({n_tokens} one-token sequences, "
        f"{seconds:.1f} s):")
  shown = range(len(stats)) if len(stats) <= 6 else [0, 1, 2, 3, len(stats) - 2, len(stats) - 1]
  for i in shown:
    print(line(f"layer {i}", stats[i]))
  mean = type(stats[0])(*(None if getattr(stats[0], f) is None else
                          float(np.mean([getattr(s, f) for s in stats]))
                          for f in ("recall", "precision", "predicted_sparsity",
                                    "true_sparsity", "gpu_share")))
  print(line("mean", mean))


if __name__ == "__main__":
  main()
