"""pijax.grammar (response_format / logit_bias as a per-row sampling bias) and the engine under
it: masks on the default model's tokenizer (no weights read), and generation on tiny models."""

import json

import numpy as np
import pytest

from pijax import grammar as grammar_lib
from pijax.errors import ConfigError, GrammarError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


def check_schema(value, schema=SCHEMA) -> None:
  """Asserts that `value` validates against SCHEMA (the keywords it uses)."""
  assert isinstance(value, dict) and set(schema["required"]) <= set(value)
  assert set(value) <= set(schema["properties"])
  props = schema["properties"]
  assert isinstance(value["name"], str) and len(value["name"]) <= props["name"]["maxLength"]
  assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
  assert value["role"] in props["role"]["enum"]
  if "tags" in value:
    assert len(value["tags"]) <= 3 and all(isinstance(t, bool) for t in value["tags"])


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
  from pijax.text.tokenizer import Tokenizer
  return Tokenizer.from_gguf(smollm2_path)


def _allowed(constraint) -> np.ndarray:
  return np.flatnonzero(np.isfinite(constraint.bias()))


def _random_walk(tokenizer, grammar, seed: int, limit: int = 400) -> tuple[str, list[int]]:
  """Draws uniformly among the allowed tokens until a stop token: (text, ids)."""
  rng = np.random.default_rng(seed)
  c = grammar_lib.Constraint(grammar.vocab_size, grammar)
  ids = []
  for _ in range(limit):
    allowed = _allowed(c)
    assert allowed.size, "a live grammar always allows a token"
    token = int(rng.choice(allowed))
    if token in tokenizer.stop_ids:
      return tokenizer.decode(ids), ids
    c.advance(token)
    ids.append(token)
  raise AssertionError(f"no end after {limit} tokens: {tokenizer.decode(ids)!r}")


def test_json_object_mask_starts_with_a_brace_and_ends_with_eos_only(tokenizer):
  g = grammar_lib.response_format_grammar(tokenizer, {"type": "json_object"})
  c = grammar_lib.Constraint(tokenizer.vocab_size, g)
  first = _allowed(c)
  assert first.size and all(tokenizer.token_bytes(t).startswith(b"{") for t in first)
  assert not set(first) & tokenizer.stop_ids  # No empty reply.
  text = '{"a": [1, 2.5, "x\\n"], "b": {"c": null, "d": true}}'
  for t in tokenizer.encode(text, add_special=False):
    assert np.isfinite(c.bias()[t])
    c.advance(t)
  assert c.done
  assert set(_allowed(c)) == set(tokenizer.stop_ids)  # Complete: only the end may follow.


def test_special_tokens_never_spell_json_text(tokenizer):
  g = grammar_lib.response_format_grammar(tokenizer, {"type": "json_object"})
  c = grammar_lib.Constraint(tokenizer.vocab_size, g)
  for t in tokenizer.encode('{"key": "va', add_special=False):
    c.advance(t)
  allowed = set(_allowed(c))
  assert not allowed & set(tokenizer.special_ids)  # <|im_start|>, <|im_end|>, ... inside a string.


def test_whitespace_between_json_tokens_is_bounded(tokenizer):
  g = grammar_lib.response_format_grammar(tokenizer, {"type": "json_object"})
  c = grammar_lib.Constraint(tokenizer.vocab_size, g)
  c.advance(tokenizer.encode("{", add_special=False)[0])
  space = tokenizer.encode(" ", add_special=False)
  assert len(space) == 1
  for _ in range(grammar_lib.MAX_JSON_WHITESPACE):
    assert np.isfinite(c.bias()[space[0]])
    c.advance(space[0])
  assert not np.isfinite(c.bias()[space[0]])  # No endless run of whitespace.


