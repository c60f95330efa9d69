"""Workloads, as the shared services see them, and how they are found.

A workload (the language model, the RL agent and its observers, later others) lives in one folder
under ``trainer/`` and registers a ``WorkloadSpec`` under the entry-point group ``rpcps.workloads``
(``pyproject.toml``). The CLI, the launcher and the benches reach its roles, settings, launch
plan, status schemas and benchmarks only through this registry: ``services/`` imports no workload.
What a spec names as ``"module:attribute"`` (settings, status schemas, metrics, factories,
benchmarks) is imported only when it is used, so listing the workloads costs no more than reading
their specs: ``rpcps --help`` imports neither pydantic nor torch.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Protocol

if TYPE_CHECKING:
    from pydantic import BaseModel

    from services.metrics import Metrics

GROUP = "rpcps.workloads"
ROLES_GROUP = "rpcps.roles"      # roles that serve any workload: the parameter servers
EXTRA = "RPCPS_WORKLOADS"        # "module:attribute,…": workloads not installed as entry points (tests, development)


def resolve(ref: str) -> Any:
    """What a spec names as ``"module:attribute"``, imported now."""
    module, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class TorchrunSpec:
    """A role torchrun may start (``services/torchrun.py``)."""

    count: str                                     # the setting torchrun's WORLD_SIZE fills
    defaults: tuple[tuple[str, str], ...] = ()     # (setting, value) it takes unless told otherwise


@dataclass(frozen=True)
class RoleSpec:
    name: str                  # the `rpcps <name>` subcommand, and the role word of its RPC names
    settings: str              # "module:attribute": its settings (flags and RPCPS_* variables)
    status_schema: str         # "module:attribute": its /status schema; ``line()`` gives `rpcps status`'s columns
    factory: str               # "module:attribute" building the role from (config, RoleContext)
    help: str
    indexed: bool = True       # named ps0, ps1, … (False: the one agent)
    episodes: bool = False     # its work comes in episodes that `rpcps episode start|stop` controls
    metric_families: str = "services.metrics:Metrics"   # its metric families (every role's, and its own)
    torchrun: Optional["TorchrunSpec"] = None   # how it reads its settings when torchrun starts it
    hosting: bool = False      # it serves a workload chosen by --workload: its settings are that one's ``server``
    leader: Optional[str] = None   # the member that leads it, when no one workload owns it
    routes: Optional[str] = None   # "module:attribute": adds its own sidecar routes (``services.sidecar.Routes``)

    def settings_for(self, workload: Optional[str]) -> type["BaseModel"]:
        """Its settings; a hosting role's are those of the workload it hosts (None: the default)."""
        return resolve(hosted(workload).server.settings) if self.hosting else self.config

    @property
    def config(self) -> type["BaseModel"]:
        return resolve(self.settings)

    @property
    def status(self) -> type["BaseModel"]:
        return resolve(self.status_schema)

    @property
    def metrics(self) -> type["Metrics"]:
        return resolve(self.metric_families)

    def build(self) -> Callable[..., Any]:
        return resolve(self.factory)


@dataclass(frozen=True)
class BenchSpec:
    """A command a workload adds: a benchmark (`rpcps bench <name>`), its data writer (`rpcps data
    <name>`), or one of its own (`rpcps <name>`)."""

    name: str
    help: str
    module: str                # its ``add_arguments(parser)`` and ``run(args) -> exit code``

    def load(self) -> Any:
        return importlib.import_module(self.module)


