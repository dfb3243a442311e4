"""Helpers shared by the tests (tests/ is on sys.path via conftest)."""

from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file, save_file

from kiln.artifact.weights import quantize_per_tensor


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


def write_compressed_tensors(src, out, *, dynamic: bool, kv: bool):
    """A compressed-tensors float-quantized FP8 checkpoint (what llm-compressor writes)."""
    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    new = {}
    for name, t in tensors.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEAR:
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
            "weights": {**FP8_SCHEME, "dynamic": False},
            "input_activations": {**FP8_SCHEME, "dynamic": dynamic},
        }},
        "ignore": ["lm_head"],
        "kv_cache_scheme": {**FP8_SCHEME, "dynamic": False} if kv else None,
    }
    (out / "config.json").write_text(json.dumps(cfg))
    return out
