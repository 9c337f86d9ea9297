"""Pieces the server and the chat REPL stand on: stop strings, OpenAI penalties, sessions."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pijax.errors import ConfigError
from pijax.generation import StopStrings
from pijax.sampling import apply_presence_frequency_penalty, make_sampling_params, sample


def _reference_cut(text, stops):
  """Where token-by-token generation stops: at the first stop string to complete (of two
  completing together, the one that starts first)."""
  ends = [(text.find(s) + len(s), text.find(s)) for s in stops if s and s in text]
  return (text[:min(ends)[1]], True) if ends else (text, False)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc \n", max_size=40),
       stops=st.lists(st.text(alphabet="abc \n", min_size=1, max_size=5), max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=12))
def test_stop_strings_match_a_reference_for_any_split(text, stops, cuts):
  bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
  pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
  matcher = StopStrings(stops)
  out = []
  for piece in pieces:
    out.append(matcher.push(piece))
    if matcher.stopped:
      break
  out.append(matcher.flush())
  expected, stopped = _reference_cut(text, stops)
  assert "".join(out) == expected
  assert matcher.stopped == stopped


@pytest.mark.parametrize("pieces", [["aaba"], ["aab", "a"], ["a", "a", "b", "a"]])
def test_the_first_stop_to_complete_wins_however_the_text_is_split(pieces):
  """Found by hypothesis in CI: "aab" | "a" stopped at "b" ("aa") while "aaba" in one piece
  stopped at the earlier-starting "aba" ("a"). Generation meets "b" first: "aa" both ways."""
  m = StopStrings(["b", "aba"])
  out = "".join(m.push(p) for p in pieces if not m.stopped) + m.flush()
  assert (out, m.stopped, m.matched) == ("aa", True, "b")
  m = StopStrings(["b", "ab"])  # Both complete at the same character: the longer one cuts.
  assert m.push("cab") == "c" and m.matched == "ab"


def test_stop_string_is_held_back_until_decided():
  m = StopStrings(["</s>"])
  assert m.push("Hello <") == "Hello "  # "<" could start "</s>": held.
  assert m.push("/") == ""
  assert m.push("x") == "</x"  # Not a match after all: released.
  assert m.push(" </") == " "
  assert m.push("s> tail") == "" and m.stopped and m.matched == "</s>"


def test_earliest_stop_wins_over_list_order():
  m = StopStrings(["world", "lo w"])
  assert m.push("hello world") == "hel" and m.matched == "lo w"


def _penalty_reference(logits, recent, presence, frequency):
  out = logits.astype(np.float64).copy()
  for b in range(logits.shape[0]):
    ids, counts = np.unique(np.asarray([t for t in recent[b] if 0 <= t < logits.shape[1]], int),
                            return_counts=True)
    out[b, ids] -= presence * (counts > 0) + frequency * counts
  return out


@pytest.mark.parametrize("presence,frequency", [(0.0, 0.0), (0.7, 0.0), (0.0, 0.4),
                                                (1.5, -0.5), (-2.0, 2.0)])
def test_presence_frequency_penalty_matches_numpy(presence, frequency):
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 50)).astype(np.float32)
  recent = rng.integers(-1, 60, size=(3, 24)).astype(np.int32)  # Padding and out-of-range ids.
  recent[2] = -1  # An empty window.
  got = apply_presence_frequency_penalty(jnp.asarray(logits), jnp.asarray(recent), presence,
                                         frequency)
  np.testing.assert_allclose(np.asarray(got), _penalty_reference(logits, recent, presence,
                                                                 frequency), rtol=1e-6,
                             atol=1e-6)


def test_presence_penalty_changes_the_greedy_pick():
  logits = jnp.asarray([[2.0, 1.5, 0.0]])
  recent = jnp.asarray([[0, -1]], jnp.int32)
  key = jnp.zeros(2, jnp.uint32)
  assert int(sample(logits, key, make_sampling_params(), recent)[0]) == 0
  assert int(sample(logits, key, make_sampling_params(presence_penalty=1.0), recent)[0]) == 1
  assert int(sample(logits, key, make_sampling_params(frequency_penalty=0.6), recent)[0]) == 1


@pytest.mark.parametrize("kw", [{"presence_penalty": 2.5}, {"frequency_penalty": -3},
                                {"presence_penalty": float("nan")},
                                {"frequency_penalty": "1"}])
def test_penalties_out_of_range_are_refused(kw):
  with pytest.raises(ConfigError, match=next(iter(kw))):
    make_sampling_params(**kw)


# ------------------------------------------------------------------------------- sessions
TURN1 = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module", params=["xla", "host"])
def model(request, smollm2_path):
  import pijax
  m = pijax.load(smollm2_path, max_seq_len=256)
  if request.param == "host":
    # f32 decode products: a reused prefix changes which tokens run as a short (gemv) pass,
    # and with int8 activations that changes the arithmetic, so only f32 is chunking-exact.
    m.configure_host_weights("gguf", dot="f32")
  return m


@pytest.mark.slow
def test_session_reuses_the_prefix_and_equals_a_fresh_run(model):
  from pijax.session import Session
  with Session(model) as session:
    first = model.generate(TURN1, chat=True, max_new_tokens=16, session=session)
    assert session.last_reused == 0
    prompt1 = model.encode_prompt(TURN1, chat=True)
    # The cache holds the prompt and every reply token but the last one sampled.
    assert session.ids == prompt1 + first.token_ids[:-1]
    turn2 = TURN1 + [{"role": "assistant", "content": first.text},
                     {"role": "user", "content": "And of Germany?"}]
    second = model.generate(turn2, chat=True, max_new_tokens=16, session=session)
    assert session.last_reused >= len(prompt1)
    fresh = model.generate(turn2, chat=True, max_new_tokens=16)
    assert second.token_ids == fresh.token_ids
    # A prompt that diverges early reuses only the common part, and still matches.
    other = [{"role": "user", "content": "Name a large animal."}]
    third = model.generate(other, chat=True, max_new_tokens=12, session=session)
    assert 0 < session.last_reused < len(prompt1)
    assert third.token_ids == model.generate(other, chat=True, max_new_tokens=12).token_ids
    # The same prompt again: everything but its last token comes from the cache.
    again = model.generate(other, chat=True, max_new_tokens=12, session=session)
    assert session.last_reused == len(model.encode_prompt(other, chat=True)) - 1
    assert again.token_ids == third.token_ids


@pytest.mark.slow
def test_closing_a_stream_early_keeps_the_session_usable(model):
  from pijax.session import Session
  session = Session(model)
  stream = model.stream(TURN1, chat=True, max_new_tokens=16, session=session)
  next(stream)
  stream.close()  # Stop after the first piece.
  assert stream.result is None
  assert len(session.ids) >= len(model.encode_prompt(TURN1, chat=True))
  full = model.generate(TURN1, chat=True, max_new_tokens=16, session=session)
  assert full.token_ids == model.generate(TURN1, chat=True, max_new_tokens=16).token_ids
  session.close()
  assert session.ids == []


@pytest.mark.slow
def test_stop_strings_in_the_library_stream(model):
  full = model.generate("Once upon a time", max_new_tokens=24)
  stop = full.text[8:12]
  cut = model.generate("Once upon a time", max_new_tokens=24, stop=[stop])
  assert cut.text == full.text[:full.text.find(stop)] and cut.stop_reason == "stop"


@pytest.mark.slow
def test_stop_given_as_one_string_or_none(model):
  full = model.generate("Once upon a time", max_new_tokens=24)
  stop = full.text[8:12]
  assert model.generate("Once upon a time", max_new_tokens=24, stop=stop).text == \
      full.text[:full.text.find(stop)]
  assert model.generate("Once upon a time", max_new_tokens=24, stop=None).text == full.text
  with pytest.raises(ConfigError, match="stop"):
    model.generate("Once upon a time", max_new_tokens=4, stop=[3])


def test_session_of_another_model_is_refused(smollm2_path):
  import pijax
  from pijax.session import Session
  a = pijax.load(smollm2_path, max_seq_len=64)
  b = pijax.load(smollm2_path, max_seq_len=128)
  with pytest.raises(ConfigError, match="another Model"):
    b.generate_ids(b.encode_prompt("Hi"), max_new_tokens=2, session=Session(a))


def test_warm_up_on_a_vocabulary_that_cannot_spell_its_text(tmp_path):
  """The server's warm-up compiles on token 0 when its text encodes to nothing (the tiny
  placeholder vocabulary has only "a" and "b"), instead of refusing to start; a json_object
  grammar it cannot spell does not stop the warm-up either."""
  import pijax
  import tiny_models
  from pijax.server import worker
  path = tiny_models.write_random_quantized_gguf(tmp_path / "t.gguf")
  model = pijax.load(path, max_seq_len=64)
  assert model.tokenizer.encode("Hello") == []
  assert worker.warm_up(model) > 0  # json_object cannot be spelled: the bias alone compiles.
  assert model.compile_count("decode") == 2  # The plain and the biased decode step.
