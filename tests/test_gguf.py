"""GGUF reading: alignment (case G3), corrupt and truncated files (G4), unsupported kinds."""

import shutil
import zlib

import gguf
import numpy as np
import pytest

from pijax.errors import GGUFError
from pijax.formats.gguf import open_gguf
from pijax.formats.loader import dequantize, load_gguf
from pijax.formats.packed import PackedBytes, StringArray

import tiny_models


def _write_plain(path, alignment):
  rng = np.random.default_rng(alignment or 0)
  arrays = {"a": rng.normal(size=(3, 5)).astype(np.float32),
            "b": rng.normal(size=(7,)).astype(np.float32),
            "c": rng.normal(size=(2, 9)).astype(np.float16)}
  w = gguf.GGUFWriter(str(path), "llama")
  if alignment is not None:
    w.add_custom_alignment(alignment)
  for name, arr in arrays.items():
    w.add_tensor(name, arr)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return arrays


@pytest.mark.parametrize("alignment", [16, 64, None])
def test_alignment_reads_back_exactly(tmp_path, alignment):
  path = tmp_path / f"align_{alignment}.gguf"
  arrays = _write_plain(path, alignment)
  reader, metadata = open_gguf(path)
  assert metadata.get("general.alignment", 32) == (alignment or 32)
  tensors = {t.name: t for t in reader.tensors}
  for name, arr in arrays.items():
    got = dequantize(tensors[name], str(path))
    np.testing.assert_array_equal(got, arr.astype(np.float32))


def _patch_alignment(path, value):
  """Overwrites the uint32 value of general.alignment in place."""
  data = bytearray(path.read_bytes())
  key = b"general.alignment"
  at = data.index(key) + len(key)
  # Then: value type (uint32 enum, 4 bytes), then the uint32 value.
  data[at + 4:at + 8] = int(value).to_bytes(4, "little")
  path.write_bytes(bytes(data))


@pytest.mark.parametrize("bad", [0, 12])
def test_bad_alignment_is_refused(tmp_path, bad):
  path = tmp_path / "bad_align.gguf"
  _write_plain(path, 16)
  _patch_alignment(path, bad)
  with pytest.raises(GGUFError) as err:
    open_gguf(path)
  assert str(path) in str(err.value)
  assert "alignment" in str(err.value) or "corrupt" in str(err.value)


def test_missing_file(tmp_path):
  with pytest.raises(GGUFError, match="no such file"):
    open_gguf(tmp_path / "nope.gguf")


def test_text_file_renamed_gguf(tmp_path):
  path = tmp_path / "notes.gguf"
  path.write_text("this is not a model\n")
  with pytest.raises(GGUFError, match="not a GGUF"):
    open_gguf(path)


def test_truncated_real_model(tmp_path, smollm2_path):
  """Case G4: the default model cut at 50% of its size."""
  src = open(smollm2_path, "rb").read()
  path = tmp_path / "half.gguf"
  path.write_bytes(src[: len(src) // 2])
  with pytest.raises(GGUFError, match="truncated") as err:
    open_gguf(path)
  assert str(path) in str(err.value)


@pytest.mark.parametrize("cut", [10, 200, 5000])
def test_truncated_header(tmp_path, smollm2_path, cut):
  with open(smollm2_path, "rb") as f:
    head = f.read(cut)
  path = tmp_path / "head.gguf"
  path.write_bytes(head)
  with pytest.raises(GGUFError) as err:
    open_gguf(path)
  assert str(path) in str(err.value)


def test_unsupported_architecture(tmp_path):
  path = tmp_path / "gpt.gguf"
  w = gguf.GGUFWriter(str(path), "gpt2")
  w.add_tensor("x", np.ones((2, 2), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(GGUFError, match="architecture 'gpt2' is not supported"):
    load_gguf(path)


def test_f16_tensors_and_directory(tmp_path):
  hf = tiny_models.make_hf_llama(seed=1)
  path = tiny_models.write_gguf(hf, tmp_path / "f16.gguf", qtype="F16")
  cfg, params, _ = load_gguf(path)
  want = hf.model.embed_tokens.weight.detach().numpy().astype(np.float16).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(params["embed"]["embedding"]), want)
  with pytest.raises(GGUFError, match="is a directory"):
    open_gguf(tmp_path)


def test_missing_tensor(tmp_path):
  hf = tiny_models.make_hf_llama(seed=2, layers=1)
  full = tiny_models.write_gguf(hf, tmp_path / "full.gguf")
  reader = gguf.GGUFReader(str(full))  # Its fields carry the value types GGUFWriter needs.
  # Rewrite the file without blk.0.ffn_up.weight.
  path = tmp_path / "missing.gguf"
  w = gguf.GGUFWriter(str(path), "llama")
  for key, field in reader.fields.items():
    if key.startswith("GGUF.") or key == "general.architecture":
      continue
    value = field.contents()
    vtype = field.types[0]
    if vtype == gguf.GGUFValueType.ARRAY:
      w.add_key_value(key, value, vtype, sub_type=field.types[-1])
    else:
      w.add_key_value(key, value, vtype)
  for t in reader.tensors:
    if t.name != "blk.0.ffn_up.weight":
      w.add_tensor(t.name, np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)]))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  shutil.copy(full, tmp_path / "unused.gguf")
  with pytest.raises(GGUFError, match="blk.0.ffn_up.weight"):
    load_gguf(path)


