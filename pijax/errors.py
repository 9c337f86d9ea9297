"""Exception types, one per failure family.

CLIs catch `PijaxError` and print `str(err)` as one line on stderr with exit status 2
(see `pijax.cli_util.run_main`). Every message names what was wrong and what to do.
"""


class PijaxError(Exception):
  """Base class of every error pijax raises on bad input."""


class GGUFError(PijaxError):
  """A model file is missing, not a GGUF, truncated, corrupt, or of an unsupported kind."""


class ConfigError(PijaxError):
  """A config value or flag is invalid (bad sampling parameter, unknown mode, ...)."""


class ContextError(PijaxError):
  """A prompt (plus generation) does not fit the context window (max_seq_len tokens)."""


class ContextLengthError(ContextError):
  """A prompt is longer than the context: `n_tokens` > `max_seq_len` (both in tokens)."""

  def __init__(self, message: str, *, n_tokens: int, max_seq_len: int):
    super().__init__(message)
    self.n_tokens = n_tokens
    self.max_seq_len = max_seq_len


class TokenizerError(PijaxError):
  """The GGUF's tokenizer metadata is missing or of a kind pijax does not support."""


class BudgetError(PijaxError):
  """A device-memory budget (bytes) is too small for what must be resident."""


class BundleError(PijaxError):
  """A converted bundle is missing, of another version, or does not match its source GGUF."""


class UnsupportedError(ConfigError):
  """A backend was asked for a model family, switch or mode it does not implement."""


class GrammarError(ConfigError):
  """A response_format, JSON schema or grammar that the grammar engine cannot compile, or a
  generation that left its grammar."""
