"""Compare two KILN_JIT_LOG files: the specialisations only one of them met (by kernel)."""
import collections
import json
import sys


def load(p):
    out = collections.defaultdict(set)
    with open(p) as f:
        lines = f.readlines()
    for line in lines:
        r = json.loads(line)
        out[r["repr"].split("[")[0]].add(r["spec"] or r["repr"])
    return out


a, b = load(sys.argv[1]), load(sys.argv[2])
for name in sorted(set(a) | set(b)):
    only_a, only_b = a[name] - b[name], b[name] - a[name]
    print(f"{name}: {len(a[name])} vs {len(b[name])} specialisations; "
          f"{len(only_a)} only in A, {len(only_b)} only in B")
    for s in list(only_b)[:2]:
        print("  B only:", s[:1500])
    for s in list(only_a)[:2]:
        print("  A only:", s[:1500])