def _tiny_with(tmp_path, name, **overrides):
  """The tiny GGUF with some llama.* metadata replaced (written field by field)."""
  hf = tiny_models.make_hf_llama(seed=9, layers=1)
  full = tiny_models.write_gguf(hf, tmp_path / "base.gguf")
  reader = gguf.GGUFReader(str(full))  # Its fields carry the value types GGUFWriter needs.
  path = tmp_path / name
  w = gguf.GGUFWriter(str(path), "llama")
  for key, field in reader.fields.items():
    if key.startswith("GGUF.") or key == "general.architecture":
      continue
    vtype = field.types[0]
    if key in overrides:
      value, vtype = overrides[key]
      w.add_key_value(key, value, vtype)
    elif vtype == gguf.GGUFValueType.ARRAY:
      w.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1])
    else:
      w.add_key_value(key, field.contents(), vtype)
  for t in reader.tensors:
    w.add_tensor(t.name, np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)]))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


U32 = gguf.GGUFValueType.UINT32
I32 = gguf.GGUFValueType.INT32


@pytest.mark.parametrize("key,value,vtype,needle", [
    ("llama.attention.head_count", 0, U32, "head_count"),
    ("llama.attention.head_count_kv", 0, U32, "head_count_kv"),
    ("llama.embedding_length", "abc", gguf.GGUFValueType.STRING, "embedding_length"),
    ("llama.context_length", 0, U32, "context_length"),
    ("llama.context_length", -5, I32, "context_length"),
    ("llama.vocab_size", 300, U32, "vocab_size"),
])
def test_bad_hyperparameters_are_refused(tmp_path, key, value, vtype, needle):
  path = _tiny_with(tmp_path, "bad.gguf", **{key: (value, vtype)})
  with pytest.raises(GGUFError, match=needle) as err:
    load_gguf(path)
  assert str(path) in str(err.value)


def test_fifo_is_refused(tmp_path):
  import os
  path = tmp_path / "pipe.gguf"
  os.mkfifo(path)
  with pytest.raises(GGUFError, match="not a regular file"):
    open_gguf(path)


def _same_as_gguf_reader(path):
  """pijax's GGUFFile against gguf-py's GGUFReader (the oracle) on one file: every metadata
  value with its type, every tensor's name, type, shape, offset and bytes."""
  from pijax.formats.gguf import GGUFFile
  ours, theirs = GGUFFile(str(path)), gguf.GGUFReader(str(path))
  want = {}
  for key, field in theirs.fields.items():
    if key.startswith("GGUF."):  # The reader's own header pseudo-keys.
      continue
    value = field.contents()
    want[key] = value.item() if isinstance(value, np.generic) else value
    vtype, etype, n = ours.value_types[key]
    assert vtype == field.types[0] and (etype is None or etype == field.types[-1]), key
  assert ours.metadata.keys() == want.keys()
  for key, value in want.items():
    got = ours.metadata[key]
    if isinstance(value, list) and value and isinstance(value[0], str):
      # Arrays of strings are packed (one UTF-8 buffer): the same strings, in order.
      assert isinstance(got, StringArray) and len(got) == len(value), key
      assert list(got) == value and got == value and got[-1] == value[-1], key
      assert [got.raw(i) for i in (0, len(value) - 1)] == \
          [value[0].encode(), value[-1].encode()], key
    else:
      assert type(got) is type(value) and got == value, key
  assert len(ours.tensors) == len(theirs.tensors) > 0
  for a, b in zip(ours.tensors, theirs.tensors):
    assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == \
        (b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)
    assert np.array_equal(a.shape, b.shape)
    assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
    assert np.array_equal(a.data, b.data) and not a.data.flags.writeable


def test_header_reader_equals_gguf_reader_on_smollm2(smollm2_path):
  _same_as_gguf_reader(smollm2_path)


