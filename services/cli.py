"""The ``rpcps`` command: role subcommands run a role; the rest talk to sidecars or launch locally."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Optional, Sequence

from services.config import (AgentConfig, ConfigError, ObserverConfig, PsConfig, TrainerConfig, UpConfig, add_flags,
                             load)

_ROLES = {"ps": PsConfig, "trainer": TrainerConfig, "agent": AgentConfig, "observer": ObserverConfig}


def _role_factory(role: str):
    # Imported lazily: `rpcps status` should not pay for importing torch.
    if role == "ps":
        from ps.role import PsRole
        return PsRole
    if role == "agent":
        from trainer.rl.agent import AgentRole
        return AgentRole
    if role == "observer":
        from trainer.rl.observer import ObserverRole
        return ObserverRole
    from trainer.lm.role import TrainerRole
    return TrainerRole


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rpcps", description="parameter-server training on torch.distributed.rpc")
    sub = p.add_subparsers(dest="command", required=True)
    for role, model in _ROLES.items():
        add_flags(sub.add_parser(role, help=f"run one {role} process"), model)
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
    ep = sub.add_parser("episode", help="start or stop episodes on the trainers or the RL agent")
    ep.add_argument("action", choices=("start", "stop"))
    ep.add_argument("--steps", type=int, default=None, help="LM: steps of the episode (default: unbounded)")
    ep.add_argument("--episodes", type=int, default=None, help="RL: episodes to run (default: until solved)")
    sidecar_flags(ep)
    bench = sub.add_parser("bench", help="benchmarks, printing JSON")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from services.bench import checkpoint as bench_checkpoint, lm as bench_lm, rl as bench_rl
    bench_lm.add_arguments(bench_sub.add_parser("lm", help="tokens/s: one process vs the seed design vs rpcps"))
    bench_checkpoint.add_arguments(bench_sub.add_parser("checkpoint", help="checkpoint save/restore of a 2M x 64 shard vs dd"))
    bench_rl.add_arguments(bench_sub.add_parser("rl", help="environment steps/s: 1, 2, 4 observers, batched and not"))
    return p


def _sidecars(args: argparse.Namespace, roles: Optional[tuple[str, ...]] = None) -> dict[str, str]:
    if args.sidecar:
        return {url: url for url in args.sidecar}
    env = os.environ.get("RPCPS_SIDECARS")
    if env:
        return {url: url for url in env.split(",") if url}
    path = Path(args.state_dir) / "cluster.json"
    if not path.is_file():
        raise SystemExit(f"rpcps: no --sidecar given and no {path}: is a cluster running (rpcps up)?")
    sidecars = json.loads(path.read_text())["sidecars"]
    return {n: u for n, u in sidecars.items() if roles is None or n.rstrip("0123456789") in roles}


def _client(url: str):
    from services.client import SidecarClient
    return SidecarClient(url, token=os.environ.get("RPCPS_CONTROL_TOKEN") or None)


def _status(args: argparse.Namespace) -> int:
    code = 0
    rows = {}
    for name, url in _sidecars(args).items():
        try:
            with _client(url) as c:
                rows[name] = c.status()
        except Exception as exc:
            rows[name] = {"name": name, "state": "unreachable", "reason": str(exc).splitlines()[0]}
            code = 1
    if args.json:
        print(json.dumps(rows))
        return code
    for name, s in rows.items():
        parts = [f"{s.get('name', name):<10}", f"{s.get('role', '?'):<8}", f"{s.get('state'):<9}"]
        if s.get("role") == "trainer":
            ep = s.get("episode") or {}
            loss = s.get("loss_avg")
            parts += [f"step {s.get('step', 0)}", f"episode {ep.get('id', '-')} {ep.get('step', 0)}/{ep.get('steps') or '∞'}",
                      f"loss {loss:.3f}" if loss is not None else "loss -",
                      f"{s.get('tokens_per_s') or 0:.0f} tokens/s"]
        elif s.get("role") == "ps":
            parts += [f"shard {s.get('shard')}/{s.get('num_shards')}", f"{s.get('rows')} rows",
                      f"members {len(s.get('members') or [])}"]
        elif s.get("role") == "agent":
            last, running = s.get("last_reward"), s.get("running_reward")
            parts += [f"episode {s.get('episode', 0)}", "reward -" if last is None else f"reward {last:.1f}",
                      "running -" if running is None else f"running {running:.1f}",
                      "- steps/s" if s.get("steps_per_s") is None else f"{s['steps_per_s']:.0f} steps/s",
                      f"members {len(s.get('members') or [])}"]
        elif s.get("role") == "observer":
            parts += [f"episodes {s.get('episodes', 0)}", f"{s.get('env_steps', 0)} env steps"]
        else:
            parts.append(s.get("reason", ""))
        print("  ".join(str(p) for p in parts))
    return code


def _each(args: argparse.Namespace, roles: tuple[str, ...], call, first_only: bool = False) -> int:
    code = 0
    targets = list(_sidecars(args, roles).items())
    for name, url in targets[:1] if first_only else targets:
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
            cfg = load(_ROLES[cmd], vars(args), os.environ)
            from services.runtime import run_role
            factory = _role_factory(cmd)
            run_role(cfg, factory)          # exits the process with the role's code
        if cmd == "up":
            cfg = load(UpConfig, vars(args), os.environ)
            from services.launcher import Launcher, emitter
            from services.log import init_logging
            init_logging("up", "warning" if cfg.as_json else cfg.log_level)
            launcher = Launcher(cfg, emitter(cfg.as_json))
            signal.signal(signal.SIGTERM, lambda *_: launcher.request_stop())
            signal.signal(signal.SIGINT, lambda *_: launcher.request_stop())
            sys.exit(launcher.run())
        if cmd == "status":
            sys.exit(_status(args))
        if cmd == "episode":
            if args.action == "start":
                sys.exit(_each(args, ("trainer", "agent"),
                               lambda c: c.start_episode(steps=args.steps, episodes=args.episodes)))
            sys.exit(_each(args, ("trainer", "agent"), lambda c: c.stop_episode()))
        if cmd == "checkpoint":
            # One sidecar is enough: whichever is asked, the leader (ps0 or the agent) takes one
            # checkpoint of the whole cluster.
            sys.exit(_each(args, ("ps", "agent"), (lambda c: c.checkpoints()) if args.list else (lambda c: c.checkpoint()),
                           first_only=True))
        if cmd == "bench":
            from services.bench import checkpoint as bench_checkpoint, lm as bench_lm, rl as bench_rl
            sys.exit({"lm": bench_lm, "checkpoint": bench_checkpoint, "rl": bench_rl}[args.bench].run(args))
    except ConfigError as exc:
        print(f"rpcps {cmd}: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
