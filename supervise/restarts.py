"""When ``rpcps up`` starts a member that died again, and when it gives up and ends the run: the
policy, apart from the roster that carries it out (``roster.py``) and the liveness that judges a
silent member lost (``liveness.py``).

A death waits a back-off that doubles with each death in a row (as Kubernetes does), up to a
ceiling; a member up for the restart window is healthy again, its deaths no longer in a row. The
run ends when the user's ``--max-restarts`` is spent, or when a member failed the same way at each
of its last few starts: a restart cannot mend the data, the settings or a bug. A member fenced
(stopped as lost) is never judged so: its silence was the host's, not its own fault.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from supervise.member import Member
from supervise.upconfig import LauncherConfig

SAME_FAILURES = 3   # deaths in a row, each of the same error, that end the run: it fails at every start


@dataclass(frozen=True)
class Verdict:
    """What a death leads to: ``reason``, the death in words; ``delay``, the seconds before it
    starts again, or None when the run ends, with ``ends_run``, the sentence it ends with."""

    reason: str
    delay: Optional[float] = None
    ends_run: str = ""


class RestartPolicy:
    def __init__(self, backoff: float, backoff_max: float, window: float, max_restarts: Optional[int] = None) -> None:
        self.backoff, self.backoff_max, self.window, self.max_restarts = backoff, backoff_max, window, max_restarts

    @classmethod
    def of(cls, cfg: LauncherConfig) -> "RestartPolicy":
        return cls(cfg.restart_backoff, cfg.restart_backoff_max, cfg.restart_window, cfg.max_restarts)

    def after_death(self, m: Member, code: int) -> Verdict:
        """``m`` died with ``code`` (its deaths in a row so far not counting this one)."""
        reason = m.died_of(code)
        if self.max_restarts is not None and m.deaths >= self.max_restarts:
            return Verdict(reason, ends_run=f"{m.name} exited with code {code} after {m.deaths} restarts in a row "
                                            f"({reason}); giving up (--max-restarts; see {m.log_path})")
        causes = (*m.causes, reason)
        if code > 0 and m.fenced is None and len(causes) >= SAME_FAILURES and len(set(causes[-SAME_FAILURES:])) == 1:
            return Verdict(reason, ends_run=f"{m.name} failed the same way at each of its last {SAME_FAILURES} "
                                            f"starts: {reason} (log: {m.log_path})")
        return Verdict(reason, delay=min(self.backoff_max, self.backoff * 2 ** m.deaths))

    def healthy_again(self, m: Member, now: float) -> bool:
        """Whether ``m``, which died in a row before, has been up long enough (``now``, monotonic)
        that those deaths count no more."""
        return bool(m.deaths) and now - m.started_at >= self.window
