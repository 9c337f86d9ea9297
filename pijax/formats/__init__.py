"""File formats: GGUF (open, validate, dequantize into the family's params) and converted bundles."""
