"""`python -m pijax.generate --config=configs/smollm2_135m.py --prompt=...`

stdout carries only the generated text, streamed as it is produced; stderr carries logs and
one closing stats line. Bad input (missing/corrupt model, prompt longer than the context,
invalid sampling values, a schema or grammar that does not compile) gives one line on stderr
and exit status 2.

Constrained output (`pijax.grammar`): `--response_format=json_object`, `--json_schema=FILE` (a
JSON Schema), or `--grammar=FILE` (a Lark grammar); `--logit_bias=ID:BIAS,...` as OpenAI's.
"""

from __future__ import annotations

import sys

from absl import flags, logging

from pijax import cli
from pijax import sparse_flags

_CONFIG = cli.define_config_file(
    "config", "ml_collections config file (e.g. configs/smollm2_135m.py).", lock_config=False)
_MODEL = flags.DEFINE_string("model", None, "GGUF path or 'default'; overrides config.model.")
_PROMPT = flags.DEFINE_string("prompt", None, "Prompt text.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", None, "Tokens to generate at most.")
_TEMPERATURE = flags.DEFINE_float("temperature", None, "0 = greedy.")
_TOP_K = flags.DEFINE_integer("top_k", None, "Keep the k most likely tokens; 0 = off.")
_TOP_P = flags.DEFINE_float("top_p", None, "Nucleus sampling mass; 1 = off.")
_MIN_P = flags.DEFINE_float("min_p", None, "Drop tokens with p < min_p * p_max; 0 = off.")
_REPEAT_PENALTY = flags.DEFINE_float("repeat_penalty", None, "Repetition penalty; 1 = off.")
_REPEAT_LAST_N = flags.DEFINE_integer("repeat_last_n", None, "Tokens the penalty looks back.")
_SEED = flags.DEFINE_integer("seed", None, "PRNG seed.")
_CHAT = flags.DEFINE_boolean("chat", False, "Wrap the prompt in the model's chat template.")
_PARSE_SPECIAL = flags.DEFINE_boolean(
    "parse_special", False, "Treat special-token text in the prompt (e.g. <|im_start|>) as "
    "special tokens instead of plain text.")
_MAX_SEQ_LEN = flags.DEFINE_integer("max_seq_len", None, "KV cache length (tokens).")
_DTYPE = flags.DEFINE_string("dtype", None, "float32 (CPU) or bfloat16 (GPU).")
_RESPONSE_FORMAT = flags.DEFINE_string(
    "response_format", None, "text (default) or json_object (the reply is one JSON object); "
    "see also --json_schema and --grammar.")
_JSON_SCHEMA = flags.DEFINE_string("json_schema", None, "A JSON Schema file: the reply is JSON "
                                   "that validates against it.")
_GRAMMAR = flags.DEFINE_string("grammar", None, "A Lark grammar file (llguidance syntax, e.g. "
                               "start: \"yes\" | \"no\"): the reply is a sentence of it.")
_LOGIT_BIAS = flags.DEFINE_list("logit_bias", [], "Token id:bias pairs added to the logits, "
                                "bias in [-100, 100] (e.g. 42:100,7:-100).")


def _pick(flag, default):
  return default if flag.value is None else flag.value


_REQUIRED = {"model": str, "dtype": str, "max_seq_len": int, "max_new_tokens": int}
_REQUIRED_SAMPLING = {"temperature": float, "top_k": int, "top_p": float, "min_p": float,
                      "repeat_penalty": float, "repeat_last_n": int, "seed": int}


