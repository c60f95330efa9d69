"""Concurrent requests answered together: one forward pass for many rows costs little more than
for one, so rows that arrive while the model is busy wait for the next pass, which takes all of
them (up to ``batch_rows``), and a pass that is not full waits ``wait`` seconds more for others.

Request threads ``submit`` and wait on the future; one thread runs the passes, so the model and
its encoder are only ever used from it.

No request fails another: a pass that fails for a reason other than the member's own state (a
domain error: a server lost, stopping) runs again request by request, so only the request whose
rows broke it fails; a score that is not finite fails only the request whose row it answers.
"""
from __future__ import annotations

import collections
import logging
import math
import threading
import time
from concurrent.futures import Future
from typing import Callable, Generic, Optional, Sequence, TypeVar

from services.errors import InvalidInput, NotReady, Overloaded, RpcpsError

log = logging.getLogger(__name__)

R = TypeVar("R")        # a request's row
A = TypeVar("A")        # what a pass says of all its rows besides their scores


class MicroBatcher(Generic[R, A]):
    """``answer(rows)`` gives a score per row and one ``A`` for the pass; ``submit(rows)`` a
    future of ``(scores of those rows, A)``. At most ``queue_rows`` rows wait: past that a
    request is refused with ``Overloaded`` at once, instead of waiting without bound."""

    def __init__(self, answer: Callable[[list[R]], tuple[Sequence[float], A]], batch_rows: int, wait: float,
                 queue_rows: int, on_pass: Callable[[int, float], None] = lambda rows, seconds: None) -> None:
        self._answer, self._on_pass = answer, on_pass
        self.batch_rows, self.wait, self.queue_rows = batch_rows, wait, queue_rows
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[list[R], Future]] = collections.deque()
        self._queued = 0          # rows in the queue
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="batcher", daemon=True)
        self._thread.start()

    def submit(self, rows: list[R]) -> "Future[tuple[list[float], A]]":
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise NotReady("stopping: not answering any more")
            if self._queued and self._queued + len(rows) > self.queue_rows:
                raise Overloaded(f"{self._queued} rows are waiting to be answered (--queue-rows "
                                 f"{self.queue_rows}): try again shortly")
            self._queue.append((rows, future))
            self._queued += len(rows)
            self._cond.notify()
        return future

    def close(self, timeout: float = 5.0) -> None:
        """Answer nothing more; what waits is refused."""
        with self._cond:
            self._closed = True
            waiting = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for _, future in waiting:
            if future.set_running_or_notify_cancel():
                future.set_exception(NotReady("stopping: not answering any more"))
        self._thread.join(timeout)

    def _take(self) -> Optional[list[tuple[list[R], Future]]]:
        """The next pass's requests: what waits, up to ``batch_rows`` rows (a bigger request alone),
        after up to ``wait`` seconds for a pass that is not full, less those whose callers gave up
        waiting; None once closed."""
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            deadline = time.monotonic() + self.wait
            while self._queued < self.batch_rows and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    break
            taken, rows = [], 0
            while self._queue and (not taken or rows + len(self._queue[0][0]) <= self.batch_rows):
                request = self._queue.popleft()
                self._queued -= len(request[0])
                if request[1].set_running_or_notify_cancel():     # False: its caller gave up waiting
                    taken.append(request)
                    rows += len(request[0])
            return taken

    def _run(self) -> None:
        while (taken := self._take()) is not None:
            if taken:           # else every request taken had been given up
                self._pass(taken)

    def _pass(self, taken: list[tuple[list[R], Future]]) -> None:
        rows = [row for request, _ in taken for row in request]
        started = time.perf_counter()
        try:
            scores, said = self._answer(rows)
        except BaseException as exc:  # noqa: BLE001 - the requests get the error, the thread goes on
            if len(taken) > 1 and not isinstance(exc, RpcpsError):
                for request in taken:
                    self._pass([request])
                return
            for _, future in taken:
                future.set_exception(exc)
            return
        self._on_pass(len(rows), time.perf_counter() - started)
        at = 0
        for request, future in taken:
            mine = [float(s) for s in scores[at:at + len(request)]]
            at += len(request)
            bad = next((k for k, score in enumerate(mine) if not math.isfinite(score)), None)
            if bad is None:
                future.set_result((mine, said))
            else:
                future.set_exception(InvalidInput(f"rows[{bad}]: the model's answer is {mine[bad]}, not a number: a "
                                                  f"value of the row is far outside what the model was trained on"))
