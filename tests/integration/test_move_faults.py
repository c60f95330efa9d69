"""Members lost in the middle of a change of layout, with roles run alone and started again as an
engine starts them: each is frozen at an exact step of the change by a failpoint
(``services/failpoints.py``), then killed. The change completes or is undone, each row is held
by exactly one server at the layout in force, and training goes on once the lost member is back.

- a source lost as it copies its rows ahead: the change fails, the old layout stays whole;
- a trainer lost while the rows are copied ahead: the change completes without it;
- a server lost in its rebuild, once the others have rebuilt: the new layout is in force, the
  lost server named (``not_rebuilt``), and started again it holds its slots by the new layout;
- the leader lost with every server rebuilt, before it adopted the new layout: started again,
  the job is on the layout before, the rebuilt servers back on the last checkpoint;
- a destination lost under the trainers' hold: the change fails, the trainers are let go;
- a server whose rebuild fails every time while it answers on: the new layout is in force, the
  server named and put out of the group (it exits 75), and started again it holds its slots by
  the new layout.
"""
import os
import signal
from pathlib import Path

from tests.integration.test_live_scale import MODEL, TRAINER, Asking, status, steps
from tests.support.wait import wait_until


def frozen(role) -> bool:
    """Whether ``role`` stopped itself (SIGSTOP) at its failpoint."""
    return Path(f"/proc/{role.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def killed(role) -> None:
    os.kill(role.proc.pid, signal.SIGKILL)
    role.proc.wait(30)


def rows(*servers) -> int:
    return sum(status(s)["rows"] for s in servers)


def trains_on(trainer, what: str, more: int = 3) -> None:
    before = steps(trainer)
    wait_until(lambda: steps(trainer) >= before + more, 120, what)


def test_members_lost_in_the_middle_of_a_change(procs):
    ps0 = procs.start("ps", "ps0", 2, env={"RPCPS_FAILPOINTS": "adopt"}, **MODEL)
    ps1 = procs.start("ps", "ps1", 2, env={"RPCPS_FAILPOINTS": "part:early"}, **MODEL)
    for role in (ps0, ps1):
        procs.wait_ready(role)
    trainer = procs.start("trainer", "trainer0", 2, start=True, **TRAINER)
    ps2 = procs.start("ps", "ps2", 2, **MODEL)
    for role in (trainer, ps2):
        procs.wait_ready(role)
    wait_until(lambda: steps(trainer) >= 3, 90, "training")
    with ps0.client(timeout=120.0) as c:
        assert c.checkpoint()["step"] > 0

    # A source lost as it copies its rows ahead: the change fails and changes nothing.
    asking = Asking(ps0, 3)
    wait_until(lambda: frozen(ps1), 60, "ps1 at its early part")
    killed(ps1)
    answer, error = asking.ended()
    assert error is not None and answer is None, answer
    wait_until(lambda: status(ps0)["change"]["state"] == "failed", 10, "the change said failed")
    ps1 = procs.start("ps", "ps1", 2, **MODEL)       # as an engine starts it again: the last checkpoint
    procs.wait_ready(ps1)
    assert all(status(s)["layout"]["epoch"] == 1 for s in (ps0, ps1, ps2)) and status(ps2)["rows"] == 0
    assert rows(ps0, ps1) == MODEL["ntoken"]
    trains_on(trainer, "training after the change failed")

    # The leader lost with every server rebuilt, before it adopted layout 2: every member leaves
    # (exit 75); started again with the settings they had, the job is on layout 1.
    asking = Asking(ps0, 3)
    wait_until(lambda: frozen(ps0), 60, "ps0 before it adopts")
    assert "rebuilt by layout 2" in ps1.log_text() and "rebuilt by layout 2" in ps2.log_text()
    killed(ps0)
    for role in (ps1, ps2, trainer):
        assert role.proc.wait(60) == 75, role.log_text()[-3000:]
    asking.ended()
    ps0, ps1, ps2 = (procs.start("ps", name, 2, **MODEL) for name in ("ps0", "ps1", "ps2"))
    for role in (ps0, ps1, ps2):
        procs.wait_ready(role)
    assert all(status(s)["layout"]["epoch"] == 1 for s in (ps0, ps1, ps2)), status(ps0)["layout"]
    assert list(status(ps0)["layout"]["servers"]) == ["ps0", "ps1"] and status(ps2)["rows"] == 0
    assert rows(ps0, ps1) == MODEL["ntoken"]
    trainer = procs.start("trainer", "trainer0", 2, start=True, **TRAINER)
    procs.wait_ready(trainer)
    trains_on(trainer, "training on layout 1 again")

    # A trainer lost while the rows are copied ahead, then a server lost in its rebuild once the
    # others rebuilt: layout 2 is in force, ps1 named as not rebuilt; started again, ps1 holds its
    # slots by layout 2 from the last checkpoint.
    with ps0.client(timeout=120.0) as c:
        c.checkpoint()
    killed(ps1)
    ps1 = procs.start("ps", "ps1", 2, env={"RPCPS_FAILPOINTS": "part:early,relayout"}, **MODEL)
    procs.wait_ready(ps1)
    trains_on(trainer, "training with ps1 back", more=1)
    asking = Asking(ps0, 3)
    wait_until(lambda: frozen(ps1), 60, "ps1 at its early part")
    killed(trainer)
    os.kill(ps1.proc.pid, signal.SIGCONT)
    wait_until(lambda: frozen(ps1), 60, "ps1 in its rebuild")
    killed(ps1)
    answer, error = asking.ended()
    assert error is None and answer["state"] == "done" and answer["not_rebuilt"] == ["ps1"], (answer, error)
    ps1 = procs.start("ps", "ps1", 2, env={"RPCPS_FAILPOINTS": "take:changes"}, **MODEL)
    procs.wait_ready(ps1)
    assert all(status(s)["layout"]["epoch"] == 2 for s in (ps0, ps1, ps2))
    assert min(status(s)["rows"] for s in (ps0, ps1, ps2)) > 0 and rows(ps0, ps1, ps2) == MODEL["ntoken"]
    trainer = procs.start("trainer", "trainer0", 2, start=True, **TRAINER)
    procs.wait_ready(trainer)
    trains_on(trainer, "training on layout 2")

    # A destination lost under the trainers' hold, as it takes what was written since its copy
    # ahead: the change fails, the trainers are let go, layout 2 stays whole, and training goes on
    # once the destination is back.
    asking = Asking(ps0, 2)
    wait_until(lambda: frozen(ps1), 60, "ps1 taking its changes, the trainers held")
    killed(ps1)
    answer, error = asking.ended()
    assert error is not None and answer is None, answer
    assert status(ps0)["change"]["state"] == "failed" and status(ps0)["layout"]["epoch"] == 2
    ps1 = procs.start("ps", "ps1", 2, env={"RPCPS_FAILPOINTS": "relayout!"}, **MODEL)
    procs.wait_ready(ps1)
    assert all(status(s)["layout"]["epoch"] == 2 for s in (ps0, ps1, ps2)) and rows(ps0, ps1, ps2) == MODEL["ntoken"]
    trains_on(trainer, "training after the change under the hold failed")

    # A server whose rebuild fails twice while it answers on (back onto ps0 and ps1): layout 3 is
    # in force, ps1 named, and the leader puts it out of the group, since it holds layout 2's
    # shard (the trainers' steps that read the slots it was to take would be refused by it). It
    # leaves to rejoin; started again, it holds its slots by layout 3 from the last checkpoint.
    answer, error = Asking(ps0, 2).ended()
    assert error is None and answer["state"] == "done" and answer["not_rebuilt"] == ["ps1"], (answer, error)
    assert ps1.proc.wait(60) == 75, ps1.log_text()[-3000:]
    assert ps2.proc.wait(60) == 0, ps2.log_text()[-3000:]      # drained: it holds nothing in layout 3
    ps1 = procs.start("ps", "ps1", 2, **MODEL)
    procs.wait_ready(ps1)
    assert all(status(s)["layout"]["epoch"] == 3 for s in (ps0, ps1)) and rows(ps0, ps1) == MODEL["ntoken"]
    trains_on(trainer, "training after a server failed its rebuild")
