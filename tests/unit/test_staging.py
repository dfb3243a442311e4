"""StepStager (the Triton path's host->device staging) against the reference runner's rules.

Every array is checked against what ModelRunner's reference path computes for the same batch
(slots via ``slots_of``, positions, query offsets, context lengths, logits rows), for a batch
mixing a decode, a non-final prefill chunk, a final chunk and a tree-masked draft plan; then
the graph padding layout. Also: the detokenizer's fast backend decode equals the wrapper's.
"""

from __future__ import annotations

import numpy as np
import torch

from kiln.runtime.detokenizer import Detokenizer
from kiln.runtime.model_runner import ForwardOutput, ModelRunner
from kiln.runtime.request import Request
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import ScheduledBatch
from kiln.runtime.speculative.draft import DraftPlan
from kiln.runtime.staging import StepStager

BS = 4


def _req(name: str, n_tokens: int, computed: int, table: list[int]) -> Request:
    r = Request(name, list(range(10, 10 + n_tokens)), SamplingParams(), frozenset())
    r.num_computed_tokens = computed
    r.block_table = list(table)
    return r


def _batch():
    dec = _req("dec", 9, 8, [7, 3, 5])  # decode of token 8
    chunk = _req("chunk", 20, 4, [1, 2, 9, 11, 12])  # tokens 4..9 of 20: no logits
    last = _req("last", 11, 8, [4, 6, 8])  # final chunk 8..10: sample row
    spec = _req("spec", 6, 5, [13, 14, 15])  # a 4-token tree plan from token 5
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]],
                        dtype=torch.bool)
    spec.draft = DraftPlan([15, 21, 22, 23], torch.tensor([0, 1, 1, 2]), mask)
    return ScheduledBatch([(dec, 1), (chunk, 6), (last, 3), (spec, 4)]), mask


def test_stage_matches_reference_rules():
    batch, mask = _batch()
    st = StepStager(max_seqs=8, max_tokens=32, max_blocks=8, block_size=BS, max_mask=64,
                    device=torch.device("cpu"))
    out = ForwardOutput(torch.empty(0))
    plans = st.plans(batch)
    assert plans[:3] == [None, None, None] and plans[3] is batch.items[3][0].draft
    s = st.stage(batch, plans, out)
    assert (s.num_seqs, s.num_tokens, s.num_rows, s.max_query_len, s.max_context_len,
            s.masked) == (4, 14, 1 + 1 + 4, 6, 11, True)
    ref = ModelRunner.__new__(ModelRunner)
    ref.block_size = BS
    h = st.h
    q0 = 0
    for i, (req, n) in enumerate(batch.items):
        start = req.num_computed_tokens
        want_slots = ref.slots_of(req.block_table, list(range(start, start + n)))
        assert h["slots"][q0 : q0 + n].tolist() == want_slots.tolist()
        assert h["query_start_loc"][i] == q0 and h["context_lens"][i] == start + n
        assert h["block_tables"][i, : len(req.block_table)].tolist() == req.block_table
        q0 += n
    assert h["query_start_loc"][4] == 14
    # token ids and positions: plain rows from the request, the plan's from the plan
    assert h["input_ids"][:10].tolist() == [18] + list(range(14, 20)) + [18, 19, 20]
    assert h["input_ids"][10:14].tolist() == [15, 21, 22, 23]
    assert h["positions"][:14].tolist() == [8, 4, 5, 6, 7, 8, 9, 8, 9, 10, 5, 6, 6, 7]
    # logits rows: decode, final chunk's last token, every plan row; the chunk gets none
    dec, _chunk, last, spec = (r for r, _ in batch.items)
    assert out.sample_rows == {dec: 0, last: 1} and out.draft_rows == {spec: (2, 4)}
    assert h["logit_rows"][:6].tolist() == [0, 9, 10, 11, 12, 13]
    assert h["mask_offsets"][:4].tolist() == [-1, -1, -1, 0]
    assert np.array_equal(st.mask_np[:16], mask.numpy().reshape(-1).astype(np.uint8))
    # the device twin got the same bytes (one copy)
    assert torch.equal(st.dev, st.host)
    meta = st.metadata(s.num_seqs, s.num_tokens, s.max_query_len, s.max_context_len, True)
    assert meta.block_tables.shape == (4, 8) and meta.slot_mapping.shape == (14,)


def test_stage_pads_for_a_graph_bucket():
    batch, _ = _batch()
    st = StepStager(max_seqs=8, max_tokens=32, max_blocks=8, block_size=BS, max_mask=64,
                    device=torch.device("cpu"))
    st.stage(batch, st.plans(batch), ForwardOutput(torch.empty(0)), pad=(8, 32))
    h = st.h
    # sequences 4..7 empty, sequence 8 (padding) holds tokens 14..31, which write nowhere
    assert h["query_start_loc"][4:9].tolist() == [14] * 5 and h["query_start_loc"][9] == 32
    assert h["context_lens"][4:8].tolist() == [0] * 4 and h["context_lens"][8] == 18
    assert h["mask_offsets"][4:9].tolist() == [-1] * 5
    assert (h["slots"][14:32] == -1).all() and (h["input_ids"][14:32] == 0).all()


def test_fits_refuses_what_the_buffers_cannot_hold():
    batch, _ = _batch()
    small = StepStager(max_seqs=3, max_tokens=32, max_blocks=8, block_size=BS, max_mask=64,
                       device=torch.device("cpu"))
    assert not small.fits(batch)  # 4 sequences
    short = StepStager(max_seqs=8, max_tokens=32, max_blocks=4, block_size=BS, max_mask=64,
                       device=torch.device("cpu"))
    assert not short.fits(batch)  # a 5-block table


def test_fast_detokenizer_equals_the_wrapper(smollm2_gguf):
    from transformers import AutoTokenizer

    from kiln.sources import make_byte_tokenizer

    smol = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    for tokenizer in (smol, make_byte_tokenizer()):
        d = Detokenizer(tokenizer)
        ids = tokenizer.encode("Hello, world! Ünïcode ✓ and  spaces\tand\nlines.",
                               add_special_tokens=False)
        assert d._fast is not None  # both agree with their wrapper, so the fast decode is used
        if d._fast is not None:
            assert d._fast(ids, skip_special_tokens=True) == tokenizer.decode(
                ids, skip_special_tokens=True)
        # incremental text == one-shot decode, whichever decode it uses
        r = Request("r", ids[:3], SamplingParams(), frozenset())
        d.init_request(r)
        for t in ids[3:]:
            r.append_token(t)
            d.update(r)
        d.update(r, final=True)
        assert r.text == tokenizer.decode(ids[3:], skip_special_tokens=True)
