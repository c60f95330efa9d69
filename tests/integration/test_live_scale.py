"""Servers join and leave a running job, as a user does it with roles run alone: a server started
beside two with their settings (`rpcps ps --name ps2 --num-ps 2`) joins holding nothing; `POST /scale` on the leader
moves a third of the slots to it while the trainer trains, and `POST /drain` on it hands them back,
after which it exits 0. No step is lost, every row is held by exactly one server at each layout,
the leader lost after a change gives the job back on the servers it had,
and a checkpoint records the layout in force."""
import json
import os
import re
import signal
import subprocess
import sys
import threading

import torch

from ps.spec.counting import job_tally
from ps.spec.sharding import NO_ID
from services.client import SidecarClient
from tests.support.cluster import SMALL_MODEL
from tests.support.upcli import UpProcess
from tests.support.wait import wait_until

MODEL = {**SMALL_MODEL, "ntoken": 1000}  # the built-in corpus has 1000 word types
TRAINER = {"batch_size": 4, "bptt": 5, "num_trainers": 1, "synthetic_tokens": 5000, "log_interval": 1}


def status(role):
    with role.client(timeout=5.0) as c:
        return c.status()


def steps(trainer) -> int:
    return status(trainer).get("step", 0)


def test_a_server_joins_takes_a_third_of_the_slots_and_drains_back(procs):
    ps0, ps1 = procs.start_servers(2, **MODEL)
    trainer = procs.start("trainer", "trainer0", 2, start=True, **TRAINER)
    wait_until(lambda: steps(trainer) >= 3, 90, "training")
    ps2 = procs.start("ps", "ps2", 2, **MODEL)      # the others' settings, as a StatefulSet scaled up has
    procs.wait_ready(ps2)
    assert status(ps2)["rows"] == 0 and status(ps2)["layout"]["epoch"] == 1       # beside the job, empty

    with ps0.client(timeout=300.0) as c:
        assert c.checkpoint()["step"] > 0         # on layout 1: the one a lost leader would restore
        grown = c.scale(3)
    assert grown["epoch"] == 2 and grown["state"] == "done", grown
    count = status(ps0)["layout"]["slots"]
    assert grown["moved_slots"] == count // 3 and grown["bytes"] > 0, grown
    assert status(ps0)["change"] == grown
    with ps0.client() as c:
        shown = c.metrics()
    assert 'rpcps_ps_layout_changes_total{name="ps0",result="done",role="ps"} 1.0' in shown
    said = {k: float(re.search(rf'^rpcps_ps_layout_change_{k}{{name="ps0",role="ps"}} (\S+)$', shown, re.M)[1])
            for k in ("seconds", "bytes", "pause_seconds")}
    assert said == {"seconds": grown["seconds"], "bytes": grown.get("ahead_bytes", 0) + grown["bytes"],
                    "pause_seconds": grown["pause_seconds"]}, said
    before = steps(trainer)
    wait_until(lambda: steps(trainer) >= before + 3, 90, "training on three servers")
    rows = [status(s)["rows"] for s in (ps0, ps1, ps2)]
    assert sum(rows) == MODEL["ntoken"] and min(rows) > 0, rows
    assert all(status(s)["layout"]["epoch"] == 2 for s in (ps0, ps1, ps2))
    seen = status(trainer)
    assert not seen.get("lost_steps") and not seen.get("relaid_steps"), seen

    # The leader lost before a checkpoint records layout 2: every member leaves (exit 75), and
    # started again as an engine restarts them (the same settings, --num-ps 2), the leader gives the
    # job back on its three servers, and ps1 and ps2 keep the shards they handed over.
    os.kill(ps0.proc.pid, signal.SIGKILL)
    for role in (ps1, ps2, trainer):
        assert role.proc.wait(60) == 75, role.log_text()[-3000:]
    ps0 = procs.start("ps", "ps0", 2, **MODEL)
    ps1, ps2 = (procs.start("ps", name, 2, **MODEL) for name in ("ps1", "ps2"))
    for role in (ps0, ps1, ps2):
        procs.wait_ready(role)
    trainer = procs.start("trainer", "trainer0", 2, start=True, **TRAINER)
    assert status(ps0)["layout"]["epoch"] == 2 and list(status(ps0)["layout"]["servers"]) == ["ps0", "ps1", "ps2"]
    for kept in (ps1, ps2):
        assert (status(kept).get("resumed_from") or {}).get("handover") is True, status(kept)
    assert sum(status(s)["rows"] for s in (ps0, ps1, ps2)) == MODEL["ntoken"]
    wait_until(lambda: steps(trainer) >= 3, 90, "training again on three servers")

    with ps2.client(timeout=300.0) as c:
        drained = c.drain()
    assert drained["epoch"] == 3 and drained["to"] == ["ps0", "ps1"], drained
    assert ps2.proc.wait(60) == 0, ps2.log_text()[-3000:]
    before = steps(trainer)
    wait_until(lambda: steps(trainer) >= before + 3, 90, "training on two servers again")
    assert sum(status(s)["rows"] for s in (ps0, ps1)) == MODEL["ntoken"]
    assert not status(trainer).get("lost_steps")

    # A trainer started again with the count the job had before it shrank (an engine's stale
    # --num-ps 3) trains on the leader's layout, two servers, instead of waiting for ps2.
    trainer.proc.kill()
    trainer.proc.wait(30)
    trainer = procs.start("trainer", "trainer0", 3, start=True, **TRAINER)
    wait_until(lambda: steps(trainer) >= 3, 90, "a trainer started for three servers training on two")

    with ps0.client(timeout=120.0) as c:
        taken = c.checkpoint()
    manifest = json.loads((procs.tmp / "ckpt" / f"step-{taken['step']}" / "manifest.json").read_text())
    assert manifest["meta"]["layout"]["epoch"] == 3 and manifest["meta"]["layout"]["servers"] == ["ps0", "ps1"]
    shards = [torch.load(procs.tmp / "ckpt" / f"step-{taken['step']}" / f"ps{k}.pt", weights_only=True) for k in (0, 1)]
    ids = torch.cat([s["tables"]["vocabulary"] for s in shards])
    assert sorted(ids[ids != NO_ID].tolist()) == list(range(MODEL["ntoken"]))     # -1: a row of no id

    # The destination lost in the middle of a change: frozen as it is asked to take its part, then
    # killed. The change fails, the old layout stays whole, and the trainer trains on.
    ps2 = procs.start("ps", "ps2", 3, **MODEL)
    procs.wait_ready(ps2)
    os.kill(ps2.proc.pid, signal.SIGSTOP)
    asking = Asking(ps0, 3)
    wait_until(lambda: (status(ps0).get("change") or {}).get("state") == "moving", 30, "the change under way")
    os.kill(ps2.proc.pid, signal.SIGKILL)
    answer, error = asking.ended()
    assert error is not None and answer is None, "the change onto a killed server did not fail"
    wait_until(lambda: status(ps0)["change"]["state"] == "failed", 10, "the change said failed")
    assert all(status(s)["layout"]["epoch"] == 3 for s in (ps0, ps1))
    assert sum(status(s)["rows"] for s in (ps0, ps1)) == MODEL["ntoken"]
    before = steps(trainer)
    wait_until(lambda: steps(trainer) >= before + 3, 90, "training on after the change failed")


