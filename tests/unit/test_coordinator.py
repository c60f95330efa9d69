"""The checkpoint protocol and layout, in process: a coordinator over real members (real stores on
disk) whose parts are fakes, called through an in-process transport instead of RPC."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from services.checkpoint.coordinator import CheckpointPlan, Coordinator
from services.checkpoint.member import CheckpointMember
from services.checkpoint.parts import PausedPart, SnapshotPart
from services.checkpoint.store import CheckpointStore
from services.errors import CheckpointError, CheckpointInProgress, NotReady
from services.metrics import Metrics
from tests.support.wait import wait_until


class Shard(SnapshotPart):
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log, self.steps, self.prepared = name, log, 0, False
        self.poisoned = False

    def prepare(self) -> None:
        self.prepared = True
        self.log.append(f"prepare {self.name}")

    def state_dict(self) -> dict[str, Any]:
        assert self.prepared, "copied before its buffers were prepared"
        self.log.append(f"snapshot {self.name}")
        self.prepared = False
        return {"steps": self.steps, "value": f"{self.name}@{self.steps}"}

    def step(self, state: dict[str, Any]) -> int:
        return state["steps"]

    def check(self, state: dict[str, Any]) -> None:
        if self.poisoned:
            raise CheckpointError(f"{self.name} holds values that are not finite")


class Position(PausedPart):
    def __init__(self, name: str, log: list[str], fails: bool = False) -> None:
        self.name, self.log, self.fails, self.at = name, log, fails, 0

    def pause(self, timeout: float) -> None:
        if self.fails:
            raise CheckpointError(f"{self.name} did not reach a step boundary")
        self.log.append(f"pause {self.name}")

    def resume(self) -> None:
        self.log.append(f"resume {self.name}")

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "position": self.at, "steps": self.at}


class Cluster:
    """ps0 (the leader), ps1 and trainers, each a CheckpointMember over its own folder or a shared one."""

    def __init__(self, root: Path, shared: bool, trainers: int = 2) -> None:
        self.log: list[str] = []
        self.shards = {n: Shard(n, self.log) for n in ("ps0", "ps1")}
        self.positions = {f"trainer{i}": Position(f"trainer{i}", self.log) for i in range(trainers)}
        self.members: dict[str, CheckpointMember] = {}
        for name, part in [*self.shards.items(), *self.positions.items()]:
            store = CheckpointStore(root / ("shared" if shared or name == "ps0" else name))
            self.members[name] = CheckpointMember(name, store)
            self.members[name].add(part)
        self.gone: set[str] = set()
        self.metrics = Metrics(CollectorRegistry(), "ps", "ps0")
        self.coordinator = Coordinator(
            self.members["ps0"].store, CheckpointPlan(holders=("ps0", "ps1"), paused_role="trainer",
                                                      meta={"model": {"ntoken": 10}}),
            keep=2, local=self.members["ps0"], metrics=self.metrics,
            members=lambda: sorted(set(self.members) - self.gone), transport=self.call)

    def call(self, member: str, method: Any, *args: Any, timeout: float) -> Any:
        assert member != "ps0", "the leader's own member is called directly"
        if member in self.gone:
            raise RuntimeError(f"{member} is unreachable")
        return getattr(self.members[member], method.__name__)(*args)

    def train(self, steps: int) -> None:
        for shard in self.shards.values():
            shard.steps += steps
        for position in self.positions.values():
            position.at += steps


def test_one_checkpoint_holds_every_part_at_one_instant(tmp_path):
    cluster = Cluster(tmp_path, shared=True)
    cluster.train(5)
    result = cluster.coordinator.take()
    assert result["new"] and result["step"] == 5
    log = cluster.log
    # Buffers before anyone is held; every trainer held before any shard is copied; resumed after.
    assert {e for e in log[:2]} == {"prepare ps0", "prepare ps1"}
    held = [log.index(f"pause trainer{i}") for i in range(2)]
    copied = [log.index(f"snapshot {n}") for n in ("ps0", "ps1")]
    resumed = [log.index(f"resume trainer{i}") for i in range(2)]
    assert max(held) < min(copied) and max(copied) < min(resumed)

    store = cluster.members["ps0"].store
    info = store.latest_valid()
    assert sorted(info.files) == ["ps0.pt", "ps1.pt", "trainer0.pt", "trainer1.pt"]
    assert info.meta["model"] == {"ntoken": 10} and info.meta["positions"] == ["trainer0", "trainer1"]
    assert store.load_file(info, "ps1.pt")["value"] == "ps1@5"
    assert cluster.coordinator.positions()["states"][1] == {"name": "trainer1", "position": 5, "steps": 5}
    assert not list(info.path.glob(".taking-*"))          # the marker is gone
    assert cluster.metrics.checkpoint_last_success._value.get() > 0


def test_nothing_new_to_save_is_no_new_checkpoint(tmp_path):
    cluster = Cluster(tmp_path, shared=True)
    cluster.train(3)
    first = cluster.coordinator.take()
    again = cluster.coordinator.take()
    assert first["new"] and not again["new"] and again["id"] == first["id"]
    assert cluster.coordinator.take_unless_saved(3)["new"] is False
    cluster.train(1)
    assert cluster.coordinator.take_unless_saved(4)["new"] is True


def test_a_final_checkpoint_asked_while_one_is_being_taken_waits_for_it(tmp_path):
    """Every server stopping at once (``scancel``): the leader's final checkpoint must not give up
    (and leave) while another server's is being written; it waits, and that one holds its steps."""
    cluster = Cluster(tmp_path, shared=True)
    cluster.train(3)
    slow, release = cluster.positions["trainer1"], threading.Event()
    slow.pause = lambda timeout: release.wait(10)
    first: dict[str, Any] = {}
    taking = threading.Thread(target=lambda: first.update(cluster.coordinator.take()))
    taking.start()
    wait_until(lambda: "prepare ps0" in cluster.log, 10, "the first checkpoint under way")
    with pytest.raises(CheckpointInProgress):
        cluster.coordinator.take()                  # a user's request is refused, as before
    final: dict[str, Any] = {}
    waiting = threading.Thread(target=lambda: final.update(cluster.coordinator.take_unless_saved(3)))
    waiting.start()
    waiting.join(0.5)
    assert waiting.is_alive(), "the final checkpoint did not wait for the one being taken"
    release.set()
    taking.join(10)
    waiting.join(10)
    assert first["new"] and not final["new"] and final["id"] == first["id"]


