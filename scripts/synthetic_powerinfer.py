"""A synthetic ReLU model in PowerInfer's file layout whose FFN sparsity a predictor can learn
(`make_synthetic_gguf.py --format powerinfer`), its placement file, a plain-GGUF twin of the
same weights, and the predictors' recall measured on the file's own activations.

The construction (one layer; h = the FFN's input after RMSNorm, |h| = sqrt(d)):
  * Token embeddings are e_t = a u + b n_t (a = 3, b = 4; u a fixed vector and n_t ~ N(0, I),
    both of unit RMS), and attn_output / ffn_down_t are small (std 0.002), so the residual
    stream stays embedding-dominated in every layer: h ~ sqrt(d) (cos t û + sin t v), cos t =
    a / sqrt(a^2 + b^2) = 0.6, v a random unit direction orthogonal to û = u / |u|.
  * The gate is low rank plus noise: with B [k, d] orthonormal rows orthogonal to û and per
    neuron j a spread t_j = exp(N(0.388, 0.4^2)) and a random unit w_j in R^k,
      gate_j = s_j (-Z / (sqrt(d) cos t) û + t_j (rho / sin t w_j B + sqrt(1 - rho^2) / sqrt(d)
      eps_j)),  eps_j ~ N(0, I), Z = 2, rho = 0.995,
    so gate_j . h / s_j = -Z + t_j (rho N(0, 1) + sqrt(1 - rho^2) N(0, 1)): the û part is a
    bias common to all neurons, and neuron j fires with probability Phi(-Z / t_j): 10% on
    average, from ~30% for the hottest 1% to <0.03% for the coldest 1% (a power-law-like
    spread, what PowerInfer's placement exploits); s_j sets the gate's weights to std 0.02.
  * The predictor is derived analytically, not trained: fc1 = [B; -B] / R (R = 5, the
    residual's RMS) and fc2_j = t_j rho / sin t [w_j, -w_j], so fc2 relu(fc1 x) =
    t_j rho / sin t w_j . B h (relu(y) - relu(-y) = y): the gate's low-rank part, exact but
    for the noise term and the quantization of gate, fc1 and fc2; the threshold holds the
    common bias, Z plus a margin (default -0.4: a neuron is predicted active when its low-rank
    part reaches 1.6). (A per-neuron bias in fc2 would multiply the large activation along û,
    and its 4-bit quantization error would cost ~5 points of recall.) Rank r = 2k per layer
    (7B: 256, 384, 512, 640 in turn, ~5% of the FFN's bytes on average; tiny: 32, 64).
  * Everything else (q, k, v, up, output; down at std 0.002) is random blocks, as in the plain
    synthetic file.
Types follow PowerInfer's quantizer: every matrix `--type` (Q4_0, Q8_0 or F16), fc1/fc2 Q4_0 in a
Q4_0 file, Q5_0 in a Q8_0 one, F16 in an F16 one; output.weight Q6_K (Q8_0 where hidden is not a
multiple of 256, F16 in an F16 file); norms F32 ones.
"""

from __future__ import annotations

import dataclasses
import math
import os

import gguf
import numpy as np

import make_synthetic_gguf as base

RANKS = {"llama2-7b": (256, 384, 512, 640), "tiny": (32, 64), "tiny-k": (32, 64)}
TYPES = ("Q4_0", "Q8_0", "F16")
ACTIVATIONS = {"relu": "llama", "drelu": "bamboo"}  # FFN -> PowerInfer's architecture name.
EMBED_MEAN, EMBED_NOISE = 3.0, 4.0  # a, b above.
RESIDUAL_RMS = math.hypot(EMBED_MEAN, EMBED_NOISE)
SIGNAL = 0.995  # rho: the share of a gate's input-dependent std its low-rank part explains.
BIAS = 2.0  # Z: every gate's pre-activation is -Z + t_j N(0, 1), in units of s_j.
# log t_j ~ N(0.388, 0.4^2): Phi(-Z / t_j) averages 0.10 over the neurons.
SPREAD_MEAN, SPREAD_STD = 0.388, 0.4
DEFAULT_THRESHOLD = BIAS - 0.4
STD, OUT_STD = 0.02, 0.002  # Weight std of the matrices; of attn_output and ffn_down_t.
_CHUNK_ROWS = 1024


