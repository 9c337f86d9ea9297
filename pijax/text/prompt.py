"""A prompt -> token ids that fit the context: plain text, a chat turn, or ids given as they are."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Sequence

import numpy as np

from pijax.errors import ConfigError, ContextError, ContextLengthError


def token_ids(prompt: Any) -> list[int]:
  """A prompt given as token ids: a flat sequence of ints (not bytes, not floats).

  Raises:
    ConfigError: bytes, nested lists, or non-integer values.
  """
  if isinstance(prompt, (bytes, bytearray)):
    raise ConfigError("the prompt is bytes; pass text (str) or a list of token ids.")
  arr = np.asarray(prompt)
  if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
    raise ConfigError(f"token-id prompts must be a flat list of integers, got "
                      f"{arr.dtype}{list(arr.shape)}.")
  return [int(i) for i in arr]


def encode(tokenizer, prompt: str | Sequence[int], *, chat: bool, parse_special: bool,
           system: str | None, max_seq_len: int, context_length: int, vocab_size: int,
           path: str) -> list[int]:
  """Token ids for a prompt: text (optionally one user turn in the chat template) or ids.

  Special-token text typed in the prompt stays plain text unless parse_special; with chat,
  only the template inserts real special tokens.

  Args:
    tokenizer: pijax.text.tokenizer.Tokenizer.
    prompt: text, token ids used as they are, or (with chat) a conversation:
      [{"role": "system" | "user" | "assistant", "content": str}, ...].
    max_seq_len: the KV cache length (tokens) the ids must fit; context_length: the model's.
    vocab_size: ids must lie in [0, vocab_size). path: the model, for messages.

  Raises:
    ConfigError: chat on a model without a chat template; a malformed id list.
    ContextError: empty, not UTF-8, ids outside the vocabulary, longer than max_seq_len.
  """
  is_messages = (isinstance(prompt, Sequence) and not isinstance(prompt, str) and prompt
                 and all(isinstance(m, Mapping) for m in prompt))
  if is_messages:
    if not chat:
      raise ConfigError("a list of messages is a chat prompt; pass chat=True.")
    from pijax.text.chat import encode_chat
    if not tokenizer.chat_template:
      raise ConfigError(f"{path}: the model has no chat template "
                        "(tokenizer.chat_template); send a plain-text prompt instead.")
    for m in prompt:
      content = m.get("content")
      if isinstance(content, str):
        try:
          content.encode("utf-8")
        except UnicodeEncodeError as err:
          raise ContextError(f"a message is not valid UTF-8 text ({err.reason}); pass UTF-8 "
                             "text.") from None
    ids = encode_chat(tokenizer, tokenizer.chat_template, list(prompt),
                      add_generation_prompt=True, parse_special_in_content=parse_special)
  elif isinstance(prompt, str):
    try:
      prompt.encode("utf-8")
    except UnicodeEncodeError as err:
      raise ContextError(f"the prompt is not valid UTF-8 text ({err.reason} at character "
                         f"{err.start}); pass UTF-8 text.") from None
    if chat:
      from pijax.text.chat import encode_chat
      if not tokenizer.chat_template:
        raise ConfigError(f"{path}: the model has no chat template "
                          "(tokenizer.chat_template); run without --chat.")
      messages = ([{"role": "system", "content": system}] if system else []) + [
          {"role": "user", "content": prompt}]
      ids = encode_chat(tokenizer, tokenizer.chat_template, messages,
                        add_generation_prompt=True, parse_special_in_content=parse_special)
    else:
      ids = tokenizer.encode(prompt, add_special=True, parse_special=parse_special)
  else:
    ids = token_ids(prompt)
  if not ids:
    raise ContextError("the prompt is empty (0 tokens) and there is nothing to continue; "
                       "give a non-empty prompt.")
  if len(ids) > max_seq_len:
    raise ContextLengthError(
        f"the prompt has {len(ids)} tokens but the context is {max_seq_len} tokens "
        "(max_seq_len); shorten the prompt or raise max_seq_len (up to the model's "
        f"context_length {context_length}).", n_tokens=len(ids), max_seq_len=max_seq_len)
  bad = [i for i in ids if not 0 <= i < vocab_size]
  if bad:
    raise ContextError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size}).")
  return ids
