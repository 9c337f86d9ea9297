"""Text: tokenizers built from GGUF metadata, and chat templates."""
