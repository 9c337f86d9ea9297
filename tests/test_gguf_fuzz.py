"""Hostile GGUF files: a small valid model mutated field by field (and at random bytes).

Every mutated file must either load (`read_gguf`, then the tokenizer the CLI builds next) or
give one `PijaxError` (a `GGUFError` naming the file) whose message is one line: never another
exception type, a hang, or an allocation driven by a lying size field. Each example runs under an address-space limit and a timer, so such a blow-up
fails the test instead of taking the machine down.

The example count is small by default (CI); PIJAX_FUZZ_EXAMPLES=2000 runs a longer search.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import re
import resource
import signal
import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from pijax.errors import GGUFError, PijaxError
from pijax.formats.loader import read_gguf
from pijax.text.tokenizer import Tokenizer

import tiny_models

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = "--config=" + str(ROOT / "configs" / "smollm2_135m.py")

N_EXAMPLES = int(os.environ.get("PIJAX_FUZZ_EXAMPLES", "300"))
TIME_LIMIT_S = 10.0  # Per example; the tiny file loads in milliseconds.
MEMORY_LIMIT_BYTES = 1 << 30  # Extra address space one example may map or allocate.

# ------------------------------------------------------------------------------------- layout

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


@dataclasses.dataclass(frozen=True)
class Field:
  """One fixed-size field of the file: `size` bytes at byte `offset` (little-endian)."""

  kind: str  # magic, version, count, strlen, vtype, atype, alen, scalar, ndims, dim, ttype, toffset
  offset: int
  size: int
  name: str = ""  # the key or tensor name the field belongs to.


@dataclasses.dataclass(frozen=True)
class Layout:
  """The fields of a valid GGUF (parsed here independently of the code under test)."""

  fields: tuple[Field, ...]
  data_start: int  # first byte of tensor data (aligned)
  alignment: int

  def of(self, *kinds: str) -> list[Field]:
    return [f for f in self.fields if f.kind in kinds]


def parse_layout(data: bytes) -> Layout:
  """Walks a valid little-endian GGUF v3 header and records every field's offset."""
  fields: list[Field] = [Field("magic", 0, 4), Field("version", 4, 4)]
  pos = 8

  def u(fmt: str) -> int:
    nonlocal pos
    (value,) = struct.unpack_from("<" + fmt, data, pos)
    pos += struct.calcsize(fmt)
    return value

  def string(name: str) -> str:
    nonlocal pos
    fields.append(Field("strlen", pos, 8, name))
    n = u("Q")
    text = data[pos:pos + n].decode()
    pos += n
    return text

  def value(vtype: int, name: str, in_array: bool = False) -> object:
    nonlocal pos
    if vtype == _STRING:
      return string(name)
    if vtype == _ARRAY:
      fields.append(Field("atype", pos, 4, name))
      atype = u("I")
      fields.append(Field("alen", pos, 8, name))
      n = u("Q")
      return [value(atype, name, True) for _ in range(n)]
    size = _SCALAR_SIZES[vtype]
    if not in_array:
      fields.append(Field("scalar", pos, size, name))
    raw = data[pos:pos + size]
    pos += size
    return int.from_bytes(raw, "little")

  fields.append(Field("count", pos, 8, "tensor_count"))
  n_tensors = u("Q")
  fields.append(Field("count", pos, 8, "kv_count"))
  n_kv = u("Q")
  alignment = 32
  for _ in range(n_kv):
    key = string("key")
    fields.append(Field("vtype", pos, 4, key))
    vtype = u("I")
    got = value(vtype, key)
    if key == "general.alignment" and vtype == 4:
      alignment = got
  for _ in range(n_tensors):
    name = string("tensor")
    fields.append(Field("ndims", pos, 4, name))
    n_dims = u("I")
    for _ in range(n_dims):
      fields.append(Field("dim", pos, 8, name))
      u("Q")
    fields.append(Field("ttype", pos, 4, name))
    u("I")
    fields.append(Field("toffset", pos, 8, name))
    u("Q")
  data_start = -(-pos // alignment) * alignment
  return Layout(tuple(fields), data_start, alignment)


@functools.lru_cache(maxsize=1)
def base_file() -> tuple[bytes, Layout]:
  """A tiny valid llama GGUF (tokenizer metadata, F32/F16/Q8_0 tensors, explicit alignment)."""
  import tempfile
  with tempfile.TemporaryDirectory() as tmp:
    path = pathlib.Path(tmp) / "tiny.gguf"
    tiny_models.write_random_quantized_gguf(
        path, layer_type="Q8_0", embd_type="F16", output_type="F32", hidden=32, ffn=64, layers=1,
        heads=2, kv_heads=1, vocab=8, alignment=64)
    data = path.read_bytes()
  return data, parse_layout(data)


@functools.lru_cache(maxsize=1)
def _base_contents() -> tuple[list, list]:
  """(metadata [(key, value, type, element type)], tensors [(name, raw data, type)]) of the
  base file, to write variants of it."""
  import tempfile
  with tempfile.TemporaryDirectory() as tmp:
    path = pathlib.Path(tmp) / "base.gguf"
    path.write_bytes(base_file()[0])
    reader = gguf.GGUFReader(path)
    kvs = [(k, f.contents(), f.types[0], f.types[-1] if f.types[0] == _ARRAY else None)
           for k, f in reader.fields.items() if not k.startswith("GGUF.")]
    tensors = [(t.name, np.array(t.data), t.tensor_type) for t in reader.tensors]
  return kvs, tensors


V = gguf.GGUFValueType
# A value of another type for a key (the file stays well-formed): what its readers must refuse.
RETYPE_VALUES = (
    (7, V.UINT32, None), (-1, V.INT32, None), (float("nan"), V.FLOAT32, None),
    ("x", V.STRING, None), (True, V.BOOL, None), ((1 << 64) - 1, V.UINT64, None),
    (1 << 40, V.UINT64, None), ([1, 2], V.ARRAY, V.UINT32), (["a", "b"], V.ARRAY, V.STRING),
    ([0.5], V.ARRAY, V.FLOAT32), (1e308, V.FLOAT64, None), (-(1 << 63), V.INT64, None))
RETYPE_EXTRA_KEYS = (
    "pijax.ffn_activation", "llama.attention.key_length", "llama.rope.scaling.type",
    "llama.rope.scaling.factor", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template",
    "tokenizer.ggml.scores", "tokenizer.ggml.eot_token_id")


def retype_keys() -> list[str]:
  return [k for k, *_ in _base_contents()[0]] + list(RETYPE_EXTRA_KEYS)


@functools.lru_cache(maxsize=64)
def retyped_file(key: str, variant: int) -> tuple[bytes, Layout]:
  """The base file with metadata `key` set to RETYPE_VALUES[variant] (added if absent)."""
  import tempfile
  value, vtype, sub = RETYPE_VALUES[variant]
  kvs, tensors = _base_contents()
  with tempfile.TemporaryDirectory() as tmp:
    path = pathlib.Path(tmp) / "retyped.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    if key == "general.architecture":
      w.kv_data[0][key] = gguf.GGUFValue(value, vtype, sub)
    if key != "general.alignment":
      w.add_custom_alignment(base_file()[1].alignment)
    for k, v, t, st_ in kvs:
      if k not in ("general.architecture", "general.alignment", key):
        w.add_key_value(k, v, t, sub_type=st_)
    if key != "general.architecture":
      w.add_key_value(key, value, vtype, sub_type=sub)
    for name, data, ttype in tensors:
      w.add_tensor(name, data, raw_dtype=ttype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = path.read_bytes()
  return data, parse_layout(data)


def test_base_file_is_valid_and_parsed(tmp_path):
  data, layout = base_file()
  path = tmp_path / "base.gguf"
  path.write_bytes(data)
  cfg, metadata = read_gguf(path)
  assert cfg.vocab_size == 8 and metadata["general.alignment"] == 64
  assert layout.alignment == 64
  assert {f.name for f in layout.of("ttype")} >= {"token_embd.weight", "output.weight"}
  assert layout.of("alen") and layout.of("scalar")
  assert layout.data_start < len(data)

# ------------------------------------------------------------------------------------ mutations


def _edges(bits: int) -> list[int]:
  """Boundary values of an unsigned `bits`-bit field."""
  top = (1 << bits) - 1
  values = {0, 1, 2, 3, 4, 7, 8, 16, 31, 32, 63, 64, 255, 256, 4096, 1 << 20, (1 << 31) - 1,
            1 << 31, top >> 1, (top >> 1) + 1, top - 1, top}
  return sorted(v for v in values if v <= top)


def _int_value(draw, bits: int, old: int, file_size: int) -> int:
  """A replacement for an unsigned `bits`-bit field holding `old`: an edge value, a value near
  the old one or the file size, or any value."""
  top = (1 << bits) - 1
  near = [old + d for d in (-2, -1, 1, 2, 8, 64)] + [file_size + d for d in (-8, 0, 8)]
  return draw(st.one_of(
      st.sampled_from(_edges(bits)),
      st.sampled_from([v & top for v in near]),
      st.integers(0, top)))


def _mutate(draw, data: bytearray, layout: Layout) -> str:
  """Applies one mutation in place; returns its description."""
  size = len(data)
  kind = draw(st.sampled_from([
      "magic", "version", "count", "strlen", "vtype", "atype", "alen", "scalar", "alignment",
      "ndims", "dim", "ttype", "toffset", "flip", "lying_array"]))
  if kind == "lying_array":  # Any element type, any length: the classic lying size field.
    atype = draw(st.sampled_from(layout.of("atype")))
    alen = next(f for f in layout.of("alen") if f.offset == atype.offset + 4)
    etype = draw(st.sampled_from(sorted(_SCALAR_SIZES) + [_STRING]))
    n = _int_value(draw, 64, 0, size)
    data[atype.offset:atype.offset + 4] = etype.to_bytes(4, "little")
    data[alen.offset:alen.offset + 8] = n.to_bytes(8, "little")
    return f"array {atype.name!r}@{atype.offset} := type {etype} x {n}"
  if kind == "flip":
    n = draw(st.integers(1, 8))
    end = draw(st.sampled_from([layout.data_start, size]))
    out = []
    for _ in range(n):
      at = draw(st.integers(0, end - 1))
      data[at] ^= draw(st.integers(1, 255))
      out.append(at)
    return f"flip bytes {out}"
  if kind == "alignment":
    candidates = [f for f in layout.of("scalar") if f.name == "general.alignment"]
    value = draw(st.sampled_from([0, 1, 2, 4, 8, 12, 16, 24, 31, 32, 128, 4096, 1 << 20,
                                  1 << 31, (1 << 32) - 1]))
  else:
    candidates = layout.of(kind)
  field = draw(st.sampled_from(candidates or layout.of("scalar")))
  if kind == "magic":
    value = draw(st.integers(0, (1 << 32) - 1))
  elif kind == "vtype" or kind == "atype":
    value = draw(st.one_of(st.integers(0, 14), st.sampled_from([255, 1 << 16, (1 << 32) - 1])))
  elif kind == "ttype":
    value = draw(st.one_of(st.integers(0, 45), st.sampled_from([255, 1 << 16, (1 << 32) - 1])))
  elif kind == "ndims":
    value = draw(st.one_of(st.integers(0, 8), st.sampled_from([255, 1 << 16, (1 << 32) - 1])))
  elif kind == "toffset":
    old = int.from_bytes(data[field.offset:field.offset + 8], "little")
    value = draw(st.one_of(
        st.sampled_from([old + k * layout.alignment for k in (-2, -1, 1, 2, 100)] +
                        [size - layout.data_start]),
        st.integers(0, size), st.just(0)))
    value &= (1 << 64) - 1
  elif kind != "alignment":
    old = int.from_bytes(data[field.offset:field.offset + field.size], "little")
    value = _int_value(draw, 8 * field.size, old, size)
  value &= (1 << (8 * field.size)) - 1
  data[field.offset:field.offset + field.size] = value.to_bytes(field.size, "little")
  return f"{kind} {field.name!r}@{field.offset} := {value}"


@st.composite
def hostile_files(draw) -> tuple[bytes, list[str]]:
  """(file bytes, mutation descriptions): the base file (or, one time in four, the base with one
  key's value of another type), 1-3 in-place mutations (0-3 after a retype), then maybe a
  truncation."""
  base, layout = base_file()
  steps = []
  if draw(st.integers(0, 3)) == 0:
    key, variant = draw(st.sampled_from(retype_keys())), draw(
        st.integers(0, len(RETYPE_VALUES) - 1))
    base, layout = retyped_file(key, variant)
    steps.append(f"{key} := {RETYPE_VALUES[variant][:2]}")
  data = bytearray(base)
  steps += [_mutate(draw, data, layout) for _ in range(draw(st.integers(0 if steps else 1, 3)))]
  if draw(st.integers(0, 3)) == 0:
    end = draw(st.sampled_from([8, layout.data_start, layout.data_start, len(data)]))
    cut = draw(st.integers(0, 1 << 30)) % end  # Spread out (bounded draws favour the ends).
    del data[cut:]
    steps.append(f"truncate to {cut} bytes")
  return bytes(data), steps

# --------------------------------------------------------------------------- guarded execution


class ExampleTimeout(BaseException):
  """Raised by the timer when one example runs too long (a BaseException: `except Exception`
  in the code under test cannot swallow it)."""


def _vm_size_bytes() -> int | None:
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmSize:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def _guarded(fn, *args):
  """fn(*args) under a wall-clock timer and an address-space limit of MEMORY_LIMIT_BYTES above
  what the process maps now (Linux; elsewhere only the timer)."""

  def on_alarm(signum, frame):
    raise ExampleTimeout(f"one example ran longer than {TIME_LIMIT_S} s")

  old_handler = signal.signal(signal.SIGALRM, on_alarm)
  old_limit = resource.getrlimit(resource.RLIMIT_AS)
  vm = _vm_size_bytes()
  if vm is not None:
    soft = vm + MEMORY_LIMIT_BYTES
    if old_limit[1] == resource.RLIM_INFINITY or soft <= old_limit[1]:
      resource.setrlimit(resource.RLIMIT_AS, (soft, old_limit[1]))
  # Repeats until disarmed: one firing can be swallowed (e.g. inside a gc callback).
  signal.setitimer(signal.ITIMER_REAL, TIME_LIMIT_S, 0.5)
  try:
    return fn(*args)
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    resource.setrlimit(resource.RLIMIT_AS, old_limit)
    signal.signal(signal.SIGALRM, old_handler)


def _chain(err: BaseException):
  """err and every exception it was raised from or while handling."""
  seen = set()
  while err is not None and id(err) not in seen:
    seen.add(id(err))
    yield err
    err = err.__cause__ or err.__context__


def _load(path: pathlib.Path) -> None:
  _, metadata = read_gguf(path)
  Tokenizer.from_metadata(metadata)  # The CLI builds the tokenizer next; cheap here.


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory) -> pathlib.Path:
  return tmp_path_factory.mktemp("fuzz")


@settings(max_examples=N_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=hostile_files())
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN scales dequantized from flipped bytes.
def test_hostile_gguf_loads_or_gives_one_clear_error(fuzz_dir, case):
  data, steps = case
  note(f"mutations: {steps}")
  path = fuzz_dir / "hostile.gguf"
  path.write_bytes(data)
  try:
    _guarded(_load, path)
  except PijaxError as err:
    for cause in _chain(err):
      assert not isinstance(cause, (MemoryError, ExampleTimeout)), (
          f"a {type(cause).__name__} was turned into {type(err).__name__}: {err}")
    message = str(err)
    assert "\n" not in message, message
    if isinstance(err, GGUFError):
      assert str(path) in message, message
      # The reader's own exception, caught by open_gguf's last resort: the header scan that
      # should have named the bad field missed a case.
      assert "corrupt or truncated GGUF (" not in message, message

# --------------------------------------------------------------- what the fuzzer found, pinned


def _lying_array(key: str, etype: int, n: int) -> bytes:
  """The base file with array `key` declared as `n` elements of type `etype`."""
  data, layout = base_file()
  data = bytearray(data)
  atype = next(f for f in layout.of("atype") if f.name == key)
  data[atype.offset:atype.offset + 4] = etype.to_bytes(4, "little")
  data[atype.offset + 4:atype.offset + 12] = n.to_bytes(8, "little")
  return bytes(data)


def _retyped(key: str, value, vtype, sub=None) -> bytes:
  return retyped_file(key, RETYPE_VALUES.index((value, vtype, sub)))[0]


FOUND = {
    # gguf.GGUFReader looped past the end of the file, one empty numpy view per element.
    "array_of_bytes_longer_than_file": (lambda: _lying_array(
        "tokenizer.ggml.merges", 0, (1 << 64) - 2), "array 'tokenizer.ggml.merges'"),
    "array_of_int32_longer_than_file": (lambda: _lying_array(
        "tokenizer.ggml.token_type", 5, 1 << 40), "array 'tokenizer.ggml.token_type'"),
    # read_gguf built a list of 2**64 layers' tensor names (MemoryError).
    "block_count_2_64": (lambda: _retyped("llama.block_count", (1 << 64) - 1, V.UINT64),
                         "block_count"),
    # len(7), hash(list): TypeError in the family and tokenizer code.
    "tokens_not_an_array": (lambda: _retyped("tokenizer.ggml.tokens", 7, V.UINT32),
                            "'tokenizer.ggml.tokens' holds a UINT32 value"),
    "pre_tokenizer_array": (lambda: _retyped("tokenizer.ggml.pre", ["a", "b"], V.ARRAY, V.STRING),
                            "'tokenizer.ggml.pre' holds an array of STRING"),
    "ffn_activation_array": (lambda: _retyped("pijax.ffn_activation", [1, 2], V.ARRAY, V.UINT32),
                             "'pijax.ffn_activation' holds an array of UINT32"),
    # An empty tensor [0, 2**62]: no bytes to bound, and numpy's reshape raised ValueError.
    "zero_dim_beside_a_huge_one": (lambda: _patched_dims("token_embd.weight", (0, 1 << 62)),
                                   "impossible dimensions"),
    # block_count <= the tensor count, but more than the blocks held: read_gguf listed every
    # layer's tensors before finding one missing (1M layers: 41 s and 3.3 GB).
    "block_count_beyond_the_blocks": (lambda: _patched("scalar", "llama.block_count", 2),
                                      "tensors for only 1 blocks"),
}


def _patched_dims(name: str, dims: tuple[int, ...]) -> bytes:
  """The base file with tensor `name`'s dimensions replaced (same count)."""
  data, layout = base_file()
  data = bytearray(data)
  fields = [f for f in layout.of("dim") if f.name == name]
  assert len(fields) == len(dims)
  for field, value in zip(fields, dims):
    data[field.offset:field.offset + field.size] = value.to_bytes(field.size, "little")
  return bytes(data)


@pytest.mark.parametrize("case", sorted(FOUND))
def test_found_cases_give_one_clear_error(tmp_path, case):
  make, needle = FOUND[case]
  path = tmp_path / f"{case}.gguf"
  path.write_bytes(make())
  with pytest.raises(GGUFError) as err:
    _guarded(_load, path)
  assert str(path) in str(err.value) and needle in str(err.value), str(err.value)

# ---------------------------------------------------------------------------------------- CLI


def _patched(field_kind: str, name: str | None, value: int) -> bytes:
  data, layout = base_file()
  data = bytearray(data)
  field = next(f for f in layout.of(field_kind) if name is None or f.name == name)
  data[field.offset:field.offset + field.size] = value.to_bytes(field.size, "little")
  return bytes(data)


def _cli_cases() -> dict[str, bytes]:
  data, layout = base_file()
  return {
      "bad_magic": b"GGUG" + data[4:],
      "truncated_header": data[:layout.data_start // 2],
      "truncated_data": data[:len(data) - 100],
      "huge_string_length": _patched("strlen", "tokenizer.ggml.tokens", (1 << 64) - 1),
      "huge_array_length": _patched("alen", "tokenizer.ggml.token_type", (1 << 63) + 5),
      "huge_tensor_dims": _patched("dim", "token_embd.weight", 1 << 40),
      "huge_kv_count": _patched("count", "kv_count", (1 << 64) - 1),
      "tensor_count_over_the_cap": _patched("count", "tensor_count", (1 << 16) + 1),
  }


@pytest.mark.parametrize("case", sorted(_cli_cases()))
def test_cli_refuses_hostile_file_in_one_line(tmp_path, case):
  path = tmp_path / f"{case}.gguf"
  path.write_bytes(_cli_cases()[case])
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, "-m", "pijax.generate", CONFIG, f"--model={path}", "--prompt=hi",
       "--max_new_tokens=1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
  lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
  assert len(lines) == 1, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  assert str(path) in lines[0], lines[0]
  assert re.match(r"pijax\.generate: ", lines[0]), lines[0]