class Asking:
    """The leader asked for a change in a thread of the test's (it returns once the change ends)."""

    def __init__(self, ps0, servers: int) -> None:
        self.answer, self.error = None, None
        self._thread = threading.Thread(target=self._ask, args=(ps0, servers), daemon=True)
        self._thread.start()

    def _ask(self, ps0, servers: int) -> None:
        try:
            with ps0.client(timeout=300.0) as c:
                self.answer = c.scale(servers)
        except Exception as exc:  # noqa: BLE001 - what the test checks
            self.error = exc

    def ended(self, timeout: float = 120.0):
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the change did not end"
        return self.answer, self.error


def test_a_change_that_cannot_be_made_is_refused_and_one_that_waits_says_for_whom(procs):
    ps0, ps1 = procs.start_servers(2, **MODEL)
    for role, ask, code, words in ((ps1, lambda c: c.scale(1), 501, "ask the leader, ps0"),
                                   (ps0, lambda c: c.drain(), 501, "cannot drain")):
        with role.client(timeout=60.0) as c:
            try:
                ask(c)
            except Exception as exc:     # noqa: BLE001 - the sidecar's answer, checked below
                assert getattr(exc, "status", None) == code and words in str(exc), exc
            else:
                raise AssertionError(f"{words}: accepted")
    with ps0.client(timeout=60.0) as c:
        waiting = c.scale(3)                 # ps2 is not serving: the leader waits for it
        assert waiting["state"] == "waiting" and waiting["awaiting"] == ["ps2"], waiting
        wait_until(lambda: c.status().get("wanted") == ["ps0", "ps1", "ps2"], 10, "the leader saying what it waits for")
        assert c.scale(2)["state"] == "unchanged"                      # asked back: nothing waits
        wait_until(lambda: c.status().get("wanted") is None, 10, "the leader waiting for nothing")
        assert c._http.post("/scale", json={"servers": 0}).status_code == 422
    assert status(ps0)["layout"]["epoch"] == 1 and sum(status(s)["rows"] for s in (ps0, ps1)) == MODEL["ntoken"]


