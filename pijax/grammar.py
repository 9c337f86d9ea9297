"""Constrained output: JSON / JSON-schema / Lark grammars and OpenAI's `logit_bias`, as a bias.

A constraint reaches the sampler as one additive bias row per sequence, f32[vocab]: -inf on the
tokens the grammar forbids at this step, plus the `logit_bias` values (`pijax.sampling.sample`'s
`bias`, f32[batch, vocab]; rows of a batch carry their own constraints). The grammar's state
advances on the host after each sampled token (`Constraint.advance`); once the grammar is
complete only the end-of-sequence tokens (`Tokenizer.stop_ids`) are allowed, so the reply ends
with the JSON.

The grammar engine is llguidance (Rust, on PyPI): a JSON-schema or JSON-object token mask for
SmolLM2's 49,152-token vocabulary costs ~15 us a token (median; with the bias row ~45 us, under
0.5% of a decode step: BUILD_NOTES.md, issue 31; xgrammar is not yet measured beside it), it
needs no torch, and its `LLExecutor` fills the masks of a batch's rows in parallel
(`fill_biases`).

JSON formatting: at most `MAX_JSON_WHITESPACE` whitespace characters between two JSON tokens
(llguidance's default is unbounded: a small model sampled at a high temperature could write
newlines until max_tokens and never close the object).
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import threading
import weakref
from typing import Any, Mapping, Sequence

import numpy as np

from pijax.errors import ConfigError, GrammarError

LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for logit_bias values: [-100, 100].
MAX_JSON_WHITESPACE = 20  # Whitespace characters at most between two JSON tokens.
_JSON_OPTIONS = {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_JSON_WHITESPACE}}}"}
RESPONSE_FORMATS = ("text", "json_object", "json_schema")

_llg_tokenizers: "weakref.WeakKeyDictionary[Any, dict[int, Any]]" = weakref.WeakKeyDictionary()
_llg_lock = threading.Lock()


def _llguidance():
  try:
    import llguidance
    import llguidance.numpy  # noqa: F401 (the bitmask helpers)
  except ImportError:
    raise ConfigError("structured output (response_format / grammars) needs the llguidance "
                      "package; run pip install llguidance (it is in the `server` "
                      "extra).") from None
  return llguidance


def llg_tokenizer(tokenizer, vocab_size: int | None = None):
  """The llguidance `LLTokenizer` of a pijax `Tokenizer` (built once, ~0.1 s, then cached).

  Control and unknown tokens (`Tokenizer.special_ids`) never spell grammar text; the stop ids
  are llguidance's end-of-sequence tokens.

  Args:
    tokenizer: a `pijax.text.tokenizer.Tokenizer`.
    vocab_size: the logits' width (>= the tokenizer's vocabulary; ids past it are never allowed).
  """
  llg = _llguidance()
  n_vocab = int(vocab_size or tokenizer.vocab_size)
  with _llg_lock:
    by_size = _llg_tokenizers.setdefault(tokenizer, {})
    if n_vocab not in by_size:
      wrapper = llg.TokenizerWrapper.__new__(llg.TokenizerWrapper)  # No HF tokenizer to wrap.
      wrapper.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
      wrapper.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else \
          min(tokenizer.stop_ids, default=0)
      wrapper.bos_token_id = tokenizer.bos_id
      wrapper.special_token_ids = sorted(tokenizer.special_ids)
      wrapper.is_tokenizer_wrapper = True
      wrapper._gtokenizer = lambda text: tokenizer.encode(
          text.decode("utf-8", "replace") if isinstance(text, bytes) else text,
          add_special=False)
      wrapper._accepts_bytes = False
      eos = sorted(tokenizer.stop_ids) or [wrapper.eos_token_id]
      by_size[n_vocab] = llg.LLTokenizer(wrapper, n_vocab=n_vocab, eos_token=eos)
    return by_size[n_vocab]


@dataclasses.dataclass(frozen=True, eq=False)
class Grammar:
  """A compiled grammar for one tokenizer; `matcher()` gives a fresh state for one sequence.

  Attributes:
    name: what it constrains to, for messages ("json_object", "json_schema 'person'", "lark").
    spec: the llguidance grammar (JSON text).
    vocab_size: width of the masks (the logits' vocabulary).
  """
  name: str
  spec: str
  vocab_size: int
  _proto: Any = dataclasses.field(repr=False)  # An LLMatcher at the start, copied per sequence.
  _lock: Any = dataclasses.field(default_factory=threading.Lock, repr=False)

  def matcher(self):
    """A new llguidance `LLMatcher` at the grammar's start."""
    with self._lock:
      return self._proto.deep_copy()


def _compile(tokenizer, spec: str, name: str, vocab_size: int | None) -> Grammar:
  llg = _llguidance()
  lt = llg_tokenizer(tokenizer, vocab_size)
  limits = llg.LLParserLimits(verbose_errors=False)  # Errors name the problem, not our state.
  matcher = llg.LLMatcher(lt, spec, log_level=0, limits=limits)
  if matcher.is_error():
    raise GrammarError(f"the {name} cannot be compiled: {' '.join(matcher.get_error().split())}")
  return Grammar(name, spec, lt.vocab_size, matcher)


def json_schema_grammar(tokenizer, schema: Mapping[str, Any] | bool, *,
                        name: str = "JSON schema", vocab_size: int | None = None) -> Grammar:
  """A grammar for JSON text that validates against `schema` (a JSON Schema object).

  Raises:
    GrammarError: the schema is not a JSON object (or boolean) or llguidance cannot compile it
      (an unknown type, a dangling $ref, an unsupported keyword); the message names `name`.
  """
  llg = _llguidance()
  if not isinstance(schema, (Mapping, bool)):
    raise GrammarError(f"the {name} must be a JSON object, got {type(schema).__name__}.")
  try:
    spec = llg.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), overrides=dict(_JSON_OPTIONS))
  except (ValueError, TypeError) as err:
    raise GrammarError(f"the {name} cannot be compiled: {err}") from None
  return _compile(tokenizer, spec, name, vocab_size)


