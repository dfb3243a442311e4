"""Helpers shared by the tests (tests/ is on sys.path via conftest)."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kiln.artifact.weights import quantize_per_tensor


@contextmanager
def module_dir(tmp_path_factory, name: str) -> Iterator[Path]:
    """A fresh directory for a module-scoped fixture, removed when the fixture is torn down.

    pytest keeps every ``tmp_path_factory.mktemp`` directory until the session ends; the
    real-model engines (0.5-2.4 GB each, float32) would otherwise pile up to ~15 GB over a
    full run and fill a small disk."""
    root = tmp_path_factory.mktemp(name)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def count_launches(eng) -> list[int]:
    """Wraps ``eng._launch_next``; returns a one-item list counting steps launched ahead
    (async scheduling)."""
    n = [0]
    inner = eng._launch_next

    def counting(cur):
        nxt = inner(cur)
        n[0] += nxt is not None
        return nxt

    eng._launch_next = counting
    return n


def mixed_prompts(seed: int = 1) -> list[list[int]]:
    """8 prompts of mixed lengths (3..40 tokens) of byte-tokenizer ids."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (k,), generator=g).tolist()
            for k in (5, 17, 30, 9, 40, 3, 22, 11)]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Exactly ``n`` greedy tokens from a transformers model (eos ignored)."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True}


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 w / s, s [N, 1]) with s = each output row's amax / 448, as llm-compressor's
    channel strategy stores it."""
    s = (w.float().abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
    return (w.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn), s


def write_compressed_tensors(src, out, *, dynamic: bool, kv: bool, strategy: str = "tensor"):
    """A compressed-tensors float-quantized FP8 checkpoint (what llm-compressor writes):
    weights per tensor or, ``strategy="channel"``, per output channel (FP8_DYNAMIC)."""
    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    new = {}
    for name, t in tensors.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEAR:
            if strategy == "channel":
                new[name], new[module + ".weight_scale"] = quantize_per_channel(t)
            else:
                q, s = quantize_per_tensor(t)
                new[name], new[module + ".weight_scale"] = q, s.reshape(1)
            if not dynamic:  # a plausible static activation scale
                new[module + ".input_scale"] = torch.tensor([4.0 / 448])
        else:
            new[name] = t
    if kv:
        for i in range(2):
            new[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.02 + i / 100)
            new[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.01 + i / 100)
    save_file(new, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "version": "0.9.0",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {**FP8_SCHEME, "strategy": strategy, "dynamic": False},
            "input_activations": {**FP8_SCHEME, "dynamic": dynamic},
        }},
        "ignore": ["lm_head"],
        "kv_cache_scheme": {**FP8_SCHEME, "dynamic": False} if kv else None,
    }
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def drain_checking_spec_state(eng, worker) -> dict:
    """Step ``eng`` until every request finishes, checking after each step that the
    speculative template left no saved state and no request holds a draft; returns the
    finished outputs by request id."""
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        assert len(worker.saved) == 0 and not worker.saved.active
        assert all(r.draft is None for r in eng._requests.values())
    return done


def tv(a: dict, b: dict) -> float:
    """Total variation distance between two histograms (counts or probabilities)."""
    na, nb = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a.get(k, 0) / na - b.get(k, 0) / nb) for k in set(a) | set(b))


CYCLE = 16


def write_bigram(src: Path, swap: bool = False) -> Path:
    """A llama whose next token depends only on the last one: after t (< 16) it puts
    logits 10 on t+1 and 10 - ln 2 on t+2 (mod 16), 0 elsewhere. With top_k=2 and
    temperature 1 that is p(t+1) = 2/3, p(t+2) = 1/3 exactly (temperature 0.5 alone:
    4/5 and 1/5, the other 298 tokens under 1e-6), so sampled sequences have a known
    distribution and the prompt's n-grams make good, often-accepted drafts. ``swap``: the
    two logits swapped (p(t+1) = 1/3), a draft model that disagrees with the target."""
    import transformers

    from kiln.sources import make_byte_tokenizer

    cfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=256, eos_token_id=257)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # attention and MLP add nothing: h = embed(x)
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb[:CYCLE] = torch.eye(CYCLE, 64)  # rmsnorm turns e_t into 8 e_t
        head = model.lm_head.weight
        head.zero_()
        one, two = (10 - math.log(2), 10) if swap else (10, 10 - math.log(2))
        for t in range(CYCLE):
            head[(t + 1) % CYCLE, t] = one / 8
            head[(t + 2) % CYCLE, t] = two / 8
    model.save_pretrained(src, safe_serialization=True)
    make_byte_tokenizer().save_pretrained(src)
    return src


BIGRAM_PROMPT = list(range(CYCLE)) * 2 + [0, 2, 3, 5, 6, 8, 9, 11]  # ends at 11


def build_bigram_engine(source: Path, out: Path, mode: str, **limits) -> Path:
    """The bigram model's float32 engine with lookahead (4,3,4), prompt lookup (draft 4,
    match 2) or suffix decoding (draft 4, depth 8, match 2+): drafts from BIGRAM_PROMPT's
    n-grams are accepted often."""
    from kiln.artifact.speculative import SpeculativeConfig
    from kiln.builder import build_engine

    spec = {"lookahead": lambda: SpeculativeConfig.from_cli("lookahead", "4,3,4", None, None),
            "ngram": lambda: SpeculativeConfig.from_cli("ngram", None, 4, 2),
            "suffix": lambda: SpeculativeConfig.from_cli(
                "suffix", max_draft_len=4, suffix={"suffix_tree_depth": 8,
                                                   "suffix_min_match": 2})}[mode]()
    build_engine(str(source), out, dtype="float32", max_seq_len=128, speculative=spec,
                 progress=False, **limits)
    return out


def exact_three_token_distribution(last: int, p_one: float = 2 / 3) -> dict:
    """The bigram's three tokens after ``last``: each step +1 with probability ``p_one``,
    else +2."""
    out: dict = {}
    for a in (1, 2):
        for b in (1, 2):
            for c in (1, 2):
                t1 = (last + a) % CYCLE
                t2 = (t1 + b) % CYCLE
                t3 = (t2 + c) % CYCLE
                p = 1.0
                for step in (a, b, c):
                    p *= p_one if step == 1 else 1 - p_one
                out[(t1, t2, t3)] = out.get((t1, t2, t3), 0) + p
    return out


def rank_workers(engine: Path) -> dict[int, str]:
    """{pid: command line} of the live processes running a follower rank of ``engine``
    (kiln.runtime.parallel.worker); zombies (exited, not yet reaped) are not."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if "kiln.runtime.parallel.worker" in cmd and str(engine) in cmd and state != "Z":
            found[int(proc.name)] = cmd
    return found


