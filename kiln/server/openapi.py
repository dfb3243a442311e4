"""What /openapi.json says: request bodies with their real bounds, responses by status code.

The generation routes read the raw request (``app.read_body``: the 413 limit while the body
streams in, OpenAI error bodies), so FastAPI does not see their request models; each route
declares its body with ``request_body(Model)`` and ``openapi(...)`` adds the models to the
components. Bounds that depend on the engine (the vocabulary, the context, the lookahead
window) are placeholders in the models (``protocol.MAX``) filled in here.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

from kiln.server.protocol import MAX, MAX_DIGITS

REF = "#/components/schemas/{model}"


class _Out(BaseModel):
    """A response body: exactly these fields (the schema says additionalProperties: false)."""

    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Out):
    message: str
    type: str
    param: str | None = Field(description="the request field to blame, if one is")
    code: str | None


class ErrorResponse(_Out):
    error: ErrorDetail


class Usage(_Out):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)


FinishReason = Literal["stop", "length"]
ChatFinishReason = Literal["stop", "length", "tool_calls"]


class CompletionLogprobs(_Out):
    """Per token: its text, logprob, alternatives and offset into the choice's text (with
    echo, the prompt's tokens first, the first of them null: nothing precedes it)."""

    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="<= 0; -9999.0 stands for -inf")
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(_Out):
    logprob: float = Field(description="<= 0; -9999.0 stands for -inf")
    rank: int = Field(ge=1, description="1 = the most likely token")
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]
_PROMPT_LOGPROBS = ("prompt_logprobs requests: per prompt token (the first: null) token id -> "
                    "its score, the token itself then its most likely alternatives")


class CompletionChoice(_Out):
    index: int = Field(ge=0)
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    prompt_logprobs: PromptLogprobs | None = Field(None, description=_PROMPT_LOGPROBS)


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(_Out):
    token: str
    logprob: float = Field(description="<= 0; -9999.0 stands for -inf")
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: list[ChatTokenLogprob]


class FunctionCallOut(_Out):
    name: str
    arguments: str = Field(description="the arguments object as JSON text")


class ToolCallOut(_Out):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(_Out):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the answer is only tool calls")
    tool_calls: list[ToolCallOut] | None = Field(None, description=(
        "the calls parsed from the answer (requests with tools)"))


class ChatChoice(_Out):
    index: int = Field(ge=0)
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason | None


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = Field(None, description=(
        "prompt_logprobs requests: as on /v1/completions, over the rendered messages"))


class CompletionChunkChoice(_Out):
    """With echo or prompt_logprobs, a choice's first chunk carries the prompt's part."""

    index: int = Field(ge=0)
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    prompt_logprobs: PromptLogprobs | None = Field(None, description=_PROMPT_LOGPROBS)


class CompletionChunk(_Out):
    """One streamed event of /v1/completions; with include_usage every chunk has ``usage``:
    null, except the last one (``choices`` empty), which has the totals."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class FunctionCallDelta(_Out):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Out):
    """A piece of call ``index``: its first piece has the id, type and name; the arguments
    come in fragments to concatenate."""

    index: int = Field(ge=0)
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Out):
    index: int = Field(ge=0)
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason | None


class ChatCompletionChunk(_Out):
    """One streamed event of /v1/chat/completions (``usage`` as in CompletionChunk)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int = Field(ge=1)


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Out):
    tokens: list[int]
    count: int = Field(ge=0)
    max_model_len: int = Field(ge=1)


class DetokenizeResponse(_Out):
    prompt: str


class HealthResponse(_Out):
    status: Literal["ok"]
    startup_s: float | None = Field(None, description="engine loading to accepting requests")
    startup: dict[str, float] | None = Field(None, description="start-up seconds by phase")


class HealthUnavailable(_Out):
    """/health's 503: the engine is not running, or (``status``) the server is draining."""

    status: Literal["shutting down"] | None = None
    error: ErrorDetail


class VersionResponse(_Out):
    version: str


