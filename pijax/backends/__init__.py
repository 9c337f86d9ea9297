"""How a model *runs*: one protocol (`base.Backend`) and its implementations.

xla: dense weights in XLA. host: the GGUF's quantized blocks in numba with host KV caches.
hybrid: PowerInfer's hot (device) / cold (host) FFN split. bridge: every JAX -> host callback.
"""
