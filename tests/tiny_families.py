"""Tiny random models of every supported family, written as GGUF files the way llama.cpp's
converter writes them, each with its transformers twin (the oracle).

Conventions followed (llama.cpp `convert_hf_to_gguf.py`): only `llama` files permute Q/K rows
(adjacent-pair RoPE); Gemma's RMSNorm weights are stored as 1 + w; Phi-3 keeps its fused
`attn_qkv` and `ffn_up` (gate | up) tensors; Qwen2 stores q/k/v biases as `attn_{q,k,v}.bias`.
"""

from __future__ import annotations

import pathlib

import gguf
import numpy as np

import tiny_models

FAMILIES = ("qwen2", "qwen3", "gemma3", "phi3", "llama3", "mistral_swa", "qwen2_yarn")


def make_hf(family: str, *, seed: int = 0, vocab: int = 256, tied: bool = False):
  """A random transformers model of `family` (f32, eval), weights large enough that the logits
  are far from uniform and every norm weight non-trivial."""
  import torch
  import transformers as tf
  torch.manual_seed(seed)
  common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                tie_word_embeddings=tied)
  if family == "qwen2":
    model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, rms_norm_eps=1e-6))
  elif family == "qwen3":
    model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=32, rms_norm_eps=1e-6,
                                               attention_bias=False))
  elif family == "gemma3":
    # 7 layers: local 0-4, global 5, local 6; a 4-token window so it matters on short prompts;
    # query_pre_attn_scalar = head_dim, as Gemma 3 270M (and llama.cpp's scale).
    common.update(num_hidden_layers=7, num_key_value_heads=1, tie_word_embeddings=True)
    model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
        **common, head_dim=32, sliding_window=4, query_pre_attn_scalar=32, rms_norm_eps=1e-6))
  elif family == "phi3":
    model = tf.Phi3ForCausalLM(tf.Phi3Config(**common, rms_norm_eps=1e-5, sliding_window=5,
                                             pad_token_id=0))
  elif family == "llama3":
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, rms_norm_eps=1e-5, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}))
  elif family == "qwen2_yarn":
    model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, rms_norm_eps=1e-6, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16}))
  elif family == "mistral_swa":
    model = tf.MistralForCausalLM(tf.MistralConfig(**common, rms_norm_eps=1e-5,
                                                   sliding_window=5))
  else:
    raise ValueError(family)
  model = model.eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.uniform_(-0.5, 0.5) if family == "gemma3" else p.uniform_(0.5, 1.5)
      elif "bias" in name:
        p.normal_(0.0, 0.5)
      else:
        p.mul_(2.0)
  return model


def _llama3_factors(cfg) -> np.ndarray:
  """llama.cpp's converter's rope_freqs for "llama3" scaling: 1 / (the HF inverse-frequency
  multiplier), per frequency (written from the LLaMA-3.1 definition)."""
  rp = cfg.rope_parameters
  dim = cfg.hidden_size // cfg.num_attention_heads
  base, factor = rp["rope_theta"], rp["factor"]
  low, high, old = rp["low_freq_factor"], rp["high_freq_factor"], \
      rp["original_max_position_embeddings"]
  out = []
  for i in range(0, dim, 2):
    wavelen = 2 * np.pi / (base ** (-i / dim))
    if wavelen < old / high:
      out.append(1.0)
    elif wavelen > old / low:
      out.append(factor)
    else:
      smooth = (old / wavelen - low) / (high - low)
      out.append(1.0 / ((1 - smooth) / factor + smooth))
  return np.asarray(out, np.float32)


