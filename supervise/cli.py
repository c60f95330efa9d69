"""The ``rpcps`` command: role subcommands run a role; the rest talk to sidecars, read the disk or
launch locally.

Only the subcommand being run is built in full (its flags, its imports), so ``rpcps --help``,
``rpcps status`` and ``rpcps checkpoint --list`` never import torch or a benchmark.
"""
from __future__ import annotations

import argparse
import datetime
import difflib
import importlib.metadata
import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from services.errors import ConfigError
from services.names import parse_name
from supervise.placement import NotPossible, placement_class
from services.workload import benches, commands, data_writers, roles, settings_of, workloads

STATE_FILE = "cluster.json"

UP_EXIT_CODES = """exit codes:
  0  done: the workload's episodes ended (--steps, --episodes), or stopped by Ctrl-C or SIGTERM
  1  a role failed before it was ready (its cause is printed), was not ready in time,
     or died more than --max-restarts times in a row
  2  a setting was refused before anything started (the message names it)"""


class CliError(Exception):
    """A sentence for the user, exit code 1: what is wrong and what to do."""


class _Help(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34)


class _Parser(argparse.ArgumentParser):
    """argparse, with the closest command or value named when one is mistyped."""

    def error(self, message: str) -> None:  # type: ignore[override]
        m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if m:
            message += did_you_mean(m.group(1), re.findall(r"'([^']*)'", m.group(2)))
        super().error(message)


