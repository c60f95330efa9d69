"""Typed configuration: what every role's settings share, and how flags and variables fill them.

Each role's own model lives beside its owner (``ps/spec/config.py``, ``trainer/<workload>/config.py``);
every field can be set by a flag (``--field-name``) or an environment variable (``RPCPS_FIELD_NAME``);
flags win. Rendezvous uses torch's own ``MASTER_ADDR``/``MASTER_PORT``, unless ``--ps-addr`` says
otherwise (under torchrun those are the workers' own). ``load`` is pure: it takes
the environment as an argument, so tests need no monkeypatching.
"""
from __future__ import annotations

import argparse
import enum
import logging
import os
import tempfile
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from services.errors import ConfigError
from services.failpoints import VARIABLE as FAILPOINTS
from services.names import parse_name
from services.workload import EXTRA

log = logging.getLogger(__name__)

ENV_PREFIX = "RPCPS_"
# Fields read from torch's standard variables instead of RPCPS_*.
_TORCH_ENV = {"master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT"}


def _extra(info: Any, key: str) -> Any:
    extra = getattr(info, "json_schema_extra", None)
    return extra.get(key) if isinstance(extra, dict) else None


def env_name(field: str, info: Any = None) -> str:
    return _extra(info, "env") or _TORCH_ENV.get(field, ENV_PREFIX + field.upper())


def flag_name(field: str, info: Any = None) -> str:
    return _extra(info, "flag") or "--" + field.replace("_", "-")


def dest_name(field: str, info: Any = None) -> str:
    """Where argparse keeps a field's flag: named after the flag, which may differ from the field
    (``--ps`` fills ``num_ps``), so a parsed ``vars(args)`` is keyed as the command line reads."""
    return flag_name(field, info)[2:].replace("-", "_")


class ConfigBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CommonConfig(ConfigBase):
    flag_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "cluster": ("name", "master_addr", "master_port", "ps_addr", "sidecar_host", "sidecar_port", "control_token",
                    "http_read_timeout", "threads", "rpc_timeout", "join_timeout", "rpc_transport",
                    "rpc_channel"),
        "checkpoints": ("checkpoint_dir",),
        "failures": ("restarts_in_a_row", "lease_timeout", "requeue_job"),
        "output": ("log_level",),
    }
    name: str = Field(description="RPC name of this process (ps0, trainer1, ...)")
    master_addr: str = Field("127.0.0.1", description="address of the leader (ps0, or the RL agent), which hosts the rendezvous store")
    master_port: int = Field(29500, ge=1, le=65535, description="port of the rendezvous store on the leader")
    ps_addr: Optional[str] = Field(None, description="HOST:PORT of the leader's rendezvous store; wins over "
                                                     "MASTER_ADDR/MASTER_PORT (which torchrun sets for its workers' own group)")
    sidecar_host: str = Field("127.0.0.1", description="address the HTTP sidecar binds")
    sidecar_port: int = Field(8080, ge=0, le=65535, description="port of the HTTP sidecar (0: any free port)")
    http_read_timeout: float = Field(10.0, gt=0, le=3600, description="seconds a client has to send the sidecar a "
                                                                     "whole request, headers and body (slower: 408 "
                                                                     "and the connection closed)")
    checkpoint_dir: Path = Field(Path("checkpoints"), description="folder of the cluster checkpoints")
    control_token: Optional[SecretStr] = Field(None, description="bearer token required by the routes that change "
                                                                 "state (POST /checkpoint, /episode/*)")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    threads: int = Field(1, ge=1, le=256, description="torch intra-op threads (1 is steadiest on small hosts)")
    rpc_timeout: float = Field(60.0, gt=0, description="seconds before an RPC fails")
    join_timeout: float = Field(300.0, gt=0, description="seconds to wait for the cluster when joining")
    rpc_transport: Literal["uv", "shm"] = Field(
        "uv", description="TensorPipe transport: uv (TCP) or shm (lower latency, but busy-polls a core)")
    rpc_channel: Literal["basic", "multiplexed"] = Field(
        "basic", description="how tensors cross to another host: basic (on the message's own connection) or "
                             "multiplexed (TensorPipe's default: 16 more loop threads a process and 16 more "
                             "connections a peer, for fast links); between processes of one machine they are "
                             "copied (cma) either way")
    restarts_in_a_row: int = Field(0, ge=0, description="deaths in a row before this start, as its supervisor "
                                                        "counts them (rpcps up sets it): a crash loop shows in the metrics")
    lease_timeout: Optional[float] = Field(None, ge=2, le=600, description="exit (code 76) when the supervisor has not "
                                                                           "renewed this member's lease on /healthz for "
                                                                           "this many seconds (rpcps up sets it to its "
                                                                           "--member-timeout; default: no lease)")
    requeue_job: Optional[str] = Field(None, pattern=r"^[0-9]+(_[0-9]+)?$",
                                       description="Slurm job to requeue when this member's lease runs out and its "
                                                   "leader's store is out of reach too (the batch node, where rpcps "
                                                   "up runs, is lost); rpcps up --slurm sets it")

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        parse_name(v)
        return v

    @model_validator(mode="before")
    @classmethod
    def _rendezvous_at_ps_addr(cls, values: Any) -> Any:
        if isinstance(values, dict) and values.get("ps_addr"):
            host, port = host_and_port(str(values["ps_addr"]), "--ps-addr / RPCPS_PS_ADDR")
            values = {**values, "master_addr": host, "master_port": port}
        return values

    @field_validator("checkpoint_dir")
    @classmethod
    def _writable_folder(cls, v: Path) -> Path:
        return writable_folder(v)

    def _check_role(self, role: str) -> None:
        if parse_name(self.name).role != role:
            raise ValueError(f"name {self.name!r} is not a {role} name")


