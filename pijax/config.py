"""The project's constants: FFN families, RoPE layouts, norm placements, mask value.

The frozen model description (`ModelConfig`) is `pijax.arch.spec`."""

from __future__ import annotations

# FFN families: how a neuron's activation is formed, and models that use each.
FFN_SWIGLU = "swiglu"  # silu(gate x) * (up x): LLaMA, SmolLM2, Mistral.
FFN_REGLU = "reglu"  # relu(gate x) * (up x): ReluLLaMA, ProSparse.
FFN_DRELU = "drelu"  # relu(gate x) * relu(up x): Bamboo, TurboSparse.
FFN_GEGLU = "geglu"  # gelu_tanh(gate x) * (up x): Gemma.
FFN_RELU_MLP = "relu_mlp"  # relu(up x + b): OPT, ReluFalcon (activation definition only).
FFN_FAMILIES = (FFN_SWIGLU, FFN_REGLU, FFN_DRELU, FFN_GEGLU)

# User-facing activation names (config `ffn_activation`, GGUF key `pijax.ffn_activation`).
ACTIVATION_TO_FAMILY = {"silu": FFN_SWIGLU, "relu": FFN_REGLU, "drelu": FFN_DRELU,
                        "gelu": FFN_GEGLU}

# RoPE conventions. GGUF `llama` files rotate adjacent pairs (x0,x1),(x2,x3)... because
# llama.cpp's converter permuted Q/K; NeoX-style files rotate (x_i, x_{i+d/2}).
ROPE_ADJACENT = "adjacent"
ROPE_HALF = "half"

MASK_VALUE = -1e30  # Added to attention scores of masked keys (finite: no NaN on empty rows).

# Where each block's RMSNorms sit. "pre": x += f(norm(x)) (LLaMA). "sandwich": x += norm(f(norm(x)))
# (Gemma 2/3: a second norm on each sub-block's output).
NORM_PRE = "pre"
NORM_SANDWICH = "sandwich"