def did_you_mean(word: str, candidates: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _version() -> str:
    def of(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"
    return f"rpcps {of('rpcps')} (torch {of('torch')}, python {sys.version.split()[0]})"


def _words(argv: Sequence[str]) -> list[str]:
    return [a for a in argv if not a.startswith("-")]


def _up_epilog() -> str:
    examples = [("", "two servers and two trainers of the default workload, until Ctrl-C")]
    for spec in workloads().values():
        examples += list(spec.examples)
    lines = [f"  {('rpcps up ' + args).strip()}\n      {what}" for args, what in examples]
    return "examples:\n" + "\n".join(lines) + "\n\n" + UP_EXIT_CODES


def _parser(argv: Sequence[str]) -> tuple[_Parser, dict[str, argparse.ArgumentParser]]:
    """The parser, with only the subcommand ``argv`` names filled in, and every subcommand's parser
    by name (for naming the closest flag to a mistyped one)."""
    words = _words(argv)
    chosen = words[0] if words else None
    p = _Parser(prog="rpcps", formatter_class=_Help,
                description="Parameter-server training on torch.distributed.rpc, run as a cluster of processes.",
                epilog="Start with `rpcps up`; `rpcps <command> --help` explains each command.")
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="command", required=True, metavar="command", parser_class=_Parser)
    made: dict[str, argparse.ArgumentParser] = {}

    def command(name: str, help: str, **kw: Any) -> argparse.ArgumentParser:
        made[name] = sub.add_parser(name, help=help, description=help, formatter_class=_Help, **kw)
        return made[name]

    def flags_of(sp: argparse.ArgumentParser, model: Any, **kw: Any) -> None:
        from services.config import add_flags     # pydantic: only for the subcommand being built
        add_flags(sp, model, **kw)

    for role in roles().values():
        sp = command(role.name, role.help, usage="%(prog)s [options]")
        if chosen == role.name:
            flags_of(sp, _settings(role, argv))
    up = command("up", "run a whole cluster as local processes, supervised, with progress",
                 usage="%(prog)s [--workload {" + ",".join(workloads()) + "}] [options]")
    if chosen == "up":
        from supervise.upconfig import UpConfig
        up.epilog = _up_epilog()
        flags_of(up, UpConfig)
    _control_commands(command, chosen, flags_of)
    _family(command("bench", "benchmarks, each printing JSON"), "bench", "benchmark", benches(), words, made)
    _family(command("data", "data as files: write a workload's (its format, to read or to test a pipeline with), "
                            "or check yours against a feature schema"), "data_command", "command", data_writers(), words, made)
    for spec in commands().values():
        sp = command(spec.name, spec.help)
        if chosen == spec.name:
            spec.load().add_arguments(sp)
    return p, made


def _control_commands(command: Callable[..., argparse.ArgumentParser], chosen: Optional[str],
                      flags_of: Callable[..., None]) -> None:
    """The commands that act on a running cluster: status, checkpoint, episode, chaos."""
    _sidecar_flags(command("status", "one line per member of the running cluster"))
    ck = command("checkpoint", "take a cluster checkpoint, or list the checkpoints on disk")
    _sidecar_flags(ck)
    ck.add_argument("--list", action="store_true", help="list the checkpoints in a folder, newest first (reads the "
                                                        "disk: no cluster needs to run)")
    ck.add_argument("--checkpoint-dir", metavar="DIR", help="with --list: the folder (default: the running "
                                                            "cluster's, from its cluster.json; else ./checkpoints)")
    ck.add_argument("--verify", action="store_true", help="with --list: check every file against its sha256 too")
    sc = command("scale", "move a running job onto N parameter servers while it trains (each new one serving "
                          "already), or drain one server (its slots handed to the others, then it stops)")
    sc.add_argument("--servers", type=int, metavar="N", help="the servers the job runs on: ps0 ... ps<N-1>")
    sc.add_argument("--drain", metavar="NAME", help="the server to drain instead (not the leader)")
    _sidecar_flags(sc)
    ep = command("episode", "start or stop episodes on the roles that run them (trainers, the RL agent)")
    ep.add_argument("action", choices=("start", "stop"))
    ep.add_argument("--steps", type=int, default=None, help="LM: steps of the episode (default: unbounded)")
    ep.add_argument("--episodes", type=int, default=None, help="RL: episodes to run (default: until solved)")
    _sidecar_flags(ep)
    chaos = command("chaos", "kill members of the local cluster at random and report how it recovers")
    if chosen == "chaos":
        from supervise.chaos import ChaosConfig
        flags_of(chaos, ChaosConfig, default_group="chaos")


def _family(parent: argparse.ArgumentParser, dest: str, metavar: str, specs: dict[str, Any], words: list[str],
            made: dict[str, argparse.ArgumentParser]) -> None:
    """A command of registered subcommands (``rpcps bench read``, ``rpcps data check``): each
    one's flags are added, and its module (and torch) imported, only when it is the one named."""
    family = parent.prog.split()[-1]
    under = parent.add_subparsers(dest=dest, required=True, metavar=metavar, parser_class=_Parser)
    for spec in specs.values():
        sp = under.add_parser(spec.name, help=spec.help, description=spec.help, formatter_class=_Help)
        if words[:2] == [family, spec.name]:
            spec.load().add_arguments(sp)
            made[f"{family} {spec.name}"] = sp


def _settings(role: Any, argv: Sequence[str]) -> Any:
    """The role's settings, as the command line and environment choose them (a hosting role's
    depend on ``--workload``); the hosting role's own when that names no workload it can host."""
    given = [a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
             for i, a in enumerate(argv) if a == "--workload" or a.startswith("--workload=")]
    try:
        return settings_of(role, {"workload": given[-1] if given else None}, os.environ)
    except KeyError:
        return role.config          # its validation names the workloads there are


def _sidecar_flags(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--sidecar", action="append", metavar="URL",
                    help="a sidecar URL (repeatable; default: the cluster `rpcps up` started, from its cluster.json)")
    sp.add_argument("--state-dir", default=".rpcps", help="where `rpcps up` wrote cluster.json (default: .rpcps)")
    sp.add_argument("--json", action="store_true", help="print JSON")


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser, made = _parser(argv)
    args, extras = parser.parse_known_args(argv)
    if extras:
        owner = made.get(f"{args.command} {getattr(args, args.command, '')}") or made.get(args.command) or parser
        known = [o for a in owner._actions for o in a.option_strings if a.help != argparse.SUPPRESS]
        owner.error(f"unrecognized arguments: {' '.join(extras)}{did_you_mean(extras[0].split('=')[0], known)}")
    return args


# --- the running cluster, as `rpcps up` recorded it --------------------------------------------------

def cluster_state(state_dir: Path, running: bool = True) -> Optional[dict]:
    """What ``rpcps up`` recorded in ``state_dir``, None if nothing; ``CliError`` when the file is
    not one ``rpcps up`` wrote, or (``running``) the run that wrote it has ended."""
    path = state_dir / STATE_FILE
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_text())
        if not isinstance(state, dict) or not isinstance(state.get("sidecars"), dict):
            raise ValueError("it has no sidecars")
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CliError(f"{path} is not a cluster file `rpcps up` wrote ({str(exc).splitlines()[0]}): remove it, "
                       f"or start a cluster with `rpcps up`") from None
    hosts = state.get("hosts")
    # Where its placement ran it (a record of an older rpcps up names none: Slurm's hosts name a job).
    slurm = isinstance(hosts, dict) and any(isinstance(h, dict) and h.get("job") for h in hosts.values())
    try:
        ended = placement_class(state.get("run_on") or ("slurm" if slurm else "local")).run_ended(state)
    except NotPossible as exc:
        raise CliError(f"{path}: {exc}") from None
    if ended and running:
        raise CliError(f"the cluster recorded in {path} is not running (the `rpcps up` that started it has "
                       f"ended): start one with `rpcps up`, or name a sidecar with --sidecar URL")
    return state


