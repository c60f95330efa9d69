"""The CLI as a user meets it: helps that show defaults and allowed values, the closest flag to a
mistyped one, old spellings kept, commands that read the disk without a cluster, and sentences
(not tracebacks) for what is wrong."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch

from supervise import cli
from services.checkpoint.store import CheckpointStore
from services.config import ConfigError, load, shown_default
from supervise.member import cause
from supervise.upconfig import UpConfig
from services.workload import roles

REPO = Path(__file__).resolve().parents[2]


def rpcps(*argv: str, cwd: Path = REPO, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "supervise.cli", *argv], capture_output=True, text=True, timeout=60,
                          cwd=cwd, env={**os.environ, **(env or {}), "PYTHONPATH": str(REPO)})


def help_of(*argv: str, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli.parse([*argv, "--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())      # argparse wraps lines: compare the words


@pytest.mark.parametrize("command", ["up", *sorted(roles())])
def test_every_help_shows_defaults_and_allowed_values(command, capsys):
    model = UpConfig if command == "up" else roles()[command].settings_for(None)
    text = help_of(command, capsys=capsys)
    for field, info in model.model_fields.items():
        default = shown_default(info)
        if default is not None:
            flag = "--" + (info.json_schema_extra or {}).get("flag", "--" + field.replace("_", "-"))[2:]
            assert f"(default: {default})" in text, f"{command} {flag}: default {default} not shown"
        kind = typing.get_args(info.annotation) or (info.annotation,)
        for literal in (k for k in kind if typing.get_origin(k) is typing.Literal):
            assert "{" + ",".join(typing.get_args(literal)) + "}" in text, f"{command} {field}: choices not shown"


def test_up_help_groups_its_flags_and_ends_with_examples_and_exit_codes(capsys):
    with pytest.raises(SystemExit):
        cli.parse(["up", "--help"])
    text = capsys.readouterr().out
    headings = [line.rstrip(":") for line in text.splitlines() if line.endswith("settings:")]
    assert headings == ["cluster settings", "workload settings", "consistency settings", "checkpoints settings",
                        "failures settings", "output settings", "emulated hosts settings"], headings
    assert "examples:\n  rpcps up\n" in text and "rpcps up --workload rl" in text
    assert text.rstrip().splitlines()[-1].strip().startswith("2  a setting was refused")


@pytest.mark.parametrize("argv, says", [
    (["up", "--stpes", "3"], "unrecognized arguments: --stpes 3 (did you mean --steps?)"),
    (["up", "--consistensy=sync"], "(did you mean --consistency?)"),
    (["stauts"], "invalid choice: 'stauts'"),
    (["checkpoint", "--lsit"], "(did you mean --list?)"),
    (["up", "--optimizer", "adagard"], "(did you mean adagrad?)"),
])
def test_a_mistyped_flag_or_command_names_the_closest(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert says in err, err
    if argv == ["stauts"]:
        assert "(did you mean status?)" in err


def test_version(capsys):
    with pytest.raises(SystemExit):
        cli.parse(["--version"])
    out = capsys.readouterr().out
    assert out.startswith("rpcps 0.") and f"torch {torch.__version__.split('+')[0]}" in out


def test_old_spellings_fill_the_same_setting():
    old = load(UpConfig, vars(cli.parse(["up", "--ps", "3", "--trainers", "1"])), {}).settings()
    new = load(UpConfig, vars(cli.parse(["up", "--num-ps", "3", "--num-trainers", "1"])), {}).settings()
    assert (old.num_ps, old.num_trainers) == (new.num_ps, new.num_trainers) == (3, 1)
    assert load(UpConfig, {}, {"RPCPS_PS": "4"}).settings().num_ps == 4
    assert load(UpConfig, {}, {"RPCPS_PS": "4", "RPCPS_NUM_PS": "5"}).settings().num_ps == 5   # the new name wins
    with pytest.raises(ConfigError, match="environment variable RPCPS_TRAINERS"):
        load(UpConfig, {}, {"RPCPS_TRAINERS": "many"})


def test_the_quick_commands_import_neither_torch_nor_pydantic():
    code = ("import sys; from supervise import cli\n"
            "try: cli.main(sys.argv[1:])\n"
            "except SystemExit: pass\n"
            "print('LOADED', 'torch' in sys.modules, 'pydantic' in sys.modules, file=sys.stderr)")
    for argv in (["--help"], ["--version"], ["checkpoint", "--list", "--checkpoint-dir", "."]):
        r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=REPO, timeout=60)
        assert "LOADED False False" in r.stderr, (argv, r.stderr)
    # A command's help reads its settings (pydantic), never the model behind them (torch).
    for argv in (["up", "--workload", "ctr", "--help"], ["ps", "--workload", "ctr", "--help"]):
        r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=REPO, timeout=60)
        assert "LOADED False True" in r.stderr, (argv, r.stderr)


def _checkpoint(store: CheckpointStore, step: int) -> None:
    store.prepare(step)
    entry = store.write_file(step, "ps0.pt", {"w": torch.arange(4.0)})
    store.commit(step, [entry], {"num_ps": 1})


def test_checkpoint_list_reads_the_disk_without_a_cluster(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    for step in (10, 20, 30):
        _checkpoint(store, step)
    (tmp_path / "ck" / "step-40").mkdir()                       # a write that never finished
    data = (tmp_path / "ck" / "step-20" / "ps0.pt").read_bytes()
    (tmp_path / "ck" / "step-20" / "ps0.pt").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))   # same size

    r = rpcps("checkpoint", "--list", "--checkpoint-dir", str(tmp_path / "ck"), "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["checkpoints"]
    assert [(x["id"], x["state"]) for x in rows] == [("step-40", "unusable"), ("step-30", "complete"),
                                                     ("step-20", "complete"), ("step-10", "complete")]
    assert "no manifest" in rows[0]["why"]

    r = rpcps("checkpoint", "--list", "--checkpoint-dir", str(tmp_path / "ck"), "--verify", cwd=tmp_path)
    assert r.returncode == 1, r.stdout             # a corrupt checkpoint fails the check
    lines = r.stdout.splitlines()
    assert lines[0] == f"{tmp_path / 'ck'}: 4 checkpoint folders, newest first"
    assert "step-30" in lines[2] and lines[2].endswith("verified")
    assert "step-20" in lines[3] and "corrupt: step-20: ps0.pt does not match its sha256" in lines[3]

    r = rpcps("checkpoint", "--list", cwd=tmp_path)      # no folder named, none here
    assert r.returncode == 1 and "checkpoints is not a folder: name the checkpoint folder with --checkpoint-dir" in r.stderr


@pytest.mark.parametrize("content, says", [
    ("{not json", "is not a cluster file `rpcps up` wrote"),
    ('{"pids": {}}', "is not a cluster file `rpcps up` wrote (it has no sidecars)"),
    ('{"sidecars": {"ps0": "http://127.0.0.1:9"}, "launcher_pid": 999999999}', "is not running"),
])
def test_a_corrupt_or_stale_cluster_file_is_a_sentence(tmp_path, content, says):
    (tmp_path / ".rpcps").mkdir()
    (tmp_path / ".rpcps" / "cluster.json").write_text(content)
    for argv in (["status"], ["checkpoint"], ["episode", "stop"]):
        r = rpcps(*argv, cwd=tmp_path)
        assert r.returncode == 1 and says in r.stderr and "Traceback" not in r.stderr, (argv, r.stderr)
    r = rpcps("status", cwd=tmp_path / ".rpcps")
    assert r.returncode == 1 and "no cluster is running here" in r.stderr, r.stderr


def test_checkpoints_are_listed_from_the_folder_of_a_run_that_has_ended(tmp_path):
    # The README's tour: `rpcps checkpoint --list` needs no cluster, after `rpcps up` ended too.
    _checkpoint(CheckpointStore(tmp_path / "ck"), 10)
    (tmp_path / ".rpcps").mkdir()
    (tmp_path / ".rpcps" / "cluster.json").write_text(json.dumps(
        {"sidecars": {"ps0": "http://127.0.0.1:9"}, "launcher_pid": 999999999, "checkpoint_dir": str(tmp_path / "ck")}))
    r = rpcps("checkpoint", "--list", "--verify", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == f"{tmp_path / 'ck'}: 1 checkpoint folder, newest first", r.stdout
    assert "step-10" in r.stdout and r.stdout.rstrip().endswith("verified"), r.stdout


def test_a_checkpoint_folder_that_cannot_serve_is_refused_before_any_role_starts(tmp_path):
    r = rpcps("up", "--checkpoint-dir", "/proc/rpcps-checkpoints", "--state-dir", str(tmp_path / "state"),
              cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "flag --checkpoint-dir: /proc/rpcps-checkpoints cannot be made in /proc: " in r.stderr
    # The workload's default folder, ./checkpoints, where the launcher stands: checked before any start.
    r = rpcps("up", "--state-dir", str(tmp_path / "state"), cwd=Path("/proc"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "error: --checkpoint-dir: checkpoints cannot be made in /proc: " in r.stdout
    assert not (tmp_path / "state" / "logs").exists()           # nothing was started


@pytest.mark.parametrize("log, says", [
    ("2026-11-23 10:00:00,1 ps0 INFO services.runtime: started\n"
     "2026-11-23 10:00:01,2 ps0 ERROR services.runtime: ps0 failed: RuntimeError: the store is gone\n"
     "Traceback (most recent call last):\n  File \"x.py\", line 1\nRuntimeError: the store is gone\n",
     "ps0 failed: RuntimeError: the store is gone"),
    ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n    import torch\n"
     "ModuleNotFoundError: No module named 'torch'\n", "ModuleNotFoundError: No module named 'torch'"),
    ("Killed\n", "Killed"),
    ("", "its log is empty"),
])
def test_a_role_that_died_starting_is_explained_from_its_log(tmp_path, log, says):
    (tmp_path / "ps0.log").write_text(log)
    assert cause(tmp_path / "ps0.log") == says