def wait_all_free(url: str, timeout: float = 30) -> dict:
    """A running server's /debug/kv once every KV block is free and no request is left."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while True:
        kv = httpx.get(url + "/debug/kv").json()
        if kv["all_free"] and not kv["has_unfinished"]:
            return kv
        assert time.monotonic() < deadline, f"KV blocks not freed: {kv}"
        time.sleep(0.1)


def assert_e4m3_equal(got: torch.Tensor, ref: torch.Tensor, unrounded: torch.Tensor,
                      min_checked: float = 0.7) -> None:
    """e4m3 tensors equal element for element, except where triton's CPU interpreter rounds
    a float32 -> e4m3 cast wrongly: a rounding that carries into the next binade (7.98 -> 4
    instead of 8; the reference is then a power of two), the subnormal range (|x| < 2**-6)
    and ties (it rounds half away from zero, the GPU to even): ``unrounded`` (the float32
    values cast) exactly halfway between ``got`` and ``ref``. The GPU tests check every
    element; at least ``min_checked`` of them are compared here."""
    got, ref, unrounded = got.float(), ref.float(), unrounded.float()
    assert got.shape == ref.shape == unrounded.shape, (got.shape, ref.shape, unrounded.shape)
    fault = torch.frexp(ref)[0].abs() == 0.5
    fault |= (ref.abs() < 2**-6) & (ref != 0)
    fault |= (got != ref) & (unrounded * 2 == got + ref)
    bad = (got != ref) & ~fault
    assert not bad.any(), f"{int(bad.sum())} e4m3 values differ, e.g. {got[bad][:4].tolist()} " \
                          f"vs {ref[bad][:4].tolist()}"
    assert (~fault).float().mean() >= min_checked


def record_trees(monkeypatch) -> list:
    """Every token tree ``walk_tree`` verifies on the host, recorded: (its children's rows by
    token per row, the KV moves the walk returned), in each module that calls it."""
    from kiln.runtime.speculative import draft_model, lookahead, suffix, verify, worker

    seen, walk = [], verify.walk_tree

    def recording(req, logits, argmax, kids):
        out = walk(req, logits, argmax, kids)
        seen.append((kids, out[1]))
        return out

    for module in (verify, worker, suffix, lookahead, draft_model):
        monkeypatch.setattr(module, "walk_tree", recording)
    return seen


def branches(kids: dict) -> bool:
    """Whether a recorded tree has a node with two or more children."""
    return any(len(below) > 1 for below in kids.values())


def sample_three_tokens(eng, prompt: list[int], window, trials: int = 1500):
    """``trials`` seeded requests (seeds 0..trials-1) sampling 3 tokens after ``prompt`` at
    temperature 1 and top_k 2, speculating at ``window`` (PLAIN: not at all): their
    outputs and the histogram of the 3-token outcomes."""
    import collections

    from kiln.runtime.sampling_params import SamplingParams

    ps = [SamplingParams(max_tokens=3, temperature=1.0, top_k=2, seed=s, ignore_eos=True,
                         lookahead=window) for s in range(trials)]
    outs = eng.generate([prompt] * trials, ps)
    return outs, collections.Counter(tuple(o.token_ids) for o in outs)


def use_wrong_acceptance_rule(monkeypatch) -> None:
    """The negative control of the sampled tests: every host walk (``verify.verify_position``)
    accepts a draft whenever the target gives it any probability, with no rejection step."""
    from kiln.runtime.speculative import verify

    real = verify.verify_position

    def accept_any_supported(p, drafts, generator=None):
        for idx, d in enumerate(drafts):
            if float(p[d]) > 0:
                return int(d), idx
        return real(p, [], generator)

    monkeypatch.setattr(verify, "verify_position", accept_any_supported)


def find_draft(tokens: list[int], max_match: int, min_match: int, max_len: int) -> list[int]:
    """Prompt lookup's draft by a scan of the whole text, the oracle of ``LookupIndex`` and
    the device drafts: the tokens (at most ``max_len``) that followed the most recent earlier
    match of the longest suffix (min_match <= k <= max_match)."""
    n = len(tokens)
    for k in range(min(max_match, n - 1), min_match - 1, -1):
        suffix = tokens[n - k :]
        # scan right to left; a match must end before the suffix itself starts at n-k
        for start in range(n - k - 1, -1, -1):
            if tokens[start : start + k] == suffix:
                follow = tokens[start + k : start + k + max_len]
                if follow:
                    return follow
    return []


def pool_tensors(pool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An ``NgramPool``'s table as the device keeps it: keys [buckets, max(g, 1)] (-1:
    empty), continuations [buckets, max(g, 1), n-1] (0 where empty), cursors [buckets]."""
    g = max(pool.g, 1)
    keys = torch.full((pool.buckets, g), -1, dtype=torch.long)
    conts = torch.zeros(pool.buckets, g, pool.n - 1, dtype=torch.long)
    cursor = torch.zeros(pool.buckets, dtype=torch.long)
    flat, entry_keys, entry_conts, cursors = pool.entries()
    if flat:
        at = torch.tensor(flat)
        keys.view(-1)[at] = torch.tensor(entry_keys)
        conts.view(-1, pool.n - 1)[at] = torch.tensor(entry_conts).view(-1, pool.n - 1)
    for h, c in cursors:
        cursor[h] = c
    return keys, conts, cursor