def _sidecars(args: argparse.Namespace, pick: Callable[[str], bool] = lambda name: True
              ) -> tuple[dict[str, str], dict[str, dict]]:
    """The sidecars to ask, by name, and the members ``rpcps up`` is restarting after a death
    (both from its cluster.json, unless sidecars are named)."""
    if args.sidecar:
        return {url: url for url in args.sidecar}, {}
    env = os.environ.get("RPCPS_SIDECARS")
    if env:
        return {url: url for url in env.split(",") if url}, {}
    state = cluster_state(Path(args.state_dir))
    if state is None:
        raise CliError(f"no cluster is running here: no --sidecar given and no {Path(args.state_dir) / STATE_FILE} "
                       f"(start one with `rpcps up`, or name a sidecar with --sidecar URL)")
    return {n: u for n, u in state["sidecars"].items() if pick(n)}, state.get("failing", {})


def _runs_episodes(name: str) -> bool:
    return roles()[parse_name(name).role].episodes


def _leader_first(names: list[str]) -> list[str]:
    leaders = {spec.leader for spec in workloads().values()}
    return sorted(names, key=lambda n: n not in leaders)


def _client(url: str):
    from services.client import SidecarClient
    return SidecarClient(url, token=os.environ.get("RPCPS_CONTROL_TOKEN") or None)


def _status(args: argparse.Namespace) -> int:
    code = 0
    rows = {}
    targets, failing = _sidecars(args)
    for name, url in targets.items():
        try:
            with _client(url) as c:
                rows[name] = c.status()
        except Exception as exc:
            rows[name] = {"name": name, "state": "unreachable", "reason": str(exc).splitlines()[0]}
            code = 1
        if name in failing and rows[name]["state"] == "unreachable":   # dead, waiting for its restart
            f = failing[name]
            due = "" if f.get("restart_at") is None else f"; restart in {max(0.0, f['restart_at'] - time.time()):.0f}s"
            rows[name] = {**rows[name], "state": "failing", "failing": f,
                          "reason": f"exited with code {f['exit_code']}, {f['deaths']} deaths in a row{due}"}
    if args.json:
        print(json.dumps(rows))
        return code
    for name, s in rows.items():
        if s["state"] in ("failing", "unreachable"):
            columns = [s.get("reason", "")]
        elif "summary" in s:            # the role's own rendering of its status
            columns = s["summary"]
        else:                           # a role of an older rpcps
            spec = roles().get(s.get("role", ""))
            columns = spec.status.model_validate(s).line() if spec else [s.get("reason", "")]
        parts = [f"{s.get('name', name):<10}", f"{s.get('role', '?'):<8}", f"{s.get('state'):<9}", *columns]
        print("  ".join(str(p) for p in parts))
    return code


def _each(args: argparse.Namespace, call, pick: Callable[[str], bool] = lambda name: True,
          first_only: bool = False) -> int:
    code = 0
    targets, _ = _sidecars(args, pick)
    names = _leader_first(list(targets))
    for name in names[:1] if first_only else names:
        url = targets[name]
        try:
            with _client(url) as c:
                print(json.dumps({name: call(c)}))
        except Exception as exc:
            print(f"rpcps: {name}: {exc}", file=sys.stderr)
            code = 1
    return code


def _control(cmd: str, args: argparse.Namespace) -> int:
    """A command that asks the sidecars of a running cluster."""
    if cmd == "status":
        return _status(args)
    if cmd == "episode":
        if args.action == "start":
            return _each(args, lambda c: c.start_episode(steps=args.steps, episodes=args.episodes), _runs_episodes)
        return _each(args, lambda c: c.stop_episode(), _runs_episodes)
    if cmd == "scale":
        return _scale(args)
    if args.list:
        return _list_checkpoints(args)
    # One sidecar is enough: whichever is asked, the leader (ps0 or the agent) takes one
    # checkpoint of the whole cluster; asked first, it needs no second hop.
    return _each(args, lambda c: c.checkpoint(), first_only=True)


def _scale(args: argparse.Namespace) -> int:
    if (args.servers is None) == (args.drain is None):
        raise CliError("say --servers N (the leader moves the job onto N servers) or --drain NAME")
    name = args.drain if args.drain is not None else "ps0"
    if not _sidecars(args, lambda n: n == name)[0]:
        raise CliError(f"{name} is not a member of the running cluster's cluster.json: name its sidecar with "
                       f"--sidecar URL")
    if args.drain is not None:
        return _each(args, lambda c: c.drain(), lambda n: n == name)
    said = lambda asked: print(json.dumps({"awaiting": asked["awaiting"]}), file=sys.stderr)  # noqa: E731
    return _each(args, lambda c: c.scaled(args.servers, waiting=said), lambda n: n == name)


