"""A checkpoint folder per server (a Kubernetes StatefulSet's volume per shard): each server keeps its
shard under a manifest of its own, ps0's manifest commits the step, and every server restores the
checkpoint ps0 chose, never a newer part of its own that the cluster did not commit."""
import json
import shutil

from services.checkpoint.store import CheckpointStore
from tests.integration.test_roles import MODEL, TRAINER, episode
from tests.support.wait import wait_until


def start_cluster(procs, dirs, **ps_flags):
    servers = [procs.start("ps", f"ps{i}", 2, checkpoint_dir=dirs[i], **MODEL, **ps_flags) for i in (1, 0)]
    trainer = procs.start("trainer", "trainer0", 2, start=True, **TRAINER)
    for role in (*servers, trainer):
        procs.wait_ready(role)
    return servers[1], servers[0], trainer


def status(role) -> dict:
    with role.client(timeout=5.0) as c:
        return c.status()


def test_a_checkpoint_folder_per_server(procs, tmp_path):
    dirs = [tmp_path / "volume-ps0", tmp_path / "volume-ps1"]
    ps0, ps1, trainer = start_cluster(procs, dirs)
    wait_until(lambda: episode(trainer)[1].get("step", 0) >= 3, 60, "training")
    with ps1.client(timeout=60) as c:
        taken = c.checkpoint()
    assert sorted(taken["files"]) == ["ps0.pt", "trainer0.pt"]
    cluster = json.loads((dirs[0] / taken["id"] / "manifest.json").read_text())
    part = json.loads((dirs[1] / taken["id"] / "manifest.json").read_text())
    assert set(part["files"]) == {"ps1.pt"} and part["meta"]["server"] == "ps1"
    elsewhere = cluster["meta"]["elsewhere"]["ps1.pt"]
    assert elsewhere["server"] == "ps1" and elsewhere["sha256"] == part["files"]["ps1.pt"]["sha256"]
    assert not (dirs[0] / taken["id"] / "ps1.pt").exists() and not list(dirs[0].glob("*/.taking-*"))
    CheckpointStore(dirs[1]).verify(CheckpointStore(dirs[1]).resolve(taken["id"]))

    # A stop leaves a final checkpoint in both volumes; then ps0 loses its newest (as if it died
    # before committing it). ps1 holds a newer part of its own, but must restore what ps0 restores.
    wait_until(lambda: status(ps0).get("steps", 0) > taken["step"], 30, "more steps")
    procs.stop_all()
    final = CheckpointStore(dirs[0]).latest_valid()
    assert final.step > taken["step"] and CheckpointStore(dirs[1]).latest_valid().step == final.step
    shutil.rmtree(final.path)
    ps0, ps1, trainer = start_cluster(procs, dirs)
    assert status(ps0)["resumed_from"]["id"] == taken["id"]
    assert status(ps1)["resumed_from"]["id"] == taken["id"]
    assert f"ps0 stands on {taken['id']}" in ps1.log_text()

    # Checkpoints past the orphaned part's step (one of them may fall on it: it is replaced, not
    # an error) leave both volumes at the same newest step again.
    wait_until(lambda: status(ps0).get("steps", 0) > final.step, 60, "training past the orphaned part")
    procs.stop_all()
    newest = CheckpointStore(dirs[0]).latest_valid()
    assert newest.step > final.step and CheckpointStore(dirs[1]).latest_valid().step == newest.step

    # A server whose folder lacks the cluster's checkpoint (a lost volume) refuses to start, naming
    # it, and ps0 goes on serving.
    ps0 = procs.start("ps", "ps0", 2, checkpoint_dir=dirs[0], **MODEL)
    lost = procs.start("ps", "ps1", 2, checkpoint_dir=tmp_path / "empty-volume", **MODEL)
    assert lost.proc.wait(60) != 0
    assert f"ps0 resumed the cluster from {newest.id}" in lost.log_text() and "cannot restore" in lost.log_text()
    assert ps0.proc.poll() is None and status(ps0)["resumed_from"]["id"] == newest.id
