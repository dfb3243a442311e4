"""The engine artifact: what ``kiln build`` writes and the runtime reads, defined once.

The builder writes it and the runtime loads it; both import this package. It imports
nothing of ``kiln.builder``, and of ``kiln.runtime`` only SamplingParams, inside
``generation.check_value``, so that a recorded default meets a request's bounds. An engine
directory:

    engine.json           the spec (spec.py: limits, quantization, speculative.py: the
                          speculative settings, generation.py: the generation defaults)
    weights.safetensors   runtime-named tensors (weights.py: names, shapes, FP8 scales;
                          random engines have none and make them at load)
    tokenizer/            tokenizer files, chat template, generation_config.json (eos ids)
    kernels/<tag>/        optional compiled Triton kernels (kiln.runtime.kernel_cache)
    draft/                a draft-model engine's draft (speculative mode "draft"): an
                          engine directory of its own, its engine.json's sha256 recorded
                          in the target's (loader.load_engine checks it)

``loader.load_engine`` opens and checks one. These names are light (no torch): the CLI uses
them without loading anything.
"""

from __future__ import annotations

ENGINE_JSON = "engine.json"
WEIGHTS_FILE = "weights.safetensors"
TOKENIZER_DIR = "tokenizer"
KERNELS_DIR = "kernels"
