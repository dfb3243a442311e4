"""A JSON Schema's shape checked before it reaches the grammar compiler, so that a client's
400 names where in the schema the mistake is (xgrammar's messages name no path).

Only the keywords' own types are checked (``type`` names, ``required`` a list of strings,
bounds numbers, subschemas objects or booleans); unknown keywords are left alone. What passes
here can still fail to compile (an unresolvable ``$ref``): the caller then reports the
compiler's message.
"""

from __future__ import annotations

from typing import Any

TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")
_SUBSCHEMA = ("additionalProperties", "additionalItems", "contains", "not", "if", "then",
              "else", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_NUMBERS = ("minimum", "maximum", "multipleOf")
_NUMBER_OR_BOOL = ("exclusiveMinimum", "exclusiveMaximum")  # a bool in draft 4
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties",
           "maxProperties", "minContains", "maxContains")
_STRINGS = ("pattern", "$ref", "format")

Path = tuple[str | int, ...]


def dotted(path: Path) -> str:
    """``("properties", "a", "anyOf", 1)`` -> ``properties.a.anyOf[1]``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out.lstrip(".")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def schema_problem(schema: Any, path: Path = ()) -> tuple[Path, str] | None:
    """The first mistake in ``schema``: (its path, what is wrong and what is expected), or
    None when every keyword checked has the type JSON Schema gives it."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return path, (f"is {schema!r}, not a schema; a schema is an object (or true/false)")
    if "type" in schema:
        t = schema["type"]
        names = t if isinstance(t, list) else [t]
        if not names or any(n not in TYPES for n in names):
            return path + ("type",), (f"{t!r} is not a JSON Schema type; use one of "
                                      f"{', '.join(TYPES)} (or a list of them)")
    for key in _NUMBERS:
        if key in schema and not _number(schema[key]):
            return path + (key,), f"{schema[key]!r} is not a number; {key} takes a number"
    for key in _NUMBER_OR_BOOL:
        if key in schema and not (_number(schema[key]) or isinstance(schema[key], bool)):
            return path + (key,), f"{schema[key]!r} is not a number; {key} takes a number"
    for key in _COUNTS:
        v = schema.get(key)
        if key in schema and not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            return path + (key,), f"{v!r} is not a count; {key} takes an integer >= 0"
    for key in _STRINGS:
        if key in schema and not isinstance(schema[key], str):
            return path + (key,), f"{schema[key]!r} is not a string; {key} takes a string"
    if "required" in schema:
        req = schema["required"]
        if not isinstance(req, list) or not all(isinstance(n, str) for n in req):
            return path + ("required",), (f"{req!r} is not a list of property names; "
                                          'required takes one, e.g. ["city"]')
    if "enum" in schema and not isinstance(schema["enum"], list):
        return path + ("enum",), f"{schema['enum']!r} is not a list; enum takes a list of values"
    for key in _SUBSCHEMA_MAPS:
        if key not in schema:
            continue
        if not isinstance(schema[key], dict):
            return path + (key,), (f"{schema[key]!r} is not an object; {key} maps names to "
                                   "schemas")
        for name, sub in schema[key].items():
            if (problem := schema_problem(sub, path + (key, name))) is not None:
                return problem
    for key in _SUBSCHEMA_LISTS:
        if key not in schema:
            continue
        subs = schema[key]
        if not isinstance(subs, list) or not subs:
            return path + (key,), f"{subs!r} is not a list of schemas; {key} takes one"
        for i, sub in enumerate(subs):
            if (problem := schema_problem(sub, path + (key, i))) is not None:
                return problem
    if "items" in schema:  # a schema, or (draft 4) a list of them
        items = schema["items"]
        for i, sub in enumerate(items) if isinstance(items, list) else [(None, items)]:
            at = path + ("items",) + (() if i is None else (i,))
            if (problem := schema_problem(sub, at)) is not None:
                return problem
    for key in _SUBSCHEMA:
        if key in schema and (problem := schema_problem(schema[key], path + (key,))):
            return problem
    return None
