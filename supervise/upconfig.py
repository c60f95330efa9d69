"""``rpcps up``'s settings: the launcher's own, joined by every registered workload's.

Light on purpose (pydantic, no torch, no HTTP client): the CLI builds ``rpcps up --help`` from it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal, Optional

from pydantic import Field, SecretStr, TypeAdapter, ValidationError, create_model, field_validator, model_validator
from pydantic.fields import FieldInfo

from services.config import ConfigBase, explain, flag_name, shown_default, writable_folder
from supervise.hosts.emulated import HostsSettings, threads_for
from supervise.placement import PLACEMENTS
from services.workload import workloads


# The flags that name a placement by themselves, by the placement they name.
SHORTHANDS = {"slurm": "slurm", "emulate_hosts": "hosts"}


class LauncherConfig(HostsSettings):
    """``rpcps up``: the launcher's own settings, whatever the workload."""

    workload: str = Field(description="which workload to run")
    as_json: bool = Field(False, description="print JSON lines instead of human progress",
                          json_schema_extra={"flag": "--json", "env": "RPCPS_JSON"})
    threads: int = Field(1, ge=1, description="torch threads per process")
    rpc_transport: Literal["uv", "shm"] = Field("uv", description="TensorPipe transport of every role")
    rpc_channel: Literal["basic", "multiplexed"] = Field("basic", description="how every role's tensors cross to "
                                                                          "another host (see rpcps ps --help)")
    master_addr: str = Field("127.0.0.1", description="address of the rendezvous store (the leader: ps0 or the agent)")
    master_port: int = Field(0, ge=0, le=65535, description="rendezvous port (0: a free port)")
    sidecar_host: str = Field("127.0.0.1", description="address the sidecars bind")
    sidecar_port: int = Field(0, ge=0, le=65535, description="first sidecar port, one per role in order (0: free ports); with "
                                                                    "--slurm, the first on each node (0: 8080)")
    http_read_timeout: float = Field(10.0, gt=0, le=3600, description="seconds a client has to send a sidecar a "
                                                                     "whole request (slower: cut off)")
    progress_interval: float = Field(5.0, gt=0, description="seconds between progress lines")
    restart_backoff: float = Field(1.0, gt=0, description="seconds before a dead member is restarted; doubled "
                                                          "for each death in a row, up to --restart-backoff-max")
    restart_backoff_max: float = Field(60.0, gt=0, description="the longest wait before a restart")
    restart_window: float = Field(60.0, gt=0, description="a member up this long is healthy again: its next "
                                                          "death waits --restart-backoff")
    max_restarts: Optional[int] = Field(None, ge=0, description="end the run after this many deaths in a row of "
                                                                "one member (default: never; it is shown failing)")
    ready_timeout: float = Field(180.0, gt=0, description="seconds for every role to become ready")
    member_timeout: float = Field(15.0, ge=2, le=600, description="a member whose sidecar has not answered for this "
                                                                 "many seconds is declared lost though its process "
                                                                 "lives (frozen, cut off): stopped, and replaced")
    state_dir: Path = Field(Path(".rpcps"), description="where role logs and cluster.json go")
    resume: bool = Field(True, description="resume from the newest valid checkpoint (--no-resume: start fresh)")
    resume_from: Optional[str] = Field(None, description="resume from this checkpoint (step-N or its path)")
    keep_checkpoints: int = Field(3, ge=1, description="newest checkpoints kept")
    final_checkpoint: bool = Field(True, description="take a checkpoint when stopping")
    run_on: str = Field("local", description=f"where the members run, the placement: {', '.join(PLACEMENTS)} "
                                             "(processes of this machine; an emulated host each, as "
                                             "--emulate-hosts; a step each of a Slurm allocation, as --slurm)")
    slurm: bool = Field(False, description="run inside a Slurm allocation (a batch script, or salloc): every member "
                                           "a job step on a node of it, servers first (see the Slurm guide)")
    local: bool = Field(False, description="train the same model on the same data in this one process instead of "
                                           "a cluster, for comparison (nothing is checkpointed; the ctr workload)")
    checkpoint_dir: Optional[Path] = Field(None, description="folder of the checkpoints (default: the workload's own)")
    control_token: Optional[SecretStr] = Field(None, description="bearer token for the sidecars' POST routes")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level of every role")

    # Set on the composed ``UpConfig``: each workload's own settings, by name.
    workload_settings: ClassVar[dict[str, type[ConfigBase]]] = {}
    flag_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "cluster": ("workload", "local", "run_on", "slurm", "threads", "rpc_transport", "rpc_channel", "master_addr",
                    "master_port", "sidecar_host", "sidecar_port", "http_read_timeout", "control_token"),
        "checkpoints": ("checkpoint_dir", "resume", "resume_from", "keep_checkpoints", "final_checkpoint"),
        "failures": ("restart_backoff", "restart_backoff_max", "restart_window", "max_restarts", "ready_timeout",
                     "member_timeout"),
        "output": ("as_json", "progress_interval", "state_dir", "log_level"),
        "emulated hosts": ("emulate_hosts", "host_cpus", "link_rate"),
    }

    _folders = field_validator("checkpoint_dir", "state_dir")(
        classmethod(lambda cls, v: v if v is None else writable_folder(v)))

    @model_validator(mode="before")
    @classmethod
    def _workload_of_its_settings(cls, values: Any) -> Any:
        """No --workload given: the one workload whose settings were given, when only one has them
        all (``--model`` is a setting of one workload alone); else the default."""
        if not isinstance(values, dict) or values.get("workload") is not None:
            return values
        given = {k for k, v in values.items() if v is not None and k not in LauncherConfig.model_fields}
        fits = [name for name, model in cls.workload_settings.items() if given <= set(model.model_fields)]
        return {**values, "workload": fits[0]} if given and len(fits) == 1 else values

    @model_validator(mode="before")
    @classmethod
    def _placement_of_its_shorthands(cls, values: Any) -> Any:
        """--slurm and --emulate-hosts name a placement; --run-on names it too, and then the
        shorthand follows it, so that either way the two agree."""
        if not isinstance(values, dict):
            return values
        on = []                         # (flag, placement) of each shorthand given
        for field, name in SHORTHANDS.items():
            try:
                if TypeAdapter(bool).validate_python(values.get(field) or False):
                    on.append((f"--{field.replace('_', '-')}", name))
            except ValidationError:
                pass                    # the field's own validation says what is wrong with it
        given = values.get("run_on")
        if len(on) > 1:
            raise ValueError(f"{', '.join(flag for flag, _ in on)}: a run has one placement")
        if on and given not in (None, on[0][1]):
            raise ValueError(f"--run-on {given}: {on[0][0]} means --run-on {on[0][1]}")
        if on:
            return {**values, "run_on": on[0][1]}
        if given in PLACEMENTS:
            return {**values, **{field: given == name for field, name in SHORTHANDS.items()}}
        return values

    @property
    def run_on_flag(self) -> str:
        """The flag that names this run's placement, for its errors (``--slurm: no allocation``)."""
        flags = {name: f"--{field.replace('_', '-')}" for field, name in SHORTHANDS.items()}
        return flags.get(self.run_on, f"--run-on {self.run_on}")

    @field_validator("run_on")
    @classmethod
    def _registered(cls, v: str) -> str:
        if v not in PLACEMENTS:
            raise ValueError(f"one of {', '.join(PLACEMENTS)}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _threads_of_the_hosts(cls, values: Any) -> Any:
        """On hosts of --host-cpus cores, torch's threads follow the cores unless --threads is given."""
        if isinstance(values, dict) and values.get("threads") is None and values.get("host_cpus") is not None:
            return {**values, "threads": threads_for(float(values["host_cpus"]))}
        return values

    @model_validator(mode="after")
    def _slurm(self) -> "LauncherConfig":
        if self.run_on != "slurm":
            return self
        if self.local or self.emulate_hosts:
            raise ValueError(f"--slurm: {'--local' if self.local else '--emulate-hosts'} runs no member on the "
                             "allocation's nodes")
        placed = [f"--{f.replace('_', '-')}" for f in ("master_addr", "sidecar_host") if f in self.model_fields_set]
        if placed:
            raise ValueError(f"{', '.join(placed)}: with --slurm every member's address is its node's")
        return self

    @model_validator(mode="after")
    def _hosts(self) -> "LauncherConfig":
        if self.run_on != "hosts":
            given = [f"--{f.replace('_', '-')}" for f in ("host_cpus", "link_rate") if getattr(self, f) is not None]
            if given:
                raise ValueError(f"{', '.join(given)}: only with --emulate-hosts")
            return self
        if self.local:
            raise ValueError("--emulate-hosts: --local trains in this one process, on no host of its own")
        placed = [f"--{f.replace('_', '-')}" for f in ("master_addr", "sidecar_host") if f in self.model_fields_set]
        if placed:
            raise ValueError(f"{', '.join(placed)}: with --emulate-hosts every member's address is its host's")
        return self

    @model_validator(mode="after")
    def _check(self) -> "LauncherConfig":
        settings = type(self).workload_settings
        if self.workload not in settings:
            raise ValueError(f"--workload: unknown workload {self.workload!r}; one of {', '.join(settings)}")
        # A setting of another workload would be silently ignored: refuse it instead.
        mine = set(settings[self.workload].model_fields) | set(LauncherConfig.model_fields)
        wrong = sorted(self.model_fields_set - mine)
        if wrong:
            names = ", ".join(flag_name(f, type(self).model_fields[f]) for f in wrong)
            raise ValueError(f"{names}: not a setting of --workload {self.workload}")
        # The workload's own checks (its validators) run here, so a bad value is a ConfigError
        # at load naming its flag, not a failure once the launch has begun.
        try:
            self.settings()
        except ValidationError as exc:
            fields = type(self).model_fields
            problems = []
            for e in exc.errors():
                field = str(e["loc"][0]) if e["loc"] else None
                problems.append(explain(e["msg"], field and flag_name(field, fields.get(field)), e["input"] if field else None))
            raise ValueError("; ".join(problems)) from None
        return self

    def settings(self) -> ConfigBase:
        """The chosen workload's settings: those given, its defaults for the rest."""
        model = type(self).workload_settings[self.workload]
        return model.model_validate({f: getattr(self, f) for f in self.model_fields_set if f in model.model_fields})

    def restoring_flags(self) -> list[str]:
        """How the leader (and the servers) should restore and keep checkpoints."""
        out = ["--resume" if self.resume else "--no-resume", "--keep-checkpoints", str(self.keep_checkpoints)]
        return out + (["--resume-from", self.resume_from] if self.resume_from else [])


def compose_up_config() -> type[LauncherConfig]:
    """``LauncherConfig`` with every registered workload's settings as fields (one flag each, as
    `rpcps up --help` lists them): a field two workloads share takes each one's default from it."""
    settings = {name: spec.up for name, spec in workloads().items()}
    declared: dict[str, list[tuple[str, FieldInfo]]] = {}
    for name, model in settings.items():
        for setting, info in model.model_fields.items():
            declared.setdefault(setting, []).append((name, info))
    fields: dict[str, Any] = {}
    for setting, where in declared.items():
        first = where[0][1]
        extra = dict(first.json_schema_extra) if isinstance(first.json_schema_extra, dict) else {}
        if len(where) == 1:
            # The field's own default is None (so the workload's applies); --help shows the workload's.
            about, extra["shown_default"] = f"{where[0][0]}: {first.description}", shown_default(first)
        elif len({(info.description, shown_default(info)) for _, info in where}) == 1:
            # Every workload's alike (a setting their shared base declares): said once.
            about, extra["shown_default"] = first.description, shown_default(first)
        else:
            about = "; ".join(f"{name}: {info.description} (default {shown_default(info)})" for name, info in where)
        fields[setting] = (Optional[first.annotation], FieldInfo.merge_field_infos(
            first, default=None, description=about, json_schema_extra=extra))
    specs = workloads()
    about = "which workload to run: " + ", ".join(f"{name} ({spec.help})" for name, spec in specs.items()) + \
        "; without it, the one workload whose settings are given (--model: ctr), else the first"
    fields["workload"] = (Literal[tuple(specs)], Field(next(iter(specs)), description=about))
    composed = create_model("UpConfig", __base__=LauncherConfig, **fields)
    composed.workload_settings = settings
    groups: dict[str, tuple[str, ...]] = {}
    for model in (*settings.values(), LauncherConfig):
        for group, names in getattr(model, "flag_groups", {}).items():
            groups[group] = (*groups.get(group, ()), *names)
    composed.flag_groups = groups
    return composed


UpConfig = compose_up_config()


def flags(settings: ConfigBase, fields: tuple[str, ...]) -> list[str]:
    """The role flags that pass on ``settings``' values of ``fields`` (those that are set)."""
    out: list[str] = []
    for f in fields:
        v: Any = getattr(settings, f)
        flag = flag_name(f, type(settings).model_fields[f])
        if isinstance(v, bool):         # argparse's BooleanOptionalAction: --name or --no-name
            out.append(flag if v else f"--no-{flag[2:]}")
        elif v is not None:
            out += [flag, str(v)]
    return out
