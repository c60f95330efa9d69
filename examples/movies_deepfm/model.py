"""DeepFM (Guo et al., 2017) over movie ratings, written once with rpcps's public API: a weight per
feature value (first order), the pairwise interactions of the features' vectors (second order), and
an MLP over those vectors and the numeric columns, summed into one logit."""
import torch
import torch.nn as nn

import rpcps


class DeepFM(nn.Module):
    def __init__(self, schema: rpcps.Schema, hidden=(64, 32)) -> None:
        super().__init__()
        tables = schema.table_configs()
        self.features = schema.features
        self.vectors = rpcps.EmbeddingBags(tables)
        # First order: a one-wide table beside each table, looked up by the same features.
        self.weights = rpcps.EmbeddingBags([t.model_copy(update={"name": f"{t.name}_w", "dim": 1}) for t in tables])
        sizes = [tables[0].dim * len(self.features) + len(schema.numeric), *hidden]
        layers: list[nn.Module] = []
        for n_in, n_out in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(n_in, n_out), nn.ReLU()]
        self.deep = nn.Sequential(*layers, nn.Linear(sizes[-1], 1))
        self.linear = nn.Linear(len(schema.numeric), 1)

    def forward(self, batch: rpcps.Batch) -> torch.Tensor:
        v = torch.stack([self.vectors(batch.sparse)[f] for f in self.features], dim=1)     # [B, F, dim]
        first = torch.cat(list(self.weights(batch.sparse).values()), dim=1).sum(1) + self.linear(batch.dense)[:, 0]
        second = 0.5 * (v.sum(1).pow(2) - v.pow(2).sum(1)).sum(1)
        deep = self.deep(torch.cat([v.flatten(1), batch.dense], dim=1))[:, 0]
        return first + second + deep
