"""Chat templates: render `tokenizer.chat_template` (Jinja2) and encode the result safely.

`render_chat` renders a template the way Hugging Face transformers does (sandboxed Jinja2 with
`trim_blocks` / `lstrip_blocks`, `raise_exception`, `strftime_now`, a `tojson` that keeps Unicode).

`encode_chat` turns messages into prompt ids with a special-token policy (case T4):

* special tokens the *template* writes (`<|im_start|>`, `<s>`, ...) become their real ids;
* message *contents* are plain text by default: a user who types `<|im_end|>` gets the characters,
  not the control token, so they cannot close their turn or open a fake system turn. Pass
  `parse_special_in_content=True` to parse specials in contents too (trusted input only);
* BOS is added when the vocabulary wants it (`add_bos`) unless the rendered text already starts
  with it: never a double BOS. EOS is never appended (the prompt continues with the reply).
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from pijax.errors import TokenizerError
from pijax.text.tokenizer import Tokenizer

# Private-use characters that bracket each message content in a second, marked rendering.
_OPEN, _CLOSE = "\ue000", "\ue001"


def _raise_exception(message: str):
  import jinja2
  raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
  return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False,
            separators: Sequence[str] | None = None, sort_keys: bool = False) -> str:
  # Jinja's own tojson HTML-escapes "<", ">", "&", "'"; chat templates expect plain JSON.
  return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii,
                    separators=tuple(separators) if separators else None, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compile(template: str):
  import jinja2
  from jinja2.sandbox import ImmutableSandboxedEnvironment
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                     extensions=["jinja2.ext.loopcontrols"])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  try:
    return env.from_string(template)
  except jinja2.TemplateSyntaxError as err:
    raise TokenizerError(f"the chat template has a syntax error (line {err.lineno}: "
                         f"{err.message}); fix tokenizer.chat_template or pass another "
                         "template.") from None


def _template_and_tokens(source: str | Mapping[str, Any] | Tokenizer
                         ) -> tuple[str, str, str]:
  """(template, bos text, eos text) from a template string, GGUF metadata or a Tokenizer."""
  if isinstance(source, str):
    return source, "", ""
  if isinstance(source, Tokenizer):
    template, tokens, bos_id, eos_id = (source.chat_template, source.tokens, source.bos_id,
                                        source.eos_id)
  elif isinstance(source, Mapping):
    template = source.get("tokenizer.chat_template")
    tokens = source.get("tokenizer.ggml.tokens") or []
    bos_id = source.get("tokenizer.ggml.bos_token_id")
    eos_id = source.get("tokenizer.ggml.eos_token_id")
  else:
    raise TypeError("render_chat takes a template string, GGUF metadata or a Tokenizer, got "
                    f"{type(source).__name__}")
  if not isinstance(template, str):
    raise TokenizerError("the model has no chat template (tokenizer.chat_template); pass a "
                         "template string instead.")

  def text(i):
    return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else ""

  return template, text(bos_id), text(eos_id)


def render_chat(tokenizer_metadata_or_template: str | Mapping[str, Any] | Tokenizer,
                messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                bos_token: str | None = None, eos_token: str | None = None,
                **template_kwargs: Any) -> str:
  """Renders a chat template.

  Args:
    tokenizer_metadata_or_template: the Jinja2 template string, or GGUF metadata (a dict with
      `tokenizer.chat_template`), or a `Tokenizer`; the latter two also give the BOS / EOS texts.
    messages: [{"role": "system" | "user" | "assistant" | ..., "content": str}, ...].
    add_generation_prompt: end with the header of an assistant turn ("<|im_start|>assistant\\n").
    bos_token, eos_token: texts for `{{ bos_token }}` / `{{ eos_token }}`; default: the model's
      (from metadata / Tokenizer), or "" for a bare template string.
    **template_kwargs: extra template variables (e.g. `tools=[...]`).

  Returns:
    The rendered prompt text.

  Raises:
    TokenizerError: a template syntax error, a `raise_exception(...)` from the template (e.g. roles
      that do not alternate), or any other failure while rendering; the message says which.
  """
  import jinja2
  template, default_bos, default_eos = _template_and_tokens(tokenizer_metadata_or_template)
  compiled = _compile(template)
  try:
    return compiled.render(
        messages=messages, add_generation_prompt=add_generation_prompt,
        bos_token=default_bos if bos_token is None else bos_token,
        eos_token=default_eos if eos_token is None else eos_token, **template_kwargs)
  except jinja2.TemplateError as err:
    raise TokenizerError(f"the chat template refused the messages: {err}") from None
  except Exception as err:  # A template bug, e.g. adding None to a string.
    raise TokenizerError(f"the chat template failed ({type(err).__name__}: {err}); check the "
                         "messages (role/content strings) or the template.") from None


def _content_strings(messages: Sequence[Mapping[str, Any]]) -> list[str]:
  """The message contents that must stay plain text: str contents and text parts of lists."""
  out = []
  for m in messages:
    content = m.get("content") if isinstance(m, Mapping) else None
    if isinstance(content, str):
      out.append(content)
    elif isinstance(content, Sequence):
      out += [p["text"] for p in content
              if isinstance(p, Mapping) and isinstance(p.get("text"), str)]
  return [c for c in out if c]


def _mark_messages(messages: Sequence[Mapping[str, Any]]) -> list[Any]:
  """A copy of `messages` with every content string wrapped in _OPEN ... _CLOSE."""
  marked = []
  for m in messages:
    if not isinstance(m, Mapping):
      marked.append(m)
      continue
    m = dict(m)
    content = m.get("content")
    if isinstance(content, str) and content:
      m["content"] = _OPEN + content + _CLOSE
    elif isinstance(content, Sequence) and not isinstance(content, str):
      m["content"] = [
          {**p, "text": _OPEN + p["text"] + _CLOSE}
          if isinstance(p, Mapping) and isinstance(p.get("text"), str) and p["text"] else p
          for p in content]
    marked.append(m)
  return marked


def _spans_from_markers(marked: str, rendered: str) -> list[tuple[int, int]] | None:
  """Content spans [start, end) in `rendered`, or None if `marked` is not `rendered` + markers."""
  spans, out_len, start, pieces = [], 0, None, []
  pos = 0
  for i, ch in enumerate(marked):
    if ch not in (_OPEN, _CLOSE):
      continue
    pieces.append(marked[pos:i])
    out_len += i - pos
    pos = i + 1
    if ch == _OPEN:
      if start is not None:
        return None
      start = out_len
    else:
      if start is None:
        return None
      spans.append((start, out_len))
      start = None
  pieces.append(marked[pos:])
  if start is not None or "".join(pieces) != rendered:
    return None
  return spans


def _spans_by_search(rendered: str, contents: Sequence[str], tokenizer: Tokenizer
                     ) -> list[tuple[int, int]]:
  """Content spans found by searching each content (or its strip()) in order."""
  spans, cursor = [], 0
  for content in contents:
    for candidate in (content, content.strip()):
      at = rendered.find(candidate, cursor) if candidate else -1
      if at >= 0:
        spans.append((at, at + len(candidate)))
        cursor = at + len(candidate)
        break
    else:
      if any(isinstance(f, int) for f in tokenizer.split_special(content)):
        raise TokenizerError(
            "a message content holds special-token text and the chat template transforms it "
            "beyond recognition, so it cannot be kept plain text; remove the special-token "
            "text or pass parse_special_in_content=True if the content is trusted.")
  return spans


def encode_chat(tokenizer: Tokenizer, template: str | None,
                messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                parse_special_in_content: bool = False, **template_kwargs: Any) -> list[int]:
  """Prompt ids for a conversation: the rendered template with a safe special-token policy.

  Args:
    tokenizer: the model's `Tokenizer` (gives BOS / EOS texts for the template).
    template: the Jinja2 chat template; None uses `tokenizer.chat_template`.
    messages: [{"role": ..., "content": str}, ...].
    add_generation_prompt: end with the assistant-turn header.
    parse_special_in_content: False (default): special-token text inside message contents stays
      plain text; only the template's own markers become special ids. True: the whole rendered text
      is parsed for specials (like transformers' `apply_chat_template(tokenize=True)`).
    **template_kwargs: extra template variables.

  Returns:
    list[int] of token ids, with BOS first when the vocabulary adds one (never twice), no EOS.

  Raises:
    TokenizerError: no template, a template error, or a content with special-token text that the
      template rewrote so it cannot be located (see `parse_special_in_content`).
  """
  if template is None:
    template = tokenizer.chat_template
    if template is None:
      raise TokenizerError("the model has no chat template (tokenizer.chat_template); pass one.")
  bos_text = tokenizer.tokens[tokenizer.bos_id] if tokenizer.bos_id is not None else ""
  eos_text = tokenizer.tokens[tokenizer.eos_id] if tokenizer.eos_id is not None else ""

  def render(msgs):
    return render_chat(template, msgs, add_generation_prompt=add_generation_prompt,
                       bos_token=bos_text, eos_token=eos_text, **template_kwargs)

  rendered = render(messages)
  if parse_special_in_content:
    fragments = tokenizer.split_special(rendered)
  else:
    contents = _content_strings(messages)
    spans = None
    if not any(_OPEN in c or _CLOSE in c for c in contents) and _OPEN not in rendered \
        and _CLOSE not in rendered:
      try:
        spans = _spans_from_markers(render(_mark_messages(messages)), rendered)
      except TokenizerError:
        spans = None  # The template inspects contents; fall back to searching for them.
    if spans is None:
      spans = _spans_by_search(rendered, contents, tokenizer)
    # Template text is cut at its special tokens; content text is kept whole. Neighbouring text
    # pieces are joined so words that cross a content boundary tokenize as in one string.
    fragments: list[str | int] = []
    pos = 0
    for start, end in sorted(spans) + [(len(rendered), len(rendered))]:
      if start < pos:  # Overlap (a content found twice by search): keep the earlier one.
        continue
      fragments += tokenizer.split_special(rendered[pos:start])
      fragments.append(rendered[start:end])
      pos = end
    merged: list[str | int] = []
    for frag in fragments:
      if isinstance(frag, str) and merged and isinstance(merged[-1], str):
        merged[-1] += frag
      elif frag != "":
        merged.append(frag)
    fragments = merged
  ids = tokenizer.encode_fragments(fragments, add_special=False)
  if tokenizer.add_bos and not (ids and ids[0] == tokenizer.bos_id):
    ids.insert(0, tokenizer.bos_id)
  return ids
