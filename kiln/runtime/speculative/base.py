"""Base class of every speculative worker: an exception-safe step.

A worker that saves state before its draft pass and restores it afterwards without
try/finally leaves the saved state behind when the pass raises (a tolerated OOM, say), and
every later step then fails. Here ``SpeculativeWorker.step()`` is a final template method.
Subclasses implement ``_step_impl()`` and register what they change as restore callbacks on
``self.saved`` (a ``SavedState``): ``self.saved.push("draft plans", clear_plans)``. Whatever
``_step_impl`` does (return or raise, including torch.OutOfMemoryError), the base runs every
callback (last registered first), and the stack is empty when ``step()`` returns or raises.
"""

from __future__ import annotations

import logging
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class SpeculativeStateError(RuntimeError):
    """Saved speculative state was misused or could not be restored (always has a message)."""


class SavedState:
    """Stack of restore callbacks for one step. Owned by one worker; only usable while that
    worker's ``step()`` runs (``active``)."""

    def __init__(self, owner: str = "worker") -> None:
        self._owner = owner
        self._restores: list[tuple[str, Callable[[], None]]] = []
        self.active = False

    def push(self, name: str, restore: Callable[[], None]) -> None:
        """Register a restore callback; it runs when the step ends (last pushed first)."""
        if not self.active:
            raise SpeculativeStateError(
                f"{self._owner}: cannot save {name!r} outside step(): saved state is only "
                f"tracked while SpeculativeWorker.step() runs; call it from _step_impl()")
        if not callable(restore):
            raise TypeError(f"{self._owner}: restore callback for {name!r} is not callable")
        self._restores.append((name, restore))

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self._restores]

    def __len__(self) -> int:
        return len(self._restores)

    def release(self) -> list[tuple[str, BaseException]]:
        """Run every restore (last pushed first) and empty the stack. Never stops early: a
        failing callback is recorded and the rest still run. Returns the (name, error) pairs
        that failed."""
        errors: list[tuple[str, BaseException]] = []
        while self._restores:
            name, fn = self._restores.pop()
            try:
                fn()
            except BaseException as e:
                errors.append((f"restore {name}", e))
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

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Run one step; saved state is restored whatever happens."""
        if self.saved.active:
            raise SpeculativeStateError(
                f"{type(self).__name__}.step() called while a step is running: steps do not "
                f"nest; call the helper you need from _step_impl() directly"
            )
        if self.saved:
            # Only possible if the stack was mutated behind the API; restore, don't poison.
            logger.warning("%s: restoring state left from an earlier step: %s",
                           type(self).__name__, self.saved.names)
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
            names = self.saved.names
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
