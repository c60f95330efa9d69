"""--dense allreduce's checkpoint hold on a trainer: the replica is written to the servers only
once the trainer is held, only by the trainer chosen to, and a failed write lets it go."""
import pytest

from trainer.lm.dense import ReplicaHold


class FakeHold:
    def __init__(self, holds: bool) -> None:
        self.holds, self.calls = holds, []

    def hold(self, timeout: float) -> bool:
        self.calls.append("hold")
        return self.holds

    def release(self) -> None:
        self.calls.append("release")


def test_the_replica_is_written_once_held():
    inner, written = FakeHold(True), []
    hold = ReplicaHold(inner, lambda: written.append(list(inner.calls)))
    assert hold.hold(5.0)
    assert written == [["hold"]]            # written after the hold, before any release
    hold.release()
    assert inner.calls == ["hold", "release"]


def test_nothing_is_written_when_not_held_or_not_chosen():
    written = []
    assert not ReplicaHold(FakeHold(False), lambda: written.append(1)).hold(5.0)
    assert ReplicaHold(FakeHold(True), None).hold(5.0)
    assert written == []


def test_a_failed_write_releases_the_trainer_and_fails_the_hold():
    inner = FakeHold(True)

    def broken() -> None:
        raise RuntimeError("ps1 is gone")
    with pytest.raises(RuntimeError, match="ps1 is gone"):
        ReplicaHold(inner, broken).hold(5.0)
    assert inner.calls == ["hold", "release"]
