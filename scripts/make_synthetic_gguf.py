"""Writes a LLaMA-2-7B-shaped GGUF of random quantized blocks, for speed and memory benchmarks.

  .venv/bin/python scripts/make_synthetic_gguf.py --out /tmp/synthetic-7b-drelu.q4_1.gguf \
      --activation drelu --type Q4_1

Shapes (LLaMA-2-7B): hidden_size 4096, intermediate_size 11008, 32 layers, 32 heads (32 KV
heads), head_dim 128, vocab 32000, rope_theta 10000. Every matrix is random blocks of `--type`
(Q4_1 or Q8_0: the block formats the host path reads as they are) with scales chosen so weights
have std ~0.02 and mean 0 (Q4_1: d = 0.0043, m = -7.5 d, codes uniform), norms are ones, and the
tokenizer is a placeholder BPE vocabulary ("a", "b", "ab", then "<t3>".."<t31999>"): prompts
can only use "a" and "b" (other characters have no token), the text it generates means nothing;
the bytes read per token are those of a 7B model. An existing --out file is replaced.

`--activation drelu` writes `pijax.ffn_activation = "drelu"` (relu(gate x) * relu(up x)), so with
gate and up independent and symmetric ~75% of FFN neurons are inactive per token by
construction: the case where gate-first sparsity (`--gate_sparse`) skips up and down rows
exactly. llama.cpp ignores the key and runs the file as a dense SwiGLU model (the same bytes).

Tensors are written one at a time (streamed: memory stays ~ one tensor); the file goes to a
temp name and is renamed when complete.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

SHAPES = {"llama2-7b": dict(hidden=4096, ffn=11008, layers=32, heads=32, kv_heads=32,
                            vocab=32000),
          "tiny": dict(hidden=128, ffn=352, layers=2, heads=4, kv_heads=2, vocab=512)}
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}
_CHUNK_ROWS = 1024  # Rows generated at once (bounded memory for the 131k-row matrices).


def random_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: str,
                  std: float = 0.02) -> np.ndarray:
  """u8[rows, cols / 32 * block_bytes]: GGUF blocks of random codes with weights of mean ~0 and
  standard deviation ~std."""
  nb = cols // 32
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
  if shape not in SHAPES or qtype not in BLOCK_BYTES or activation not in ("drelu", "silu",
                                                                            "relu"):
    raise ValueError(f"shape {shape!r} / type {qtype!r} / activation {activation!r}: use "
                     f"{', '.join(SHAPES)} / {', '.join(BLOCK_BYTES)} / drelu, silu, relu")
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


def _write_to(tmp, gguf, s, qtype, activation, seed, shape) -> None:
  """Writes the file (see `write`) to `tmp`."""
  hidden, ffn, heads, kv, vocab = s["hidden"], s["ffn"], s["heads"], s["kv_heads"], s["vocab"]
  hd = hidden // heads
  gtype = getattr(gguf.GGMLQuantizationType, qtype)
  w = gguf.GGUFWriter(tmp, "llama")
  w.add_name(f"synthetic-{shape}-{activation}")
  w.add_block_count(s["layers"])
  w.add_context_length(4096)
  w.add_embedding_length(hidden)
  w.add_feed_forward_length(ffn)
  w.add_head_count(heads)
  w.add_head_count_kv(kv)
  w.add_rope_freq_base(10000.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_rope_dimension_count(hd)
  w.add_vocab_size(vocab)
  w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1 if qtype == "Q4_1" else
                  gguf.LlamaFileType.MOSTLY_Q8_0)
  if activation != "silu":
    w.add_string("pijax.ffn_activation", activation)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("default")  # llama.cpp refuses "gpt2" as a pre-tokenizer name.
  w.add_token_list(["a", "b", "ab"] + [f"<t{i}>" for i in range(3, vocab)])
  w.add_token_types([gguf.TokenType.NORMAL] * vocab)
  w.add_token_merges(["a b"])
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)

  plan = [("token_embd.weight", (vocab, hidden))]
  for i in range(s["layers"]):
    p = f"blk.{i}."
    plan += [(p + "attn_norm.weight", (hidden,)), (p + "attn_q.weight", (heads * hd, hidden)),
             (p + "attn_k.weight", (kv * hd, hidden)), (p + "attn_v.weight", (kv * hd, hidden)),
             (p + "attn_output.weight", (hidden, heads * hd)), (p + "ffn_norm.weight", (hidden,)),
             (p + "ffn_gate.weight", (ffn, hidden)), (p + "ffn_up.weight", (ffn, hidden)),
             (p + "ffn_down.weight", (hidden, ffn))]
  plan += [("output_norm.weight", (hidden,)), ("output.weight", (vocab, hidden))]
  for name, shp in plan:
    if len(shp) == 1:
      w.add_tensor_info(name, shp, np.dtype(np.float32), 4 * shp[0])
    else:
      rows, cols = shp
      nbytes = rows * cols // 32 * BLOCK_BYTES[qtype]
      w.add_tensor_info(name, (rows, cols * BLOCK_BYTES[qtype] // 32), np.dtype(np.uint8),
                        nbytes, raw_dtype=gtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_ti_data_to_file()
  rng = np.random.default_rng(seed)
  for name, shp in plan:
    if len(shp) == 1:
      w.write_tensor_data(np.ones(shp, np.float32))
      continue
    rows, cols = shp
    # Chunks of rows, written as they are made (write_tensor_data pads after the last one).
    parts = [random_blocks(rng, min(_CHUNK_ROWS, rows - lo), cols, qtype)
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
  parser.add_argument("--type", default="Q4_1", choices=sorted(BLOCK_BYTES))
  parser.add_argument("--activation", default="drelu", choices=["drelu", "silu", "relu"])
  parser.add_argument("--seed", type=int, default=0)
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
  t0 = time.perf_counter()
  try:
    size = write(args.out, shape=args.shape, qtype=args.type, activation=args.activation,
                 seed=args.seed)
  except OSError as err:
    _fail(f"writing {args.out} failed ({err.strerror or err}); nothing was written.")
  print(f"{args.out}: {size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
  main()
