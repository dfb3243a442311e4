"""OpenAI request bodies (pydantic) and their translation into kiln SamplingParams.

Unknown fields are ignored (clients send ``user``, ``service_tier`` ...); every known field
is range-checked here, so a bad value becomes a 400 that names the field. The bounds live
in the models, so /openapi.json states the same ones. Sampling fields default to None: an
omitted one takes the engine's generation default (its ``generation_defaults``, from the
model's generation_config), then kiln's (``KILN_DEFAULTS``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_validator

from kiln.errors import RequestError
from kiln.runtime.guided import GuidedSpec
from kiln.runtime.sampling_params import (
    ADDITIVE_PENALTY_RANGE,
    DEFAULT_MAX_TOKENS,
    LOGIT_BIAS_RANGE,
    REPETITION_PENALTY_RANGE,
    SEED_RANGE,
    SamplingParams,
)

MAX_N = 16
MAX_TOP_K = 2**31 - 1  # top_k >= the vocabulary size keeps every token, as 0 and -1 do
# SamplingParams' own defaults for the fields a model's generation_config may override
KILN_DEFAULTS: dict[str, float] = {
    f.name: f.default for f in dataclasses.fields(SamplingParams)
    if f.name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
# {MAX: name}: a maximum that depends on the engine, which the OpenAPI builder fills in
# ("token_id": vocabulary size - 1, "max_tokens": context - 1, "w" / "n" / "g": the
# engine's lookahead window); the engine checks these itself.
MAX = "x-kiln-max"
MAX_DIGITS = "x-kiln-max-digits"  # a decimal string of at most that value (openapi.py)

# A token id: >= 0 here; < the vocabulary size is checked per engine (the schema says both).
TokenId = Annotated[int, Field(ge=0, json_schema_extra={MAX: "token_id"})]
# Prompt token ids are range-checked by the engine (a 400 naming "prompt"): a bound inside
# the prompt union would turn one bad id into errors about the union's other members.
PromptTokenId = Annotated[int, WithJsonSchema({"type": "integer", "minimum": 0,
                                               MAX: "token_id"})]
Text = Annotated[str, Field(min_length=1)]
# Fields kiln does not support yet take only their "off" value: validation accepts any value
# of the type, ``check()`` answers the others with a 400 "unsupported" naming the field, and
# the schema states the value that works.
_ONLY_NONE = WithJsonSchema({"anyOf": [{"const": "none"}, {"type": "null"}]})
_ONLY_EMPTY = WithJsonSchema({"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]})


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


def unsupported(feature: str, param: str, fix: str) -> BadRequest:
    return BadRequest(f"{feature} is not supported by this server yet; {fix}", param,
                      code="unsupported")


# -- request bodies ---------------------------------------------------------------------------
class _Body(BaseModel):
    """A request body: unknown fields are ignored; known ones are typed strictly (false is
    no number, 1.0 no integer, "5" neither), as the schema says."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    def check(self) -> None:
        """Rules across fields, after validation: raise BadRequest naming the field."""


class StreamOptions(_Body):
    include_usage: bool = False


class Lookahead(_Body):
    """The lookahead window: W columns, N-gram size, G candidates verified per step."""

    w: int = Field(ge=1, description="lookahead window width, 1 to the engine's W",
                   json_schema_extra={MAX: "w"})
    n: int = Field(ge=1, description="n-gram size, 1 to the engine's N",
                   json_schema_extra={MAX: "n"})
    g: int = Field(ge=0, description="candidates verified per step, 0 to the engine's G",
                   json_schema_extra={MAX: "g"})


class JsonSchemaFormat(_Body):
    name: str | None = None
    # false (no value matches) is a valid JSON Schema but no grammar: the compiler rejects it
    schema_: Annotated[dict[str, Any] | bool, WithJsonSchema({"anyOf": [
        {"type": "object"}, {"const": True}]})] = Field(alias="schema",
                                                         description="a JSON Schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}},
        "then": {"required": ["json_schema"], "properties": {"json_schema": {"type": "object"}}}})

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _needs_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema: {"schema": {...}}')
        return self


