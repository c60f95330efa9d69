"""The decisions around a lost leader, without a cluster: when a member calls its leader gone, which
handover a server may keep, how the leader's life is recorded, how a restarted leader resumes."""
import threading

import pytest
import torch

from services.checkpoint.handover import Handover, LeaderLife, Standing
from supervise.roster import resuming_newest
from services.leader import LeaderWatch


class FakeLeader:
    """A probe target: answers with its id, or raises while it is down."""

    def __init__(self, ident: str = "a") -> None:
        self.ident, self.down = ident, False

    def __call__(self) -> str:
        if self.down:
            raise ConnectionRefusedError("nothing listens")
        return self.ident


def test_one_missed_probe_is_no_loss_but_misses_in_a_row_are():
    leader = FakeLeader()
    watch = LeaderWatch(leader, lambda why: None, misses=2)
    watch.leader = leader()
    leader.down = True
    assert watch.check() is not None and watch._missed == 1
    leader.down = False
    assert watch.check() is None and watch._missed == 0, "an answer resets the count"
    leader.down = True
    watch.check()
    assert "2 probe(s) in a row" in watch.check()


def test_a_silent_leader_is_left_to_the_supervisors_deadline_and_a_refusing_one_is_not():
    leader, now = FakeLeader(), [100.0]
    watch = LeaderWatch(leader, lambda why: None, misses=2, silence=15.0, clock=lambda: now[0])
    watch.leader = leader()
    assert watch.check() is None                # answered at 100

    def silent() -> str:
        now[0] += 1.0                           # each probe waits out its timeout
        raise TimeoutError("timed out")
    watch._probe = silent                       # frozen, or cut off: no answer in time
    for _ in range(13):
        assert watch.check() is None and watch._missed == 0, now
    # A failed step asks for a verdict: asked again until the silence passes the deadline.
    assert "its store has not answered for 15s" in watch.verdict() and watch._missed >= watch.misses
    assert now[0] == 115.0
    # This member cut off itself (its supervisor's asks stopped too): the leader is not blamed,
    # and the member's lease fences it.
    alone = LeaderWatch(silent, lambda why: None, misses=2, silence=15.0, cut_off=lambda: True, clock=lambda: now[0])
    now[0] += 60
    assert alone.check() is None and alone._missed == 0
    refusing = LeaderWatch(leader, lambda why: None, misses=2, silence=15.0)
    refusing.leader = leader()
    leader.down = True                          # dead on a live host: refused at once, counted at once
    refusing.check()
    assert "2 probe(s) in a row" in refusing.check()


def test_another_leader_answering_is_a_loss_at_once():
    leader = FakeLeader("a")
    watch = LeaderWatch(leader, lambda why: None, misses=5)
    watch.leader = "a"
    leader.ident = "b"      # the store came back, under a new leader: this member's group is gone
    assert "another leader" in watch.check()
    assert watch._missed >= watch.misses


def test_an_evicted_member_leaves_at_once():
    leader = FakeLeader("a")
    evicted = False
    watch = LeaderWatch(leader, lambda why: None, misses=5, evicted=lambda: evicted)
    watch.leader = "a"
    assert watch.check() is None
    evicted = True          # stopped past the leader's probes: the group went on without it
    assert "removed this member from the group" in watch.check()
    assert watch._missed >= watch.misses


def test_the_watch_thread_reports_a_loss_once():
    leader = FakeLeader()
    told = []
    reported = threading.Event()
    watch = LeaderWatch(leader, lambda why: (told.append(why), reported.set()), interval=0.01, misses=2).start()
    leader.down = True
    assert reported.wait(5)
    watch._thread.join(5)
    assert len(told) == 1 and watch.lost.is_set()


def test_the_leaders_life_is_left_behind_only_by_an_unclean_stop(tmp_path):
    first = LeaderLife(tmp_path)
    assert first.begin() is None
    second = LeaderLife(tmp_path)          # the first died: its file is still there
    assert second.begin() == first.life
    second.release()                        # stopped cleanly
    assert LeaderLife(tmp_path).begin() is None
    third = LeaderLife(tmp_path)
    third.begin()
    first.release()                         # an old life's release does not remove a newer one's file
    assert LeaderLife(tmp_path).begin() == third.life


STATE = {"shard": 1, "steps": 7, "params": {"w": torch.arange(4.0)}}


