"""Where everything lives: pure values computed before any RPC.

**Slots and an epoch.** The leader owns one ``Slots``: every row-wise or hashed table's ids fall
into a fixed number of slots (id ``x`` in slot ``x % count``, the same slot in every table), and
each slot has one owning server; each table kept whole, and each dense group, has a home server.
The epoch rises with every change. Adding one server to N moves about 1/(N+1) of the slots (the
difference of two layouts, ``Slots.moves``), where ``id % N`` would move N/(N+1) of the rows. The
count is fixed for the life of a checkpoint chain, which records it.

Each table is placed as its ``Table.placement`` says (as TorchRec's ``ParameterSharding``):

* **row-wise** (``ShardPlan``), for big tables: row ``id`` on the owner of its slot. A server
  keeps a table's rows as a grid of ``W`` columns, a column for each slot it holds (its
  ``Columns``, the same for every table): local row ``(id // count) * W + c``, where ``c`` is the
  column of ``id``'s slot. Its first columns are its slots in rising order, so that it keeps its
  ids in rising order; when a change of layout takes slots away their columns stay, empty, and
  slots that come take empty columns, so that what stays never moves (``Columns.after``). A
  table of fewer than ``GRID_DEPTH`` ids a slot is packed instead: its ids rising, no row empty;
* **table-wise** (``WholePlan``), for tables smaller than the server count: the whole table on its
  home server;
* **hashed** (``HashedPlan``), for a table keyed by raw 64-bit ids: id ``id`` on the owner of slot
  ``id % count``, at whichever row that server's index gives it (``ps/server/hashed/``).

Unsaid, a table is row-wise when the first layout gives it a row per server. The first layout deals
the slots out in turn (slot ``s`` to server ``s % N``) over a count that N divides, so it places
every id where ``id % N`` did: a checkpoint from before slots restores as it was saved.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch

from ps.spec.model import ModelSpec

MIN_SLOTS = 4096    # slots at least: a server added then moves within a slot of its share


def slot_count(num_servers: int, at_least: int = MIN_SLOTS) -> int:
    """The slots of a new layout: ``at_least``, rounded up to a multiple of the first server count."""
    return -(-at_least // num_servers) * num_servers


def table_unit(table: str) -> str:
    return f"table:{table}"


def dense_unit(group: int) -> str:
    return f"dense:{group}"


@dataclass(frozen=True)
class Move:
    """One part of a change of layout: a slot, or a unit kept whole, that changes owner."""

    what: str               # "slot:<s>" or a unit's name
    source: str
    destination: str


@dataclass(frozen=True)
class Slots:
    """Who owns what, as of ``epoch``: the leader's; every other member holds a copy."""

    epoch: int
    servers: tuple[str, ...]
    owners: tuple[int, ...]                  # slot -> its server's index in ``servers``
    homes: tuple[tuple[str, int], ...] = ()  # (unit, server index): tables kept whole and dense groups

    def __post_init__(self) -> None:
        if self.epoch < 1:
            raise ValueError(f"a layout's epoch starts at 1, got {self.epoch}")
        if not self.servers or len(set(self.servers)) != len(self.servers):
            raise ValueError(f"a layout names each of its servers once, got {list(self.servers)}")
        if not self.owners:
            raise ValueError("a layout has one slot at least")
        n = len(self.servers)
        if min(self.owners) < 0 or max(self.owners) >= n or any(not 0 <= k < n for _, k in self.homes):
            raise ValueError(f"a layout's owners must be among its {n} servers")

    @classmethod
    def even(cls, servers: "int | Iterable[str]", count: Optional[int] = None,
             units: Iterable[str] = ()) -> "Slots":
        """The first layout: slots dealt out in turn, the ``i``-th unit on server ``i % N``
        (``units``: the names of the tables kept whole and the dense groups, in the model's order
        of each); ``servers``: their names, or how many (``ps0`` …)."""
        names = tuple(f"ps{k}" for k in range(servers)) if isinstance(servers, int) else tuple(servers)
        count = count or slot_count(len(names))
        return cls(1, names, tuple(s % len(names) for s in range(count)),
                   tuple((u, i % len(names)) for i, u in enumerate(units)))

    @property
    def count(self) -> int:
        return len(self.owners)

    @property
    def num_shards(self) -> int:
        return len(self.servers)

    def index(self, server: str) -> int:
        try:
            return self.servers.index(server)
        except ValueError:
            raise KeyError(f"{server} holds no part of layout {self.epoch} (its servers: "
                           f"{', '.join(self.servers)})") from None

    def position(self, server: str) -> int:
        """``server``'s index, or, for a server the layout does not name (one that joined and
        holds nothing yet), one past the last: a shard that owns nothing."""
        return self.servers.index(server) if server in self.servers else self.num_shards

    def home(self, unit: str) -> int:
        return dict(self.homes)[unit]

    def has_home(self, unit: str) -> bool:
        return any(u == unit for u, _ in self.homes)

    @functools.cached_property
    def owner_of(self) -> torch.Tensor:
        """[count] int64: each slot's owner."""
        return torch.tensor(self.owners, dtype=torch.int64)

    @functools.cached_property
    def owned(self) -> torch.Tensor:
        """[servers] int64: how many slots each owns."""
        return torch.bincount(self.owner_of, minlength=self.num_shards)

    @functools.cached_property
    def before(self) -> torch.Tensor:
        """[count] int64: how many slots of the same owner come before each slot."""
        out = torch.empty(self.count, dtype=torch.int64)
        for k in range(self.num_shards):
            mine = (self.owner_of == k).nonzero().squeeze(1)
            out[mine] = torch.arange(mine.numel())
        return out

    def dense_homes(self) -> list[int]:
        """The servers that hold a dense group, rising."""
        return sorted({k for u, k in self.homes if u.startswith("dense:")})

    def slots_of(self, shard: int) -> torch.Tensor:
        return (self.owner_of == shard).nonzero().squeeze(1)

    def moves(self, new: "Slots") -> list[Move]:
        """The difference of two layouts of the same slots: what changes owner, by server name."""
        if new.count != self.count:
            raise ValueError(f"layouts of {self.count} and {new.count} slots: the slot count is fixed for a "
                             f"checkpoint chain's life")
        out = [Move(f"slot:{s}", self.servers[a], new.servers[b]) for s, (a, b) in enumerate(zip(self.owners, new.owners))
               if self.servers[a] != new.servers[b]]
        before, after = dict(self.homes), dict(new.homes)
        out += [Move(u, self.servers[before[u]], new.servers[after[u]]) for u in before
                if u in after and self.servers[before[u]] != new.servers[after[u]]]
        return out

    def rebalanced(self, servers: Iterable[str]) -> "Slots":
        """The next layout (epoch + 1) over ``servers``, moving as little as it can: the slots of a
        server that leaves, and what each remaining server holds past its even share, go to the
        servers under theirs; a unit kept whole moves only when its server leaves."""
        names = tuple(servers)
        if not names or len(set(names)) != len(names):
            raise ValueError(f"a layout names each of its servers once, got {list(names)}")
        base, extra = divmod(self.count, len(names))
        held: dict[str, list[int]] = {n: [] for n in names}
        loose: list[int] = []
        for s, k in enumerate(self.owners):
            (held[self.servers[k]] if self.servers[k] in held else loose).append(s)
        # The servers holding most keep the ``extra`` one-more shares: fewer slots move.
        order = sorted(names, key=lambda n: (-len(held[n]), names.index(n)))
        share = {n: base + (1 if i < extra else 0) for i, n in enumerate(order)}
        # A server gives slots spread evenly over those it holds, and each loose slot goes to the
        # server with the most still to take: a table smaller than the slot count lives in the
        # low slots only, and so still spreads over every server.
        for n in names:
            give = len(held[n]) - share[n]
            if give > 0:
                picked = {int((i + 0.5) * len(held[n]) / give) for i in range(give)}
                loose += [s for i, s in enumerate(held[n]) if i in picked]
                held[n] = [s for i, s in enumerate(held[n]) if i not in picked]
        need = {n: share[n] - len(held[n]) for n in names}
        for s in sorted(loose):
            taker = max(names, key=lambda n: (need[n], -names.index(n)))
            held[taker].append(s)
            need[taker] -= 1
        owners = [0] * self.count
        for n, slots in held.items():
            for s in slots:
                owners[s] = names.index(n)
        homes = []
        load = {n: sum(1 for _, k in self.homes if self.servers[k] == n) for n in names}
        for unit, k in self.homes:
            now = self.servers[k]
            if now not in load:
                now = min(names, key=lambda n: (load[n], names.index(n)))
                load[now] += 1
            homes.append((unit, names.index(now)))
        return Slots(self.epoch + 1, names, tuple(owners), tuple(homes))

    def to_dict(self) -> dict[str, Any]:
        """As JSON holds it (a checkpoint's manifest, the rendezvous store)."""
        return {"epoch": self.epoch, "servers": list(self.servers), "owners": list(self.owners),
                "homes": {u: k for u, k in self.homes}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Slots":
        return cls(int(data["epoch"]), tuple(data["servers"]), tuple(int(k) for k in data["owners"]),
                   tuple((str(u), int(k)) for u, k in data.get("homes", {}).items()))

    def describe(self) -> dict[str, Any]:
        """For ``/status``: the epoch, and slots and units per server."""
        owned = self.owned.tolist()
        return {"epoch": self.epoch, "slots": self.count,
                "servers": {n: {"slots": owned[k], "units": [u for u, h in self.homes if h == k]}
                            for k, n in enumerate(self.servers)}}


NO_ID = -1     # the id of a row that holds none: an empty column's, or past a table's last id
# A row-wise table of this many ids a slot or more is kept as a grid (``ShardPlan.gridded``): its
# rows past its last id, at most one of the grid's, are under a sixteenth of it.
GRID_DEPTH = 16


@dataclass(frozen=True)
class Columns:
    """Where one server keeps the slots it holds, in every row-wise table (``ShardPlan``): slot
    ``s`` in column ``of[s]`` (-1: not here) of ``width``; server-local, never sent."""

    shard: int
    of: tuple[int, ...]         # slot -> its column here, or -1
    width: int

    @classmethod
    def first(cls, slots: Slots, shard: int) -> "Columns":
        """The slots ``shard`` owns in rising order, with no empty column: its ids rising."""
        mine = slots.owner_of == shard
        return cls(shard, tuple(torch.where(mine, slots.before, -1).tolist()), int(mine.sum()))

    def after(self, slots: Slots, shard: int) -> Optional["Columns"]:
        """The columns by the next layout ``slots``: the slots that stay where they were, those
        that leave leave their columns empty, those that come take columns empty before the change
        (lowest first); None when those are too few (the storage would grow: every row moves)."""
        was = torch.tensor(self.of, dtype=torch.int64)
        mine = slots.owner_of == shard
        now = torch.where(mine, was, -1)
        coming = (mine & (was < 0)).nonzero().squeeze(1)
        # Those coming are copied in while those leaving are still served: only columns empty now.
        used = torch.zeros(self.width, dtype=torch.bool)
        used[was[was >= 0]] = True
        empty = (~used).nonzero().squeeze(1)
        if coming.numel() > empty.numel():
            return None
        now[coming] = empty[:coming.numel()]
        return Columns(shard, tuple(now.tolist()), self.width)

    @functools.cached_property
    def column_of(self) -> torch.Tensor:
        """[count] int64: each slot's column here, -1 where it is not held."""
        return torch.tensor(self.of, dtype=torch.int64)

    @functools.cached_property
    def slot_at(self) -> torch.Tensor:
        """[width] int64: each column's slot, -1 where it is empty."""
        out = torch.full((self.width,), -1, dtype=torch.int64)
        held = (self.column_of >= 0).nonzero().squeeze(1)
        out[self.column_of[held]] = held
        return out


def _slot_sizes(num_ids: int, count: int) -> torch.Tensor:
    """[count]: how many of the ids 0 .. num_ids - 1 fall into each slot."""
    return ((num_ids - torch.arange(count) + count - 1) // count).clamp(min=0)


@functools.lru_cache(maxsize=64)
def _first_columns(slots: Slots, shard: int) -> Columns:
    return Columns.first(slots, shard)


def columns_on(columns: Optional[Columns], slots: Slots, shard: int) -> Columns:
    """Where shard ``shard`` keeps its slots: ``columns`` if they are its own, else its first."""
    return columns if columns is not None and columns.shard == shard else _first_columns(slots, shard)


@dataclass(frozen=True)
class ShardPlan:
    """One id space (a table's rows, ids 0 .. num_ids - 1) over the slots of a layout; on a server,
    with that server's ``columns`` (for other shards, and without: their first columns).

    A table of ``GRID_DEPTH`` ids a slot or more (``gridded``) is kept as a full grid, ``rows`` =
    ``ceil(num_ids / count) * width``: the rows of a column past the table's last id, and an empty
    column's, hold no id (``NO_ID``). A smaller one is *packed*: its ids in rising order, the grid
    of its first columns cut after its last id, whatever ``columns`` say; a change of layout lays it
    out again, which costs little."""

    slots: Slots
    num_ids: int
    columns: Optional[Columns] = None

    def __post_init__(self) -> None:
        if self.num_ids < 1:
            raise ValueError(f"a table has one row at least, got {self.num_ids}")

    @property
    def num_shards(self) -> int:
        return self.slots.num_shards

    @property
    def id_max(self) -> int:
        """The largest id a request may name."""
        return self.num_ids - 1

    def columns_of(self, shard: int) -> Columns:
        return columns_on(self.columns if self.gridded else None, self.slots, shard)

    @property
    def depth(self) -> int:
        """A column's rows: ``ceil(num_ids / count)``."""
        return -(-self.num_ids // self.slots.count)

    @property
    def gridded(self) -> bool:
        """Whether it is kept as a grid whose columns a change of layout keeps (``Columns``)."""
        return self.depth >= GRID_DEPTH

    def rows(self, shard: int) -> int:
        """Shard ``shard``'s rows of storage (its tensors' length)."""
        return self.depth * self.columns_of(shard).width if self.gridded else self.held(shard)

    def held(self, shard: int) -> int:
        """How many ids shard ``shard`` owns."""
        return int(_slot_sizes(self.num_ids, self.slots.count)[self.slots.owner_of == shard].sum())

    def global_ids(self, shard: int) -> torch.Tensor:
        """The id of each of shard ``shard``'s rows, ``NO_ID`` where a row holds none."""
        return self.ids_at(shard, torch.arange(self.rows(shard)))

    def ids_at(self, shard: int, rows: torch.Tensor) -> torch.Tensor:
        """The ids of shard ``shard``'s ``rows``: ``global_ids(shard)[rows]``, without them all."""
        if not self.gridded:
            mine = self.slots.slots_of(shard)
            return (rows // mine.numel()) * self.slots.count + mine[rows % mine.numel()]
        columns = self.columns_of(shard)
        if not columns.width:
            return torch.full_like(rows, NO_ID)
        slot = columns.slot_at[rows % columns.width]
        ids = (rows // columns.width) * self.slots.count + slot
        return torch.where((slot >= 0) & (ids < self.num_ids), ids, NO_ID)

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        return self.slots.owner_of[ids % self.slots.count]

    def to_local(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids`` on this server (``columns``'; without, or packed, the first columns of
        each id's owner)."""
        slot = ids % self.slots.count
        if self.columns is None or not self.gridded:
            return (ids // self.slots.count) * self.slots.owned[self.slots.owner_of[slot]] + self.slots.before[slot]
        return (ids // self.slots.count) * self.columns.width + self.columns.column_of[slot]

    def partition(self, unique_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per shard: (positions in ``unique_ids``, the global ids there), positions rising."""
        if self.num_shards == 1:
            return [(torch.arange(unique_ids.numel()), unique_ids)]
        owners = self.owner(unique_ids)
        out = []
        for shard in range(self.num_shards):
            pos = (owners == shard).nonzero(as_tuple=True)[0]
            out.append((pos, unique_ids[pos]))
        return out


@dataclass(frozen=True)
class HashedPlan(ShardPlan):
    """A hashed table (``ps/server/hashed/``): raw 64-bit id ``id`` (any int64, negative too) on
    the owner of slot ``id % count``, in whichever of its rows its index gives it; ``num_ids`` is
    the table's capacity in rows, each server's share as many as it would own of ids 0 .. num_ids - 1."""

    @property
    def id_max(self) -> int:
        return torch.iinfo(torch.int64).max

    def rows(self, shard: int) -> int:
        """Its share of the capacity; one row at least (an index holds one), also on a server
        that owns no slot."""
        return max(1, super().held(shard))

    def held(self, shard: int) -> int:
        return self.rows(shard)

    def global_ids(self, shard: int) -> torch.Tensor:
        raise TypeError("a hashed table's rows have no fixed ids: ask its index")

    def ids_at(self, shard: int, rows: torch.Tensor) -> torch.Tensor:
        raise TypeError("a hashed table's rows have no fixed ids: ask its index")

    def to_local(self, ids: torch.Tensor) -> torch.Tensor:
        raise TypeError("a hashed table's ids find their rows in its index")


@dataclass(frozen=True)
class WholePlan:
    """One id space kept whole on its home, shard ``home``: ``ShardPlan``'s interface."""

    slots: Slots
    num_ids: int
    home: int

    def __post_init__(self) -> None:
        if not 0 <= self.home < self.num_shards:
            raise ValueError(f"home {self.home} is not a shard of {self.num_shards}")

    @property
    def num_shards(self) -> int:
        return self.slots.num_shards

    @property
    def id_max(self) -> int:
        return self.num_ids - 1

    def rows(self, shard: int) -> int:
        return self.num_ids if shard == self.home else 0

    def held(self, shard: int) -> int:
        return self.rows(shard)

    def global_ids(self, shard: int) -> torch.Tensor:
        return torch.arange(self.num_ids if shard == self.home else 0)

    def ids_at(self, shard: int, rows: torch.Tensor) -> torch.Tensor:
        return rows

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.full_like(ids, self.home)

    def to_local(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def partition(self, unique_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        nothing = torch.empty(0, dtype=torch.long)
        return [(torch.arange(unique_ids.numel()), unique_ids) if k == self.home else (nothing, nothing)
                for k in range(self.num_shards)]


Plan = ShardPlan | HashedPlan | WholePlan

PLACEMENTS = ("row_wise", "table_wise", "hashed")


def kept_whole(spec: ModelSpec, num_servers: int) -> list[str]:
    """The tables a first layout over ``num_servers`` keeps whole: table-wise ones, and those left
    unsaid with fewer rows than servers."""
    out = []
    for name, table in spec.tables.items():
        if table.placement not in ("", *PLACEMENTS):
            raise ValueError(f"unknown placement {table.placement!r}: row_wise, table_wise or hashed")
        if not table.hashed and (table.placement == "table_wise" or (not table.placement and table.rows < num_servers)):
            out.append(name)
    return out


def first_slots(spec: ModelSpec, servers: "int | Iterable[str]", count: Optional[int] = None) -> Slots:
    """The first layout of ``spec``'s model: each table kept whole at home on server ``t % N`` for
    the ``t``-th table of the model, dense group ``g`` on ``g % N`` (as before slots)."""
    names = tuple(f"ps{k}" for k in range(servers)) if isinstance(servers, int) else tuple(servers)
    whole = set(kept_whole(spec, len(names)))
    base = Slots.even(names, count)
    homes = [(table_unit(t), i % len(names)) for i, t in enumerate(spec.tables) if t in whole]
    homes += [(dense_unit(g), g % len(names)) for g in range(len(spec.dense))]
    return Slots(1, base.servers, base.owners, tuple(homes))


def resumed_slots(spec: ModelSpec, servers: Iterable[str], saved: Optional[dict[str, Any]]) -> Slots:
    """The layout a job over ``servers`` starts with, given the one its checkpoint ``saved``
    (``Slots.to_dict``): that one, on the same servers; moved onto others by the fewest slots, as
    the difference of two layouts (its epoch one more); the first layout when the checkpoint
    names none (one taken before slots) or there is no checkpoint."""
    names = tuple(servers)
    if saved is None:
        return first_slots(spec, names)
    slots = Slots.from_dict(saved)
    return slots if slots.servers == names else slots.rebalanced(names)


def plan_of(slots: Slots, table: str, num_ids: int, hashed: bool = False,
            columns: Optional[Columns] = None) -> Plan:
    """Table ``table``'s plan under ``slots``: kept whole if it has a home there; ``columns``: a
    server's own, for a row-wise table."""
    if slots.has_home(table_unit(table)):
        return WholePlan(slots, num_ids, slots.home(table_unit(table)))
    if hashed:       # raw ids spread over every shard: each needs a row at least
        return HashedPlan(slots, max(num_ids, slots.num_shards))
    return ShardPlan(slots, num_ids, columns)


def placement_of(plan: Plan) -> tuple[str, int]:
    """(kind, home) as a server tells it to its clients (home: 0 unless table-wise)."""
    if isinstance(plan, WholePlan):
        return "table_wise", plan.home
    return ("hashed" if isinstance(plan, HashedPlan) else "row_wise"), 0


@dataclass(frozen=True)
class Layout:
    """A model's tables and dense groups over the servers of a ``Slots``."""

    slots: Slots
    plans: dict[str, Plan]                         # per table
    table_params: dict[str, tuple[str, ...]]       # per table, its parameters
    dense_groups: tuple[tuple[str, ...], ...]      # the g-th group's parameters
    # per table parameter, its optimizer state indexed by rows, as its rule says (none: a state
    # saved before rules said it, told by its shape)
    row_state: dict[str, tuple[str, ...]] = field(default_factory=dict)

    columns: Optional[Columns] = None              # a server's own (``Columns``): None, the first

    @classmethod
    def of(cls, spec: ModelSpec, slots: "Slots | int", columns: Optional[Columns] = None) -> "Layout":
        """``spec``'s model under ``slots`` (a number of servers: their first layout); on a server,
        with its ``columns``."""
        slots = first_slots(spec, slots) if isinstance(slots, int) else slots
        missing = [g for g in range(len(spec.dense)) if not slots.has_home(dense_unit(g))]
        if missing:
            raise ValueError(f"layout {slots.epoch} gives no home to dense group {missing[0]} of the model's "
                             f"{len(spec.dense)}")
        return cls(slots, {t: plan_of(slots, t, table.rows, table.hashed, columns) for t, table in spec.tables.items()},
                   {t: tuple(table.params) for t, table in spec.tables.items()},
                   tuple(tuple(group.params) for group in spec.dense),
                   {p: spec.rule_of(t).row_state for t, table in spec.tables.items() for p in table.params}, columns)

    @property
    def num_shards(self) -> int:
        return self.slots.num_shards

    @property
    def epoch(self) -> int:
        return self.slots.epoch

    def columns_of(self, shard: int) -> Columns:
        return columns_on(self.columns, self.slots, shard)

    def group_owner(self, group: int) -> int:
        return self.slots.home(dense_unit(group))

    def groups_of(self, shard: int) -> list[int]:
        return [g for g in range(len(self.dense_groups)) if self.group_owner(g) == shard]

    def dense_of(self, shard: int) -> list[str]:
        return [name for g in self.groups_of(shard) for name in self.dense_groups[g]]

    def table_of(self, param: str) -> str:
        for table, params in self.table_params.items():
            if param in params:
                return table
        raise KeyError(param)

    def hashed_tables(self) -> list[str]:
        return [t for t, plan in self.plans.items() if isinstance(plan, HashedPlan)]

    def row_params(self) -> list[str]:
        return [name for params in self.table_params.values() for name in params]


def client_plans(slots: Slots, placed: dict[str, tuple[str, int]], num_ids: dict[str, int]) -> dict[str, Plan]:
    """The plans a client makes of the leader's ``slots`` and what the servers say of each table:
    its kind (``placement_of``) and its ids in all."""
    return {t: plan_of(slots, t, num_ids[t], placed.get(t, ("row_wise", 0))[0] == "hashed") for t in num_ids}
