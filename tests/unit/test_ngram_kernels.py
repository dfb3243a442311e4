"""Prompt-lookup step kernels (kiln/runtime/kernels/ngram.py) vs the torch ops they replace
(DeviceNgram.propose / verify / update), on Triton's CPU interpreter, and the torch ops vs
the host worker (find_draft, NgramWorker's greedy verification), the oracle.

Two identical DeviceNgram states run the same steps side by side, one through the torch ops
and one through the kernels, with a stand-in model whose greedy token after any row is a
bigram table of that row's token (so copied continuations get accepted). After every step
the proposal, the verdict and the state must be equal exactly, and equal to what the host
worker proposes and commits from the same text.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (kernels are built on import)

import random

import pytest
import torch

pytest.importorskip("triton")

from helpers import find_draft

from kiln.runtime.kernels.ngram import ngram_commit, ngram_propose
from kiln.runtime.speculative.device_ngram import DeviceNgram

NUM_SLOTS = 5
SLOTS = [3, 0, 4]  # slots 1 and 2 stay idle: the kernels must not touch them


def propose(st, slots, input_ids=None, q0=None):
    """``ngram_propose`` on ``st``'s history and settings."""
    return ngram_propose(st.history, st.length, slots, max_match=st.max_match,
                         min_match=st.min_match, max_draft_len=st.max_draft_len,
                         input_ids=input_ids, q0=q0)


def make_states(rng, vocab, draft, max_match, min_match, capacity=400):
    states = [DeviceNgram(NUM_SLOTS, draft, max_match, min_match, capacity, torch.device("cpu"))
              for _ in range(2)]
    texts = {}
    # a 1-token prompt (no draft possible), short ones and a long one crossing a search block
    for slot, length in zip(range(NUM_SLOTS), (1, 3, 9, 300, 12)):
        motif = [rng.randrange(vocab) for _ in range(rng.randint(2, 6))]
        text = [motif[i % len(motif)] if rng.random() < 0.8 else rng.randrange(vocab)
                for i in range(length)]
        for st in states:
            st.admit(slot, text)
        texts[slot] = text
    return states, texts


def host_step(text, argmax, draft_len, max_match, min_match):
    """The host worker's step on ``text``: its draft, and what greedy verification commits
    given the model's token after each row (``argmax``)."""
    draft = find_draft(text, max_match, min_match, draft_len)
    accepted = []
    for i, d in enumerate(draft):
        if argmax[i] != d:
            break
        accepted.append(d)
    accepted.append(argmax[len(accepted)])
    return draft, accepted


@pytest.mark.parametrize("draft,max_match,min_match", [(8, 3, 1), (4, 2, 2), (1, 1, 1),
                                                        (6, 4, 3)])
def test_kernel_steps_equal_the_torch_ops_and_the_host_worker(draft, max_match, min_match):
    rng = random.Random(draft * 100 + max_match * 10 + min_match)
    vocab = 7
    bigram = torch.tensor([rng.randrange(vocab) for _ in range(vocab)])
    (ref, dut), texts = make_states(rng, vocab, draft, max_match, min_match)
    slots = torch.tensor(SLOTS)
    idle = [dut.history[[1, 2]].clone(), dut.length[[1, 2]].clone()]
    accepted = 0
    for step in range(12):
        tokens, lens = ref.propose(slots)
        k_tokens, k_lens = propose(dut, slots)
        assert torch.equal(tokens, k_tokens) and torch.equal(lens, k_lens), step
        out = bigram[tokens]
        if step % 3 == 2:  # now and then the model disagrees with the text's continuation
            out = (out + 1) % vocab
        verdict = ref.verify(tokens, out, lens)
        ref.update(slots, tokens, out, verdict)
        k_committed, k_count = ngram_commit(dut.history, dut.length, slots, k_tokens, k_lens,
                                            out)
        assert torch.equal(verdict.count, k_count), step
        assert torch.equal(verdict.committed, k_committed), step
        assert torch.equal(ref.history, dut.history) and torch.equal(ref.length, dut.length)
        for b, slot in enumerate(SLOTS):  # the oracle, from the same text
            h_draft, h_acc = host_step(texts[slot], out[b].tolist(), draft, max_match,
                                       min_match)
            assert tokens[b, 1:1 + len(h_draft)].tolist() == h_draft, (step, slot)
            assert int(lens[b]) == len(h_draft), (step, slot)
            c = int(verdict.count[b])
            assert verdict.committed[b, :c].tolist() == h_acc, (step, slot)
            texts[slot] += h_acc
            assert ref.history[slot, : len(texts[slot])].tolist() == texts[slot]
            accepted += c - 1
    assert torch.equal(dut.history[[1, 2]], idle[0]) and torch.equal(dut.length[[1, 2]], idle[1])
    assert accepted > 0  # the comparison covered accepted drafts, not only bonus tokens