@pytest.mark.parametrize("now, kept", [
    (Standing("step-3", "new", succeeds="old"), True),          # one leader later, same checkpoint
    (Standing("step-3", "new", succeeds=None), False),          # a deliberate start
    (Standing("step-3", "new", succeeds="older"), False),       # a leader after another one
    (Standing("step-5", "new", succeeds="old"), False),         # the new leader stands elsewhere
    (Standing(None, "new", succeeds="old"), False),
    (Standing("step-3", "old"), True),                          # the same leader evicted it: it rejoins
    (Standing("step-5", "old"), False),
])
def test_a_handover_is_kept_only_by_the_next_leader_on_the_same_checkpoint(tmp_path, now, kept):
    handover = Handover(tmp_path, "ps1")
    handover.write(STATE, Standing("step-3", "old"), steps=7)
    got = handover.take(now)
    assert (got is not None) == kept
    if kept:
        state, meta = got
        assert torch.equal(state["params"]["w"], STATE["params"]["w"]) and meta["steps"] == 7
    else:
        assert not handover.folder.exists(), "a handover that does not match is discarded"


def test_a_corrupt_handover_is_discarded(tmp_path):
    handover = Handover(tmp_path, "ps1")
    handover.write(STATE, Standing(None, "old"), steps=7)
    with open(handover.folder / "state.pt", "r+b") as f:
        f.seek(40)
        f.write(b"\x00\xff\x00")
    assert handover.take(Standing(None, "new", succeeds="old")) is None
    assert not handover.folder.exists()


def test_a_restarted_leader_resumes_the_newest_checkpoint_whatever_it_was_first_told():
    assert resuming_newest(["ps", "--no-resume", "--lr", "1"]) == ["ps", "--lr", "1", "--resume"]
    assert resuming_newest(["ps", "--resume", "--resume-from", "step-3", "--x"]) == ["ps", "--x", "--resume"]


class FakeCluster:
    """What ``rpcps chaos`` sees of a cluster whose launcher restarts a killed member at once."""

    def __init__(self) -> None:
        self.pids = {"ps0": 10, "ps1": 11, "trainer0": 12}
        self.statuses = {"ps0": {"steps": 50}, "ps1": {"steps": 50}, "trainer0": {"step": 25}}
        self.restored = {"ps0": {"id": "step-40", "step": 40}, "ps1": {"id": "step-40", "step": 40, "handover": True}}

    def state(self) -> dict:
        return {"pids": dict(self.pids), "leader": "ps0"}

    def status(self, name):
        return self.statuses[name]

    def ready(self, name) -> bool:
        return True

    def newest_checkpoint(self):
        return {"id": "step-40", "step": 40}

    def handle(self, state: dict, name: str) -> "FakeHandle":
        return FakeHandle(self, state["pids"][name])

    def kill(self, pid: int) -> None:
        name = next(n for n, p in self.pids.items() if p == pid)
        self.pids[name] = pid + 100
        if name == "trainer0":
            self.statuses[name] = {"step": 20}
        for n, resumed in self.restored.items():
            if n == name or name == "ps0":        # the leader's loss restarts every server
                self.statuses[n] = {"steps": 50, "resumed_from": resumed}


class FakeHandle:
    """A member's handle as ``rpcps chaos`` acts on it: what is done to it is recorded."""

    cuttable = False            # a process of this machine: no link of its own to cut

    def __init__(self, cluster: FakeCluster, pid: int) -> None:
        self.cluster, self.pid = cluster, pid
        self.done: list = cluster.__dict__.setdefault("done", [])

    def kill(self) -> None:
        self.cluster.kill(self.pid)

    def send_signal(self, sig) -> None:
        self.done.append((self.pid, sig))

    def connect(self, up: bool) -> None:
        self.done.append((self.pid, "up" if up else "down"))

    def poll(self):
        return None if self.pid in self.cluster.pids.values() else -9


def test_chaos_reports_each_kill_and_what_it_cost():
    from supervise.chaos import Chaos, ChaosConfig
    cluster, events = FakeCluster(), []
    clock = iter(range(100, 10_000))
    chaos = Chaos(ChaosConfig(kills=1, interval=1.0, seed=1), cluster, events.append,
                  clock=lambda: float(next(clock)), pause=lambda s: None, handle=cluster.handle)
    assert set(chaos.candidates()) == {"ps1", "trainer0"}, "the leader is left out unless named"
    leader = chaos.fault_one("ps0")
    assert leader["steps_lost"] == 10 and leader["resumed_from"] == "step-40" and leader["kept_by"] == ["ps1"]
    trainer = chaos.fault_one("trainer0")
    assert trainer["steps_lost"] == 5 and trainer["back_at"] > trainer["killed_at"]
    summary = chaos.run()
    assert summary["kills"] == summary["recovered"] == 1 and events[-1]["event"] == "summary"


