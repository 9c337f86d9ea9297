"""Tokenizers built from a GGUF file's metadata alone (no tokenizer.json, no network).

Two kinds of vocabulary are supported, as llama.cpp names them in `tokenizer.ggml.model`:

* `"gpt2"`: byte-level BPE (GPT-2, SmolLM, Llama 3, Qwen 2, ...). Built with the `tokenizers`
  library from `tokenizer.ggml.tokens` + `tokenizer.ggml.merges`; the pre-tokenizer (the regex that
  cuts text into words before BPE) is chosen by `tokenizer.ggml.pre`, see `SUPPORTED_PRE`.
* `"llama"`: SentencePiece BPE (Llama 1/2, Mistral v1, TinyLlama, ...). A
  `sentencepiece_model_pb2.ModelProto` is built from tokens / scores / token types and run by the
  `sentencepiece` package.

Token types (`tokenizer.ggml.token_type`) follow llama.cpp and SentencePiece: 1 normal, 2 unknown,
3 control (`<|im_start|>`, `<s>`, ...), 4 user-defined, 5 unused, 6 byte (`<0x0A>`).

Special-token policy (prompt injection, case T4): `encode(text)` treats text that looks like a
control token (e.g. `"<|im_start|>"`) as plain text unless `parse_special=True`. User-defined tokens
(type 4) are always matched whole, as llama.cpp does.

Decoding is a byte concatenation: every id maps to bytes (a byte-level BPE token to its bytes, a
SentencePiece piece to its text with `▁` as a space, a byte token to its byte), the bytes are joined
and read as UTF-8. `StreamDecoder` runs the very same byte pipeline through an incremental UTF-8
decoder, so the streamed pieces joined are exactly `decode(ids)` (case T5) and a character split
over several tokens is held until it is complete (case T3).
"""

from __future__ import annotations

import codecs
import functools
import logging
import operator
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from pijax.errors import TokenizerError
from pijax.formats.packed import PackedBytes, StringArray

logger = logging.getLogger(__name__)

# llama.cpp / SentencePiece token types.
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

SUPPORTED_MODELS = ("gpt2", "llama")

# Texts of control tokens that end a turn; with eos / eot / eom they form `Tokenizer.stop_ids`.
END_OF_TURN_TEXTS = frozenset({
    "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|endoftext|>", "</s>",
    "<|end|>",
})

# Llama 3 word split (llama.cpp's LLAMA3 pre-tokenizer): numbers in groups of up to 3 digits.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen 2 word split: as Llama 3, but every digit on its own.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> (kind, regex). Kinds: "gpt2" = ByteLevel's own GPT-2 regex; "digits" = every
# \p{N} isolated, then the GPT-2 regex (llama.cpp's "smollm"); "split" = the regex, isolated, then
# ByteLevel without its own regex.
_PRE_TOKENIZERS = {
    "default": ("gpt2", None),
    "gpt2": ("gpt2", None),
    "smollm": ("digits", None),
    "llama-bpe": ("split", _LLAMA3_SPLIT),
    "llama3": ("split", _LLAMA3_SPLIT),
    "llama-v3": ("split", _LLAMA3_SPLIT),
    "qwen2": ("split", _QWEN2_SPLIT),
    "deepseek-r1-qwen": ("split", _QWEN2_SPLIT),
}
SUPPORTED_PRE = tuple(sorted(_PRE_TOKENIZERS))
# llama.cpp matches whole words against the vocabulary before merging for these (Llama 3).
_IGNORE_MERGES_PRE = frozenset({"llama-bpe", "llama3", "llama-v3"})

_SPM_SPACE = "\u2581"  # "▁", SentencePiece's visible space.
_SPM_UNK_SURFACE = " \u2047 "  # " ⁇ ", how SentencePiece renders the unknown token.


def _replace_per_byte(err: UnicodeDecodeError) -> tuple[str, int]:
  """UTF-8 error handler: one U+FFFD per invalid byte, as SentencePiece decodes byte pieces."""
  return "\ufffd" * (err.end - err.start), err.end


_PER_BYTE_ERRORS = "pijax.replace_per_byte"
codecs.register_error(_PER_BYTE_ERRORS, _replace_per_byte)


