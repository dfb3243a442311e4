"""``load_engine``: read and check an engine directory; load its tokenizer and weights."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

import kiln
from kiln.artifact import ENGINE_JSON, TOKENIZER_DIR
from kiln.artifact.spec import ENGINE_FORMAT_VERSION, EngineSpec
from kiln.artifact.weights import (
    FP8,
    RandomCalibration,
    is_scale_name,
    quantize_random,
    random_calibration,
    random_weights,
    runtime_shapes,
    weight_groups,
)
from kiln.config import ModelConfig
from kiln.dtypes import TORCH_DTYPES
from kiln.errors import EngineFormatError
from kiln.sources.base import sha256_file


class Calibrator(Protocol):
    """Runs the unquantized model forward as a random FP8 engine's weights are made, one
    group at a time (the embedding, then each layer in order), and answers each group's
    static activation scales (``{prefix}.input_scale``, [] float32)."""

    def observe(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


# (model config, calibration data, device, dtype) -> a Calibrator: the runtime's model
# calibrates (kiln.runtime.models.calibration.ActivationCalibrator); the artifact, below the
# runtime, only calls it.
CalibratorFactory = Callable[[ModelConfig, RandomCalibration, str | torch.device, torch.dtype],
                             Calibrator]


@dataclass(frozen=True)
class EngineArtifact:
    """A checked engine directory. Weights and tokenizer load on demand.

    ``draft``: a draft-model engine's draft (speculative mode "draft"), itself a checked
    engine directory inside this one (``spec.speculative.draft_engine``); None otherwise.
    """

    spec: EngineSpec
    path: Path
    draft: EngineArtifact | None = None

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / TOKENIZER_DIR

    def load_tokenizer(self) -> Any:
        """The engine's transformers tokenizer (with its chat template)."""
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(self.tokenizer_dir))
        except Exception as e:
            raise EngineFormatError(
                f"cannot load the tokenizer in {self.tokenizer_dir} ({type(e).__name__}: {e}); "
                "rebuild the engine"
            ) from e

    def load_weights(
        self, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
        rank: int = 0, calibrator: CalibratorFactory | None = None,
    ) -> dict[str, torch.Tensor]:
        """Runtime-named tensors (see kiln.artifact.weights) on ``device``; of a tensor-parallel
        engine, rank ``rank``'s shard (kiln.artifact.parallel).

        ``dtype`` defaults to the engine dtype. Random engines generate their weights here,
        deterministically from the recorded seed (a tensor-parallel one group by group,
        keeping the rank's shard of each), FP8 ones with their static activation scales
        calibrated here by ``calibrator`` (``_random_weights``; required for those,
        kiln.runtime.models.calibration.ActivationCalibrator).
        """
        dtype = dtype or TORCH_DTYPES[self.spec.dtype]
        w = self.spec.weights
        q = self.spec.quantization
        par = self.spec.parallel
        if not 0 <= rank < self.spec.tp:
            raise ValueError(f"rank {rank} is not a rank of this tp={self.spec.tp} engine")
        if w.get("format") == "random":
            return self._random_weights(device, dtype, rank, calibrator)
        from safetensors import safe_open

        out: dict[str, torch.Tensor] = {}
        for name in w["files"] if par is None else [par.shards[rank]]:
            with safe_open(str(self.path / name), framework="pt", device=str(device)) as f:
                for key in f.keys():
                    t = f.get_tensor(key)
                    # FP8 weights and their float32 scales keep their dtype
                    keep = t.dtype == torch.float8_e4m3fn or is_scale_name(key)
                    out[key] = t if keep else t.to(dtype)
        self._check_lm_head(out)
        cfg = self.spec.model if par is None else par.local_config(self.spec.model)
        expected = runtime_shapes(cfg, separate_head=q.lm_head == "fp8")
        extra = {k for k in set(out) - set(expected) if not is_scale_name(k)}
        if not set(expected) <= set(out) or extra:
            missing, extra = sorted(set(expected) - set(out)), sorted(extra)
            raise EngineFormatError(
                f"engine {self.path} weights do not match its model config (missing "
                f"{missing[:5]}, unexpected {extra[:5]}); rebuild the engine"
            )
        return out

    def _random_weights(self, device: str | torch.device, dtype: torch.dtype, rank: int,
                        make_calibrator: CalibratorFactory | None
                        ) -> dict[str, torch.Tensor]:
        """A random engine's weights, made from its seed one group at a time (the embedding
        with the head, then each layer; ``weight_groups``) where a group's full tensors are
        needed before the group is converted: a tensor-parallel rank keeps its shard of
        each, and static FP8 activation scales are calibrated on each layer's unquantized
        weights before they are quantized (kiln/runtime/models/calibration.py)."""
        cfg, q, par = self.spec.model, self.spec.quantization, self.spec.parallel
        w = self.spec.weights
        seed = int(w["seed"])
        calibrator = None
        calibration = random_calibration(q.scales) if q.weights == "fp8" else None
        if calibration is not None:
            if make_calibrator is None:
                raise ValueError(
                    f"engine {self.path} is a random FP8 engine with static activation scales, "
                    "which the model calibrates as its weights are made: pass "
                    "load_weights(calibrator=kiln.runtime.models.calibration."
                    "ActivationCalibrator)")
            calibrator = make_calibrator(cfg, calibration, device, dtype)
        # fp8_pc_pt random engines: one weight scale per output row
        per_row = str((q.scales or {}).get("weights", "")).startswith("per-channel")
        weights = {}
        grouped = par is not None or calibrator is not None
        for names in weight_groups(cfg) if grouped else [None]:
            part = random_weights(cfg, seed, device=device, dtype=dtype, std=float(w["std"]),
                                  names=names)
            if calibrator is not None:
                part.update(calibrator.observe(part))
            if "fp8" in (q.weights, q.kv_cache, q.lm_head):
                part = quantize_random(part, cfg, fp8_weights=q.weights == "fp8",
                                       kv_fp8=q.kv_cache == "fp8",
                                       fp8_lm_head=q.lm_head == "fp8", per_row=per_row)
            if par is not None:
                part = {k: par.shard(cfg, k, part.pop(k), rank) for k in list(part)}
            weights.update(part)
        return weights

    def _check_lm_head(self, weights: dict[str, torch.Tensor]) -> None:
        """engine.json's ``quantization.lm_head`` is "fp8" exactly when the weights have an
        e4m3 lm_head.weight with its lm_head.weight_scale."""
        head, scale = weights.get("lm_head.weight"), weights.get("lm_head.weight_scale")
        fp8 = (head is not None and head.dtype == FP8 and scale is not None
               and scale.shape == (head.shape[0],))
        said = self.spec.quantization.lm_head
        if fp8 != (said == "fp8"):
            found = ("an FP8 lm_head" if fp8 else "no FP8 lm_head (e4m3 lm_head.weight + float32 "
                     "lm_head.weight_scale, one per row)")
            raise EngineFormatError(
                f"engine {self.path}: engine.json says quantization lm_head {said!r} but its "
                f"weights have {found}; rebuild the engine (with --quantize-lm-head for an FP8 "
                "lm_head)"
            )


