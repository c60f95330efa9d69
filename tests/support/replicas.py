"""What the trainers' sidecars say of their replicas (``--dense allreduce``), for tests that kill
one and watch the others."""
import os
import signal
from typing import Callable

from services.client import SidecarClient
from tests.support.upcli import UpProcess
from tests.support.wait import wait_until

# ``rpcps up``'s flags and environment for a test of this kind. A survivor can wait out the
# group's timeout in gloo before it sees the death (seen once in CI: a recv that its neighbour's
# abort did not end), so the trainers' group times out at 8 s, and the victim's replacement
# starts 12 s after its death is seen: the survivors step as a pair (about 2 s after the kill
# here, 10 s at worst) before it can join them, which would leave no pair to see.
RESTART_LATER = ["--restart-backoff", "12", "--restart-backoff-max", "12"]
GROUP_TIMEOUT = {"RPCPS_GROUP_TIMEOUT": "8"}


def agree(urls: dict[str, str], names: list[str], group: list[str], after: int = -1):
    """The step after ``after`` that all of ``names`` took last, once all of them all-reduce in
    ``group``; their replicas' digests must be equal at every step they all took (a difference
    fails at once)."""
    seen = {}
    for name in names:
        with SidecarClient(urls[name], timeout=2.0) as c:
            seen[name] = c.status().get("dense_replica")
    if any(r is None or r["allreduce_group"] != group for r in seen.values()):
        return None
    by_step = [dict(r["digests"]) for r in seen.values()]
    common = set.intersection(*(set(steps) for steps in by_step))
    for step in common:
        assert len({steps[step] for steps in by_step}) == 1, f"replicas differ at step {step}: {seen}"
    return max((s for s in common if s > after), default=None)


def kill_one_and_see_it_rejoin(up: UpProcess, urls: dict[str, str], everyone: list[str], victim: str,
                               ready: Callable[[list[str]], bool] = lambda names: True) -> None:
    """Trainers (``everyone``) in one group with equal replicas (once ``ready``); ``victim``
    SIGKILLed; the others step on with equal replicas; its replacement, restarted by ``up``,
    joins them with the same replica, taken from them."""
    before = wait_until(lambda: ready(everyone) and agree(urls, everyone, everyone), 120,
                        f"{len(everyone)} equal replicas at one step")
    killed = up.cluster()["pids"][victim]
    os.kill(killed, signal.SIGKILL)
    survivors = [n for n in everyone if n != victim]
    try:
        after = wait_until(lambda: agree(urls, survivors, survivors, before), 60,
                           "the survivors all-reducing on, with equal replicas at one step")
        up.wait_event("restart", 30, name=victim)
        wait_until(lambda: ready(everyone) and agree(urls, everyone, everyone, after), 120,
                   "the replacement in the group, its replica equal to the others'")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{up.logs()}") from None
    assert up.cluster()["pids"][victim] != killed
    assert "took the replica at step" in up.full_logs(), "the replacement took its replica from the survivors"
