"""LLMEngine: add_request / step / abort. The only entry point serve and bench use."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kiln.runtime.outputs import RequestOutput
from kiln.runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class RuntimeConfig:
    """Knobs of one running engine (the engine's limits come from engine.json).

    ``num_kv_blocks=None`` sizes the cache from free memory (CUDA) or from
    max_batch_size x max_seq_len (CPU). ``max_num_tokens``/``max_num_seqs`` of None take the
    engine's limits.
    """

    device: str | None = None  # "cuda" when available, else "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_tokens: int | None = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.85


class LLMEngine:
    """Runs a built engine directory. Not thread-safe: one thread calls these methods."""

    @classmethod
    def from_engine_dir(cls, path: str | Path, config: RuntimeConfig | None = None) -> LLMEngine:
        raise NotImplementedError

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request (text is tokenized as-is, no chat template); returns its id."""
        raise NotImplementedError

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of the engine's chat template over ``messages`` with a generation prompt."""
        raise NotImplementedError

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns outputs of requests that got tokens or finished."""
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; unknown ids are ignored."""
        raise NotImplementedError

    def has_unfinished_requests(self) -> bool:
        raise NotImplementedError

    def generate(
        self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[RequestOutput]:
        """Run prompts to completion (continuous batching); outputs in prompt order."""
        raise NotImplementedError

    def stream(self, prompt: str | list[int], params: SamplingParams) -> Iterator[RequestOutput]:
        """Add one request and yield its output after each step that advanced it."""
        raise NotImplementedError
