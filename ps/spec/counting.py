"""Updates counted by slot, so that a move's "nothing lost, nothing twice" can be shown with many
trainers (``rpcps ps --count-updates``).

In async mode the trainers' updates reach a server in no fixed order, so a job that moved cannot
be compared bit for bit with one that did not. Counts can be compared instead. A counting server
keeps, beside each row of a table read by id, how many updates changed it (``COUNT_KEY``, one
more value of the row's optimizer state). Being the row's state, the count is written in the same
step as the row, and moves with it wherever the row goes: copied ahead, sent again under the hold,
saved in checkpoints and deltas, re-divided on restore. A trainer counts, per slot, the steps the
servers acknowledged, by the rows of the slot each read (``ps/client/counts.py``). Once the
trainers are idle, a slot's acknowledged row updates, summed over the trainers, must equal the sum
of its rows' counts on its owner: fewer means an acknowledged update is not in the parameters
(lost), more means one was applied twice (``tally``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from ps.spec.consistency import Consistency
from ps.spec.rules import UpdateRule

if TYPE_CHECKING:
    import torch

    from ps.spec.model import ModelSpec

COUNT_KEY = "updates_applied"     # a row's state: the updates that changed it


@dataclass(frozen=True)
class Counted:
    """``rule``, with each row's updates counted: a row a step's sparse gradient names counts one
    (its ids deduplicated, as a step applies them once)."""

    rule: UpdateRule

    @property
    def name(self) -> str:          # the rule's own: a checkpoint's rule is the same with or without counts
        return self.rule.name

    @property
    def rows_only(self) -> bool:
        return self.rule.rows_only

    @property
    def row_state(self) -> tuple[str, ...]:
        return (*self.rule.row_state, COUNT_KEY)

    def state_shapes(self, param: torch.Tensor) -> dict[str, tuple[int, ...]]:
        return {**self.rule.state_shapes(param), COUNT_KEY: (param.shape[0],)}

    def step(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], lr: float) -> None:
        import torch
        self.rule.step(param, grad, state, lr)
        if COUNT_KEY not in state:      # state restored from a checkpoint written without counts
            state[COUNT_KEY] = torch.zeros(param.shape[0], dtype=torch.float32)
        if grad.is_sparse:
            rows = grad.coalesce().indices()[0]
            state[COUNT_KEY].index_add_(0, rows, torch.ones(rows.numel(), dtype=state[COUNT_KEY].dtype))


def check_mode(consistency: str) -> None:
    """``ValueError`` unless each trainer's updates are its own in ``consistency``."""
    if Consistency.parse(consistency).averaged:
        raise ValueError(f"--count-updates counts each trainer's own updates; --consistency {consistency} averages "
                         "the trainers' gradients into one update a step (its proof: a job that moved ends bit for "
                         "bit as one that did not)")


def counting(spec: ModelSpec) -> ModelSpec:
    """``spec`` with the updates of every table read by id counted: not a hashed table's, whose
    rows an id's admission gives and takes (an update of an id not admitted changes no row)."""
    if spec.ops:
        raise ValueError(f"--count-updates counts the rows trainers read by id; this model's servers also run "
                         f"operations of their own on their rows ({', '.join(spec.ops)}), which it cannot count")
    tables = {name: table if table.hashed is not None else replace(table, rule=Counted(spec.rule_of(name)))
              for name, table in spec.tables.items()}
    return replace(spec, tables=tables)


def counted_tables(spec: ModelSpec) -> list[str]:
    return [name for name in spec.tables if isinstance(spec.rule_of(name), Counted)]


def slot_sums(ids: torch.Tensor, counts: torch.Tensor, slots: int) -> list[int]:
    """Per slot (``id % slots``), the sum of ``counts`` of the rows whose ids are ``ids``."""
    import torch
    sums = torch.bincount(ids % slots, weights=counts.double(), minlength=slots)
    return [int(v) for v in sums.round().tolist()]


def summed(answers: Iterable[Mapping[str, Any]], key: str) -> dict[str, list[int]]:
    """``answers``' (each member's ``GET /counts``) lists under ``key``, added up slot by slot."""
    out: dict[str, list[int]] = {}
    for answer in answers:
        for table, values in answer.get(key, {}).items():
            have = out.setdefault(table, [0] * len(values))
            out[table] = [a + b for a, b in zip(have, values)]
    return out


def job_tally(servers: Iterable[Mapping[str, Any]], trainers: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """``tally`` over every server's and every trainer's ``GET /counts``: exact once the trainers
    are idle (a step in flight is applied on some server before it is acknowledged)."""
    trainers = list(trainers)
    return tally(summed(trainers, "acked"), summed(trainers, "unsure"), summed(servers, "applied"))


def tally(acked: Mapping[str, list[int]], unsure: Mapping[str, list[int]],
          applied: Mapping[str, list[int]]) -> dict[str, Any]:
    """The trainers' acknowledged row updates per slot (``acked``, summed over the trainers), those
    of steps that failed after some server may have applied them (``unsure``), against the updates
    the servers' rows hold (``applied``, summed over the servers), table by table: ``lost``, the
    acknowledged updates no row holds; ``twice``, the updates held past every step that could
    have made them; and the slots where either is."""
    out: dict[str, Any] = {"acknowledged": 0, "applied": 0, "unsure": 0, "lost": 0, "twice": 0, "slots_off": 0}
    for table in sorted(set(acked) | set(applied)):
        sent, maybe, held = acked.get(table, []), unsure.get(table, []), applied.get(table, [])
        width = max(len(sent), len(maybe), len(held))
        for s in range(width):
            a, u, h = (v[s] if s < len(v) else 0 for v in (sent, maybe, held))
            lost, twice = max(0, a - h), max(0, h - a - u)
            out["lost"] += lost
            out["twice"] += twice
            out["slots_off"] += bool(lost or twice)
        out["acknowledged"] += sum(sent)
        out["unsure"] += sum(maybe)
        out["applied"] += sum(held)
    return out
