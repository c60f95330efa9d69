"""Which placement ``rpcps up`` runs its members with: one setting (``--run-on``), its shorthands
(``--slurm``, ``--emulate-hosts``) agreeing with it, and one registry that both chooses the
placement and finds a recorded member's handle again (``cluster.json``, read by ``rpcps chaos``)."""
from __future__ import annotations

import subprocess

import pytest

from supervise import cli
from services.config import ConfigError, load
from supervise.placement import PLACEMENTS, NotPossible, found, placement_class, placement_for
from supervise.placement.hosts import OnHost, OnHosts
from supervise.placement.local import Local, LocalProcess
from supervise.placement.slurm import OnSlurm, SlurmStep
from supervise.upconfig import UpConfig


def up(*argv: str, environ=None) -> UpConfig:
    return load(UpConfig, vars(cli.parse(["up", *argv])), environ or {})


def test_run_on_and_its_shorthands_name_one_placement():
    assert up().run_on == "local"
    assert (up("--slurm").run_on, up("--emulate-hosts").run_on) == ("slurm", "hosts")
    by_name = up("--run-on", "hosts")
    assert by_name.emulate_hosts and not by_name.slurm, "the shorthand follows --run-on"
    assert up(environ={"RPCPS_RUN_ON": "slurm"}).slurm
    assert up("--run-on", "hosts", "--host-cpus", "0.5").host_cpus == 0.5
    with pytest.raises(ConfigError, match="--run-on local: --slurm means --run-on slurm"):
        up("--run-on", "local", "--slurm")
    with pytest.raises(ConfigError, match="--slurm, --emulate-hosts: a run has one placement"):
        up("--slurm", "--emulate-hosts")
    with pytest.raises(ConfigError, match="--run-on: one of local, hosts, slurm, got 'kubernetes'"):
        up("--run-on", "kubernetes")
    # A setting of one placement is refused with another, whichever flag chose it.
    with pytest.raises(ConfigError, match="--host-cpus: only with --emulate-hosts"):
        up("--run-on", "slurm", "--host-cpus", "0.5")
    with pytest.raises(ConfigError, match="--master-addr: with --slurm every member's address is its node's"):
        up("--run-on", "slurm", "--master-addr", "10.0.0.1")


def test_the_registry_chooses_the_placement_of_the_settings():
    assert set(PLACEMENTS) == {"local", "hosts", "slurm"}
    local = placement_for(up("--sidecar-port", "9100"))
    assert isinstance(local, Local)
    assert isinstance(placement_for(up("--run-on", "hosts", "--host-cpus", "0.5", "--link-rate", "1gbit")), OnHosts)
    assert isinstance(placement_for(up("--slurm")), OnSlurm)
    hosts = placement_for(up("--emulate-hosts", "--host-cpus", "0.5", "--link-rate", "1gbit"))
    assert (hosts.cpus, hosts.rate) == (0.5, "1gbit")
    with pytest.raises(NotPossible, match="no placement is named 'k8s'; one of local, hosts, slurm"):
        placement_class("k8s")


def test_a_recorded_handle_is_found_again_by_its_kind():
    records = [LocalProcess(41).describe(), OnHost(42, "rpcps-h-ps0", "ps0").describe(),
               SlurmStep(43, "17", "rpcps-ps0", "node1").describe()]
    handles = [found(r) for r in records]
    assert [type(h) for h in handles] == [LocalProcess, OnHost, SlurmStep]
    assert [h.describe() for h in handles] == records
    assert [placement_class(r["kind"]).handle for r in records] == [LocalProcess, OnHost, SlurmStep]
    assert isinstance(found({"pid": 44}), LocalProcess), "a record of an older rpcps up, without a kind"
    with pytest.raises(NotPossible, match="cluster.json names a placement this rpcps does not know: 'k8s'"):
        found({"kind": "k8s", "pid": 45})


def test_rpcps_up_help_lists_the_placements():
    shown = subprocess.run(["python", "-m", "supervise.cli", "up", "--help"], capture_output=True, text=True,
                           timeout=60)
    said = " ".join(shown.stdout.split())
    assert "--run-on RUN_ON where the members run, the placement: local, hosts, slurm" in said, said[-2000:]


def test_whether_a_recorded_run_is_over_is_asked_of_its_placement(tmp_path, monkeypatch):
    import os
    mine, gone = os.getpid(), 999_999_999
    assert placement_class("local").run_ended({"launcher_pid": mine}) is False
    assert placement_class("hosts").run_ended({"launcher_pid": gone}) is True
    assert placement_class("local").run_ended({"pids": {"ps0": gone}}) is True, "an older record: its members"
    # Slurm's: rpcps up ran on the batch node, so its job's state says (a fake squeue here).
    squeue = tmp_path / "squeue"
    squeue.write_text("#!/bin/sh\ncase \"$*\" in *' 7 '*) echo RUNNING;; *) echo COMPLETED;; esac\n")
    squeue.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert placement_class("slurm").run_ended({"launcher_pid": gone, "hosts": {"ps0": {"job": "7"}}}) is False
    assert placement_class("slurm").run_ended({"launcher_pid": mine, "hosts": {"ps0": {"job": "8"}}}) is True
