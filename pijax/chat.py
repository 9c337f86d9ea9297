"""`python -m pijax.chat --model=default`: chat with a model in the terminal.

The conversation, and its KV cache (`pijax.session.Session`), are kept between turns, so a turn
prefills only its new tokens. Replies stream as they are decoded. Ctrl-C stops the current reply
(what was said so far stays in the conversation); Ctrl-D or /bye quits. Commands:

  /help                 this list
  /clear                forget the conversation (and free its cache)
  /bye                  quit
  /set <name> <value>   temperature, top_p, top_k, min_p, repeat_penalty, seed, max_tokens, system
  /show                 the current settings

Bad flags or a model without a chat template: one line on stderr, exit status 2.
"""

from __future__ import annotations

import signal
import sys
import threading

from absl import flags

from pijax import cli
from pijax import sparse_flags

_MODEL = flags.DEFINE_string("model", "default", "GGUF path, bundle folder, or 'default'.")
_SYSTEM = flags.DEFINE_string("system", None, "System message that opens the conversation.")
_MAX_SEQ_LEN = flags.DEFINE_integer("max_seq_len", 2048, "KV cache length (tokens): the whole "
                                    "conversation must fit.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.7, "0 = greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 40, "Keep the k most likely tokens; 0 = off.")
_TOP_P = flags.DEFINE_float("top_p", 0.95, "Nucleus sampling mass; 1 = off.")
_MIN_P = flags.DEFINE_float("min_p", 0.05, "Drop tokens with p < min_p * p_max; 0 = off.")
_REPEAT_PENALTY = flags.DEFINE_float("repeat_penalty", 1.1, "Repetition penalty; 1 = off.")
_SEED = flags.DEFINE_integer("seed", 0, "PRNG seed of the first reply (then +1 per reply).")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 512, "Tokens per reply at most.")

PROG = "pijax.chat"
HELP = """commands:
  /help                 this list
  /clear                forget the conversation
  /bye                  quit (or Ctrl-D)
  /set <name> <value>   temperature, top_p, top_k, min_p, repeat_penalty, seed, max_tokens, system
  /show                 the current settings
Ctrl-C stops a reply; the conversation goes on."""

_NUMBERS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float,
            "repeat_penalty": float, "seed": int, "max_tokens": int}


class ChatSession:
  """A conversation with a model: messages, settings and the KV cache they share.

  Args:
    model: a loaded `pijax.engine.Model` with a chat template.
    settings: sampling values (see `_NUMBERS`) and "system" (str or None).

  Raises:
    ConfigError: the model has no chat template.
  """

  def __init__(self, model, settings: dict):
    from pijax import session as session_lib
    from pijax.errors import ConfigError
    if not model.tokenizer.chat_template:
      raise ConfigError(f"{model.path}: the model has no chat template "
                        "(tokenizer.chat_template), so it cannot chat; use pijax.generate.")
    self.model = model
    self.settings = dict(settings)
    self.messages: list[dict[str, str]] = []
    self.session = session_lib.Session(model)
    self.context_full = False  # The latest reply stopped because the context was full.

  def clear(self) -> None:
    self.messages = []
    self.session.clear()

  def set(self, name: str, value: str) -> str:
    """Changes one setting; returns the line to print."""
    from pijax.errors import ConfigError
    if name == "system":
      self.settings["system"] = value or None
      return f"system = {value!r} (from the next turn on)"
    kind = _NUMBERS.get(name)
    if kind is None:
      return f"unknown setting {name!r}; one of: {', '.join(list(_NUMBERS) + ['system'])}"
    try:
      parsed = kind(value)
    except ValueError:
      return f"{name} takes a{'n integer' if kind is int else ' number'}, not {value!r}"
    trial = dict(self.settings, **{name: parsed})
    try:
      check_settings(trial)
    except ConfigError as err:
      return str(err)
    self.settings[name] = parsed
    return f"{name} = {parsed}"

  def reply(self, text: str, write) -> tuple[str, bool]:
    """Sends one user turn and streams the reply through `write`.

    Ctrl-C (SIGINT) while it runs stops the reply before the next decode step: the signal only
    sets a flag, since an interrupt raised inside the host callback would fail the step.

    Returns:
      (the reply, whether Ctrl-C stopped it); what was said stays in the conversation.

    Raises:
      ContextError: the conversation no longer fits max_seq_len (the turn is dropped).
    """
    s = self.settings
    system = [{"role": "system", "content": s["system"]}] if s.get("system") else []
    self.messages.append({"role": "user", "content": text})
    try:
      stream = self.model.stream(
          system + self.messages, chat=True, session=self.session,
          max_new_tokens=s["max_tokens"], temperature=s["temperature"], top_k=s["top_k"],
          top_p=s["top_p"], min_p=s["min_p"], repeat_penalty=s["repeat_penalty"],
          seed=s["seed"])
    except Exception:
      self.messages.pop()
      raise
    s["seed"] = s["seed"] + 1 if s["seed"] < 2 ** 63 - 1 else -(2 ** 63)
    pieces: list[str] = []
    stopped = threading.Event()
    previous = None
    if threading.current_thread() is threading.main_thread():
      previous = signal.signal(signal.SIGINT, lambda signum, frame: stopped.set())
    try:
      for piece in stream:
        pieces.append(piece)
        write(piece)
        if stopped.is_set():
          break
    finally:
      stream.close()
      if previous is not None:
        signal.signal(signal.SIGINT, previous)
      self.messages.append({"role": "assistant", "content": "".join(pieces)})
    result = stream.result
    self.context_full = (result is not None and result.stop_reason == "length"
                         and len(self.session.ids) + 1 >= self.model.max_seq_len)
    return "".join(pieces), stopped.is_set()