TINY_CTR = ["--workload", "ctr", "--scale", "0.001", "--dim", "8", "--bottom", "32", "--top", "32", "--batch-size",
            "256", "--eval-samples", "1000", "--progress-interval", "1"]


def test_rpcps_scale_on_a_running_up_starts_a_server_moves_to_it_and_lets_it_go(tmp_path, cleanup):
    """As a user does it: `rpcps scale --servers 3` on a running `rpcps up` (async CTR) starts ps2
    where the placement puts a new member, moves a third of the slots to it, and `--servers 2` moves
    them back and lets it go: `rpcps up` does not start it again, and the trainers train on; then
    `rpcps chaos --fault scale` changes the servers twice at random. First of all, the new server
    frozen as it takes its first part (a failpoint, once in the job) past --member-timeout (6 s): `rpcps
    up` replaces it, the change fails and changes nothing, and asked again it is made. The job
    counts its updates (`--count-updates`): once the two async trainers stop, every row update
    they were acknowledged is in the servers' rows, none twice, slot by slot, across the five
    changes. Then `rpcps chaos --fault scale-kill` kills a member of a change as it moves."""
    once = tmp_path / "frozen-once"
    up = UpProcess(tmp_path, *TINY_CTR, "--num-ps", "2", "--num-trainers", "2", "--member-timeout", "6",
                   "--ready-timeout", "90", "--count-updates",
                   env={"RPCPS_FAILPOINTS": f"take:early={once}"})
    cleanup(up)
    up.wait_event("started", 180)
    ps0 = SidecarClient(up.cluster()["sidecars"]["ps0"], timeout=10.0)
    trainer = SidecarClient(up.cluster()["sidecars"]["ctr0"], timeout=10.0)
    wait_until(lambda: trainer.status().get("step", 0) >= 2, 120, "training")
    failed = scale(tmp_path, up, "--servers", "3", code=1)
    assert once.exists() and "failed" in failed, failed
    assert up.wait_event("lost", 60, name="ps2") and up.wait_event("restart", 60, name="ps2"), up.explain()
    assert "failed, layout 1 stays in force" in failed and ps0.status()["layout"]["epoch"] == 1
    assert up.wait_event("moved", 30, epoch=2, state="failed"), up.explain()
    wait_until(lambda: serving(up, "ps2"), 120, "ps2's replacement serving")
    wait_until(lambda: trainer.status()["step"] >= 4, 120, "training after the change failed")
    grown = scale(tmp_path, up, "--servers", "3")
    assert grown["epoch"] == 2 and grown["to"] == ["ps0", "ps1", "ps2"] and grown["state"] == "done", grown
    assert up.wait_event("scale", 30, name="ps2", action="started")
    moved = up.wait_event("moved", 30, epoch=2, state="done")      # `rpcps up` tells each change it saw
    assert moved["pause_seconds"] == grown["pause_seconds"], (moved, grown)
    assert [e["epoch"] for e in up.drain() if e["event"] == "move"] == [2, 2], up.explain()     # failed, then made
    sidecar = up.cluster()["sidecars"]["ps2"]
    with SidecarClient(sidecar, timeout=10.0) as c:
        assert c.status()["rows"] > 0 and c.status()["layout"]["epoch"] == 2
    before = trainer.status()["step"]
    wait_until(lambda: trainer.status()["step"] >= before + 3, 120, "training on three servers")

    shrunk = scale(tmp_path, up, "--servers", "2")
    assert shrunk["epoch"] == 3 and shrunk["to"] == ["ps0", "ps1"], shrunk
    up.wait_event("scale", 60, name="ps2", action="stopped")
    assert "ps2" not in up.cluster()["sidecars"]
    before = trainer.status()["step"]
    wait_until(lambda: trainer.status()["step"] >= before + 3, 120, "training on two servers again")
    restarts = [e["name"] for e in up.drain() if e["event"] == "restart"]
    assert restarts == ["ps2"], up.explain()        # the frozen one's, above: none since
    assert not trainer.status().get("lost_steps")

    # `rpcps chaos --fault scale`: two changes at random, each done with every row held once.
    done = subprocess.run([sys.executable, "-m", "supervise.cli", "chaos", "--fault", "scale", "--kills", "2",
                           "--interval", "0.5", "--seed", "1", "--json", "--state-dir", str(up.state_dir)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr + up.logs()
    changes = [e for e in map(json.loads, done.stdout.splitlines()) if e["event"] == "kill"]
    assert len(changes) == 2 and all(c["done"] and c["rows_held_once"] for c in changes), changes
    before = trainer.status()["step"]
    wait_until(lambda: trainer.status()["step"] >= before + 3, 120, "training after the changes")

    # The trainers stopped, every acknowledged row update is in the rows once.
    sidecars = up.cluster()["sidecars"]
    members = {n: SidecarClient(sidecars[n], timeout=10.0) for n in ("ps0", "ps1", "ctr0", "ctr1")}
    for name in ("ctr0", "ctr1"):
        members[name].stop_episode()
        wait_until(lambda name=name: members[name].status().get("state") == "idle", 60, f"{name} idle")
    counted = job_tally([members[n].counts() for n in ("ps0", "ps1")], [members[n].counts() for n in ("ctr0", "ctr1")])
    print("counted:", counted)
    assert counted["acknowledged"] > 1000 and counted["unsure"] == 0, counted
    assert (counted["lost"], counted["twice"]) == (0, 0) and counted["applied"] == counted["acknowledged"], counted

    # `rpcps chaos --fault scale-kill`: a change with one of its members killed as it moves; done
    # or failed, once the member is back every row is held once, and the trainers train on.
    for name in ("ctr0", "ctr1"):
        members[name].start_episode()
    before = trainer.status().get("step", 0)
    wait_until(lambda: trainer.status().get("step", 0) > before, 60, "training again")
    done = subprocess.run([sys.executable, "-m", "supervise.cli", "chaos", "--fault", "scale-kill", "--kills", "1",
                           "--interval", "0.5", "--seed", "2", "--json", "--state-dir", str(up.state_dir)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr + up.logs()
    killed = [e for e in map(json.loads, done.stdout.splitlines()) if e["event"] == "kill"]
    print("scale-kill:", killed)
    assert len(killed) == 1 and killed[0]["rows_held_once"] and killed[0]["kill"]["back_at"], killed
    before = trainer.status().get("step", 0)
    wait_until(lambda: trainer.status().get("step", 0) >= before + 3, 120, "training after the kill")
    for c in (ps0, trainer, *members.values()):
        c.close()
    assert up.terminate() == 0, up.logs()


def serving(up, name) -> bool:
    """Whether ``name`` as ``up``'s cluster.json names it now answers ready."""
    with SidecarClient(up.cluster()["sidecars"][name], timeout=5.0) as c:
        return c.ready()


def scale(tmp_path, up, *args, code: int = 0):
    """`rpcps scale` on the running ``up``: the leader's answer; with a ``code`` other than 0,
    what it said on stderr."""
    done = subprocess.run([sys.executable, "-m", "supervise.cli", "scale", *args, "--state-dir", str(up.state_dir)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == code, done.stdout + done.stderr + up.logs()
    return json.loads(done.stdout.strip().splitlines()[-1])["ps0"] if code == 0 else done.stderr


# Its largest table (70,918 rows) is kept as a grid (16 ids a slot or more), filled in place by a
# change; the others are packed, laid out again.
CTR = {"workload": "ctr", "scale": 0.007, "dim": 4, "bottom": "8", "top": "8", "consistency": "sync"}
STEPS = 60     # enough that both changes fall while training goes on (each takes about 10 steps here)


def _trained(procs, moves: bool, consistency: str = "sync", trainers: int = 2) -> dict[str, torch.Tensor]:
    """CTR trainers' 60 steps on two servers, with a third joining after step 3 and drained after
    step 20 when ``moves``: the model at the end, every table's rows by id."""
    settings = {**CTR, "consistency": consistency}
    ps0, ps1 = procs.start_servers(2, **settings)
    ps2 = procs.start("ps", "ps2", 3, **settings) if moves else None
    if ps2 is not None:
        procs.wait_ready(ps2)
    trainer = {"num_ps": 2, "num_trainers": trainers, "start": True, "steps": STEPS, "batch_size": 64,
               "eval_samples": 256}
    trainers = [procs.start_rl("ctr", f"ctr{k}", **trainer) for k in range(trainers)]
    if consistency == "sync":
        clock = lambda: status(ps0)["clock"]["step"]      # noqa: E731 - the steps every trainer took
    else:
        clock = lambda: min(status(t).get("step", 0) for t in trainers)     # noqa: E731
    if ps2 is not None:
        wait_until(lambda: clock() >= 3, 120, "three steps")
        with ps0.client(timeout=300.0) as c:
            assert c.scale(3)["epoch"] == 2
        assert clock() < STEPS, "the change onto three servers fell after the last step"
        wait_until(lambda: clock() >= 20, 120, "steps on three servers")
        with ps2.client(timeout=300.0) as c:
            assert c.drain()["epoch"] == 3
        assert clock() < STEPS, "the change back onto two servers fell after the last step"
        assert ps2.proc.wait(60) == 0
    for t in trainers:
        wait_until(lambda t=t: (status(t).get("episode") or {}).get("done"), 180, f"{t.name}'s {STEPS} steps")
    with ps0.client(timeout=120.0) as c:
        taken = c.checkpoint()
    folder = procs.tmp / "ckpt" / f"step-{taken['step']}"
    out: dict[str, torch.Tensor] = {}
    for k in (0, 1):
        shard = torch.load(folder / f"ps{k}.pt", weights_only=True)
        table_of = {name: t for t, names in shard["table_params"].items() for name in names}
        for name, value in shard["params"].items():
            if name not in table_of:
                out[name] = value           # a dense tensor, held whole
                continue
            for i, row in zip(shard["tables"][table_of[name]].tolist(), value):
                if i != NO_ID:          # a row of no id: an empty column's, or past the last id
                    out[f"{name}[{i}]"] = row
    assert taken["step"] == STEPS
    return out


def test_a_sync_job_moved_two_three_two_ends_bit_for_bit_as_one_that_never_moved(procs, tmp_path):
    from tests.support.cluster import Processes
    moved = _trained(procs, moves=True)
    still = Processes(tmp_path / "still")
    (tmp_path / "still").mkdir()
    try:
        unmoved = _trained(still, moves=False)
    finally:
        still.stop_all()
    assert moved.keys() == unmoved.keys() and sum("[" in k for k in moved) > 1000     # every row, by id
    for name in moved:
        assert torch.equal(moved[name], unmoved[name]), name


def test_an_async_job_moved_two_three_two_ends_bit_for_bit_as_one_that_never_moved(procs, tmp_path):
    """One async trainer's updates come in one order, so a run whose servers changed twice while
    it trained ends as one whose did not only if every update the servers acknowledged is in the
    rows after each move and none was applied twice (a refused request sent again included)."""
    from tests.support.cluster import Processes
    moved = _trained(procs, moves=True, consistency="async", trainers=1)
    still = Processes(tmp_path / "still")
    (tmp_path / "still").mkdir()
    try:
        unmoved = _trained(still, moves=False, consistency="async", trainers=1)
    finally:
        still.stop_all()
    assert moved.keys() == unmoved.keys() and sum("[" in k for k in moved) > 1000
    differ = [name for name in moved if not torch.equal(moved[name], unmoved[name])]
    assert not differ, f"{len(differ)} of {len(moved)} differ, first {differ[:3]}"
