"""The ``rpcps`` command: role subcommands run a role; the rest talk to sidecars or launch locally."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from services.chaos import ChaosConfig
from services.config import ConfigError, add_flags, load
from services.launcher import UpConfig
from services.names import parse_name
from services.torchrun import as_worker
from services.workload import benches, roles, workloads

_ROLES = {name: spec.config for name, spec in roles().items()}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rpcps", description="parameter-server training on torch.distributed.rpc")
    sub = p.add_subparsers(dest="command", required=True)
    for role in roles().values():
        add_flags(sub.add_parser(role.name, help=role.help), role.config)
    add_flags(sub.add_parser("up", help="run a whole cluster as local processes"), UpConfig)

    def sidecar_flags(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--sidecar", action="append", metavar="URL",
                        help="a sidecar URL (repeatable; default: the cluster `rpcps up` started here)")
        sp.add_argument("--state-dir", default=".rpcps", help="where `rpcps up` wrote cluster.json")
        sp.add_argument("--json", action="store_true", help="print JSON")

    sidecar_flags(sub.add_parser("status", help="one line per role"))
    ck = sub.add_parser("checkpoint", help="take a cluster checkpoint")
    sidecar_flags(ck)
    ck.add_argument("--list", action="store_true", help="list the checkpoints on disk instead")
    ep = sub.add_parser("episode", help="start or stop episodes on the roles that run them (trainers, the RL agent)")
    ep.add_argument("action", choices=("start", "stop"))
    ep.add_argument("--steps", type=int, default=None, help="LM: steps of the episode (default: unbounded)")
    ep.add_argument("--episodes", type=int, default=None, help="RL: episodes to run (default: until solved)")
    sidecar_flags(ep)
    add_flags(sub.add_parser("chaos", help="kill members of the local cluster at random and report how it recovers"),
              ChaosConfig)
    bench = sub.add_parser("bench", help="benchmarks, printing JSON")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for spec in benches().values():
        spec.load().add_arguments(bench_sub.add_parser(spec.name, help=spec.help))
    return p


def _sidecars(args: argparse.Namespace, pick: Callable[[str], bool] = lambda name: True) -> dict[str, str]:
    if args.sidecar:
        return {url: url for url in args.sidecar}
    env = os.environ.get("RPCPS_SIDECARS")
    if env:
        return {url: url for url in env.split(",") if url}
    path = Path(args.state_dir) / "cluster.json"
    if not path.is_file():
        raise SystemExit(f"rpcps: no --sidecar given and no {path}: is a cluster running (rpcps up)?")
    sidecars = json.loads(path.read_text())["sidecars"]
    return {n: u for n, u in sidecars.items() if pick(n)}


def _runs_episodes(name: str) -> bool:
    return roles()[parse_name(name).role].episodes


def _leader_first(names: list[str]) -> list[str]:
    leaders = {spec.leader for spec in workloads().values()}
    return sorted(names, key=lambda n: n not in leaders)


def _client(url: str):
    from services.client import SidecarClient
    return SidecarClient(url, token=os.environ.get("RPCPS_CONTROL_TOKEN") or None)


def _failing(args: argparse.Namespace) -> dict[str, dict]:
    """Members ``rpcps up`` is restarting after a death (from its cluster.json)."""
    path = Path(args.state_dir) / "cluster.json"
    if args.sidecar or os.environ.get("RPCPS_SIDECARS") or not path.is_file():
        return {}
    return json.loads(path.read_text()).get("failing", {})


def _status(args: argparse.Namespace) -> int:
    code = 0
    rows = {}
    failing = _failing(args)
    for name, url in _sidecars(args).items():
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
        spec = roles().get(s.get("role", ""))
        columns = spec.status.model_validate(s).line() if spec and s["state"] != "failing" else [s.get("reason", "")]
        parts = [f"{s.get('name', name):<10}", f"{s.get('role', '?'):<8}", f"{s.get('state'):<9}", *columns]
        print("  ".join(str(p) for p in parts))
    return code


def _each(args: argparse.Namespace, call, pick: Callable[[str], bool] = lambda name: True,
          first_only: bool = False) -> int:
    code = 0
    targets = _sidecars(args, pick)
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


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = _parser().parse_args(argv)
    cmd = args.command
    try:
        if cmd in _ROLES:
            flags, environ = vars(args), os.environ
            if roles()[cmd].torchrun is not None:
                flags, environ = as_worker(cmd, roles()[cmd].torchrun, flags, environ)
            cfg = load(_ROLES[cmd], flags, environ)
            from services.runtime import run_role
            run_role(cfg, roles()[cmd])          # exits the process with the role's code
        if cmd == "up":
            cfg = load(UpConfig, vars(args), os.environ)
            from services.launcher import Launcher
            from services.log import init_logging
            init_logging("up", "warning" if cfg.as_json else cfg.log_level)
            launcher = Launcher(cfg)
            signal.signal(signal.SIGTERM, lambda *_: launcher.request_stop())
            signal.signal(signal.SIGINT, lambda *_: launcher.request_stop())
            sys.exit(launcher.run())
        if cmd == "chaos":
            from services.chaos import run_chaos
            sys.exit(run_chaos(load(ChaosConfig, vars(args), os.environ)))
        if cmd == "status":
            sys.exit(_status(args))
        if cmd == "episode":
            if args.action == "start":
                sys.exit(_each(args, lambda c: c.start_episode(steps=args.steps, episodes=args.episodes),
                               _runs_episodes))
            sys.exit(_each(args, lambda c: c.stop_episode(), _runs_episodes))
        if cmd == "checkpoint":
            # One sidecar is enough: whichever is asked, the leader (ps0 or the agent) takes one
            # checkpoint of the whole cluster; asked first, it needs no second hop.
            sys.exit(_each(args, (lambda c: c.checkpoints()) if args.list else (lambda c: c.checkpoint()),
                           first_only=True))
        if cmd == "bench":
            sys.exit(benches()[args.bench].load().run(args))
    except ConfigError as exc:
        print(f"rpcps {cmd}: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
