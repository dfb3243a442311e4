"""Block manager: allocation, ref counts, prefix cache, eviction."""

import pytest
import torch

from kiln.runtime.kv_cache import BlockManager, KVCache
from kiln.runtime.layers.attention import read_kv, write_kv


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    table: list[int] = []
    bm.allocate(table, 9)  # 3 blocks
    assert len(table) == 3 and bm.num_free_blocks == 5
    bm.allocate(table, 12)  # still 3
    assert len(table) == 3
    bm.allocate(table, 13)
    assert len(table) == 4
    bm.free(table)
    assert table == [] and bm.num_free_blocks == 8
    bm.check_all_free()


def test_allocate_beyond_capacity_raises_with_message():
    bm = BlockManager(num_blocks=2, block_size=4)
    assert not bm.can_allocate([], 9)
    with pytest.raises(RuntimeError, match="out of blocks"):
        bm.allocate([], 9)


def test_double_free_is_detected():
    bm = BlockManager(num_blocks=2, block_size=4)
    table: list[int] = []
    bm.allocate(table, 4)
    copy = list(table)
    bm.free(table)
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.free(copy)


def test_prefix_cache_shares_full_blocks_and_leaves_one_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    a: list[int] = []
    hashes: list[int] = []
    bm.allocate(a, len(tokens))
    bm.cache_full_blocks(a, hashes, tokens, num_computed=len(tokens))
    assert len(hashes) == 2
    blocks, got = bm.match_prefix(tokens)
    assert blocks == a[:2] and got == hashes
    # shared blocks are referenced twice: freeing one owner keeps them
    bm.free(a)
    assert bm.num_free_blocks == 8 - 2
    bm.free(blocks)
    bm.check_all_free()
    # exactly one full block of prompt: never fully cached (one token must be computed)
    b, _ = bm.match_prefix(tokens[:4])
    assert b == []


def test_freed_cached_blocks_are_reused_then_evicted():
    bm = BlockManager(num_blocks=3, block_size=2)
    tokens = [1, 2, 3, 4, 5]
    t: list[int] = []
    h: list[int] = []
    bm.allocate(t, 5)
    bm.cache_full_blocks(t, h, tokens, 5)
    bm.free(t)
    hit, _ = bm.match_prefix(tokens)
    assert len(hit) == 2
    bm.free(hit)
    # allocate everything: cached blocks get evicted, no longer found
    other: list[int] = []
    bm.allocate(other, 6)
    assert bm.match_prefix(tokens)[0] == []
    bm.free(other)
    bm.check_all_free()


def test_different_prefix_does_not_match():
    bm = BlockManager(num_blocks=4, block_size=2)
    t: list[int] = []
    h: list[int] = []
    bm.allocate(t, 4)
    bm.cache_full_blocks(t, h, [1, 2, 3, 4], 4)
    blocks, _ = bm.match_prefix([1, 2, 9, 9, 9])
    assert len(blocks) == 1  # first block shared, second differs
    bm.free(blocks)
    bm.free(t)
    bm.check_all_free()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_hnd_cache_holds_what_nhd_holds(dtype):
    """The two KV layouts (``KVCache(layout=)``) store the same values at the same slots:
    the torch backend's write and read, and ``move_slots``, give equal logical caches; HND
    keeps a head's tokens of a block side by side in memory."""
    layers, blocks, bs, heads, dim = 2, 6, 4, 3, 8
    caches = [KVCache(layers, blocks, bs, heads, dim, dtype, "cpu", layout=lay)
              for lay in ("NHD", "HND")]
    nhd, hnd = caches
    assert nhd.k.is_contiguous() and not hnd.k.is_contiguous()
    assert hnd.k.stride()[2:] == (dim, bs * dim, 1)  # [.., block_size, kv_heads, head_dim]
    torch.manual_seed(0)
    slots = torch.randperm(blocks * bs)[:10]
    k, v = torch.randn(10, heads, dim), torch.randn(10, heads, dim)
    for c in caches:
        write_kv(1, k, v, c, slots)
        c.move_slots(slots[:3], slots[7:])
    assert torch.equal(nhd.k.float(), hnd.k.float()) and torch.equal(nhd.v.float(), hnd.v.float())
    got = [read_kv(1, c, slots[7:], torch.float32) for c in caches]
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    assert torch.equal(got[0][0], read_kv(1, nhd, slots[:3], torch.float32)[0])
    with pytest.raises(ValueError, match="layout 'NDH' must be one of NHD, HND"):
        KVCache(1, 1, 1, 1, 8, dtype, "cpu", layout="NDH")
