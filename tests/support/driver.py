"""A scripted trainer for integration tests: joins the real cluster as a real RPC member, drives the
servers through the real stub, and prints one JSON line with what it observed.

    python -m tests.support.driver equivalence|sync|clocked|hammer|inspect|bad --name trainerN --num-ps K --master-port P
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading
import time
from pathlib import Path

import torch

from tests.support.rows import held
import torch.nn.functional as F

from ps.spec.config import ps_names
from ps.server.service import ParameterServer
from ps.spec.surface import ClockSurface, PsSurface
from ps.client.client import PsClient
from services.errors import Superseded, UpdateRefused
from services.log import init_logging
from services.membership import Membership, current_members
from services.rpc import RpcEndpoint
from tests.support.wait import wait_until
from trainer.lm.config import LmModelConfig, TrainerConfig
from trainer.lm.data import BatchStream
from trainer.core.loop import TrainLoop
from trainer.core.hot_rows import ReplicatedRows
from trainer.core.replica import GROUP_PREFIX
from trainer.lm.model import DistributedLM, LocalLM, init_hidden
from trainer.lm.task import LmTask


def full_parameters(client: PsClient) -> dict[str, torch.Tensor]:
    """Reassemble the whole model's parameters from every shard."""
    m, plan = LmModelConfig.model_validate(client.model), client.routes.plans["vocabulary"]
    full = {"embedding.weight": torch.empty(m.ntoken, m.emsize), "decoder.weight": torch.empty(m.ntoken, m.nhid),
            "decoder.bias": torch.empty(m.ntoken)}
    for k, name in enumerate(client.routes.servers):
        part = client.call(name, PsSurface.parameters)
        rows, ids = held(plan.global_ids(k))
        for key in ("embedding.weight", "decoder.weight", "decoder.bias"):
            full[key][ids] = part.pop(key)[rows]
        full.update({f"lstm.{n}": t for n, t in part.items()})
    return full


def local_parameters(model: LocalLM) -> dict[str, torch.Tensor]:
    out = {"embedding.weight": model.embedding.weight, "decoder.weight": model.decoder.weight,
           "decoder.bias": model.decoder.bias}
    out.update({f"lstm.{n}": p for n, p in model.body.lstm.named_parameters()})
    return {k: v.detach() for k, v in out.items()}


def equivalence(client: PsClient, args: argparse.Namespace) -> dict:
    cfg = TrainerConfig(name=args.name, num_ps=args.num_ps, batch_size=4, bptt=5, dropout=0.0, clip=args.clip)
    g = torch.Generator().manual_seed(7)
    model = LmModelConfig.model_validate(client.model)
    data = torch.randint(0, model.ntoken, (cfg.bptt * args.steps + 1, cfg.batch_size), generator=g)
    dist_loop = TrainLoop.of(LmTask(DistributedLM(client, 0.0), BatchStream(data, cfg.bptt), cfg), cfg)
    local = LocalLM(model, 0.0)
    local_stream, hidden = BatchStream(data, cfg.bptt), init_hidden(model, cfg.batch_size)
    initial = full_parameters(client)
    initial_diff = _max_diffs(initial, local_parameters(local))
    losses = []
    for _ in range(args.steps):
        d = dist_loop.step()
        x, y, _ = local_stream.next()
        loss, hidden = local.train_step(x, y, hidden, cfg.clip)
        losses.append([d.loss, loss])
    final = full_parameters(client)
    return {"losses": losses, "initial_diff": initial_diff, "param_diff": _max_diffs(final, local_parameters(local)),
            "update_size": _max_diffs(final, initial)}