def test_a_folder_per_server_keeps_each_shard_under_its_own_manifest(tmp_path):
    cluster = Cluster(tmp_path, shared=False)
    cluster.train(2)
    cluster.coordinator.take()
    leader = cluster.members["ps0"].store.latest_valid()
    assert sorted(leader.files) == ["ps0.pt", "trainer0.pt", "trainer1.pt"]
    own = cluster.members["ps1"].store.latest_valid()
    assert list(own.files) == ["ps1.pt"] and own.meta["server"] == "ps1"
    assert leader.meta["elsewhere"]["ps1.pt"]["sha256"] == own.files["ps1.pt"].sha256
    assert leader.meta["elsewhere"]["ps1.pt"]["server"] == "ps1"


def test_a_failed_checkpoint_leaves_no_own_part_behind_and_counts_as_a_failure(tmp_path, monkeypatch):
    cluster = Cluster(tmp_path, shared=False)
    cluster.train(2)
    ps0_store = cluster.members["ps0"].store

    def broken_commit(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")
    monkeypatch.setattr(ps0_store, "commit", broken_commit)
    with pytest.raises(OSError, match="disk full"):
        cluster.coordinator.take()
    # ps1 wrote its shard under its own manifest, but the cluster never committed: it is removed.
    assert cluster.members["ps1"].store.list() == []
    assert not (cluster.members["ps1"].store.root / "step-2").exists()
    assert cluster.metrics.checkpoint_failures._value.get() == 1
    assert cluster.log.count("resume trainer0") == 1          # trainers were let go all the same


def test_a_missing_server_refuses_and_a_dead_trainer_does_not_block(tmp_path):
    cluster = Cluster(tmp_path, shared=True, trainers=3)
    cluster.positions["trainer2"].fails = True
    cluster.gone = {"ps1"}
    with pytest.raises(NotReady, match="without ps1"):
        cluster.coordinator.take()
    cluster.gone = set()
    cluster.members["trainer1"] = _Unreachable()              # type: ignore[assignment]  # listed, not answering
    cluster.train(1)
    result = cluster.coordinator.take()
    info = cluster.members["ps0"].store.latest_valid()
    assert result["new"] and sorted(info.files) == ["ps0.pt", "ps1.pt", "trainer0.pt"]
    assert "resume trainer2" not in cluster.log               # never held, so never resumed


class _Unreachable:
    def __getattr__(self, name: str) -> Any:
        raise RuntimeError("connection refused")


def test_a_departed_trainer_keeps_its_position_in_later_checkpoints(tmp_path):
    cluster = Cluster(tmp_path, shared=True)
    cluster.train(4)
    cluster.coordinator.tell("trainer1", {"name": "trainer1", "position": 4, "said": "goodbye"})
    cluster.gone = {"trainer1"}
    cluster.train(1)
    cluster.coordinator.take()
    states = {s["name"]: s for s in cluster.coordinator.positions()["states"]}
    assert states["trainer1"]["said"] == "goodbye" and states["trainer0"]["position"] == 5
    with pytest.raises(CheckpointError, match="ps1 is not a member whose position"):
        cluster.coordinator.tell("ps1", {})


def test_a_trainer_down_keeps_its_last_known_position(tmp_path):
    cluster = Cluster(tmp_path, shared=True)
    cluster.train(4)
    cluster.coordinator.take()
    cluster.gone = {"trainer1"}          # crashed: it never said where it stopped
    cluster.train(3)
    cluster.coordinator.take()
    states = {s["name"]: s for s in cluster.coordinator.positions()["states"]}
    assert states == {"trainer0": {"name": "trainer0", "position": 7, "steps": 7},
                      "trainer1": {"name": "trainer1", "position": 4, "steps": 4}}
    cluster.gone = set()                 # back, and held again: its own position wins
    cluster.train(1)
    cluster.coordinator.take()
    assert {s["name"]: s["position"] for s in cluster.coordinator.positions()["states"]} == {"trainer0": 8,
                                                                                            "trainer1": 8}


def test_overlapping_requests_get_409_not_a_second_checkpoint(tmp_path):
    cluster = Cluster(tmp_path, shared=True)
    cluster.train(1)
    release = threading.Event()
    original = cluster.shards["ps1"].state_dict

    def slow_copy() -> dict[str, Any]:
        release.wait(10)
        return original()
    cluster.shards["ps1"].state_dict = slow_copy       # type: ignore[method-assign]
    first: list[dict] = []
    taking = threading.Thread(target=lambda: first.append(cluster.coordinator.take()))
    taking.start()
    try:
        wait_until(lambda: "snapshot ps0" in cluster.log, 10, "the first checkpoint to be copying")
        with pytest.raises(CheckpointInProgress):
            cluster.coordinator.take()
    finally:
        release.set()
        taking.join(10)
    assert first and first[0]["new"]
    assert cluster.metrics.checkpoint_failures._value.get() == 0


@pytest.mark.parametrize("shared", [True, False])
def test_a_shard_that_must_not_be_saved_fails_the_checkpoint_and_the_last_good_one_stays(tmp_path, shared):
    cluster = Cluster(tmp_path, shared=shared)
    cluster.train(2)
    cluster.coordinator.take()
    cluster.train(3)
    cluster.shards["ps1"].poisoned = True
    with pytest.raises(CheckpointError, match="not finite"):
        cluster.coordinator.take()
    for name in ("ps0", "ps1"):
        store = cluster.members[name].store
        assert [c.step for c in store.list()] == [2], name     # nothing of step 5 counts as a checkpoint
    assert cluster.metrics.checkpoint_failures._value.get() == 1
    assert cluster.log.count("resume trainer0") == 2           # trainers went on both times


def test_a_position_told_while_waiting_is_where_a_replacement_goes_on_when_newer(tmp_path):
    # A followed stream's trainer waiting between files tells ps0 where it is; killed there, its
    # replacement resumes from that, not from the older checkpoint; an older told one loses.
    cluster = Cluster(tmp_path, shared=True)
    assert cluster.coordinator.positions() is None
    cluster.coordinator.tell("trainer1", {"name": "trainer1", "position": 1, "steps": 1})
    assert cluster.coordinator.positions()["states"] == [{"name": "trainer1", "position": 1, "steps": 1}]
    cluster.train(4)
    cluster.coordinator.take()
    states = {s["name"]: s for s in cluster.coordinator.positions()["states"]}
    assert states["trainer1"]["position"] == 4, "the checkpoint's is newer than the told one"
    cluster.coordinator.tell("trainer1", {"name": "trainer1", "position": 6, "steps": 6})
    states = {s["name"]: s for s in cluster.coordinator.positions()["states"]}
    assert states["trainer1"]["position"] == 6 and states["trainer0"]["position"] == 4
    cluster.gone = {"trainer1"}
    cluster.train(1)
    cluster.coordinator.take()
    states = {s["name"]: s for s in cluster.coordinator.positions()["states"]}
    assert states["trainer1"]["position"] == 6, "a checkpoint without it keeps the newer told position"
    with pytest.raises(CheckpointError, match="ps1 is not a member whose position"):
        cluster.coordinator.tell("ps1", {})
