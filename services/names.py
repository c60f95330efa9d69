"""The role-name contract: how RPC names are formatted and parsed.

torch RPC splits its member list on ``-``, so a name containing one breaks the next join for the
whole group; names here are a role word plus an optional index and nothing else.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

ROLES = ("ps", "trainer", "agent", "observer")
# The agent is a singleton; the others are numbered.
_INDEXED = {"ps": True, "trainer": True, "agent": False, "observer": True}
_NAME = re.compile(r"^(ps|trainer|agent|observer)(\d*)$")

LEADER = "ps0"
"""The first parameter server hosts the rendezvous store and decides who may join."""
RL_LEADER = "agent"
"""In the RL workload the agent does (there are no servers)."""


@dataclass(frozen=True)
class RoleName:
    role: str
    index: int | None

    def __str__(self) -> str:
        return self.role if self.index is None else f"{self.role}{self.index}"


def format_name(role: str, index: int | None = None) -> str:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    if _INDEXED[role]:
        if index is None or index < 0:
            raise ValueError(f"role {role!r} needs an index >= 0, got {index!r}")
        return f"{role}{index}"
    if index is not None:
        raise ValueError(f"role {role!r} takes no index, got {index!r}")
    return role


def parse_name(name: str) -> RoleName:
    m = _NAME.match(name)
    if not m:
        raise ValueError(
            f"invalid name {name!r}: expected ps<N>, trainer<N>, observer<N> or agent "
            "(no '-', which torch RPC cannot carry)"
        )
    role, digits = m.group(1), m.group(2)
    if _INDEXED[role] != bool(digits):
        raise ValueError(f"invalid name {name!r}: {role} " + ("needs an index" if _INDEXED[role] else "takes no index"))
    return RoleName(role, int(digits) if digits else None)


def ps_names(num_ps: int) -> list[str]:
    return [format_name("ps", i) for i in range(num_ps)]


def leader_of(name: str) -> str:
    """The member that hosts the rendezvous store and admits ``name``'s workload."""
    return RL_LEADER if parse_name(name).role in ("agent", "observer") else LEADER
