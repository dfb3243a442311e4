"""Suffix decoding's shared cache on the host: memory, the cost of adding a finished
response, and the cost of one proposal, with N responses of L tokens in the cache.

Tokens are Zipf-distributed ids (a=1.2, below 32,000): text with common and rare tokens,
few long repeats, so nearly every cached token brings new keys (the costly case). Memory is
the process's resident set before and after filling the cache.

usage: python benchmarks/suffix_cache.py [N=10000] [L=200] [DEPTH=24] [MIN_MATCH=2]"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from kiln.runtime.speculative.suffix import ResponseCache, SuffixIndex


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(n: int, length: int, depth: int, min_match: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    responses = [rng.zipf(1.2, length).clip(max=31999).tolist() for _ in range(n)]
    before = rss_mib()
    cache = ResponseCache(depth, n, min_match)
    t0 = time.perf_counter()
    for r in responses:
        cache.add(r)
    add_ms = (time.perf_counter() - t0) / n * 1e3
    grown = rss_mib() - before
    ids = responses[n // 2][: length // 2] + rng.zipf(1.2, 300).clip(max=31999).tolist()
    index = SuffixIndex(depth, min_match, 16, cache)
    t0 = time.perf_counter()
    steps = 200
    for j in range(steps):
        index.draft(ids, 50 + j)
    return {"tokens": cache.num_tokens, "rss_mib": grown,
            "bytes_per_token": grown * 2**20 / cache.num_tokens, "add_ms": add_ms,
            "proposal_ms": (time.perf_counter() - t0) / steps * 1e3}


def main(argv: list[str]) -> None:
    n, length, depth, min_match = (int(a) for a in (argv + ["10000", "200", "24", "2"][len(argv):]))
    r = measure(n, length, depth, min_match)
    print(f"{n} responses x {length} tokens ({r['tokens']:,} cached): RSS +{r['rss_mib']:.0f} "
          f"MiB ({r['bytes_per_token']:.0f} B a token); add {r['add_ms']:.2f} ms a response; "
          f"proposal {r['proposal_ms']:.3f} ms")


if __name__ == "__main__":
    main(sys.argv[1:])