_lb_lo, _lb_hi = LOGIT_BIAS_RANGE
_rp_lo, _rp_hi = REPETITION_PENALTY_RANGE
_ap_lo, _ap_hi = ADDITIVE_PENALTY_RANGE


def _guided_set(name: str) -> dict[str, Any]:
    """JSON Schema: the request sets structured-output field ``name`` (present, not null; a
    response_format of type "text" asks for nothing)."""
    value: dict[str, Any] = {"not": {"type": "null"}}
    if name == "response_format":
        value = {"type": "object", "not": {"properties": {"type": {"const": "text"}}}}
    return {"required": [name], "properties": {name: value}}


_GUIDED = ("response_format", "regex", "grammar", "choice")
# at most one of them (SamplingFields.guided's rule)
AT_MOST_ONE_GUIDED = {"not": {"anyOf": [
    {"allOf": [_guided_set(a), _guided_set(b)]}
    for i, a in enumerate(_GUIDED) for b in _GUIDED[i + 1:]]}}


class SamplingFields(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + kiln extras)."""

    model: str | None = Field(None, description="the served model name or an alias; "
                                                "omitted: the served model")
    n: int = Field(1, ge=1, le=MAX_N, description=f"choices per prompt, 1 to {MAX_N}; "
                   "choice i samples with seed (seed + i) mod 2**64")
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2, description="a number in [0, 2]; "
                                      "0 is greedy; omitted: the model's default, else 1")
    top_p: float | None = Field(None, gt=0, le=1, description="a number in (0, 1]; 1 keeps "
                                "every token; omitted: the model's default, else 1")
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1],
                             description="a 64-bit integer, in [-2**63, 2**64 - 1]")
    stop: Text | list[Text] | None = Field(None, description="a non-empty string or a list of "
                                           "them; generation stops before the first match")
    frequency_penalty: float = Field(0.0, ge=_ap_lo, le=_ap_hi, description=(
        f"a number in [{_ap_lo:g}, {_ap_hi:g}]: logit -= value x times the token was "
        "generated; 0 disables it"))
    presence_penalty: float = Field(0.0, ge=_ap_lo, le=_ap_hi, description=(
        f"a number in [{_ap_lo:g}, {_ap_hi:g}]: logit -= value once a token was generated; "
        "0 disables it"))
    logit_bias: dict[str, float] | None = Field(None, description=(
        f"token id (a decimal string, < the vocabulary size) -> bias in [{_lb_lo:g}, "
        f"{_lb_hi:g}], added to that token's logit"), json_schema_extra={
            "propertyNames": {MAX_DIGITS: "token_id"},
            "additionalProperties": {"type": "number", "minimum": _lb_lo, "maximum": _lb_hi}})
    # kiln / vLLM extras
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K, description=(
        f"an integer in [-1, {MAX_TOP_K}]; -1, 0 and values >= the vocabulary size keep "
        "every token; omitted: the model's default, else 0"))
    min_p: float | None = Field(None, ge=0, le=1, description="a number in [0, 1]; 0 "
                                "disables it; omitted: the model's default, else 0")
    repetition_penalty: float | None = Field(None, ge=_rp_lo, le=_rp_hi, description=(
        f"a number in [{_rp_lo:g}, {_rp_hi:g}]; 1 disables it; omitted: the model's "
        "default, else 1"))
    stop_token_ids: list[TokenId] | None = Field(None, description=(
        "token ids in [0, vocabulary size) that end generation"))
    ignore_eos: bool = False
    skip_special_tokens: bool = Field(True, description=(
        "false keeps special tokens in the text (a stop token that ends it has none)"))
    response_format: ResponseFormat | None = None
    regex: str | None = None
    grammar: str | None = Field(None, description="EBNF (GBNF-style) the output must match")
    choice: list[Text] | None = Field(None, min_length=1, description="non-empty strings; "
                                      "the output is one of them")
    lookahead: Lookahead | None = None
    max_draft_len: int | None = Field(None, ge=0, description=(
        "draft-model and suffix engines: most draft tokens per step for this request, 0 "
        "(plain decoding) to "
        "the engine's max_draft_len; omitted: the engine's"), json_schema_extra={MAX: "k"})
    user: str | None = Field(None, description=(
        "an identifier of the end user (OpenAI's field); under `kiln serve --suffix-cache-scope "
        "tenant` (without --tenant-header) the tenant whose cache of earlier responses suffix "
        "decoding drafts from"))

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
    model_config = ConfigDict(json_schema_extra={  # max_tokens 0 needs echo: true
        "if": {"required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}}},
        "then": {"required": ["echo"], "properties": {"echo": {"const": True}}},
        **AT_MOST_ONE_GUIDED})

    prompt: (Text | Annotated[list[Text], Field(min_length=1)]
             | Annotated[list[PromptTokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[PromptTokenId], Field(min_length=1)]],
                         Field(min_length=1)]) = Field(description=(
        "a non-empty string, a list of them, a list of token ids, or a list of token-id lists "
        "(n choices per prompt)"))
    max_tokens: int | None = Field(None, ge=0, json_schema_extra={MAX: "max_tokens"},
                                   description="tokens to generate, >= 1 (0 with echo: true: "
                                   "the prompt alone, scored); prompt + max_tokens must fit "
                                   f"the context; omitted: {DEFAULT_MAX_TOKENS}, capped to "
                                   "the context")
    logprobs: int | None = Field(None, ge=0, le=20, description="alternatives per token, 0 "
                                 "to 20 (with echo: the prompt's tokens too)")
    echo: bool = Field(False, description="true: the text starts with the prompt, and "
                       "logprobs cover the prompt's tokens first (the first one's null)")
    prompt_logprobs: int | None = Field(None, ge=0, le=20, description=(
        "vLLM's: the choice's prompt_logprobs holds, per prompt token (the first: null), its "
        "logprob, its rank and this many alternatives, 0 to 20"))
    suffix: str | None = Field(None, description="not supported: must be empty or null",
                               json_schema_extra={"maxLength": 0})
    # The schema says null only: best_of equal to n is accepted too, but JSON Schema cannot
    # compare two fields (and test generators cannot follow the 16-way anyOf that could).
    best_of: int | None = Field(None, ge=1, description="not supported: null, or equal to n",
                                json_schema_extra={"anyOf": [{"type": "null"}]})

    def check(self) -> None:
        if self.max_tokens == 0 and not self.echo:
            raise BadRequest("max_tokens 0 generates nothing, which only echo: true asks for "
                             "(the prompt alone, with logprobs scored); send max_tokens >= 1 "
                             "or echo: true", "max_tokens")
        if self.suffix:
            raise unsupported("suffix (insertion)", "suffix", "drop it")
        if self.best_of is not None and self.best_of != self.n:
            raise unsupported(f"best_of {self.best_of} (other than n={self.n})", "best_of",
                              "drop it and use n")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):  # non-empty: the model says min_length=1
            return [list(p)]
        return list(p)


_TEXT_PARTS = WithJsonSchema({"type": "array", "items": {
    "type": "object", "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}})


FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class FunctionDef(_Body):
    name: str = Field(pattern=FUNCTION_NAME, description="a-z, A-Z, 0-9, _ and -, at most 64")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description=(
        "a JSON Schema for the arguments object; omitted: any object"))
    strict: bool | None = Field(None, description=(
        "true: the arguments are constrained to the schema (a grammar) even under "
        'tool_choice "auto"'))


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Body):
    name: str
    # JSON Schema cannot say "valid JSON text": the pattern refuses what is not shaped as an
    # object, contentMediaType/contentSchema say the rest
    arguments: str = Field(description="the arguments object as JSON text", json_schema_extra={
        "pattern": r"^\s*\{[\s\S]*\}\s*$", "contentMediaType": "application/json",
        "contentSchema": {"type": "object"}})


class ToolCallIn(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    model_config = ConfigDict(json_schema_extra={"allOf": [
        {  # a tool message names the call it answers
            "if": {"required": ["role"], "properties": {"role": {"const": "tool"}}},
            "then": {"required": ["tool_call_id"],
                     "properties": {"tool_call_id": {"type": "string", "minLength": 1}}}},
        {  # only an assistant message carries tool calls
            "if": {"required": ["role"], "properties": {"role": {"not": {"const": "assistant"}}}},
            "then": {"properties": {"tool_calls": {"type": "null"}}}}]})

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | Annotated[list[dict[str, Any]], _TEXT_PARTS] | None = Field(
        None, description='a string or a list of text parts [{"type": "text", "text": "..."}]')
    tool_calls: list[ToolCallIn] | None = Field(None, description=(
        "assistant messages: the calls the model made (rendered back through the chat "
        "template)"))
    tool_call_id: str | None = Field(None, description="tool messages: the call answered")
    name: str | None = None

    def as_dict(self, index: int) -> dict[str, Any]:
        """The message as the chat template reads it: text parts joined; a call's
        arguments as an object (templates write them with ``tojson``)."""
        content = self.content
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts = []
            for i, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise BadRequest(
                        f"messages[{index}].content[{i}] has type {part.get('type')!r}: only "
                        'text parts {"type": "text", "text": "..."} are supported',
                        f"messages[{index}].content")
                parts.append(part["text"])
            content = "".join(parts)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.tool_calls:
            if self.role != "assistant":
                raise BadRequest(f"messages[{index}] has role {self.role!r}: only assistant "
                                 "messages carry tool_calls", f"messages[{index}].tool_calls")
            out["tool_calls"] = [self._call(index, j, c) for j, c in enumerate(self.tool_calls)]
        if self.role == "tool" and not self.tool_call_id:
            raise BadRequest(f"messages[{index}] has role 'tool' but no tool_call_id; a tool "
                             "message answers one call: send the id of the assistant's "
                             "tool call it answers", f"messages[{index}].tool_call_id")
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    @staticmethod
    def _call(index: int, j: int, call: ToolCallIn) -> dict[str, Any]:
        param = f"messages[{index}].tool_calls[{j}].function.arguments"
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError as e:
            raise BadRequest(f"{param} is not valid JSON ({e}); send the arguments object as "
                             'JSON text, e.g. "{\\"city\\": \\"Paris\\"}"', param) from None
        if not isinstance(arguments, dict):
            raise BadRequest(f"{param} is JSON {type(arguments).__name__}, not an object; "
                             "send the arguments object as JSON text", param)
        return {"id": call.id, "type": "function",
                "function": {"name": call.function.name, "arguments": arguments}}


def chat_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [m.as_dict(i) for i, m in enumerate(messages)]


_LEGACY_FIX = "use tools and tool_choice instead (the same functions, as tools)"


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra={  # top_logprobs > 0 needs logprobs: true
        "if": {"required": ["top_logprobs"],
               "properties": {"top_logprobs": {"type": "integer", "minimum": 1}}},
        "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
        **AT_MOST_ONE_GUIDED})

    messages: list[ChatMessage] = Field(min_length=1, description="at least one message")
    max_tokens: int | None = Field(None, ge=1, json_schema_extra={MAX: "max_tokens"},
                                   description="tokens to generate, >= 1; the messages + "
                                   "max_tokens must fit the context; omitted: the rest of it")
    max_completion_tokens: int | None = Field(None, ge=1, json_schema_extra={MAX: "max_tokens"},
                                              description="as max_tokens (and preferred)")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20, description="alternatives per token, "
                                     "0 to 20; needs logprobs: true")
    tools: list[Tool] | None = Field(None, description=(
        "functions the model may call; rendered through the model's chat template"))
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description=(
            'none: no calls; auto (the default with tools): the model decides, its calls are '
            'parsed; required: at least one call; {"type": "function", "function": {"name": '
            '...}}: exactly that call (required and named calls are constrained by a grammar, '
            "so their arguments always match the schema)"))
    parallel_tool_calls: bool | None = Field(None, description=(
        "false: at most one call per answer; omitted: true"))
    prompt_logprobs: int | None = Field(None, ge=0, le=20, description=(
        "vLLM's: the response's prompt_logprobs holds, per token of the rendered messages "
        "(the first: null), its logprob, its rank and this many alternatives, 0 to 20; not "
        "with stream"))
    modalities: list[Literal["text"]] | None = Field(None, description=(
        'output kinds: only ["text"] (this server makes no audio)'))
    audio: Annotated[dict[str, Any] | None, WithJsonSchema({"type": "null"})] = Field(
        None, description="not supported (no audio output): null")
    prediction: Annotated[dict[str, Any] | None, WithJsonSchema({"type": "null"})] = Field(
        None, description="predicted outputs are not supported: null")
    web_search_options: Annotated[dict[str, Any] | None, WithJsonSchema({"type": "null"})] = (
        Field(None, description="web search is not supported: null"))
    functions: Annotated[list[dict[str, Any]] | None, _ONLY_EMPTY] = Field(
        None, description="deprecated by OpenAI, not supported: use tools")
    function_call: Annotated[str | dict[str, Any] | None, _ONLY_NONE] = Field(
        None, description="deprecated by OpenAI, not supported: use tool_choice")

    def check(self) -> None:
        if self.functions:
            raise unsupported("functions (deprecated)", "functions", _LEGACY_FIX)
        if self.function_call not in (None, "none"):
            raise unsupported("function_call (deprecated)", "function_call", _LEGACY_FIX)
        for name, feature in (("audio", "audio output"), ("prediction", "predicted outputs"),
                              ("web_search_options", "web search")):
            if getattr(self, name) is not None:
                raise unsupported(feature, name, f"drop {name}")
        if self.top_logprobs and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        if self.prompt_logprobs is not None and self.stream:
            raise unsupported("prompt_logprobs with stream on chat completions",
                              "prompt_logprobs", "drop one of them (or use /v1/completions, "
                              "which streams them)")
        names = [t.function.name for t in self.tools or ()]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise BadRequest(f"tools name {dup[0]!r} more than once; give each function a "
                             "unique name", "tools")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise BadRequest(
                    f"tool_choice names function {choice.function.name!r}, which is not in "
                    f"tools ({', '.join(names) or 'none given'}); name one of them",
                    "tool_choice")
        elif choice == "required" and not names:
            raise BadRequest('tool_choice "required" needs tools: send at least one',
                             "tool_choice")


class TokenizeRequest(_Body):
    model_config = ConfigDict(json_schema_extra={"oneOf": [  # exactly one of the two
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]})

    model: str | None = None
    prompt: str | None = Field(None, description="text to tokenize as-is (no template)")
    messages: list[ChatMessage] | None = Field(None, min_length=1, description=(
        "messages to render with the chat template; send prompt or messages"))

    def check(self) -> None:
        if self.prompt is None and self.messages is None:
            raise BadRequest("send prompt (text) or messages (chat) to tokenize", "prompt")
        if self.prompt is not None and self.messages is not None:
            raise BadRequest("send prompt or messages, not both", "messages")


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId] = Field(description="token ids in [0, vocabulary size)")


# -- SamplingParams --------------------------------------------------------------------------
def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice ``index``'s seed: ``seed + index`` wrapped into [0, 2**64), which is how torch
    reads a negative seed too, so every seed in SEED_RANGE gives every choice a valid one."""
    return None if seed is None else (seed + index) % 2**64


