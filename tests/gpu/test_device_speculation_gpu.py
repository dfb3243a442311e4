"""On CUDA: lookahead with the device state (the Triton propose / commit / KV move kernels,
captured in the masked buckets' CUDA graphs around the forward) commits exactly the host
worker's tokens, which equal plain greedy decoding (float32), in a batch of requests at the
engine's window beside a plain request (a plain row of the steps launched ahead) or one at
a smaller window (host state); and the graph replay of those steps commits what the same
steps run eagerly commit."""

from __future__ import annotations

import collections
import os

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="compiled kernels, not the interpreter"),
]


# repetitive prompts: the pool and prompt lookup find candidates, and random weights still
# accept some
PROMPTS = [[100 + (7 * i + j) % 50 for i in range(12 + 3 * j)] * 3 for j in range(4)]


def _engine(tmp_path, spec):
    from kiln.builder import build_engine

    out = tmp_path / "e"
    build_engine("random:smollm2-135m", out, dtype="float32", max_seq_len=512,
                 max_num_tokens=1024, max_batch_size=8, progress=False, speculative=spec)
    return out


def _run(out, windows, max_tokens, on_device: bool, graphs: bool = True):
    """Greedy tokens of PROMPTS (one window per prompt; None: the engine's) and the
    engine's (speculative steps, tokens they committed); checks every slot and block is
    freed and, on the device with graphs, that masked buckets' replays ran the steps."""
    from kiln.runtime.engine import LLMEngine, RuntimeConfig
    from kiln.runtime.sampling_params import SamplingParams

    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(
        device="cuda", device_speculation=on_device, adaptive_speculation=False,
        cuda_graphs=graphs))
    params = [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                             lookahead=w) for w in windows]
    outs = eng.generate(PROMPTS, params)
    stats = (eng.spec_stats["steps"], eng.spec_stats["accepted_tokens"])
    if on_device:
        assert sorted(eng.spec_worker._free_slots) == list(range(8))  # all released
        if graphs:
            g = eng.runner.graphs
            assert sum(n for b, n in g.replays.items() if b.masked) > 0
    eng.blocks.check_all_free()
    return [o.token_ids for o in outs], stats


@pytest.mark.parametrize("window", ["7,7,7", "4,3,4"])
def test_device_lookahead_equals_host_lookahead_and_plain_greedy(tmp_path, window):
    from kiln.artifact.speculative import SpeculativeConfig

    out = _engine(tmp_path, SpeculativeConfig.from_cli("lookahead", window, None, None))
    windows = [None, None, None, (1, 1, 0)]  # a plain request: a plain row beside the plans
    plain, _ = _run(out, [(1, 1, 0)] * 4, 40, False)
    host, host_stats = _run(out, windows, 40, False)
    dev, dev_stats = _run(out, windows, 40, True)
    eager, eager_stats = _run(out, windows, 40, True, graphs=False)
    assert host == plain
    assert dev == plain
    assert eager == dev and eager_stats == dev_stats  # graph replay == eager steps
    assert dev_stats == host_stats  # the same steps committed the same counts
    assert dev_stats[1] > dev_stats[0]  # some drafts were accepted
    # the last one at a smaller window (host state): it decodes plainly while the device
    # requests speculate, and speculates on the host once they are done
    smaller, _ = _run(out, [None, None, None, (2, 2, 1)], 40, True)
    assert smaller == plain


def test_device_prompt_lookup_equals_host_prompt_lookup_and_plain_greedy(tmp_path):
    """The same for prompt lookup (the ngram kernels: the draft search over each slot's
    tokens, chain verification and the history update, in the masked buckets' graphs),
    with a plain request beside the speculating ones."""
    from kiln.artifact.speculative import SpeculativeConfig

    out = _engine(tmp_path, SpeculativeConfig.from_cli("ngram", None, 8, 2))
    windows = [None, None, None, (1, 1, 0)]
    plain, _ = _run(out, [(1, 1, 0)] * 4, 48, False)
    host, host_stats = _run(out, windows, 48, False)
    dev, dev_stats = _run(out, windows, 48, True)
    eager, eager_stats = _run(out, windows, 48, True, graphs=False)
    assert host == plain
    assert dev == plain
    assert eager == dev and eager_stats == dev_stats
    # the same drafts were accepted; the device also runs a step (one token) where the host
    # finds no draft and decodes plainly, so only the accepted count is compared
    assert dev_stats[1] - dev_stats[0] == host_stats[1] - host_stats[0] > 0


