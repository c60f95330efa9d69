"""The CTR workload's tables sharded over 1, 2 or 3 real servers in sync mode train exactly the
one-process DLRM on the trainers' concatenated batches: every table and MLP parameter, with SGD
and row-wise Adagrad, tables placed row-wise and whole (table-wise), and with each step's lookups
cut into many requests by a small --max-ids-per-request. And gradients pushed for rows a step did
not read from the servers move them as distributed autograd's do; and sync steps whose reads were
issued ahead (--prefetch) train bit for bit as those that read in the step, as do steps that take
hot rows replicated among the trainers (--cache-staleness 0); a cached row serves up to its bound,
and a trainer killed with a full cache, its step's gradients of the copies pushed, leaves nothing
of that step applied."""

import json
import signal

import pytest
import torch

from tests.support.cluster import Processes
from tests.support.wait import wait_until

STEPS = 3
TRAINERS = 2
# A small DLRM: 1/2000 of Criteo's rows (16,905 in 26 tables, the smallest of 2 rows), dimension 4.
MODEL = {"workload": "ctr", "scale": 0.0005, "dim": 4, "bottom": "8", "top": "8", "lr": 0.1, "consistency": "sync"}
# Two trainers' gradients summed round differently from one batch's; row-wise Adagrad divides by
# each row's root mean square, which magnifies that for rows with tiny gradients.
TOLERANCE = {"sgd": 1e-6, "rowwise_adagrad": 1e-5}

# --max-ids-per-request, so small that every step's lookups are cut into requests; and where the
# trainers' backward runs (their own autograd, each server's gradients sent with the hand-over).
CASES = [(1, "rowwise_adagrad", "auto", None, "distributed"), (2, "sgd", "auto", 50, "local"),
         (2, "rowwise_adagrad", "table_wise", None, "distributed"), (3, "rowwise_adagrad", "auto", None, "local")]


@pytest.mark.parametrize("num_ps,table_rule,placement,cap,backward", CASES)
def test_sharded_ctr_equals_one_process(procs, num_ps, table_rule, placement, cap, backward):
    servers = procs.start_servers(num_ps, **MODEL, table_rule=table_rule, placement=placement,
                                  max_ids_per_request=cap)
    results = procs.finish_drivers([procs.spawn_driver("ctr", f"ctr{k}", num_ps, steps=STEPS, trainers=TRAINERS,
                                                       backward=backward) for k in range(TRAINERS)])
    lead = results[0]
    assert {r["consistency"] for r in results} == {"sync"}
    # auto: tables row by row, but those smaller than the server count (2 rows, of 3 servers) whole.
    expected = {"WholePlan"} if placement == "table_wise" else {"ShardPlan", "WholePlan"} if num_ps == 3 \
        else {"ShardPlan"}
    assert set(lead["placements"].values()) == expected, lead["placements"]
    for step in range(STEPS):
        mean = sum(r["losses"][step] for r in results) / TRAINERS
        assert mean == pytest.approx(lead["local_losses"][step], rel=1e-5), f"step {step + 1}"
    largest = max(lead["param_diff"].values())
    print(f"{num_ps} servers, {table_rule}, {placement}, {backward} backward: largest difference {largest:.3g} "
          f"(tables moved up to {lead['tables_moved']:.3g})")
    assert lead["tables_moved"] > 1e-3, "the steps changed the tables"
    if cap is not None:
        # A local backward's reads are stamped with the server's updates (read_rows).
        method = 'method="read_rows"' if backward == "local" else 'method="lookup_many"'
        with servers[0].client() as c:
            asked = next(line for line in c.metrics().splitlines()
                         if line.startswith("rpcps_ps_requests_total") and method in line)
        assert float(asked.split()[-1]) > 2 * STEPS * TRAINERS, f"lookups cut into several requests: {asked}"
    for name, diff in lead["param_diff"].items():
        assert diff < TOLERANCE[table_rule], f"{name} differs by {diff} after {STEPS} steps"


def _trained(procs, steps=STEPS, **driver):
    """Both trainers' results after ``steps`` sync steps of two servers (trainer0's first)."""
    procs.start_servers(2, **MODEL, table_rule="rowwise_adagrad")
    return procs.finish_drivers([procs.spawn_driver("ctr", f"ctr{k}", 2, steps=steps, trainers=TRAINERS, **driver)
                                 for k in range(TRAINERS)])


def test_hot_rows_replicated_among_the_trainers_train_bit_for_bit_as_rows_read_from_the_servers(procs, tmp_path):
    """--cache-staleness 0: the hot rows chosen every 2 steps, held and stepped by both trainers
    (whose dense weights are replicated too), read ahead as well; then given back to the servers."""
    plain = _trained(procs, steps=7, dense="allreduce")
    procs.stop_all()
    (tmp_path / "hot").mkdir()
    again = Processes(tmp_path / "hot")
    try:
        hot = _trained(again, steps=7, dense="allreduce", hot_rows=30, prefetch=1)
    finally:
        again.stop_all()
    assert [r["hits"][:2] for r in hot] == [[0, 0]] * TRAINERS, "nothing hot before the first choice"
    assert all(sum(r["hits"][2:]) > 0 for r in hot), [r["hits"] for r in hot]
    for p, h in zip(plain, hot):
        assert p["losses"] == h["losses"], (p["losses"], h["losses"])
    assert plain[0]["tables_moved"] > 1e-3, "the steps changed the tables"
    assert plain[0]["digest"] == hot[0]["digest"], "every row and weight on the servers, bit for bit"


