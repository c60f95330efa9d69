"""rpcps's model API: write a model once, as plain PyTorch, and train it in one process or with
its tables on the parameter servers.

    import rpcps

    class MyModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tables = rpcps.EmbeddingBags([rpcps.TableConfig(name="item", rows=1000, dim=8)])
            self.top = torch.nn.Linear(8, 1)

        def forward(self, batch: rpcps.Batch) -> torch.Tensor:
            return self.top(self.tables(batch.sparse)["item"]).squeeze(1)

Everything a user's code needs is here: the names in ``__all__`` (and ``rpcps.data.__all__``, for
a source of your own). Every other name under ``rpcps/`` is internal, imported by the system's
own packages, and may change without notice; so is the rest of the repository.
"""
from rpcps.batch import Batch, Jagged
from rpcps.data import batches
from rpcps.local import local_optimizer
from rpcps.saved import load_model
from rpcps.schema import Schema, SchemaError, load_schema
from rpcps.tables import EmbeddingBags, TableConfig

__all__ = ["Batch", "EmbeddingBags", "Jagged", "Schema", "SchemaError", "TableConfig", "batches", "load_model",
           "load_schema", "local_optimizer"]