class RestoringConfig(ConfigBase):
    """A role that saves state in checkpoints and starts from them."""

    flag_groups: ClassVar[dict[str, tuple[str, ...]]] = {"checkpoints": ("resume", "resume_from", "keep_checkpoints")}

    resume: bool = Field(True, description="start from the newest valid checkpoint in --checkpoint-dir")
    resume_from: Optional[str] = Field(None, description="start from this checkpoint (step-N or its path)")
    keep_checkpoints: int = Field(3, ge=1, description="newest checkpoints kept; older ones removed after a newer completes")


class LeaderConfig(ConfigBase):
    """What the leader (ps0, the agent) uses to watch the group's members."""

    flag_groups: ClassVar[dict[str, tuple[str, ...]]] = {"failures": ("probe_interval", "probe_failures"),
                                                         "cluster": ("store_host",)}

    probe_interval: float = Field(1.0, gt=0, description="seconds between liveness probes of members (leader)")
    probe_failures: int = Field(2, ge=1, description="failed probes in a row before a member is evicted (leader)")
    store_host: Optional[str] = Field(None, description="address the rendezvous store listens on (default: the "
                                                        "address --master-addr names, if it is this host's; else "
                                                        "every interface)")


def _plain_type(annotation: Any) -> Any:
    """The non-None member of Optional[X], else the annotation."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


# The order `--help` lists a command's flag groups in; a field's group is its owner's ``flag_groups``.
GROUPS = ("cluster", "workload", "consistency", "checkpoints", "failures", "output")


def group_of(model: type[BaseModel], field: str, default: str) -> str:
    """The help group of ``field``: the nearest class of ``model`` that names it in its
    ``flag_groups`` (a ``ClassVar`` mapping group -> fields) says which."""
    for cls in model.__mro__:
        for group, fields in vars(cls).get("flag_groups", {}).items():
            if field in fields:
                return group
    return default


def shown_default(info: Any) -> Optional[str]:
    """A field's default as ``--help`` shows it (None: no default worth showing)."""
    shown = _extra(info, "shown_default")
    if shown is not None:
        return shown
    if info.is_required() or info.default is None:
        return None
    value = info.default
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value.value if isinstance(value, enum.Enum) else value)


def help_text(field: str, info: Any) -> str:
    """``description (default: X) [env VAR]``: what ``--help`` says of one setting."""
    default = shown_default(info)
    aliases = (_extra(info, "aliases") or ())
    parts = [info.description or "", f"(default: {default})" if default is not None else "",
             f"(also {', '.join(aliases)})" if aliases else "", f"[env {env_name(field, info)}]"]
    return " ".join(p for p in parts if p).replace("%", "%%")


