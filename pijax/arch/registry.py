"""The architecture registry: `general.architecture` -> the family module that reads it.

A family module defines `FAMILY = Family(...)`: its name, how its GGUF metadata becomes a
`ModelConfig`, and its tensor map (the GGUF name of every weight role), declared once and read
by every loader and backend. Unknown architectures are refused by name.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Any, Callable, Mapping

import numpy as np

from pijax import config as config_lib
from pijax.arch.spec import ModelConfig
from pijax.errors import GGUFError

# Weight roles of a decoder-only family. Per-layer roles take the layer index.
LAYER_ROLES = ("attn_norm", "q", "k", "v", "o", "ffn_norm", "gate", "up", "down")
# Per-layer roles present only when the config's switches say so (`layer_shapes`).
OPTIONAL_LAYER_ROLES = ("q_bias", "k_bias", "v_bias", "q_norm", "k_norm", "post_attn_norm",
                        "post_ffn_norm")
GLOBAL_ROLES = ("embedding", "final_norm", "lm_head")

# GGUF architecture name -> module under pijax.arch defining FAMILY.
_FAMILY_MODULES = {"llama": "pijax.arch.llama", "qwen2": "pijax.arch.qwen", "qwen3":
                   "pijax.arch.qwen", "gemma3": "pijax.arch.gemma3", "phi3": "pijax.arch.phi3",
                   "bamboo": "pijax.arch.bamboo"}
SUPPORTED_ARCHS = tuple(_FAMILY_MODULES)
# Architecture names of GGUFs that are not models, and what they are.
_NOT_MODELS = {
    "generic.gpu_index": "PowerInfer's GPU placement file (<model>.generated.gpuidx), not a "
                         "model; pass the model file (pijax.formats.powerinfer.read_gpuidx "
                         "reads this one)",
}


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Every per-layer weight role `cfg` needs -> its NumPy shape ([out, in] for matrices)."""
  d, n, k, h, f = (cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                   cfg.intermediate_size)
  shapes = {"attn_norm": (d,), "q": (n * h, d), "k": (k * h, d), "v": (k * h, d),
            "o": (d, n * h), "ffn_norm": (d,), "gate": (f, d), "up": (f, d), "down": (d, f)}
  if cfg.qkv_bias:
    shapes.update(q_bias=(n * h,), k_bias=(k * h,), v_bias=(k * h,))
  if cfg.qk_norm:
    shapes.update(q_norm=(h,), k_norm=(h,))
  if cfg.norm_placement == config_lib.NORM_SANDWICH:
    shapes.update(post_attn_norm=(d,), post_ffn_norm=(d,))
  return shapes


@dataclasses.dataclass(frozen=True)
class TensorSlice:
  """Where a role's weight lives: rows [lo, hi) of GGUF tensor `name` (lo = hi = None: the whole
  tensor), which holds `rows` rows in all (fused tensors, e.g. Phi-3's attn_qkv)."""

  name: str
  lo: int | None = None
  hi: int | None = None
  rows: int | None = None


@dataclasses.dataclass(frozen=True)
class TensorMap:
  """GGUF tensor names by role: `names[role]` is a format string with `{i}` for the layer.

  `fused` maps a GGUF tensor name pattern to the roles stacked by rows inside it, in order
  (Phi-3: attn_qkv holds q | k | v, ffn_up holds gate | up).
  """

  names: Mapping[str, str]
  fused: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

  def name(self, role: str, layer: int | None = None) -> str:
    """The GGUF name of `role` (of layer `layer` for per-layer roles); KeyError if unknown."""
    return self.names[role].format(i=layer)

  def locate(self, role: str, layer: int | None, cfg: ModelConfig) -> TensorSlice:
    """Where `role` of `layer` lives (its own tensor, or rows of a fused one)."""
    for pattern, parts in self.fused.items():
      if role in parts:
        shapes = layer_shapes(cfg)
        lo = sum(shapes[p][0] for p in parts[:parts.index(role)])
        return TensorSlice(pattern.format(i=layer), lo, lo + shapes[role][0],
                           sum(shapes[p][0] for p in parts))
    return TensorSlice(self.name(role, layer))

  def __hash__(self) -> int:
    return hash((tuple(sorted(self.names.items())), tuple(sorted(self.fused.items()))))


