"""The speculative worker of an engine, chosen by the mode recorded at build."""

from __future__ import annotations

import torch

from kiln.artifact.speculative import SpeculativeConfig, validate_request_window
from kiln.errors import RequestError
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.speculative.device_draft import DeviceDraft
from kiln.runtime.speculative.device_lookahead import DeviceLookahead
from kiln.runtime.speculative.device_ngram import DeviceNgram
from kiln.runtime.speculative.device_step import DeviceProposer
from kiln.runtime.speculative.draft_model import DraftModel, DraftModelWorker
from kiln.runtime.speculative.lookahead import LookaheadWorker
from kiln.runtime.speculative.ngram import NgramWorker
from kiln.runtime.speculative.suffix import SuffixWorker
from kiln.runtime.speculative.worker import DraftWorker

# mode -> (its host worker, its device proposer or None: host state only): a new mode is its
# modules and one line here
MODES: dict[str, tuple[type[DraftWorker], type[DeviceProposer] | None]] = {
    "lookahead": (LookaheadWorker, DeviceLookahead),
    "ngram": (NgramWorker, DeviceNgram),
    "draft": (DraftModelWorker, DeviceDraft),
    "suffix": (SuffixWorker, None),
}


def make_worker(spec: SpeculativeConfig, device_state: DeviceProposer | None = None,
                draft: DraftModel | None = None) -> DraftWorker | None:
    """The engine's speculative worker for its recorded mode (None: plain decoding);
    ``device_state``: the mode's proposer, whose slots keep requests' state on the device;
    ``draft``: the draft model of a draft-model engine."""
    if spec.mode not in MODES:
        return None
    return MODES[spec.mode][0].from_config(spec, device_state, draft)


def make_device_state(spec: SpeculativeConfig, num_slots: int, max_seq_len: int,
                      device: torch.device) -> DeviceProposer | None:
    """The device proposer of an engine whose speculation runs on the device (lookahead
    with N >= 2, prompt lookup, or a draft model's verification), or None (also for a mode
    whose state lives on the host only)."""
    proposer = MODES[spec.mode][1] if spec.mode in MODES else None
    if proposer is None:
        return None
    return proposer.from_config(spec, num_slots, max_seq_len, device)


def device_by_default(spec: SpeculativeConfig) -> bool:
    """Whether the mode keeps its requests' state on the device unless the runtime says
    otherwise (``DeviceProposer.default_on``; on CUDA)."""
    proposer = MODES[spec.mode][1] if spec.mode in MODES else None
    return proposer is not None and proposer.default_on


def request_window(spec: SpeculativeConfig, params: SamplingParams) -> tuple[int, int, int] | None:
    """The request's (w, n, g) when it speculates, else None (validated against the
    engine's window; a request outside it is rejected with both named)."""
    if params.max_draft_len is not None:
        k = validate_request_draft_len(spec, params.max_draft_len)
        if k == 0:
            return None
    if params.lookahead is not None:
        w, n, g = validate_request_window(spec, *params.lookahead)
        if (w, n, g) == (1, 1, 0):
            return None
    elif spec.mode == "lookahead":
        w, n, g = spec.lookahead
    elif spec.mode in MODES:  # the chain modes: a request names no window
        w, n, g = 1, 1, 0
    else:
        return None
    # Speculation here verifies with the plain sampler's distribution (and, for greedy
    # structured output, the grammar); requests that need per-token state the verifier
    # does not replay decode plainly.
    if ((params.guided is not None and not params.greedy) or params.logprobs is not None
            or params.penalized):
        return None
    return (w, n, g)


def validate_request_draft_len(spec: SpeculativeConfig, k: int) -> int:
    """A request's ``max_draft_len`` against a draft-model or suffix engine's: 0 (plain
    decoding) up to the engine's; anything else is a RequestError naming both (the server
    answers 400)."""
    if not spec.request_draft_len:
        if k == 0:
            return 0
        raise RequestError(
            f"max_draft_len {k} is not available: this engine was built with speculative "
            f"decoding mode {spec.mode!r}, and a request's max_draft_len applies to draft-model "
            f"engines and suffix engines (kiln build --speculative-decoding-mode draft "
            f"--draft-model SOURCE, or suffix); "
            f"drop it or send 0 (plain decoding)", "max_draft_len")
    if k > spec.max_draft_len:
        raise RequestError(
            f"max_draft_len {k} exceeds the engine's {spec.max_draft_len} (it drafts at most "
            f"that many tokens per step): send 0 to {spec.max_draft_len} "
            f"(0: plain decoding)", "max_draft_len")
    return k