def check_settings(settings: dict) -> None:
  """Raises ConfigError naming the first out-of-range setting."""
  from pijax.errors import ConfigError
  from pijax.sampling import make_sampling_params
  make_sampling_params(**{k: settings[k] for k in ("temperature", "top_k", "top_p", "min_p",
                                                   "repeat_penalty")})
  if not 1 <= settings["max_tokens"] <= 2 ** 31 - 1:
    raise ConfigError(f"max_tokens={settings['max_tokens']} must be in [1, 2**31 - 1].")
  if not -(2 ** 63) <= settings["seed"] < 2 ** 63:
    raise ConfigError(f"seed={settings['seed']} must be in [-2**63, 2**63).")


def repl(chat: ChatSession, *, stdin=None, stdout=None) -> None:
  """Reads turns and commands until /bye or end of input."""
  out = stdout or sys.stdout

  def write(text: str) -> None:
    out.write(text)
    out.flush()

  from pijax.errors import PijaxError
  write(f"pijax chat: {chat.model.path} ({chat.model.weights_label}). "
        "/help for commands, /bye or Ctrl-D to quit.\n")
  while True:
    try:
      line = input(">>> ") if stdin is None else _read(stdin, write)
    except EOFError:
      write("\n")
      return
    except KeyboardInterrupt:
      write("\n(Ctrl-D or /bye quits)\n")
      continue
    line = line.strip()
    if not line:
      continue
    if line.startswith("/"):
      cmd, _, arg = line.partition(" ")
      if cmd in ("/bye", "/exit", "/quit"):
        return
      if cmd == "/help":
        write(HELP + "\n")
      elif cmd == "/clear":
        chat.clear()
        write("(conversation cleared)\n")
      elif cmd == "/show":
        write(", ".join(f"{k}={v!r}" for k, v in chat.settings.items()) + "\n")
      elif cmd == "/set":
        name, _, value = arg.strip().partition(" ")
        write(chat.set(name, value.strip()) + "\n" if name else "usage: /set <name> <value>\n")
      else:
        write(f"unknown command {cmd}; /help lists them\n")
      continue
    try:
      _, stopped = chat.reply(line, write)
      write("\n(stopped)\n" if stopped else "\n")
      if chat.context_full:
        write(f"(the context is full: {chat.model.max_seq_len} tokens; /clear starts over)\n")
    except KeyboardInterrupt:
      write("\n(stopped)\n")
    except PijaxError as err:
      write(f"error: {' '.join(str(err).split())} (/clear starts over)\n")


def _read(stdin, write) -> str:
  write(">>> ")
  line = stdin.readline()
  if not line:
    raise EOFError
  return line


def main(argv: list[str]) -> None:
  del argv
  import pijax
  cli.check_max_seq_len(_MAX_SEQ_LEN.value)
  settings = {"temperature": _TEMPERATURE.value, "top_k": _TOP_K.value, "top_p": _TOP_P.value,
              "min_p": _MIN_P.value, "repeat_penalty": _REPEAT_PENALTY.value,
              "seed": _SEED.value, "max_tokens": _MAX_TOKENS.value, "system": _SYSTEM.value}
  check_settings(settings)
  sparse_flags.check(model=_MODEL.value)
  from absl import logging as absl_logging
  absl_logging.set_verbosity(absl_logging.ERROR)  # Log lines would land inside replies.
  # Ctrl-C at the prompt must interrupt input(): a process started where SIGINT is ignored (a
  # background job of a non-interactive shell, and so its children) inherits SIG_IGN, and
  # Python then installs no handler; the REPL is interactive, so it takes SIGINT back.
  signal.signal(signal.SIGINT, signal.default_int_handler)
  model = pijax.load(_MODEL.value, max_seq_len=_MAX_SEQ_LEN.value)
  sparse_flags.configure(model)
  chat = ChatSession(model, settings)
  try:
    import readline  # noqa: F401  (line editing and history for input())
  except ImportError:
    pass
  try:
    repl(chat)
  finally:
    chat.session.close()


if __name__ == "__main__":
  cli.run(main, PROG, args_hint="give every value as --flag=value (see --helpfull)")
