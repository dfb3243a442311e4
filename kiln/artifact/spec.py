"""engine.json as frozen dataclasses: limits, quantization, the whole ``EngineSpec``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kiln.artifact.generation import GenerationDefaults
from kiln.artifact.parallel import ParallelConfig
from kiln.artifact.speculative import SpeculativeConfig, check_limits
from kiln.config import ModelConfig

# The newest engine format this kiln reads and writes. 2: an FP8 lm_head
# (quantization.lm_head "fp8", lm_head.weight_scale one per row). 3: speculative decoding
# mode "draft" (a draft engine in ENGINE/draft; speculative.draft_model, draft_engine,
# draft_sha256). 4: tensor parallelism (a ``parallel`` section, one weight file per rank,
# which an older kiln would read as one model). An engine is written with the oldest version
# that describes it (``format_version_for``), so a kiln that reads only 1 still opens every
# engine without the new feature and says "upgrade kiln" for the others.
# An optional section that an older kiln can ignore (EngineSpec.from_dict reads only the keys
# it knows) needs no new version: ``generation_defaults`` is one.
ENGINE_FORMAT_VERSION = 4


def format_version_for(
    quantization: QuantConfig, speculative: SpeculativeConfig | None = None,
    parallel: ParallelConfig | None = None,
) -> int:
    """The oldest engine format version that holds an engine with this quantization, these
    speculative settings and this tensor parallelism."""
    if parallel is not None:
        return 4
    if speculative is not None and speculative.mode == "draft":
        return 3
    return 2 if quantization.lm_head != "none" else 1


DTYPES = ("bfloat16", "float16", "float32")
# Defaults of limits the user leaves out (as vLLM and TensorRT-LLM size them): max_seq_len is
# the model's context (``Limits.for_model``; DEFAULT_MAX_SEQ_LEN only where there is no model,
# ``Limits()``); a token budget of 8192 a step; a batch of 256, which serve lowers to what the
# KV memory holds (kiln/runtime/sizing.py).
DEFAULT_MAX_SEQ_LEN = 2048
DEFAULT_MAX_BATCH_SIZE = 256
DEFAULT_MAX_NUM_TOKENS = 8192
LIMIT_FLAGS = {"max_batch_size": "--max-batch-size", "max_seq_len": "--max-seq-len",
               "max_input_len": "--max-input-len", "max_num_tokens": "--max-num-tokens"}


@dataclass(frozen=True)
class Limits:
    """Sizes the runtime is built for.

    ``max_input_len`` (prompt tokens) defaults to ``max_seq_len - 1``: at least one generated
    token always fits. ``max_num_tokens`` is the per-step token budget (prefill chunks +
    decode + draft tokens). ``validate_for`` checks the limits against a model and
    speculative settings.
    """

    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN
    max_input_len: int | None = None
    max_num_tokens: int = DEFAULT_MAX_NUM_TOKENS

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_seq_len", "max_num_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_input_len is None:
            object.__setattr__(self, "max_input_len", self.max_seq_len - 1)
        mil = self.max_input_len
        if not isinstance(mil, int) or isinstance(mil, bool) or mil < 1:
            raise ValueError(f"max_input_len must be a positive integer, got {mil!r}")
        if mil >= self.max_seq_len:
            raise ValueError(
                f"max_input_len {mil} must be < max_seq_len {self.max_seq_len} "
                "(room for at least one generated token); lower --max-input-len or raise "
                "--max-seq-len"
            )

    @classmethod
    def for_model(
        cls,
        model: ModelConfig,
        *,
        max_batch_size: int | None = None,
        max_seq_len: int | None = None,
        max_input_len: int | None = None,
        max_num_tokens: int | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> Limits:
        """Fill unset limits with defaults that fit ``model``: max_seq_len its context (at
        most its sliding window), a token budget of DEFAULT_MAX_NUM_TOKENS (at least one
        speculative step), DEFAULT_MAX_BATCH_SIZE sequences; max_input_len leaves room for
        ``speculative`` draft tokens."""
        draft = speculative.max_draft_len if speculative else 0
        if max_seq_len is None:
            max_seq_len = model.max_position_embeddings
            if model.sliding_window:
                max_seq_len = min(max_seq_len, model.sliding_window)
        if max_input_len is None and draft:
            max_input_len = max_seq_len - 1 - draft
        if max_num_tokens is None:
            max_num_tokens = max(DEFAULT_MAX_NUM_TOKENS, 1 + draft)
        return cls(
            max_batch_size=DEFAULT_MAX_BATCH_SIZE if max_batch_size is None else max_batch_size,
            max_seq_len=max_seq_len,
            max_input_len=max_input_len,
            max_num_tokens=max_num_tokens,
        )

    def describe(self, model: ModelConfig, given: set[str] | frozenset[str] = frozenset()
                 ) -> str:
        """One line: each limit and where it came from; ``given``: the names the user set
        (``LIMIT_FLAGS`` keys), the others were ``for_model``'s defaults for ``model``."""
        window = model.sliding_window and model.sliding_window < model.max_position_embeddings
        why = {"max_seq_len": "the model's sliding window" if window else "the model's context",
               "max_num_tokens": "default",
               "max_batch_size": "default; serve runs fewer when the KV memory holds fewer",
               "max_input_len": "max_seq_len - 1" + (
                   f" - {self.max_seq_len - self.max_input_len - 1} draft tokens"
                   if self.max_seq_len - self.max_input_len > 1 else "")}
        parts = [f"{name} {getattr(self, name):,} "
                 f"({LIMIT_FLAGS[name] if name in given else why[name]})"
                 for name in ("max_seq_len", "max_num_tokens", "max_batch_size", "max_input_len")]
        return ", ".join(parts) + "; KV cache: sized by serve from the device's free memory"

    def validate_for(self, model: ModelConfig, speculative: SpeculativeConfig) -> list[str]:
        """Raise ValueError when these limits cannot work; return warnings for the user."""
        if self.max_seq_len > model.max_position_embeddings:
            raise ValueError(
                f"max_seq_len {self.max_seq_len} exceeds the model's max_position_embeddings "
                f"{model.max_position_embeddings}; use --max-seq-len "
                f"{model.max_position_embeddings} or less"
            )
        if model.sliding_window and self.max_seq_len > model.sliding_window:
            raise ValueError(
                f"max_seq_len {self.max_seq_len} exceeds the model's sliding_window "
                f"{model.sliding_window} (kiln attends to the full context); use "
                f"--max-seq-len {model.sliding_window} or less"
            )
        return check_limits(
            speculative,
            max_batch_size=self.max_batch_size,
            max_seq_len=self.max_seq_len,
            max_input_len=self.max_input_len,
            max_num_tokens=self.max_num_tokens,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Limits:
        return cls(**d)


QUANT_WEIGHTS = ("none", "fp8")
QUANT_ACTIVATIONS = ("none", "fp8")
KV_CACHE_DTYPES = ("auto", *DTYPES, "fp8")
QUANT_LM_HEAD = ("none", "fp8")


@dataclass(frozen=True)
class QuantConfig:
    """Quantization scheme. ``kv_cache="auto"`` means the engine dtype (resolved at build).

    ``scales`` records where the linears' and KV scales came from (e.g. {"source":
    "modelopt", "calib_size": 512}); None when neither is quantized.
    ``lm_head="fp8"`` (``kiln build --quantize-lm-head``): the output projection is stored as
    ``lm_head.weight`` e4m3 with float32 ``lm_head.weight_scale`` [V] = each row's amax / 448
    of the engine-dtype matrix (made at build; random engines: at load), also when the model
    ties it to the embedding, which then stays in the engine dtype. Engines without the key:
    "none".
    """

    weights: str = "none"
    activations: str = "none"
    kv_cache: str = "auto"
    scales: dict[str, Any] | None = None
    lm_head: str = "none"

    def __post_init__(self) -> None:
        for name, valid in (
            ("weights", QUANT_WEIGHTS),
            ("activations", QUANT_ACTIVATIONS),
            ("kv_cache", KV_CACHE_DTYPES),
            ("lm_head", QUANT_LM_HEAD),
        ):
            if getattr(self, name) not in valid:
                raise ValueError(
                    f"quantization {name} {getattr(self, name)!r} is not supported; use one of "
                    f"{list(valid)}"
                )

    def resolved(self, dtype: str) -> QuantConfig:
        return dataclasses.replace(self, kv_cache=dtype) if self.kv_cache == "auto" else self

    def kv_scale_warning(self) -> str | None:
        """The warning for an FP8 KV cache whose scales nobody calibrated (``scales``'
        "kv_cache" record, written at build), or None."""
        if self.kv_cache != "fp8":
            return None
        recorded = (self.scales or {}).get("kv_cache", "not recorded")
        if recorded == "checkpoint (calibrated)":
            return None
        return (f"this engine's FP8 KV cache runs with uncalibrated scales (engine.json: "
                f"{recorded}): keys and values beyond the scale x 448 saturate and small ones "
                "lose precision; calibrate with `kiln quantize SOURCE -o CKPT --kv-cache-dtype "
                "fp8` and build from CKPT, or build with --kv-cache-dtype bfloat16")

    def to_dict(self) -> dict[str, Any]:
        """engine.json's section; ``lm_head`` only when "fp8", so that engines without an FP8
        lm_head stay readable by kiln versions from before the option."""
        d = dataclasses.asdict(self)
        if self.lm_head == "none":
            del d["lm_head"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuantConfig:
        return cls(**d)


TOOL_PARSER_SOURCES = ("chat template", "--tool-parser", "none")


@dataclass(frozen=True)
class ToolsConfig:
    """engine.json ``tools``: the tool-call ``parser`` family the engine's chat template
    speaks (kiln.tools.PARSERS; None: the template has no tool calling) and where that
    choice came from (``source``: detected from the "chat template", or "--tool-parser" at
    build). Engines built before the section have none; the runtime then detects it from
    the tokenizer's template at load."""

    parser: str | None = None
    source: str = "none"

    def __post_init__(self) -> None:
        if self.source not in TOOL_PARSER_SOURCES:
            raise ValueError(f"tools.source {self.source!r} is not one of "
                             f"{list(TOOL_PARSER_SOURCES)}")

    def to_dict(self) -> dict[str, Any]:
        return {"parser": self.parser, "source": self.source}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ToolsConfig:
        return cls(parser=d.get("parser"), source=str(d.get("source", "none")))


@dataclass(frozen=True)
class EngineSpec:
    """Everything in engine.json. ``weights`` is {"format": "safetensors", "files": {name:
    {"sha256", "size"}}} or {"format": "random", "seed": S, "std": 0.02}.
    ``kernel_configs`` is the build-time kernel tuning section (kiln.runtime.kernels.tuning:
    {"tuned": true, "gpu", "triton", ..., "configs": {kernel: {key: config}}} or
    {"tuned": false, "reason"}; empty in engines built before tuning existed).
    ``generation_defaults``: sampling values for the fields a request omits (see
    kiln.artifact.generation). ``tools``: the tool-call parser (an optional section: None in
    engines built before it, which read it from the chat template at load). ``attention``:
    the attention backend per step class, measured at build or given by the build's
    ``--attention-backend`` (kiln.runtime.layers.attention_select; an optional section:
    empty in engines built before it, which run the runtime's default). ``parallel``:
    tensor parallelism (kiln.artifact.parallel; None: tp 1, and no section).
    """

    format_version: int
    kiln_version: str
    model: ModelConfig
    dtype: str
    limits: Limits
    quantization: QuantConfig = field(default_factory=QuantConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    provenance: dict[str, Any] = field(default_factory=dict)
    weights: dict[str, Any] = field(default_factory=dict)
    kernel_configs: dict[str, Any] = field(default_factory=dict)
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    tools: ToolsConfig | None = None
    attention: dict[str, Any] = field(default_factory=dict)
    parallel: ParallelConfig | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; use one of {list(DTYPES)}")
        if self.parallel is not None:
            self.parallel.check_model(self.model)

    @property
    def tp(self) -> int:
        return self.parallel.tp if self.parallel is not None else 1

    @property
    def is_random(self) -> bool:
        return self.weights.get("format") == "random"

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "kiln_version": self.kiln_version,
            "model": self.model.to_dict(),
            "dtype": self.dtype,
            "limits": self.limits.to_dict(),
            "quantization": self.quantization.to_dict(),
            "speculative": self.speculative.to_dict(),
            "provenance": self.provenance,
            "weights": self.weights,
            "kernel_configs": self.kernel_configs,
            "generation_defaults": self.generation_defaults.to_dict(),
            **({"tools": self.tools.to_dict()} if self.tools is not None else {}),
            **({"attention": self.attention} if self.attention else {}),
            **({"parallel": self.parallel.to_dict()} if self.parallel is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineSpec:
        return cls(
            format_version=int(d["format_version"]),
            kiln_version=str(d["kiln_version"]),
            model=ModelConfig.from_dict(d["model"]),
            dtype=d["dtype"],
            limits=Limits.from_dict(d["limits"]),
            quantization=QuantConfig.from_dict(d.get("quantization") or {}),
            speculative=SpeculativeConfig.from_dict(d.get("speculative") or {}),
            provenance=dict(d.get("provenance") or {}),
            weights=dict(d.get("weights") or {}),
            kernel_configs=dict(d.get("kernel_configs") or {}),
            generation_defaults=GenerationDefaults.from_dict(d.get("generation_defaults") or {}),
            tools=ToolsConfig.from_dict(d["tools"]) if d.get("tools") is not None else None,
            attention=dict(d.get("attention") or {}),
            parallel=(ParallelConfig.from_dict(d["parallel"]) if d.get("parallel") is not None
                      else None),
        )
