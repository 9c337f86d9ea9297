"""Tiny random llama-family models written as GGUF files, with a transformers twin (oracle).

The GGUF gets the Q/K rows re-ordered the way llama.cpp's converter does, so RoPE rotates
adjacent pairs in the file while transformers keeps its half-split layout: if our RoPE
convention or the permutation were wrong, logits would disagree.
"""

from __future__ import annotations

import pathlib

import gguf
import numpy as np


def interleave_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """[heads * H, in] HF layout (x_i, x_{i+H/2}) -> GGUF layout (x_{2i}, x_{2i+1}) per head."""
  out_dim, in_dim = w.shape
  h = out_dim // n_heads
  heads = w.reshape(n_heads, 2, h // 2, in_dim)  # [heads, half, H/2, in]
  return np.ascontiguousarray(heads.transpose(0, 2, 1, 3).reshape(out_dim, in_dim))


def make_hf_llama(*, hidden_act: str = "silu", seed: int = 0, vocab: int = 256,
                  hidden: int = 64, ffn: int = 160, layers: int = 2, heads: int = 4,
                  kv_heads: int = 2, tied: bool = False):
  """A random transformers LlamaForCausalLM (f32, eval mode)."""
  import torch
  from transformers import LlamaConfig, LlamaForCausalLM
  torch.manual_seed(seed)
  config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, max_position_embeddings=512,
                       rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act=hidden_act,
                       tie_word_embeddings=tied, attention_bias=False, mlp_bias=False)
  model = LlamaForCausalLM(config).eval()
  with torch.no_grad():
    for p in model.parameters():  # Larger-than-default weights: logits far from uniform.
      p.mul_(2.0)
    for layer in model.model.layers:  # Non-trivial norm weights.
      layer.input_layernorm.weight.uniform_(0.5, 1.5)
      layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    model.model.norm.weight.uniform_(0.5, 1.5)
  return model