def write_gguf(model, family: str, path: pathlib.Path, qtype: str = "F32") -> pathlib.Path:
  """Writes `model` (from `make_hf`) as the GGUF llama.cpp's converter would; matrices in
  `qtype` ("F32" or a GGML type gguf.quants can quantize, e.g. "Q8_0"), vectors in F32."""
  cfg = model.config
  arch = {"llama3": "llama", "mistral_swa": "llama", "qwen2_yarn": "qwen2"}.get(family, family)
  sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
  w = gguf.GGUFWriter(str(path), arch)
  n, kv = cfg.num_attention_heads, cfg.num_key_value_heads
  hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // n
  w.add_block_count(cfg.num_hidden_layers)
  w.add_context_length(cfg.max_position_embeddings)
  w.add_embedding_length(cfg.hidden_size)
  w.add_feed_forward_length(cfg.intermediate_size)
  w.add_head_count(n)
  w.add_head_count_kv(kv)
  w.add_key_length(hd)
  w.add_value_length(hd)
  rp = cfg.rope_parameters
  theta = rp["full_attention"]["rope_theta"] if "full_attention" in rp else rp["rope_theta"]
  w.add_rope_freq_base(float(theta))
  w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  w.add_rope_dimension_count(hd)
  if rp.get("rope_type") == "yarn":
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rp["factor"])
    w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
  if getattr(cfg, "sliding_window", None) and family != "qwen2_yarn":
    w.add_sliding_window(cfg.sliding_window)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("gpt2")
  w.add_token_list(["a", "b", "ab"] + [f"<t{i}>" for i in range(3, cfg.vocab_size)])
  w.add_token_types([gguf.TokenType.NORMAL] * cfg.vocab_size)
  w.add_token_merges(["a b"])
  w.add_bos_token_id(0)
  w.add_eos_token_id(1)

  def add(name: str, arr: np.ndarray) -> None:
    arr = np.ascontiguousarray(arr, np.float32)
    if qtype == "F32" or arr.ndim == 1:
      w.add_tensor(name, arr)
      return
    t = getattr(gguf.GGMLQuantizationType, qtype)
    q = gguf.quants.quantize(arr, t)
    w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=t)

  def norm(arr: np.ndarray) -> np.ndarray:
    return arr + 1.0 if family == "gemma3" else arr

  permute = tiny_models.interleave_rope_rows if arch == "llama" else (lambda a, h: a)
  add("token_embd.weight", sd["model.embed_tokens.weight"])
  if family == "llama3":
    add("rope_freqs.weight", _llama3_factors(cfg))
  for i in range(cfg.num_hidden_layers):
    p, b = f"model.layers.{i}.", f"blk.{i}."
    add(b + "attn_norm.weight", norm(sd[p + "input_layernorm.weight"]))
    if family == "phi3":
      add(b + "attn_qkv.weight", sd[p + "self_attn.qkv_proj.weight"])
      add(b + "ffn_up.weight", sd[p + "mlp.gate_up_proj.weight"])
    else:
      add(b + "attn_q.weight", permute(sd[p + "self_attn.q_proj.weight"], n))
      add(b + "attn_k.weight", permute(sd[p + "self_attn.k_proj.weight"], kv))
      add(b + "attn_v.weight", sd[p + "self_attn.v_proj.weight"])
      add(b + "ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
      add(b + "ffn_up.weight", sd[p + "mlp.up_proj.weight"])
    if arch == "qwen2":
      for r in "qkv":
        add(b + f"attn_{r}.bias", sd[p + f"self_attn.{r}_proj.bias"])
    if family in ("qwen3", "gemma3"):
      add(b + "attn_q_norm.weight", norm(sd[p + "self_attn.q_norm.weight"]))
      add(b + "attn_k_norm.weight", norm(sd[p + "self_attn.k_norm.weight"]))
    add(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
    if family == "gemma3":
      add(b + "post_attention_norm.weight", norm(sd[p + "post_attention_layernorm.weight"]))
      add(b + "ffn_norm.weight", norm(sd[p + "pre_feedforward_layernorm.weight"]))
      add(b + "post_ffw_norm.weight", norm(sd[p + "post_feedforward_layernorm.weight"]))
    else:
      add(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
    add(b + "ffn_down.weight", sd[p + "mlp.down_proj.weight"])
  add("output_norm.weight", norm(sd["model.norm.weight"]))
  if not cfg.tie_word_embeddings:
    add("output.weight", sd["lm_head.weight"])
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path