def test_sync_steps_read_ahead_train_bit_for_bit_as_steps_that_read_in_the_step(procs, tmp_path):
    plain = _trained(procs)
    procs.stop_all()
    (tmp_path / "prefetched").mkdir()
    again = Processes(tmp_path / "prefetched")
    try:
        ahead = _trained(again, prefetch=1)
    finally:
        again.stop_all()
    assert all(h is None for r in plain for h in r["hidden"])
    assert all(h is not None for r in ahead for h in r["hidden"]), "each step's reads went out before it"
    for p, a in zip(plain, ahead):
        assert p["losses"] == a["losses"], (p["losses"], a["losses"])
    assert plain[0]["tables_moved"] > 1e-3, "the steps changed the tables"
    assert plain[0]["digest"] == ahead[0]["digest"], "every row and weight on the servers, bit for bit"


def test_a_cached_row_serves_up_to_its_bound_while_another_write_moves_it_and_never_after(procs):
    servers = procs.start_servers(2, **{**MODEL, "consistency": "async"}, table_rule="sgd")
    # Steps: 1 reads X (copies kept), 2 writes X unseen, 3 and 4 read X, 5 reads it again.
    bounded = procs.run_driver("cached", "ctr0", 2, staleness=2, steps=3)
    first, third, fourth, fifth = bounded["steps"]
    assert first["used"] == first["servers_before"], "nothing cached yet: read from the servers"
    assert third["used"] == first["used"] and third["servers_before"] != first["used"], \
        "2 steps old, within the bound: the copy, though two writes moved the servers' rows"
    assert fourth["used"] == fourth["servers_before"] != first["used"], "3 steps old: read again"
    assert fifth["used"] == fourth["used"], "the copy read in step 4, 1 step old"
    # Misses: X in steps 1 and 4, and the row of C4 the writing step read.
    assert bounded["oldest"] == 2 and bounded["hits"] == 2 * 3 and bounded["misses"] == 2 * 3 + 1, bounded
    for step in (third, fifth):    # a copy's gradient still reached the servers: SGD moved them by 0.1 w
        moved = torch.tensor(step["servers_after"]) - torch.tensor(step["servers_before"])
        assert torch.allclose(moved, -0.1 * torch.linspace(-1, 1, 12).reshape(3, 4), atol=1e-6), moved

    # A trainer killed with a full cache, its step's gradients of the copies on the servers before
    # its update: they are dropped with the step, the rows as they were.
    dying = procs.spawn_driver("dies_cached", "ctr2", 2)
    line = dying.stdout.readline()
    assert line, dying.communicate(timeout=30)[1][-3000:]
    pushed = json.loads(line)
    assert pushed["hits"] == 3 and pushed["rows"] == 3, pushed
    dying.send_signal(signal.SIGKILL)
    dying.wait(timeout=30)
    wait_until(lambda: any("autograd context(s) left by ctr2" in s.log_text() for s in servers), 60,
               "the servers released the dead trainer's step")
    exact = procs.run_driver("cached", "ctr1", 2, staleness=0, steps=3)
    assert exact["steps"][0]["servers_before"] == pushed["servers_before"], "nothing of the killed step applied"
    assert all(s["used"] == s["servers_before"] for s in exact["steps"]), "staleness 0: what no cache reads"
    assert exact["hits"] == 0 and exact["misses"] == 4 * 3 + 1, exact


@pytest.mark.parametrize("consistency", ["async", "sync"])
def test_pushed_gradients_move_rows_as_those_back_through_autograd(procs, consistency):
    # The explicit push (a step's gradients of rows it did not read from the servers: a trainer's
    # cached copy) joins the step's update as distributed autograd's gradients do.
    procs.start_servers(2, **{**MODEL, "consistency": consistency}, table_rule="sgd")
    result = procs.run_driver("pushed", "ctr0", 2)
    autograd, pushed = torch.tensor(result["autograd"]), torch.tensor(result["pushed"])
    assert autograd.abs().max() > 1e-3, "the first step moved the rows"
    assert torch.allclose(pushed, autograd, atol=1e-6), (pushed - autograd).abs().max()
    assert torch.equal(autograd[1], autograd[2]), "a repeated id is one row"
    assert [r.split(":")[0] for r in result["refused"]] == ["BadRequest", "BadRequest"], result["refused"]
    assert "must be a tensor [2, 4]" in result["refused"][0], result["refused"]


def test_one_hybrid_trainer_trains_the_one_process_dlrm(procs):
    """hybrid: the rows are the trainer's own update (as in async), the MLPs a replica all-reduced
    over a group of one; with one trainer that is the one-process model, table and MLP alike."""
    servers = procs.start_servers(2, **{**MODEL, "consistency": "hybrid"}, table_rule="rowwise_adagrad")
    lead = procs.run_driver("ctr", "ctr0", 2, steps=STEPS, trainers=1, dense="allreduce", backward="local")
    assert lead["consistency"] == "hybrid"
    assert lead["losses"] == pytest.approx(lead["local_losses"], rel=1e-5)
    assert lead["tables_moved"] > 1e-3, "the steps changed the tables"
    for name, diff in lead["param_diff"].items():
        assert diff < TOLERANCE["rowwise_adagrad"], f"{name} differs by {diff} after {STEPS} steps"
    # Its backward ran here, with no context: each update's staleness counted from the read's
    # stamp, on every server, and none, as nothing came between a read and its own update.
    for server in servers:
        with server.client() as c:
            staleness = {line.split("{")[0].rsplit("_", 1)[-1]: float(line.split()[-1])
                         for line in c.metrics().splitlines()
                         if line.startswith(("rpcps_ps_update_staleness_steps_count",
                                             "rpcps_ps_update_staleness_steps_sum"))}
        assert staleness == {"count": STEPS, "sum": 0.0}, (server.name, staleness)
