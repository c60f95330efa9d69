"""The role-name contract: how RPC names are formatted and parsed.

A name is a registered role's word plus an index (``ps0``, ``trainer3``, ``observer1``), or the word
alone for a role of one (``agent``); the roles and the leader of each workload come from the
workloads' specs (``services/workload.py``). torch RPC splits its member list on ``-``, so a name
containing one breaks the next join for the whole group: names here carry nothing else.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from services.workload import roles, workload_of

_NAME = re.compile(r"^([a-z]+)(\d*)$")


@dataclass(frozen=True)
class RoleName:
    role: str
    index: int | None

    def __str__(self) -> str:
        return self.role if self.index is None else f"{self.role}{self.index}"


def format_name(role: str, index: int | None = None) -> str:
    spec = roles().get(role)
    if spec is None:
        raise ValueError(f"unknown role {role!r}; expected one of {', '.join(roles())}")
    if spec.indexed:
        if index is None or index < 0:
            raise ValueError(f"role {role!r} needs an index >= 0, got {index!r}")
        return f"{role}{index}"
    if index is not None:
        raise ValueError(f"role {role!r} takes no index, got {index!r}")
    return role


def parse_name(name: str) -> RoleName:
    m = _NAME.match(name)
    spec = roles().get(m.group(1)) if m else None
    if spec is None:
        forms = ", ".join(f"{r.name}<N>" if r.indexed else r.name for r in roles().values())
        raise ValueError(f"invalid name {name!r}: expected {forms} (no '-', which torch RPC cannot carry)")
    role, digits = m.group(1), m.group(2)
    if spec.indexed != bool(digits):
        raise ValueError(f"invalid name {name!r}: {role} " + ("needs an index" if spec.indexed else "takes no index"))
    return RoleName(role, int(digits) if digits else None)


def leader_of(name: str) -> str:
    """The member that hosts the rendezvous store and admits ``name``'s workload."""
    role = parse_name(name).role
    return roles()[role].leader or workload_of(role).leader
