"""Shared CLI plumbing: absl app with bad input reported as one line and exit status 2."""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable

from host_ops import HostOpError
from pijax.errors import PijaxError

EXIT_BAD_INPUT = 2


def fail(prog: str, message: str) -> None:
  """Prints `prog: error: message` on stderr and exits with status 2."""
  sys.stderr.write(f"{prog}: error: {message}\n")
  sys.stderr.flush()
  raise SystemExit(EXIT_BAD_INPUT)


def parse_ints(text: str, name: str) -> list[int]:
  """"16,32,64" -> [16, 32, 64]; anything else -> ConfigError naming the flag."""
  from pijax.errors import ConfigError
  try:
    values = [int(v) for v in str(text).split(",") if v.strip()]
  except ValueError:
    raise ConfigError(f"--{name}={text!r} must be a comma-separated list of integers.") from None
  if not values or any(v <= 0 for v in values):
    raise ConfigError(f"--{name}={text!r} must list positive integers.")
  return values


def read_text(path: str, what: str = "the text") -> str:
  """The UTF-8 text of a file named on the command line.

  Raises:
    ConfigError: `<path>: cannot read <what> (<why>).` when it cannot be opened or decoded.
  """
  from pijax.errors import ConfigError
  try:
    with open(path, encoding="utf-8") as fh:
      return fh.read()
  except (OSError, UnicodeDecodeError) as err:
    raise ConfigError(f"{path}: cannot read {what} ({err}).") from None


def config_value(holder):
  """The value of a config_flags holder; a missing or broken config file -> ConfigError."""
  from pijax.errors import ConfigError
  try:
    value = holder.value
    if value is not None:
      value.keys()  # A config that failed to load raises here (ml_collections' _ErrorConfig).
  except Exception as err:  # ml_collections raises OSError, SyntaxError, AttributeError...
    cause = err.__cause__ or err
    raise ConfigError("could not load --config: " + " ".join(str(cause).split())) from None
  if value is None:
    raise ConfigError("--config is required, e.g. --config=configs/smollm2_135m.py")
  return value


def check_max_seq_len(value, where: str = "--max_seq_len") -> None:
  """Refuses a KV cache length (tokens) below 1 given on a command line or in a config file.

  `pijax.load(max_seq_len=0)` means "the model's whole context"; on a command line 0 or a
  negative value is a slip, so it raises here (before any model loads) instead.

  Raises:
    ConfigError: naming `where` (the flag, or the config field).
  """
  from pijax.errors import ConfigError
  if value is None:
    return
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ConfigError(f"{where}={value!r} must be a positive number of tokens (the KV cache "
                      "length, e.g. 2048).")


def define_config_file(name: str, help_string: str, **kwargs):
  """`config_flags.DEFINE_config_file(name, None, ...)` that leaves flag-file errors to `run`.

  ml_collections expands every --flagfile of sys.argv when the flag is *defined* (to see
  whether --config was given), so an unreadable flag file would raise at import time, before
  `run` can turn it into one line. Here such a file is skipped at definition; `run` parses
  sys.argv again and reports it.
  """
  from absl import flags
  from ml_collections import config_flags
  try:
    return config_flags.DEFINE_config_file(name, None, help_string, **kwargs)
  except (flags.Error, OSError, UnicodeDecodeError):
    # The failed definition registered nothing. The parse in `run` fails on the same flag
    # file before this flag is parsed, so its argv here only decides the default.
    return config_flags.DEFINE_config_file(name, None, help_string, sys_argv=sys.argv[:1],
                                           **kwargs)


def _flagfile_error(err: object) -> str:
  """One-line message for a --flagfile that cannot be opened or read."""
  detail = " ".join(str(err).split())
  for prefix in ("ERROR::", "Unable to open flagfile:"):
    detail = detail[len(prefix):].strip() if detail.startswith(prefix) else detail
  return (f"cannot read --flagfile ({detail}); pass an existing text file of --flag=value "
          "lines.")


def run(main: Callable[[list[str]], None], prog: str, *,
        args_hint: str = "give every value as --flag=value (see --helpfull)") -> None:
  """absl.app.run with flag errors and PijaxError turned into one line + exit 2.

  Positional arguments are refused (`args_hint` says what to do instead): every pijax CLI
  takes flags only, and a stray word would otherwise be ignored in silence.
  """
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  try:  # Generated text is UTF-8 whatever the locale says.
    sys.stdout.reconfigure(encoding="utf-8", errors="replace")
  except (AttributeError, ValueError):
    pass
  from absl import app, flags

  def parse_flags(argv: list[str]) -> list[str]:
    try:
      return flags.FLAGS(argv)
    except flags.CantOpenFlagFileError as err:
      fail(prog, _flagfile_error(err))
    except UnicodeDecodeError as err:
      if any(a.lstrip("-").startswith("flagfile") for a in argv[1:]):
        fail(prog, _flagfile_error(f"not UTF-8 text: {err}"))
      fail(prog, "bad flags: " + " ".join(f"{type(err).__name__}: {err}".split()))
    except flags.Error as err:
      fail(prog, " ".join(f"{err} (see --helpfull)".split()))
    except Exception as err:  # Flag files that cannot be read or decoded, broken configs.
      fail(prog, "bad flags: " + " ".join(f"{type(err).__name__}: {err}".split()))
    return []

  def guarded(argv: list[str]) -> None:
    logging.getLogger("jax").setLevel(logging.WARNING)
    from absl import logging as absl_logging
    if not flags.FLAGS["verbosity"].present:  # orbax logs every step at INFO; -v 0 shows it.
      absl_logging.set_verbosity(absl_logging.WARNING)
    try:
      if len(argv) > 1:
        fail(prog, f"unexpected arguments {argv[1:]}; {args_hint}.")
      main(argv)
    except (PijaxError, HostOpError) as err:  # HostOpError: host_ops's own bad-input error.
      fail(prog, " ".join(str(err).split()))
    except BrokenPipeError:
      # The reader went away (e.g. `| head`): stop quietly, as cat does.
      try:
        sys.stdout = open(os.devnull, "w")
      except OSError:
        pass
      os._exit(0)  # Avoid a second BrokenPipeError while flushing at exit.
    except KeyboardInterrupt:
      sys.stderr.write(f"\n{prog}: interrupted\n")
      raise SystemExit(130) from None

  app.run(guarded, flags_parser=parse_flags)
