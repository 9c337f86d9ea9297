"""`python -m pijax.serve --model=default --host 127.0.0.1 --port 8080`: an OpenAI-compatible server.

Serves `/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/health`, `/metrics` and a chat
page at `/` (see `pijax.server.app`), up to `--parallel` requests decoded together (continuous
batching, `pijax.server.worker`). The port opens at once; the model loads and compiles in
the background while `/health` answers 503, then 200. Takes the sparse / placement / host
flags of `pijax.generate`. Needs the `server` extra (`pip install -e '.[server]'`).
Bad flags, a port in use or a model that fails to load: one line on stderr, exit status 2.
Only requests naming this server in `Host` are answered (403 otherwise; `--allowed_hosts`);
`--api_key` requires a Bearer key; a bind beyond loopback without one prints a warning.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading

PROG = "pijax.serve"


def _quit_now(sig, frame) -> None:
  """A Ctrl-C while nothing can be unwound cleanly (imports, clean-up): one line, status 130."""
  del sig, frame
  sys.stderr.write(f"\n{PROG}: interrupted\n")
  sys.stderr.flush()
  os._exit(130)  # Python's immediate exit: no unwinding of half-done imports or threads.


if __name__ == "__main__":  # Ctrl-C while the imports below run (~1 s): quit, no traceback.
  signal.signal(signal.SIGINT, _quit_now)

from absl import flags  # noqa: E402 (after the handler above)

from pijax import cli  # noqa: E402
from pijax import sparse_flags  # noqa: E402

_MODEL = flags.DEFINE_string("model", "default", "GGUF path, bundle folder, or 'default'.")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
_PORT = flags.DEFINE_integer("port", 8080, "TCP port to listen on.")
_MODEL_ALIAS = flags.DEFINE_string("model_alias", None, "Model id clients send (default: the "
                                   "file name without .gguf).")
_MAX_SEQ_LEN = flags.DEFINE_integer("max_seq_len", 2048, "KV cache length (tokens) of each "
                                    "conversation: prompt + reply must fit.")
_DTYPE = flags.DEFINE_string("dtype", "float32", "float32 (CPU) or bfloat16 (GPU).")
_MAX_QUEUE = flags.DEFINE_integer("max_queue", 16, "Requests that may wait for a free slot "
                                  "(--parallel); more get 503.")
_CACHE_SLOTS = flags.DEFINE_integer("cache_slots", 2, "Conversations whose KV cache is kept "
                                    "for prefix reuse (each max_seq_len tokens) when requests "
                                    "run one at a time (models off host weights); the "
                                    "--parallel slots keep their own.")
_PARALLEL = flags.DEFINE_integer("parallel", 8, "Requests decoded together (continuous "
                                 "batching, llama-server's -np); each holds a KV cache of "
                                 "max_seq_len tokens. Models off host weights: one at a time.")
_PREFILL_CHUNK = flags.DEFINE_integer("prefill_chunk", 128, "Prompt tokens of newly arrived "
                                     "requests fed per decode step while others stream "
                                     "(chunked prefill: bounds how long a long prompt stalls "
                                     "them; BUILD_NOTES.md, issue 31).")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", None, "Reply tokens at most for a "
                                   "request that names no max_tokens (llama.cpp's -n); "
                                   "default: up to the context's end.", lower_bound=1)
_WARMUP = flags.DEFINE_bool("warmup", True, "Compile the prefill and decode steps before "
                            "reporting ready.")
_ALLOWED_HOSTS = flags.DEFINE_list("allowed_hosts", [], "Names clients may send in the Host "
                                   "header besides localhost, 127.0.0.1, [::1] and --host "
                                   "(comma-separated; '*' allows any, e.g. behind a proxy). "
                                   "Others get 403 (DNS rebinding).")
_API_KEY = flags.DEFINE_string("api_key", None, "Require 'Authorization: Bearer KEY' on every "
                               "route but /health and / (401 otherwise). Without it, a server "
                               "bound beyond loopback is open to the network.")



def _model_id(path: str) -> str:
  if _MODEL_ALIAS.value:
    return _MODEL_ALIAS.value
  if path == "default":
    from pijax.formats.gguf import default_model_path
    path = default_model_path()
  name = os.path.basename(os.path.normpath(path))
  return name[:-5] if name.endswith(".gguf") else name


def _check_port(host: str, port: int) -> None:
  from pijax.errors import ConfigError
  if not 0 < port < 65536:
    raise ConfigError(f"--port={port} must be in [1, 65535].")
  try:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
  except socket.gaierror as err:
    raise ConfigError(f"--host={host!r} is not an address this machine has ({err}).") from None
  family, _, _, _, addr = infos[0]
  with socket.socket(family, socket.SOCK_STREAM) as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      s.bind(addr)
    except OSError as err:
      raise ConfigError(f"cannot listen on {host}:{port} ({err.strerror}); pick another "
                        "--port or stop what uses it.") from None


def _precheck_model(path: str, dtype: str) -> None:
  """Fails fast (before the port opens) on a model that cannot load: missing, not a GGUF,
  truncated, an unsupported architecture, a bundle without its manifest, a bad dtype."""
  from pijax.arch import registry
  from pijax.formats import bundle as bundle_lib
  from pijax.formats.gguf import default_model_path, open_gguf
  from pijax.formats.loader import numpy_dtype
  numpy_dtype(dtype)
  if bundle_lib.is_bundle(path):
    bundle_lib.read_manifest(path)
    return
  path = default_model_path() if path == "default" else path
  reader, metadata = open_gguf(path)
  registry.config_from_metadata(metadata, path, {t.name: t for t in reader.tensors})


def main(argv: list[str]) -> None:
  del argv
  signal.signal(signal.SIGINT, signal.default_int_handler)  # Imports done: cli.run reports it.
  try:
    import fastapi  # noqa: F401
    import uvicorn
  except ImportError as err:
    from pijax.errors import ConfigError
    raise ConfigError(f"the server needs the `server` extra ({err.name} is missing); run "
                      "pip install -e '.[server]'.") from None
  from pijax.errors import ConfigError
  cli.check_max_seq_len(_MAX_SEQ_LEN.value)
  for flag in (_MAX_QUEUE, _CACHE_SLOTS, _PARALLEL, _PREFILL_CHUNK):
    if flag.value < 1:
      raise ConfigError(f"--{flag.name}={flag.value} must be >= 1.")
  sparse_flags.check(model=_MODEL.value)
  model_arg = _MODEL.value
  if model_arg != "default" and not os.path.exists(model_arg):
    raise ConfigError(f"--model={model_arg!r} does not exist; give a GGUF file, a bundle "
                      "folder or 'default'.")
  from pijax.server import access
  api_key = access.check_api_key(_API_KEY.value)
  _precheck_model(model_arg, _DTYPE.value)
  _check_port(_HOST.value, _PORT.value)

  from pijax.server.app import ServerState, create_app
  from pijax.server import worker as worker_lib
  state = ServerState(_model_id(model_arg), max_queue=_MAX_QUEUE.value,
                      cache_slots=_CACHE_SLOTS.value, parallel=_PARALLEL.value,
                      prefill_tokens=_PREFILL_CHUNK.value, max_tokens=_MAX_TOKENS.value,
                      host=_HOST.value, allowed_hosts=tuple(_ALLOWED_HOSTS.value),
                      api_key=api_key)
  app = create_app(state)
  config = uvicorn.Config(app, host=_HOST.value, port=_PORT.value, log_level="warning",
                          access_log=False, timeout_graceful_shutdown=5,
                          # The app has no startup/shutdown hooks; with lifespan on, a second
                          # Ctrl-C (force quit) printed the cancelled lifespan task's traceback.
                          lifespan="off")
  stopping = threading.Event()

  class Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
      # uvicorn turns Ctrl-C / SIGTERM into a graceful shutdown, then raises the signal again
      # once it is done: SIGTERM then killed the process before the clean-up below ran. The
      # shutdown is finished here (threads joined, "stopped"), so the signals are not re-raised.
      if threading.current_thread() is not threading.main_thread():
        yield
        return
      old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
      try:
        yield
      finally:
        for sig, handler in old.items():
          signal.signal(sig, handler)

    def handle_exit(self, sig, frame):
      # Ctrl-C / SIGTERM: end every job now, so open streams close within the grace period.
      stopping.set()
      if state.worker is not None:
        state.worker.shutdown()
      super().handle_exit(sig, frame)

  server = Server(config)

  def load() -> None:
    import pijax
    try:
      model = pijax.load(model_arg, dtype=_DTYPE.value, max_seq_len=_MAX_SEQ_LEN.value)
      sparse_flags.configure(model)
      compile_s = worker_lib.warm_up(model, stopping) if _WARMUP.value else 0.0
      if stopping.is_set():
        return
    except Exception as err:  # Reported as one line; the server then stops with exit 2.
      from host_ops import HostOpError
      from pijax.errors import PijaxError
      if not isinstance(err, (PijaxError, HostOpError)):
        logging.exception("loading the model failed")
      state.error = " ".join(str(err).split())
      server.should_exit = True
      return
    state.attach(model)
    sys.stderr.write(f"{PROG}: ready: {state.model_id} ({model.weights_label}, "
                     f"max_seq_len {model.max_seq_len}, {state.worker.parallel} slots), load {model.load_s:.1f} s, "
                     f"warm-up {compile_s:.1f} s\n")
    sys.stderr.flush()

  sys.stderr.write(f"{PROG}: listening on http://{_HOST.value}:{_PORT.value} "
                   f"(loading {model_arg})\n")
  if api_key is None and not access.is_loopback_bind(_HOST.value):
    sys.stderr.write(f"{PROG}: warning: --host={_HOST.value} is reachable from the network and "
                     "there is no --api_key: anyone who can reach this port can use the "
                     "model.\n")
  sys.stderr.flush()
  loader = threading.Thread(target=load, name="pijax-load", daemon=True)
  loader.start()
  try:
    server.run()  # Returns after a graceful shutdown (capture_signals does not re-raise).
  finally:
    # Threads still inside XLA or numba when the interpreter exits abort it: stop them first.
    # Another Ctrl-C meanwhile quits at once, without the interpreter's exit (which would abort).
    if threading.current_thread() is threading.main_thread():
      signal.signal(signal.SIGINT, _quit_now)
      signal.signal(signal.SIGTERM, _quit_now)
    stopping.set()
    loader.join()
    if state.worker is not None:
      state.worker.close()
  if state.error is None:
    sys.stderr.write(f"{PROG}: stopped\n")
    # Nothing is left to interrupt: a late Ctrl-C must not end the exit by the signal.
    if threading.current_thread() is threading.main_thread():
      signal.signal(signal.SIGINT, signal.SIG_IGN)
  if state.error is not None:
    raise ConfigError(f"could not load --model={model_arg}: {state.error}")


if __name__ == "__main__":
  cli.run(main, PROG, args_hint="give every value as --flag=value (see --helpfull)")
