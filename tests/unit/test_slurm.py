"""``rpcps up --slurm`` without a Slurm cluster: its settings, where it places members (against a
fake ``scontrol`` on PATH) beside the sidecar ports the other placements give, and how ``rpcps
status`` tells whether such a run is over (a fake ``squeue``). The real cluster is
``tests/integration/test_slurm.py``'s."""
from __future__ import annotations

import json
import os
import socket
import stat

import pytest

from supervise import cli
from services.config import ConfigError, load
from supervise.hosts.network import Unavailable
from supervise.placement.local import Local
from services.lease import requeue_orphaned
from supervise.placement.slurm import OnSlurm, job_alive
from supervise.upconfig import UpConfig


def up(*argv: str) -> UpConfig:
    return load(UpConfig, vars(cli.parse(["up", *argv])), {})


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """``scontrol show hostnames``, ``squeue`` and ``sinfo`` as a Slurm controller would answer
    them: ``nodes`` expanded from the allocation's list, a comma list as itself; ``jobs`` (id ->
    state) for squeue, and the job's nodes now (``held``, all of ``nodes`` unless given);
    ``states`` (node -> sinfo's short state, ``mix`` unless given)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    answers = tmp_path / "answers.json"

    def write(nodes=(), jobs=None, held=None, states=None):
        answers.write_text(json.dumps({"nodes": list(nodes), "jobs": jobs or {},
                                       "held": list(nodes if held is None else held), "states": states or {}}))
    write()
    program = f"""#!/usr/bin/env python3
import json, os, sys
a = json.load(open({str(answers)!r}))
with open({str(tmp_path / "calls")!r}, "a") as calls:
    calls.write(os.path.basename(sys.argv[0]) + " " + " ".join(sys.argv[1:]) + "\\n")
if sys.argv[0].endswith("scontrol"):
    listed = sys.argv[-1]
    print("\\n".join(listed.split(",") if "," in listed else a["nodes"]))
elif sys.argv[0].endswith("sinfo"):
    print("\\n".join(f"{{n}} {{a['states'].get(n, 'mix')}}" for n in a["nodes"]))
elif "%N" in sys.argv:
    print(",".join(a["held"]))
else:
    job = sys.argv[sys.argv.index("--jobs") + 1]
    if job not in a["jobs"]:
        sys.exit("slurm_load_jobs error: Invalid job id specified")
    print(a["jobs"][job])
