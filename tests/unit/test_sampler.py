"""Sampler: greedy, penalties, top-k / top-p / min-p, seeds, logprobs."""

import math

import pytest
import torch

from kiln.runtime.layers.sampler import (
    INVALID_TOKEN,
    Sampler,
    apply_penalties,
    apply_repetition_penalty,
    describe_bad_row,
    warp,
    warp_batch,
)
from kiln.runtime.sampling_params import SamplingParams


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    toks, lps = Sampler()(logits, [SamplingParams(temperature=0)] * 2, [[], []], [None, None])
    assert toks == [1, 0] and lps == [None, None]


def test_repetition_penalty_hf_rule():
    row = torch.tensor([2.0, -2.0, 1.0])
    out = apply_repetition_penalty(row, [0, 1], 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]


def test_top_k_top_p_min_p_zero_out_the_tail():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert (warp(logits, SamplingParams(top_k=2)) > 0).tolist() == [True, True, False, False]
    assert (warp(logits, SamplingParams(top_p=0.7)) > 0).tolist() == [True, True, False, False]
    assert (warp(logits, SamplingParams(top_p=0.5)) > 0).tolist() == [True, False, False, False]
    probs = warp(logits, SamplingParams(min_p=0.25))  # keep p >= 0.125
    assert (probs > 0).tolist() == [True, True, True, False]
    assert probs.sum().item() == pytest.approx(1.0)


def test_seeded_sampling_is_reproducible_and_follows_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    p = SamplingParams(temperature=1.0, seed=7)

    def draw(n):
        g = torch.Generator().manual_seed(7)
        return [Sampler()(logits, [p], [[]], [g])[0][0] for _ in range(n)]

    a, b = draw(3000), draw(3000)
    assert a == b
    freq = torch.bincount(torch.tensor(a), minlength=3).float() / len(a)
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_logprobs_report_chosen_and_top():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    toks, lps = Sampler()(logits, [SamplingParams(temperature=0, logprobs=2)], [[]], [None])
    ref = torch.log_softmax(logits[0], -1)
    assert toks == [2]
    assert lps[0].logprob == pytest.approx(ref[2].item())
    assert list(lps[0].top) == [2, 1]


@pytest.mark.parametrize("kw,name", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"min_p": 2}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"logprobs": 50}, "logprobs"),
])
def test_bad_params_name_the_field(kw, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kw)


MIXED = [SamplingParams(temperature=0.7), SamplingParams(top_k=3),
         SamplingParams(temperature=1.3, top_p=0.6), SamplingParams(min_p=0.2),
         SamplingParams(temperature=0.5, top_k=5, top_p=0.9, min_p=0.05),
         SamplingParams(top_k=50)]  # top_k >= vocab: off


def test_warp_batch_equals_warp_row_by_row():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(MIXED), 50, generator=g) * 3
    logits[1, 7] = float("-inf")  # a token already masked (grammar) stays out
    got = warp_batch(logits, MIXED)
    for i, p in enumerate(MIXED):
        want = warp(logits[i], p)
        assert torch.allclose(got[i], want, atol=1e-6), (i, p)
        assert torch.equal(got[i] > 0, want > 0), (i, p)


