"""SpeculativeWorker: saved attention/KV state never outlives a step (second field report)."""

from __future__ import annotations

import pytest
import torch

from kiln.runtime.speculative.base import SavedState, SpeculativeStateError, SpeculativeWorker


class FakeAttnMeta:
    def __init__(self) -> None:
        self.kv_lens = torch.tensor([5, 7])
        self.num_tokens = 2
        self.block_table = [[0, 1], [2]]


class FakeWorker(SpeculativeWorker):
    """Saves metadata, mutates it like a draft pass, optionally fails midway."""

    def __init__(self, meta: FakeAttnMeta) -> None:
        super().__init__()
        self.meta = meta
        self.kv_committed = [5, 7]
        self.fail_with: BaseException | None = None
        self.seen_at_start: list[tuple] = []

    def _save_state(self, drafts: int) -> None:
        m = self.meta
        buf, snap, num = m.kv_lens, m.kv_lens.clone(), m.num_tokens

        def restore() -> None:  # in place, so a graph-captured buffer keeps its storage
            buf.copy_(snap)
            m.kv_lens, m.num_tokens = buf, num

        self.saved.push("attention metadata", restore)

    def _step_impl(self, drafts: int) -> list[int]:
        m = self.meta
        # the state the model sees at the start of each step must be clean
        self.seen_at_start.append((m.kv_lens.tolist(), m.num_tokens, len(self.saved)))
        m.kv_lens += drafts  # in place, like a graph-captured buffer
        m.num_tokens = 2 * (1 + drafts)
        before = list(self.kv_committed)
        self.kv_committed = [k + drafts for k in self.kv_committed]
        self.saved.push("kv_committed", lambda: setattr(self, "kv_committed", before))
        old_table = [list(r) for r in m.block_table]
        self.saved.push("block_table", lambda: setattr(m, "block_table", old_table))
        m.block_table = [[9]]
        if self.fail_with is not None:
            raise self.fail_with
        return m.kv_lens.tolist()


def _clean(worker: FakeWorker, kv_buf: torch.Tensor) -> None:
    m = worker.meta
    assert len(worker.saved) == 0 and not worker.saved.active
    assert m.kv_lens is kv_buf and m.kv_lens.tolist() == [5, 7]
    assert m.num_tokens == 2
    assert m.block_table == [[0, 1], [2]]
    assert worker.kv_committed == [5, 7]


def test_successful_step_restores_everything():
    w = FakeWorker(FakeAttnMeta())
    buf = w.meta.kv_lens
    assert w.step(3) == [8, 10]
    _clean(w, buf)


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("draft pass failed"),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (warm-up)"),
    ],
    ids=["runtime-error", "oom"],
)
def test_failed_step_leaves_nothing_saved_and_next_step_works(exc):
    w = FakeWorker(FakeAttnMeta())
    buf = w.meta.kv_lens
    w.fail_with = exc
    with pytest.raises(type(exc)) as info:
        w.step(4)
    assert str(info.value)  # the error names its cause
    assert w.num_failed_steps == 1
    _clean(w, buf)
    # the tolerated failure must not poison the next request
    w.fail_with = None
    assert w.step(2) == [7, 9]
    assert w.seen_at_start == [([5, 7], 2, 1), ([5, 7], 2, 1)]
    _clean(w, buf)


def test_failure_inside_save_hook_is_also_restored():
    class SaveFails(FakeWorker):
        def _save_state(self, drafts: int) -> None:
            super()._save_state(drafts)
            self.meta.kv_lens.zero_()  # mutate after the save, then fail
            raise torch.OutOfMemoryError("OOM while allocating draft buffers")

    w = SaveFails(FakeAttnMeta())
    buf = w.meta.kv_lens
    with pytest.raises(torch.OutOfMemoryError, match="draft buffers"):
        w.step(1)
    _clean(w, buf)


def test_defining_step_is_rejected_at_class_creation():
    with pytest.raises(TypeError, match=r"defines step\(\).*_step_impl"):

        class Bad(SpeculativeWorker):
            def step(self, *a, **k):
                return None

            def _step_impl(self, *a, **k):
                return None

    class Indirect(FakeWorker):  # subclasses of subclasses are checked too
        pass

    with pytest.raises(TypeError, match="defines step"):

        class Bad2(Indirect):
            step = lambda self: None


def test_saving_outside_step_and_nesting_raise_with_message():
    w = FakeWorker(FakeAttnMeta())
    with pytest.raises(SpeculativeStateError, match="outside step"):
        w.saved.push("x", lambda: None)
    w.saved.active = True
    with pytest.raises(TypeError, match="not callable"):
        w.saved.push("x", None)
    w.saved.active = False

    class Nested(FakeWorker):
        def _step_impl(self, drafts: int):
            return self.step(drafts)

    n = Nested(FakeAttnMeta())
    buf = n.meta.kv_lens
    with pytest.raises(SpeculativeStateError, match="do not nest"):
        n.step(1)
    _clean(n, buf)


def test_restore_failure_is_reported_and_rest_still_restored():
    class BadRestore(FakeWorker):
        def _step_impl(self, drafts: int):
            self.saved.push("broken", self._boom)
            return super()._step_impl(drafts)

        def _boom(self):
            raise ValueError("cannot restore")

    w = BadRestore(FakeAttnMeta())
    buf = w.meta.kv_lens
    with pytest.raises(SpeculativeStateError, match="restore broken: ValueError: cannot restore"):
        w.step(1)
    _clean(w, buf)
    # on a failing step the step's own error propagates, with the restore failure noted
    w.fail_with = RuntimeError("draft failed")
    with pytest.raises(RuntimeError, match="draft failed") as info:
        w.step(1)
    assert any("cannot restore" in note for note in getattr(info.value, "__notes__", []))
    _clean(w, buf)


def test_saved_state_release_order():
    s = SavedState("t")
    order: list[str] = []
    s.active = True
    s.push("a", lambda: order.append("restore a"))
    s.push("b", lambda: order.append("restore b"))
    s.push("c", lambda: order.append("restore c"))
    assert s.names == ["a", "b", "c"]
    assert s.release() == []
    assert order == ["restore c", "restore b", "restore a"]
    assert len(s) == 0
