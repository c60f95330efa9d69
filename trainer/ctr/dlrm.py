"""DLRM (Naumov et al., 2019) over Criteo's columns, written once with rpcps's public API: a
bottom MLP over the counts, one pooled embedding per categorical column, their pairwise dot
products, a top MLP to one logit. Weights start as DLRM's do."""
import math

import torch
import torch.nn as nn

import rpcps


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:]):
        layer = nn.Linear(n_in, n_out)
        nn.init.normal_(layer.weight, std=math.sqrt(2.0 / (n_in + n_out)))
        nn.init.normal_(layer.bias, std=math.sqrt(1.0 / n_out))
        layers += [layer, nn.ReLU()]
    return nn.Sequential(*layers[:-1])          # no ReLU after the last layer


class DLRM(nn.Module):
    def __init__(self, schema: rpcps.Schema, bottom=(512, 256, 64), top=(512, 256)) -> None:
        super().__init__()
        dim = schema.tables[0].dim                  # every table's: the interaction needs one width
        self.features = schema.features
        self.tables = rpcps.EmbeddingBags(schema.table_configs())
        self.bottom = mlp([len(schema.numeric), *bottom, dim])
        n = len(self.features) + 1
        self.pairs = torch.triu_indices(n, n, offset=1)
        self.top = mlp([dim + n * (n - 1) // 2, *top, 1])

    def forward(self, batch: rpcps.Batch) -> torch.Tensor:
        x = self.bottom(batch.dense)
        pooled = self.tables(batch.sparse)
        t = torch.stack([x, *(pooled[f] for f in self.features)], dim=1)        # [B, 27, dim]
        z = torch.bmm(t, t.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]   # each pair's dot product
        return self.top(torch.cat([x, z], dim=1)).squeeze(1)                   # logits [B]