def lark_grammar(tokenizer, text: str, *, name: str = "Lark grammar",
                 vocab_size: int | None = None) -> Grammar:
  """A grammar from Lark text (llguidance's syntax, e.g. `start: "yes" | "no"`).

  Raises:
    GrammarError: the grammar does not compile (the message quotes llguidance's reason).
  """
  llg = _llguidance()
  if not isinstance(text, str):
    raise GrammarError(f"the {name} must be text, got {type(text).__name__}.")
  return _compile(tokenizer, llg.LLMatcher.grammar_from_lark(text), name, vocab_size)


def response_format_grammar(tokenizer, response_format: Mapping[str, Any] | Grammar | None, *,
                            vocab_size: int | None = None) -> Grammar | None:
  """The grammar an OpenAI `response_format` asks for (None for plain text).

  Args:
    tokenizer: the model's `Tokenizer`.
    response_format: None, a `Grammar` (returned as is), or OpenAI's object:
      {"type": "text"}, {"type": "json_object"} (any JSON object), or {"type": "json_schema",
      "json_schema": {"name": str, "schema": {...}, "strict": bool}} (no schema: any object).
    vocab_size: the logits' width (default: the tokenizer's vocabulary).

  Raises:
    GrammarError: an unknown type, a malformed json_schema, or a schema that does not compile.
  """
  if response_format is None or isinstance(response_format, Grammar):
    return response_format
  if not isinstance(response_format, Mapping):
    raise GrammarError(f"response_format must be an object such as {{\"type\": "
                       f"\"json_object\"}}, got {type(response_format).__name__}.")
  kind = response_format.get("type")
  if kind == "text":
    return None
  if kind == "json_object":
    return json_schema_grammar(tokenizer, {"type": "object"}, name="json_object",
                               vocab_size=vocab_size)
  if kind == "json_schema":
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
      raise GrammarError("response_format json_schema needs a \"json_schema\" object: "
                         "{\"name\": ..., \"schema\": {...}}.")
    label = spec.get("name") if isinstance(spec.get("name"), str) else None
    schema = spec.get("schema", {"type": "object"})
    return json_schema_grammar(
        tokenizer, schema, vocab_size=vocab_size,
        name=f"json_schema {label!r}" if label else "json_schema")
  raise GrammarError(f"response_format type {kind!r} is not supported; use one of "
                     f"{', '.join(RESPONSE_FORMATS)}.")