def test_fold_kernel_equals_commit_tokens_on_cuda():
    """The compiled ``lookahead_fold`` (what a paced request's plain-step tokens take into
    its device slot) leaves the state ``commit_tokens``' torch ops leave, on CUDA."""
    import random

    from kiln.runtime.kernels.lookahead import lookahead_fold
    from kiln.runtime.speculative.device_lookahead import DeviceLookahead
    from kiln.runtime.speculative.lookahead_math import NgramPool

    rng = random.Random(3)
    window, vocab = (7, 7, 7), 9
    states = [DeviceLookahead(6, window, torch.device("cuda")) for _ in range(2)]
    for slot, length in enumerate((1, 4, 30, 80, 7, 12)):
        prompt = [rng.randrange(vocab) for _ in range(length)]
        pool = NgramPool(7, 7, states[0].buckets)
        pool.seed_from_tokens(prompt)
        grid = [[rng.randrange(vocab) for _ in range(7)] for _ in range(6)]
        for st in states:
            st.load(slot, grid, pool, prompt)
    ref, dut = states
    for step in range(6):
        slots = torch.tensor([5, -1, 0, 2, 1], device="cuda")
        counts = [0 if s < 0 else rng.choice([0, 1, 5, 9, 40]) for s in slots.tolist()]
        tokens = torch.tensor([[rng.randrange(vocab) for _ in range(40)] for _ in counts],
                              device="cuda")
        count = torch.tensor(counts, device="cuda")
        live = slots >= 0
        ref.commit_tokens(slots[live], tokens[live], count[live])
        lookahead_fold(slots, tokens, count, dut.keys, dut.conts, dut.cursor, dut.recent,
                       dut.total, dut.history, dut.g)
        for name in ("window", "keys", "conts", "cursor", "recent", "total", "history"):
            assert torch.equal(getattr(ref, name), getattr(dut, name)), (step, name)


@pytest.mark.parametrize("warp", ["temperature", "top_k", "min_p"])
@pytest.mark.parametrize("mode", ["lookahead", "ngram"])
def test_device_sampled_verification_follows_the_target_distribution_on_cuda(
        bigram_source, tmp_path, mode, warp):
    """Sampled requests verified on CUDA (``row_targets``: the sampling kernels inside the
    masked buckets' graphs, a Philox key per plan and depth, the threshold kernel of warped
    rows): the joint distribution of 3 tokens against the exact one, 1500 seeds, as the
    CPU test (tests/model/test_speculative.py) does for the torch ops: temperature 0.5
    alone, or temperature 3 with top_k 2 / min_p 0.5 (without the warp the other 298
    tokens would hold 85 %)."""
    from helpers import BIGRAM_PROMPT, build_bigram_engine, exact_three_token_distribution, tv

    from kiln.runtime.engine import LLMEngine, RuntimeConfig
    from kiln.runtime.sampling_params import SamplingParams

    out = build_bigram_engine(bigram_source, tmp_path / "engine", mode, max_num_tokens=1024,
                              max_batch_size=8)
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(
        device="cuda", device_speculation=True, adaptive_speculation=False))
    prompt = BIGRAM_PROMPT
    sampling, p_one = {"temperature": ({"temperature": 0.5}, 0.8),
                       "top_k": ({"temperature": 3.0, "top_k": 2}, 1 / (1 + 2 ** (-1 / 3))),
                       "min_p": ({"temperature": 3.0, "min_p": 0.5}, 1 / (1 + 2 ** (-1 / 3))),
                       }[warp]
    exact = exact_three_token_distribution(11, p_one=p_one)
    counts = collections.Counter()
    for first in range(0, 1500, 8):  # 8 at a time: each fits the graphs' masked buckets
        ps = [SamplingParams(max_tokens=3, **sampling, seed=s, ignore_eos=True)
              for s in range(first, first + 8)]
        counts.update(tuple(o.token_ids) for o in eng.generate([prompt] * 8, ps))
    steps, committed = eng.spec_stats["steps"], eng.spec_stats["accepted_tokens"]
    assert steps > 0 and committed > 1.2 * steps
    assert sum(n for b, n in eng.runner.graphs.replays.items() if b.masked) > 0
    assert tv(counts, exact) < 0.06, tv(counts, exact)
    eng.blocks.check_all_free()
    assert sorted(eng.spec_worker._free_slots) == list(range(8))