@functools.cache
def _byte_level_alphabet() -> dict[int, str]:
  """GPT-2's reversible byte -> printable character map used to spell byte-level BPE tokens.

  Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, ...) are
  spelled with the characters U+0100 onwards, in byte order (so a space is "Ġ", U+0120).
  """
  printable = ([*range(ord("!"), ord("~") + 1)] + [*range(ord("¡"), ord("¬") + 1)]
               + [*range(ord("®"), ord("ÿ") + 1)])
  table = {b: chr(b) for b in printable}
  extra = 0
  for b in range(256):
    if b not in table:
      table[b] = chr(256 + extra)
      extra += 1
  return table


def _byte_level_to_bytes(token: str, char_to_byte: Mapping[str, int]) -> bytes:
  """Bytes a byte-level BPE token spells; a token outside the byte alphabet is its own UTF-8."""
  try:
    return bytes(char_to_byte[c] for c in token)
  except KeyError:
    return token.encode("utf-8")


def _literal_union_pattern(texts: Iterable[str]) -> str:
  """A regex matching any of `texts` (leftmost, then longest), written as a prefix trie.

  A flat `a|b|...` of thousands of texts (Gemma 3 has 6,249 control tokens, mostly
  "<unusedN>") tries every alternative at every "<" of the input; the trie tries one branch.
  """
  trie: dict = {}
  for text in texts:
    node = trie
    for ch in text:
      node = node.setdefault(ch, {})
    node[""] = True  # A text ends here.

  def emit(node: dict) -> str:
    alts = []
    for ch in sorted(k for k in node if k):
      child, run = node[ch], re.escape(ch)
      while len(child) == 1 and "" not in child:  # Chains without branches stay flat.
        (nxt, child), = child.items()
        run += re.escape(nxt)
      alts.append(run + emit(child))
    if not alts:
      return ""
    body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
    # Where a text may end, the greedy `?` tries the longer texts first.
    return f"(?:{body})?" if "" in node else body

  return emit(trie)


def _get_list(metadata: Mapping[str, Any], key: str,
              length: int | None = None) -> list | StringArray | None:
  value = metadata.get(key)
  if value is None:
    return None
  if not isinstance(value, (list, tuple, StringArray)):
    raise TokenizerError(f"{key} must be an array, got {type(value).__name__}; "
                         "the file's tokenizer metadata is corrupt, re-convert the model.")
  if length is not None and len(value) != length:
    raise TokenizerError(f"{key} has {len(value)} entries but tokenizer.ggml.tokens has {length}; "
                         "the file's tokenizer metadata is corrupt, re-convert the model.")
  return value if isinstance(value, StringArray) else list(value)  # Packed: kept, not copied.


def _get_token_id(metadata: Mapping[str, Any], key: str, vocab_size: int) -> int | None:
  value = metadata.get(key)
  if value is None:
    return None
  try:
    if isinstance(value, bool):
      raise TypeError
    value = operator.index(value)  # int or a NumPy integer
  except TypeError:
    raise TokenizerError(f"{key}={value!r} is not an integer token id; "
                         "re-convert the model.") from None
  if value < 0:  # Some converters write -1 (or 0xFFFFFFFF as int32) for "none".
    return None
  if value >= vocab_size:
    raise TokenizerError(f"{key}={value} is outside the vocabulary of {vocab_size} tokens; "
                         "the file's tokenizer metadata is corrupt, re-convert the model.")
  return value


