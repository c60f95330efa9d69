"""When rpcps up starts a dead member again, and when it ends the run: the policy alone, over
members whose logs say why they died."""
from pathlib import Path

from supervise.member import Member
from supervise.restarts import SAME_FAILURES, RestartPolicy


def member(tmp_path: Path, *errors: str) -> Member:
    log = tmp_path / "ps1.log"
    log.write_text("".join(f"2026-12-03 10:00:00 ERROR ps.server.role: {e}\n" for e in errors))
    return Member("ps1", "ps", [], "http://127.0.0.1:1", log)


def died(policy: RestartPolicy, m: Member, code: int, error: str) -> "float | None":
    """``m`` dies with ``error`` in its log: the delay the policy gives, with the death recorded
    as the roster records it."""
    m.log_start = m.log_path.stat().st_size
    with open(m.log_path, "a") as f:
        f.write(f"2026-12-03 10:00:01 ERROR ps.server.role: {error}\n")
    verdict = policy.after_death(m, code)
    if verdict.delay is not None:
        m.causes, m.deaths = (*m.causes, verdict.reason), m.deaths + 1
    return verdict.delay


def test_each_death_in_a_row_waits_twice_as_long_up_to_the_ceiling(tmp_path):
    policy, m = RestartPolicy(backoff=1.0, backoff_max=5.0, window=60.0), member(tmp_path)
    delays = [died(policy, m, -9, "") for _ in range(5)]      # killed by a signal: never "the same way"
    assert delays == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert m.causes == ("killed by signal 9",) * 5


def test_a_member_that_fails_the_same_way_each_start_ends_the_run_with_its_error(tmp_path):
    policy, m = RestartPolicy(backoff=1.0, backoff_max=60.0, window=60.0), member(tmp_path)
    for _ in range(SAME_FAILURES - 1):
        assert died(policy, m, 1, "no such file: data.csv") is not None
    verdict = policy.after_death(m, 1)
    assert verdict.delay is None
    assert "failed the same way at each of its last 3 starts: no such file: data.csv" in verdict.ends_run


def test_different_errors_or_a_fenced_member_are_started_again(tmp_path):
    policy, m = RestartPolicy(backoff=1.0, backoff_max=60.0, window=60.0), member(tmp_path)
    for error in ["a", "b", "a", "b", "a"]:
        assert died(policy, m, 1, error) is not None
    fenced = member(tmp_path)
    fenced.fenced = "no answer from its sidecar for 15s"
    for _ in range(SAME_FAILURES + 1):       # its host's silence, not its own fault
        assert died(policy, fenced, 1, "") is not None


def test_max_restarts_spent_ends_the_run(tmp_path):
    policy, m = RestartPolicy(backoff=1.0, backoff_max=60.0, window=60.0, max_restarts=2), member(tmp_path)
    assert [died(policy, m, -15, "") for _ in range(2)] == [1.0, 2.0]
    verdict = policy.after_death(m, -15)
    assert verdict.delay is None and "after 2 restarts in a row (killed by signal 15)" in verdict.ends_run
    assert "--max-restarts" in verdict.ends_run


def test_a_member_up_for_the_window_is_healthy_again(tmp_path):
    policy, m = RestartPolicy(backoff=1.0, backoff_max=60.0, window=60.0), member(tmp_path)
    m.started_at = 100.0
    assert not policy.healthy_again(m, 500.0), "no deaths in a row: nothing to forget"
    died(policy, m, -9, "")
    assert not policy.healthy_again(m, 159.0)
    assert policy.healthy_again(m, 160.0)
    m.healthy()
    assert died(policy, m, -9, "") == 1.0, "its next death waits the first back-off again"