def sync(client: PsClient, args: argparse.Namespace) -> dict:
    """One of ``--trainers`` sync trainers, each on its slice of one batch of M*B sequences; trainer0
    also trains the one-process model on the whole batch and compares the parameters at the end."""
    index, batch = int(args.name.removeprefix("trainer")), 4
    cfg = TrainerConfig(name=args.name, num_ps=args.num_ps, batch_size=batch, bptt=5, dropout=0.0, clip=args.clip)
    model = LmModelConfig.model_validate(client.model)
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, model.ntoken, (cfg.bptt * args.steps + 1, batch * args.trainers), generator=g)
    dist_model = DistributedLM(client, 0.0)
    initial = full_parameters(client)
    if args.dense == "allreduce":
        dist_model.replicate(lambda key: args.endpoint.prefixed_store(f"{GROUP_PREFIX}{key}/", 60), 60)
    loop = TrainLoop.of(LmTask(dist_model, BatchStream(data[:, index * batch:(index + 1) * batch], cfg.bptt), cfg), cfg)
    client.clock.start_with = args.trainers       # everyone in step 1, as a trainer role says
    client.clock.begin()
    losses = [loop.step().loss for _ in range(args.steps)]
    result: dict = {"losses": losses, "consistency": str(client.consistency)}
    trained = full_parameters(client)
    if dist_model.replica is not None:
        replica = {f"lstm.{n}": t for n, t in dist_model.replica.weights().items()}
        result["servers_lstm_moved"] = _max_diffs({k: trained[k] for k in replica}, {k: initial[k] for k in replica})
        result["replica_sha256"] = hashlib.sha256(b"".join(t.numpy().tobytes() for t in replica.values())).hexdigest()
        trained.update(replica)
    if index == 0:
        local = LocalLM(model, 0.0)
        stream, hidden = BatchStream(data, cfg.bptt), init_hidden(model, batch * args.trainers)
        local_losses = []
        for _ in range(args.steps):
            x, y, _ = stream.next()
            loss, hidden = local.train_step(x, y, hidden, cfg.clip)
            local_losses.append(loss)
        result.update(local_losses=local_losses, param_diff=_max_diffs(trained, local_parameters(local)))
    client.clock.end()
    return result


def clocked(client: PsClient, args: argparse.Namespace) -> dict:
    """A trainer that records, by the machine's monotonic clock, the step number of every read
    (right after the step clock let it begin) and when it reported each step done; ``--slow-down``
    makes it a straggler, as it does a real trainer."""
    cfg = TrainerConfig(name=args.name, num_ps=args.num_ps, batch_size=4, bptt=5, dropout=0.0, clip=0.25,
                        slow_down=args.slow_down)
    model = DistributedLM(client, 0.0)
    g = torch.Generator().manual_seed(int(args.name.removeprefix("trainer")))
    data = torch.randint(0, model.config.ntoken, (cfg.bptt * args.steps + 1, cfg.batch_size), generator=g)
    loop = TrainLoop.of(LmTask(model, BatchStream(data, cfg.bptt), cfg), cfg)
    client.clock.begin()
    wait_until(lambda: len(client.call(client.leader, ClockSurface.status)["clocks"]) == args.trainers, 60,
               "every trainer on the step clock")
    reads, done = [], []
    for _ in range(args.steps):
        client.clock.begin()               # the step's own begin inside loop.step() is then a no-op
        reads.append([client.clock.granted.step, time.monotonic()])
        done.append([reads[-1][0], loop.step().arrived_at])
    client.clock.end()
    return {"reads": reads, "done": done}


def _max_diffs(a: dict, b: dict) -> dict:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return {k: float((a[k] - b[k]).abs().max()) for k in a}


