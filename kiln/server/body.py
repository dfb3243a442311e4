"""A request body from bytes to a validated request model, or a BadRequest naming the field.

Python's json module reads more than JSON: NaN, Infinity, 1e400 (as inf), lone UTF-16
surrogates ("\\ud800") and nesting as deep as the recursion limit. Each of those breaks
something later (the tokenizer, UTF-8 encoding of a response, pydantic, xgrammar), so
``check_json`` rejects them first, naming where they are; then pydantic validates, and its
first error becomes one message with the field, the rule, the value and the accepted range
(the field's description).
"""

from __future__ import annotations

import json
import math
import types
import typing
from typing import Annotated, Any

from pydantic import BaseModel, ValidationError

from kiln.server.protocol import BadRequest

# Deepest nesting a body may have. OpenAI bodies nest ~6 levels, a json_schema in
# response_format some more; deeper ones are rejected before anything recurses over them.
MAX_JSON_DEPTH = 64


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """``raw`` (a JSON object) as a validated ``model``; the model's ``check()`` runs too."""
    try:
        data = json.loads(raw, parse_float=_number)
    except RecursionError:
        raise BadRequest(f"the request body is nested more than {MAX_JSON_DEPTH} levels "
                         f"deep; kiln accepts at most {MAX_JSON_DEPTH}", None) from None
    except ValueError as e:
        what = "is empty" if not raw.strip() else f"is not valid JSON ({e})"
        raise BadRequest(f"the request body {what}; send a JSON object, UTF-8 encoded",
                         None) from None
    if not isinstance(data, dict):
        raise BadRequest(f"the request body is a JSON {_JSON_TYPES[type(data)]}; send a JSON "
                         "object of the request's fields", None)
    check_json(data)
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        raise describe_error(model, e.errors()[0]) from None
    body.check()
    return body


_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def _number(literal: str) -> float | int:
    """A JSON number with a fraction or exponent: an int when its value is integral. JSON
    (and JSON Schema's "integer") does not tell 5.0 from 5; the models are strict, so 5.0
    must reach them as 5. Beyond 2**63 it stays a float (an int field rejects it)."""
    f = float(literal)
    return int(f) if f.is_integer() and abs(f) < 2**63 else f


def json_path(path: tuple[str | int, ...]) -> str | None:
    """("messages", 0, "content") -> "messages[0].content"."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def check_json(data: Any) -> None:
    """Reject nesting deeper than MAX_JSON_DEPTH, lone surrogates and non-finite numbers
    anywhere in ``data``. Iterative, so any depth json.loads returns is safe here."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
            continue
        if isinstance(value, float):
            if not math.isfinite(value):
                raise BadRequest(f"{json_path(path)} is {json.dumps(value)}, which is not a "
                                 "finite number (NaN, Infinity and numbers beyond 1.8e308 "
                                 "are not JSON); send a finite number", json_path(path))
            continue
        if not isinstance(value, (dict, list)):
            continue
        if len(path) >= MAX_JSON_DEPTH:
            raise BadRequest(f"the request body is nested more than {MAX_JSON_DEPTH} levels "
                             f"deep under {json_path(path[:1])}; kiln accepts at most "
                             f"{MAX_JSON_DEPTH}", json_path(path[:1]))
        if isinstance(value, dict):
            for k, v in value.items():
                _check_text(k, path)
                stack.append((v, (*path, k)))
        else:
            stack.extend((v, (*path, i)) for i, v in enumerate(value)
                         if type(v) is not int)  # token-id lists: nothing to check


def _check_text(s: str, path: tuple[str | int, ...]) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        where = json_path(path) or "a key of the body"
        raise BadRequest(
            f"{where} contains a lone UTF-16 surrogate \\u{ord(s[e.start]):04x} at character "
            f"{e.start}, which is not a character and has no UTF-8 encoding; send valid "
            "Unicode (a character above U+FFFF is escaped as a surrogate pair, e.g. "
            "\\ud83d\\ude00)", json_path(path)) from None


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (through Optional, unions, list[...])."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list, Annotated):
        return [m for a in typing.get_args(annotation) for m in _models_in(a)]
    return []


def describe_error(model: type[BaseModel], err: dict) -> BadRequest:
    """A BadRequest for one pydantic error. The param is the path of model fields (union
    member tags and dict keys dropped, list indices too, as in "messages.role"); the message
    adds the value and the field's description, which states what is accepted."""
    names: list[str] = []
    current: type[BaseModel] | None = model
    info = None
    for part in err.get("loc", ()):
        if isinstance(part, int):
            continue
        if current is None:
            break  # inside a plain value: a dict's keys, a union member's items
        fields = {f.alias or n: f for n, f in current.model_fields.items()}
        if part not in fields:
            continue  # a union member tag: "str", "list[int]", "function-after[...]"
        info = fields[part]
        names.append(part)
        models = _models_in(info.annotation)
        current = models[0] if len(models) == 1 else None
    param = ".".join(names) or None
    msg = err.get("msg", "invalid value")
    if err.get("type") == "value_error":  # a validator's ValueError: its own words
        msg = str(err.get("ctx", {}).get("error", msg))
    text = f"{param or 'body'}: {msg}"
    if "input" in err and param and err.get("type") != "missing":
        text += f" (got {json.dumps(err['input'])[:100]})"
    if info is not None and info.description:
        text += f"; expected: {info.description}"
    return BadRequest(text, param)
