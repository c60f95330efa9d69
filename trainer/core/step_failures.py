"""What a trainer does with a step that did not apply (``StepFailures``): one the servers refused,
or lost on its way, is skipped and counted, and many in a row stop the trainer; one lost to a
server's going away waits for the server's return, counted toward no limit; one planned with a
layout the servers have left takes the leader's new one, counted toward no limit either."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from services.control import EpisodeGate, StepPause
from services.errors import PeerUnavailable, ServerLost, StaleLayout, StepLost, UpdateRefused
from services.lifecycle import RoleState, StatusBoard
from trainer.core.metrics import TrainerMetrics

log = logging.getLogger("trainer.core.episodes")


class StepFailures:
    """``cfg``: the trainer's settings (``max_refused_steps``, ``server_wait``); ``returned``: of
    some servers' names, those serving again (``ServerLosses.returned``); ``follow_layout``: take
    the leader's layout again, whether it changed (``PsClient.follow_layout``)."""

    def __init__(self, cfg: Any, board: StatusBoard, metrics: TrainerMetrics, gate: EpisodeGate, pause: StepPause,
                 wake: threading.Condition, returned: Callable[[list[str]], list[str]],
                 follow_layout: Callable[[], bool] = lambda: False) -> None:
        self.cfg, self.board, self.metrics = cfg, board, metrics
        self.gate, self.pause, self._wake, self._returned = gate, pause, wake, returned
        self._follow_layout = follow_layout
        self.relaid_steps = 0       # steps lost to a change of layout
        self.refused = 0            # steps skipped because their update was refused
        self.lost = 0               # steps skipped because they failed on their way (StepLost)
        self.server_losses = 0      # times a server went away under this trainer's step
        self._in_a_row = 0

    def applied(self) -> None:
        self._in_a_row = 0

    def skip(self, exc: "UpdateRefused | StepLost") -> None:
        """A step the servers refused, or lost on its way (``StepLost``): its batch is skipped;
        many in a row end the trainer, since the cause (bad data, a diverging learning rate, a
        group that cannot form) will not go away by itself."""
        lost = isinstance(exc, StepLost)
        if lost:
            self.lost += 1
            self.board.update(lost_steps=self.lost)
        else:
            self.refused += 1
            self.metrics.steps_refused.inc()
            self.board.update(refused_steps=self.refused)
        self._in_a_row += 1
        log.warning("step skipped, %s (%d in a row): %s", "lost" if lost else "its update refused",
                    self._in_a_row, exc)
        if self._in_a_row >= self.cfg.max_refused_steps:
            raise type(exc)(f"{self._in_a_row} steps in a row were refused or lost (the last: {exc}); "
                            f"stopping rather than spinning: check the data, --lr and --clip, and the trainers' "
                            f"connections to each other")

    def relaid(self, exc: StaleLayout) -> None:
        """A step a server refused as planned with an older layout: nothing of it applied there,
        and its batch is skipped. The next step plans with the leader's layout; a layout that did
        not change counts as any refused step does (so a server that keeps refusing cannot spin
        this trainer forever)."""
        if not self._follow_layout():
            self.skip(exc)
            return
        self.lost += 1
        self.relaid_steps += 1
        log.info("step lost to a change of layout, planning with the leader's from now on: %s", exc)
        self.board.update(lost_steps=self.lost, relaid_steps=self.relaid_steps)

    def await_servers(self, lost: ServerLost) -> bool:
        """A server went away under a step: that step is lost (its batch skipped), and this trainer
        waits, quiet (a checkpoint may hold it at once), until every lost server serves again, up
        to ``--server-wait`` seconds, then ``PeerUnavailable``. False if asked to stop meanwhile.
        A loss is an operational event, not the trainer's failure: it counts toward no limit."""
        self.lost += 1
        self.server_losses += 1
        waiting = list(lost.servers)
        log.warning("step lost, waiting up to %gs for %s: %s", self.cfg.server_wait, ", ".join(waiting), lost)
        self.metrics.server_losses.inc()
        self.metrics.waiting_for_servers.set(len(waiting))
        started = time.monotonic()
        try:
            with self.pause.quiet():
                while waiting:
                    self.board.update(lost_steps=self.lost, server_losses=self.server_losses, waiting_for=waiting,
                                      waiting_s=round(time.monotonic() - started, 1))
                    self.board.set_state(RoleState.RUNNING, f"waiting for {', '.join(waiting)}")
                    back = self._returned(waiting)
                    waiting = [n for n in waiting if n not in back]
                    if not waiting:
                        break
                    if time.monotonic() - started > self.cfg.server_wait:
                        raise PeerUnavailable(f"{', '.join(waiting)} did not come back within "
                                              f"{self.cfg.server_wait:g}s (--server-wait); stopping")
                    with self._wake:
                        if self.gate.stop_requested:
                            return False
                        self._wake.wait(0.2)
        finally:
            self.metrics.waiting_for_servers.set(0)
            self.board.update(waiting_for=[], waiting_s=None)
        log.info("%s back after %.1fs; training goes on", ", ".join(lost.servers), time.monotonic() - started)
        return True
