"""OpenAI-compatible request models (pydantic) and the shape of error bodies.

Field names, ranges and defaults follow the OpenAI API reference ("Create chat completion",
"Create completion"), `response_format` and `logit_bias` included; the llama.cpp extras `top_k`,
`min_p`, `repeat_penalty` and `ignore_eos` are accepted as llama-server and vLLM accept them. Unknown fields are
ignored. Values outside a range are refused with 400 and an OpenAI error body naming the field
(`param`).
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

ROLES = ("system", "developer", "user", "assistant")  # "developer" is OpenAI's newer "system".
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
  """An OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
  return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
  model_config = ConfigDict(extra="ignore")
  include_usage: StrictBool = False


class ContentPart(BaseModel):
  model_config = ConfigDict(extra="ignore")
  type: Literal["text"]
  text: str


class Message(BaseModel):
  """One chat message; `content` is text or a list of text parts (joined)."""
  model_config = ConfigDict(extra="ignore")
  role: str
  content: str | list[ContentPart] | None = None
  name: str | None = None

  @pydantic.field_validator("role")
  @classmethod
  def _known_role(cls, role: str) -> str:
    if role not in ROLES:
      raise ValueError(f"unknown role {role!r}; use one of {', '.join(ROLES)}")
    return role

  def text(self) -> str:
    if self.content is None:
      return ""
    if isinstance(self.content, str):
      return self.content
    return "".join(part.text for part in self.content)


class _Sampling(BaseModel):
  """Fields shared by chat and text completions."""
  model_config = ConfigDict(extra="ignore")
  model: str | None = None
  max_tokens: StrictInt | None = Field(default=None, ge=1)
  temperature: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
  top_p: float = Field(default=1.0, ge=0.0, le=1.0)
  top_k: StrictInt = Field(default=0, ge=-1)  # -1 or 0: off.
  min_p: float = Field(default=0.0, ge=0.0, le=1.0)
  repeat_penalty: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)
  presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
  frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
  seed: StrictInt | None = Field(default=None, ge=-(2 ** 63), lt=2 ** 64)
  stop: str | list[str] | None = None
  stream: StrictBool = False
  stream_options: StreamOptions | None = None
  n: StrictInt = Field(default=1, ge=1, le=1)  # One choice per request.
  user: str | None = None
  # {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}; its shape and schema
  # are checked when it is compiled (`pijax.grammar.response_format_grammar`): 400 naming it.
  response_format: dict[str, Any] | None = None
  # Token id (a decimal string: JSON object keys) -> bias in [-100, 100], checked against the
  # vocabulary by `pijax.grammar.check_logit_bias`.
  logit_bias: dict[str, float] | None = None
  # llama.cpp's extra: end-of-sequence tokens do not end the reply (benchmarks of fixed length).
  ignore_eos: StrictBool = False

  @pydantic.field_validator("stop")
  @classmethod
  def _stop_list(cls, stop):
    if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
      raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
    return stop

  def stop_strings(self) -> list[str]:
    if self.stop is None:
      return []
    return [self.stop] if isinstance(self.stop, str) else list(self.stop)

  def sampling_kwargs(self) -> dict[str, Any]:
    """Keyword arguments of `pijax.engine.Model.generate_ids`."""
    return dict(temperature=self.temperature, top_p=self.top_p, top_k=max(0, self.top_k),
                min_p=self.min_p, repeat_penalty=self.repeat_penalty,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty)

  @property
  def include_usage(self) -> bool:
    return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
  messages: list[Message] = Field(min_length=1)
  max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
  logprobs: StrictBool = False
  top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

  @pydantic.field_validator("top_logprobs")
  @classmethod
  def _top_logprobs_needs_logprobs(cls, value, info):
    if value is not None and not info.data.get("logprobs"):
      raise ValueError("top_logprobs needs logprobs=true")
    return value

  def token_limit(self) -> int | None:
    return self.max_completion_tokens if self.max_completion_tokens is not None \
        else self.max_tokens


class CompletionRequest(_Sampling):
  # Text, token ids, or a batch of one of either (n and batches above 1 are refused).
  prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
  max_tokens: StrictInt | None = Field(default=16, ge=1)  # OpenAI's default for completions.
  logprobs: StrictInt | None = Field(default=None, ge=0, le=5)
  echo: StrictBool = False

  @pydantic.field_validator("prompt")
  @classmethod
  def _one_prompt(cls, prompt):
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
      if len(prompt) != 1:
        raise ValueError("one prompt per request (batches of several prompts are not served)")
      prompt = prompt[0]
    if isinstance(prompt, list) and not prompt:
      raise ValueError("the prompt is empty")
    return prompt

  def token_limit(self) -> int | None:
    return self.max_tokens
