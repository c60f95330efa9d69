"""The update rules' one registry (``ps/spec/rules.py``): a schema's table `rule`, `--table-rule` and
`--optimizer` choose among its names, and each rule says which of its state moves with a table's
rows (``row_state``), so nothing is told by a tensor's shape."""
import typing

import pytest
import torch

from ps.spec.rules import RULES, by_row, choices
from rpcps.tables import TableConfig
from trainer.ctr.config import CtrUpSettings
from trainer.lm.config import LmUpSettings


def test_every_choice_of_a_rule_is_the_registrys():
    tables, dense = typing.get_args(choices()), typing.get_args(choices(tables=False))
    assert tables == tuple(RULES) and set(dense) == {n for n, r in RULES.items() if not r.rows_only}
    assert "rowwise_adagrad" in tables and "rowwise_adagrad" not in dense, "one value a row: tables only"
    assert typing.get_args(TableConfig.model_fields["rule"].annotation)[0] == choices()
    assert CtrUpSettings.model_fields["table_rule"].annotation == choices()
    assert CtrUpSettings.model_fields["optimizer"].annotation == LmUpSettings.model_fields["optimizer"].annotation \
        == choices(tables=False)
    with pytest.raises(ValueError, match="'sgd', 'adagrad' or 'rowwise_adagrad'"):
        TableConfig(name="t", rows=4, dim=2, rule="adam")


def test_each_rule_names_the_state_it_keeps_by_row():
    weight = torch.zeros(5, 5)        # as many rows as columns: shapes alone cannot tell
    for name, rule in RULES.items():
        state = {k: torch.zeros(shape) for k, shape in rule.state_shapes(weight).items()}
        assert set(rule.row_state) <= set(state), name
        assert by_row(rule.row_state, state, 5) == list(rule.row_state), name
    assert by_row(None, {"sum": torch.zeros(5, 2), "step": torch.zeros(())}, 5) == ["sum"], "a state saved before"
