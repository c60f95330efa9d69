"""`rpcps export` refuses what it cannot take out, with a sentence and exit code 2, and writes
nothing: a checkpoint of a model that is not over a schema, an `--out` that holds files, a folder
without checkpoints; an exported folder that is not whole is refused by `rpcps.load_model`."""
import argparse
import shutil
from pathlib import Path

import pytest

import rpcps
from trainer.ctr.export import run

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoints-e73f547"


def refused(capsys, checkpoint: Path, out: Path) -> str:
    assert run(argparse.Namespace(checkpoint=checkpoint, out=out, data=None, replace=False)) == 2
    return capsys.readouterr().err


def test_what_cannot_be_exported_is_a_sentence_and_writes_nothing(tmp_path, capsys):
    shutil.copytree(FIXTURES / "lm", tmp_path / "lm")
    out = tmp_path / "model"
    said = refused(capsys, tmp_path / "lm", out)
    assert "step-12 holds a model that is not over a feature schema" in said, said
    said = refused(capsys, tmp_path / "lm" / "step-12", out)
    assert "not over a feature schema" in said and not out.exists(), said
    (tmp_path / "empty").mkdir()
    assert "holds no checkpoint" in refused(capsys, tmp_path / "empty", out)
    assert "no such folder" in refused(capsys, tmp_path / "nowhere", out)
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert "exists and is not an empty folder" in refused(capsys, tmp_path / "lm", out)
    assert (out / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "lm", "model"], "nothing half-written"


def test_a_folder_that_is_not_an_exported_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="is not an exported model: model.json is missing"):
        rpcps.load_model(tmp_path)


def test_a_schema_without_the_statistics_it_standardizes_by_is_refused_without_data(tmp_path, capsys, monkeypatch):
    """A checkpoint of roles started alone, whose schema gives no mean and std: only the training
    files can say how training standardized."""
    from types import SimpleNamespace

    import trainer.ctr.export as export
    from tests.support.exported import HERE
    from rpcps.schema import load_schema
    schema = load_schema(HERE / "ratings_schema.yaml").model_dump(mode="json")
    taken = SimpleNamespace(id="step-3", meta={"model": {"schema": schema}})
    monkeypatch.setattr(export, "_checkpoint", lambda path: (None, taken))
    said = refused(capsys, tmp_path / "ck", tmp_path / "model")
    assert "step-3: standardized column age has no mean and std in the schema" in said, said
    assert "give --data (the training files)" in said and not (tmp_path / "model").exists()