def hammer(client: PsClient, args: argparse.Namespace) -> dict:
    """Steps whose gradients do not depend on the parameters, so the exact end state is known.
    With ``--poison nan,inf`` every step's gradients are scaled by those in turn: none is finite."""
    model = LmModelConfig.model_validate(client.model)
    ids, targets = hammer_batch(model.ntoken)
    h = torch.ones(targets.numel(), model.nhid)
    poison = [float(p) for p in args.poison.split(",") if p]
    refused = []
    for i in range(args.steps):
        client.clock.begin()
        with client.step() as step:
            rows, weights = step.fetch({"embedding.weight": ids})
            parts = client.op("decode", h, targets)
            # Only the target logits: their gradient is one-hot, whatever the parameters are.
            loss = rows["embedding.weight"].sum() + sum(w.sum() for w in weights.values()) + sum(p[1].sum() for p in parts)
            if poison:
                loss = loss * poison[i % len(poison)]
            try:
                step.finish(loss, clip=0.0)
            except UpdateRefused as exc:
                refused.append(str(exc).splitlines()[0])
    client.clock.end()
    return {"steps": args.steps, "refused": refused}


def stale(client: PsClient, args: argparse.Namespace) -> dict:
    """An incarnation that may have been replaced: says its rank, waits until ``--out`` exists
    (the test freezes it meanwhile, has the leader evict it and starts another of its name), then
    tries one step of the hammer's; whether the servers refused it (``Superseded``)."""
    print(json.dumps({"rank": args.endpoint.rank}), flush=True)
    wait_until(lambda: Path(args.out).exists(), 120, "the go-ahead")
    model = LmModelConfig.model_validate(client.model)
    ids, targets = hammer_batch(model.ntoken)
    try:
        with client.step() as step:
            rows, weights = step.fetch({"embedding.weight": ids})
            step.finish(rows["embedding.weight"].sum() + sum(w.sum() for w in weights.values()), clip=0.0)
        return {"refused": None}
    except Superseded as exc:
        return {"refused": str(exc).splitlines()[0]}


def poison_hashed(client: PsClient, args: argparse.Namespace) -> dict:
    """One trainer's steps on a hashed table (the CTR model's ``C3``, keyed by raw ids): honest,
    then scaled by nan and by inf (each to be refused whole), then honest again; whether each
    refused step left every server's parameters, hashed rows included, exactly as they were, and
    whether the honest steps moved them."""
    ids = torch.tensor([5, -2**40, 2**62 + 7, 123_456_789])
    refused, params = [], []
    for scale in (1.0, float("nan"), float("inf"), 1.0):
        client.clock.begin()
        with client.step() as step:
            rows, weights = step.fetch({"tables.weights.C3": ids})
            loss = (rows["tables.weights.C3"].sum() + sum(w.sum() for w in weights.values())) * scale
            try:
                step.finish(loss, clip=0.0)
                refused.append(None)
            except UpdateRefused as exc:
                refused.append(str(exc).splitlines()[0])
        params.append([client.call(n, PsSurface.parameters) for n in client.routes.servers])
    client.clock.end()

    def same(a: list[dict], b: list[dict]) -> bool:
        return all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b))
    return {"refused": refused, "refused_left_all": same(params[0], params[1]) and same(params[1], params[2]),
            "honest_moved": not same(params[2], params[3])}


def hammer_batch(ntoken: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[0, 1, 1], [2, 3, 5]]) % ntoken           # repeated id: gradient 2 on row 1
    targets = torch.tensor([1, 2, 2, 3, 7, 7, 7]) % ntoken
    return ids, targets


def inspect(client: PsClient, args: argparse.Namespace) -> dict:
    torch.save(full_parameters(client), args.out)
    return {"saved": args.out, "members": current_members()}