def load_engine(path: str | Path, *, verify_checksums: bool = True) -> EngineArtifact:
    """Open an engine directory; EngineFormatError explains anything wrong with it."""
    path = Path(path).expanduser()
    if not path.exists():
        raise EngineFormatError(f"engine {path} does not exist; build one with `kiln build`")
    spec_path = path / ENGINE_JSON
    if not spec_path.is_file():
        other = f"{str(path).rstrip('/')}-engine"
        if (path / "config.json").is_file():
            raise EngineFormatError(
                f"{path} is not a kiln engine (no {ENGINE_JSON}) but a model directory; build "
                f"an engine from it with `kiln build {path} -o {other}` (serve, generate and "
                "bench take the model directory itself too)")
        raise EngineFormatError(
            f"{path} is not a kiln engine (no {ENGINE_JSON}); build one with `kiln build MODEL "
            f"-o {other if path.is_dir() and any(path.iterdir()) else path}`"
        )
    try:
        raw = json.loads(spec_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EngineFormatError(f"{spec_path} is not valid JSON ({e}); rebuild the engine") from e
    if not isinstance(raw, dict) or not isinstance(raw.get("format_version"), int):
        raise EngineFormatError(f"{spec_path} has no integer format_version; rebuild the engine")
    version = raw["format_version"]
    if version > ENGINE_FORMAT_VERSION:
        raise EngineFormatError(
            f"engine {path} was built by kiln {raw.get('kiln_version', '?')} with format "
            f"{version}; this kiln ({kiln.__version__}) reads up to format "
            f"{ENGINE_FORMAT_VERSION}: upgrade kiln or rebuild the engine"
        )
    try:
        spec = EngineSpec.from_dict(raw)
    except (KeyError, TypeError, ValueError) as e:
        raise EngineFormatError(f"{spec_path} is malformed ({e!r}); rebuild the engine") from e
    if not (path / TOKENIZER_DIR).is_dir():
        raise EngineFormatError(f"engine {path} has no {TOKENIZER_DIR}/ directory; rebuild it")
    fmt = spec.weights.get("format")
    if fmt == "safetensors":
        for name, info in spec.weights.get("files", {}).items():
            file = path / name
            if not file.is_file():
                raise EngineFormatError(
                    f"engine {path} is missing its weights file {name}; rebuild the engine"
                )
            if verify_checksums:
                actual = sha256_file(file)
                if actual != info["sha256"]:
                    raise EngineFormatError(
                        f"checksum mismatch for {file}: expected sha256 {info['sha256']}, "
                        f"got {actual}; the file is corrupt: rebuild the engine"
                    )
        shards = spec.parallel.shards if spec.parallel is not None else ()
        unlisted = [s for s in shards if s not in spec.weights.get("files", {})]
        if unlisted or (spec.parallel is not None and not shards):
            raise EngineFormatError(
                f"{spec_path}: a tp={spec.tp} engine lists its per-rank weight files in "
                f"parallel.shards and their checksums in weights.files; missing "
                f"{unlisted or 'parallel.shards'}: rebuild the engine")
    elif fmt != "random":
        raise EngineFormatError(
            f"{spec_path} has weights format {fmt!r}; expected 'safetensors' or 'random'"
        )
    draft = None
    if spec.speculative.mode == "draft":
        draft = _load_draft(path, spec, verify_checksums)
    return EngineArtifact(spec=spec, path=path, draft=draft)


def _load_draft(path: Path, spec: EngineSpec, verify_checksums: bool) -> EngineArtifact:
    """The draft engine of the draft-model engine at ``path``: the directory engine.json
    names, whose engine.json has the recorded sha256 (checked always: one small file that
    lists the draft's weight checksums), of the target's dtype and without speculation."""
    sp = spec.speculative
    spec_path = path / ENGINE_JSON
    if sp.draft_engine is None or sp.draft_sha256 is None:
        missing = " and ".join(n for n in ("draft_engine", "draft_sha256")
                               if getattr(sp, n) is None)
        raise EngineFormatError(
            f"{spec_path} has speculative decoding mode 'draft' but no {missing}: the engine "
            f"must name its draft engine directory and that engine.json's sha256; rebuild the "
            f"engine with `kiln build --speculative-decoding-mode draft --draft-model SOURCE`"
        )
    draft_dir = path / sp.draft_engine
    draft_json = draft_dir / ENGINE_JSON
    if not draft_json.is_file():
        raise EngineFormatError(
            f"engine {path} is a draft-model engine but its draft engine {draft_json} is "
            f"missing; rebuild the engine"
        )
    actual = sha256_file(draft_json)
    if actual != sp.draft_sha256:
        raise EngineFormatError(
            f"checksum mismatch for {draft_json}: {spec_path} records draft_sha256 "
            f"{sp.draft_sha256}, the file has {actual}; the draft engine was changed or "
            f"replaced: rebuild the engine"
        )
    draft = load_engine(draft_dir, verify_checksums=verify_checksums)
    if draft.spec.dtype != spec.dtype:
        raise EngineFormatError(
            f"draft engine {draft_dir} has dtype {draft.spec.dtype!r} but the engine {path} "
            f"{spec.dtype!r}: a draft runs in the target's dtype; rebuild the engine"
        )
    if draft.spec.speculative.mode != "none":
        raise EngineFormatError(
            f"draft engine {draft_dir} has speculative decoding mode "
            f"{draft.spec.speculative.mode!r}: a draft model decodes plainly (mode 'none'); "
            f"rebuild the engine"
        )
    return draft
