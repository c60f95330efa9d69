"""The parameter servers host a workload defined only under tests/ (``tests/support/tiny.py``): no
edit in ps/ or services/. Its tables are placed row-wise and whole, each stepped by its own rule."""
from tests.support.cluster import REPO


def test_a_workload_defined_only_in_the_tests_runs_on_real_servers(procs):
    env = {"RPCPS_WORKLOADS": "tests.support.tiny:SPEC", "PYTHONPATH": str(REPO)}
    servers = [procs.start("ps", f"ps{k}", 2, env=env, workload="tiny", rows=50) for k in range(2)]
    for server in servers:
        procs.wait_ready(server)
    with servers[1].client() as c:
        status = c.status()
    assert status["model"] == {"tiny": 1, "rows": 50} and status["tables"] == {"big": 25, "flag": 1}, status

    result = procs.run_driver("tiny", "trainer0", 2, steps=3)
    # The one-row table lives whole on one server (the second table: ps1); the big one row by row.
    assert result["rows_per_server"] == {"ps0": {"big": 25, "flag": 0}, "ps1": {"big": 25, "flag": 1}}, result
    # Three steps through the servers equal the same steps in one process, rule by rule.
    assert result["moved"] > 1e-3 and all(d < 1e-6 for d in result["diff"].values()), result
