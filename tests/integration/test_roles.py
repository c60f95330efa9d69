"""Each role run alone, as containers and other hosts run them: start order, episodes over HTTP,
metrics accepted by promtool, the control token, SIGTERM with a dead peer, and a member whose
lease runs out."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest

from services.client import SidecarError
from services.lease import FENCED, LEASE_HEADER
from tests.support.cluster import REPO, SMALL_MODEL
from tests.support.wait import wait_until

MODEL = {**SMALL_MODEL, "ntoken": 1000}  # the built-in corpus has 1000 word types
TRAINER = {"batch_size": 4, "bptt": 5, "num_trainers": 1, "synthetic_tokens": 5000, "log_interval": 1}


def episode(role):
    with role.client(timeout=2.0) as c:
        s = c.status()
    return s.get("state"), s.get("episode") or {}


def test_trainer_started_first_waits_then_trains_episodes_on_request(procs):
    # The trainer comes up before any server: it waits for ps0's store, then for both servers.
    trainer = procs.start("trainer", "trainer0", 2, **TRAINER)
    wait_until(lambda: episode(trainer)[0] == "joining", 60, "trainer joining")
    with trainer.client() as c:
        with pytest.raises(SidecarError) as e:
            c.start_episode(steps=3)
        assert e.value.status == 503
    procs.start_servers(2, **MODEL)
    procs.wait_ready(trainer)
    assert episode(trainer)[0] == "idle"

    with trainer.client() as c:
        c.start_episode(steps=5)
        with pytest.raises(SidecarError) as e:
            c.start_episode(steps=5)
        assert e.value.status == 409
    wait_until(lambda: episode(trainer)[1].get("done") and episode(trainer)[0] == "idle", 60, "episode of 5 done")
    assert episode(trainer)[1]["step"] == 5

    with trainer.client() as c:
        c.start_episode()                      # unbounded
        wait_until(lambda: episode(trainer)[1].get("step", 0) >= 3, 60, "unbounded episode under way")
        c.stop_episode()
    state, ep = wait_until(lambda: episode(trainer)[0] == "idle" and episode(trainer), 60, "stopped at a step boundary")
    assert ep["steps"] is None and ep["done"] and ep["step"] >= 3
    with trainer.client() as c:
        with pytest.raises(SidecarError) as e:
            c.stop_episode()
        assert e.value.status == 409
        assert c.status()["eval"]["tokens"] > 0          # the synthetic corpus has a held-out split


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
def test_every_role_metrics_pass_promtool(procs):
    servers = procs.start_servers(2, **MODEL)
    trainer = procs.start("trainer", "trainer0", 2, start=True, steps=3, **TRAINER)
    procs.wait_ready(trainer)
    wait_until(lambda: episode(trainer)[1].get("done"), 60, "episode done")
    for role in [*servers, trainer]:
        with role.client() as c:
            text = c.metrics()
        check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert check.returncode == 0, f"{role.name}: {check.stdout}{check.stderr}"
        assert f'name="{role.name}"' in text
    with trainer.client() as c:
        text = c.metrics()
    assert 'rpcps_trainer_steps_total{name="trainer0",role="trainer"} 3.0' in text
    with servers[0].client() as c:
        text = c.metrics()
    assert "rpcps_ps_rows_looked_up_total" in text and 'method="decode"' in text


def test_control_token_required_when_set(procs):
    servers = procs.start_servers(1, **MODEL)
    trainer = procs.start("trainer", "trainer0", 1, env={"RPCPS_CONTROL_TOKEN": "t0ken"}, **TRAINER)
    procs.wait_ready(trainer)
    with trainer.client() as c:
        with pytest.raises(SidecarError) as e:
            c.start_episode(steps=2)
        assert e.value.status == 401
        assert c.status()["state"] == "idle"             # GETs stay open
    with trainer.client(token="t0ken") as c:
        assert c.start_episode(steps=2)["started"]
    del servers


def training_cluster(procs, **trainer_flags):
    """Two servers and one trainer that has taken a few steps."""
    ps0, ps1 = procs.start_servers(2, **MODEL)
    trainer = procs.start("trainer", "trainer0", 2, start=True, **TRAINER, **trainer_flags)
    procs.wait_ready(trainer)
    wait_until(lambda: episode(trainer)[1].get("step", 0) >= 2, 60, "training")
    return ps0, ps1, trainer


def test_servers_stop_cleanly_on_sigterm_right_after_a_trainer_died(procs):
    ps0, ps1, trainer = training_cluster(procs)
    trainer.proc.send_signal(signal.SIGKILL)
    trainer.proc.wait(10)
    for role in (ps1, ps0):  # before the leader has even evicted the dead trainer
        t0 = time.monotonic()
        role.proc.send_signal(signal.SIGTERM)
        code = role.proc.wait(15)
        assert time.monotonic() - t0 < 10, role.name
        assert code == 0, role.log_text()[-2000:]


def test_a_trainer_waits_for_a_lost_server_as_long_as_it_may(procs):
    # Nobody restarts ps1 here: the trainer says it waits, then gives up after --server-wait.
    ps0, ps1, trainer = training_cluster(procs, server_wait=6)
    ps1.proc.send_signal(signal.SIGKILL)
    wait_until(lambda: trainer.client(timeout=2.0).status().get("waiting_for") == ["ps1"], 15, "waiting for ps1")
    code = trainer.proc.wait(30)
    log = trainer.log_text()
    assert code == 1 and "PeerUnavailable: ps1 did not come back within 6s (--server-wait)" in log, log[-2000:]
    assert "Traceback" not in log, log[-3000:]
    t0 = time.monotonic()
    ps0.proc.send_signal(signal.SIGTERM)
    assert ps0.proc.wait(15) == 0 and time.monotonic() - t0 < 10


def test_a_member_whose_lease_runs_out_fences_itself(procs):
    # Started as rpcps up starts it, with a lease (3 s here): each ask of /healthz with the lease
    # header renews it; asks without it (anyone's curl) do not. Once no renewal comes, the member
    # stops serving by itself, with its own exit code, before its supervisor would replace it.
    ps0 = procs.start("ps", "ps0", 1, env={"RPCPS_LEASE_TIMEOUT": "3"}, **MODEL)
    procs.wait_ready(ps0)
    renewals_until = time.monotonic() + 6
    while time.monotonic() < renewals_until:     # renewed for twice the lease: it stays
        asked = time.monotonic()
        assert httpx.get(f"{ps0.url}/healthz", headers={LEASE_HEADER: "3"}, timeout=2).status_code == 200
        last_renewal = asked
        assert ps0.proc.poll() is None, ps0.log_text()[-2000:]
        time.sleep(0.5)  # noqa: sleep-ok (the supervisor's pace of asking, not a synchronisation)
    shown = httpx.get(f"{ps0.url}/healthz", timeout=2).json()["lease"]       # asked without the header
    assert shown["timeout"] == 3 and 0 <= shown["renewed_ago"] < 3, shown
    wait_until(lambda: ps0.proc.poll() is not None or
               httpx.get(f"{ps0.url}/healthz", timeout=2).status_code != 200, 15, "ps0 to fence itself")
    assert ps0.proc.wait(10) == FENCED and time.monotonic() - last_renewal >= 3, ps0.log_text()[-2000:]
    assert "ps0 fenced itself: its supervisor has not renewed its lease for 3s" in ps0.log_text()


def test_bad_flag_or_variable_is_refused_at_start(tmp_path):
    for argv, env, needle in ([["ps", "--num-ps", "0"], {}, "flag --num-ps"],
                              [["trainer", "--name", "trainer-1"], {}, "flag --name"],
                              [["trainer"], {"RPCPS_BATCH_SIZE": "big"}, "RPCPS_BATCH_SIZE"],
                              [["up", "--steps", "-3"], {}, "flag --steps"]):
        r = subprocess.run([sys.executable, "-m", "supervise.cli", *argv], capture_output=True, text=True,
                           env={**os.environ, **env}, cwd=tmp_path, timeout=60)
        assert r.returncode == 2, (argv, r.stderr)
        assert needle in r.stderr and "invalid configuration" in r.stderr, r.stderr


def _bad_corpora(root):
    """Each way a --data folder can be wrong, and what the refusal must say of it."""
    (root / "a-file.txt").write_text("hello\n")
    cases = {"missing": (root / "missing", "does not exist"),
             "a file": (root / "a-file.txt", "is a file, not a folder"),
             "no splits": (root / "no-splits", "no train/valid/test text"),
             "binary": (root / "binary", "is binary, not text"),
             "not UTF-8": (root / "latin1", "is not UTF-8 text (byte 0xe9 at offset 3)"),
             "empty": (root / "empty", "is empty"),
             "too small": (root / "small", "too few for 2 trainer(s) of batch size 20")}
    (root / "no-splits").mkdir()
    contents = {"binary": b"\x00\x01\x02 not text", "latin1": "caf\xe9 au lait\n".encode("latin-1"),
                "empty": b"  \n", "small": b"a b c\n"}
    for folder, data in contents.items():
        (root / folder).mkdir()
        for split in ("train.txt", "valid.txt", "test.txt"):
            (root / folder / split).write_bytes(data)
    return cases


def test_bad_data_and_checkpoint_folders_are_a_sentence_not_a_traceback(tmp_path):
    cases = _bad_corpora(tmp_path)
    runs = [(["up", "--data"], case) for case in cases.values()]
    runs += [(["trainer", "--name", "trainer0", "--data"], cases["not UTF-8"]),
             (["ps", "--name", "ps0", "--data"], cases["a file"]),
             (["up", "--checkpoint-dir"], (tmp_path / "a-file.txt" / "ckpt", "a-file.txt is a file")),
             (["trainer", "--name", "trainer0", "--checkpoint-dir"], (tmp_path / "a-file.txt", "is a file"))]
    for argv, (path, says) in runs:
        r = subprocess.run([sys.executable, "-m", "supervise.cli", *argv, str(path)], capture_output=True, text=True,
                           cwd=tmp_path, timeout=60)
        assert r.returncode == 2, (argv, path, r.stderr)
        assert says in r.stderr and str(path) in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_up_reports_a_role_refusing_its_settings_with_the_roles_words(tmp_path):
    r = subprocess.run([sys.executable, "-m", "supervise.cli", "up", "--json", "--steps", "1",
                        "--state-dir", str(tmp_path / "state"), "--checkpoint-dir", str(tmp_path / "ckpt")],
                       capture_output=True, text=True, cwd=REPO, timeout=120,
                       env={**os.environ, "RPCPS_MAX_IDS_PER_REQUEST": "0"})
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [json.loads(line) for line in r.stdout.splitlines() if '"error"' in line]
    assert errors and "refused to start" in errors[0]["message"], r.stdout
    assert "RPCPS_MAX_IDS_PER_REQUEST: Input should be greater than or equal to 1" in errors[0]["message"]