@pytest.mark.parametrize("seed", range(6))
def test_any_walk_the_schema_allows_parses_and_validates(tokenizer, seed):
  """Whatever tokens are drawn (uniformly among the allowed ones), the text is valid."""
  g = grammar_lib.response_format_grammar(
      tokenizer, {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
  text, _ = _random_walk(tokenizer, g, seed)
  check_schema(json.loads(text))


@pytest.mark.parametrize("response_format, words", [
    ({"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "strin"}}},
     ["json_schema 'bad'", "strin"]),
    ({"type": "json_schema", "json_schema": {"name": "ref", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}},
     ["json_schema 'ref'", "missing"]),
    ({"type": "json_schema", "json_schema": {"schema": [1, 2]}}, ["json_schema", "list"]),
    ({"type": "json_schema"}, ["json_schema"]),
    ({"type": "xml"}, ["'xml'", "json_object"]),
    ("json", ["response_format"]),
])
def test_bad_response_formats_raise_grammar_error(tokenizer, response_format, words):
  with pytest.raises(GrammarError) as err:
    grammar_lib.response_format_grammar(tokenizer, response_format)
  assert isinstance(err.value, ConfigError)  # CLIs: one line, exit 2; the server: 400.
  for word in words:
    assert word in str(err.value), (word, str(err.value))


def test_text_response_format_is_no_constraint(tokenizer):
  assert grammar_lib.response_format_grammar(tokenizer, {"type": "text"}) is None
  assert grammar_lib.make_constraint(tokenizer, tokenizer.vocab_size,
                                     response_format={"type": "text"}) is None


@pytest.mark.parametrize("bias, words", [
    ({"49152": 1}, ["49152", "[0, 49152)"]),
    ({"-1": 1}, ["-1"]),
    ({"x": 1}, ["'x'"]),
    ({"5": 101}, ["logit_bias['5']=101", "[-100, 100]"]),
    ({5: float("nan")}, ["nan"]),
    ({5: True}, ["True"]),
    ([5], ["list"]),
])
def test_bad_logit_bias_is_refused_by_name(bias, words):
  with pytest.raises(ConfigError) as err:
    grammar_lib.check_logit_bias(bias, 49152)
  assert "logit_bias" in str(err.value)
  for word in words:
    assert word in str(err.value)


def test_logit_bias_keys_may_be_strings():
  assert grammar_lib.check_logit_bias({"7": -100, 9: 2.5}, 10) == {7: -100.0, 9: 2.5}


def test_fill_biases_gives_each_row_its_own_mask(tokenizer):
  """Rows of a batch: a grammar, none, a logit_bias only, the same grammar further on. The
  batched (parallel) fill equals each row's own bias."""
  g = grammar_lib.response_format_grammar(tokenizer, {"type": "json_object"})
  v = tokenizer.vocab_size
  further = grammar_lib.Constraint(v, g, {5: 3.0})
  for t in tokenizer.encode('{"a": ', add_special=False):
    further.advance(t)
  rows = [grammar_lib.Constraint(v, g), None, grammar_lib.Constraint(v, None, {7: -2.0}),
          further]
  out = grammar_lib.fill_biases(rows, np.full((4, v), 9.0, np.float32))
  for i, row in enumerate(rows):
    want = np.zeros(v, np.float32) if row is None else row.bias()
    np.testing.assert_array_equal(out[i], want)
  assert not np.array_equal(np.isfinite(out[0]), np.isfinite(out[3]))
  assert out[2, 7] == -2.0 and np.isfinite(out[2]).all()
  # A logit_bias inside a grammar adds to the allowed tokens and leaves the others at -inf.
  assert out[3, 5] in (3.0, -np.inf)
  with pytest.raises(ValueError, match="f32"):
    grammar_lib.fill_biases(rows, np.zeros((3, v), np.float32))


def test_lark_grammar(tokenizer):
  g = grammar_lib.lark_grammar(tokenizer, 'start: "yes" | "no"')
  for seed in range(4):
    text, _ = _random_walk(tokenizer, g, seed)
    assert text in ("yes", "no")
  with pytest.raises(GrammarError, match="Lark"):
    grammar_lib.lark_grammar(tokenizer, "start: undefined_rule")


# ------------------------------------------------------------------ the engine (tiny models)
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """A tiny Llama (vocabulary "a", "b", "ab", "<t3>"...; "b" is the end-of-sequence token) on
  Q8_0 blocks: (XLA model, host-backend model)."""
  import pijax
  from pijax.backends import host as host_backend
  from tiny_models import make_hf_llama, write_gguf
  path = write_gguf(make_hf_llama(), tmp_path_factory.mktemp("tiny") / "tiny.gguf",
                    qtype="Q8_0")
  xla = pijax.load(str(path), max_seq_len=64)
  host = pijax.load(str(path), max_seq_len=64)
  host.use_backend(host_backend.build(host.config, host.path, "gguf"))
  return xla, host


PROMPT = [5, 9, 17, 3]


@pytest.mark.parametrize("backend", ["xla", "host"])
def test_unconstrained_runs_are_unchanged_by_constrained_ones(tiny, backend):
  """A run without a constraint reuses its executables and gives the same tokens after a
  constrained run compiled its own."""
  model = tiny[backend == "host"]
  plain = model.generate(PROMPT, max_new_tokens=8, temperature=0.8, seed=4).token_ids
  executables = dict(model._compiled)
  model.generate(PROMPT, max_new_tokens=8, temperature=0.8, seed=4, logit_bias={7: 5.0})
  again = model.generate(PROMPT, max_new_tokens=8, temperature=0.8, seed=4).token_ids
  assert again == plain
  for key, exe in executables.items():
    assert model._compiled[key] is exe
  assert len(model._compiled) > len(executables)  # The biased steps are separate.


@pytest.mark.parametrize("backend", ["xla", "host"])
def test_logit_bias_forces_and_bans_tokens(tiny, backend):
  model = tiny[backend == "host"]
  greedy = model.generate(PROMPT, max_new_tokens=6, temperature=0).token_ids
  forced = model.generate(PROMPT, max_new_tokens=6, temperature=0, logit_bias={"42": 100})
  assert forced.token_ids == [42] * 6
  banned = model.generate(PROMPT, max_new_tokens=6, temperature=0,
                          logit_bias={greedy[0]: -100}).token_ids
  assert banned[0] != greedy[0]
  sampled = model.generate(PROMPT, max_new_tokens=6, temperature=1.0, seed=1,
                           logit_bias={42: 100}).token_ids
  assert sampled == [42] * 6


@pytest.mark.parametrize("backend", ["xla", "host"])
def test_grammar_run_ends_when_the_grammar_is_complete(tiny, backend):
  """Lark `start: "a" "a" "a"` at a high temperature: three "a" tokens, then the
  end-of-sequence token ("b", id 1), whatever the model prefers."""
  model = tiny[backend == "host"]
  g = grammar_lib.lark_grammar(model.tokenizer, 'start: "a" "a" "a"',
                               vocab_size=model.config.vocab_size)
  for seed in range(3):
    r = model.generate(PROMPT, max_new_tokens=20, temperature=1.5, seed=seed,
                       response_format=g)
    assert r.token_ids == [0, 0, 0, 1] and r.stop_reason == "eos"
    assert r.text == "aaa"
  steps = list(model.generate_ids(PROMPT, max_new_tokens=20, response_format=g))
  assert [s.token_id for s in steps] == [0, 0, 0, 1, -1]


def test_grammar_of_another_vocabulary_is_refused(tiny, tokenizer):
  g = grammar_lib.response_format_grammar(tokenizer, {"type": "json_object"})
  with pytest.raises(ConfigError, match="vocabulary"):
    tiny[0].generate(PROMPT, max_new_tokens=2, response_format=g)
