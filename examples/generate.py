"""Generate with the Python API: build smollm2-135m once, then run a few prompts in a batch.

    python examples/generate.py [ENGINE_DIR]

The first run downloads the model (about 100 MB, into KILN_CACHE or ~/.cache/kiln) and
builds the engine into ENGINE_DIR (default engines/smol); later runs reuse it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams

PROMPTS = [
    "Write a haiku about kilns.",
    "What is the capital of France?",
    "Give me three tips for writing clear error messages.",
]


def main() -> None:
    engine_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "engines/smol")
    if not (engine_dir / "engine.json").is_file():
        # The same thing as running `kiln build smollm2-135m -o engines/smol` in a shell.
        subprocess.run([sys.executable, "-m", "kiln", "build", "smollm2-135m",
                        "-o", str(engine_dir)], check=True)

    engine = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig())
    # Chat models answer best through their chat template; token ids go in as-is.
    prompts = [engine.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(max_tokens=64, temperature=0.0)  # greedy: same answer every run

    # All prompts run together (continuous batching); outputs come back in prompt order.
    for prompt, out in zip(PROMPTS, engine.generate(prompts, params)):
        print(f"### {prompt}\n{out.text.strip()}\n"
              f"({len(out.token_ids)} tokens, finish: {out.finish_reason})\n")


if __name__ == "__main__":
    main()