def _check_config(cfg) -> None:
  """Raises ConfigError naming the first missing or mistyped config field."""
  from pijax.errors import ConfigError

  def check(holder, fields, prefix):
    for name, kind in fields.items():
      if name not in holder:
        raise ConfigError(f"--config has no field {prefix}{name}; see configs/smollm2_135m.py.")
      value = holder[name]
      ok = isinstance(value, (int, float)) and not isinstance(value, bool) \
          if kind is float else isinstance(value, kind) and not isinstance(value, bool)
      if not ok:
        raise ConfigError(f"--config field {prefix}{name}={value!r} must be a "
                          f"{kind.__name__}.")

  check(cfg, _REQUIRED, "")
  if "sampling" not in cfg:
    raise ConfigError("--config has no field sampling; see configs/smollm2_135m.py.")
  check(cfg.sampling, _REQUIRED_SAMPLING, "sampling.")


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    from pijax.errors import ConfigError
    raise ConfigError(f"unexpected arguments {argv[1:]}; pass the prompt with --prompt.")
  import pijax
  from pijax.errors import ConfigError
  from pijax.sampling import make_sampling_params
  cfg = cli.config_value(_CONFIG)
  try:
    _check_config(cfg)
  except (AttributeError, KeyError, TypeError) as err:
    raise ConfigError(f"--config is missing a field or has a wrong type ({err}); see "
                      "configs/smollm2_135m.py for the expected fields.") from None
  sampling = cfg.sampling
  prompt = _pick(_PROMPT, cfg.get("prompt", None))
  if prompt is None:
    raise ConfigError("--prompt is required.")
  max_new_tokens = _pick(_MAX_NEW, cfg.max_new_tokens)
  if max_new_tokens < 0:
    raise ConfigError(f"max_new_tokens={max_new_tokens} must be >= 0.")
  max_seq_len = _pick(_MAX_SEQ_LEN, cfg.max_seq_len)
  cli.check_max_seq_len(max_seq_len, "--max_seq_len" if _MAX_SEQ_LEN.value is not None
                        else "--config field max_seq_len")
  sampling_kwargs = dict(
      temperature=_pick(_TEMPERATURE, sampling.temperature),
      top_k=_pick(_TOP_K, sampling.top_k),
      top_p=_pick(_TOP_P, sampling.top_p),
      min_p=_pick(_MIN_P, sampling.min_p),
      repeat_penalty=_pick(_REPEAT_PENALTY, sampling.repeat_penalty))
  make_sampling_params(**sampling_kwargs)  # Fail on bad values before loading the model.
  response_format, logit_bias = _constraint_flags()
  sparse_flags.check(cfg, model=_pick(_MODEL, cfg.model))
  model = pijax.load(_pick(_MODEL, cfg.model), dtype=_pick(_DTYPE, cfg.dtype),
                     max_seq_len=max_seq_len,
                     ffn_activation=cfg.get("ffn_activation", None) or None)
  logging.debug("loaded %s in %.2f s", model.path, model.load_s)
  sparse_flags.configure(model, cfg)
  stream = model.stream(
      prompt,
      max_new_tokens=max_new_tokens,
      **sampling_kwargs,
      repeat_last_n=_pick(_REPEAT_LAST_N, sampling.repeat_last_n),
      seed=_pick(_SEED, sampling.seed),
      chat=_CHAT.value,
      parse_special=_PARSE_SPECIAL.value,
      logit_bias=logit_bias,
      response_format=_compile(model, response_format))
  for piece in stream:
    sys.stdout.write(piece)
    sys.stdout.flush()
  sys.stdout.write("\n")
  sys.stdout.flush()
  result = stream.result
  sys.stderr.write(result.stats.summary(result.stop_reason) + "\n")


def _read(flag) -> str:
  from pijax.errors import ConfigError
  try:
    with open(flag.value, encoding="utf-8") as f:
      return f.read()
  except (OSError, UnicodeDecodeError) as err:
    raise ConfigError(f"cannot read --{flag.name}={flag.value!r} "
                      f"({getattr(err, 'strerror', None) or err}).") from None


def _constraint_flags():
  """(response_format: None, a dict or ("lark", text), logit_bias: {id: bias}) from the flags,
  read and checked before the model loads. Raises ConfigError naming the flag."""
  from pijax.errors import ConfigError
  given = [f"--{f.name}" for f in (_RESPONSE_FORMAT, _JSON_SCHEMA, _GRAMMAR)
           if f.value is not None]
  if len(given) > 1:
    raise ConfigError(f"{' and '.join(given)} both constrain the reply; give one of them.")
  response_format = None
  if _RESPONSE_FORMAT.value is not None:
    if _RESPONSE_FORMAT.value not in ("text", "json_object"):
      raise ConfigError(f"--response_format={_RESPONSE_FORMAT.value!r} must be text or "
                        "json_object (use --json_schema=FILE for a schema).")
    response_format = {"type": _RESPONSE_FORMAT.value}
  elif _JSON_SCHEMA.value is not None:
    import json
    try:
      schema = json.loads(_read(_JSON_SCHEMA))
    except json.JSONDecodeError as err:
      raise ConfigError(f"--json_schema={_JSON_SCHEMA.value!r} is not JSON ({err}).") from None
    response_format = {"type": "json_schema",
                       "json_schema": {"name": _JSON_SCHEMA.value, "schema": schema}}
  elif _GRAMMAR.value is not None:
    response_format = ("lark", _read(_GRAMMAR))
  logit_bias = {}
  for pair in _LOGIT_BIAS.value:
    token, sep, bias = pair.partition(":")
    try:
      logit_bias[int(token)] = float(bias)
    except ValueError:
      sep = ""
    if not sep:
      raise ConfigError(f"--logit_bias entry {pair!r} must be TOKEN_ID:BIAS, e.g. 42:100.")
  from pijax import grammar as grammar_lib
  limit = grammar_lib.LOGIT_BIAS_LIMIT
  for token, bias in logit_bias.items():  # Token ids past the vocabulary: once it is loaded.
    if token < 0 or not -limit <= bias <= limit:  # False for NaN.
      raise ConfigError(f"--logit_bias entry {token}:{bias:g} must be a token id >= 0 and a "
                        f"bias in [-{limit:g}, {limit:g}].")
  return response_format, logit_bias


def _compile(model, response_format):
  """The Grammar of `_constraint_flags`' response_format for this model (GrammarError names the
  file when it does not compile)."""
  from pijax import grammar as grammar_lib
  if isinstance(response_format, tuple):
    return grammar_lib.lark_grammar(model.tokenizer, response_format[1],
                                    name=f"Lark grammar {_GRAMMAR.value!r}",
                                    vocab_size=model.config.vocab_size)
  return grammar_lib.response_format_grammar(model.tokenizer, response_format,
                                             vocab_size=model.config.vocab_size)


if __name__ == "__main__":
  cli.run(main, "pijax.generate", args_hint="pass the prompt with --prompt")
