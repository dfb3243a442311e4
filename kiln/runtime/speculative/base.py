"""Base class of every speculative worker: an exception-safe step.

The second field report: a one-model speculative worker saved attention metadata before
its draft pass and restored it afterwards with no try/finally. A tolerated warm-up OOM
aborted the pass between the two, the saved state stayed behind, and every later forward
died on a bare ``assert len(saved) == 0`` whose empty message hid the cause.

Here ``SpeculativeWorker.step()`` is a final template method. Subclasses implement
``_step_impl()`` and register what they change through ``self.saved`` (a ``SavedState``):

    self.saved.save_attrs(attn_meta, "kv_lens", "num_tokens")   # snapshot, restored later
    self.saved.push("block_table", lambda: ...)                  # any restore callback
    self.saved.defer_kv_rewind("kv_lens -= drafts", lambda: ...)  # applied after restores
    with self.saved_state("x", restore): ...                     # scoped save/restore

Whatever ``_step_impl`` does (return or raise, including torch.OutOfMemoryError), the base
restores every saved entry (last saved first), then applies the pending KV rewinds (in
registration order), and the stack is empty when ``step()`` returns or raises.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)


class SpeculativeStateError(RuntimeError):
    """Saved speculative state was misused or could not be restored (always has a message)."""


class SavedState:
    """Stack of restore callbacks plus a queue of deferred KV rewinds for one step.

    Owned by one worker; only usable while that worker's ``step()`` runs (``active``).
    """

    def __init__(self, owner: str = "worker") -> None:
        self._owner = owner
        self._restores: list[tuple[str, Callable[[], None]]] = []
        self._rewinds: list[tuple[str, Callable[[], None]]] = []
        self.active = False

    # ---- registration (inside a step only)
    def _check_active(self, what: str, name: str) -> None:
        if not self.active:
            raise SpeculativeStateError(
                f"{self._owner}: cannot {what} {name!r} outside step(): saved state is only "
                f"tracked while SpeculativeWorker.step() runs; call it from _step_impl()"
            )

    def push(self, name: str, restore: Callable[[], None]) -> None:
        """Register a restore callback; it runs when the step ends (LIFO)."""
        self._check_active("save", name)
        if not callable(restore):
            raise TypeError(f"{self._owner}: restore callback for {name!r} is not callable")
        self._restores.append((name, restore))

    def save_attrs(self, obj: Any, *names: str) -> None:
        """Snapshot attributes of ``obj``; restore puts the same objects back.

        Tensors are cloned and copied back in place (so buffers captured by CUDA graphs
        keep their storage) and the attribute is re-pointed at the original tensor.
        """
        for name in names:
            if not hasattr(obj, name):
                raise AttributeError(
                    f"{self._owner}: cannot save {type(obj).__name__}.{name}: no such attribute"
                )
            orig = getattr(obj, name)
            snap = orig.clone() if isinstance(orig, torch.Tensor) else orig

            def restore(obj=obj, name=name, orig=orig, snap=snap) -> None:
                if isinstance(orig, torch.Tensor):
                    orig.copy_(snap)
                setattr(obj, name, orig)

            self.push(f"{type(obj).__name__}.{name}", restore)

    def defer_kv_rewind(self, name: str, rewind: Callable[[], None]) -> None:
        """Register a KV rewind applied after all restores, whether the step failed or not."""
        self._check_active("defer rewind", name)
        self._rewinds.append((name, rewind))

    def cancel_kv_rewind(self, name: str) -> bool:
        """Drop a pending rewind (e.g. the subclass already applied it); True if found."""
        for i, (n, _) in enumerate(self._rewinds):
            if n == name:
                del self._rewinds[i]
                return True
        return False

    def pop(self, name: str) -> Callable[[], None]:
        """Remove the most recent entry named ``name`` without running it; return it."""
        for i in range(len(self._restores) - 1, -1, -1):
            if self._restores[i][0] == name:
                return self._restores.pop(i)[1]
        raise SpeculativeStateError(
            f"{self._owner}: no saved entry {name!r} to pop; saved: {self.names or 'nothing'}"
        )

    # ---- inspection
    @property
    def names(self) -> list[str]:
        return [n for n, _ in self._restores]

    @property
    def pending_rewinds(self) -> list[str]:
        return [n for n, _ in self._rewinds]

    def __len__(self) -> int:
        return len(self._restores) + len(self._rewinds)

    def __bool__(self) -> bool:
        return len(self) > 0

    # ---- release
    def release(self) -> list[tuple[str, BaseException]]:
        """Run every restore (LIFO), then every rewind (FIFO); empty both.

        Never stops early: a failing callback is recorded and the rest still run.
        Returns the (name, error) pairs that failed.
        """
        errors: list[tuple[str, BaseException]] = []
        while self._restores:
            name, fn = self._restores.pop()
            try:
                fn()
            except BaseException as e:
                errors.append((f"restore {name}", e))
        while self._rewinds:
            name, fn = self._rewinds.pop(0)
            try:
                fn()
            except BaseException as e:
                errors.append((f"kv rewind {name}", e))
        return errors


class SpeculativeWorker(ABC):
    """A speculative decoding worker (lookahead, ngram, draft-target).

    ``step()`` is final: it runs ``_save_state()`` and ``_step_impl()`` inside try/finally
    and always restores what was registered in ``self.saved``. Subclasses implement
    ``_step_impl`` (and optionally ``_save_state``); defining ``step`` raises TypeError at
    class creation. ``step()`` refuses nesting.
    """

    _FINAL = ("step",)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in cls._FINAL:
            if name in cls.__dict__:
                raise TypeError(
                    f"{cls.__qualname__} defines {name}(), which SpeculativeWorker keeps final "
                    f"so saved attention/KV state is always restored; implement _step_impl() "
                    f"instead"
                )

    def __init__(self) -> None:
        self.saved = SavedState(type(self).__name__)
        self.num_failed_steps = 0

    def _save_state(self, *args: Any, **kwargs: Any) -> None:
        """Hook run inside the guarded region before ``_step_impl`` (register saves here)."""

    @abstractmethod
    def _step_impl(self, *args: Any, **kwargs: Any) -> Any:
        """One speculative step; may raise. Register every mutation through ``self.saved``."""

    @contextlib.contextmanager
    def saved_state(self, name: str, restore: Callable[[], None]) -> Iterator[None]:
        """Scoped save: ``restore`` runs when the block exits (or when the step unwinds)."""
        self.saved.push(name, restore)
        yield  # if the block raises, the entry stays and step()'s finally restores it
        self.saved.pop(name)()

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Run one step; saved state is restored and KV rewinds applied whatever happens."""
        if self.saved.active:
            raise SpeculativeStateError(
                f"{type(self).__name__}.step() called while a step is running: steps do not "
                f"nest; call the helper you need from _step_impl() directly"
            )
        if self.saved:
            # Only possible if the stack was mutated behind the API; restore, don't poison.
            leftover = self.saved.names + self.saved.pending_rewinds
            logger.warning("%s: restoring state left from an earlier step: %s",
                           type(self).__name__, leftover)
            self.saved.release()
        self.saved.active = True
        failed = True
        try:
            self._save_state(*args, **kwargs)
            out = self._step_impl(*args, **kwargs)
            failed = False
            return out
        finally:
            self.saved.active = False
            names = self.saved.names + self.saved.pending_rewinds
            errors = self.saved.release()
            if failed:
                self.num_failed_steps += 1
                if names:
                    logger.warning("%s: step failed; restored %s",
                                   type(self).__name__, names)
            if errors:
                msg = (
                    f"{type(self).__name__}: could not restore speculative state after a "
                    f"{'failed' if failed else 'successful'} step: "
                    + "; ".join(f"{n}: {type(e).__name__}: {e}" for n, e in errors)
                )
                if failed:
                    # keep the step's own exception; note the restore failure on it
                    logger.error(msg)
                    exc = sys.exc_info()[1]
                    if exc is not None and hasattr(exc, "add_note"):  # Python >= 3.11
                        exc.add_note(msg)
                else:
                    raise SpeculativeStateError(msg) from errors[0][1]