def types(qtype: str, hidden: int) -> dict[str, str]:
  """The GGML type of each kind of matrix in a PowerInfer file of `qtype` (its quantizer's
  rules: `llama_model_quantize` / get_k_quant_type in PowerInfer's llama.cpp)."""
  if qtype == "F16":
    return {"matrix": "F16", "predictor": "F16", "output": "F16"}
  return {"matrix": qtype, "predictor": "Q4_0" if qtype == "Q4_0" else "Q5_0",
          "output": "Q8_0" if qtype == "Q8_0" or hidden % 256 else "Q6_K"}


def _encode(x: np.ndarray, ttype: str) -> np.ndarray:
  """f32[rows, cols] -> the tensor data of type `ttype` (f16 values, or u8 rows of blocks)."""
  if ttype == "F16":
    return x.astype(np.float16)
  return gguf.quants.quantize(np.ascontiguousarray(x, np.float32),
                              gguf.GGMLQuantizationType[ttype])


def _random(rng: np.random.Generator, rows: int, cols: int, ttype: str, std: float
            ) -> np.ndarray:
  """A random matrix of mean ~0 and std ~`std` as the tensor data of type `ttype`."""
  parts = []
  for lo in range(0, rows, _CHUNK_ROWS):
    n = min(_CHUNK_ROWS, rows - lo)
    if ttype == "F16":
      parts.append((rng.standard_normal((n, cols), np.float32) * std).astype(np.float16))
    else:
      parts.append(base.random_blocks(rng, n, cols, ttype, std))
  return np.concatenate(parts)


def _basis(rng: np.random.Generator, u_hat: np.ndarray, k: int) -> np.ndarray:
  """f32[k, d] orthonormal rows: u_hat, then k - 1 random directions orthogonal to it."""
  m = rng.standard_normal((u_hat.size, k))
  m[:, 0] = u_hat
  q, _ = np.linalg.qr(m)  # [d, k]
  q = q.T
  q[0] *= np.sign(q[0] @ u_hat)
  return q.astype(np.float32)


@dataclasses.dataclass
class Design:
  """What the writer chose, for the placement file and the notes.

  hotness: per layer f32[n_ff], t_j (neuron j fires with probability ~Phi(-Z / t_j)).
  ranks: per layer predictor rank r_i.
  types: the GGML type of each kind of matrix (`types`).
  """

  hotness: list[np.ndarray]
  ranks: list[int]
  types: dict[str, str]


