"""Deadlines for members that hang (``supervise/liveness.py``): any answer of a sidecar counts, a
503 included; a sidecar that does not answer leaves the last answer where it was; ``rpcps up``
judges a member by --member-timeout after its first answer since its start, by --ready-timeout
before it."""
import http.server
import threading
import time

import pytest

from services.lease import Lease
from supervise.liveness import Liveness
from supervise.processes import free_port
from services.runtime import _hear_supervisor
from tests.support.wait import wait_until


class _Unhealthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(503)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def sidecar():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Unhealthy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_any_answer_counts_and_silence_leaves_the_last_one(sidecar):
    live = Liveness(15.0, 180.0, every=0.05, timeout=0.5)
    try:
        live.watch("ps1", sidecar)
        live.watch("ps2", f"http://127.0.0.1:{free_port()}")       # nobody there
        wait_until(lambda: live.last_answer("ps1") is not None, 10, "an answer from ps1 (a 503)")
        wait_until(lambda: live.asked("ps2") >= 3, 10, "three asks of ps2")
        assert live.last_answer("ps2") is None
    finally:
        live.close()


def test_a_member_not_answering_is_asked_five_times_as_often_as_one_that_answers(sidecar):
    # So a member is heard as soon as its sidecar listens, before it can freeze (and be judged by
    # --ready-timeout instead of --member-timeout).
    live = Liveness(15.0, 180.0, every=0.5, timeout=0.5)
    try:
        live.watch("ps1", sidecar)
        live.watch("ps2", f"http://127.0.0.1:{free_port()}")       # nobody there yet
        wait_until(lambda: live.asked("ps2") >= 15, 10, "fifteen asks of ps2")
        assert live.asked("ps1") <= 6, live.asked("ps1")           # about 3 in the same 1.5 s
    finally:
        live.close()


def test_a_member_is_judged_by_the_member_timeout_once_it_has_answered_since_its_start():
    live = Liveness(15.0, 180.0)            # no member watched: its answers set by hand
    assert live.overdue("ps1", 100.0, 200.0) is None, "not answered yet: --ready-timeout"
    assert live.overdue("ps1", 100.0, 281.0) == 181.0
    live._answered["ps1"] = 250.0
    assert live.overdue("ps1", 100.0, 264.0) is None
    assert live.overdue("ps1", 100.0, 266.0) == 16.0
    live._answered["ps1"] = 90.0            # an answer of its life before this start does not count
    assert live.overdue("ps1", 100.0, 200.0) is None


def test_a_lease_expires_after_its_timeout_since_the_last_renewal_and_says_when_it_is_cut_off():
    from services.lease import Lease
    now = [100.0]
    lease = Lease(6.0, clock=lambda: now[0])
    now[0] += 60
    assert lease.expired() is None and not lease.cut_off(), "nothing to expire before the first renewal"
    assert lease.describe() == {"timeout": 6.0, "renewed_ago": None}
    lease.renew()
    now[0] += 3.5                   # asked each second: three missed asks say it is cut off
    assert lease.cut_off() and lease.expired() is None and lease.describe()["renewed_ago"] == 3.5
    lease.renew()
    assert not lease.cut_off()
    now[0] += 6.5
    assert lease.expired() == 6.5


def test_a_lease_renews_from_when_an_ask_was_sent_and_not_on_one_its_asker_gave_up_on():
    from services.lease import Ask, Lease
    now = [1000.0]
    lease = Lease(15.0, clock=lambda: now[0])
    offset = -700.0                  # the asker's clock reads 700 s behind this host's
    header = Ask(now[0] + offset, 2.0, "up-1").header(15)
    assert Ask.parse(header) == Ask(now[0] + offset, 2.0, "up-1") and Ask.parse("15") is None
    assert Ask.parse("sent=nan;within=2;by=x") is None and Ask.parse("sent=1;within=inf;by=x") is None
    for _ in range(3):               # asked each second, answered at once
        assert lease.renew(Ask.parse(Ask(now[0] + offset - 0.01, 2.0, "up-1").header(15)))
        now[0] += 1.0
    assert lease.describe()["renewed_ago"] == pytest.approx(1.0)

    # Frozen for 6 s: the asks sent meanwhile are answered when it goes on; their asker gave up
    # after 2 s, and counts its silence from its last answer, so they renew nothing.
    queued = [Ask(now[0] + offset + k - 0.01, 2.0, "up-1") for k in range(6)]
    now[0] += 6.0
    assert [lease.renew(a) for a in queued] == [False] * 4 + [True] * 2
    assert lease.describe()["renewed_ago"] == pytest.approx(1.0, abs=0.02)   # from the last, sent 1 s ago

    # A lease never goes back, and a new asker (another clock) is measured afresh.
    assert lease.renew(Ask(now[0] + offset - 1.5, 2.0, "up-1"))
    assert lease.describe()["renewed_ago"] == pytest.approx(1.0, abs=0.02)
    assert lease.renew(Ask(now[0] + 5000.0, 2.0, "up-2")) and lease.describe()["renewed_ago"] == 0
    assert lease.renew(None) and lease.describe()["renewed_ago"] == 0     # by hand: now


def test_a_slow_drift_between_two_clocks_does_not_make_every_ask_stale():
    from services.lease import Ask, Lease
    now = [0.0]
    lease = Lease(15.0, clock=lambda: now[0])
    for k in range(20000):           # this host's clock gains 100 ppm on the asker's, for 5.5 hours
        now[0] = k * 1.0001
        assert lease.renew(Ask(k * 1.0, 2.0, "up-1")), k


def test_a_member_that_lost_its_leader_leaves_once_its_supervisor_asks_again():
    """Under Slurm the supervisor runs beside the leader: a member leaving a lost leader first
    hears from it (or, when the supervisor is gone too, its lease runs out and fencing requeues)."""
    lease = Lease(timeout=5)
    lease.renew()
    asks = threading.Timer(0.3, lease.renew)
    asks.start()
    left = time.monotonic()
    _hear_supervisor(lease)
    assert 0.25 < time.monotonic() - left < 3
