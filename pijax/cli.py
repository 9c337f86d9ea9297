"""Shared CLI plumbing: absl app with bad input reported as one line and exit status 2."""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable

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


def run(main: Callable[[list[str]], None], prog: str) -> None:
  """absl.app.run with flag errors and PijaxError turned into one line + exit 2."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  try:  # Generated text is UTF-8 whatever the locale says.
    sys.stdout.reconfigure(encoding="utf-8", errors="replace")
  except (AttributeError, ValueError):
    pass
  from absl import app, flags

  def parse_flags(argv: list[str]) -> list[str]:
    try:
      return flags.FLAGS(argv)
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
      main(argv)
    except PijaxError as err:
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
