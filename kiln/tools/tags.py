"""Building blocks of the xgrammar structural tags the tool parsers state."""

from __future__ import annotations

import json
from typing import Any

# The most consecutive whitespace characters the arguments JSON may hold. One keeps the
# spaces models write after ":" and "," (`{"city": "Paris"}`) and, like kiln's other JSON
# grammars (compact), leaves a constrained model no whitespace to pad or loop on: 16 let a
# random-weight model fill 128 tokens with newlines before its first key.
MAX_JSON_WHITESPACE = 1


def quoted(name: str) -> str:
    """A function name as a JSON string, as the model writes it."""
    return json.dumps(name, ensure_ascii=False)


def arguments_schema(function: dict[str, Any]) -> dict[str, Any] | bool:
    """The JSON schema of a function's arguments: its "parameters", any object when none."""
    params = function.get("parameters")
    return params if params else {"type": "object"}


def arguments_format(function: dict[str, Any]) -> dict[str, Any]:
    """The content format of one call's arguments."""
    return {"type": "json_schema", "json_schema": arguments_schema(function),
            "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def call_tag(begin: str, function: dict[str, Any], end: str) -> dict[str, Any]:
    """``begin`` + the function's arguments (matching its schema) + ``end``."""
    return {"type": "tag", "begin": begin, "content": arguments_format(function), "end": end}


def chosen(functions: list[dict[str, Any]], mode: str, name: str | None) -> list[dict[str, Any]]:
    """The functions a mode allows: all of them, or only ``name`` for "named"."""
    if mode not in ("auto", "required", "named"):
        raise ValueError(f"tool mode {mode!r} is unknown; use one of auto, required, named")
    if mode == "named":
        picked = [f for f in functions if f["name"] == name]
        if not picked:
            raise ValueError(f"tool {name!r} is not among the request's functions")
        return picked[:1]
    if not functions:
        raise ValueError("tool calls need at least one function")
    return list(functions)


def calls(tags: list[dict[str, Any]], separator: str, parallel: bool) -> dict[str, Any]:
    """One or more of ``tags`` (only one unless ``parallel``), ``separator`` between them,
    nothing else."""
    return {"type": "tags_with_separator", "tags": tags, "separator": separator,
            "at_least_one": True, "stop_after_first": not parallel}


def structural_tag(fmt: dict[str, Any]) -> dict[str, Any]:
    """The top-level structural tag around a format."""
    return {"type": "structural_tag", "format": fmt}