_ERRORS = {
    400: "invalid request: the error's param names the field",
    401: "missing or wrong API key",
    404: "unknown model",
    408: "the request body did not arrive in time",
    413: "request body larger than --max-body-bytes",
    429: "queue full; retry after the Retry-After header's seconds",
    500: "the engine failed this request",
    503: "the engine is not running, or the server is shutting down",
}
STREAM_MODELS = (CompletionChunk, ChatCompletionChunk)


def sse(chunk: type[BaseModel]) -> dict[str, Any]:
    """``text/event-stream`` whose events (OpenAPI 3.1: ``schema`` is one event's) carry
    ``chunk`` JSON, an error body if the request fails mid-stream, and last ``[DONE]``."""
    return {"text/event-stream": {"schema": {
        "type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
            {"const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json", "contentSchema": {
                "anyOf": [{"$ref": REF.format(model=chunk.__name__)},
                          {"$ref": REF.format(model="ErrorResponse")}]}}]}}}}}


def responses(ok: type[BaseModel] | None, *errors: int | tuple[int, type[BaseModel]],
              stream: type[BaseModel] | None = None,
              content: dict | None = None) -> dict[int | str, dict[str, Any]]:
    """A route's ``responses=``: 200 with ``ok`` (and SSE events of ``stream`` chunks), then
    ``errors``: statuses with ErrorResponse bodies, or (status, body model) pairs."""
    out: dict[int | str, dict[str, Any]] = {200: {"description": "OK"}}
    if ok is not None:
        out[200]["model"] = ok
    if stream or content:
        out[200]["content"] = {**(sse(stream) if stream else {}), **(content or {})}
    for err in errors:
        status, model = err if isinstance(err, tuple) else (err, ErrorResponse)
        out[status] = {"model": model, "description": _ERRORS[status]}
    return out


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's ``openapi_extra=``: a required JSON body of ``model``."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": REF.format(model=model.__name__)}}}}}


def openapi(app: FastAPI, request_models: list[type[BaseModel]], *, maxima: dict[str, int],
            protected: tuple[str, ...], api_key: bool) -> dict[str, Any]:
    """The OpenAPI document of ``app``, with the request models as components, ``maxima``
    (this engine's bounds by ``protocol.MAX`` name) filled in and, when ``api_key``, bearer
    auth on the ``protected`` paths."""
    doc = get_openapi(title=app.title, version=app.version, description=app.description,
                      routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for model in (*request_models, *STREAM_MODELS):
        s = model.model_json_schema(ref_template=REF, mode="validation")
        schemas.update(s.pop("$defs", {}))
        schemas[model.__name__] = s
    _fill(doc, maxima)
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, ops in doc["paths"].items():
            if path.startswith(protected):
                for op in ops.values():
                    op["security"] = [{"bearer": []}]
                    op["responses"]["401"] = {"description": _ERRORS[401], "content": {
                        "application/json": {"schema": {"$ref": REF.format(
                            model="ErrorResponse")}}}}
    return doc


def decimal_upto(m: int) -> str:
    """A pattern of the decimal strings of 0..m (up to 8 leading zeros: at most 18 digits)."""
    s = str(m)
    parts = ["[0-9]"] if len(s) > 1 else []
    parts += [f"[1-9][0-9]{{{n - 1}}}" for n in range(2, len(s))]
    for i, d in enumerate(map(int, s)):
        lo = 1 if i == 0 and len(s) > 1 else 0
        if i == len(s) - 1:
            parts.append(f"{s[:i]}[{lo}-{d}]")
        elif d > lo:
            parts.append(f"{s[:i]}[{lo}-{d - 1}][0-9]{{{len(s) - i - 1}}}")
    return f"^0{{0,8}}(?:{'|'.join(parts)})$"


def _fill(node: Any, maxima: dict[str, int]) -> None:
    """Replace each ``{MAX: name}`` in ``node`` with ``maximum: maxima[name]``, and each
    ``{MAX_DIGITS: name}`` with the pattern of decimal strings up to it."""
    if isinstance(node, dict):
        if MAX in node:
            node["maximum"] = maxima[node.pop(MAX)]
        if MAX_DIGITS in node:
            node["pattern"] = decimal_upto(maxima[node.pop(MAX_DIGITS)])
        for v in node.values():
            _fill(v, maxima)
    elif isinstance(node, list):
        for v in node:
            _fill(v, maxima)