@dataclasses.dataclass(frozen=True)
class Family:
  """One model family: `config_from_metadata(reader, tensors, ffn_activation)` (tensors: the
  file's {name: gguf ReaderTensor}) and its tensor map."""

  name: str
  config_from_metadata: Callable[["MetadataReader", Mapping[str, Any], str | None], ModelConfig]
  tensors: TensorMap


class MetadataReader:
  """Typed access to `{arch}.{key}` GGUF metadata with one-line errors naming the file."""

  def __init__(self, metadata: Mapping[str, Any], arch: str, path: str):
    self.metadata, self.arch, self.path = metadata, arch, path

  def get(self, key: str, default: Any = None) -> Any:
    return self.metadata.get(f"{self.arch}.{key}", default)

  def has(self, key: str) -> bool:
    return f"{self.arch}.{key}" in self.metadata

  def need(self, key: str) -> Any:
    full = f"{self.arch}.{key}"
    if full not in self.metadata:
      raise GGUFError(f"{self.path}: metadata key {full!r} is missing; the file is incomplete, "
                      "re-convert it.")
    return self.metadata[full]

  def positive_int(self, key: str, default: Any = None) -> int:
    value = self.need(key) if default is None else self.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
      raise GGUFError(f"{self.path}: metadata {self.arch}.{key}={value!r} must be a positive "
                      "integer; the file is corrupt, re-convert it.")
    return int(value)

  def positive_float(self, key: str, default: float) -> float:
    value = self.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or \
        not np.isfinite(value) or value <= 0:
      raise GGUFError(f"{self.path}: metadata {self.arch}.{key}={value!r} must be a positive "
                      "number; the file is corrupt, re-convert it.")
    return float(value)


def get_family(arch: Any, path: str = "the model") -> Family:
  """The Family registered for a GGUF `general.architecture` value.

  Raises:
    GGUFError: an architecture no family module declares.
  """
  module = _FAMILY_MODULES.get(arch) if isinstance(arch, str) else None
  if isinstance(arch, str) and arch in _NOT_MODELS:
    raise GGUFError(f"{path}: architecture {arch!r}: this is {_NOT_MODELS[arch]}.")
  if module is None:
    raise GGUFError(f"{path}: architecture {arch!r} is not supported; pijax runs "
                    f"{', '.join(SUPPORTED_ARCHS)} (SwiGLU, ReGLU, dReLU FFNs).")
  return importlib.import_module(module).FAMILY


def config_from_metadata(metadata: Mapping[str, Any], path: str, tensors: Mapping[str, Any],
                         ffn_activation: str | None = None) -> ModelConfig:
  """Builds the ModelConfig of a GGUF from its metadata through its family module.

  Args:
    metadata: GGUF key/values (see `pijax.formats.gguf.open_gguf`).
    path: the file, for error messages.
    tensors: the file's tensors, {name: gguf ReaderTensor} (to detect a tied output head, and
      to read small tensors that are hyper-parameters, e.g. `rope_freqs.weight`).
    ffn_activation: "silu" | "relu" | "drelu", used only when the file does not say.

  Raises:
    GGUFError: unsupported architecture or missing/inconsistent hyper-parameters.
  """
  arch = metadata.get("general.architecture")
  family = get_family(arch, path)
  return family.config_from_metadata(MetadataReader(metadata, arch, path), tensors,
                                     ffn_activation)


