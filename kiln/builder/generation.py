"""The engine's generation defaults: sampling values for the fields a request leaves out.

Like vLLM's ``--generation-config auto``, ``kiln build`` takes them from the model
(generation_config.json of a local or hub directory; a built-in alias's from its model card;
a GGUF file and random presets carry none) and records them in engine.json with where they
came from. ``--generation-config none`` records nothing: omitted fields then get kiln's own
defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.builder.speculative import SpeculativeConfig
from kiln.sources.base import GENERATION_FIELDS

GENERATION_CONFIG_MODES = ("auto", "none")

# A request with repetition_penalty != 1 decodes plainly (the speculative workers verify
# against unpenalized logits), so a recorded default would turn speculation off for all.
SPEC_DROP_REASON = ("a repetition penalty makes every request decode plainly, which would "
                    "turn off this engine's speculative decoding for requests that do not "
                    "set it")


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


def resolve_generation_defaults(
    values: dict[str, Any], source: str | None, mode: str, speculative: SpeculativeConfig
) -> tuple[GenerationDefaults, list[str]]:
    """(the section to record, warnings) from a source's raw ``values`` and ``source``.

    ``mode`` "none" records nothing; "auto" records ``values`` after checking them (a bad
    value fails the build: the file is wrong, or ``--generation-config none`` skips it).
    A speculative engine drops a repetition_penalty != 1 (see SPEC_DROP_REASON).
    """
    if mode not in GENERATION_CONFIG_MODES:
        raise ValueError(f"--generation-config {mode!r} is not supported; use one of "
                         f"{list(GENERATION_CONFIG_MODES)}")
    if mode == "none":
        return GenerationDefaults(source="none (--generation-config none)"), []
    if not values:
        return GenerationDefaults(source=f"none ({source or 'the source'} sets no sampling "
                                         "defaults)"), []
    checked = {}
    for name, value in values.items():
        try:
            checked[name] = check_value(name, value)
        except ValueError as e:
            raise ValueError(f"{e} (in {source}); fix it there or pass --generation-config "
                             "none to record no generation defaults") from None
    dropped: dict[str, dict[str, Any]] = {}
    warnings = []
    penalty = checked.get("repetition_penalty")
    if speculative.enabled and penalty is not None and penalty != 1.0:
        del checked["repetition_penalty"]
        dropped["repetition_penalty"] = {"value": penalty, "reason": SPEC_DROP_REASON}
        warnings.append(
            f"the model's default repetition_penalty {penalty:g} is not recorded: on this "
            f"{speculative.mode} engine {SPEC_DROP_REASON}; a request may still set it")
    return GenerationDefaults(checked, source or "the source", dropped), warnings