def test_propose_writes_the_input_ids_and_skips_spare_entries():
    rng = random.Random(5)
    (ref, dut), _ = make_states(rng, 5, 4, 3, 1)
    slots = torch.tensor([3, -1, 0])
    q0 = torch.tensor([0, 0, 6])
    ids = torch.full((12,), -5, dtype=torch.int32)
    tokens, lens = propose(dut, slots, ids, q0)
    t = dut.num_tokens
    assert ids[:t].tolist() == tokens[0].tolist() and ids[6:6 + t].tolist() == tokens[2].tolist()
    assert ids[t:6].tolist() == [-5] * (6 - t) and ids[6 + t:].tolist() == [-5] * (6 - t)
    out = ngram_commit(dut.history, dut.length, slots, tokens, lens,
                       torch.zeros(3, t, dtype=torch.int32))
    assert len(out) == 2  # (committed, count): a chain moves no KV
    count = out[1]
    assert count[1] == 0 and count[[0, 2]].tolist() == [1, 1]


def test_bad_arguments_name_what_is_wrong():
    st = DeviceNgram(2, 4, 3, 1, 64, torch.device("cpu"))
    with pytest.raises(ValueError, match="slots"):
        propose(st, torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match="input_ids and q0"):
        propose(st, torch.tensor([0]), torch.zeros(8, dtype=torch.int32))
    with pytest.raises(ValueError, match="argmax"):
        ngram_commit(st.history, st.length, torch.tensor([0]),
                     torch.zeros(1, 5, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                     torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="max_draft_len"):
        DeviceNgram(2, 0, 3, 1, 64, torch.device("cpu"))
    with pytest.raises(ValueError, match="do not fit"):
        st.admit(0, list(range(65)))


def test_device_spec_step_kernels_equal_its_torch_path():
    """DeviceSpecStep (what a masked bucket's graph runs around its forward) through the
    kernels and through the torch ops, over entries with spare rows (slot -1) between them:
    the same input ids, commits and histories after every step, and the KV cache untouched
    (a chain's accepted rows are in place)."""
    from kiln.runtime.kv_cache import KVCache
    from kiln.runtime.speculative.device_step import DeviceSpecStep, SpecEntries

    rng = random.Random(11)
    vocab = 6
    bigram = torch.tensor([rng.randrange(vocab) for _ in range(vocab)])
    (ref, dut), _ = make_states(rng, vocab, 5, 3, 1)
    t = ref.num_tokens
    slots = torch.tensor([3, -1, 0, -1])
    q0 = torch.tensor([0, 0, t + 1, 0])
    r0 = torch.tensor([0, 0, t + 1, 0])
    num_tokens = 2 * t + 1
    torch.manual_seed(0)
    cache = KVCache(2, 16, 4, 2, 8, torch.float32, "cpu")
    cache.k.normal_(), cache.v.normal_()
    k0, v0 = cache.k.clone(), cache.v.clone()
    slot_mapping = torch.randperm(16 * 4)[:num_tokens].to(torch.int32)
    torch_step, kernel_step = DeviceSpecStep(ref), DeviceSpecStep(dut)
    kernel_step.proposer.use_kernels(True)  # the CUDA path, interpreted
    accepted = 0
    for step in range(6):
        outs = []
        for st in (torch_step, kernel_step):
            entries = SpecEntries(slots.clone(), q0.clone(), r0.clone())
            ids = torch.full((num_tokens,), -5, dtype=torch.int32)
            proposal = st.prologue(entries, ids)
            logits = torch.nn.functional.one_hot(bigram[ids.long().clamp(min=0)],
                                                 vocab).float()
            out = st.epilogue(entries, proposal, logits, slot_mapping, cache)
            outs.append((ids, out))
        (ids_a, a), (ids_b, b) = outs
        assert torch.equal(ids_a, ids_b), step
        assert ids_a[t] == -5  # the plain row between the plans is untouched
        assert torch.equal(a.count, b.count) and a.count[[1, 3]].tolist() == [0, 0], step
        live = a.count > 0
        assert torch.equal(a.committed[live], b.committed[live]), step
        assert torch.equal(ref.history, dut.history) and torch.equal(ref.length, dut.length)
        assert torch.equal(torch_step.last_count, kernel_step.last_count)
        accepted += int((a.count[live] - 1).sum())
    assert torch.equal(cache.k, k0) and torch.equal(cache.v, v0)
    assert accepted > 0
