"""Compact read-only sequences of byte strings and text: one buffer plus offsets.

A vocabulary of n entries held as a Python list costs one object per entry (~50-80 bytes for a
short str or bytes, plus 8 for the list slot); Gemma 3's 262,144 tokens took ~44 MB as metadata
lists and ~15 MB more as decoded piece bytes. Packed, the same entries cost their UTF-8 bytes
plus 8 bytes of offset each (~3.6 MB for Gemma 3). Items are sliced (and decoded) on access.
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any


class PackedBytes(Sequence):
  """An immutable sequence of `bytes` stored as one buffer and int64 offsets.

  `packed[i]` is `blob[offsets[i]:offsets[i + 1]]`; slicing gives a list. Equal to any sequence
  (not a str / bytes) holding the same items in order.
  """

  __slots__ = ("_blob", "_offsets")

  def __init__(self, blob: bytes | bytearray, offsets: array):
    """Internal: use `from_iterable`. blob: the items' bytes back to back (not modified later);
    offsets: array('q') of len(items) + 1, starting at 0."""
    self._blob = blob
    self._offsets = offsets

  @classmethod
  def from_iterable(cls, items: Iterable[bytes]) -> PackedBytes:
    """Packs `items` (bytes-like) without keeping them: each is copied into the buffer."""
    blob, offsets = bytearray(), array("q", [0])
    for item in items:
      blob += item
      offsets.append(len(blob))
    return cls(bytes(blob), offsets)

  def raw(self, index: int) -> bytes:
    """The stored bytes of item `index` (negative counts from the end). Raises IndexError."""
    n = len(self._offsets) - 1
    i = index + n if index < 0 else index
    if not 0 <= i < n:
      raise IndexError(f"index {index} out of range for {n} items")
    item = self._blob[self._offsets[i]:self._offsets[i + 1]]
    return item if type(item) is bytes else bytes(item)

  def _item(self, raw: bytes) -> Any:
    return raw

  def __len__(self) -> int:
    return len(self._offsets) - 1

  def __getitem__(self, index):
    if isinstance(index, slice):
      return [self[i] for i in range(*index.indices(len(self)))]
    try:
      i = operator.index(index)
    except TypeError:
      raise TypeError(f"{type(self).__name__} indices must be integers or slices, not "
                      f"{type(index).__name__}") from None
    return self._item(self.raw(i))

  def __iter__(self) -> Iterator:
    blob, offsets, item = self._blob, self._offsets, self._item
    whole = type(blob) is bytes
    for i in range(len(offsets) - 1):
      raw = blob[offsets[i]:offsets[i + 1]]
      yield item(raw if whole else bytes(raw))

  def __eq__(self, other: object) -> bool:
    if type(other) is type(self):
      return self._blob == other._blob and self._offsets == other._offsets
    if isinstance(other, (str, bytes, bytearray)) or not isinstance(other, Sequence):
      return NotImplemented
    return len(self) == len(other) and all(a == b for a, b in zip(self, other))

  __hash__ = None  # Compared by value, like a list.

  @property
  def nbytes(self) -> int:
    """Bytes held: the buffer and the offsets."""
    return len(self._blob) + self._offsets.itemsize * len(self._offsets)

  def __repr__(self) -> str:
    head = ", ".join(repr(self[i]) for i in range(min(len(self), 3)))
    more = ", ..." if len(self) > 3 else ""
    return f"{type(self).__name__}([{head}{more}], n={len(self)})"


class StringArray(PackedBytes):
  """An immutable sequence of `str`, stored as UTF-8 in one buffer (a GGUF string array).

  The buffer must be valid UTF-8 at every item boundary (`pijax.formats.gguf` checks that when
  it reads a file); `raw(i)` gives item i's UTF-8 bytes without decoding.
  """

  __slots__ = ()

  @classmethod
  def from_strings(cls, items: Iterable[str]) -> StringArray:
    """Packs `items` (str) as UTF-8."""
    packed = PackedBytes.from_iterable(s.encode("utf-8") for s in items)
    return cls(packed._blob, packed._offsets)

  def _item(self, raw: bytes) -> str:
    return raw.decode("utf-8")