def bad(client: PsClient, args: argparse.Namespace) -> dict:
    ps, m = client.routes.servers[0], LmModelConfig.model_validate(client.model)
    lookup, decode, emb = PsSurface.lookup, PsSurface.op, "embedding.weight"
    cases = {
        "float ids": (lookup, emb, torch.tensor([0.0, 1.0])),
        "int16 ids": (lookup, emb, torch.tensor([0, 1], dtype=torch.int16)),
        "2-d ids": (lookup, emb, torch.zeros(2, 2, dtype=torch.long)),
        "negative id": (lookup, emb, torch.tensor([-1])),
        "id past vocab": (lookup, emb, torch.tensor([m.ntoken + 5])),
        "id of another shard": (lookup, emb, torch.tensor([1])) if len(client.routes.servers) > 1 else (lookup, emb, torch.tensor([], dtype=torch.long)),
        "empty ids": (lookup, emb, torch.tensor([], dtype=torch.long)),
        "too many ids": (lookup, emb, torch.zeros(262_144, dtype=torch.long)),
        "too many targets": (decode, "decode", torch.zeros(262_144, m.nhid), torch.zeros(262_144, dtype=torch.long)),
        "not a tensor": (lookup, emb, [0, 2]),
        "no such table": (lookup, "embedding.bias", torch.tensor([0])),
        "h wrong width": (decode, "decode", torch.zeros(3, m.nhid + 1), torch.tensor([0, 1, 2])),
        "targets length": (decode, "decode", torch.zeros(3, m.nhid), torch.tensor([0, 1])),
        "target out of range": (decode, "decode", torch.zeros(2, m.nhid), torch.tensor([0, m.ntoken])),
        "no such operation": (decode, "encode", torch.zeros(2, m.nhid)),
        "unknown context": (PsSurface.grad_sq_norm, 123456789),
        "clip past 1": (PsSurface.apply, 123456789, 2.0),
        "pushed with the norm, wrong shape": (PsSurface.grad_sq_norm, 123456789, {emb: (torch.tensor([0]), torch.zeros(3))}),
        "rows held, an id twice": (PsSurface.hold_rows, {emb: torch.tensor([0, 0])}),
        "rows given back, wrong width": (PsSurface.return_rows, {emb: (torch.tensor([0]), torch.zeros(1, 1), {})}, 1),
        "rows given back, not a triple": (PsSurface.return_rows, {emb: (torch.tensor([0]),)}, 1),
        "not a remote method": (ParameterServer.export_state,),
        "missing argument": (lookup, emb),
        "no lookups": (PsSurface.lookup_many, {}),
        "lookups not a dict": (PsSurface.lookup_many, [emb]),
        "too many ids in all": (PsSurface.lookup_many, {emb: torch.zeros(40_000, dtype=torch.long),
                                                              "decoder.weight": torch.zeros(40_000, dtype=torch.long)}),
    }
    results = {}
    for case, (method, *a) in cases.items():
        try:
            client.call(ps, method, *a)
            results[case] = {"error": None}
        except Exception as exc:
            results[case] = {"error": type(exc).__name__, "message": str(exc).splitlines()[0]}
    # ...and the server still answers a good request.
    rows = client.call(ps, PsSurface.lookup, emb, torch.tensor([0, 2 * len(client.routes.servers)]))
    return {"cases": results, "good_rows": list(rows.shape)}