class Tokenizer:
  """Text <-> token ids for a GGUF model; build it with `from_gguf` or `from_metadata`.

  Attributes:
    model: "gpt2" (byte-level BPE) or "llama" (SentencePiece).
    pre: the pre-tokenizer name used ("smollm", "llama-bpe", ...); None for SentencePiece.
    tokens: Sequence[str] of the vocabulary as stored (byte-level spelling for gpt2): a
      `pijax.formats.packed.StringArray` when read from a file, else a tuple.
    token_types: tuple[int, ...], llama.cpp token types (see module docstring).
    vocab_size: number of tokens (len(tokens)).
    bos_id, eos_id: int | None, beginning / end of sequence ids.
    add_bos, add_eos: whether `encode(..., add_special=True)` adds BOS / EOS.
    stop_ids: frozenset[int] of ids that end generation (eos, eot, eom, and control tokens whose
      text is in `END_OF_TURN_TEXTS`).
    chat_template: str | None, the Jinja2 chat template (`tokenizer.chat_template`); see pijax.text.chat.
    special_ids: frozenset[int] of the control / unknown ids `parse_special=True` recognises.
    backend: the engine that splits plain text: a `tokenizers.Tokenizer` (gpt2; its
      `encode_special_tokens` is True, control tokens are parsed by `split_special`) or a
      `sentencepiece.SentencePieceProcessor` (llama).
  """

  def __init__(self, *, model: str, pre: str | None, tokens: Sequence[str],
               token_types: Sequence[int], bos_id: int | None, eos_id: int | None,
               add_bos: bool, add_eos: bool, stop_ids: Iterable[int], chat_template: str | None,
               piece_bytes: Sequence[bytes], add_space_prefix: bool,
               encode_text: Callable[[str], list[int]],
               utf8_errors: str, backend: Any):
    """Internal: use `from_metadata` / `from_gguf`."""
    self.model = model
    self.pre = pre
    # A file's vocabulary stays packed (one UTF-8 buffer; a tuple of str took ~60 bytes a token).
    self.tokens = tokens if isinstance(tokens, StringArray) else tuple(tokens)
    self.token_types = tuple(token_types)
    self.vocab_size = len(self.tokens)
    self.bos_id = bos_id
    self.eos_id = eos_id
    self.add_bos = add_bos
    self.add_eos = add_eos
    self.stop_ids = frozenset(stop_ids)
    self.chat_template = chat_template
    # piece_bytes[i]: the bytes token i stands for when decoding.
    self._piece_bytes = (piece_bytes if isinstance(piece_bytes, PackedBytes)
                         else tuple(piece_bytes))
    # SentencePiece's dummy prefix: decoding drops the leading space of the first text piece.
    self._strip_first_space = add_space_prefix
    self._encode_text = encode_text  # str -> list[int], no special-token parsing.
    self.backend = backend
    self._utf8_errors = utf8_errors
    # Tokens `parse_special=True` recognises in text: control and unknown ones (as llama.cpp).
    self.special_ids = frozenset(
        i for i, t in enumerate(self.token_types) if t in (TOKEN_CONTROL, TOKEN_UNKNOWN))
    self._special_by_text = {}
    for i in sorted(self.special_ids):
      self._special_by_text.setdefault(self.tokens[i], i)
    # Leftmost match, longest token first at a position (like tokenizers' LeftmostLongest).
    texts = [t for t in self._special_by_text if t]
    self._special_re = re.compile(_literal_union_pattern(texts)) if texts else None

  # ----------------------------------------------------------------------------------- building

  @classmethod
  def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer of a GGUF file. Raises GGUFError (bad file) or TokenizerError (bad vocab)."""
    from pijax.formats.gguf import read_metadata
    return cls.from_metadata(read_metadata(path))

  @classmethod
  def from_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
    """Builds the tokenizer a GGUF's metadata describes.

    Args:
      metadata: {key: value} as returned by `pijax.formats.gguf.read_metadata`; only `tokenizer.*` keys
        are used.

    Returns:
      A `Tokenizer`.

    Raises:
      TokenizerError: missing or inconsistent tokenizer metadata, or a tokenizer model or
        pre-tokenizer pijax does not support (the message names it and lists the supported ones).
    """
    model = metadata.get("tokenizer.ggml.model")
    if model is None:
      raise TokenizerError("the GGUF has no tokenizer.ggml.model, so it carries no tokenizer; "
                           "re-convert the model with llama.cpp's convert_hf_to_gguf.py.")
    if model not in SUPPORTED_MODELS:
      raise TokenizerError(f"tokenizer model {model!r} (tokenizer.ggml.model) is not supported; "
                           f"pijax supports {', '.join(map(repr, SUPPORTED_MODELS))}.")
    tokens = _get_list(metadata, "tokenizer.ggml.tokens")
    if not tokens:
      raise TokenizerError("the GGUF has no tokenizer.ggml.tokens (empty vocabulary); "
                           "re-convert the model.")
    n = len(tokens)
    if not isinstance(tokens, StringArray) and not all(isinstance(t, str) for t in tokens):
      raise TokenizerError("tokenizer.ggml.tokens holds non-string entries; re-convert the model.")
    types = _get_list(metadata, "tokenizer.ggml.token_type", n) or [TOKEN_NORMAL] * n
    types = [t if t in (1, 2, 3, 4, 5, 6) else TOKEN_NORMAL for t in types]  # 0 = undefined.
    bos_id = _get_token_id(metadata, "tokenizer.ggml.bos_token_id", n)
    eos_id = _get_token_id(metadata, "tokenizer.ggml.eos_token_id", n)
    # llama.cpp's defaults: a SentencePiece vocabulary adds BOS, a byte-level BPE one does not.
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", model == "llama"))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    for flag, name, tid in ((add_bos, "bos", bos_id), (add_eos, "eos", eos_id)):
      if flag and tid is None:
        raise TokenizerError(f"tokenizer.ggml.add_{name}_token is true but the file has no "
                             f"tokenizer.ggml.{name}_token_id; re-convert the model.")
    stop = {i for i in (eos_id,
                        _get_token_id(metadata, "tokenizer.ggml.eot_token_id", n),
                        _get_token_id(metadata, "tokenizer.ggml.eom_token_id", n)) if i is not None}
    stop |= {i for i, typ in enumerate(types)
             if typ == TOKEN_CONTROL and tokens[i] in END_OF_TURN_TEXTS}
    chat_template = metadata.get("tokenizer.chat_template")
    common = dict(model=model, tokens=tokens, token_types=types, bos_id=bos_id, eos_id=eos_id,
                  add_bos=add_bos, add_eos=add_eos, stop_ids=stop,
                  chat_template=chat_template if isinstance(chat_template, str) else None)
    if model == "gpt2":
      return cls(**common, **_build_byte_level_bpe(metadata, tokens, types))
    return cls(**common, **_build_sentencepiece(metadata, tokens, types))

  # ----------------------------------------------------------------------------------- encoding

  def encode(self, text: str, *, add_special: bool = True,
             parse_special: bool = False) -> list[int]:
    """Token ids of `text`.

    Args:
      text: the text to encode.
      add_special: add BOS / EOS as the file says (`add_bos` / `add_eos`). BOS (EOS) is not added
        again when the text itself starts (ends) with it and `parse_special` is True, so a prompt
        that already holds "<s>" never gets a double BOS.
      parse_special: False (default): text that looks like a control token, e.g. "<|im_start|>", is
        encoded as plain text (safe for user input). True: control and unknown tokens written in the
        text become their ids (for prompts built by a chat template; see `pijax.text.chat.encode_chat`).

    Returns:
      list[int] of token ids. An empty `text` gives `[]` on a model that adds no BOS (e.g. SmolLM2)
      and `[bos_id]` on one that does; the engine refuses an empty prompt with a clear error.
    """
    if not isinstance(text, str):
      raise TypeError(f"encode() takes a str, got {type(text).__name__}")
    if parse_special:
      fragments = self.split_special(text)
    else:
      fragments = [text] if text else []
    return self.encode_fragments(fragments, add_special=add_special)

  def split_special(self, text: str) -> list[str | int]:
    """Cuts `text` at control / unknown token texts: plain text pieces (str) and token ids (int)."""
    if self._special_re is None:
      return [text] if text else []
    out: list[str | int] = []
    pos = 0
    for m in self._special_re.finditer(text):
      if m.start() > pos:
        out.append(text[pos:m.start()])
      out.append(self._special_by_text[m.group()])
      pos = m.end()
    if pos < len(text):
      out.append(text[pos:])
    return out

  def encode_fragments(self, fragments: Iterable[str | int], *,
                       add_special: bool = True) -> list[int]:
    """Encodes a sequence of plain-text pieces (str, no special parsing) and token ids (int).

    Each text piece is tokenized on its own (as llama.cpp does between special tokens: for
    SentencePiece each piece gets the dummy-prefix space). BOS / EOS as in `encode`.
    """
    ids: list[int] = []
    for frag in fragments:
      if isinstance(frag, str):
        if frag:
          ids.extend(self._encode_text(frag))
      else:
        tid = int(frag)
        self._check_id(tid)
        ids.append(tid)
    if add_special:
      if self.add_bos and not (ids and ids[0] == self.bos_id):
        ids.insert(0, self.bos_id)
      if self.add_eos and not (ids and ids[-1] == self.eos_id):
        ids.append(self.eos_id)
    return ids

  # ----------------------------------------------------------------------------------- decoding

  def _check_id(self, token_id: int) -> None:
    if not 0 <= token_id < self.vocab_size:
      raise TokenizerError(f"token id {token_id} is outside the vocabulary "
                           f"[0, {self.vocab_size}); mask padded logits before sampling.")

  def _bytes_of(self, token_id: int, skip_special: bool, strip_pending: bool) -> tuple[bytes, bool]:
    """(bytes of one token, whether the dummy-prefix space is still to be dropped)."""
    token_id = int(token_id)
    self._check_id(token_id)
    typ = self.token_types[token_id]
    if typ == TOKEN_CONTROL:
      # Control tokens are invisible to the dummy-prefix rule (as in SentencePiece).
      return (b"" if skip_special else self._piece_bytes[token_id]), strip_pending
    data = self._piece_bytes[token_id]
    if strip_pending and typ in (TOKEN_NORMAL, TOKEN_USER_DEFINED, TOKEN_UNUSED):
      if data.startswith(b" ") and self.tokens[token_id].startswith(_SPM_SPACE):
        data = data[1:]
    return data, False

  def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
    """Text of token ids.

    Args:
      ids: token ids (ints, or a 1-D integer array).
      skip_special: drop control tokens (BOS, "<|im_end|>", ...); False writes their text.

    Returns:
      The text. Invalid or incomplete UTF-8 (a generation cut mid-character) shows as U+FFFD.
      For SentencePiece the leading space of the first word (the dummy prefix) is dropped.

    Raises:
      TokenizerError: an id outside [0, vocab_size).
    """
    strip = self._strip_first_space
    chunks = []
    for tid in ids:
      data, strip = self._bytes_of(tid, skip_special, strip)
      chunks.append(data)
    return b"".join(chunks).decode("utf-8", self._utf8_errors)

  def stream(self, *, skip_special: bool = True, context: Iterable[int] = ()) -> StreamDecoder:
    """A `StreamDecoder` for detokenizing generated ids one at a time.

    Args:
      skip_special: as in `decode`.
      context: ids that precede the streamed ones (e.g. the prompt); they are consumed silently so
        the first streamed token is decoded in context (SentencePiece keeps its leading space).
        Without context the pieces joined equal `decode(streamed_ids)` exactly.
    """
    dec = StreamDecoder(self, skip_special=skip_special)
    for tid in context:
      dec.push(tid)
    return dec

  def token_bytes(self, token_id: int) -> bytes:
    """The bytes one id stands for (its text in UTF-8; special tokens give their own text)."""
    self._check_id(int(token_id))
    return self._piece_bytes[int(token_id)]

  def token_text(self, token_id: int) -> str:
    """The vocabulary entry of one id as stored in the file (byte-level spelling for gpt2)."""
    self._check_id(int(token_id))
    return self.tokens[int(token_id)]

  def __repr__(self) -> str:
    return (f"Tokenizer(model={self.model!r}, pre={self.pre!r}, vocab_size={self.vocab_size}, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id}, add_bos={self.add_bos})")


class StreamDecoder:
  """Incremental detokenizer: `push` one id at a time, `flush` once at the end.

  It runs the same byte pipeline as `Tokenizer.decode` through an incremental UTF-8 decoder, so
  `"".join(pushes) + flush()` equals `decode(ids)` exactly. A character split over several tokens is
  held back until complete: `push` never returns half a character (case T3: "🦙" = 3 tokens streams
  as "", "", "🦙").
  """

  def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True):
    self._tok = tokenizer
    self._skip_special = skip_special
    self._strip = tokenizer._strip_first_space
    self._utf8 = codecs.getincrementaldecoder("utf-8")(errors=tokenizer._utf8_errors)
    self.ids: list[int] = []

  def push(self, token_id: int) -> str:
    """Adds one id; returns the text it completes ("" while a character is incomplete)."""
    data, self._strip = self._tok._bytes_of(token_id, self._skip_special, self._strip)
    self.ids.append(int(token_id))
    return self._utf8.decode(data)

  def flush(self) -> str:
    """Returns the held bytes once (U+FFFD for an incomplete character), then ""."""
    return self._utf8.decode(b"", final=True)


# --------------------------------------------------------------------------------- builders


def _build_byte_level_bpe(metadata: Mapping[str, Any], tokens: list[str],
                          types: list[int]) -> dict[str, Any]:
  """Byte-level BPE (`tokenizer.ggml.model == "gpt2"`) with the `tokenizers` library."""
  from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
  from tokenizers import Tokenizer as HFTokenizer

  merges_raw = _get_list(metadata, "tokenizer.ggml.merges")
  if not merges_raw:
    raise TokenizerError("a byte-level BPE vocabulary (tokenizer.ggml.model 'gpt2') needs "
                         "tokenizer.ggml.merges, which the file lacks; re-convert the model.")
  merges = []
  for k, merge in enumerate(merges_raw):
    parts = merge.split(" ") if isinstance(merge, str) else ()
    if len(parts) != 2:
      raise TokenizerError(f"tokenizer.ggml.merges[{k}]={merge!r} is not two tokens separated by "
                           "one space; the file's tokenizer metadata is corrupt.")
    merges.append((parts[0], parts[1]))

  pre = metadata.get("tokenizer.ggml.pre")
  if pre is None:
    logger.warning("the GGUF has no tokenizer.ggml.pre; using the GPT-2 pre-tokenizer, which may "
                   "split text differently from the model's own tokenizer.")
    pre = "gpt2"
  if pre not in _PRE_TOKENIZERS:
    raise TokenizerError(f"pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; pijax "
                         f"supports {', '.join(SUPPORTED_PRE)}.")
  kind, split = _PRE_TOKENIZERS[pre]

  vocab: dict[str, int] = {}
  for i, tok in enumerate(tokens):
    vocab.setdefault(tok, i)
  try:
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                     ignore_merges=pre in _IGNORE_MERGES_PRE)
  except Exception as err:  # tokenizers raises Exception subclasses for bad merges.
    raise TokenizerError(f"cannot build the BPE model from tokenizer.ggml.tokens/merges: {err}; "
                         "the file's tokenizer metadata is corrupt.") from None
  backend = HFTokenizer(bpe)
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True, trim_offsets=False)
  if kind == "gpt2":
    backend.pre_tokenizer = byte_level
  elif kind == "digits":
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level])
  else:
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False),
    ])
  backend.decoder = decoders.ByteLevel()
  specials = [AddedToken(tokens[i], special=True, normalized=False)
              for i, t in enumerate(types)
              if t in (TOKEN_CONTROL, TOKEN_UNKNOWN) and vocab.get(tokens[i]) == i and tokens[i]]
  user = [AddedToken(tokens[i], special=False, normalized=False)
          for i, t in enumerate(types)
          if t == TOKEN_USER_DEFINED and vocab.get(tokens[i]) == i and tokens[i]]
  backend.add_special_tokens(specials)
  backend.add_tokens(user)
  # Control tokens are parsed by Tokenizer.split_special (only when asked); the backend always
  # treats their text as plain text. User-defined tokens stay matched whole.
  backend.encode_special_tokens = True

  char_to_byte = {c: b for b, c in _byte_level_alphabet().items()}
  piece_bytes = PackedBytes.from_iterable(
      tok.encode("utf-8") if typ in (TOKEN_CONTROL, TOKEN_USER_DEFINED)
      else _byte_level_to_bytes(tok, char_to_byte) for tok, typ in zip(tokens, types))

  def encode_text(text: str) -> list[int]:
    return backend.encode(text, add_special_tokens=False).ids

  return dict(pre=pre, piece_bytes=piece_bytes, add_space_prefix=False, encode_text=encode_text,
              utf8_errors="replace", backend=backend)


def _build_sentencepiece(metadata: Mapping[str, Any], tokens: list[str],
                         types: list[int]) -> dict[str, Any]:
  """SentencePiece BPE (`tokenizer.ggml.model == "llama"`) with the `sentencepiece` package."""
  import sentencepiece
  from sentencepiece import sentencepiece_model_pb2 as pb

  tokens = list(tokens)  # Decoded once for the passes below; freed when the build returns.
  n = len(tokens)
  scores = _get_list(metadata, "tokenizer.ggml.scores", n) or [0.0] * n
  # SentencePiece needs exactly one unknown piece. Gemma 3 files type "<unk>" as control (3) and
  # name it in tokenizer.ggml.unknown_token_id; the proto then types that piece as unknown (the
  # Tokenizer keeps the file's types, so decoding treats it as llama.cpp does: a control token).
  unk_id = _get_token_id(metadata, "tokenizer.ggml.unknown_token_id", n)
  if unk_id is None and TOKEN_UNKNOWN in types:
    unk_id = types.index(TOKEN_UNKNOWN)
  if unk_id is None:
    raise TokenizerError("the SentencePiece vocabulary has no unknown token (no token_type 2 and "
                         "no tokenizer.ggml.unknown_token_id); the file's tokenizer metadata is "
                         "incomplete, re-convert the model.")
  add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
  byte_values = {int(m.group(1), 16) for i, typ in enumerate(types) if typ == TOKEN_BYTE
                 for m in [re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", tokens[i])] if m}
  # SentencePiece accepts byte pieces only as a full set of 256 (byte fallback). A partial set is
  # registered as unused pieces: never produced by encoding, still decoded as bytes below.
  byte_fallback = len(byte_values) == 256
  if TOKEN_BYTE in types and not byte_fallback:
    logger.warning("the SentencePiece vocabulary has %d of the 256 byte tokens; byte fallback "
                   "is off, characters outside the vocabulary encode as <unk>.", len(byte_values))
  # User-defined tokens are matched whole in the raw text (llama.cpp, transformers). SentencePiece
  # matches them after escaping " " to "▁", so a GGUF user-defined token holding spaces (Gemma's
  # runs "  " .. 31 spaces) is registered with "▁" for " ", unless that spelling is taken.
  spaced = {tokens[i].replace(" ", _SPM_SPACE) for i, typ in enumerate(types)
            if typ == TOKEN_USER_DEFINED and " " in tokens[i]}
  taken = {tok for tok in tokens if tok in spaced} if spaced else set()  # Spellings in use.
  proto = pb.ModelProto()
  for i, (tok, score, typ) in enumerate(zip(tokens, scores, types)):
    if i == unk_id:
      typ = TOKEN_UNKNOWN
    elif typ == TOKEN_UNKNOWN:  # A second unknown piece: SentencePiece refuses it.
      typ = TOKEN_CONTROL
    elif typ == TOKEN_BYTE and not byte_fallback:
      typ = TOKEN_UNUSED
    elif typ == TOKEN_USER_DEFINED and " " in tok:
      escaped = tok.replace(" ", _SPM_SPACE)
      if escaped not in taken:
        taken.add(escaped)
        tok = escaped
    piece = proto.pieces.add()
    piece.piece = tok
    piece.score = float(score)
    piece.type = typ
  proto.trainer_spec.model_type = pb.TrainerSpec.BPE
  proto.trainer_spec.vocab_size = n
  proto.trainer_spec.byte_fallback = byte_fallback
  proto.trainer_spec.unk_surface = _SPM_UNK_SURFACE
  proto.normalizer_spec.name = "identity"
  proto.normalizer_spec.add_dummy_prefix = add_space_prefix
  proto.normalizer_spec.remove_extra_whitespaces = False
  proto.normalizer_spec.escape_whitespaces = True
  sp = sentencepiece.SentencePieceProcessor()
  try:
    sp.LoadFromSerializedProto(proto.SerializeToString())
  except Exception as err:  # sentencepiece raises RuntimeError/OSError with its own message.
    raise TokenizerError(f"cannot build the SentencePiece model from tokenizer.ggml.tokens/scores/"
                         f"token_type: {err}; the file's tokenizer metadata is corrupt.") from None

  def piece(tok: str, typ: int) -> bytes:
    if typ == TOKEN_BYTE:
      m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", tok)
      return bytes([int(m.group(1), 16)]) if m else tok.encode("utf-8")
    if typ == TOKEN_UNKNOWN:
      return _SPM_UNK_SURFACE.encode("utf-8")
    if typ == TOKEN_CONTROL:
      return tok.encode("utf-8")
    return tok.replace(_SPM_SPACE, " ").encode("utf-8")

  piece_bytes = PackedBytes.from_iterable(piece(tok, typ) for tok, typ in zip(tokens, types))

  def encode_text(text: str) -> list[int]:
    return sp.encode(text, out_type=int)

  return dict(pre=None, piece_bytes=piece_bytes, add_space_prefix=add_space_prefix,
              encode_text=encode_text, utf8_errors=_PER_BYTE_ERRORS, backend=sp)