# --- checkpoints on disk ---------------------------------------------------------------------------
def _checkpoint_dir(args: argparse.Namespace) -> Path:
    if args.checkpoint_dir:
        return Path(args.checkpoint_dir)
    if os.environ.get("RPCPS_CHECKPOINT_DIR"):
        return Path(os.environ["RPCPS_CHECKPOINT_DIR"])
    state = cluster_state(Path(args.state_dir), running=False)     # a run that has ended left its checkpoints
    if state is not None and state.get("checkpoint_dir"):
        return Path(state["checkpoint_dir"])
    return Path("checkpoints")


def list_checkpoints(folder: Path, verify: bool) -> list[dict[str, Any]]:
    """Every ``step-N`` folder under ``folder``, newest first: the checkpoint, or why it is none."""
    from services.checkpoint.store import CheckpointStore
    from services.errors import CheckpointError
    store = CheckpointStore(folder)
    rows = []
    for path, found in store.scan():
        if isinstance(found, CheckpointError):
            rows.append({"id": path.name, "path": str(path), "state": "unusable", "why": str(found)})
            continue
        row = {**found.describe(), "state": "complete"}
        if verify:
            try:
                store.verify(found)
                row["state"] = "verified"
            except CheckpointError as exc:
                row.update(state="corrupt", why=str(exc))
        rows.append(row)
    return rows


def _list_checkpoints(args: argparse.Namespace) -> int:
    if args.sidecar:          # a cluster elsewhere: ask it
        return _each(args, lambda c: c.checkpoints(), first_only=True)
    folder = _checkpoint_dir(args)
    if not folder.is_dir():
        raise CliError(f"{folder} is not a folder: name the checkpoint folder with --checkpoint-dir DIR")
    rows = list_checkpoints(folder, args.verify)
    bad = any(r["state"] == "corrupt" for r in rows)
    if args.json:
        print(json.dumps({"checkpoint_dir": str(folder), "checkpoints": rows}))
        return 1 if bad else 0
    print(f"{folder}: {len(rows)} checkpoint folder{'s' if len(rows) != 1 else ''}, newest first"
          + ("" if rows else " (no checkpoint yet)"))
    for r in rows:
        if r["state"] == "unusable":
            print(f"  {r['id']:<12} unusable: {r['why']}")
            continue
        when = datetime.datetime.fromtimestamp(r["created"]).strftime("%Y-%m-%d %H:%M:%S")
        state = f"corrupt: {r['why']}" if r["state"] == "corrupt" else r["state"]
        kind = f"delta on {', '.join(r['bases'])}" if r.get("kind") == "delta" else "full"
        print(f"  {r['id']:<12} step {r['step']:<8} {when}  {_size(r['size_bytes']):>9}  "
              f"{len(r['files'])} files  {kind}  {state}")
    return 1 if bad else 0


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


# --- main --------------------------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    cmd = args.command
    try:
        if cmd in roles():
            spec = roles()[cmd]
            flags, environ = vars(args), os.environ
            if spec.torchrun is not None:
                from services.torchrun import as_worker
                flags, environ = as_worker(cmd, spec.torchrun, flags, environ)
            from services.config import load
            cfg = load(_settings(spec, argv), flags, environ)
            from services.runtime import run_role
            run_role(cfg, spec)          # exits the process with the role's code
        if cmd == "up":
            from services.config import load
            from supervise.launcher import Launcher
            from services.log import init_logging
            from supervise.upconfig import UpConfig
            cfg = load(UpConfig, vars(args), os.environ)
            init_logging("up", "warning" if cfg.as_json else cfg.log_level)
            launcher = Launcher(cfg)
            signal.signal(signal.SIGTERM, lambda *_: launcher.request_stop())
            signal.signal(signal.SIGINT, lambda *_: launcher.request_stop())
            sys.exit(launcher.run())
        if cmd == "chaos":
            from supervise.chaos import ChaosConfig, run_chaos
            from services.config import load
            sys.exit(run_chaos(load(ChaosConfig, vars(args), os.environ)))
        if cmd in ("status", "episode", "scale", "checkpoint"):
            sys.exit(_control(cmd, args))
        if cmd == "bench":
            sys.exit(benches()[args.bench].load().run(args))
        if cmd == "data":
            sys.exit(data_writers()[args.data_command].load().run(args))
        if cmd in commands():
            sys.exit(commands()[cmd].load().run(args))
    except ConfigError as exc:
        print(f"rpcps {cmd}: {exc}", file=sys.stderr)
        sys.exit(2)
    except CliError as exc:
        print(f"rpcps {cmd}: {exc}", file=sys.stderr)
        sys.exit(1)
    except BrokenPipeError:
        # The reader of the output went away (`rpcps data check … | head`): no traceback for that, and
        # stdout pointed at nothing so that the interpreter's own flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


if __name__ == "__main__":
    main()