def base_fields(meta: MetadataReader, tensors: Mapping[str, Any], ffn_activation: str | None,
                *, default_activation: str = "silu") -> dict[str, Any]:
  """The ModelConfig fields every family reads the same way (sizes, norms, RoPE base and
  linear scaling, vocabulary, activation, tied head); families add or override the rest.

  Raises:
    GGUFError: missing or inconsistent values.
  """
  path, arch = meta.path, meta.arch
  hidden = meta.positive_int("embedding_length")
  n_heads = meta.positive_int("attention.head_count")
  n_kv_heads = meta.positive_int("attention.head_count_kv", n_heads)
  head_dim = meta.positive_int("attention.key_length", max(hidden // n_heads, 1))
  if meta.has("attention.value_length") and \
      meta.positive_int("attention.value_length") != head_dim:
    raise GGUFError(f"{path}: key_length {head_dim} != value_length "
                    f"{meta.get('attention.value_length')}; pijax needs them equal.")
  if n_heads % n_kv_heads:
    raise GGUFError(f"{path}: head_count {n_heads} is not a multiple of head_count_kv "
                    f"{n_kv_heads}.")
  n_tokens = len(meta.metadata.get("tokenizer.ggml.tokens", []))
  vocab = meta.positive_int("vocab_size", n_tokens) if (meta.has("vocab_size") or n_tokens) \
      else meta.positive_int("vocab_size")
  if n_tokens and vocab != n_tokens:
    raise GGUFError(f"{path}: {arch}.vocab_size={vocab} but the tokenizer has {n_tokens} "
                    "tokens; the file is inconsistent, re-convert it.")
  activation = meta.metadata.get(ACTIVATION_KEY) or ffn_activation or default_activation
  if activation not in config_lib.ACTIVATION_TO_FAMILY:
    raise GGUFError(f"{path}: FFN activation {activation!r} is not supported; use one of "
                    f"{sorted(config_lib.ACTIVATION_TO_FAMILY)}.")
  rope_dim = meta.positive_int("rope.dimension_count", head_dim)
  if rope_dim > head_dim or rope_dim % 2:
    raise GGUFError(f"{path}: rope.dimension_count={rope_dim} must be even and <= head_dim "
                    f"{head_dim}.")
  theta = meta.positive_float("rope.freq_base", 10000.0)
  scaling_type = meta.get("rope.scaling.type", "none")
  rope_scale, factors, attn_scale = 1.0, rope_freq_factors(meta, tensors, rope_dim), 0.0
  if scaling_type == "linear":
    rope_scale = meta.positive_float("rope.scaling.factor", 1.0)
  elif scaling_type == "yarn":
    if factors:
      raise GGUFError(f"{path}: YaRN scaling and {ROPE_FREQS} together are not supported.")
    factors, mscale = yarn_factors(meta, theta, rope_dim)
    attn_scale = head_dim ** -0.5 * mscale * mscale  # cos and sin both carry mscale.
  elif scaling_type not in ("none", None):
    raise GGUFError(f"{path}: RoPE scaling {scaling_type!r} is not supported (linear, yarn, "
                    "and llama3 through rope_freqs.weight, are).")
  window = meta.get("attention.sliding_window", 0)
  if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0:
    raise GGUFError(f"{path}: {arch}.attention.sliding_window={window!r} must be an integer "
                    ">= 0; the file is corrupt.")
  context = meta.positive_int("context_length", 2048)
  # A window at least the context sees everything: clamp it (positions are int32 in XLA).
  window = min(int(window), context, 2**31 - 1)
  return dict(
      arch=arch,
      vocab_size=int(vocab),
      hidden_size=hidden,
      intermediate_size=meta.positive_int("feed_forward_length"),
      n_layers=meta.positive_int("block_count"),
      n_heads=n_heads,
      n_kv_heads=n_kv_heads,
      head_dim=head_dim,
      rope_theta=theta,
      rope_style=config_lib.ROPE_HALF,
      rope_dim=rope_dim,
      rms_norm_eps=meta.positive_float("attention.layer_norm_rms_epsilon", 1e-5),
      context_length=context,
      ffn_family=config_lib.ACTIVATION_TO_FAMILY[activation],
      tied_output="output.weight" not in tensors,
      rope_scale=rope_scale,
      sliding_window=int(window),
      rope_freq_factors=factors,
      attn_scale=attn_scale,
  )


def yarn_factors(meta: MetadataReader, theta: float, rope_dim: int
                 ) -> tuple[tuple[float, ...], float]:
  """YaRN (Peng et al. 2023, arXiv 2309.00071 §3.2-3.4) as per-frequency divisors of RoPE's
  inverse frequencies and the attention factor m (cos and sin are scaled by m).

  Frequency i is interpolated (divided by the factor s) below the ramp, kept above it, and
  blended linearly in between; the ramp runs over the dims that turn beta_fast..beta_slow times
  in the original context (`rope.scaling.original_context_length`). m = attn_factor *
  (0.1 ln s + 1).

  Raises:
    GGUFError: missing or non-positive values.
  """
  s = meta.positive_float("rope.scaling.factor", 1.0)
  orig = meta.positive_int("rope.scaling.original_context_length")
  beta_fast = meta.positive_float("rope.scaling.yarn_beta_fast", 32.0)
  beta_slow = meta.positive_float("rope.scaling.yarn_beta_slow", 1.0)

  turns = [orig / (b * 2 * math.pi) for b in (beta_fast, beta_slow)]
  if not theta > 1.0 or not all(0.0 < t < math.inf for t in turns):
    raise GGUFError(f"{meta.path}: YaRN RoPE scaling needs rope.freq_base > 1 and finite "
                    f"positive yarn_beta_fast / yarn_beta_slow (got {theta}, {beta_fast}, "
                    f"{beta_slow}); the file is corrupt, re-convert it.")

  def dim_of(rotations: float) -> float:  # The dim that turns `rotations` times in `orig`.
    return rope_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

  low = max(math.floor(dim_of(beta_fast)), 0)
  high = min(math.ceil(dim_of(beta_slow)), rope_dim - 1)
  span = max(high - low, 0.001)
  factors = []
  for i in range(rope_dim // 2):
    keep = 1.0 - min(max((i - low) / span, 0.0), 1.0)  # 1: extrapolate (unscaled).
    factors.append(1.0 / (keep + (1.0 - keep) / s))
  mscale = meta.positive_float("rope.scaling.attn_factor", 1.0) * \
      (0.1 * math.log(s) + 1.0 if s > 1.0 else 1.0)
  return tuple(factors), mscale


def rope_freq_factors(meta: MetadataReader, tensors: Mapping[str, Any], rope_dim: int
                      ) -> tuple[float, ...]:
  """The file's `rope_freqs.weight` (R/2 positive f32 divisors of RoPE's inverse frequencies,
  written by llama.cpp's converter for LLaMA-3.1 "llama3" scaling), or () when absent.

  Raises:
    GGUFError: a tensor of the wrong size or with values that are not positive and finite.
  """
  tensor = tensors.get(ROPE_FREQS) if hasattr(tensors, "get") else None
  if tensor is None:
    return ()
  try:
    values = np.asarray(tensor.data, np.float32)
  except (TypeError, ValueError) as err:
    raise GGUFError(f"{meta.path}: {ROPE_FREQS} is not an f32 tensor ({err}).") from None
  if values.ndim != 1 or values.size != rope_dim // 2:
    raise GGUFError(f"{meta.path}: {ROPE_FREQS} must be a vector of {rope_dim // 2} values, got "
                    f"shape {values.shape}; the file is corrupt, re-convert it.")
  if not (np.isfinite(values).all() and (values > 0).all()):
    raise GGUFError(f"{meta.path}: {ROPE_FREQS} holds values that are not positive and finite; "
                    "the file is corrupt, re-convert it.")
  return tuple(float(v) for v in values)


# GGUF key naming the FFN activation of converted sparse families (absent: the family's own).
ACTIVATION_KEY = "pijax.ffn_activation"
ROPE_FREQS = "rope_freqs.weight"
