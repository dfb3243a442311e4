"""engine.json ``generation_defaults``: sampling values for the fields a request leaves out.

``kiln build`` records them (kiln.builder.generation decides which); serve and generate use
them for omitted fields. Every recorded value passes SamplingParams' own checks, so a default
can never fail a request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.sources.base import GENERATION_FIELDS


def check_value(name: str, value: Any) -> float | int:
    """``value`` as the type SamplingParams takes for ``name``, within the runtime's bounds
    (SamplingParams' own checks: a recorded default must never fail a request);
    ValueError names the rule."""
    if name not in GENERATION_FIELDS:
        raise ValueError(f"generation default {name!r} is not one of {list(GENERATION_FIELDS)}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"generation default {name}={value!r} is not a number")
    if name == "top_k":
        if value != int(value):
            raise ValueError(f"generation default top_k={value!r} is not an integer")
        value = max(int(value), 0)  # -1 (vLLM) and 0 (transformers) both mean "off"
    else:
        value = float(value)
    from kiln.runtime.sampling_params import SamplingParams

    try:
        SamplingParams(**{name: value})
    except ValueError as e:
        raise ValueError(f"generation default {e}") from None
    return value


@dataclass(frozen=True)
class GenerationDefaults:
    """engine.json ``generation_defaults``: ``values`` (field -> value, the fields of
    GENERATION_FIELDS) fill what a request omits; ``source`` says where they came from;
    ``dropped`` lists values the model has that the engine does not apply, each
    {"value", "reason"}. Engines built before the section have none of it (``values`` {})."""

    values: dict[str, float | int] = field(default_factory=dict)
    source: str = "none"
    dropped: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "values",
                           {k: check_value(k, v) for k, v in dict(self.values).items()})

    def to_dict(self) -> dict[str, Any]:
        return {"values": dict(self.values), "source": self.source,
                "dropped": {k: dict(v) for k, v in self.dropped.items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GenerationDefaults:
        """Fields this kiln does not know (a newer kiln's) are left out, not an error."""
        values = {k: v for k, v in (d.get("values") or {}).items() if k in GENERATION_FIELDS}
        return cls(values=values, source=str(d.get("source", "none")),
                   dropped=dict(d.get("dropped") or {}))
