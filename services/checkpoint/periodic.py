"""Checkpoints the leader takes on its own: on a schedule, and one last on the way out."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from services.errors import CheckpointInProgress, RpcpsError

log = logging.getLogger(__name__)


class Periodic:
    """Takes a checkpoint every N steps and/or M seconds (the leader). Survives any single failure."""

    def __init__(self, take: Callable[[], dict], steps_now: Callable[[], int], every_steps: Optional[int],
                 every_seconds: Optional[float]) -> None:
        self._take, self._steps_now = take, steps_now
        self._every_steps, self._every_seconds = every_steps, every_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="checkpoints", daemon=True)

    def start(self) -> "Periodic":
        if self._every_steps or self._every_seconds:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def _run(self) -> None:
        last_time, last_steps = time.monotonic(), self._steps_now()
        while not self._stop.wait(0.5):
            due_steps = self._every_steps and self._steps_now() - last_steps >= self._every_steps
            due_time = self._every_seconds and time.monotonic() - last_time >= self._every_seconds
            if not (due_steps or due_time) or self._steps_now() == last_steps:
                continue
            try:
                result = self._take()
                last_time, last_steps = time.monotonic(), result["step"]
            except CheckpointInProgress:
                pass
            except (RpcpsError, RuntimeError) as exc:
                # A member down or going away (RPC's errors are RuntimeErrors): an operational
                # event, said in one line; the next period tries again.
                log.warning("periodic checkpoint not taken: %s", str(exc).splitlines()[0])
                last_time = time.monotonic()
            except Exception:  # keep the schedule alive; the next period tries again
                log.exception("periodic checkpoint failed")
                last_time = time.monotonic()


def take_final(take: Callable[[], dict], seconds: float) -> None:
    """A checkpoint on the way out, given at most ``seconds``: a stop must stay bounded, and an
    unfinished write leaves the previous checkpoint the newest valid one."""
    done = threading.Event()

    def run() -> None:
        try:
            result = take()
            log.info("final checkpoint %s%s", result["id"], "" if result.get("new", True) else " (already saved)")
        except Exception as exc:  # noqa: BLE001 - the previous checkpoint stays the valid one
            log.warning("final checkpoint failed: %s", exc)
        finally:
            done.set()

    threading.Thread(target=run, name="final-checkpoint", daemon=True).start()
    if not done.wait(seconds):
        log.warning("final checkpoint still running after %.0fs; leaving it unfinished "
                    "(the previous checkpoint stays the newest valid one)", seconds)