def _layer(rng: np.random.Generator, u_hat: np.ndarray, ffn: int, rank: int, ptype: str,
           gtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """(gate, fc1, fc2 as tensor data, spread t f32[ffn]) of one layer (see the module doc)."""
  d, k = u_hat.size, rank // 2
  cos_t = EMBED_MEAN / RESIDUAL_RMS
  sin_t = EMBED_NOISE / RESIDUAL_RMS
  b = _basis(rng, u_hat, k + 1)[1:]  # [k, d], orthogonal to û.
  t = np.exp(rng.normal(SPREAD_MEAN, SPREAD_STD, ffn)).astype(np.float32)
  w = rng.standard_normal((ffn, k)).astype(np.float32)
  w /= np.linalg.norm(w, axis=1, keepdims=True)
  # [ffn, k]: each neuron's low-rank coefficients, in units of its s_j.
  c = (SIGNAL / sin_t) * t[:, None] * w
  bias = -BIAS / (math.sqrt(d) * cos_t)  # The coefficient on û.
  noise = math.sqrt(1.0 - SIGNAL ** 2) * t
  # s_j: weights of std STD (the three parts are orthogonal; |eps_j|^2 ~ d).
  scale = STD * math.sqrt(d) / np.sqrt((c * c).sum(1) + bias ** 2 + noise ** 2)
  gate = []
  for lo in range(0, ffn, _CHUNK_ROWS):
    hi = min(lo + _CHUNK_ROWS, ffn)
    eps = rng.standard_normal((hi - lo, d), np.float32)
    rows = c[lo:hi] @ b + bias * u_hat + noise[lo:hi, None] / math.sqrt(d) * eps
    gate.append(_encode(rows * scale[lo:hi, None], gtype))
  fc1 = np.concatenate([b, -b]) / RESIDUAL_RMS  # [rank, d]
  fc2 = np.concatenate([c, -c], axis=1)  # [ffn, rank]
  return np.concatenate(gate), _encode(fc1, ptype), _encode(fc2, ptype), t


def write(path: str, *, shape: str = "llama2-7b", qtype: str = "Q4_0",
          activation: str = "relu", seed: int = 0,
          threshold: float = DEFAULT_THRESHOLD) -> tuple[int, Design]:
  """Writes the PowerInfer-format file (streamed to `path`.tmp, renamed when complete).

  Returns:
    (size in bytes, the Design).

  Raises:
    ValueError: an unknown shape, type or activation (relu: ReGLU `llama`; drelu: `bamboo`).
  """
  if shape not in base.SHAPES or qtype not in TYPES or activation not in ACTIVATIONS:
    raise ValueError(f"--format powerinfer: shape {shape!r} / type {qtype!r} / activation "
                     f"{activation!r}: use {', '.join(base.SHAPES)} / {', '.join(TYPES)} / "
                     f"{', '.join(ACTIVATIONS)} (PowerInfer runs only ReLU families)")
  if seed < 0 or not math.isfinite(threshold):
    raise ValueError(f"seed must be >= 0 and the threshold finite, got {seed}, {threshold}")
  tmp = path + ".tmp"
  try:
    design = _write_to(tmp, base.SHAPES[shape], shape, qtype, activation, seed, threshold)
    os.replace(tmp, path)
  finally:  # No half-written file is left behind, whatever failed.
    if os.path.exists(tmp):
      os.remove(tmp)
  return os.path.getsize(path), design


def _write_to(tmp: str, s: dict, shape: str, qtype: str, activation: str, seed: int,
              threshold: float) -> Design:
  from pijax.formats import powerinfer
  hidden, ffn, heads, kv, vocab = s["hidden"], s["ffn"], s["heads"], s["kv_heads"], s["vocab"]
  n, hd = s["layers"], hidden // heads
  kinds = types(qtype, hidden)
  ranks = [RANKS[shape][i % len(RANKS[shape])] for i in range(n)]
  arch = ACTIVATIONS[activation]
  w = gguf.GGUFWriter(tmp, arch)
  from make_synthetic_gguf import add_shape_header  # Lazy: make_synthetic_gguf imports this.
  add_shape_header(w, s, f"synthetic-{shape}-{activation}-powerinfer")
  w.add_file_type({"Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                   "F16": gguf.LlamaFileType.MOSTLY_F16}[qtype])
  w.add_float32(powerinfer.THRESHOLD_KEY, threshold)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("default")
  w.add_token_list(["a", "b", "ab"] + [f"<t{i}>" for i in range(3, vocab)])
  w.add_token_types([gguf.TokenType.NORMAL] * vocab)
  w.add_token_merges(["a b"])
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)

  mt, pt = kinds["matrix"], kinds["predictor"]
  plan = [("token_embd.weight", (vocab, hidden), mt)]
  for i in range(n):
    p = f"blk.{i}."
    plan += [(p + "attn_norm.weight", (hidden,), "F32"),
             (p + "attn_q.weight", (heads * hd, hidden), mt),
             (p + "attn_k.weight", (kv * hd, hidden), mt),
             (p + "attn_v.weight", (kv * hd, hidden), mt),
             (p + "attn_output.weight", (hidden, heads * hd), mt),
             (p + "ffn_norm.weight", (hidden,), "F32"),
             (p + "ffn_gate.weight", (ffn, hidden), mt),
             (p + "ffn_up.weight", (ffn, hidden), mt),
             (p + "ffn_down_t.weight", (ffn, hidden), mt),
             (p + "fc1.weight", (ranks[i], hidden), pt),
             (p + "fc2.weight", (ffn, ranks[i]), pt)]
  plan += [("output_norm.weight", (hidden,), "F32"),
           ("output.weight", (vocab, hidden), kinds["output"])]
  for name, shp, ttype in plan:
    if len(shp) == 1:
      w.add_tensor_info(name, shp, np.dtype(np.float32), 4 * shp[0])
    elif ttype == "F16":
      w.add_tensor_info(name, shp, np.dtype(np.float16), 2 * shp[0] * shp[1])
    else:
      rows, cols = shp
      row_bytes = cols // base.BLOCK_VALUES[ttype] * base.BLOCK_BYTES[ttype]
      w.add_tensor_info(name, (rows, row_bytes), np.dtype(np.uint8), rows * row_bytes,
                        raw_dtype=gguf.GGMLQuantizationType[ttype])
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_ti_data_to_file()

  # One generator per tensor kind and layer: the file does not depend on the write order.
  def rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([seed, *key])

  u = rng(0).standard_normal(hidden).astype(np.float32)
  u *= math.sqrt(hidden) / np.linalg.norm(u)  # Unit RMS.
  u_hat = u / np.linalg.norm(u)
  hotness = []
  layer_parts: dict[str, np.ndarray] = {}
  for name, shp, ttype in plan:
    if len(shp) == 1:
      w.write_tensor_data(np.ones(shp, np.float32))
      continue
    rows, cols = shp
    if name == "token_embd.weight":
      g = rng(1)
      data = np.concatenate([_encode(EMBED_MEAN * u + EMBED_NOISE * g.standard_normal(
          (min(_CHUNK_ROWS, rows - lo), cols), np.float32), ttype)
          for lo in range(0, rows, _CHUNK_ROWS)])
    elif name == "output.weight":
      data = _random(rng(2), rows, cols, ttype, STD)
    else:
      i, role = int(name.split(".")[1]), name.split(".")[2]
      if role == "ffn_gate":  # Gate and predictor are made together.
        gate, fc1, fc2, t = _layer(rng(3, i), u_hat, ffn, ranks[i], pt, ttype)
        layer_parts.update(fc1=fc1, fc2=fc2)
        hotness.append(t)
        data = gate
      elif role in ("fc1", "fc2"):
        data = layer_parts.pop(role)
      else:
        tag = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_up", "ffn_down_t").index(role)
        std = OUT_STD if role in ("attn_output", "ffn_down_t") else STD
        data = _random(rng(4 + tag, i), rows, cols, ttype, std)
    w.write_tensor_data(data)
  w.close()
  powerinfer.stamp_magic(tmp)
  return Design(hotness, ranks, kinds)


# ---------------------------------------------------------------------------------- placement
def neuron_bytes(path: str, layer: int = 0) -> int:
  """Bytes of one neuron's gate, up and ffn_down_t rows in the file (what PowerInfer moves to
  the GPU per neuron)."""
  from pijax.formats import gguf as gguf_io
  reader, _ = gguf_io.open_gguf(path)
  tensors = {t.name: t for t in reader.tensors}
  return sum(tensors[f"blk.{layer}.{r}.weight"].n_bytes // int(tensors[f"blk.{layer}.{r}.weight"]
                                                                    .shape[1])
             for r in ("ffn_gate", "ffn_up", "ffn_down_t"))


def write_gpuidx(path: str, design: Design, budget_bytes: int
                 ) -> tuple[str, list[np.ndarray]]:
  """Writes `<path>.generated.gpuidx`: the hottest neurons of all layers (by their expected
  firing rate Phi(-Z / t_j)) that fit `budget_bytes` of gate + up + down rows, as PowerInfer's
  placement file.

  Returns:
    (the placement file, per layer bool[n_ff]: True for a GPU neuron).

  Raises:
    ValueError: a negative budget.
  """
  from pijax.formats import powerinfer
  if budget_bytes < 0:
    raise ValueError(f"the placement budget must be >= 0 bytes, got {budget_bytes}")
  t = np.concatenate(design.hotness)
  n_hot = min(t.size, budget_bytes // neuron_bytes(path))
  hot = np.zeros(t.size, bool)
  hot[np.argsort(-t, kind="stable")[:n_hot]] = True  # Largest t: fires most often.
  masks = np.split(hot, np.cumsum([h.size for h in design.hotness])[:-1])
  out = powerinfer.gpuidx_path(path)
  powerinfer.write_gpuidx(out, masks, budget_bytes)
  return out, masks


# ------------------------------------------------------------------------------- measurement
@dataclasses.dataclass
class LayerStats:
  """One layer's predictor against the true active set, over the measured tokens.

  recall: predicted and active / active; precision: predicted and active / predicted;
  predicted_sparsity / true_sparsity: share of neurons predicted / truly inactive (an
  inactive neuron's FFN output is exactly 0); gpu_share: share of active neurons on the GPU
  (None without a placement)."""

  recall: float
  precision: float
  predicted_sparsity: float
  true_sparsity: float
  gpu_share: float | None = None


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
  return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def reference_forward(path: str, tokens: np.ndarray
                      ) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
  """A NumPy forward of each token as a one-token sequence (position 0: RoPE is the identity
  and attention reduces exactly to W_o W_v h, one key of weight 1) over the file's weights
  dequantized by pijax's reader, with down taken from ffn_down_t (the file's own tensor, not the
  derived dense view); the oracle for one-token runs and for `measure`.

  Args:
    path: a PowerInfer model file (or any llama-shaped GGUF with ffn_down_t).
    tokens: i64[T] token ids, each run on its own.

  Returns:
    (logits f32[T, vocab], per layer (x f32[T, hidden]: the residual entering the FFN block,
    act f32[T, n_ff]: the FFN's activations before down)).

  Raises:
    GGUFError: the file does not read back (see `pijax.formats.loader.read_gguf`).
  """
  from pijax import config as config_lib
  from pijax.formats import gguf as gguf_io
  from pijax.formats import loader, powerinfer
  cfg, _ = loader.read_gguf(path)
  down_t = powerinfer.read_down_t(path)
  reader, _ = gguf_io.open_gguf(path)
  tensors = {t.name: t for t in reader.tensors}

  def f32(name: str) -> np.ndarray:
    return loader.dequantize(tensors[name], path)

  n_tokens = len(tokens)
  x = f32("token_embd.weight")[tokens]  # [tokens, hidden]
  groups, hd = cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
  layers = []
  for i in range(cfg.n_layers):
    p = f"blk.{i}."
    h = _rms_norm(x, f32(p + "attn_norm.weight"), cfg.rms_norm_eps)
    v = (h @ f32(p + "attn_v.weight").T).reshape(n_tokens, cfg.n_kv_heads, hd)
    # [tokens, heads * head_dim]: each query head reads its KV head's value.
    heads = np.repeat(v, groups, axis=1).reshape(n_tokens, cfg.n_heads * hd)
    x = x + heads @ f32(p + "attn_output.weight").T
    h = _rms_norm(x, f32(p + "ffn_norm.weight"), cfg.rms_norm_eps)
    g, up = h @ f32(p + "ffn_gate.weight").T, h @ f32(p + "ffn_up.weight").T
    act = np.maximum(g, 0) * (np.maximum(up, 0) if cfg.ffn_family == config_lib.FFN_DRELU
                              else up)
    layers.append((x, act))
    x = x + act @ down_t[i].f32()
  head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
  logits = _rms_norm(x, f32("output_norm.weight"), cfg.rms_norm_eps) @ f32(head).T
  return logits, layers


def measure(path: str, n_tokens: int = 256, seed: int = 1,
            gpu_masks: list[np.ndarray] | None = None) -> list[LayerStats]:
  """Recall, precision and sparsity of the file's own predictors on its own activations.

  Each of `n_tokens` random token ids runs as a one-token sequence through
  `reference_forward`; every layer's FFN input (the residual before ffn_norm) goes to the
  predictor, and the true active set is the neurons whose FFN output is nonzero.

  Returns:
    One LayerStats per layer.

  Raises:
    GGUFError: the file does not read back (see `pijax.formats.powerinfer.read_predictors`).
  """
  from pijax.formats import loader, powerinfer
  cfg, _ = loader.read_gguf(path)
  preds = powerinfer.read_predictors(path)
  tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, n_tokens)
  _, layers = reference_forward(path, tokens)
  stats = []
  for i, (x, act) in enumerate(layers):
    fc1, fc2 = preds.layers[i].f32()
    predicted = powerinfer.predictor_logits(fc1, fc2, x) >= preds.threshold
    active = act != 0
    both = (predicted & active).sum()
    share = None
    if gpu_masks is not None:
      share = float(active[:, gpu_masks[i]].sum() / max(active.sum(), 1))
    stats.append(LayerStats(float(both / max(active.sum(), 1)),
                            float(both / max(predicted.sum(), 1)),
                            float(1 - predicted.mean()), float(1 - active.mean()), share))
  return stats


# ---------------------------------------------------------------------------------- rewriting
def _copied(t) -> tuple[str, np.ndarray, gguf.GGMLQuantizationType | None]:
  """(name, data, raw type) that write a file tensor back unchanged."""
  raw = None if t.tensor_type.name in ("F32", "F16") else t.tensor_type
  return t.name, np.array(t.data), raw


def rewrite(src: str, dst: str, edit=None, *, kv: dict | None = None,
            magic: bytes | None = None, arch: str | None = None) -> int:
  """Copies a GGUF (PowerInfer's or plain) to `dst` (temp name, renamed when complete), with
  changes: for tests' corrupt files, and `write_dense_twin`.

  Args:
    edit: (TensorInfo) -> [(name, data, raw GGML type or None)] replacing each of the file's
      own tensors (derived views are skipped); [] drops it; None keeps every tensor.
    kv: {key: (value, gguf.GGUFValueType) or None (drop)} applied to the metadata.
    magic: the written file's magic (default: the source's).
    arch: the written file's architecture (default: the source's); the source architecture's
      keys (`<arch>.block_count`, ...) are renamed to it.

  Returns:
    The new file's size in bytes.
  """
  from pijax.formats import gguf as gguf_io
  from pijax.formats.packed import StringArray
  reader, metadata = gguf_io.open_gguf(src)
  kv = kv or {}
  tmp = dst + ".tmp"
  try:
    src_arch = metadata["general.architecture"]
    w = gguf.GGUFWriter(tmp, arch or src_arch)
    for key, value in metadata.items():
      if key in ("general.architecture", "general.alignment") or key in kv:
        continue
      vtype, etype, _ = reader.value_types[key]
      if arch and key.startswith(src_arch + "."):
        key = arch + key[len(src_arch):]
      if isinstance(value, StringArray):
        value = [str(v) for v in value]
      w.add_key_value(key, value, gguf.GGUFValueType(vtype),
                      None if etype is None else gguf.GGUFValueType(etype))
    for key, new in kv.items():
      if new is not None:
        w.add_key_value(key, new[0], new[1])
    for t in reader.tensors:
      if t.source is None:
        for name, data, raw in (edit(t) if edit else [_copied(t)]):
          w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if (magic or reader.magic) != gguf_io.GGUF_MAGIC:
      with open(tmp, "r+b") as fh:
        fh.write(magic or reader.magic)
    os.replace(tmp, dst)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return os.path.getsize(dst)


def write_dense_twin(src: str, dst: str, down_type: str | None = None) -> int:
  """Writes `src` (a PowerInfer file) as a plain `llama` GGUF of the same weights: magic
  b"GGUF", architecture "llama" (a `bamboo` file's keys renamed), no fc1/fc2,
  `blk.N.ffn_down.weight` = ffn_down_t transposed, and `pijax.ffn_activation` naming the FFN (a
  plain llama file would be read as SwiGLU). Every other tensor keeps its blocks.

  Args:
    down_type: the down projection's type: "F32" (exact), "F16", or a block type gguf.quants
      writes ("Q4_0", "Q8_0", ...: re-quantized, not exact, but the same bytes per weight as a
      file of that type); None: the type of ffn_down_t.

  Returns:
    The twin's size in bytes.
  """
  from pijax.arch import registry
  from pijax.formats import loader

  cfg, metadata = loader.read_gguf(src)

  def edit(t):
    if t.name.endswith((".fc1.weight", ".fc2.weight")):
      return []
    if not t.name.endswith(".ffn_down_t.weight"):
      return [_copied(t)]
    ttype = down_type or t.tensor_type.name
    values = np.ascontiguousarray(loader.dequantize(t, src).T)  # [hidden, ffn]
    data = values if ttype == "F32" else _encode(values, ttype)
    raw = None if ttype in ("F32", "F16") else gguf.GGMLQuantizationType[ttype]
    return [(t.name.replace("ffn_down_t", "ffn_down"), data, raw)]

  from pijax.formats import powerinfer
  activation = {"reglu": "relu", "drelu": "drelu", "swiglu": "silu"}[cfg.ffn_family]
  kv = {powerinfer.THRESHOLD_KEY: None}
  if registry.ACTIVATION_KEY not in metadata:
    kv[registry.ACTIVATION_KEY] = (activation, gguf.GGUFValueType.STRING)
  return rewrite(src, dst, edit, kv=kv, magic=b"GGUF", arch="llama")
