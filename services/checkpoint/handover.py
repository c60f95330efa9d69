"""What a server keeps across the loss of its leader, and how the next leader says it succeeds.

torch 2.13 cannot repair an RPC group whose store host died, so when the leader is lost every
other member restarts and joins the new leader's group (``services/leader.py``). A server's shard
since the last checkpoint would die with it; instead, before it exits, the server writes its shard
as a *handover* into its own checkpoint folder, and its next life restores that instead of the
checkpoint, if and only if the new leader stands where the old one stood:

* the leader keeps a file naming its life while it runs (``LeaderLife``) and removes it when it
  stops cleanly; a leader that finds one left behind announces that it *succeeds* that life;
* a handover names the leader life it served and the checkpoint the cluster stood on then, and
  every checkpoint's manifest names the leader life that committed it.

A handover matching both (or standing on a checkpoint its own leader committed last, unheard of)
is the same cluster one leader later: the server keeps its newer state. So is one written under
the leader that leads now: the leader evicted this server, which left to rejoin.
Any other (a deliberate restart, another checkpoint chosen, a handover older than the last leader)
is discarded with a log line. A handover is used once. No RPC here.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from services.checkpoint.store import atomic_write, sha256_of

log = logging.getLogger(__name__)

HANDOVER_DIR = "handover"
LIFE_FILE = "leader-life.json"
LEADER_LIFE = "leader_life"      # in a checkpoint's manifest: the leader life that committed it
_STATE, _META = "state.pt", "handover.json"


@dataclass(frozen=True)
class Standing:
    """What the leader announces in the rendezvous store: the checkpoint the cluster stands on
    (None: a fresh start), its own life, and the life it succeeds (None: a deliberate start)."""

    checkpoint: Optional[str]
    leader: str
    succeeds: Optional[str] = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Standing":
        data = json.loads(text)
        return cls(data.get("checkpoint"), data["leader"], data.get("succeeds"))


class LeaderLife:
    """The leader's life, in a file of its checkpoint folder while it runs."""

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / LIFE_FILE
        self.life = uuid.uuid4().hex[:12]

    @staticmethod
    def left_behind(folder: Path) -> bool:
        """Whether a leader's life is in ``folder``: the last one did not stop cleanly."""
        return (Path(folder) / LIFE_FILE).exists()

    def begin(self) -> Optional[str]:
        """Record this life; the one a predecessor left behind when it died (None: it stopped cleanly, or none ran)."""
        previous = None
        try:
            previous = json.loads(self.path.read_text())["life"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"life": self.life, "pid": os.getpid(), "started": time.time()}))
        os.replace(tmp, self.path)
        return previous

    def release(self) -> None:
        """A clean stop: the next leader starts a cluster of its own, and takes over no handover."""
        try:
            if json.loads(self.path.read_text())["life"] == self.life:
                self.path.unlink()
        except (OSError, ValueError, KeyError, TypeError):
            pass


class Handover:
    """Server ``name``'s handover in checkpoint folder ``root``: ``<root>/handover/<name>/``."""

    def __init__(self, root: Path, name: str) -> None:
        self.folder = Path(root) / HANDOVER_DIR / name

    def exists(self) -> bool:
        return (self.folder / _META).exists()

    def write(self, state: dict[str, Any], served: Standing, steps: int) -> None:
        """Write ``state`` (a snapshot part's ``state_dict``) atomically: the metadata, written last, makes it one."""
        self.remove()
        self.folder.mkdir(parents=True, exist_ok=True)
        entry = atomic_write(self.folder / _STATE, lambda f: torch.save(state, f))
        meta = {"leader": served.leader, "checkpoint": served.checkpoint, "steps": steps,
                "sha256": entry.sha256, "written": time.time()}
        atomic_write(self.folder / _META, lambda f: f.write(json.dumps(meta).encode()))

    def take(self, standing: Standing, taken_under: Optional[str] = None) -> Optional[tuple[dict[str, Any], dict[str, Any]]]:
        """(the state, its metadata) when the handover here continues what ``standing`` says the
        cluster stands on; otherwise None, and a handover that does not is discarded.
        ``taken_under``: the leader life that committed the checkpoint the cluster stands on. One
        committed by the leader the handover served is one this server's state already contains,
        even if that leader died before the server heard of the commit."""
        try:
            meta = json.loads((self.folder / _META).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            return self._discard(f"its metadata is unreadable ({exc})")
        # Under the same leader life, the server was evicted (stopped or cut off a while) and
        # rejoins the group it left, which could checkpoint nothing without it.
        if meta.get("leader") not in (standing.succeeds, standing.leader):
            return self._discard(f"it was written under leader life {meta.get('leader')}, and the leader now "
                                 f"succeeds {standing.succeeds or 'none (a deliberate start)'}")
        if meta.get("checkpoint") != standing.checkpoint and taken_under != meta.get("leader"):
            return self._discard(f"it continues {meta.get('checkpoint') or 'a fresh start'}, and the cluster "
                                 f"stands on {standing.checkpoint or 'a fresh start'}")
        path = self.folder / _STATE
        if not path.exists() or sha256_of(path) != meta.get("sha256"):
            return self._discard("its state file is missing or does not match its checksum")
        return torch.load(path, weights_only=True, map_location="cpu"), meta

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def _discard(self, why: str) -> None:
        log.warning("discarding the handover in %s: %s", self.folder, why)
        self.remove()
        return None