def check_logit_bias(logit_bias: Mapping[Any, Any] | None, vocab_size: int) -> dict[int, float]:
  """OpenAI's logit_bias (token id -> bias in [-100, 100]) as {int: float}, checked.

  Keys may be ints or decimal strings (JSON object keys are strings).

  Raises:
    ConfigError: a key that is not a token id in [0, vocab_size), or a value that is not a
      number in [-100, 100]; the message names logit_bias and the entry.
  """
  if logit_bias is None:
    return {}
  if not isinstance(logit_bias, Mapping):
    raise ConfigError(f"logit_bias must map token ids to numbers, got "
                      f"{type(logit_bias).__name__}.")
  out = {}
  for key, value in logit_bias.items():
    token = key
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
      token = int(key)
    if isinstance(token, bool) or not isinstance(token, numbers.Integral) or \
        not 0 <= int(token) < vocab_size:
      raise ConfigError(f"logit_bias key {key!r} is not a token id in [0, {vocab_size}).")
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
        not -LOGIT_BIAS_LIMIT <= float(value) <= LOGIT_BIAS_LIMIT:  # False for NaN.
      raise ConfigError(f"logit_bias[{key!r}]={value!r} must be a number in "
                        f"[-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}].")
    out[int(token)] = float(value)
  return out


