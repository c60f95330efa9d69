"""Delta checkpoints in the protocol and on disk, in process: the coordinator makes every Nth
checkpoint whole and the others deltas of parts that can give one; the manifest names what each
delta applies to; a failed checkpoint's changes go into the next; pruning keeps what a kept delta
needs; a restore applies the chain, verifying every file on the way, and skips a checkpoint whose
chain is broken."""
from __future__ import annotations

import shutil
from typing import Any, Optional

import pytest
from prometheus_client import CollectorRegistry

from services.checkpoint.coordinator import CheckpointPlan, Coordinator
from services.checkpoint.member import CheckpointMember
from services.checkpoint.parts import SnapshotPart, restore_newest
from services.checkpoint.store import CheckpointStore
from services.errors import CheckpointError
from services.metrics import Metrics


class Log(SnapshotPart):
    """A shard whose state is the list of everything it was told; a delta is what came since the
    checkpoint it last saved in."""

    def __init__(self, name: str) -> None:
        self.name, self.items, self.saved, self.since, self.taken = name, [], 0, None, 0
        self.poisoned = False

    def state_dict(self) -> dict[str, Any]:
        return self.snapshot(None)

    def snapshot(self, base: Optional[int]) -> dict[str, Any]:
        self.taken = len(self.items)
        if base is not None and base == self.since:
            return {"steps": len(self.items), "base": base, "new": self.items[self.saved:]}
        return {"steps": len(self.items), "all": list(self.items)}

    def base_of(self, state: dict[str, Any]) -> Optional[int]:
        return state.get("base")

    def settle(self, committed: bool, step: int) -> None:
        if committed:
            self.saved, self.since = self.taken, step

    def step(self, state: dict[str, Any]) -> int:
        return state["steps"]

    def check(self, state: dict[str, Any]) -> None:
        if self.poisoned:
            raise CheckpointError("poisoned")


def merge(older: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
    return {"steps": delta["steps"], "all": older["all"] + delta["new"]}


class Cluster:
    def __init__(self, root, shared: bool = True, full_every: int = 3, keep: int = 2) -> None:
        self.parts = {n: Log(n) for n in ("ps0", "ps1")}
        self.members = {n: CheckpointMember(n, CheckpointStore(root / ("shared" if shared or n == "ps0" else n)))
                        for n in self.parts}
        for n, m in self.members.items():
            m.add(self.parts[n])
        self.coordinator = Coordinator(self.members["ps0"].store, CheckpointPlan(holders=("ps0", "ps1")), keep=keep,
                                       local=self.members["ps0"], metrics=Metrics(CollectorRegistry(), "ps", "ps0"),
                                       members=lambda: ["ps0", "ps1"], full_every=full_every,
                                       transport=lambda m, method, *a, timeout: getattr(self.members[m],
                                                                                        method.__name__)(*a))

    def train(self, k: int) -> None:
        for part in self.parts.values():
            part.items += [f"{part.name}.{len(part.items) + i}" for i in range(k)]

    def restore(self, name: str, **kw: Any) -> tuple[Any, Any]:
        store = self.members[name].store
        return restore_newest(store, True, None, lambda info: [f"{name}.pt"], lambda s: s and s[0], merge=merge, **kw)


@pytest.mark.parametrize("shared", [True, False])
def test_every_third_is_whole_and_a_chain_restores_what_was_saved(tmp_path, shared):
    cluster = Cluster(tmp_path, shared=shared)
    kinds = []
    for _ in range(5):
        cluster.train(2)
        kinds.append(cluster.coordinator.take())
    assert [k["kind"] for k in kinds] == ["full", "delta", "delta", "full", "delta"]
    assert kinds[1]["bases"] == ["step-2"] and kinds[2]["bases"] == ["step-4"]
    store = cluster.members["ps1"].store
    newest = store.list()[0]
    assert newest.bases["ps1.pt"] == "step-8" and [c.id for c in store.chain(newest, "ps1.pt")] == ["step-8", "step-10"]
    assert store.load_file(newest, "ps1.pt") == {"steps": 10, "base": 8, "new": ["ps1.8", "ps1.9"]}
    for name in ("ps0", "ps1"):
        info, state = cluster.restore(name)
        assert info.id == "step-10" and state["all"] == cluster.parts[name].items


def test_a_failed_delta_leaves_its_changes_for_the_next_and_pruning_keeps_the_chain(tmp_path):
    cluster = Cluster(tmp_path, full_every=4, keep=1)
    cluster.train(1)
    cluster.coordinator.take()                   # step-1, whole
    cluster.train(1)
    cluster.parts["ps1"].poisoned = True
    with pytest.raises(CheckpointError):
        cluster.coordinator.take()
    cluster.parts["ps1"].poisoned = False
    cluster.train(1)
    result = cluster.coordinator.take()          # step-3, a delta on step-1 holding steps 2 and 3
    assert result["kind"] == "delta" and result["bases"] == ["step-1"]
    store = cluster.members["ps0"].store
    assert [c.id for c in store.list()] == ["step-3", "step-1"], "keep=1 keeps the base of the newest"
    assert cluster.restore("ps1")[1]["all"] == ["ps1.0", "ps1.1", "ps1.2"]


def test_a_broken_chain_is_skipped_for_an_older_checkpoint_and_an_asked_one_is_an_error(tmp_path):
    cluster = Cluster(tmp_path, full_every=2, keep=5)
    for _ in range(3):
        cluster.train(1)
        cluster.coordinator.take()               # step-1 whole, step-2 delta, step-3 whole
    store = cluster.members["ps0"].store
    (store.folder(3) / "ps0.pt").write_bytes(b"not a checkpoint")     # the newest whole one, corrupt
    info, state = cluster.restore("ps0")
    assert info.id == "step-2" and state["all"] == ["ps0.0", "ps0.1"]
    shutil.rmtree(store.folder(1))               # step-2's base gone: no checkpoint left to restore
    assert cluster.restore("ps0") == (None, None)
    with pytest.raises(CheckpointError, match="delta on step-1"):
        restore_newest(store, True, "step-2", lambda info: ["ps0.pt"], lambda s: s, merge=merge)
