"""OpenAI request bodies (pydantic) and their translation into kiln SamplingParams.

Unknown fields are ignored (clients send ``user``, ``presence_penalty`` ...); every known field
is range-checked here so a bad value becomes a 400 that names the field.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kiln.runtime.guided import GuidedSpec
from kiln.runtime.sampling_params import SamplingParams

MAX_N = 16


class BadRequest(ValueError):
    """A client error: HTTP ``status`` with an OpenAI error body naming ``param``."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 code: str | None = None, type_: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code
        self.type = type_
        self.headers = headers


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Lenient):
    include_usage: bool = False


class Lookahead(_Lenient):
    """The lookahead window: W columns, N-gram size, G candidates verified per step."""

    w: int = Field(ge=1)
    n: int = Field(ge=1)
    g: int = Field(ge=0)


class JsonSchemaFormat(_Lenient):
    name: str | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _needs_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema: {"schema": {...}}')
        return self


class SamplingFields(_Lenient):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + kiln extras)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    # kiln / vLLM extras
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    response_format: ResponseFormat | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    lookahead: Lookahead | None = None

    def guided(self) -> tuple[GuidedSpec | None, str | None]:
        """The structured-output spec and the name of the field that asked for it."""
        asked = []
        rf = self.response_format
        if rf is not None and rf.type != "text":
            asked.append("response_format")
        asked += [n for n in ("regex", "grammar", "choice") if getattr(self, n) is not None]
        if not asked:
            return None, None
        if len(asked) > 1:
            raise BadRequest(f"only one of response_format, regex, grammar, choice may be set; "
                             f"got {', '.join(asked)}", asked[1])
        name = asked[0]
        try:
            if name == "response_format":
                if rf.type == "json_object":
                    return GuidedSpec("json_object"), name
                return GuidedSpec("json_schema", json.dumps(rf.json_schema.schema_)), name
            if name == "choice":
                return GuidedSpec("choice", tuple(self.choice)), name
            return GuidedSpec(name, getattr(self, name)), name
        except ValueError as e:
            raise BadRequest(str(e), name) from None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise BadRequest("prompt is empty; send a string or a list of token ids", "prompt")
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class ChatMessage(_Lenient):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def as_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise BadRequest("only text content parts are supported", "messages")
                parts.append(part["text"])
            content = "".join(parts)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class TokenizeRequest(_Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None

    @model_validator(mode="after")
    def _one(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[int]


def sampling_params(req: SamplingFields, *, max_tokens: int, logprobs: int | None,
                    seed: int | None, guided: GuidedSpec | None) -> SamplingParams:
    """SamplingParams for one choice of ``req``; ValueError -> 400 naming the field."""
    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "top_k": max(req.top_k, 0), "min_p": req.min_p, "seed": seed,
        "repetition_penalty": req.repetition_penalty,
        "stop": (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
        "stop_token_ids": tuple(req.stop_token_ids or ()), "ignore_eos": req.ignore_eos,
        "logprobs": logprobs, "guided": guided,
    }
    if req.lookahead is not None:
        names = {f.name for f in dataclasses.fields(SamplingParams)}
        if "lookahead" not in names:
            raise BadRequest("lookahead decoding is not supported by this server yet",
                             "lookahead", code="unsupported")
        la = req.lookahead
        kwargs["lookahead"] = (la.w, la.n, la.g)
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        msg = str(e)
        field = msg.split("=", 1)[0] if "=" in msg.split(" ", 1)[0] else None
        raise BadRequest(msg, field) from None
