"""What a model *is*: the frozen description (`spec.ModelConfig`) and one module per family,
reached through `registry` by the GGUF's `general.architecture`."""

from pijax.arch.registry import SUPPORTED_ARCHS, config_from_metadata, get_family
from pijax.arch.spec import ModelConfig

__all__ = ["ModelConfig", "SUPPORTED_ARCHS", "config_from_metadata", "get_family"]
