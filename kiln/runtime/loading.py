"""Loading a directory written by ``kiln build`` into an engine (``LLMEngine.from_engine_dir``):
the build's tuned kernel configs and compiled kernels first, a tensor-parallel engine's
other ranks next (they load their shards meanwhile), then the weights, tokenizer and draft."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import TypeVar

import torch

from kiln.dtypes import TORCH_DTYPES
from kiln.runtime.config import EngineLimits, RuntimeConfig
from kiln.runtime.models.calibration import ActivationCalibrator

# the engine class (kiln.runtime.engine.LLMEngine or a subclass), not imported here: the
# engine imports this module
EngineT = TypeVar("EngineT")


def load_engine_dir(cls: type[EngineT], path: str | Path,
                    config: RuntimeConfig | None = None) -> EngineT:
    """An engine of class ``cls`` (LLMEngine's constructor) over the built directory
    ``path``; ``startup_times`` counts the kernel installation and the weight loading too."""
    from kiln.artifact.loader import load_engine

    config = config or RuntimeConfig()
    art = load_engine(path)
    spec = art.spec
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    from kiln.runtime.kernels import tuning  # build-time tuned kernel configs (no re-tuning)

    tuning.install(spec.kernel_configs, device)
    kernels, kernels_s = {}, 0.0
    if torch.device(device).type == "cuda":  # before anything compiles
        from kiln.runtime.kernel_cache import install_for_engine

        kernels, kernels_s = install_for_engine(Path(path), device)
    dtype = TORCH_DTYPES[spec.dtype]
    lim = spec.limits
    limits = EngineLimits(lim.max_batch_size, lim.max_seq_len, lim.max_input_len,
                          lim.max_num_tokens)
    t0 = time.perf_counter()
    tp = None
    if spec.tp > 1:  # the other ranks start first and load their shards meanwhile
        from kiln.runtime.parallel import Ranks
        from kiln.runtime.parallel.worker import follow_launched

        tp = Ranks.start(Path(path), spec.parallel, spec.model, torch.device(device),
                         dataclasses.replace(config, device=str(device)),
                         follow=follow_launched)
    try:
        weights = art.load_weights(device, dtype, calibrator=ActivationCalibrator)
        tokenizer = art.load_tokenizer()
        draft = ((art.draft.spec.model,
                  art.draft.load_weights(device, dtype, calibrator=ActivationCalibrator))
                 if getattr(art, "draft", None) is not None else None)
        load_s = time.perf_counter() - t0
        engine = cls(spec.model, weights, tokenizer, limits, dtype, config, spec=spec,
                     draft=draft, tp=tp)
    except BaseException:
        if tp is not None:
            tp.kill()
        raise
    warning = spec.quantization.kv_scale_warning()
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    engine.startup_times = {"load_weights_s": load_s, **engine.startup_times,
                            "total_s": load_s + engine.startup_times["total_s"]}
    if kernels:  # the engine shipped compiled kernels for this machine
        engine.startup_times = {"install_kernels_s": kernels_s, **engine.startup_times,
                                "total_s": kernels_s + engine.startup_times["total_s"]}
        engine.kernels_installed = kernels
    return engine
