"""Default conversion of SmolLM2-135M-Instruct into a sparse bundle (pijax.convert --config)."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.model = "default"
  config.calibration = "../shared/data/tinyshakespeare/input.txt"  # Never the eval text.
  config.target_sparsity = 0.5
  config.device_budget_gb = 0.5  # 1e9-byte GB: dense part ~0.23 GB f32 + hot neurons.
  config.max_seq_len = 2048
  config.device_dtype = "float32"
  config.max_tokens = 65536
  config.chunk_len = 512
  config.ranks = "16,32,64"
  config.recall_target = 0.95
  config.epochs = 8
  config.tile = 64
  return config
