"""Token-budget scheduler: chunked prefill, budget sharing, preemption, admission."""

from kiln.runtime.kv_cache import BlockManager
from kiln.runtime.request import Request, Status
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import Scheduler


def _req(rid, n, max_tokens=100, ignore_eos=False):
    return Request(rid, list(range(1, n + 1)),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos), frozenset())


def _add_known_length(sched, n=3):
    """``n`` requests of 8 prompt tokens that end at 20 tokens (ignore_eos), added in order."""
    reqs = [_req(str(i), 8, max_tokens=12, ignore_eos=True) for i in range(n)]
    for r in reqs:
        sched.add(r)
    return reqs


def _run(sched, batch, new_tokens=True):
    """Pretend the step ran: advance counts, append a token to requests that finished input."""
    sched.after_step(batch)
    for req, _ in batch.items:
        if new_tokens and req.num_computed_tokens == req.num_tokens:
            req.append_token(7)


def test_prefill_is_chunked_by_the_token_budget():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_tokens=10)
    a = _req("a", 25)
    sched.add(a)
    chunks = []
    while a.num_computed_tokens < 25:
        b = sched.schedule()
        chunks.append(b.items[0][1])
        _run(sched, b)
    assert chunks == [10, 10, 5]
    # next step is a single decode token
    assert sched.schedule().items == [(a, 1)]


def test_running_requests_go_first_and_budget_is_shared():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_tokens=8)
    a, b = _req("a", 3), _req("b", 20)
    sched.add(a)
    _run(sched, sched.schedule())  # a prefilled, has 1 new token
    sched.add(b)
    batch = sched.schedule()
    assert [(r.request_id, n) for r, n in batch.items] == [("a", 1), ("b", 7)]


def test_max_num_seqs_caps_admission():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_tokens=100)
    for i in range(3):
        sched.add(_req(str(i), 4))
    batch = sched.schedule()
    assert len(batch.items) == 2 and len(sched.waiting) == 1


def test_preemption_frees_the_newest_and_it_recomputes_later():
    bm = BlockManager(6, 4)  # 24 token slots
    # without the admission's KV reservation (which would keep b waiting: see below)
    sched = Scheduler(bm, max_num_seqs=8, max_num_tokens=100, reserve=False)
    a, b = _req("a", 8), _req("b", 12)
    sched.add(a)
    sched.add(b)
    _run(sched, sched.schedule())  # a: 2 blocks (+1 token), b: 3 blocks (+1 token); 1 free
    for _ in range(4):
        batch = sched.schedule()
        if batch.preempted:
            break
        _run(sched, batch)
    assert batch.preempted == [b]
    assert b.status is Status.WAITING and b.num_computed_tokens == 0 and not b.block_table
    assert b.output_token_ids  # generated tokens are kept and recomputed, not lost
    _run(sched, batch)
    sched.finish(a)
    batch = sched.schedule()
    assert batch.items[0][0] is b and batch.items[0][1] == b.num_tokens - b.num_computed_tokens
    sched.finish(b)
    bm.check_all_free()


def test_prefix_cache_hit_skips_cached_tokens():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_tokens=100)
    a = _req("a", 10)
    sched.add(a)
    _run(sched, sched.schedule())
    sched.finish(a)
    b = _req("b", 10)
    sched.add(b)
    batch = sched.schedule()
    assert batch.items == [(b, 2)]  # 8 tokens (2 full blocks) served from the cache
    assert b.metrics.num_cached_prompt_tokens == 8
    sched.finish(b)
    bm.check_all_free()


