"""The draft model of a draft-model engine (speculative decoding mode "draft"): checks.

The draft proposes token ids that the target verifies, and it reads the target's tokens as
its own input, so both must mean the same thing by every id: the two tokenizers'
vocabularies must be equal (their embedding tables may be padded to different sizes:
Qwen2.5-0.5B has 151,936 rows, Qwen2.5-7B 152,064, for one tokenizer of 151,665 tokens).
The draft holds the KV of every token the target does, so its context must hold the
engine's max_seq_len. Everything here runs before any weight is read or any file written;
``kiln.builder.writer.build_engine`` builds the draft as ENGINE/draft.
"""

from __future__ import annotations

from typing import Any

from kiln.artifact.spec import Limits
from kiln.artifact.speculative import DRAFT_EXAMPLE
from kiln.errors import KilnError
from kiln.sources import SourceModel

# The draft engine's directory inside the target engine directory (speculative.draft_engine).
DRAFT_DIR = "draft"


def source_name(source: Any, model: SourceModel) -> str:
    """How error messages name a model: the source as the user typed it, else (an opened
    SourceModel was passed) what its provenance says."""
    if isinstance(source, str):
        return source
    prov = model.provenance
    if prov.get("kind") == "random":
        return f"random:{prov.get('preset')}:{prov.get('seed')}"
    return str(prov.get("alias") or prov.get("id") or prov.get("path") or prov.get("kind"))


def check_draft(
    target: SourceModel, draft: SourceModel, limits: Limits, *, target_name: str,
    draft_name: str,
) -> list[str]:
    """Raise KilnError unless ``draft`` can draft for ``target`` in an engine of ``limits``;
    return warnings for what works but drafts worse.

    Errors: the tokenizers' vocabularies differ; the draft's context (max_position_embeddings,
    sliding_window) is shorter than ``limits.max_seq_len``. Warning: other eos ids (the
    target verifies every token, eos included, so only it decides where a sequence ends).
    """
    check_same_tokenizer(target, draft, target_name=target_name, draft_name=draft_name)
    check_draft_context(draft, limits, target_name=target_name, draft_name=draft_name)
    warnings = []
    t_eos, d_eos = target.config.eos_token_ids, draft.config.eos_token_ids
    if set(t_eos) != set(d_eos):
        warnings.append(
            f"draft model {draft_name} has eos token ids {list(d_eos)}, target {target_name} "
            f"has {list(t_eos)}: the target's ids decide where a sequence ends (it verifies "
            f"every drafted token), the draft only drafts worse near an end; use a draft of the "
            f"target's family ({DRAFT_EXAMPLE}) if that matters"
        )
    return warnings


def check_same_tokenizer(
    target: SourceModel, draft: SourceModel, *, target_name: str, draft_name: str
) -> None:
    """KilnError unless the two tokenizers map the same tokens to the same ids."""
    t_vocab, d_vocab = _vocab(target, target_name), _vocab(draft, draft_name)
    if t_vocab == d_vocab:
        return
    examples = _differing_tokens(t_vocab, d_vocab)
    detail = (f"target {len(t_vocab):,} tokens vs draft {len(d_vocab):,}"
              if len(t_vocab) != len(d_vocab) else f"both {len(t_vocab):,} tokens")
    raise KilnError(
        f"draft model {draft_name} does not share the tokenizer of target {target_name} "
        f"(tokenizer vocabularies: {detail}; e.g. {'; '.join(examples)}): the target verifies "
        f"the draft's token ids, so both must use one tokenizer; pass a --draft-model from "
        f"the target's family that shares its tokenizer ({DRAFT_EXAMPLE})"
    )


def check_draft_context(
    draft: SourceModel, limits: Limits, *, target_name: str, draft_name: str
) -> None:
    """KilnError unless the draft attends to the engine's whole max_seq_len."""
    cfg = draft.config
    for what, n in (("max_position_embeddings", cfg.max_position_embeddings),
                    ("sliding_window", cfg.sliding_window)):
        if n is not None and n < limits.max_seq_len:
            raise KilnError(
                f"draft model {draft_name} has {what} {n:,}, shorter than the engine's "
                f"max_seq_len {limits.max_seq_len:,} (target {target_name}): the draft reads "
                f"every token of a sequence; pass --max-seq-len {n} or less, or a draft model "
                f"with a context of at least {limits.max_seq_len:,} tokens"
            )


def _vocab(model: SourceModel, name: str) -> dict[str, int]:
    try:
        return dict(model.tokenizer.get_vocab())
    except Exception as e:  # a tokenizer object without a vocabulary
        raise KilnError(
            f"cannot read the tokenizer vocabulary of {name} ({type(e).__name__}: {e}); a draft "
            f"model's tokenizer is compared with the target's: save a Hugging Face tokenizer "
            f"with the model"
        ) from e


def _differing_tokens(t: dict[str, int], d: dict[str, int], limit: int = 3) -> list[str]:
    """Up to ``limit`` tokens that differ, lowest id first, as "'tok' id 5 in the target,
    absent in the draft"."""
    inf = float("inf")
    differ = [tok for tok in set(t) | set(d) if t.get(tok) != d.get(tok)]
    differ.sort(key=lambda tok: (min(t.get(tok, inf), d.get(tok, inf)), tok))

    def where(v: dict[str, int], tok: str, who: str) -> str:
        return f"id {v[tok]} in the {who}" if tok in v else f"absent in the {who}"

    return [f"{tok!r} {where(t, tok, 'target')}, {where(d, tok, 'draft')}"
            for tok in differ[:limit]]
