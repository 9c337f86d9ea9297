"""`python -m pijax.generate --config=configs/smollm2_135m.py --prompt=...`

stdout carries only the generated text, streamed as it is produced; stderr carries logs and
one closing stats line. Bad input (missing/corrupt model, prompt longer than the context,
invalid sampling values) gives one line on stderr and exit status 2.
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
      parse_special=_PARSE_SPECIAL.value)
  for piece in stream:
    sys.stdout.write(piece)
    sys.stdout.flush()
  sys.stdout.write("\n")
  sys.stdout.flush()
  result = stream.result
  sys.stderr.write(result.stats.summary(result.stop_reason) + "\n")


if __name__ == "__main__":
  cli.run(main, "pijax.generate", args_hint="pass the prompt with --prompt")