@dataclass(frozen=True)
class ScaleCase:
    """A way a workload trains, as ``rpcps bench scale`` measures it with every member on an
    emulated host of its own: against one process on one such host, as trainer hosts are added,
    and (a link variant) beside another case as the hosts' links slow down."""

    name: str
    help: str
    flags: tuple[str, ...]               # `rpcps up`'s, besides the hosts, counts and steps the bench sets
    unit: str                            # what its throughput counts: the ``done`` event's ``<unit>_per_s``
    quality: str                         # the ``done`` event's held-out figure (an AUC, a loss)
    higher_is_better: bool = True
    efficiency: Optional[float] = None   # weak-scaling target at the most trainer hosts (None: none)
    exact: bool = False                  # sync: its quality equals one process's on every trainer's samples
    # (case, margin): its quality at the most trainer hosts is no worse than that case's by more
    # than the margin, when both ran (hybrid against sync)
    quality_near: Optional[tuple[str, float]] = None
    against: Optional[str] = None        # a link variant (not added hosts): the case it is measured beside
    link_target: Optional[float] = None  # … and the ratio it should reach on the slowest link
    prepare: Optional[str] = None        # "module:function(folder) -> (flags, working folder)": data it needs
    serve_rows: Optional[str] = None     # "module:function(count) -> rows": requests for a serving member
    serve_flags: tuple[str, ...] = ()    # … which these flags add


@dataclass(frozen=True)
class Planned:
    """A process of a local cluster: its RPC name, its role, and its flags besides name, ports
    and rendezvous."""

    name: str
    role: str
    argv: list[str]


class Launch(Protocol):
    """What ``rpcps up`` asks a workload: what to start, how to read its progress, when it is done.
    Optional: ``prepare()``, work before anything starts, returning warnings (or raising a
    ``ConfigError``); ``run_local(emit, should_stop)``, its one-process mode; and, for a workload
    whose members change while it runs, ``members(leader_status)``: the members the leader's
    status wants now, each as it would be planned (``rpcps up`` starts those it lacks and lets
    go of those that stop with exit 0 and are wanted no more)."""

    def plan(self) -> list[Planned]: ...
    def watched(self, names: list[str]) -> list[str]: ...
    def stop_waves(self, names: list[str]) -> list[list[str]]: ...
    def finished(self, statuses: dict[str, Any]) -> bool: ...
    def progress(self, statuses: dict[str, Any]) -> list[dict]: ...
    def summary(self, statuses: dict[str, Any], restarts: int) -> dict: ...
    def human(self, event: dict) -> Optional[str]: ...


@dataclass(frozen=True)
class HostedSpec:
    """What a workload hosted on the parameter servers hands them (``rpcps ps --workload <name>``)."""

    settings: str              # "module:attribute": the servers' settings for it (the server role's, and its model's)
    model: str                 # "module:attribute": (those settings) -> the ``ModelSpec`` the servers host
    client_role: str           # the role that trains against the servers: a checkpoint holds its members


@dataclass(frozen=True)
class WorkloadSpec:
    name: str                  # `rpcps up --workload <name>`
    help: str
    leader: str                # the member that hosts the rendezvous store and leads the group
    roles: tuple[RoleSpec, ...]
    up_settings: str           # "module:attribute": its `rpcps up` settings, besides the launcher's own
    launch: str                # "module:attribute" building its ``Launch`` from (launcher settings, ``up``)
    checkpoint_dir: str        # where `rpcps up` puts its checkpoints unless told
    benches: tuple[BenchSpec, ...] = ()
    examples: tuple[tuple[str, str], ...] = ()   # (`rpcps up …` arguments, what they do), for `rpcps up --help`
    server: Optional[HostedSpec] = None          # its model, when the parameter servers host it
    data: tuple[BenchSpec, ...] = ()             # `rpcps data <name>`: writes its data as files, or checks files
    commands: tuple[BenchSpec, ...] = ()         # `rpcps <name>`: a command of its own (`rpcps export`)
    scale: tuple[ScaleCase, ...] = ()            # what `rpcps bench scale` measures of it across hosts
    rank: int = 50             # its place in listings (then by name): the first is `rpcps up`'s and `rpcps ps`'s default

    @property
    def up(self) -> type["BaseModel"]:
        return resolve(self.up_settings)

    def launcher(self, common: Any, settings: Any) -> Launch:
        return resolve(self.launch)(common, settings)


