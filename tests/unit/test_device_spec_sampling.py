"""The targets device speculative steps verify against (``verify.row_targets``, the
sampling kernels under TRITON_INTERPRET=1 on the CPU, and its torch form): greedy plans and
rows that do not verify keep their argmax, a sampled plan's verifying rows draw from the
row's distribution at the plan's temperature, among the tokens its top-k / top-p / min-p
keep, fresh noise per depth, the same noise for the rows of one plan at one depth."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (kernels are built on import)

import pytest
import torch

pytest.importorskip("triton")

from kiln.runtime.speculative import device_step, verify
from kiln.runtime.speculative.verify import SpecEntries
from kiln.runtime.speculative.draft import NO_WARP

V, T = 8, 4
OFFSETS = torch.tensor([0, 1, 1, -1])  # x, two rows at depth 1 (candidates), a window row
P = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0, 0.0, 0.0, 0.0])


def _entries(b: int, inv: list[float], keys: list[int], slots=None) -> SpecEntries:
    return SpecEntries(torch.tensor(slots if slots is not None else list(range(b))),
                       torch.arange(b) * T, torch.arange(b) * T,
                       inv_temp=torch.tensor(inv, dtype=torch.float32),
                       key=torch.tensor(keys, dtype=torch.long))


def _logits(b: int) -> torch.Tensor:
    """Every row log P (temperature 1 draws P), except row 3 of each plan (a window row),
    whose argmax is token 5."""
    x = P.clamp(min=1e-30).log().repeat(b * T, 1)
    x[3::T, 5] = 10.0
    return x


def _targets(kind: str, logits: torch.Tensor, entries: SpecEntries) -> torch.Tensor:
    b = entries.slots.shape[0]
    if kind == "kernel":  # 10 plans a call: each row's program scans the call's plans, and
        # the interpreter runs that loop in Python
        parts = []
        for i in range(0, b, 10):
            e = SpecEntries(*(x[i : i + 10] for x in (entries.slots, entries.q0, entries.r0)),
                            inv_temp=entries.inv_temp[i : i + 10], key=entries.key[i : i + 10],
                            warp=None if entries.warp is None else entries.warp[i : i + 10])
            e.r0 = e.r0 - i * T
            e.q0 = e.q0 - i * T
            parts.append(verify.row_targets(logits[i * T : (i + 10) * T], e, OFFSETS))
        return torch.cat(parts).view(b, T)
    rows = entries.r0[:, None] + torch.arange(T)
    active = torch.nonzero(entries.slots >= 0)[:, 0]
    return verify.row_targets_torch(logits, rows[active], entries, active, OFFSETS)


@pytest.mark.parametrize("kind", ["kernel", "torch"])
def test_sampled_rows_follow_the_distribution_and_share_noise_by_depth(kind):
    b = 300  # the interpreter runs a program per row: ~13 s
    targets = _targets(kind, _logits(b), _entries(b, [1.0] * b, list(range(7, 7 + b))))
    assert (targets[:, 1] == targets[:, 2]).all()  # one depth, one draw
    assert (targets[:, 3] == 5).all()  # the window row keeps its argmax
    for depth in (0, 1):
        freq = torch.bincount(targets[:, depth], minlength=V).double() / b
        assert 0.5 * (freq - P.double()).abs().sum() < 0.08, freq  # noise alone: ~0.04
    # depths 0 and 1 draw independently: they agree at sum p^2 = 0.30, not always
    agree = (targets[:, 0] == targets[:, 1]).double().mean()
    assert 0.18 < agree < 0.42, agree


@pytest.mark.parametrize("kind", ["kernel", "torch"])
def test_greedy_plans_and_rows_without_a_plan_keep_the_argmax(kind):
    logits = torch.randn(3 * T, V, generator=torch.Generator().manual_seed(0))
    entries = _entries(3, [0.0, 2.0, 0.0], [0, 5, 0], slots=[0, 1, -1])
    targets = _targets(kind, logits, entries)
    argmax = logits.argmax(-1).view(3, T)
    assert targets[0].tolist() == argmax[0].tolist()
    if kind == "kernel":  # the entry without a plan: its rows keep the argmax too
        assert targets[2].tolist() == argmax[2].tolist()
    assert targets[1, 3] == argmax[1, 3]  # a sampled plan's window row


@pytest.mark.parametrize("kind", ["kernel", "torch"])
def test_the_same_key_draws_the_same_tokens(kind):
    b = 50
    logits = _logits(b)
    one = _targets(kind, logits, _entries(b, [1.0] * b, [3] * b))
    assert (one == one[0]).all()  # one key: one draw per depth, whatever the entry
    other = _targets(kind, logits, _entries(b, [1.0] * b, list(range(b))))
    assert not (other == other[0]).all()


def test_every_sampled_request_is_verified_on_the_device():
    from kiln.runtime.sampling_params import SamplingParams

    ok = device_step.device_verifiable
    assert ok(SamplingParams(temperature=0)) and ok(SamplingParams(temperature=0.7))
    assert ok(SamplingParams(temperature=0.7, top_k=5))
    assert ok(SamplingParams(temperature=0.7, top_p=0.9))
    assert ok(SamplingParams(temperature=0.7, min_p=0.1))
    assert device_step.plan_warp(SamplingParams(temperature=0.7, top_k=5, top_p=0.5,
                                                min_p=0.1)) == (5.0, 0.5, 0.1)
    assert device_step.plan_warp(SamplingParams(temperature=0.7)) == NO_WARP


def test_plan_thresholds_keep_what_the_host_warp_keeps():
    """The kernels' threshold of each warped row (from the 64 largest logits, or a search
    of the whole row) keeps exactly the tokens ``warp_batch`` (the host's sort and
    cumulative sum) keeps, for top-k, top-p, min-p and their mixes, sharp and flat rows,
    k below, at and past the candidates; rows of greedy or unwarped plans and rows that do
    not verify get -inf."""
    from kiln.runtime.kernels.sampling import plan_thresholds
    from kiln.runtime.layers.sampler import warp_batch
    from kiln.runtime.sampling_params import SamplingParams

    t = 3
    depths = torch.tensor([0, 1, -1])
    cases = [(0.7, 0, 0.9, 0.0), (1.0, 5, 1.0, 0.0), (0.5, 40, 0.8, 0.0), (1.3, 0, 1.0, 0.05),
             (0.9, 20, 0.5, 0.1), (1.0, 0, 1.0, 0.0), (0.0, 5, 0.5, 0.0), (1.0, 63, 0.95, 0.0),
             (1.0, 64, 1.0, 0.0)]
    b = len(cases)
    # a few tokens kept (settled by the 64 candidates), hundreds kept (the whole-row
    # search); 5000 tokens: three parts of the vocabulary, candidates merged across them
    for scale, vocab in ((3.0, 700), (0.3, 700), (3.0, 5000)):
        logits = torch.randn(b * t, vocab, generator=torch.Generator().manual_seed(0)) * scale
        inv = torch.tensor([1 / c[0] if c[0] else 0.0 for c in cases])
        warp = torch.tensor([c[1:] for c in cases], dtype=torch.float32)
        thr = plan_thresholds(logits, torch.arange(b), torch.arange(b) * t, inv, warp, depths)
        for e, (temp, k, p, mp) in enumerate(cases):
            for j in range(t):
                r = e * t + j
                if depths[j] < 0 or temp == 0 or (k, p, mp) == (0, 1.0, 0.0):
                    assert thr[r] == float("-inf"), (scale, e, j)
                    continue
                params = SamplingParams(temperature=temp, top_k=k, top_p=p, min_p=mp)
                kept = warp_batch(logits[r][None], [params])[0] > 0
                assert torch.equal(logits[r] * inv[e] >= thr[r], kept), (scale, e, j)


@pytest.mark.parametrize("kind", ["kernel", "torch"])
def test_warped_rows_draw_from_the_warped_distribution(kind):
    """top_p 0.75 keeps P's first three tokens (0.4 + 0.3 < 0.75 <= 0.9), top_k 2 its
    first two: draws follow P renormalised over them, never another token. The kernel
    (interpreted: ~1 s a plan here) draws 30 plans and is checked for the kept set alone;
    which tokens a threshold keeps is checked exactly above."""
    b = 30 if kind == "kernel" else 300
    for warp_row, keep in (((0.0, 0.75, 0.0), 3), ((2.0, 1.0, 0.0), 2)):
        entries = _entries(b, [1.0] * b, list(range(7, 7 + b)))
        entries.warp = torch.tensor([warp_row] * b, dtype=torch.float32)
        targets = _targets(kind, _logits(b), entries)
        assert (targets[:, 3] == 5).all()  # the window row keeps its argmax
        want = P[:keep].double() / P[:keep].sum()
        for depth in (0, 1):
            freq = torch.bincount(targets[:, depth], minlength=V).double() / b
            assert freq[keep:].sum() == 0, (warp_row, freq)
            if kind == "torch":
                assert 0.5 * (freq[:keep] - want).abs().sum() < 0.08, (warp_row, freq)
            else:
                assert (freq[:keep] > 0).sum() >= 2, (warp_row, freq)


def test_plan_rows_kernel_equals_per_row_keys():
    """``sample_plan_rows`` (each row finds its plan in the kernel) draws what
    ``sample_tokens`` draws with the per-row temperatures and keys laid out by hand."""
    from kiln.runtime.kernels.sampling import sample_plan_rows, sample_tokens

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3 * T + 2, V, generator=g)  # two rows of no plan at the end
    slots, r0 = torch.tensor([0, -1, 2]), torch.tensor([0, T, 2 * T])
    inv, key = torch.tensor([1.5, 2.0, 0.0]), torch.tensor([11, 12, 13])
    got = sample_plan_rows(logits, slots, r0, inv, key, OFFSETS)
    row_inv = torch.zeros(logits.shape[0])
    row_key = torch.zeros(logits.shape[0], dtype=torch.long)
    for j, d in enumerate(OFFSETS.tolist()):  # only plan 0 samples, where it verifies
        if d >= 0:
            row_inv[j], row_key[j] = 1.5, 11 + (d << 32)
    assert got.tolist() == sample_tokens(logits, row_inv, row_key).tolist()
