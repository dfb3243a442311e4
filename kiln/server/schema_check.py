"""A tool's JSON Schema checked against the JSON Schema meta-schema (the ``jsonschema``
package) before it reaches the grammar compiler, so that a client's 400 names where in the
schema the mistake is (xgrammar's messages name no path). What passes here can still fail to
compile (an unresolvable ``$ref``): the caller then reports the compiler's message."""

from __future__ import annotations

from typing import Any

from jsonschema import SchemaError, validators

TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")

Path = tuple[str | int, ...]


def dotted(path: Path) -> str:
    """``("properties", "a", "anyOf", 1)`` -> ``properties.a.anyOf[1]``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out.lstrip(".")


def schema_problem(schema: Any) -> tuple[Path, str] | None:
    """The meta-schema's best complaint about ``schema``: (its path, what is wrong), or None.
    The draft is the one ``$schema`` names, else 2020-12."""
    if not isinstance(schema, (dict, bool)):
        return (), f"is {schema!r}, not a schema; a schema is an object (or true/false)"
    cls = validators.validator_for(schema, default=validators.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except SchemaError as e:
        path = tuple(e.path)
        what = e.message
        if path and path[-1] == "type":
            what += f"; a type is one of {', '.join(TYPES)} (or a list of them)"
        return path, what
    return None
