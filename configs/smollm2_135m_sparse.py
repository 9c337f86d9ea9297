"""SmolLM2-135M-Instruct as a converted bundle, hybrid sparse FFN (predictor mode).

Make the bundle first:
  python -m pijax.convert --config=configs/smollm2_135m_convert.py --out=bundles/smollm2_135m
then: python -m pijax.generate --config=configs/smollm2_135m_sparse.py --prompt=...
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.model = "bundles/smollm2_135m"  # A bundle folder from pijax.convert.
  config.dtype = "float32"
  config.max_seq_len = 2048
  config.ffn_activation = ""
  config.max_new_tokens = 64
  config.sparse = "predictor"  # off | oracle | predictor (a bundle); gate | contribution (a GGUF)
  config.hot_ratio = ml_collections.config_dict.placeholder(float)  # Fraction of neurons hot.
  config.device_budget_gb = ml_collections.config_dict.placeholder(float)  # Re-place budget.
  config.host_threads = 2  # numba threads for the cold neurons.
  config.sampling = ml_collections.ConfigDict(dict(
      temperature=0.0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0,
      repeat_last_n=64, seed=0))
  return config