def add_flags(parser: argparse.ArgumentParser, model: type[BaseModel], skip: tuple[str, ...] = (),
              default_group: str = "workload") -> None:
    """One flag per field, in the groups the model's ``flag_groups`` name. Values stay strings
    (None when absent) so pydantic validates them and names the field in its error, the same way
    for flags and variables; a field's old spellings (``aliases``) fill the same value, unlisted."""
    fields = [(f, i) for f, i in model.model_fields.items() if f not in skip]
    named = {f: group_of(model, f, default_group) for f, _ in fields}
    order = [g for g in GROUPS if g in named.values()] + sorted(set(named.values()) - set(GROUPS))
    groups = {g: parser.add_argument_group(f"{g} settings") for g in order}
    for field, info in fields:
        kind = _plain_type(info.annotation)
        flag, dest, group = flag_name(field, info), dest_name(field, info), groups[named[field]]
        if kind is bool:
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text(field, info))
            continue
        choices = typing.get_args(kind) if typing.get_origin(kind) is Literal else None
        # With choices, argparse's own metavar lists them: `--optimizer {sgd,adagrad}`.
        group.add_argument(flag, dest=dest, default=None, choices=choices,
                           metavar=None if choices else dest.upper(), help=help_text(field, info))
        for alias in _extra(info, "aliases") or ():
            parser.add_argument(alias, dest=dest, default=None, choices=choices, help=argparse.SUPPRESS)


def load(model: type[ConfigBase], flags: Mapping[str, Any], environ: Mapping[str, str]) -> Any:
    """Merge environment and flags (flags win) and validate; raise ConfigError naming the source."""
    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    for field, info in model.model_fields.items():
        for var in (*(_extra(info, "env_aliases") or ()), env_name(field, info)):   # the current name wins
            if var in environ and environ[var] != "":
                values[field], source[field] = environ[var], f"environment variable {var}"
        if flags.get(dest_name(field, info)) is not None:
            values[field], source[field] = flags[dest_name(field, info)], f"flag {flag_name(field, info)}"
    known = {v for f, i in model.model_fields.items() for v in (env_name(f, i), *(_extra(i, "env_aliases") or ()))}
    known.update((EXTRA, FAILPOINTS))   # read by the workload registry and the failpoints, not by settings
    for var in environ:
        # Shared environments (compose, k8s) set variables for several roles at once; only warn.
        if var.startswith(ENV_PREFIX) and var not in known:
            log.warning("ignoring %s: %s has no such setting", var, model.__name__)
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = str(err["loc"][0]) if err["loc"] else ""
            info = model.model_fields.get(field)
            if info is None:        # a check across fields, which names what it is about itself
                problems.append(explain(err["msg"]))
                continue
            where = source.get(field, f"{flag_name(field, info)} / {env_name(field, info)}")
            problems.append(explain(err["msg"], where, values.get(field)))
        raise ConfigError("invalid configuration: " + "; ".join(problems)) from None


def host_and_port(value: str, what: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for an IPv6 address) split, or ``ValueError`` naming ``what``."""
    host, sep, port = value.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{what}: expected HOST:PORT with a port from 1 to 65535, got {value!r}")
    return host, int(port)


def writable_folder(path: Path) -> Path:
    """``path`` if it is a folder this process can write in, or can create; else ``ValueError``
    saying why (checked at start: a checkpoint that cannot be written fails only when it is due).
    Tried for real, not by permission bits alone: root passes every ``access`` check, yet cannot
    make a folder under ``/proc`` or on a read-only mount."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} is a file, not a folder")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{path} cannot be made: {existing} is a file")
    try:
        if existing == path:
            tempfile.TemporaryFile(dir=path).close()
        else:   # a folder of its own, made and taken away again: the servers starting beside this
            # one may be making the same path at this moment
            os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".rpcps-probe-"))
    except OSError as exc:
        where = "written" if existing == path else f"made in {existing.resolve()}"
        raise ValueError(f"{path} cannot be {where}: {exc.strerror or exc}") from None
    return path


def explain(msg: str, where: Optional[str] = None, value: Any = None) -> str:
    """A pydantic error message as a sentence: where the setting came from, what is wrong, and
    the value given (unless the message names it already, as a path it checked does)."""
    message = msg.removeprefix("Value error, ")
    if where is None:
        return message
    got = f", got {value!r}" if value is not None and str(value) not in message else ""
    return f"{where}: {message}{got}"
