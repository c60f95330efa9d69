"""sync mode: M trainers of batch B, each on its slice, train exactly the one-process model on the
whole batch of M*B sequences (dropout off), with the averaged gradient clipped, over several steps."""

import pytest

from tests.support.cluster import SMALL_MODEL

STEPS = 3
# Summing M trainers' gradients rounds differently from one batch's; Adagrad divides each element by
# its own root sum of squares, which magnifies that in elements with tiny gradients (its updates
# are ~lr = 0.05 each, so 5e-5 is 1e-3 of one).
TOLERANCE = {"sgd": 1e-5, "adagrad": 5e-5}


# Every pair of server and trainer counts, each optimizer with each count: 6 of the 12 combinations,
# to keep the suite's time (all 12 passed when this was written; the README gives their figures).
CASES = [(1, 2, "sgd"), (1, 3, "adagrad"), (2, 2, "adagrad"), (2, 3, "sgd"), (3, 2, "sgd"), (3, 3, "adagrad")]


def run_sync_trainers(procs, num_ps: int, trainers: int, **args) -> list[dict]:
    """``trainers`` sync drivers to their end, each on its slice of the batch; what each saw."""
    return procs.finish_drivers([procs.spawn_driver("sync", f"trainer{k}", num_ps, steps=STEPS, clip=0.25,
                                                    trainers=trainers, **args) for k in range(trainers)])


def assert_one_process(results: list[dict], tolerance: float) -> None:
    """The trainers' mean loss at every step is the one-process model's on their whole batch, and
    the parameters after the last step agree within ``tolerance``."""
    lead = results[0]
    for step in range(STEPS):
        mean = sum(r["losses"][step] for r in results) / len(results)
        assert mean == pytest.approx(lead["local_losses"][step], rel=1e-5, abs=1e-5), f"step {step + 1}"
    print("largest differences:", max(lead["param_diff"].values()), lead["param_diff"])
    for name, diff in lead["param_diff"].items():
        assert diff < tolerance, f"{name} differs by {diff} after {STEPS} steps"


@pytest.mark.parametrize("num_ps,trainers,optimizer", CASES)
def test_sync_trainers_match_one_process_on_their_concatenated_batches(procs, num_ps, trainers, optimizer):
    procs.start_servers(num_ps, consistency="sync", **{**SMALL_MODEL, "optimizer": optimizer,
                                                       "lr": 0.5 if optimizer == "sgd" else 0.05})
    results = run_sync_trainers(procs, num_ps, trainers)
    assert {r["consistency"] for r in results} == {"sync"}
    assert_one_process(results, TOLERANCE[optimizer])


def test_allreduce_trainers_match_one_process_and_keep_identical_replicas(procs):
    """--dense allreduce: the LSTM replicated on 2 trainers (DDP over gloo) and the tables on 2
    servers in sync mode train exactly the one-process model on the doubled batch; the replicas
    are bit-identical, and the servers' own LSTM weights are never touched."""
    trainers = 2
    procs.start_servers(2, consistency="sync", **SMALL_MODEL)
    results = run_sync_trainers(procs, 2, trainers, dense="allreduce")
    assert_one_process(results, TOLERANCE["sgd"])
    assert len({r["replica_sha256"] for r in results}) == 1
    assert all(moved == 0.0 for r in results for moved in r["servers_lstm_moved"].values())
