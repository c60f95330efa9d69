"""A server's part in cluster checkpoints (its shard), and which checkpoint files rebuild it."""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Optional

import torch

from ps.server.delta import is_delta
from ps.server.service import ParameterServer
from ps.spec.model import ModelSpec
from ps.server.state import same_layout
from ps.spec.sharding import Layout, Slots
from services.checkpoint.handover import Handover, Standing
from services.checkpoint.parts import SnapshotPart
from services.checkpoint.store import CheckpointInfo
from services.errors import CheckpointError

log = logging.getLogger(__name__)


class ServerPart(SnapshotPart):
    def __init__(self, name: str, server: ParameterServer,
                 describe: Callable[[], dict[str, Any]] = lambda: {}) -> None:
        """``describe``: what the manifest should say besides the shard's step (ps0: the step clock)."""
        self.name, self.server, self._describe = name, server, describe
        self._lock = threading.Lock()
        self._buffers: Optional[tuple] = None

    def prepare(self) -> None:
        buffers = self.server.optimizer.copy_buffers()
        with self._lock:
            self._buffers = buffers

    def state_dict(self) -> dict[str, Any]:
        return self.snapshot(None)

    def snapshot(self, base: Optional[int]) -> dict[str, Any]:
        with self._lock:
            buffers, self._buffers = self._buffers, None
        return self.server.export_state(into=buffers, since=base)

    def base_of(self, state: dict[str, Any]) -> Optional[int]:
        return state["delta"]["base"] if is_delta(state) else None

    def settle(self, committed: bool, step: int) -> None:
        with self.server.optimizer.lock:
            self.server.params.touched.settle(committed, step)

    def step(self, state: dict[str, Any]) -> int:
        return int(state["steps"])

    def describe(self, state: dict[str, Any]) -> dict[str, Any]:
        return self._describe()

    def check(self, state: dict[str, Any]) -> None:
        # A poisoned model saved would be restored on every restart, and would push the last good
        # checkpoint out of the ones kept.
        bad = [name for name, value in state["params"].items() if not bool(torch.isfinite(value).all())]
        bad += [f"{name} ({key})" for name, s in state["optim"].items() for key, value in s.items()
                if isinstance(value, torch.Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all())]
        if bad:
            raise CheckpointError(f"{self.name}'s shard holds values that are not finite in {', '.join(bad)}: not "
                                  f"saved, the previous checkpoint stays the newest")


def differences(key: str, saved: Any, mine: Any, most: int = 4) -> str:
    """How a checkpoint's ``key`` differs from this server's, in a few words: the parts that
    differ, down to the values, for a model described by nested mappings."""
    if saved is None and mine is not None:
        return f"no {key} recorded (another model's, or one of an earlier version's)"
    if not isinstance(saved, dict) or not isinstance(mine, dict):
        return f"{key}={_short(saved)}, this server has {_short(mine)}"
    differ = [k for k in sorted(set(saved) | set(mine), key=str) if saved.get(k) != mine.get(k)]
    said = [differences(f"{key}.{k}", saved.get(k), mine.get(k)) for k in differ[:most]]
    return "; ".join(said) + (f"; and {len(differ) - most} more" if len(differ) > most else "")


def _short(value: Any, width: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width - 1] + "…"


def hand_over(part: ServerPart, handover: Handover, standing: Standing) -> None:
    """The leader is gone: keep this server's shard (``part``) for its next life
    (``services/checkpoint/handover.py``), unless it holds values that are not finite."""
    state = part.state_dict()
    try:
        part.check(state)
    except CheckpointError as exc:
        log.error("no handover: %s", exc)
        return
    handover.write(state, standing, int(state["steps"]))
    log.info("handed over this shard at step %d (the cluster stood on %s)", state["steps"],
             standing.checkpoint or "no checkpoint")


def handover_fits(state: dict[str, Any], spec: ModelSpec, slots: Slots, server: str) -> bool:
    """Whether a shard ``state`` a server handed over is ``server``'s under the layout ``slots``,
    of the model ``spec``."""
    return state.get("shard") == slots.position(server) and same_layout(state, Layout.of(spec, slots)) and all(
        state.get("model", {}).get(k) == spec.meta.get(k) for k in spec.compatible)


def own_file(info: CheckpointInfo, slots: Slots) -> bool:
    """Whether ``info`` was taken under the layout ``slots`` (one taken before slots: under the
    first layout over as many servers, which places ids where ``id % num_ps`` did), so that each
    server's own file holds its shard."""
    laid = info.meta.get("layout")
    if laid is None:
        return int(info.meta.get("num_ps", 0)) == slots.num_shards
    before = Slots.from_dict(laid)
    if before.count != slots.count:
        raise CheckpointError(f"{info.id} was taken with {before.count} slots, this job has {slots.count}: the "
                              f"slot count is fixed for a checkpoint chain's life")
    return before.servers == slots.servers and not before.moves(slots)


def shard_files(info: CheckpointInfo, spec: ModelSpec, slots: Slots, server: str) -> list[str]:
    """The files of ``info`` that ``server`` rebuilds its shard from under the layout ``slots``:
    its own, when the checkpoint's layout is the same, or else every old shard's (rows move on
    load, as the difference of the two layouts says). A checkpoint of another model (in the keys
    ``spec.compatible`` names) is refused."""
    saved = info.meta.get("model", {})
    for key in spec.compatible:
        if saved.get(key) != spec.meta.get(key):
            raise CheckpointError(f"{info.id} was taken with {differences(key, saved.get(key), spec.meta.get(key))}; "
                                  f"start with matching flags, --resume-from another, or --no-resume")
    old = int(info.meta.get("num_ps", 0))
    if own_file(info, slots):
        return [f"{server}.pt"]    # the same layout: this shard's own file is all it needs
    laid = info.meta.get("layout")
    names = [f"{n}.pt" for n in laid["servers"]] if laid is not None else [f"ps{k}.pt" for k in range(old)]
    missing = [n for n in names if n not in info.files]
    if missing:
        raise CheckpointError(
            f"{info.id} was taken with {old} servers, each keeping its shard on its own volume "
            f"({', '.join(missing)} are not in {info.path}); changing to {slots.num_shards} servers needs every "
            f"shard: restart with {old} servers, or use one checkpoint folder shared by all servers")
    log.info("resharding %s from %d to %d servers", info.id, old, slots.num_shards)
    return names