def test_batched_rows_follow_their_distribution_next_to_greedy_and_seeded_rows():
    """Unseeded sampled rows are drawn together: each follows warp()'s distribution; a
    greedy row in the same batch stays argmax and a seeded row draws what it draws alone."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    n = 4000
    sampled = SamplingParams(temperature=1.0, top_p=0.9)  # keeps 0.5, 0.3, 0.15
    seeded = SamplingParams(temperature=1.0, seed=3)
    params = [sampled] * n + [SamplingParams(temperature=0), seeded]
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(3)
    toks, _ = Sampler()(logits.expand(n + 2, 4).clone(), params, [[]] * (n + 2),
                        [None] * (n + 1) + [gen])
    freq = torch.bincount(torch.tensor(toks[:n]), minlength=4).float() / n
    assert torch.allclose(freq, warp(logits, sampled), atol=0.03)
    assert freq[3] == 0  # cut by top_p
    assert toks[n] == 0
    alone, _ = Sampler()(logits[None], [seeded], [[]], [torch.Generator().manual_seed(3)])
    assert toks[n + 1] == alone[0]


def test_race_draws_follow_the_probabilities_and_never_pick_zero_mass():
    from kiln.runtime.layers.sampler import race

    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    torch.manual_seed(1)
    toks = race(probs.expand(20000, 4).contiguous())
    freq = torch.bincount(toks, minlength=4).float() / 20000
    assert torch.allclose(freq, probs, atol=0.02)
    assert freq[3] == 0


def test_the_sampling_kernels_take_greedy_seeded_and_temperature_only_rows():
    """kernel_inv_temps: which rows the CUDA sampling kernels may draw (1 / temperature, also
    for seeded rows, which draw with a key from their generator; 0 for greedy rows), and
    None as soon as one row needs top-k, top-p or min-p."""
    from kiln.runtime.layers.sampler import kernel_inv_temps

    rows = [SamplingParams(temperature=0), SamplingParams(temperature=0.5),
            SamplingParams(temperature=2.0, seed=1), SamplingParams(top_k=1),
            SamplingParams(top_k=100)]  # top_k >= vocab warps nothing
    assert kernel_inv_temps(rows, vocab=100) == [
        0.0, 2.0, 0.5, 0.0, 1.0]
    for warped in (SamplingParams(top_k=5), SamplingParams(top_p=0.9),
                   SamplingParams(min_p=0.1)):
        assert kernel_inv_temps(rows[:2] + [warped], vocab=100) is None
        assert kernel_inv_temps([warped], vocab=100) is None  # seeded too: host redraws
    assert kernel_inv_temps([], vocab=100) is None


def test_rows_that_are_not_finite_give_invalid_token_and_never_raise():
    """A model that emits NaN logits must neither take the engine down nor answer with an
    arbitrary token (token 0 repeated): every policy marks the row INVALID_TOKEN, the
    engine fails that request alone, and rows beside it are sampled as usual."""
    v = 16
    logits = torch.randn(8, v)
    logits[:7, 5] = float("nan")
    logits[6] = float("nan")
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8),
              SamplingParams(temperature=1.0, top_k=4), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=1.0, min_p=0.2), SamplingParams(temperature=1.0, seed=7),
              SamplingParams(temperature=1.0, seed=8, logprobs=2), SamplingParams(temperature=0)]
    gens = [None] * 5 + [torch.Generator().manual_seed(7), torch.Generator().manual_seed(8),
                         None]
    toks, lps = Sampler()(logits, params, [[]] * 8, gens)
    assert toks[:7] == [INVALID_TOKEN] * 7 and lps[6] is None
    assert toks[7] == int(logits[7].argmax())
    assert "NaN" in describe_bad_row(logits[0])
    masked = torch.full((v,), float("-inf"))
    assert "grammar" in describe_bad_row(masked)


@pytest.mark.parametrize("kw", [{"top_p": 5e-324}, {"top_p": 1e-300}, {"temperature": 1e-300},
                                {"temperature": 5e-324, "top_p": 5e-324},
                                {"repetition_penalty": 0.01}, {"repetition_penalty": 100.0}])
def test_degenerate_values_still_pick_an_allowed_token(kw):
    """The issue's crash: a tiny top_p (0 in float32) dropped every token, a tiny temperature
    overflowed the logits, and with a grammar's -inf mask the row became NaN and token 0
    (masked out) came back. Now the best allowed token always survives."""
    v = 32
    logits = torch.randn(2, v, generator=torch.Generator().manual_seed(0)) * 5
    logits[:, :10] = float("-inf")  # a grammar allows tokens 10.. only
    params = [SamplingParams(**kw), SamplingParams(**kw, seed=3)]
    gens = [None, torch.Generator().manual_seed(3)]
    toks, _ = Sampler()(logits, params, [[11, 12, 20], [11]], gens)
    assert all(10 <= t < v for t in toks), toks


def test_frequency_presence_penalties_and_logit_bias_follow_openai():
    """logit -= frequency * count + presence * (count > 0) over the generated tokens only;
    logit_bias adds to the named tokens; masked (-inf) tokens stay masked."""
    row = torch.tensor([1.0, 2.0, 3.0, float("-inf"), 0.5])
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0,
                       logit_bias=((0, 10.0), (3, 5.0)))
    out = apply_penalties(row, p, seen=[2, 4, 1, 1, 2], generated=[1, 1, 2])
    assert out.tolist() == [11.0, 2.0 - 1.0 - 1.0, 3.0 - 0.5 - 1.0, float("-inf"), 0.5]
    assert row[0] == 1.0  # the input is not changed
    # the prompt (seen but not generated) is not penalized by the additive penalties
    toks, _ = Sampler()(row[None].clone(), [SamplingParams(temperature=0, presence_penalty=2.0)],
                        [[2, 2]], [None], prompt_lens=[2])
    assert toks == [2]
    toks, _ = Sampler()(row[None].clone(), [SamplingParams(temperature=0, presence_penalty=2.0)],
                        [[2, 2]], [None], prompt_lens=[1])
    assert toks == [1]
    toks, _ = Sampler()(row[None].clone(), [SamplingParams(temperature=0,
                                                          logit_bias=((4, 100.0),))],
                        [[]], [None])
    assert toks == [4]


def test_logprobs_never_report_masked_alternatives():
    """Structured output with logprobs: tokens the grammar masked out (-inf) are not
    alternatives (their -inf is not valid JSON either)."""
    row = torch.full((1, 8), float("-inf"))
    row[0, 2], row[0, 5] = 1.0, 0.0
    toks, lps = Sampler()(row, [SamplingParams(temperature=0, logprobs=5)], [[]], [None])
    assert toks == [2]
    assert set(lps[0].top) == {2, 5}
    assert all(math.isfinite(v) for v in lps[0].top.values())


@pytest.mark.parametrize("kw, field", [
    ({"repetition_penalty": 5e-324}, "repetition_penalty"),
    ({"repetition_penalty": 1.1e307}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"temperature": float("nan")}, "temperature"), ({"top_p": float("inf")}, "top_p"),
    ({"frequency_penalty": 3.0}, "frequency_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"logit_bias": ((1, 101.0),)}, "logit_bias"), ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"), ({"stop_token_ids": (-1,)}, "stop_token_ids"),
])
def test_out_of_range_values_are_rejected_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field}="):
        SamplingParams(**kw)
    SamplingParams(seed=-5)  # any 64-bit integer is a seed
    SamplingParams(seed=2**64 - 1)


def test_seeded_rows_leave_tokens_on_the_device_only_on_the_kernel_path():
    """device_only: a step may keep its tokens on the device (async scheduling) with seeded
    rows only where the sampling kernels draw them (CUDA logits, no top-k / top-p / min-p in
    the batch); elsewhere their generator draws on the host."""
    g = torch.Generator().manual_seed(0)
    seeded, plain = SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0.8)
    assert Sampler.device_only([plain, SamplingParams(temperature=0)], [None, None])
    assert not Sampler.device_only([seeded], [g])  # no kernels (CPU logits)
    assert Sampler.device_only([seeded, plain], [g, None], kernels=True)
    assert not Sampler.device_only([seeded, SamplingParams(top_p=0.9)], [g, None],
                                   kernels=True)
    assert not Sampler.device_only([SamplingParams(seed=1, top_k=5)], [g], kernels=True)
    assert not Sampler.device_only([SamplingParams(logprobs=1)], [None], kernels=True)