def _logit_bias(bias: dict[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as sorted (id, bias) pairs."""
    out = []
    for key, value in (bias or {}).items():
        # (a length bound first: int() refuses strings of more than 4300 digits)
        if not (key.isascii() and key.isdigit() and len(key) < 19 and int(key) < vocab):
            raise BadRequest(f"logit_bias key {key!r} is not a token id of this model's "
                             f"vocabulary [0, {vocab}); keys are token ids as decimal "
                             f'strings, e.g. {{"{min(50, vocab - 1)}": -100}}', "logit_bias")
        if not _lb_lo <= value <= _lb_hi:
            raise BadRequest(f"logit_bias[{key!r}] is {value:g}; a bias must be in "
                             f"[{_lb_lo:g}, {_lb_hi:g}] (-100 bans the token, 100 all but "
                             "forces it)", "logit_bias")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


def sampling_params(req: SamplingFields, *, max_tokens: int, logprobs: int | None,
                    seed: int | None, guided: GuidedSpec | None, vocab: int,
                    defaults: dict[str, Any] | None = None,
                    prompt_logprobs: int | None = None,
                    tenant: str | None = None) -> SamplingParams:
    """SamplingParams for one choice of ``req``; ``vocab``: the engine's vocabulary size;
    ``defaults``: the engine's generation defaults for omitted fields (over KILN_DEFAULTS);
    ``prompt_logprobs``: alternatives per scored prompt token (None: none scored);
    ``tenant``: whose cache of earlier responses the request uses (None: the server's).
    Bad values raise BadRequest naming the field."""
    fill = {**KILN_DEFAULTS, **{k: v for k, v in (defaults or {}).items()
                                if k in KILN_DEFAULTS and v is not None}}
    picked = {k: fill[k] if getattr(req, k) is None else getattr(req, k) for k in KILN_DEFAULTS}
    outside = [t for t in req.stop_token_ids or () if t >= vocab]
    if outside:
        raise BadRequest(f"stop_token_ids {outside[:5]} are outside this model's vocabulary "
                         f"[0, {vocab}); send token ids below {vocab}", "stop_token_ids")
    kwargs: dict[str, Any] = {
        **picked, "top_k": max(int(picked["top_k"]), 0), "max_tokens": max_tokens,
        "seed": seed, "stop": (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
        "stop_token_ids": tuple(req.stop_token_ids or ()), "ignore_eos": req.ignore_eos,
        "frequency_penalty": req.frequency_penalty, "presence_penalty": req.presence_penalty,
        "logit_bias": _logit_bias(req.logit_bias, vocab), "logprobs": logprobs,
        "guided": guided, "prompt_logprobs": prompt_logprobs,
        "skip_special_tokens": req.skip_special_tokens, "tenant": tenant,
    }
    if req.lookahead is not None:
        names = {f.name for f in dataclasses.fields(SamplingParams)}
        if "lookahead" not in names:
            raise BadRequest("lookahead decoding is not supported by this server yet",
                             "lookahead", code="unsupported")
        la = req.lookahead
        kwargs["lookahead"] = (la.w, la.n, la.g)
    if req.max_draft_len is not None:
        kwargs["max_draft_len"] = req.max_draft_len
    try:
        return SamplingParams(**kwargs)
    except RequestError as e:
        raise BadRequest(str(e), _request_field(req, e.param)) from None
    except ValueError as e:  # untyped (a conversion): still a 400, naming no field
        raise BadRequest(str(e), None) from None


def _request_field(req: SamplingFields, param: str | None) -> str | None:
    """The request field behind SamplingParams field ``param``: the same name, except in
    chat, where logprobs comes from top_logprobs and max_tokens may come from
    max_completion_tokens."""
    if isinstance(req, ChatCompletionRequest):
        if param == "logprobs":
            return "top_logprobs"
        if param == "max_tokens" and req.max_completion_tokens is not None:
            return "max_completion_tokens"
    return param
