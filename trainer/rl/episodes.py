"""The bookkeeping of one RL episode on the observers: who still plays, whose report is in, who
was lost. RPC callbacks (an observer's report or failure), the membership listener and the agent's
role thread all touch it, under the agent's condition variable, which also wakes the role thread
when the episode is over or a stop comes. No RPC here."""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from trainer.rl.batching import ActionBatcher
from trainer.rl.policy import Learner
from trainer.rl.service import EpisodeReport


class Episode:
    def __init__(self, number: int, observers: list[str], learner: Learner, batcher: Optional[ActionBatcher],
                 wake: threading.Condition, on_lost: Callable[[str, str], None]) -> None:
        """``batcher``: the one answering the observers' actions (None: they ask one at a time).
        ``on_lost(observer, why)`` runs once per observer lost, outside the lock."""
        self.number = number
        self._learner, self._batcher, self._wake, self._on_lost = learner, batcher, wake, on_lost
        self._playing = set(observers)
        self.reports: dict[str, EpisodeReport] = {}
        self.lost: list[str] = []
        if batcher is not None:
            batcher.begin(observers)

    def playing(self, observer: str) -> bool:
        with self._wake:
            return observer in self._playing

    def finish(self, observer: str, report: EpisodeReport) -> None:
        """``observer`` played its episode to the end."""
        if not self.playing(observer):
            return            # already counted as lost
        # Rewards in, and the batch no longer waiting for it, before the episode can be seen as over:
        # the next episode must not meet this one's leftovers.
        if self._batcher is not None:
            self._learner.reward(observer, report.rewards)
            self._batcher.leave(observer)
        with self._wake:
            if observer in self._playing:
                self._playing.discard(observer)
                self.reports[observer] = report
                self._wake.notify_all()

    def lose(self, observer: str, why: str) -> None:
        """``observer`` will not finish: the others go on, and nothing of its part is learned from."""
        if not self.playing(observer):
            return
        self._learner.drop(observer)
        if self._batcher is not None:
            self._batcher.leave(observer)
        with self._wake:
            if observer not in self._playing:
                return
            self._playing.discard(observer)
            self.lost.append(observer)
            self._wake.notify_all()
        self._on_lost(observer, why)

    def wait(self, closing: Callable[[], bool], members: Callable[[], list[str]], stop_wait: float) -> None:
        """Until every observer has finished or is lost. One no longer a member never answers (the
        leader evicted it as dead); one still listed gets until its RPC times out. Once ``closing()``,
        the observers still playing get ``stop_wait`` seconds more."""
        stop_deadline: Optional[float] = None
        while True:
            with self._wake:
                if not self._playing:
                    return
                if closing() and stop_deadline is None:
                    stop_deadline = time.monotonic() + stop_wait
                abandon = stop_deadline is not None and time.monotonic() > stop_deadline
                if not abandon:
                    self._wake.wait(0.5)
                playing = set(self._playing)
            if abandon:
                for o in sorted(playing):
                    self.lose(o, "the agent is stopping and waited long enough")
            for o in sorted(playing - set(members())):
                self.lose(o, "no longer a member")
