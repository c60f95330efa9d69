"""The seed tutorial's design, kept only as the benchmark's baseline (pytorch/examples
``distributed/rpc/rnn``): each trainer creates its own EmbeddingTable and Decoder on the server with
``rpc.remote``, runs the LSTM locally, and the decoder returns the full [tokens, vocab] logits over
RPC; a TorchScript-path ``DistributedOptimizer(SGD)`` updates everything. One server, one trainer,
a static group of two, as in the tutorial.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.optim import DistributedOptimizer


class EmbeddingTable(nn.Module):
    def __init__(self, ntoken: int, ninp: int, dropout: float) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.drop(self.encoder(ids))


class Decoder(nn.Module):
    def __init__(self, ntoken: int, nhid: int, dropout: float) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, output: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.drop(output))


def _call_method(method, rref, *args):
    return method(rref.local_value(), *args)


def _remote_method(method, rref, *args):
    return rpc.rpc_sync(rref.owner(), _call_method, args=[method, rref, *args])


def _param_rrefs(rref):
    return [rpc.RRef(p) for p in rref.local_value().parameters()]


def _run_trainer(data: torch.Tensor, args: dict) -> dict:
    ntoken, emsize, nhid, nlayers, dropout = args["ntoken"], args["emsize"], args["nhid"], args["nlayers"], args["dropout"]
    emb_rref = rpc.remote("ps", EmbeddingTable, args=(ntoken, emsize, dropout))
    dec_rref = rpc.remote("ps", Decoder, args=(ntoken, nhid, dropout))
    lstm = nn.LSTM(emsize, nhid, nlayers, dropout=dropout)
    params = (rpc.rpc_sync("ps", _param_rrefs, args=(emb_rref,)) + [rpc.RRef(p) for p in lstm.parameters()]
              + rpc.rpc_sync("ps", _param_rrefs, args=(dec_rref,)))
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.05)
    criterion = nn.CrossEntropyLoss()
    bptt, batch = args["bptt"], args["batch_size"]
    hidden = (torch.zeros(nlayers, batch, nhid), torch.zeros(nlayers, batch, nhid))
    times, losses = [], []
    for step in range(args["steps"]):
        i = (step * bptt) % (data.size(0) - bptt - 1)
        x, y = data[i:i + bptt], data[i + 1:i + 1 + bptt]
        t0 = time.perf_counter()
        with dist_autograd.context() as context_id:
            hidden = (hidden[0].detach(), hidden[1].detach())
            emb = _remote_method(EmbeddingTable.forward, emb_rref, x)
            out, hidden = lstm(emb, hidden)
            logits = _remote_method(Decoder.forward, dec_rref, out)   # [bptt, batch, ntoken] over RPC
            loss = criterion(logits.view(-1, ntoken), y.reshape(-1))
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    timed = times[args["warmup"]:]
    return {"tokens_per_s": bptt * batch * len(timed) / sum(timed), "timed_steps": len(timed),
            "step_s_median": sorted(timed)[len(timed) // 2], "loss_last": losses[-1]}


def _worker(rank: int, port: int, data: torch.Tensor, args: dict, out_path: str) -> None:
    torch.set_num_threads(args["threads"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    opts = rpc.TensorPipeRpcBackendOptions(rpc_timeout=300)
    rpc.init_rpc("ps" if rank == 0 else "trainer", rank=rank, world_size=2, rpc_backend_options=opts)
    try:
        if rank == 1:
            result = _run_trainer(data, args)
            with open(out_path, "w") as f:
                json.dump(result, f)
    finally:
        rpc.shutdown()


def run_seed(data: torch.Tensor, args: dict, port: int, out_path: str) -> dict:
    mp.spawn(_worker, args=(port, data, args, out_path), nprocs=2, join=True)
    with open(out_path) as f:
        return json.load(f)


if __name__ == "__main__":  # pragma: no cover - invoked by trainer.lm.bench
    print("run through `rpcps bench lm`", file=sys.stderr)
    sys.exit(2)
