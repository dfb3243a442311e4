"""Speculative decoding settings recorded in engine.json (validated once, at build).

The lookahead window (W, N, G) is the single source of truth: ``max_draft_len`` is derived
from it and recorded beside it, so the serving side never asks for the window a second time
(TensorRT-LLM's "16 != 40" failure, DESIGN.md section 3). Pure Python, no torch.

    max_draft_len(W, N, G) = (N-2 if N>1 else 0) + (W-1+G)*(N-1)
    tokens_per_step        = max_draft_len + 1        # = (W+G)(N-1) for N>1

Mode "draft": a small model of the target's tokenizer drafts K = max_draft_len tokens per
step (1 <= K <= MAX_DRAFT_MODEL_LEN). ``kiln build`` builds it as a complete engine
directory inside the target's (``draft_engine``, always "draft") and records the sha256 of
its engine.json (``draft_sha256``), which lists the draft's weight checksums in turn.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kiln.errors import RequestError

MODES = ("none", "lookahead", "ngram", "draft", "suffix")
# Most tokens a draft model proposes per step: each is one sequential forward of the draft,
# so past a few the acceptance rate (the product of per-token agreement) no longer pays.
MAX_DRAFT_MODEL_LEN = 16
# `kiln build --speculative-decoding-mode` spellings of the modes (after lower-casing, "-"
# to "_").
MODE_ALIASES = {
    "lookahead_decoding": "lookahead",
    "prompt_lookup": "ngram",
    "draft_target": "draft",
    "draft_model": "draft",
    "suffix_decoding": "suffix",
}
# Mode "suffix" (suffix decoding): a suffix tree of bounded depth over the request's prompt
# and output, and one over a bounded cache of earlier responses. The depth bounds the match
# plus the draft (a path of the tree); the cache is counted in responses (memory: about
# tokens x depth tree nodes per response, so it is the one size that bounds it).
DEFAULT_LOOKAHEAD = (7, 7, 7)  # a lookahead engine's window when the build names none
SUFFIX_DEFAULTS = {"max_draft_len": 16, "suffix_tree_depth": 24, "suffix_min_match": 2,
                   "suffix_cache_requests": 256}
MAX_SUFFIX_TREE_DEPTH = 64
SUFFIX_FIELDS = ("suffix_tree_depth", "suffix_min_match", "suffix_cache_requests")
SUFFIX_FLAGS = {"suffix_tree_depth": "--suffix-tree-depth",
                "suffix_min_match": "--suffix-min-match",
                "suffix_cache_requests": "--suffix-cache-requests"}
DRAFT_EXAMPLE = "e.g. --draft-model qwen2.5-coder-0.5b for qwen2.5-coder-1.5b"
FORMULA = "max_draft_len = (N-2 if N>1 else 0) + (W-1+G)*(N-1)"
PLAIN = (1, 1, 0)


def max_draft_len(w: int, n: int, g: int) -> int:
    """Draft tokens per sequence per step for a lookahead window (W, N, G)."""
    return (n - 2 if n > 1 else 0) + (w - 1 + g) * (n - 1)


_draft_len_of = max_draft_len  # from_cli's parameter shadows the name


def tokens_per_step(w: int, n: int, g: int) -> int:
    """Tokens fed per sequence per step: x + lookahead branch + candidates."""
    return max_draft_len(w, n, g) + 1


def triples_for(draft_len: int, limit: int = 6) -> list[tuple[int, int, int]]:
    """(W, N, G) triples whose max_draft_len is ``draft_len``, most balanced first.

    Only triples that speculate (G >= 1) are listed, except (1, 1, 0) for length 0.
    Order: W == G >= 2 first (the paper's choice), then by spread max(W,N,G) - min(W,N,G),
    then smaller N. For 39: (5,5,5), (4,6,4), (10,3,10), (2,11,2), (20,2,20), ...
    """
    if draft_len < 0:
        return []
    if draft_len == 0:
        return [PLAIN]
    t = draft_len + 1  # = (W+G)(N-1)
    found = []
    for n1 in range(1, t + 1):
        if t % n1:
            continue
        s = t // n1  # W + G
        for g in range(1, s):
            w = s - g
            found.append((w, n1 + 1, g))
    found.sort(key=lambda x: (x[0] != x[2] or x[0] < 2, max(x) - min(x), x[1], -x[0]))
    return found[:limit]


def _fmt(t: tuple[int, int, int]) -> str:
    return "({},{},{})".format(*t)


def _fmt_triples(draft_len: int) -> str:
    ts = [_fmt(t) for t in triples_for(draft_len, limit=4)]
    if not ts:
        return f"no (W,N,G) gives {draft_len}"
    listed = ts[0] if len(ts) == 1 else ", ".join(ts[:-1]) + " or " + ts[-1]
    return f"{listed} give{'s' if len(ts) == 1 else ''} {draft_len}"


def _suggest(draft_len: int) -> str:
    ts = triples_for(draft_len, limit=1)
    return f", e.g. --lookahead-config {','.join(map(str, ts[0]))}" if ts else ""


def check_window(w: int, n: int, g: int, what: str = "lookahead config",
                 flag: str | None = "--lookahead-config") -> None:
    """Raise ValueError unless (W, N, G) is a valid lookahead window. ``what`` names the
    value in the message, ``flag`` the option the fix suggests (None: a request's field)."""
    t = _fmt((w, n, g))
    use = f"{flag} " if flag else "lookahead (w,n,g) = "
    if w < 1 or n < 1 or g < 0:
        raise ValueError(
            f"{what} {t} is invalid: W and N must be >= 1 and G >= 0; "
            f"use e.g. {use}5,5,5 (or 1,1,0 for plain decoding)"
        )
    if n == 1 and (w != 1 or g != 0):
        raise ValueError(
            f"{what} {t} is invalid: N == 1 (no n-grams) requires W == 1 and G == 0; "
            f"use {use}1,1,0 for plain decoding or N >= 2 to speculate, e.g. 5,5,5"
        )


def parse_window(text: str, flag: str = "--lookahead-config") -> tuple[int, int, int]:
    """Parse "W,N,G" into a validated triple; errors name ``flag``, the option the user
    typed it into (--lookahead-config at build, --lookahead on a request)."""
    parts = [p.strip() for p in str(text).strip().strip("()[]").split(",")]
    try:
        if len(parts) != 3:
            raise ValueError
        w, n, g = (int(p) for p in parts)
    except ValueError:
        raise ValueError(
            f"{flag} {text!r} is malformed: expected three integers W,N,G "
            f"(window size, n-gram size, verification set size), e.g. {flag} 5,5,5"
        ) from None
    check_window(w, n, g, flag, flag)
    return w, n, g


def _check_match(ngram_match: int | None) -> int:
    """--ngram-match (default 3): the longest n-gram prompt lookup matches against the
    context (mode ngram, and lookahead's prompt-lookup candidate)."""
    nm = 3 if ngram_match is None else ngram_match
    if nm < 1:
        raise ValueError(
            f"--ngram-match {ngram_match} is invalid: the longest n-gram matched against "
            f"the context must be >= 1; pass e.g. --ngram-match 3"
        )
    return nm


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding as recorded in engine.json.

    mode "none" | "lookahead" | "ngram" | "draft" | "suffix". Lookahead records its (W, N, G) window
    and the max_draft_len it implies; ngram (prompt lookup) records max_draft_len; both record
    the n-gram match sizes prompt lookup tries, longest first (ngram_max_match down to
    ngram_min_match: lookahead's prompt-lookup candidate, in one of its G slots).
    Draft records max_draft_len (K, 1..MAX_DRAFT_MODEL_LEN) and its draft model:
    ``draft_model`` the source as the user gave it (provenance only), ``draft_engine`` the
    draft engine's directory inside the engine directory ("draft") and ``draft_sha256`` the
    sha256 of that directory's engine.json. The builder fills the last two (``from_cli``
    leaves them None); the three are None in the other modes and then left out of
    engine.json.
    Suffix records max_draft_len (the most draft tokens per step), ``suffix_tree_depth``
    (the longest path of its suffix trees: match + draft <= depth), ``suffix_min_match``
    (the shortest match that drafts) and ``suffix_cache_requests`` (earlier responses kept
    in the shared cache, oldest evicted first); the three are None in the other modes and
    then left out of engine.json.
    Build it through ``from_cli`` (validates); the constructor only checks consistency.
    """

    mode: str = "none"
    max_draft_len: int = 0
    lookahead: tuple[int, int, int] | None = None
    ngram_max_match: int = 3
    ngram_min_match: int = 1
    draft_model: str | None = None
    draft_engine: str | None = None
    draft_sha256: str | None = None
    suffix_tree_depth: int | None = None
    suffix_min_match: int | None = None
    suffix_cache_requests: int | None = None

    def __post_init__(self) -> None:
        if self.lookahead is not None and not isinstance(self.lookahead, tuple):
            object.__setattr__(self, "lookahead", tuple(self.lookahead))
        if self.mode not in MODES:
            raise ValueError(
                f"speculative decoding mode {self.mode!r} is unknown: valid modes are "
                f"{', '.join(MODES)}; pass --speculative-decoding-mode with one of them"
            )
        if self.mode == "lookahead":
            if self.lookahead is None:
                raise ValueError(
                    "speculative decoding mode 'lookahead' records no (W,N,G) window: "
                    "the engine must store it; pass --lookahead-config W,N,G"
                )
            check_window(*self.lookahead)
            need = max_draft_len(*self.lookahead)
            if self.max_draft_len != need:
                raise ValueError(
                    f"max_draft_len {self.max_draft_len} does not match lookahead "
                    f"{_fmt(self.lookahead)}, which needs {need} ({FORMULA}); "
                    f"{_fmt_triples(self.max_draft_len)}"
                )
        elif self.lookahead is not None:
            raise ValueError(
                f"lookahead window {_fmt(self.lookahead)} is set but mode is {self.mode!r}; "
                f"pass --speculative-decoding-mode lookahead or drop the window"
            )
        if self.mode == "none" and self.max_draft_len != 0:
            raise ValueError(
                f"max_draft_len {self.max_draft_len} is set but speculative decoding mode is "
                f"'none'; pass --speculative-decoding-mode lookahead or ngram, or drop it"
            )
        if self.mode == "ngram" and self.max_draft_len < 1:
            raise ValueError(
                f"ngram speculative decoding needs max_draft_len >= 1, got "
                f"{self.max_draft_len}; pass e.g. --max-draft-len 4"
            )
        if self.mode == "suffix":
            self._check_suffix()
        else:
            for name in SUFFIX_FIELDS:
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name} {getattr(self, name)} is set but speculative decoding mode is "
                        f"{self.mode!r}: it applies to mode 'suffix'; pass "
                        f"--speculative-decoding-mode suffix or drop {SUFFIX_FLAGS[name]}"
                    )
        if self.mode == "draft":
            self._check_draft()
        else:
            for name in ("draft_model", "draft_engine", "draft_sha256"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name} {getattr(self, name)!r} is set but speculative decoding mode "
                        f"is {self.mode!r}: a draft model applies to mode 'draft'; pass "
                        f"--speculative-decoding-mode draft or drop --draft-model"
                    )
        if not 1 <= self.ngram_min_match <= self.ngram_max_match:
            raise ValueError(
                f"ngram match sizes min {self.ngram_min_match} / max {self.ngram_max_match} "
                f"are invalid: need 1 <= min <= max; pass e.g. --ngram-match 3"
            )

    def _check_suffix(self) -> None:
        """Mode "suffix": every setting recorded and in range, match + draft within the
        tree's depth. Messages name the build flag, since ``from_cli`` reports through here."""
        for name in SUFFIX_FIELDS:
            if getattr(self, name) is None:
                raise ValueError(
                    f"speculative decoding mode 'suffix' records no {name}: the engine must "
                    f"store it; rebuild with {SUFFIX_FLAGS[name]} (default "
                    f"{SUFFIX_DEFAULTS[name]})"
                )
        depth, match, k = self.suffix_tree_depth, self.suffix_min_match, self.max_draft_len
        if not 2 <= depth <= MAX_SUFFIX_TREE_DEPTH:
            raise ValueError(
                f"--suffix-tree-depth {depth} is invalid: the suffix trees' depth (the longest "
                f"match plus draft) must be 2 to {MAX_SUFFIX_TREE_DEPTH} (memory grows with "
                f"it); pass e.g. --suffix-tree-depth {SUFFIX_DEFAULTS['suffix_tree_depth']}"
            )
        if not 1 <= match < depth:
            raise ValueError(
                f"--suffix-min-match {match} is invalid: the shortest match that drafts must "
                f"be >= 1 and leave room for a draft token in --suffix-tree-depth {depth} "
                f"(1 to {depth - 1}); pass e.g. --suffix-min-match 2"
            )
        if not 1 <= k <= depth - match:
            raise ValueError(
                f"--max-draft-len {k} is invalid for mode 'suffix': a draft follows a match of "
                f"at least --suffix-min-match {match} on a tree path of at most "
                f"--suffix-tree-depth {depth} tokens, so 1 <= max_draft_len <= {depth - match}; "
                f"pass --max-draft-len {min(max(k, 1), depth - match)} or a deeper tree "
                f"(--suffix-tree-depth {k + match})"
            )
        if self.suffix_cache_requests < 0:
            raise ValueError(
                f"--suffix-cache-requests {self.suffix_cache_requests} is invalid: the shared "
                f"cache keeps that many earlier responses and must be >= 0 (0: the request's "
                f"own text only); pass e.g. --suffix-cache-requests "
                f"{SUFFIX_DEFAULTS['suffix_cache_requests']}"
            )

    def _check_draft(self) -> None:
        """Mode "draft": K in range, a draft model named, a plain draft directory name."""
        k = self.max_draft_len
        if not 1 <= k <= MAX_DRAFT_MODEL_LEN:
            raise ValueError(
                f"max_draft_len {k} is invalid for speculative decoding mode 'draft': the "
                f"draft model proposes 1 to {MAX_DRAFT_MODEL_LEN} tokens per step; pass e.g. "
                f"--max-draft-len 4"
            )
        if not self.draft_model:
            raise ValueError(
                "speculative decoding mode 'draft' records no draft model: the engine must "
                f"name it; pass --draft-model SOURCE ({DRAFT_EXAMPLE})"
            )
        name = self.draft_engine
        if name is not None and (not name or name in (".", "..") or "/" in name
                                 or "\\" in name):
            raise ValueError(
                f"draft_engine {name!r} is invalid: it is the name of the draft engine's "
                f"directory inside the engine directory (kiln build writes 'draft'); rebuild "
                f"the engine"
            )
        sha = self.draft_sha256
        if sha is not None and (len(sha) != 64 or any(c not in "0123456789abcdef"
                                                        for c in sha)):
            raise ValueError(
                f"draft_sha256 {sha!r} is invalid: it must be the 64 lower-case hex digits "
                f"of the sha256 of the draft engine's engine.json; rebuild the engine"
            )

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def request_draft_len(self) -> bool:
        """Whether a request may send ``max_draft_len`` (0 to the engine's): modes whose
        draft (a draft model's chain, suffix decoding's tree) holds up to max_draft_len
        tokens chosen per step."""
        return self.mode in ("draft", "suffix")

    @property
    def tokens_per_step(self) -> int:
        """Tokens fed per sequence per decode step (1 without speculation)."""
        return self.max_draft_len + 1

    def to_dict(self) -> dict[str, Any]:
        """engine.json's section; the draft fields only when set (mode "draft"), so the
        other modes' section is what kiln wrote before draft models existed."""
        d = dataclasses.asdict(self)
        if self.lookahead is not None:
            d["lookahead"] = list(self.lookahead)
        for name in ("draft_model", "draft_engine", "draft_sha256", *SUFFIX_FIELDS):
            if d[name] is None:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        d = dict(d)
        if d.get("lookahead") is not None:
            d["lookahead"] = tuple(d["lookahead"])
        return cls(**d)

    @classmethod
    def from_cli(
        cls,
        mode: str,
        lookahead_config: str | None = None,
        max_draft_len: int | None = None,
        ngram_match: int | None = None,
        beam_width: int = 1,
        draft_model: str | None = None,
        suffix: dict[str, int | None] | None = None,
    ) -> SpeculativeConfig:
        """Validate the build flags and return the config recorded in engine.json.

        Mode "draft" (also "draft_target", "draft_model", "draft-target") needs
        ``draft_model`` (--draft-model) and ``max_draft_len`` 1..MAX_DRAFT_MODEL_LEN; its
        ``draft_engine`` and ``draft_sha256`` are left None for the builder to fill.
        Mode "suffix" (also "suffix_decoding") takes ``suffix`` {field: value or None}
        (SUFFIX_FIELDS; None: SUFFIX_DEFAULTS) and ``max_draft_len`` (None: the default).
        Raises ValueError with a message naming the flag, its value, the rule and the fix.
        """
        mode_in = mode
        mode = (mode or "none").strip().lower().replace("-", "_")
        mode = MODE_ALIASES.get(mode, mode)
        if mode not in MODES:
            raise ValueError(
                f"--speculative-decoding-mode {mode_in!r} is unknown: valid modes are "
                f"{', '.join(MODES)}"
            )
        if draft_model is not None:
            draft_model = str(draft_model)
        suffix = {k: v for k, v in (suffix or {}).items() if v is not None}
        if suffix and mode != "suffix":
            flags = " and ".join(f"{SUFFIX_FLAGS[k]} {v}" for k, v in suffix.items())
            raise ValueError(
                f"{flags} given but speculative decoding mode is {mode!r}: they apply to "
                f"mode 'suffix'; pass --speculative-decoding-mode suffix or drop them"
            )
        if mode == "none":
            given = [
                f for f, v in (
                    ("--lookahead-config", lookahead_config),
                    ("--max-draft-len", max_draft_len),
                    ("--ngram-match", ngram_match),
                    (f"--draft-model {draft_model}", draft_model),
                ) if v is not None
            ]
            if given:
                modes = ("draft (with --draft-model SOURCE and --max-draft-len K)"
                         if draft_model is not None else "lookahead (or ngram, or draft)")
                raise ValueError(
                    f"{' and '.join(given)} given but speculative decoding mode is 'none'; "
                    f"pass --speculative-decoding-mode {modes} to use them"
                )
            return cls()
        if beam_width != 1:
            raise ValueError(
                f"--max-beam-width {beam_width} cannot be combined with speculative decoding "
                f"mode {mode!r}: speculative decoding needs beam width 1; pass "
                f"--max-beam-width 1 or --speculative-decoding-mode none"
            )
        if draft_model is not None and mode != "draft":
            raise ValueError(
                f"--draft-model {draft_model} applies to mode 'draft', not {mode!r}; pass "
                f"--speculative-decoding-mode draft to draft with it, or drop --draft-model"
            )
        if mode == "suffix":
            for flag, value in (("--lookahead-config", lookahead_config),
                                ("--ngram-match", ngram_match)):
                if value is not None:
                    raise ValueError(
                        f"{flag} {value} does not apply to mode 'suffix' (its match length "
                        f"adapts, from --suffix-min-match up); drop it"
                    )
            k = SUFFIX_DEFAULTS["max_draft_len"] if max_draft_len is None else max_draft_len
            return cls(mode="suffix", max_draft_len=k,
                       **{name: suffix.get(name, SUFFIX_DEFAULTS[name]) for name in SUFFIX_FIELDS})
        if mode == "draft":
            return cls._draft_from_cli(lookahead_config, max_draft_len, ngram_match,
                                       draft_model)
        if mode == "lookahead":
            if lookahead_config is None and max_draft_len is None:
                # the measured default (docs/decisions.md, "Lookahead window (7,7,7)")
                lookahead_config = ",".join(map(str, DEFAULT_LOOKAHEAD))
            if lookahead_config is None:
                raise ValueError(
                    f"--max-draft-len {max_draft_len} alone does not define a lookahead "
                    f"window: the engine must record (W,N,G) and derives max_draft_len from "
                    f"it ({FORMULA}); {_fmt_triples(max_draft_len)}; pass --lookahead-config "
                    f"W,N,G instead{_suggest(max_draft_len)}"
                )
            window = parse_window(lookahead_config)
            if window == PLAIN:
                raise ValueError(
                    "--lookahead-config (1,1,0) is plain decoding: it never speculates; pass "
                    "--speculative-decoding-mode none, or a window that speculates such as 5,5,5"
                )
            need = _draft_len_of(*window)
            if max_draft_len is not None and max_draft_len != need:
                raise ValueError(
                    f"--max-draft-len {max_draft_len} does not match --lookahead-config "
                    f"{_fmt(window)}, which needs {need} ({FORMULA}); "
                    f"{_fmt_triples(max_draft_len)}; drop --max-draft-len or pass a matching "
                    f"--lookahead-config"
                )
            return cls(mode="lookahead", max_draft_len=need, lookahead=window,
                       ngram_max_match=_check_match(ngram_match), ngram_min_match=1)
        # ngram (prompt lookup)
        if lookahead_config is not None:
            raise ValueError(
                f"--lookahead-config {lookahead_config} applies to mode 'lookahead', not "
                f"'ngram'; pass --speculative-decoding-mode lookahead or drop it"
            )
        if max_draft_len is None or max_draft_len < 1:
            raise ValueError(
                f"--max-draft-len {max_draft_len} is invalid for mode 'ngram': it needs "
                f"max_draft_len >= 1 (tokens proposed per step); pass e.g. --max-draft-len 4"
            )
        return cls(mode="ngram", max_draft_len=max_draft_len,
                   ngram_max_match=_check_match(ngram_match), ngram_min_match=1)

    @classmethod
    def _draft_from_cli(
        cls,
        lookahead_config: str | None,
        max_draft_len: int | None,
        ngram_match: int | None,
        draft_model: str | None,
    ) -> SpeculativeConfig:
        """``from_cli`` for mode "draft" (the mode and beam width are checked)."""
        if lookahead_config is not None:
            raise ValueError(
                f"--lookahead-config {lookahead_config} applies to mode 'lookahead', not "
                f"'draft' (a draft model proposes --max-draft-len tokens per step); drop it"
            )
        if ngram_match is not None:
            raise ValueError(
                f"--ngram-match {ngram_match} applies to mode 'ngram', not 'draft' (a draft "
                f"model proposes --max-draft-len tokens per step); drop it"
            )
        if not draft_model or not draft_model.strip():
            both = max_draft_len is None
            raise ValueError(
                f"speculative decoding mode 'draft' needs --draft-model SOURCE"
                f"{' and --max-draft-len K' if both else ''}: a smaller model sharing the "
                f"target's tokenizer that drafts the tokens the target verifies; pass "
                f"{DRAFT_EXAMPLE}{' --max-draft-len 4' if both else ''}"
            )
        if max_draft_len is None:
            raise ValueError(
                f"speculative decoding mode 'draft' needs --max-draft-len K: the tokens the "
                f"draft model {draft_model} proposes per step, 1 to {MAX_DRAFT_MODEL_LEN}; "
                f"pass e.g. --max-draft-len 4"
            )
        if not 1 <= max_draft_len <= MAX_DRAFT_MODEL_LEN:
            raise ValueError(
                f"--max-draft-len {max_draft_len} is invalid for mode 'draft': it needs "
                f"1 <= max_draft_len <= {MAX_DRAFT_MODEL_LEN} (each draft token is one "
                f"sequential forward of the draft model); pass e.g. --max-draft-len 4"
            )
        return cls(mode="draft", max_draft_len=max_draft_len, draft_model=draft_model)


def check_limits(
    spec: SpeculativeConfig,
    *,
    max_batch_size: int,
    max_seq_len: int,
    max_input_len: int,
    max_num_tokens: int,
) -> list[str]:
    """Cross-check speculative settings against the engine limits.

    Raises ValueError when the engine could not run one speculative step; returns
    warnings (strings) for settings that work but waste the speculation.
    """
    warnings: list[str] = []
    t = spec.tokens_per_step
    what = f"speculative mode {spec.mode!r}" + (
        f" lookahead {_fmt(spec.lookahead)}" if spec.lookahead else "") + (
        f" (max_draft_len {spec.max_draft_len}, {t} tokens per sequence per step)")
    if max_num_tokens < t:
        raise ValueError(
            f"max_num_tokens {max_num_tokens} is too small for {what}: a step needs "
            f"max_num_tokens >= 1 + max_draft_len = {t}; pass --max-num-tokens {t} or more, "
            f"or a smaller window"
        )
    need_seq = max_input_len + t
    if spec.enabled and max_seq_len < need_seq:
        raise ValueError(
            f"max_seq_len {max_seq_len} leaves no room for {what}: it needs max_seq_len >= "
            f"max_input_len + 1 + max_draft_len = {max_input_len} + {t} = {need_seq}, "
            f"{need_seq - max_seq_len} more; pass --max-seq-len {need_seq} or more, or lower "
            f"--max-input-len"
        )
    if spec.enabled and max_batch_size * t > max_num_tokens:
        warnings.append(
            f"max_batch_size {max_batch_size} x {t} tokens per step = {max_batch_size * t} "
            f"exceeds max_num_tokens {max_num_tokens}: a full batch cannot speculate every "
            f"sequence in one step; raise --max-num-tokens to {max_batch_size * t} or shrink "
            f"the window per request"
        )
    return warnings


def validate_request_window(
    engine: SpeculativeConfig, w: int, n: int, g: int, flag: str | None = None
) -> tuple[int, int, int]:
    """Check a request's (w, n, g) against the engine's window; return it.

    (1, 1, 0) is plain decoding and is always allowed. Otherwise 1 <= w <= W, 1 <= n <= N,
    0 <= g <= G and the N == 1 rule. Raises RequestError (param "lookahead"; the server
    answers 400). ``flag``: the CLI option the window came from (--lookahead), named in the
    message.
    """
    req = (w, n, g)
    what = flag or "request lookahead"
    if req == PLAIN:
        return req
    if engine.mode != "lookahead" or engine.lookahead is None:
        raise RequestError(
            f"{what} {_fmt(req)} is not available: this engine was built with "
            f"speculative decoding mode {engine.mode!r}, so only (1,1,0) (plain decoding) is "
            f"allowed; rebuild with --speculative-decoding-mode lookahead --lookahead-config "
            f"W,N,G", "lookahead"
        )
    W, N, G = engine.lookahead
    if not (1 <= w <= W and 1 <= n <= N and 0 <= g <= G):
        raise RequestError(
            f"{what} {_fmt(req)} exceeds the engine window {_fmt((W, N, G))}: "
            f"each field must satisfy 1 <= w <= {W}, 1 <= n <= {N}, 0 <= g <= {G}; "
            f"ask for a smaller window or (1,1,0) for plain decoding", "lookahead"
        )
    try:
        check_window(w, n, g, what, flag)
    except ValueError as e:  # check_window also checks build configs, which are no request
        raise RequestError(str(e), "lookahead") from None
    return req