def test_header_reader_equals_gguf_reader_on_tiny_families(tmp_path):
  import tiny_families
  for family in tiny_families.FAMILIES:  # Mixed block types: Q8_0 matrices, F32 norms/biases.
    model = tiny_families.make_hf(family, seed=1)
    _same_as_gguf_reader(tiny_families.write_gguf(model, family, tmp_path / f"{family}.gguf",
                                                  qtype="Q8_0"))


def test_released_pages_read_back_the_same(smollm2_path):
  """GGUFFile.release_pages drops pages from the resident set, never data: every tensor reads
  the same bytes after a partial and a full release."""
  from pijax.formats.gguf import GGUFFile
  gf = GGUFFile(str(smollm2_path))
  before = {t.name: zlib.crc32(np.ascontiguousarray(t.data).view(np.uint8)) for t in gf.tensors}
  t = gf.tensors[3]
  gf.release_pages(t.data_offset + 100, t.n_bytes // 2)
  gf.release_pages()
  after = {t.name: zlib.crc32(np.ascontiguousarray(t.data).view(np.uint8)) for t in gf.tensors}
  assert after == before


def _write_strings(path, strings):
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_array("test.strings", strings)
  w.add_tensor("a", np.ones((2, 3), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def test_string_arrays_read_back_packed(tmp_path):
  """Random strings (ASCII, accents, CJK, emoji, empty, NUL, long) through a file: the packed
  array holds them all, in order, and costs ~their bytes + 8 per string."""
  rng = np.random.default_rng(3)
  alphabet = list("abc xyz") + ["\u00e9", "\u4e2d", "\U0001f999", "\x00", "\u2581"]
  strings = ["".join(rng.choice(alphabet, size=int(rng.integers(0, 12)))) for _ in range(500)]
  strings += ["", "x" * 5000, ""]
  path = tmp_path / "strings.gguf"
  _write_strings(path, strings)
  got = open_gguf(path)[1]["test.strings"]
  assert isinstance(got, StringArray) and len(got) == len(strings)
  assert list(got) == strings and got == strings and strings == got and got != strings[:-1]
  assert got[-3] == strings[-3] and got[10:20] == strings[10:20] and got[::-7] == strings[::-7]
  assert got.index(strings[123]) == strings.index(strings[123]) and strings[77] in got
  with pytest.raises(IndexError, match=f"index {-len(strings) - 1} out of range"):
    got[-len(strings) - 1]
  for bad in (1.0, "1", [1], None):
    with pytest.raises(TypeError, match="indices must be integers or slices"):
      got[bad]
  assert got[np.int64(5)] == strings[5]
  utf8 = sum(len(t.encode()) for t in strings)
  assert got.nbytes == utf8 + 8 * (len(strings) + 1)


def test_packed_bytes_equal_their_items():
  rng = np.random.default_rng(4)
  items = [bytes(rng.integers(0, 256, size=int(rng.integers(0, 9)), dtype=np.uint8))
           for _ in range(300)]
  packed = PackedBytes.from_iterable(iter(items))
  assert len(packed) == 300 and list(packed) == items and packed == items
  assert [packed[i] for i in (-1, 0, 151)] == [items[-1], items[0], items[151]]
  assert packed == PackedBytes.from_iterable(items) and packed != items[1:]
  assert PackedBytes.from_iterable([]) == [] and len(StringArray.from_strings([])) == 0
  with pytest.raises(TypeError):
    hash(packed)


@pytest.mark.parametrize("pieces, bad", [
    ((b"ok", b"x\xc3", b"\xa9y"), 1),  # "\xc3\xa9" (e acute) split across strings 1 and 2.
    ((b"ok", b"\xa9y"), 1),  # A string that starts inside a character.
    ((b"ok", b"", b"a\xffb"), 2),  # Not UTF-8 at all.
    ((b"ok", b"ab\xe4\xb8"), 1),  # Cut inside the last character of the array.
])
def test_string_array_that_is_not_utf8_is_refused_by_index(tmp_path, pieces, bad):
  """Each string must be UTF-8 on its own, also where the strings joined would be."""
  path = tmp_path / "bad_utf8.gguf"
  stand_ins = [bytes([ord("A") + i]) * len(p) for i, p in enumerate(pieces)]
  _write_strings(path, [s.decode() for s in stand_ins])
  data = path.read_bytes()
  for stand_in, piece in zip(stand_ins, pieces):
    if piece:
      at = data.index(len(piece).to_bytes(8, "little") + stand_in)
      data = data[:at + 8] + piece + data[at + 8 + len(piece):]
  path.write_bytes(data)
  with pytest.raises(GGUFError, match=rf"'test.strings' \(string {bad}: .* is not UTF-8"):
    open_gguf(path)
