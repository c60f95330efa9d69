"""A server's rows of a row-wise table by id: its storage holds rows of no id (``NO_ID``: an
empty column's, past the table's end), which a test reading rows by id leaves out."""
import pytest
import torch

from ps.spec.sharding import NO_ID


def held(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Of a shard's ``global_ids``: the rows that hold an id, and their ids."""
    rows = (ids != NO_ID).nonzero().squeeze(1)
    return rows, ids[rows]


def by_id(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A shard's rows made of the whole ``values`` by id: zeros where a row holds no id, as a
    server keeps them."""
    out = values[ids.clamp(min=0)]
    out[ids == NO_ID] = 0
    return out


@pytest.fixture(autouse=True, params=["packed", "gridded"])
def each_storage(request, monkeypatch):
    """Imported into a test module: its tests run with its small tables packed, as they are, and
    kept as grids (``GRID_DEPTH`` 1), with rows of no id past each table's end."""
    monkeypatch.setattr("ps.spec.sharding.GRID_DEPTH", 16 if request.param == "packed" else 1)
    return request.param
