"""A model written once with the public API (``rpcps.EmbeddingBags`` in a plain module) trains the
same on 1, 2 and 3 real servers in sync mode as in one process on the trainers' concatenated
batches: multi-hot bags summed and averaged, two features sharing a table, a hashed table and a
plain one, tables stepped by row-wise Adagrad and by SGD, dense layers by Adagrad."""
import pytest

from tests.support.cluster import REPO

STEPS, TRAINERS = 3, 2
ENV = {"RPCPS_WORKLOADS": "tests.support.bagged:SPEC", "PYTHONPATH": str(REPO)}
# Two trainers' gradients summed round differently from one batch's; row-wise Adagrad divides by
# each row's root mean square, which magnifies that for rows with tiny gradients.
TOLERANCE = 1e-5


@pytest.mark.parametrize("num_ps", [1, 2, 3])
def test_the_same_module_on_servers_equals_one_process(procs, num_ps, monkeypatch):
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    servers = [procs.start("ps", f"ps{k}", num_ps, env=ENV, workload="bagged", consistency="sync")
               for k in range(num_ps)]
    for server in servers:
        procs.wait_ready(server)
    results = procs.finish_drivers([procs.spawn_driver("bagged", f"trainer{k}", num_ps, steps=STEPS, trainers=TRAINERS)
                                    for k in range(TRAINERS)])
    lead = results[0]
    for step in range(STEPS):
        mean = sum(r["losses"][step] for r in results) / TRAINERS
        assert mean == pytest.approx(lead["local_losses"][step], rel=1e-5), f"step {step + 1}"
    assert lead["tables_moved"] > 1e-3, "the steps changed the tables"
    largest = max(lead["param_diff"].values())
    print(f"{num_ps} servers: largest difference {largest:.3g} (tables moved up to {lead['tables_moved']:.3g}); "
          f"placements {lead['placements']}")
    for name, diff in lead["param_diff"].items():
        assert diff < TOLERANCE, f"{name} differs by {diff} after {STEPS} steps"