class Constraint:
  """What one sequence may sample next: a grammar's state and a fixed logit bias.

  `bias()` gives the row to add to the logits, f32[vocab]; `advance(token)` moves the grammar
  past a sampled token. Not thread-safe: one sequence, one generation loop.

  Args:
    vocab_size: the logits' width.
    grammar: a `Grammar` (None: logit_bias only).
    logit_bias: {token id: bias} (checked by `check_logit_bias`).
  """

  def __init__(self, vocab_size: int, grammar: Grammar | None = None,
               logit_bias: Mapping[int, float] | None = None):
    if grammar is not None and grammar.vocab_size != vocab_size:
      raise ConfigError(f"the {grammar.name} was compiled for a vocabulary of "
                        f"{grammar.vocab_size} tokens, not {vocab_size}.")
    self.vocab_size = int(vocab_size)
    self.grammar = grammar
    self.matcher = grammar.matcher() if grammar is not None else None
    self.static = np.zeros(self.vocab_size, np.float32)  # f32[vocab], the logit_bias values.
    for token, value in check_logit_bias(logit_bias, self.vocab_size).items():
      self.static[token] = value
    self._added = self.static if self.static.any() else None  # Added to the mask, if any.
    self._bits = np.empty((1, (self.vocab_size + 31) // 32), np.int32)

  @property
  def fixed(self) -> bool:
    """True when the bias never changes (no grammar): compute it once."""
    return self.grammar is None

  def bias(self) -> np.ndarray:
    """f32[vocab]: the bias for the next token (-inf where the grammar forbids it); a new array
    each call (the device may still read the previous one), or `static` without a grammar."""
    if self.matcher is None:
      return self.static
    import llguidance.numpy as llnp
    llnp.fill_next_token_bitmask(self.matcher, self._bits)
    self._check()
    row = np.empty(self.vocab_size, np.float32)
    _expand(self._bits[0], self._added, row)
    return row

  def advance(self, token: int) -> None:
    """Moves the grammar past `token` (a no-op without one).

    Raises:
      GrammarError: the grammar does not allow `token` here (the sampler was not given this
        step's bias).
    """
    if self.matcher is not None and not self.matcher.consume_token(int(token)):
      raise GrammarError(f"token {int(token)} does not continue the {self.grammar.name}: "
                         f"{self.matcher.get_error()}")

  @property
  def done(self) -> bool:
    """The grammar is complete: only an end-of-sequence token may follow."""
    return self.matcher is not None and self.matcher.is_stopped()

  def _check(self) -> None:
    if self.matcher.is_error():
      raise GrammarError(f"the {self.grammar.name} failed: {self.matcher.get_error()}")


_NEG_INF_BITS = np.int32(-8388608)  # 0xFF800000: the bits of f32 -inf.


def _expand(bits: np.ndarray, static: np.ndarray | None, out: np.ndarray) -> None:
  """out f32[V] = static (or 0) where bit t of `bits` (i32[ceil(V / 32)], little-endian) is
  set, else -inf. Integer ops on the float bits: ~20 us for 49,152 tokens, where a boolean
  scatter of -inf took ~250 us."""
  allowed = np.unpackbits(bits.view(np.uint8), bitorder="little", count=out.shape[0])
  as_int = out.view(np.int32)
  np.subtract(allowed, 1, out=as_int, dtype=np.int32, casting="unsafe")  # 0 allowed, else -1.
  np.bitwise_and(as_int, _NEG_INF_BITS, out=as_int)  # 0 -> +0.0, -1 -> -inf.
  if static is not None:
    out += static


_executor = None


def fill_biases(constraints: Sequence[Constraint | None], out: np.ndarray) -> np.ndarray:
  """Writes each row's bias into `out` (f32[batch, vocab]); rows without a constraint get 0.

  The grammar rows' masks are computed in parallel (llguidance's `LLExecutor`, GIL released).

  Raises:
    ValueError: `out` is not f32[len(constraints), vocab].
    GrammarError: a grammar entered an error state.
  """
  if out.ndim != 2 or out.shape[0] != len(constraints) or out.dtype != np.float32:
    raise ValueError(f"out must be f32[{len(constraints)}, vocab], got {out.dtype}{out.shape}.")
  rows = [(i, c) for i, c in enumerate(constraints) if c is not None and c.matcher is not None]
  if len(rows) > 1:
    global _executor
    import llguidance
    import llguidance.numpy as llnp
    if _executor is None:
      _executor = llguidance.LLExecutor()
    bits = np.empty((len(constraints), (out.shape[1] + 31) // 32), np.int32)
    llnp.fill_next_token_bitmask_par(_executor, [(c.matcher, i) for i, c in rows], bits)
  for i, c in enumerate(constraints):
    if c is None:
      out[i] = 0.0
    elif c.matcher is None or len(rows) <= 1:
      out[i] = c.bias()
    else:
      c._check()
      _expand(bits[i], c._added, out[i])
  return out


def make_constraint(tokenizer, vocab_size: int, *, response_format=None,
                    logit_bias: Mapping[Any, Any] | None = None) -> Constraint | None:
  """The `Constraint` for one generation, or None when it has neither a grammar nor a bias.

  Args:
    tokenizer: the model's `Tokenizer`.
    vocab_size: the logits' width.
    response_format: as for `response_format_grammar` (a dict, a `Grammar` or None).
    logit_bias: OpenAI's token id -> bias map (see `check_logit_bias`).

  Raises:
    GrammarError: a response_format that does not compile. ConfigError: a bad logit_bias.
  """
  bias = check_logit_bias(logit_bias, vocab_size)
  grammar = response_format_grammar(tokenizer, response_format, vocab_size=vocab_size)
  if grammar is None and not bias:
    return None
  return Constraint(vocab_size, grammar, bias)


def allowed_after(grammar: Grammar, tokens: Sequence[int]) -> np.ndarray:
  """bool[vocab]: the tokens the grammar allows after `tokens` (for tests and inspection)."""
  c = Constraint(grammar.vocab_size, grammar)
  for t in tokens:
    c.advance(t)
  return np.isfinite(c.bias())


__all__ = ["Constraint", "Grammar", "GrammarError", "allowed_after", "check_logit_bias",
           "fill_biases", "json_schema_grammar", "lark_grammar", "llg_tokenizer",
           "make_constraint", "response_format_grammar", "MAX_JSON_WHITESPACE"]
