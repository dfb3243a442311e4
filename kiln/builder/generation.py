"""Which generation defaults ``kiln build`` records (the section: kiln.artifact.generation).

Like vLLM's ``--generation-config auto``, ``kiln build`` takes them from the model
(generation_config.json of a local or hub directory; a built-in alias's from its model card;
a GGUF file and random presets carry none) and records them in engine.json with where they
came from. ``--generation-config none`` records nothing: omitted fields then get kiln's own
defaults.
"""

from __future__ import annotations

from typing import Any

from kiln.artifact.generation import GenerationDefaults, check_value
from kiln.artifact.speculative import SpeculativeConfig

GENERATION_CONFIG_MODES = ("auto", "none")

# A request with repetition_penalty != 1 decodes plainly (the speculative workers verify
# against unpenalized logits), so a recorded default would turn speculation off for all.
SPEC_DROP_REASON = ("a repetition penalty makes every request decode plainly, which would "
                    "turn off this engine's speculative decoding for requests that do not "
                    "set it")


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