def tiny(client: PsClient, args: argparse.Namespace) -> dict:
    """Steps of the tests' own model (``tests/support/tiny.py``) through the servers, and the same
    steps in this process with the same rules: the largest difference of every parameter after."""
    from ps.spec.rules import rule
    from tests.support.tiny import TinyServerConfig, model
    spec = model(TinyServerConfig.model_construct(rows=int(client.model["rows"])))   # the servers checked it
    local = {"big.weight": spec.tables["big"].init(torch.arange(spec.tables["big"].rows))["big.weight"],
             "flag.weight": spec.tables["flag"].init(torch.arange(1))["flag.weight"], **spec.dense[0].init()}
    rules = {"big.weight": rule("rowwise_adagrad"), "flag.weight": rule("sgd"), "w": rule("adagrad")}
    state = {n: {k: torch.zeros(s) for k, s in r.state_shapes(local[n]).items()} for n, r in rules.items()}
    g = torch.Generator().manual_seed(5)
    for _ in range(args.steps):
        ids = torch.randint(0, spec.tables["big"].rows, (6,), generator=g)
        target = torch.randn(6, generator=g)

        def loss_of(big: torch.Tensor, flag: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return ((big * w).sum(1) + (flag * w).sum() - target).pow(2).mean()
        with client.step() as step:
            rows, weights = step.fetch({"big.weight": ids, "flag.weight": torch.zeros(6, dtype=torch.long)})
            step.finish(loss_of(rows["big.weight"], rows["flag.weight"], weights["w"]), clip=0.0)
        mine = {n: t.clone().requires_grad_() for n, t in local.items()}
        loss_of(mine["big.weight"][ids], mine["flag.weight"][torch.zeros(6, dtype=torch.long)], mine["w"]).backward()
        with torch.no_grad():
            for n, r in rules.items():
                grad = mine[n].grad
                if n != "w":        # table rows step sparsely, as the servers' do
                    touched = grad.abs().sum(1).nonzero().squeeze(1)
                    grad = torch.sparse_coo_tensor(touched[None], grad[touched], grad.shape)
                r.step(local[n], grad, state[n], spec.lr)
    client.clock.end()
    served: dict[str, dict[str, torch.Tensor]] = {}
    for k, name in enumerate(client.routes.servers):
        served[name] = client.call(name, PsSurface.parameters)
    big = torch.empty_like(local["big.weight"])
    for k, name in enumerate(client.routes.servers):
        rows, ids = held(client.routes.plans["big"].global_ids(k))
        big[ids] = served[name]["big.weight"][rows]
    holder = [name for name, p in served.items() if p["flag.weight"].shape[0] == 1]
    flag = served[holder[0]]["flag.weight"]
    w = next(p["w"] for p in served.values() if "w" in p)
    return {"rows_per_server": {name: {t: int(p[f"{t}.weight"].shape[0]) for t in ("big", "flag")}
                                for name, p in served.items()},
            "diff": {"big": float((big - local["big.weight"]).abs().max()),
                     "flag": float((flag - local["flag.weight"]).abs().max()), "w": float((w - local["w"]).abs().max())},
            "moved": float((big - spec.tables["big"].init(torch.arange(spec.tables["big"].rows))["big.weight"]).abs().max())}


def ctr(client: PsClient, args: argparse.Namespace) -> dict:
    """One of ``--trainers`` sync CTR trainers of the built-in DLRM (the real task and loop), each on
    its share of the generated stream; trainer0 also trains the same module in one process on every
    trainer's samples of each step and compares every parameter at the end."""
    import rpcps
    from trainer.ctr.custom import SchemaModel, hosted_module
    from rpcps.data.generated import GeneratedSource
    from rpcps.data.generated import SyntheticCtr
    from trainer.ctr.task import CtrTask
    index, batch, hosted = int(args.name.removeprefix("ctr")), 64, client.model
    generator = SyntheticCtr.fitting(hosted["criteo"]["cardinalities"], seed=3)
    task = CtrTask(SchemaModel(client, hosted_module(hosted)), GeneratedSource(generator, batch, index, args.trainers),
                   name=args.name, num_trainers=args.trainers)
    hot = ReplicatedRows(args.hot_rows, every=2) if args.hot_rows else None
    if args.dense == "allreduce":
        task.model.replicate(lambda key: args.endpoint.prefixed_store(f"{GROUP_PREFIX}{key}/", 60), 60, hot=hot)
    if args.backward == "local":
        client.backward_here()
    loop = TrainLoop(task, clip=0.0, prefetch=args.prefetch, cache=hot)
    client.clock.start_with = args.trainers
    client.clock.begin()
    steps = [loop.step() for _ in range(args.steps)]
    client.clock.end()
    result: dict = {"losses": [s.loss for s in steps], "consistency": str(client.consistency),
                    "hidden": [s.phases.get("fetch_hidden") for s in steps],
                    "hits": [s.cache.hits if s.cache is not None else 0 for s in steps]}
    if task.model.replica is not None:
        task.model.write_replica()      # as a trainer's stop does: the servers then hold the whole model
        client.read_ahead()             # what follows reads the servers' rows, not the replica's
    if index != 0:
        return result
    local = hosted_module(hosted)
    optimizer = rpcps.local_optimizer(local, hosted["optimizer"], hosted["lr"], hosted["table_rule"])
    every = GeneratedSource(generator, batch * args.trainers)      # each step's samples, every trainer's
    local_losses = []
    for _ in range(args.steps):
        b = every.next()
        optimizer.zero_grad()
        loss = F.binary_cross_entropy_with_logits(local(b), b.labels)
        loss.backward()
        optimizer.step()
        local_losses.append(float(loss))
    every_row = {t: torch.arange(cfg.rows) for t, cfg in local.tables.configs.items()}
    diffs, moved = compared(client, local, every_row)
    with torch.no_grad():
        rows, weights = client.fetch({f"tables.weights.{t}": ids for t, ids in every_row.items()})
    digest = hashlib.sha256()
    for name, tensor in sorted({**rows, **weights}.items()):
        digest.update(name.encode() + tensor.detach().contiguous().numpy().tobytes())
    result.update(local_losses=local_losses, param_diff=diffs, tables_moved=moved, digest=digest.hexdigest(),
                  placements={t: type(plan).__name__ for t, plan in client.routes.plans.items()})
    return result


def pushed(client: PsClient, args: argparse.Namespace) -> dict:
    """Two steps of one trainer on the CTR model's table C3 (SGD): the first gives rows X their
    gradients through distributed autograd, the second pushes the same gradients for X and reads
    only rows of C4. How far each step moved X's rows; and a push the servers refuse."""
    param, x = "tables.weights.C3", torch.tensor([3, 7, 7, 11, 40, 41])   # id 7 twice: its gradients add up
    w = torch.linspace(-1, 1, x.numel() * 4).reshape(x.numel(), 4)

    def rows() -> torch.Tensor:
        with torch.no_grad():
            return client.fetch({param: x}, dense=False)[0][param]
    start = rows()
    client.clock.begin()
    with client.step() as step:
        got, _ = step.fetch({param: x}, dense=False)
        step.finish((got[param] * w).sum(), clip=0.0)
    read = rows()
    client.clock.begin()
    with client.step() as step:
        other, _ = step.fetch({"tables.weights.C4": torch.tensor([1, 2])}, dense=False)
        step.push({param: x}, {param: w})
        step.finish(other["tables.weights.C4"].sum() * 0.0, clip=0.0)
    after = rows()
    client.clock.end()
    refused = []
    for grad in (torch.zeros(2, 5), torch.zeros(3, 4)):      # a row of the wrong width; more rows than ids
        try:
            client.call(client.routes.servers[0], PsSurface.push, 12345, {param: (torch.tensor([0, 2]), grad)})
        except Exception as exc:  # noqa: BLE001 - the sentence is the result
            refused.append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
    return {"autograd": (read - start).tolist(), "pushed": (after - read).tolist(), "refused": refused}


def cached(client: PsClient, args: argparse.Namespace) -> dict:
    """One async trainer with a rows cache of ``--staleness`` steps, on the CTR model's table C3
    (SGD, lr 0.1): each step reads rows X through the cache and moves them by its gradient ``w``;
    a step between them writes X without reading it (a pushed gradient: to this cache, another
    trainer's write). What each step computed with, beside the servers' rows just before it."""
    from ps.client.cache import HotRows
    param, x = "tables.weights.C3", torch.tensor([3, 7, 11])
    w = torch.linspace(-1, 1, x.numel() * 4).reshape(x.numel(), 4)
    client.read_ahead(cache=HotRows(capacity=100, staleness=args.staleness))

    def servers() -> list:                      # outside a step: read from the servers, never the cache
        with torch.no_grad():
            return client.fetch({param: x}, dense=False)[0][param].tolist()

    def reading() -> dict:
        before = servers()
        with client.step() as step:
            rows, _ = step.fetch({param: x}, dense=False)
            step.finish((rows[param] * w).sum(), clip=0.0)
        return {"used": rows[param].detach().tolist(), "servers_before": before, "servers_after": servers()}

    def writing() -> None:
        with client.step() as step:
            other, _ = step.fetch({"tables.weights.C4": torch.tensor([1])}, dense=False)
            step.push({param: x}, {param: torch.full((x.numel(), 4), 0.5)})
            step.finish(other["tables.weights.C4"].sum() * 0.0, clip=0.0)
    steps = [reading()]
    writing()
    steps += [reading() for _ in range(args.steps)]
    counts = client.cache.counts
    return {"steps": steps, "hits": counts.hits, "misses": counts.misses, "oldest": counts.max_age}


def dies_cached(client: PsClient, args: argparse.Namespace) -> dict:
    """An async trainer with a full rows cache (X's rows of table C3, kept by a step that read
    them) takes them from it in a step, and dies there once that step's gradients of the copies
    are on the servers (pushed with its norm round), before its update: it prints the servers' rows of X and waits to be killed."""
    import torch.distributed.autograd as dist_autograd
    from ps.client.cache import HotRows
    from ps.client.step_end import StepEnd
    param, x = "tables.weights.C3", torch.tensor([3, 7, 11])
    w = torch.linspace(-1, 1, x.numel() * 4).reshape(x.numel(), 4)
    client.read_ahead(cache=HotRows(capacity=x.numel(), staleness=1))
    with client.step() as step:
        rows, _ = step.fetch({param: x}, dense=False)
        step.finish((rows[param] * w).sum(), clip=0.0)
    with torch.no_grad():
        before = client.fetch({param: x}, dense=False)[0][param].tolist()
    with client.step() as step:
        rows, _ = step.fetch({param: x}, dense=False)
        dist_autograd.backward(step.context_id, [(rows[param] * w).sum()])
        # What finish does first, with the copies' gradients; its update next.
        end = StepEnd(client, step.context_id, step._grads)
        end._grad_norm(step._leaf_grads(end.routes))
        print(json.dumps({"servers_before": before, "hits": client.cache.counts.hits, "rows": client.cache.rows}),
              flush=True)
        threading.Event().wait(120)     # killed here
    return {}


def compared(client: PsClient, local: torch.nn.Module, ids: dict[str, torch.Tensor]) -> tuple[dict[str, float], float]:
    """The servers' rows ``ids`` of each table and their dense weights against the one-process
    module ``local`` (its tables in ``local.tables``): the largest difference of each, and the most
    any of those rows moved from its initial value."""
    with torch.no_grad():
        rows, weights = client.fetch({f"tables.weights.{t}": i for t, i in ids.items()})
    diffs = {t: float((rows[f"tables.weights.{t}"] - local.tables.rows_of(t, i)).abs().max()) for t, i in ids.items()}
    diffs.update({n: float((weights[n] - p.detach()).abs().max()) for n, p in local.named_parameters()
                  if not n.startswith("tables.")})
    moved = max(float((local.tables.rows_of(t, i) - local.tables.initial_rows(t, i)).abs().max()) for t, i in ids.items())
    return diffs, moved


def bagged(client: PsClient, args: argparse.Namespace) -> dict:
    """One of ``--trainers`` sync trainers of the public API's test model (``tests/support/bagged.py``)
    on its share of each step's samples, through the real loop; trainer0 also trains the same module
    in one process on every trainer's samples and compares every table row and weight after."""
    import rpcps
    from tests.support.bagged import TABLES, batch, build, LR, OPTIMIZER
    from trainer.core.hosted import HostedModel
    index, size = int(args.name.removeprefix("trainer")), 8
    hosted = HostedModel(client, build())

    class Task:
        model, unit = hosted, "samples"

        def __init__(self) -> None:
            self.step = 0

        def next_batch(self) -> rpcps.Batch:
            self.step += 1
            return batch(self.step, size * args.trainers).rows(index * size, (index + 1) * size)

        def fetch(self, b: rpcps.Batch):
            return hosted.fetch(b.sparse)

        def loss(self, b: rpcps.Batch, fetched) -> torch.Tensor:
            return F.binary_cross_entropy_with_logits(hosted.run(fetched, b), b.labels)

        def units(self, b: rpcps.Batch) -> int:
            return len(b)

        def stepped(self) -> None:
            pass
    loop = TrainLoop(Task(), clip=0.0)
    client.clock.begin()
    wait_until(lambda: len(client.call(client.leader, ClockSurface.status)["clocks"]) == args.trainers, 60,
               "every trainer on the step clock")
    losses = [loop.step().loss for _ in range(args.steps)]
    client.clock.end()
    result: dict = {"losses": losses}
    if index != 0:
        return result
    local = build()
    optimizer = rpcps.local_optimizer(local, OPTIMIZER, LR)
    local_losses = []
    seen: dict[str, set] = {t.name: set() for t in TABLES}
    for step in range(1, args.steps + 1):
        b = batch(step, size * args.trainers)
        for table, ids in local.tables.lookups(b.sparse).items():
            seen[table].update(ids.tolist())
        optimizer.zero_grad()
        loss = F.binary_cross_entropy_with_logits(local(b), b.labels)
        loss.backward()
        optimizer.step()
        local_losses.append(float(loss))
    ids = {t.name: torch.tensor(sorted(seen[t.name]) if t.hashed else range(t.rows)) for t in TABLES}
    diffs, moved = compared(client, local, ids)
    result.update(local_losses=local_losses, param_diff=diffs, tables_moved=moved,
                  placements={t: type(plan).__name__ for t, plan in client.routes.plans.items()})
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("equivalence", "sync", "clocked", "hammer", "inspect", "bad", "tiny", "ctr",
                                    "pushed", "poison_hashed", "bagged", "cached", "dies_cached", "stale"))
    p.add_argument("--name", required=True)
    p.add_argument("--num-ps", type=int, required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--clip", type=float, default=0.25)
    p.add_argument("--out", default="")
    p.add_argument("--trainers", type=int, default=1)
    p.add_argument("--slow-down", type=float, default=1.0)
    p.add_argument("--poison", default="", help="hammer: scale each step's loss by these in turn (nan,inf)")
    p.add_argument("--dense", default="ps", choices=("ps", "allreduce"), help="sync: where the LSTM lives")
    p.add_argument("--prefetch", type=int, default=0, help="ctr: batches read ahead")
    p.add_argument("--backward", default="distributed", choices=("local", "distributed"), help="ctr: where it runs")
    p.add_argument("--staleness", type=int, default=0, help="cached: the rows cache's bound, in steps")
    p.add_argument("--hot-rows", type=int, default=0, help="ctr --dense allreduce: hot rows replicated, per table")
    args = p.parse_args()
    init_logging(args.name, "warning")
    torch.set_num_threads(1)
    membership = Membership(args.name)
    membership.install()
    endpoint = RpcEndpoint(args.name, "127.0.0.1", args.master_port, join_timeout=60)
    endpoint.join()
    args.endpoint = endpoint          # sync --dense allreduce: the trainers' group meets at its store
    try:
        servers = ps_names(args.num_ps)
        wait_until(lambda: set(servers) <= set(current_members()), 60, "servers in the group")
        client = PsClient(args.name, servers)
        modes = {"equivalence": equivalence, "sync": sync, "clocked": clocked, "hammer": hammer, "inspect": inspect,
                 "bad": bad, "tiny": tiny, "ctr": ctr, "pushed": pushed, "poison_hashed": poison_hashed,
                 "bagged": bagged, "cached": cached, "dies_cached": dies_cached, "stale": stale}
        result = modes[args.mode](client, args)
        del client
    finally:
        endpoint.leave()
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
