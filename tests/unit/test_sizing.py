"""kiln.runtime.sizing: the KV pool, the running batch and the sequence length an engine serves,
on the CPU (bounded pool) and on CUDA (free memory, faked here)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kiln.artifact.loader import load_engine
from kiln.builder import build_engine
from kiln.errors import RequestError
from kiln.runtime import sizing
from kiln.runtime.config import EngineLimits, RuntimeConfig
from kiln.runtime.engine import LLMEngine
from kiln.runtime.kv_cache import KVCache
from kiln.runtime.sampling_params import SamplingParams
from kiln.sources.random import PRESETS

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
L8 = PRESETS["llama-3-8b"]
# llama-3-8b's default limits (kiln build without limit flags)
L8_LIMITS = EngineLimits(256, 131072, 131071, 8192)


def _block_bytes(cfg=L8, dtype=torch.bfloat16, block_size=16) -> int:
    return KVCache.bytes_per_block(cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim,
                                   dtype)


def _size(limits, device, config=None, block_bytes=None):
    config = config or RuntimeConfig(device=device.type)
    pool = sizing.kv_pool(block_bytes or _block_bytes(), limits, config, device)
    return sizing.size_engine(limits, pool, config)


def test_cpu_pool_is_bounded_for_a_long_recorded_context():
    """random:llama-3-8b records 131,072 tokens of context: the CPU pool stays at 1 GiB (8,192
    tokens of its bf16 KV) and the engine serves sequences of that length."""
    s = _size(L8_LIMITS, CPU)
    assert s.pool.num_blocks * _block_bytes() <= sizing.CPU_KV_BYTES
    assert s.pool.tokens == 8192
    assert (s.limits.max_seq_len, s.limits.max_input_len) == (8192, 8191)
    assert s.recorded == L8_LIMITS and s.limits.max_batch_size == 256
    assert s.max_num_seqs == 8192 // sizing.RUNNING_SEQ_TOKENS
    assert s.max_num_tokens == 8192
    line = s.line()
    assert "max_seq_len 8,192 (what the KV pool holds; the engine records 131,072" in line
    assert "num_kv_blocks=8192 or more" in line and "1 GiB" in line


def test_cpu_pool_keeps_the_old_default_size_for_small_models():
    """A tiny model (512 tokens of context) built without limit flags: 64 sequences' KV as
    before the defaults grew (max_batch_size 64 then, 256 now), running batch 64."""
    tiny = PRESETS["tiny-llama"]
    bb = _block_bytes(tiny, torch.float32)
    s = _size(EngineLimits(256, 512, 511, 8192), CPU, block_bytes=bb)
    assert s.pool.tokens == 64 * 512 and s.limits.max_seq_len == 512
    assert s.max_num_seqs == 64
    # explicit limits below the ceilings: the batch's full sequences, all of them running
    s = _size(EngineLimits(8, 128, 127, 64), CPU, block_bytes=bb)
    assert (s.pool.tokens, s.max_num_seqs) == (8 * 128, 8)


def test_speculative_room_is_kept_when_the_cpu_pool_shortens_sequences():
    lim = EngineLimits(256, 131072, 131072 - 16, 8192)  # lookahead (4,3,4): 15 draft tokens
    s = _size(lim, CPU)
    assert (s.limits.max_seq_len, s.limits.max_input_len) == (8192, 8192 - 16)


def test_given_blocks_must_hold_one_sequence():
    cfg = RuntimeConfig(device="cpu", num_kv_blocks=100)
    with pytest.raises(ValueError, match=r"num_kv_blocks 100 x block_size 16 holds 1,600 tokens, "
                                         r"fewer than max_seq_len 131,072; one request must "
                                         r"always fit: use num_kv_blocks=8192 or more"):
        _size(L8_LIMITS, CPU, cfg)
    s = _size(L8_LIMITS, CPU, RuntimeConfig(device="cpu", num_kv_blocks=8192))
    assert s.limits == L8_LIMITS and s.max_num_seqs == 256  # given: the engine's batch
    assert "running batch 256 (engine max_batch_size)" in s.line()
    s = _size(L8_LIMITS, CPU, RuntimeConfig(device="cpu", num_kv_blocks=8192, max_num_seqs=3,
                                            max_num_tokens=512))
    assert (s.max_num_seqs, s.max_num_tokens) == (3, 512)


@pytest.fixture
def free_gib(monkeypatch):
    """Fakes torch.cuda.mem_get_info: ``free_gib(n)`` makes n GiB free."""
    def set_free(n: float) -> None:
        monkeypatch.setattr(torch.cuda, "mem_get_info",
                            lambda device=None: (int(n * 2**30), 80 * 2**30))
    return set_free


def test_cuda_pool_takes_free_memory_and_caps_the_running_batch(free_gib):
    """The KV pool is the utilization share of free memory less 1 GiB, not max_batch_size x
    max_seq_len; the running batch is what it holds at 512 tokens a sequence, at most
    max_batch_size."""
    free_gib(64)  # an H100 after llama-3-8b's bf16 weights
    s = _size(L8_LIMITS, CUDA)
    budget = int(64 * 2**30 * 0.85) - 2**30
    assert s.pool.num_blocks == budget // _block_bytes()
    assert s.limits == L8_LIMITS and s.max_num_seqs == 256
    assert "0.85 of the 64.0 GiB free after the weights, less 1 GiB" in s.line()
    free_gib(18.0)  # 14.3 GiB of KV: 117,136 tokens, 228 sequences of 512 (not 256)
    lim = EngineLimits(256, 8192, 8191, 8192)
    s = _size(lim, CUDA)
    assert (s.pool.tokens, s.max_num_seqs) == (117136, 228)
    assert s.limits == lim
    assert f"the KV pool holds {s.max_num_seqs} sequences of 512 tokens" in s.line()
    # a pool for every full sequence is not made larger than that
    s = _size(EngineLimits(4, 128, 127, 256), CUDA)
    assert s.pool.tokens == 4 * 128 and s.max_num_seqs == 4


def test_cuda_pool_too_small_for_one_sequence_is_one_error(free_gib):
    free_gib(8)  # a 24 GB card after the weights: 5.8 GiB of KV, 47,504 tokens, not 131,072
    with pytest.raises(ValueError) as e:
        _size(L8_LIMITS, CUDA)
    msg = str(e.value)
    assert "fewer than max_seq_len 131,072; one request must always fit" in msg
    assert msg.startswith("the KV cache holds 47,504 tokens (2,969 blocks of 16; 0.85 of the "
                          "8.0 GiB free after the weights, less 1 GiB), fewer than max_seq_len "
                          "131,072; one request must always fit: rebuild the engine with "
                          "--max-seq-len 47504 or less"), msg
    assert "gpu_memory_utilization" in msg


def test_cpu_engine_with_a_long_recorded_context_starts_and_refuses_what_cannot_fit(
        tmp_path, monkeypatch):
    """An engine recording more context than the CPU pool holds starts, serves sequences of
    what the pool holds (a 1-GiB pool here shrunk to 256 tokens' worth) and refuses a longer
    prompt at admission with a RequestError (the server's 400); a request that would grow
    past it stops at that length."""
    monkeypatch.setattr(sizing, "CPU_KV_BYTES", 256 * _block_bytes(PRESETS["tiny-llama"],
                                                                    torch.float32, 1))
    out = tmp_path / "tiny"
    build_engine("random:tiny-llama", out, dtype="float32", progress=False)
    art = load_engine(out)
    cfg = dataclasses.replace(art.spec.model, max_position_embeddings=131072)
    eng = LLMEngine(cfg, art.load_weights("cpu"), art.load_tokenizer(),
                    EngineLimits(256, 131072, 131071, 8192), torch.float32,
                    RuntimeConfig(device="cpu"))
    assert eng.blocks.num_blocks * 16 == 256
    assert (eng.limits.max_seq_len, eng.limits.max_input_len) == (256, 255)
    assert eng.sizing.recorded.max_seq_len == 131072
    with pytest.raises(RequestError, match="prompt has 300 tokens; this engine accepts at most "
                                           "255"):
        eng.add_request(list(range(300)))
    out = eng.generate([list(range(200))], SamplingParams(max_tokens=1000, temperature=0,
                                                          ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 56
    eng.blocks.check_all_free()


def test_fp8_kv_pool_is_sized_at_one_byte_an_element(tmp_path, monkeypatch):
    """An FP8 KV cache holds twice the tokens of a bf16 one in the same memory: the pool is
    sized at the cache's element size, not the engine dtype's (until 2026-12-06 an FP8 KV
    engine on an H100 left ~30 GB of its KV memory unused: 45 GB device peak against 77 GB
    for bf16 KV)."""
    from kiln.artifact.spec import QuantConfig

    tiny = PRESETS["tiny-llama"]
    monkeypatch.setattr(sizing, "CPU_KV_BYTES", 64 * _block_bytes(tiny, torch.bfloat16))
    tokens = {}
    for kv in ("auto", "fp8"):
        out = tmp_path / kv
        build_engine("random:tiny-llama", out, dtype="bfloat16", progress=False,
                     quantization=QuantConfig(kv_cache=kv))
        eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu"))
        assert eng.cache.k.element_size() == (1 if kv == "fp8" else 2)
        tokens[kv] = eng.blocks.num_blocks * eng.blocks.block_size
        assert eng.cache.k.numel() * eng.cache.k.element_size() * 2 <= sizing.CPU_KV_BYTES
    assert tokens == {"auto": 64 * 16, "fp8": 2 * 64 * 16}
