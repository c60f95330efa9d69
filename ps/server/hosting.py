"""`rpcps ps`: the parameter server, hosting whichever workload ``--workload`` names.

A workload hosted on the servers declares a ``HostedSpec`` (``services/workload.py``): its server
settings (``PsConfig`` and its model's), the function from them to the ``ModelSpec`` the servers
host, and the role that trains against them. Nothing here names a workload.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from services.workload import RoleSpec, hosted, resolve

if TYPE_CHECKING:       # the role is imported when it runs: the registry stays light (no torch)
    from ps.server.role import PsRole

ROLE = RoleSpec("ps", "ps.spec.config:PsConfig", "ps.server.status:PsStatus", "ps.server.hosting:host",
                "run one parameter server, hosting the model of --workload", metric_families="ps.server.metrics:PsMetrics",
                hosting=True, leader="ps0", routes="ps.server.routes:add_routes")


def host(cfg: Any, ctx: Any) -> "PsRole":
    """The server role for the workload ``cfg.workload`` names (its settings class made ``cfg``)."""
    from ps.server.role import PsRole
    server = hosted(cfg.workload).server
    model = resolve(server.model)
    return PsRole(cfg, ctx, lambda: counted_if_asked(model(cfg), cfg.count_updates), client_role=server.client_role)


def counted_if_asked(spec: Any, count: bool) -> Any:
    """``spec``, its updates counted with ``--count-updates`` (``ps/spec/counting.py``); a model
    that cannot be counted is a ``ConfigError`` saying why."""
    if not count:
        return spec
    from ps.spec.counting import counting
    from services.errors import ConfigError
    try:
        return counting(spec)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
