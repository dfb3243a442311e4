"""The device lookahead state (speculative/device_lookahead.py) against the host worker.

Host (LookaheadWorker over real Requests) and device (DeviceLookahead over slots) run the
same recorded steps side by side: a stand-in model whose greedy token after any row is a
fixed bigram table of that row's token (so the pool learns chains and candidates get
accepted). After every step the proposal, the committed tokens, the KV moves, the window
and the whole n-gram table must be equal.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import pool_tensors

from kiln.runtime.request import Request
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.speculative.device_lookahead import DeviceLookahead
from kiln.runtime.speculative.lookahead import LookaheadWorker
from kiln.runtime.speculative.lookahead_math import NgramPool


def run_lockstep(window, buckets, prompts, slots, vocab, steps, seed):
    rng = random.Random(seed)
    bigram = torch.tensor([rng.randrange(vocab) for _ in range(vocab)])
    # some rows of the table are "noisy": the model is not a pure bigram chain
    noise = {t: rng.randrange(vocab) for t in range(vocab) if rng.random() < 0.2}
    w, n, g = window
    worker = LookaheadWorker()
    dev = DeviceLookahead(max(slots) + 1, window, torch.device("cpu"), buckets=buckets)
    reqs = []
    for i, (prompt, slot) in enumerate(zip(prompts, slots)):
        req = Request(f"r{i}", prompt, SamplingParams(max_tokens=10_000, temperature=0,
                                                       ignore_eos=True), frozenset())
        worker.init_request(req, window)
        pool = NgramPool(n, g, buckets=buckets)
        pool.seed_from_tokens(prompt)
        req.spec_state.pool = pool
        dev.load(slot, req.spec_state.window, pool, prompt)
        reqs.append(req)
    slot_t = torch.tensor(slots)

    def model(tokens: torch.Tensor, step: int) -> torch.Tensor:
        out = bigram[tokens]
        for t, v in noise.items():  # noisy tokens answer differently on odd steps
            if step % 2:
                out = torch.where(tokens == t, v, out)
        return out

    accepted_any = 0
    for step in range(steps):
        tokens, valid = dev.propose(slot_t)
        argmax = model(tokens, step)
        verdict = dev.verify(tokens, argmax, valid)
        dev.update(slot_t, tokens, argmax, verdict)
        for b, req in enumerate(reqs):
            plan = worker.propose(req)
            req.draft = plan
            host_tokens = torch.tensor(plan.token_ids)
            t = host_tokens.numel()
            assert torch.equal(tokens[b, :t], host_tokens), (step, b)
            assert int(valid[b].sum()) == len(plan.data[1]), (step, b)
            host_argmax = model(host_tokens, step).tolist()
            accepted, moves = worker.verify(req, torch.empty(0), host_argmax)
            count = int(verdict.count[b])
            assert verdict.committed[b, :count].tolist() == accepted, (step, b)
            assert verdict.committed[b, count:].eq(0).all()
            assert [(int(r), k + 1) for k, r in enumerate(verdict.src_rows[b, : count - 1])] \
                == moves, (step, b)
            accepted_any += count - 1
            req.commit(accepted, None, 1 << 30, 0.0)
            worker.on_commit(req, len(accepted), True)
            req.draft = None
            st = req.spec_state
            win = dev.window[slots[b]].clone()
            host_win = torch.tensor(st.window)
            win[0, 0] = host_win[0, 0] = 0  # x's cell: never read
            assert torch.equal(win, host_win), (step, b)
            keys, conts, cursor = pool_tensors(st.pool)
            assert torch.equal(dev.keys[slots[b]], keys), (step, b)
            assert torch.equal(dev.conts[slots[b]][keys >= 0], conts[keys >= 0]), (step, b)
            assert torch.equal(dev.cursor[slots[b]], cursor), (step, b)
            assert dev.recent[slots[b]].tolist() == ([-1] * (n - 1) + req.all_token_ids)[-(n - 1):]
            assert int(dev.total[slots[b]]) == len(req.all_token_ids)
    return accepted_any


@pytest.mark.parametrize("window", [(4, 4, 4), (7, 7, 7), (2, 2, 1), (3, 3, 0), (1, 2, 1),
                                    (5, 3, 2)])
@pytest.mark.parametrize("buckets", [4096, 5])
def test_device_steps_equal_the_host_worker(window, buckets):
    rng = random.Random(hash((window, buckets)) & 0xFFFF)
    vocab = 12
    prompts = [[rng.randrange(vocab) for _ in range(length)] for length in (1, 3, 9, 40)]
    accepted = run_lockstep(window, buckets, prompts, [3, 0, 5, 1], vocab, steps=30,
                            seed=window[0] * 7 + buckets)
    if window[2]:  # the comparison covered accepted drafts, not only bonus tokens
        assert accepted > 0


def test_admit_rejects_a_pool_of_another_shape():
    dev = DeviceLookahead(2, (4, 4, 4), torch.device("cpu"))
    with pytest.raises(ValueError, match="does not match the device table"):
        dev.load(0, [[0] * 4] * 3, NgramPool(4, 3), [1, 2])


def test_admission_resets_a_reused_slot_to_the_new_requests_pool():
    """A slot that held another request's table takes the next one's exactly (keys, cursors,
    the continuations of filled cells, window, recent tokens): admission writes only the
    filled entries, over a reset slot."""
    import random

    rng = random.Random(3)
    window = (4, 4, 3)
    w, n, g = window
    dev = DeviceLookahead(2, window, torch.device("cpu"), buckets=7)
    for trial in range(6):
        prompt = [rng.randrange(20) for _ in range(rng.randint(1, 60))]
        pool = NgramPool(n, g, buckets=7)
        pool.seed_from_tokens(prompt)
        grid = [[rng.randrange(20) for _ in range(w)] for _ in range(n - 1)]
        dev.load(1, grid, pool, prompt)
        keys, conts, cursor = pool_tensors(pool)
        assert torch.equal(dev.keys[1], keys), trial
        assert torch.equal(dev.conts[1][keys >= 0], conts[keys >= 0]), trial
        assert torch.equal(dev.cursor[1], cursor), trial
        assert dev.window[1].tolist() == grid
        assert dev.recent[1].tolist() == ([-1] * (n - 1) + prompt)[-(n - 1):]
        assert int(dev.total[1]) == len(prompt)
        assert dev.keys[0].eq(-1).all()  # the other slot untouched
        # the request's steps then change the slot before the next admission
        tokens, valid = dev.propose(torch.tensor([1]))
        argmax = torch.tensor([[rng.randrange(20) for _ in range(tokens.shape[1])]])
        dev.update(torch.tensor([1]), tokens, argmax, dev.verify(tokens, argmax, valid))


def test_admit_from_the_prompt_equals_the_host_workers_initial_state():
    """``admit(slot, prompt, seed)`` (the proposer interface) loads the window and pool the
    host worker starts the same request from: ``initial_window`` with the request's seed,
    the pool seeded with the prompt's n-grams."""
    import random

    rng = random.Random(5)
    window = (4, 4, 3)
    for seed in (None, 0, 17):
        prompt = [rng.randrange(20) for _ in range(rng.randint(1, 50))]
        req = Request("r", prompt, SamplingParams(max_tokens=8, temperature=0, seed=seed),
                      frozenset())
        LookaheadWorker().init_request(req, window)  # the host state
        host = DeviceLookahead(1, window, torch.device("cpu"))
        host.load(0, req.spec_state.window, req.spec_state.pool, prompt)
        dev = DeviceLookahead(1, window, torch.device("cpu"))
        dev.admit(0, prompt, seed)
        for name in ("window", "keys", "conts", "cursor", "recent", "total"):
            assert torch.equal(getattr(host, name), getattr(dev, name)), (seed, name)


def test_the_lockstep_sees_a_device_without_the_prompt_lookup_candidate(monkeypatch):
    """Negative control: a device state that leaves the prompt-lookup candidate out differs
    from the host worker within the lockstep's steps."""
    monkeypatch.setattr(DeviceLookahead, "_with_lookup", lambda self, slots, c, v: (c, v))
    rng = random.Random(5)
    prompts = [[rng.randrange(12) for _ in range(length)] for length in (1, 3, 9, 40)]
    with pytest.raises(AssertionError):
        run_lockstep((4, 4, 4), 4096, prompts, [3, 0, 5, 1], 12, steps=30, seed=3)
