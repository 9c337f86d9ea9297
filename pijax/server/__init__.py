"""The OpenAI-compatible server behind `python -m pijax.serve` (needs the `server` extra)."""