def test_schedule_ahead_allocates_one_more_token_or_nothing():
    """Async scheduling's step scheduled on top of a launched one: each request gets one
    decode token whose input is in flight and the blocks for it, all or none; a prompt
    chunk, waiting requests with a free slot or a request at its length limit leave the
    choice to schedule()."""
    blocks = BlockManager(3, 4)
    # reserve=False: pools smaller than the admission would reserve
    sched = Scheduler(blocks, max_num_seqs=2, max_num_tokens=16, reserve=False)
    a, b = _req("a", 4), _req("b", 3)
    sched.add(a)
    sched.add(b)
    launched = sched.schedule()
    _run(sched, launched, new_tokens=False)  # its samples are in flight
    assert a.num_computed_tokens == a.num_tokens == 4 and len(a.block_table) == 1
    batch = sched.schedule_ahead(launched, max_seq_len=100)
    assert batch.items == [(a, 1), (b, 1)] and batch.in_flight == 1
    assert len(a.block_table) == 2 and blocks.num_free_blocks == 0  # a's 5th token: block 2
    assert batch.samples(a, 5) and batch.input_ids(a, 4, 5) == [0]  # 0: patched on device
    a.all_token_ids += [7] * 4
    a.num_computed_tokens += 4  # a would need a third block: none free
    assert sched.schedule_ahead(launched, max_seq_len=100) is None and len(a.block_table) == 2
    a.num_computed_tokens -= 1  # a prompt chunk short of its end
    assert sched.schedule_ahead(launched, max_seq_len=100) is None
    a.num_computed_tokens += 1
    del a.all_token_ids[4:]
    a.num_computed_tokens = 4
    # max_seq_len 5: a's token in flight is its last; b alone continues ...
    assert sched.schedule_ahead(launched, max_seq_len=5).items == [(b, 1)]
    sched.add(_req("c", 2))  # ... unless c waits for the slot a leaves: schedule() admits it
    assert sched.schedule_ahead(launched, max_seq_len=5) is None


def test_schedule_ahead_with_admit_adds_prompt_chunks_and_admissions():
    """With ``admit`` the step scheduled ahead is what schedule() would run: the requests
    whose samples are in flight decode first (their inputs are patched on the device, rows
    0..k-1), then the next chunk of a prompt in chunks, then waiting requests ``admit``
    accepts, within the token budget; a chunk that does not fit the free blocks waits
    (nothing is preempted ahead)."""
    blocks = BlockManager(16, 4)
    # reserve=False: pools smaller than the admission would reserve
    sched = Scheduler(blocks, max_num_seqs=4, max_num_tokens=10, reserve=False)
    a, b = _req("a", 3), _req("b", 20)
    sched.add(a)
    sched.add(b)
    launched = sched.schedule()  # a's prompt (3), b's first chunk (7)
    assert launched.items == [(a, 3), (b, 7)]
    _run(sched, launched, new_tokens=False)  # a's first sample is in flight
    c, d = _req("c", 5), _req("d", 2)
    c.all_token_ids[:] = [50 + t for t in c.all_token_ids]  # no prefix-cache hit on b's
    sched.add(c)
    sched.add(d)
    assert sched.schedule_ahead(launched, max_seq_len=100) is None  # no admit: schedule()
    # a running prompt whose next chunk admit refuses (e.g. host sampling): schedule() runs
    assert sched.schedule_ahead(launched, max_seq_len=100, admit=lambda r: r is not b) is None
    batch = sched.schedule_ahead(launched, max_seq_len=100, admit=lambda r: r is not d)
    assert batch.items == [(a, 1), (b, 9)] and batch.in_flight == 1  # budget: 1 + 9
    assert batch.samples(a, 4) and not batch.samples(b, 16) and batch.input_ids(a, 3, 4) == [0]
    assert c.status is Status.WAITING  # no budget left
    a.append_token(7)  # the engine reads launched's tokens after launching batch
    sched.after_step(batch)  # b: 16 of 20
    nxt = sched.schedule_ahead(batch, max_seq_len=100, admit=lambda r: r is not d)
    # a decodes (in flight), b finishes its prompt (4, samples), c is admitted (5); d is
    # refused by admit and waits (in arrival order)
    assert nxt.items == [(a, 1), (b, 4), (c, 5)] and nxt.samples(b, 20)
    assert c.status is Status.RUNNING and d.status is Status.WAITING
    # d is next in line with a slot free: it needs the host, so schedule() runs next
    # (steps launched ahead would otherwise keep it waiting while others decode)
    a.append_token(7)
    sched.after_step(nxt)
    assert sched.schedule_ahead(nxt, max_seq_len=100, admit=lambda r: r is not d) is None


def test_schedule_ahead_with_admit_leaves_a_chunk_that_does_not_fit():
    blocks = BlockManager(4, 4)
    # reserve=False: pools smaller than the admission would reserve
    sched = Scheduler(blocks, max_num_seqs=4, max_num_tokens=10, reserve=False)
    a, b = _req("a", 3), _req("b", 15)
    sched.add(a)
    sched.add(b)
    launched = sched.schedule()  # a (3 tokens: 1 block), b's first 7 (2 blocks)
    _run(sched, launched, new_tokens=False)
    batch = sched.schedule_ahead(launched, max_seq_len=100, admit=lambda r: True)
    # a's 4th token fits its block; b's last 8 tokens need 2 more blocks, 1 is free
    assert batch.items == [(a, 1)] and blocks.num_free_blocks == 1