def test_chaos_freezes_a_member_and_reports_whether_it_was_replaced_and_when():
    import signal

    from supervise.chaos import Chaos, ChaosConfig, human
    cluster = FakeCluster()
    now = [100.0]

    def pause(seconds):
        now[0] += seconds
        if replace_after is not None and now[0] - 100.0 >= replace_after and cluster.pids["ps1"] == 11:
            cluster.kill(11)               # rpcps up declared it lost and replaced it

    def chaos(fault: str, seconds: float) -> Chaos:
        return Chaos(ChaosConfig(kills=1, fault=fault, for_seconds=seconds), cluster, lambda e: None,
                     clock=lambda: now[0], pause=pause, handle=cluster.handle)

    # Frozen past the member timeout: replaced before --for ran out, never continued.
    replace_after = 16.0
    frozen = chaos("stop", 30.0).fault_one("ps1")
    assert frozen["replaced"] and 16.0 <= frozen["detected_seconds"] < 16.5 and frozen["steps_lost"] == 10, frozen
    assert cluster.done == [(11, signal.SIGSTOP)], "a replaced member is not continued"
    assert not frozen["old_running"] and frozen["stepped_during"] is False, frozen
    assert "declared lost and replaced after 16." in human({"event": "kill", **frozen})
    # Frozen for less: continued after --for, nothing restored, nothing lost.
    replace_after, cluster.done[:] = None, []
    cluster.statuses["trainer0"] = {"step": 25}
    brief = chaos("stop", 5.0).fault_one("trainer0")
    assert not brief["replaced"] and brief["detected_seconds"] is None and brief["steps_lost"] == 0, brief
    assert cluster.done == [(12, signal.SIGSTOP), (12, signal.SIGCONT)] and 5.0 <= brief["seconds"] < 5.5, brief
    assert human({"event": "kill", **brief}).startswith("froze trainer0: not replaced, going on after 5.")


def test_chaos_cuts_a_host_off_for_all_of_its_time_and_reports_steps_taken_meanwhile():
    from supervise.chaos import Chaos, ChaosConfig, human
    cluster = FakeCluster()
    cluster.pids["ps1"] = 11
    now = [100.0]

    def pause(seconds):
        now[0] += seconds
        if now[0] - 100.0 >= 16.0 and cluster.pids["ps1"] == 11:
            cluster.kill(11)                              # declared lost and replaced elsewhere
        if now[0] - 100.0 >= 20.0:
            cluster.statuses["ps1"] = {"steps": 51, "resumed_from": {"id": "step-40", "step": 40}}

    cut = Chaos(ChaosConfig(kills=1, fault="partition", for_seconds=40.0), cluster, lambda e: None,
                clock=lambda: now[0], pause=pause, handle=cluster.handle).fault_one("ps1")
    # The link stays down its whole 40 s although ps1 was replaced after 16: the job went on meanwhile.
    assert cluster.done == [(11, "down"), (11, "up")], cluster.done
    assert cut["replaced"] and 16.0 <= cut["detected_seconds"] < 16.5 and cut["lasted_seconds"] >= 40.0, cut
    assert cut["stepped_during"] and 20.0 <= cut["next_step_seconds"] < 21 and not cut["old_running"], cut
    assert "while its link was still down" in human({"event": "kill", **cut})
    local = Chaos(ChaosConfig(kills=1, fault="partition"), cluster, lambda e: None, handle=cluster.handle)
    with pytest.raises(SystemExit, match="--fault partition cuts a host's link, and ps1, trainer0 run on no host"):
        local.run()


class StepsCluster(FakeCluster):
    """A cluster whose members are Slurm steps: each start a step of its own, known by its record
    (``cluster.json``'s ``placed``), the process ids of their ``srun``s saying nothing of it (here,
    the same number each time)."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes = {"ps0": "n1", "ps1": "n2", "trainer0": "n3"}

    def state(self) -> dict:
        return {"leader": "ps0", "pids": {n: 7 for n in self.nodes},
                "placed": {n: {"kind": "slurm", "pid": 7, "job": "9", "name": n, "node": node}
                           for n, node in self.nodes.items()}}

    def handle(self, state: dict, name: str) -> "FakeHandle":
        return FakeHandle(self, self.pids[name])

    def kill(self, pid: int) -> None:
        name = next(n for n, p in self.pids.items() if p == pid)
        self.nodes[name] = "n4"           # started again, as a new step on the node left
        super().kill(pid)


def test_chaos_knows_a_member_started_again_by_its_placements_record_not_a_process_id():
    from supervise.chaos import Chaos, ChaosConfig
    cluster = StepsCluster()
    clock = iter(range(100, 10_000))
    chaos = Chaos(ChaosConfig(kills=1, seed=1, recover_timeout=50.0), cluster, lambda e: None,
                  clock=lambda: float(next(clock)), pause=lambda s: None, handle=cluster.handle)
    assert set(chaos.candidates()) == {"ps1", "trainer0"}
    record = chaos.fault_one("trainer0")
    assert record["replaced"] and record["back_at"] is not None and record["steps_lost"] == 5, record
