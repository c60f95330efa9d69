"""The tests' own model over ``ratings_schema.yaml``, written only with the public API: a
factorization machine's pairwise term over the features' vectors, beside an MLP over them and
the numeric columns."""
import torch
import torch.nn as nn

import rpcps


class RatingsModel(nn.Module):
    def __init__(self, schema: rpcps.Schema) -> None:
        super().__init__()
        self.features = schema.features
        self.tables = rpcps.EmbeddingBags(schema.table_configs())
        dim = schema.tables[0].dim
        self.mlp = nn.Sequential(nn.Linear(dim * len(self.features) + len(schema.numeric), 16), nn.ReLU(),
                                 nn.Linear(16, 1))

    def forward(self, batch: rpcps.Batch) -> torch.Tensor:
        pooled = self.tables(batch.sparse)
        v = torch.stack([pooled[f] for f in self.features], dim=1)          # [B, F, D]
        fm = 0.5 * (v.sum(1).pow(2) - v.pow(2).sum(1)).sum(1)
        return fm + self.mlp(torch.cat([v.flatten(1), batch.dense], dim=1)).squeeze(1)
