"""Progress with an ETA from the recent rate, on a fake clock."""
from __future__ import annotations

import math

from prometheus_client import CollectorRegistry

from services.lifecycle import RoleStatus, StatusBoard
from services.metrics import Metrics
from services.progress import RATE_WINDOW_S, Progress, ProgressStatus, clock, combine, describe


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make():
    now = Clock()
    board = StatusBoard("trainer", "trainer0", RoleStatus)
    metrics = Metrics(CollectorRegistry(), "trainer", "trainer0")
    return now, board, metrics, Progress(board, metrics, now)


def test_eta_follows_the_recent_rate_and_is_published():
    now, board, metrics, p = make()
    p.start("train", 1000)
    assert board.snapshot()["progress"] == {"phase": "train", "done": 0, "total": 1000, "elapsed_s": 0.0, "eta_s": None}
    assert math.isnan(metrics.progress_eta._value.get())
    for step in range(1, 11):           # 1 step/s
        now.t += 1
        p.advance(step)
    assert p.report().eta_s == 990.0 and metrics.progress_eta._value.get() == 990.0
    assert metrics.progress_done._value.get() == 0.01
    for step in range(11, 211):         # then 4 steps/s for 50 s, longer than the rate's window
        now.t += 0.25
        p.advance(step)
    assert RATE_WINDOW_S < 50 and p.report().eta_s == 197.5        # 790 left at 4/s: the old rate is gone
    assert board.snapshot()["progress"]["elapsed_s"] == 60.0


def test_unbounded_work_has_no_eta_and_a_total_learnt_late_counts():
    now, board, metrics, p = make()
    p.start("train", None)
    now.t += 1
    p.advance(5)
    assert p.report().eta_s is None and math.isnan(metrics.progress_done._value.get())
    p.start("evaluate", None)
    now.t += 2
    p.advance(400, 1000)
    assert (p.report().total, p.report().eta_s) == (1000, 3.0)


def test_combined_progress_is_the_share_done_and_the_slowest_eta():
    a = ProgressStatus(phase="train", done=10, total=40, eta_s=30.0)
    b = ProgressStatus(phase="train", done=30, total=40, eta_s=5.0)
    assert combine([a, b, None], "train") == {"percent": 50.0, "eta_s": 30.0}
    assert combine([a, ProgressStatus(phase="train", done=1, total=40)], "train")["eta_s"] is None
    assert combine([a, ProgressStatus(phase="evaluate", done=1, total=5)], "evaluate") == {"percent": 20.0, "eta_s": None}
    assert combine([ProgressStatus(phase="train", done=3)], "train") == {"percent": None, "eta_s": None}


def test_durations_and_columns_read_as_a_person_reads_them():
    assert [clock(s) for s in (None, 0, 42.4, 78, 3909)] == ["-", "0:00", "0:42", "1:18", "1:05:09"]
    assert describe({"percent": 35.0, "elapsed_s": 42, "eta_s": 78}) == "35% | 0:42 elapsed | ETA 1:18"
    assert describe({"percent": None, "elapsed_s": 42}) == "0:42 elapsed"