@functools.cache
def workloads() -> dict[str, WorkloadSpec]:
    """Every registered workload, by name, in their ``rank`` order (then by name)."""
    found: dict[str, WorkloadSpec] = {}
    seen_roles: dict[str, str] = {role: "the shared roles" for role in _shared_roles()}
    entries = [(e.name, e.value) for e in importlib.metadata.entry_points(group=GROUP)]
    extra = [ref for ref in os.environ.get(EXTRA, "").split(",") if ref]
    listed = entries + [(resolve(ref).name, ref) for ref in extra]
    for name, ref in sorted(listed, key=lambda entry: (resolve(entry[1]).rank, entry[0])):
        spec = resolve(ref)
        if not isinstance(spec, WorkloadSpec) or spec.name != name:
            raise RuntimeError(f"entry point {name} = {ref} is not the WorkloadSpec {name!r}")
        for role in spec.roles:
            if role.name in seen_roles:
                raise RuntimeError(f"workloads {seen_roles[role.name]} and {spec.name} both define the role {role.name}")
            seen_roles[role.name] = spec.name
        found[spec.name] = spec
    if not found:
        raise RuntimeError(f"no workload is registered under {GROUP}: is rpcps installed (pip install -e .)?")
    return found


@functools.cache
def _shared_roles() -> dict[str, RoleSpec]:
    found = {}
    for entry in importlib.metadata.entry_points(group=ROLES_GROUP):
        role = entry.load()
        if not isinstance(role, RoleSpec) or role.name != entry.name:
            raise RuntimeError(f"entry point {entry.name} = {entry.value} is not the RoleSpec {entry.name!r}")
        found[role.name] = role
    return found


@functools.cache
def roles() -> dict[str, RoleSpec]:
    """Every role: the shared ones (the parameter servers), then each workload's."""
    return {**_shared_roles(), **{role.name: role for spec in workloads().values() for role in spec.roles}}


def workload_of(role: str) -> WorkloadSpec:
    for spec in workloads().values():
        if any(r.name == role for r in spec.roles):
            return spec
    raise KeyError(role)


def hosted(name: Optional[str] = None) -> WorkloadSpec:
    """The workload the parameter servers host: ``name``, or (None) the first that declares a
    ``server``; ``KeyError`` saying which there are otherwise."""
    servable = {n: spec for n, spec in workloads().items() if spec.server is not None}
    if name is None and servable:
        return next(iter(servable.values()))
    if name not in servable:
        raise KeyError(f"no workload {name!r} for the servers to host: one of {', '.join(servable) or 'none'}")
    return servable[name]


def settings_of(role: RoleSpec, flags: Mapping[str, Any], environ: Mapping[str, str]) -> type["BaseModel"]:
    """``role``'s settings as a command line and environment choose them (``--workload`` or
    ``RPCPS_WORKLOAD`` pick what a hosting role hosts)."""
    if not role.hosting:
        return role.config
    return role.settings_for(flags.get("workload") or environ.get("RPCPS_WORKLOAD") or None)


# Benchmarks of the shared services themselves, besides each workload's.
SHARED_BENCHES = (BenchSpec("cli", "seconds the quick commands take to answer (--help, status, checkpoint --list)",
                            "supervise.bench_cli"),
                  # Every workload's ``scale`` cases, each member on an emulated host (needs root).
                  BenchSpec("scale", "samples/s as trainer hosts are added, every member on an emulated host of its "
                                     "own: weak-scaling efficiency, CPU and bytes per host, slower links, serving "
                                     "beside training, and a step-time model", "trainer.core.scale.bench"),
                  BenchSpec("ring", "the trainers' all-reduce alone on emulated hosts: milliseconds and CPU an "
                                    "all-reduce, without a quota, under one, and after a step's work; gloo's ring "
                                    "beside halving and doubling",
                            "trainer.core.scale.bench_ring"))


def data_writers() -> dict[str, BenchSpec]:
    return {data.name: data for spec in workloads().values() for data in spec.data}


def commands() -> dict[str, BenchSpec]:
    """The top-level commands workloads add, by name."""
    return {c.name: c for spec in workloads().values() for c in spec.commands}


def benches() -> dict[str, BenchSpec]:
    return {bench.name: bench for bench in (*SHARED_BENCHES, *(b for spec in workloads().values() for b in spec.benches))}