"""
    for tool in ("scontrol", "squeue", "sinfo", "srun", "scancel"):
        path = folder / tool
        path.write_text(program)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")
    return write


def test_slurm_settings_are_checked_before_anything_starts():
    assert up("--slurm").slurm
    with pytest.raises(ConfigError, match="--slurm: --local runs no member on the allocation's nodes"):
        up("--slurm", "--local")
    with pytest.raises(ConfigError, match="--slurm, --emulate-hosts: a run has one placement"):
        up("--slurm", "--emulate-hosts")
    with pytest.raises(ConfigError, match="--master-addr: with --slurm every member's address is its node's"):
        up("--slurm", "--master-addr", "10.0.0.1")


def test_outside_an_allocation_it_says_where_it_runs(fake_slurm):
    with pytest.raises(Unavailable, match="inside a Slurm allocation .*SLURM_JOB_ID"):
        OnSlurm(environ={}).create(["ps0", "ctr0"])


def test_members_go_servers_first_one_per_node_from_the_batch_node(fake_slurm):
    fake_slurm(nodes=["n1", "n2", "n3", "n4"])
    place = OnSlurm(environ={"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-4]", "SLURMD_NODENAME": "n1"})
    place.create(["ps0", "ps1", "ctr0", "ctr1"])
    assert place.nodes == {"ps0": "n1", "ps1": "n2", "ctr0": "n3", "ctr1": "n4"}
    assert [place.sidecar_port(n) for n in place.nodes] == [8080] * 4
    assert place.master_addr("ps0") == "n1" and place.reach("ctr1") == "n4" and place.sidecar_host("ctr1") == "0.0.0.0"
    assert place.describe()["ctr0"] == {"node": "n3", "job": "7"}


def test_more_members_than_nodes_share_them_on_ports_of_their_own(fake_slurm):
    # The batch node (where the leader's store port is chosen) comes first, whatever Slurm's order.
    fake_slurm(nodes=["a", "b"])
    place = OnSlurm(sidecar_port=9000, environ={"SLURM_JOB_ID": "8", "SLURM_JOB_NODELIST": "a,b",
                                                "SLURMD_NODENAME": "b"})
    place.create(["ps0", "ps1", "ctr0", "ctr1", "ctr2"])
    assert place.nodes == {"ps0": "b", "ps1": "a", "ctr0": "b", "ctr1": "a", "ctr2": "b"}
    assert place.ports == {"ps0": 9000, "ps1": 9000, "ctr0": 9001, "ctr1": 9001, "ctr2": 9002}


def test_a_server_added_after_one_was_removed_takes_the_first_port_free_on_its_node(fake_slurm):
    fake_slurm(nodes=["a", "b"])
    place = OnSlurm(sidecar_port=9000, environ={"SLURM_JOB_ID": "8", "SLURM_JOB_NODELIST": "a,b",
                                                "SLURMD_NODENAME": "a"})
    place.create(["ps0", "ps1", "ctr0", "ctr1"])
    place.add("ps2")                                              # the third on a: 9002
    assert (place.reach("ps2"), place.sidecar_port("ps2")) == ("a", 9002)
    place.remove("ctr0")                                          # a's 9001 is free now, below ps2's
    place.add("ps3")                                              # the fifth member: on a again
    assert (place.reach("ps3"), place.sidecar_port("ps3")) == ("a", 9001)
    place.remove("ps2")
    place.add("ps2")
    assert (place.reach("ps2"), place.sidecar_port("ps2")) == ("a", 9002)
    assert len({(place.reach(n), place.sidecar_port(n)) for n in place.nodes}) == len(place.nodes)


def test_a_fenced_member_starts_again_on_the_least_busy_other_node_and_the_leader_stays(fake_slurm):
    fake_slurm(nodes=["n1", "n2", "n3", "n4"])
    place = OnSlurm(environ={"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-4]", "SLURMD_NODENAME": "n1"})
    place.create(["ps0", "ps1", "ctr0", "ctr1", "ctr2"])          # ctr2 shares n1 with ps0, on 8081
    assert place.renew("ctr1") and place.reach("ctr1") == "n2" and place.sidecar_port("ctr1") == 8081
    assert place.renew("ctr1") and place.reach("ctr1") == "n3" and place.sidecar_port("ctr1") == 8081
    assert not place.renew("ps0") and place.reach("ps0") == "n1", "the leader's store port is the batch node's"


def test_a_member_whose_node_left_the_allocation_starts_elsewhere_and_fencing_skips_such_nodes(fake_slurm):
    fake_slurm(nodes=["n1", "n2", "n3", "n4"])
    place = OnSlurm(environ={"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-4]", "SLURMD_NODENAME": "n1"})
    place.create(["ps0", "ps1", "ctr0", "ctr1"])
    assert place.gone("ctr1") is None
    # Slurm set n4 DOWN and the job (--no-kill) lost it: ctr1 cannot start there again.
    fake_slurm(nodes=["n1", "n2", "n3", "n4"], held=["n1", "n2", "n3"], states={"n4": "down*"})
    assert "its node n4 is no longer in Slurm job 7's allocation" in place.gone("ctr1")
    assert place.renew("ctr1") and place.reach("ctr1") == "n1" and place.sidecar_port("ctr1") == 8081
    assert place.gone("ctr1") is None
    # n3 still the job's but not responding: no start goes there; ctr0 goes to the least busy of
    # the nodes left.
    fake_slurm(nodes=["n1", "n2", "n3", "n4"], held=["n1", "n2", "n3"], states={"n3": "mix*"})
    assert place.gone("ctr0") is not None
    assert place.renew("ctr0") and place.reach("ctr0") == "n2"
    fake_slurm(nodes=["n1", "n2", "n3", "n4"], held=["n2", "n3", "n4"], states={"n1": "down"})
    assert place.gone("ps0") is None, "the leader stays on the batch node, where rpcps up runs"


def test_a_member_fencing_itself_requeues_the_job_only_when_its_leaders_store_is_out_of_reach(fake_slurm, tmp_path):
    with socket.socket() as store:
        store.bind(("127.0.0.1", 0))
        store.listen()
        assert requeue_orphaned("7", store.getsockname()) is None, "the batch node is there"
        port = store.getsockname()[1]
    assert requeue_orphaned(None, ("127.0.0.1", port)) is None, "not a member of a Slurm job"
    assert not (tmp_path / "calls").exists()
    said = requeue_orphaned("7", ("127.0.0.1", port))
    assert said == f"its leader's store at 127.0.0.1:{port} is out of reach: requeued Slurm job 7"
    assert (tmp_path / "calls").read_text() == "scontrol requeue 7\n"


def test_on_this_machine_sidecar_ports_follow_the_first_given_or_are_free():
    given = Local("127.0.0.1", "127.0.0.1", first_port=9100)
    given.create(["ps0", "ps1", "trainer0"])
    assert [given.sidecar_port(n) for n in ("ps0", "ps1", "trainer0")] == [9100, 9101, 9102]
    free = Local("127.0.0.1", "127.0.0.1")
    free.create(["ps0", "ps1"])
    assert all(0 < free.sidecar_port(n) < 65536 for n in ("ps0", "ps1"))


def test_status_asks_slurm_whether_the_run_is_over(fake_slurm, tmp_path):
    """The launcher of an ``--slurm`` run lives on a node: its process id says nothing here."""
    state = tmp_path / ".rpcps"
    state.mkdir()
    (state / "cluster.json").write_text(json.dumps({
        "sidecars": {"ps0": "http://n1:8080"}, "launcher_pid": 2 ** 22 + 1,
        "hosts": {"ps0": {"node": "n1", "job": "9"}}}))
    fake_slurm(jobs={"9": "RUNNING"})
    assert job_alive("9") and cli.cluster_state(state)["sidecars"] == {"ps0": "http://n1:8080"}
    fake_slurm(jobs={"9": "CANCELLED"})
    with pytest.raises(cli.CliError, match="is not running"):
        cli.cluster_state(state)
    fake_slurm(jobs={})          # forgotten by the controller
    assert not job_alive("9")