def write_gguf(model, path: pathlib.Path, *, ffn_activation: str | None = None,
               alignment: int | None = None, qtype: str = "F32",
               interleave_rope: bool = True, chat_template: str | None = None) -> pathlib.Path:
  """Writes a transformers Llama as a llama-architecture GGUF (matrices F32, F16 or Q8_0).

  interleave_rope=False keeps transformers' Q/K row order (the NeoX / "half" RoPE layout), for
  checking the backends' other RoPE layout with a config whose rope_style says so.
  """
  cfg = model.config
  sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
  w = gguf.GGUFWriter(str(path), "llama")
  if alignment is not None:
    w.add_custom_alignment(alignment)
  w.add_block_count(cfg.num_hidden_layers)
  w.add_context_length(cfg.max_position_embeddings)
  w.add_embedding_length(cfg.hidden_size)
  w.add_feed_forward_length(cfg.intermediate_size)
  w.add_head_count(cfg.num_attention_heads)
  w.add_head_count_kv(cfg.num_key_value_heads)
  w.add_rope_freq_base(float(cfg.rope_theta if hasattr(cfg, "rope_theta")
                             else cfg.rope_parameters["rope_theta"]))
  w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
  w.add_vocab_size(cfg.vocab_size)
  if ffn_activation is not None:
    w.add_string("pijax.ffn_activation", ffn_activation)
  # A byte-level toy vocabulary so the file is a complete model.
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("gpt2")
  tokens = ["a", "b", "ab"] + [f"<t{i}>" for i in range(3, cfg.vocab_size)]
  w.add_token_list(tokens)
  w.add_token_types([gguf.TokenType.NORMAL] * cfg.vocab_size)
  w.add_token_merges(["a b"])
  w.add_bos_token_id(0)
  w.add_eos_token_id(1)
  if chat_template is not None:
    w.add_chat_template(chat_template)
  dt = np.float16 if qtype == "F16" else np.float32

  def add(name: str, arr: np.ndarray) -> None:
    if qtype == "Q8_0" and arr.ndim > 1:
      q = gguf.quants.quantize(np.ascontiguousarray(arr, np.float32),
                               gguf.GGMLQuantizationType.Q8_0)
      w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
      return
    w.add_tensor(name, np.ascontiguousarray(arr.astype(dt if arr.ndim > 1 else np.float32)))

  rope_rows = interleave_rope_rows if interleave_rope else (lambda w_, n_: w_)

  add("token_embd.weight", sd["model.embed_tokens.weight"])
  for i in range(cfg.num_hidden_layers):
    p = f"model.layers.{i}."
    add(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
    add(f"blk.{i}.attn_q.weight",
        rope_rows(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads))
    add(f"blk.{i}.attn_k.weight",
        rope_rows(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads))
    add(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
    add(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
    add(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
    add(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
    add(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
    add(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
  add("output_norm.weight", sd["model.norm.weight"])
  if not cfg.tie_word_embeddings:
    add("output.weight", sd["lm_head.weight"])
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def use_drelu(model) -> None:
  """Patches a transformers Llama's MLPs to dReLU: down(relu(gate x) * relu(up x))."""
  import torch

  def forward(self, x):
    return self.down_proj(torch.relu(self.gate_proj(x)) * torch.relu(self.up_proj(x)))

  for layer in model.model.layers:
    layer.mlp.forward = forward.__get__(layer.mlp)


def write_random_quantized_gguf(path: pathlib.Path, *, layer_type: str = "Q4_1",
                                embd_type: str = "Q8_0", output_type: str | None = None,
                                hidden: int = 64, ffn: int = 160, layers: int = 2, heads: int = 4,
                                kv_heads: int = 2, vocab: int = 256, seed: int = 0,
                                alignment: int | None = None) -> pathlib.Path:
  """A random llama GGUF whose matrices are stored as `layer_type` / `embd_type` /
  `output_type` ("F32", "F16" or a GGML quant type quantized by gguf.quants); no output.weight
  (tied head) when output_type is None. `alignment` writes an explicit general.alignment."""
  rng = np.random.default_rng(seed)
  w = gguf.GGUFWriter(str(path), "llama")
  if alignment is not None:
    w.add_custom_alignment(alignment)
  w.add_block_count(layers)
  w.add_context_length(512)
  w.add_embedding_length(hidden)
  w.add_feed_forward_length(ffn)
  w.add_head_count(heads)
  w.add_head_count_kv(kv_heads)
  w.add_rope_freq_base(10000.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_rope_dimension_count(hidden // heads)
  w.add_vocab_size(vocab)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("gpt2")
  w.add_token_list(["a", "b", "ab"] + [f"<t{i}>" for i in range(3, vocab)])
  w.add_token_types([gguf.TokenType.NORMAL] * vocab)
  w.add_token_merges(["a b"])
  w.add_bos_token_id(0)
  w.add_eos_token_id(1)

  def add(name, arr, qtype="F32"):
    arr = np.ascontiguousarray(arr, np.float32)
    if arr.ndim == 1 or qtype == "F32":
      w.add_tensor(name, arr)
    elif qtype == "F16":
      w.add_tensor(name, arr.astype(np.float16))
    else:
      t = getattr(gguf.GGMLQuantizationType, qtype)
      q = gguf.quants.quantize(arr, t)
      w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=t)

  def mat(rows, cols, scale=0.3):
    return rng.standard_normal((rows, cols)) * scale

  hd = hidden // heads
  add("token_embd.weight", mat(vocab, hidden, 1.0), embd_type)
  for i in range(layers):
    p = f"blk.{i}."
    add(p + "attn_norm.weight", rng.uniform(0.5, 1.5, hidden))
    add(p + "attn_q.weight", mat(heads * hd, hidden), layer_type)
    add(p + "attn_k.weight", mat(kv_heads * hd, hidden), layer_type)
    add(p + "attn_v.weight", mat(kv_heads * hd, hidden), layer_type)
    add(p + "attn_output.weight", mat(hidden, heads * hd), layer_type)
    add(p + "ffn_norm.weight", rng.uniform(0.5, 1.5, hidden))
    add(p + "ffn_gate.weight", mat(ffn, hidden), layer_type)
    add(p + "ffn_up.weight", mat(ffn, hidden), layer_type)
    add(p + "ffn_down.weight", mat(hidden, ffn), layer_type)
  add("output_norm.weight", rng.uniform(0.5, 1.5, hidden))
  if output_type is not None:
    add("output.weight", mat(vocab, hidden), output_type)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path
