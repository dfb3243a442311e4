"""A tensor-parallel engine's collectives per decode step, timed in the engine as it runs.

``kiln bench latency`` of a tp > 1 engine runs a few decode steps of its batch under the
torch profiler on rank 0 and sums the collectives it finds: on CUDA the NCCL kernels (the
ones inside the CUDA graphs too), on the CPU gloo's operations. A collective's time there
includes waiting for the slowest rank to arrive, so it is what the step pays for it, not
the link's transfer time alone. Other ranks are not profiled: they run the same steps.
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.bench.offline import sampling_params, synthetic_requests

# the profiler's event names, lower-cased: (kind, in NCCL's kernel, gloo's operations)
_KINDS = (("all_reduce", "allreduce", ("gloo:all_reduce",)),
          ("gather", "allgather", ("gloo:all_gather", "gloo:gather")),
          ("broadcast", "broadcast", ("gloo:broadcast",)))


def classify(name: str, on_device: bool) -> str | None:
    """The collective an event of the profiler is (``all_reduce``, ``gather``,
    ``broadcast``), or None: NCCL kernels on the device, gloo operations on the host."""
    low = name.lower()
    for kind, kernel, ops in _KINDS:
        if on_device and low.startswith("nccl") and kernel in low:
            return kind
        if not on_device and low.startswith(ops):
            return kind
    return None


def profile_collectives(engine: Any, batch_size: int, input_len: int, steps: int = 16,
                        seed: int = 0) -> dict:
    """Decode ``steps`` steps of ``batch_size`` synthetic requests of ``input_len`` prompt
    tokens under the profiler (after their prefill and two decode steps); per step, each
    collective's milliseconds and calls on rank 0."""
    warm = 3
    requests = synthetic_requests(engine, batch_size, input_len, warm + steps + 4, seed)
    ids = [engine.add_request(list(r.prompt_token_ids), sampling_params(r.output_len))
           for r in requests]
    cuda = engine.device.type == "cuda"
    nccl = engine.tp.group.backend == "nccl"  # NCCL's are kernels; gloo's host operations
    activities = [torch.profiler.ProfilerActivity.CPU]
    if nccl:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:
        for _ in range(warm):
            engine.step()
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                engine.step()
            if cuda:
                torch.cuda.synchronize(engine.device)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        for rid in ids:
            engine.abort(rid)
    totals = collective_times(prof.events(), nccl)
    out = {
        "steps": steps, "batch_size": batch_size,
        "source": "NCCL kernels (rank 0)" if nccl else "gloo operations (rank 0)",
        **{f"{kind}_ms_per_step": ms / steps for kind, (_, ms) in totals.items()},
        **{f"{kind}_calls_per_step": n / steps for kind, (n, _) in totals.items()},
    }
    if not totals["all_reduce"][0]:  # never a silent 0 ms: say it was not seen
        out["source"] += (": none found by the profiler (KILN_CUDA_GRAPHS=0 times them "
                          "eagerly)")
    return out


def collective_times(events: Any, nccl: bool) -> dict[str, list]:
    """kind -> [calls, milliseconds] of the profiler's ``events``: NCCL's kernels
    (``nccl``) or gloo's operations."""
    totals = {kind: [0, 0.0] for kind, _, _ in _KINDS}
    for event in events:
        on_device = event.device_type == torch.autograd.DeviceType.CUDA
        if on_device != nccl:
            continue
        kind = classify(event.name, on_device)
        if kind is not None:
            totals[kind][0] += 1
            totals[kind][1] += event.time_range.elapsed_us() / 1e3
    return totals
