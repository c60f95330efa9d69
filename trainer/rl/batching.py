"""Gathering the observers' states into one forward pass per environment step.

Each observer in the episode sends its state and gets a future for its action. When every observer
still in the episode has a state waiting, one call of ``act`` answers them all. An observer whose
episode ended, or who died, ``leave``s: the others no longer wait for it. No RPC here; the agent's
``async_execution`` entry point returns these futures to torch.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch

from services.errors import BadRequest

Act = Callable[[Sequence[tuple[str, Any]]], list[int]]


class ActionBatcher:
    def __init__(self, act: Act) -> None:
        self._act = act
        self._lock = threading.Lock()
        self._expected: set[str] = set()
        self._pending: dict[str, tuple[Any, torch.futures.Future]] = {}
        self.batches = 0          # forward passes made
        self.requests = 0         # states answered

    def begin(self, names: Sequence[str]) -> None:
        """A new episode with these observers; anything left from the previous one is refused."""
        with self._lock:
            stale, self._pending = self._pending, {}
            self._expected = set(names)
        for _, fut in stale.values():
            fut.set_exception(BadRequest("the episode this request belonged to has ended"))

    def submit(self, name: str, state: Any) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        with self._lock:
            if name not in self._expected:
                refused = f"{name} is not taking part in the current episode"
            elif name in self._pending:
                refused = f"{name} already has a state waiting for its action"
            else:
                refused = ""
                self._pending[name] = (state, fut)
            batch = self._take_if_complete()
        if refused:
            fut.set_exception(BadRequest(refused))
        self._answer(batch)
        return fut

    def leave(self, name: str) -> None:
        """``name`` sends no more states this episode (its episode ended, or it died)."""
        with self._lock:
            self._expected.discard(name)
            orphan = self._pending.pop(name, None)
            batch = self._take_if_complete()
        if orphan is not None:
            orphan[1].set_exception(BadRequest(f"{name} left the episode"))
        self._answer(batch)

    @property
    def waiting_for(self) -> list[str]:
        with self._lock:
            return sorted(self._expected - set(self._pending))

    def _take_if_complete(self) -> list[tuple[str, tuple[Any, torch.futures.Future]]]:
        if not self._pending or not self._expected <= set(self._pending):
            return []
        batch, self._pending = sorted(self._pending.items()), {}
        return batch

    def _answer(self, batch: list[tuple[str, tuple[Any, torch.futures.Future]]]) -> None:
        if not batch:
            return
        try:
            actions = self._act([(name, state) for name, (state, _) in batch])
        except Exception as exc:  # noqa: BLE001 - every waiting observer must hear of it
            for _, (_, fut) in batch:
                fut.set_exception(exc)
            return
        with self._lock:
            self.batches += 1
            self.requests += len(batch)
        for (_, (_, fut)), action in zip(batch, actions):
            fut.set_result(action)