def test_admission_reserves_the_known_growth_of_running_requests():
    """ignore_eos requests end at max_tokens: a waiting one is admitted only while the pool
    holds every running request at its end and it too, so nothing is ever preempted; the
    one that waits is admitted once a running request finishes."""
    bm = BlockManager(10, 4)  # 40 token slots; each request ends at 8 + 12 = 20 tokens
    sched = Scheduler(bm, max_num_seqs=8, max_num_tokens=100)
    reqs = _add_known_length(sched)
    assert [r for r, _ in sched.schedule().items] == reqs[:2]  # 2 x 5 blocks: the pool
    assert list(sched.waiting) == [reqs[2]]
    preempted = 0
    while reqs[0].num_tokens < 20 or reqs[1].num_tokens < 20:
        batch = sched.schedule()
        preempted += len(batch.preempted)
        assert [r for r, _ in batch.items] == reqs[:2]
        _run(sched, batch)
    assert preempted == 0
    for r in reqs[:2]:
        r.finish("length")
        sched.finish(r)
    assert [r for r, _ in sched.schedule().items] == [reqs[2]]
    assert sched.expected_tokens(reqs[2]) == 20


def test_unknown_lengths_are_expected_at_the_finished_requests_mean():
    """Without ignore_eos a request may stop any time: its expected end is its prompt plus
    the mean output of the requests that finished (512 before any), at most max_tokens and
    max_seq_len, never less than it holds; the admission reserves that much."""
    sched = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_tokens=100,
                      max_seq_len=300)
    r = _req("r", 10, max_tokens=1000)
    assert sched.expected_tokens(r) == 300  # 10 + 512, past max_seq_len
    assert sched.expected_tokens(_req("s", 10, max_tokens=20)) == 30
    for n, reason in ((10, "stop"), (21, "length"), (99, "abort")):  # aborts do not count
        done = _req(f"d{n}", 4)
        done.output_token_ids = [7] * n
        done.finish(reason)
        sched.finish(done)
    assert sched.expected_tokens(r) == 10 + 16  # mean of 10 and 21, rounded up
    r.output_token_ids = [7] * 30
    r.all_token_ids += [7] * 30
    assert sched.expected_tokens(r) == 40  # already past the estimate: what it holds
    # a running request expected to grow to 80 tokens (20 blocks) keeps a 22-block pool's
    # admission to what is left beside it
    sched = Scheduler(BlockManager(22, 4), max_num_seqs=8, max_num_tokens=200)
    a, b = _req("a", 8, max_tokens=72), _req("b", 8, max_tokens=8)
    sched.add(a)
    sched.add(b)
    assert [x for x, _ in sched.schedule().items] == [a]  # b needs 4 blocks, 20 + 4 > 22
    assert list(sched.waiting) == [b]
    off = Scheduler(BlockManager(22, 4), max_num_seqs=8, max_num_tokens=200, reserve=False)
    a, b = _req("a", 8, max_tokens=72), _req("b", 8, max_tokens=8)
    off.add(a)
    off.add(b)
    assert [x for x, _ in off.schedule().items] == [a, b]


def test_requests_the_reservation_holds_out_do_not_stop_scheduling_ahead():
    """A waiting request the KV reservation keeps out would not be admitted by schedule()
    either: the decode step after a launched one is still scheduled ahead (without
    ``admit``, as speculative engines call it), until a running request finishes."""
    bm = BlockManager(10, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_tokens=100)
    reqs = _add_known_length(sched)
    launched = sched.schedule()
    assert [r for r, _ in launched.items] == reqs[:2] and list(sched.waiting) == [reqs[2]]
    _run(sched, launched, new_tokens=False)
    launched = sched.schedule()  # the reservation holds reqs[2] out
    assert [r for r, _ in launched.items] == reqs[:2]
    _run(sched, launched, new_tokens=False)
    ahead = sched.schedule_ahead(launched, max_seq_len=100)
    assert ahead is not None and [r for r, _ in ahead.items] == reqs[:2]
    # without the reservation a request waits only for free blocks: schedule() decides
    off = Scheduler(BlockManager(5, 4), max_num_seqs=8, max_num_tokens=100, reserve=False)
    reqs = _add_known_length(off)
    launched = off.schedule()
    assert [r for r, _ in launched.items] == reqs[:2] and list(off.waiting) == [reqs[2]]
    _run(off, launched, new_tokens=False)
    assert off.schedule_ahead(launched, max_seq_len=100) is None
