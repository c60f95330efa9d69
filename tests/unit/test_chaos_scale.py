"""``rpcps chaos --fault scale`` with a fake cluster: it moves the job one server up or down at
random (never below one), says what each change did, and tells a change that lost rows from one
that held them once."""
import random
import threading

from supervise.chaos_scale import Rescales, summarize
from services.client import ChangeFailed


class FakeJob:
    """A leader and its servers as their sidecars answer; ``lose`` rows on the next change."""

    def __init__(self, servers=2, rows=90):
        self.names, self.rows, self.lose, self.token = [f"ps{k}" for k in range(servers)], rows, 0, None

    def state(self):
        return {"leader": "ps0", "sidecars": {n: f"http://{n}" for n in [*self.names, "ps9"]}}

    def status(self, name):
        if name not in self.names:
            return None
        share = self.rows // len(self.names) + (1 if self.names.index(name) < self.rows % len(self.names) else 0)
        return {"rows": share, "layout": {"servers": {n: {} for n in self.names}} if name == "ps0" else None}

    def client(self, url, token=None, timeout=None):
        job = self

        class Client:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def scaled(self, servers, timeout=None):
                if servers > 5:
                    raise ChangeFailed("the change onto ... failed: no room")
                job.names = [f"ps{k}" for k in range(servers)]
                job.rows -= job.lose
                return {"state": "done", "epoch": 2, "pause_seconds": 0.1, "seconds": 0.2, "bytes": 10}
        return Client()


def rescales(job, seed=1):
    return Rescales(job, random.Random(seed), lambda s: None, 1.0, client=job.client)


def test_each_change_moves_one_server_and_checks_every_row_is_held_once():
    job = FakeJob(servers=1)
    records = rescales(job).run(6)
    assert records[0]["from"] == 1 and records[0]["to"] == 2           # never below one server
    assert all(abs(r["to"] - r["from"]) == 1 and r["to"] >= 1 for r in records)
    assert all(r["done"] and r["rows_held_once"] and r["rows"] == 90 for r in records)
    assert summarize(records) == {"fault": "scale", "kills": 6, "recovered": 6, "median_pause_seconds": 0.1, "max_pause_seconds": 0.1}


def test_a_change_that_loses_rows_or_fails_is_not_counted_recovered():
    job = FakeJob(servers=2)
    job.lose = 3
    lost = rescales(job).run(1)
    assert lost[0]["done"] and not lost[0]["rows_held_once"] and lost[0]["rows"] == 87
    job = FakeJob(servers=5)
    job.names = [f"ps{k}" for k in range(5)]
    failed = Rescales(job, random.Random(0), lambda s: None, 1.0, client=job.client)
    records = [failed.one(90) for _ in range(8)]
    refused = [r for r in records if r["to"] == 6]
    assert refused and all(not r["done"] and "no room" in r["error"] for r in refused)
    assert summarize(records)["recovered"] == sum(1 for r in records if r["done"] and r["rows_held_once"])


class MovingJob(FakeJob):
    """A job whose change stays under way (the leader says ``moving``) until a member is killed;
    killing the destination of a growth fails the change, changing nothing."""

    def __init__(self, servers=2):
        super().__init__(servers)
        self.killed, self._moving, self.change = [], threading.Event(), None

    def state(self):
        return {**super().state(), "pids": {n: 1 for n in [*self.names, "ctr0", "ctr1"]}}

    def status(self, name):
        out = super().status(name)
        if out is not None and name == "ps0" and self.change is not None:
            out["change"] = self.change
        return out

    def kill(self, name):
        self.killed.append(name)
        self._moving.set()
        return {"member": name, "back_at": 1.0, "seconds": 1.0}

    def client(self, url, token=None, timeout=None):
        job, plain = self, super().client(url)

        class Client(type(plain)):
            def scaled(self, servers, timeout=None):
                before = list(job.names)
                job.change = {"state": "moving", "from": before, "to": [f"ps{k}" for k in range(servers)]}
                assert job._moving.wait(10)
                job._moving.clear()
                job.change = {**job.change, "state": "done"}
                if servers > len(before) and job.killed[-1] not in before and job.killed[-1].startswith("ps"):
                    raise ChangeFailed(f"the change onto ... failed: {job.killed[-1]} was lost")
                return plain.scaled(servers)
        return Client()


class Clock:
    """Seconds that pass only as the code under test pauses."""

    def __init__(self):
        self.now = 0.0

    def pause(self, seconds):
        self.now += max(seconds, 0.01)


def killing(job, seed):
    clock = Clock()
    return Rescales(job, random.Random(seed), clock.pause, 1.0, client=job.client, during=job.kill,
                    clock=lambda: clock.now)


def test_a_member_of_each_role_is_killed_as_the_change_moves_and_a_change_that_failed_still_recovers():
    job = MovingJob()
    records = killing(job, 4).run(12)
    for r in records:
        before = [f"ps{k}" for k in range(r["from"])]
        after = [f"ps{k}" for k in range(r["to"])]
        plays = {"leader": r["victim"] == "ps0", "trainer": r["victim"].startswith("ctr"),
                 "source": r["victim"] in before and r["victim"] != "ps0" and (r["to"] > r["from"] or r["victim"] not in after),
                 "destination": r["victim"] in after and r["victim"] != "ps0" and (r["to"] < r["from"] or r["victim"] not in before)}
        assert plays[r["role"]], r
        assert r["killed_while_moving"] and r["kill"]["back_at"] and r["rows_held_once"], r
        # A destination killed as the job grows fails the change, which changes nothing.
        assert r["done"] == (not (r["role"] == "destination" and r["to"] > r["from"])), r
    assert {r["role"] for r in records} == {"source", "destination", "leader", "trainer"}
    summary = summarize(records)
    assert summary["recovered"] == 12 and summary["done"] == sum(r["done"] for r in records) < 12
    assert sum(summary["by_role"].values()) == 12
    job.lose = 3                                    # rows lost: not recovered, kill or not
    lost = killing(job, 0).run(1)
    assert not lost[0]["rows_held_once"] and summarize(lost)["recovered"] == 0
