"""One process vs the cluster: with dropout off, the same losses and the same updated parameters."""
import pytest

from tests.support.cluster import SMALL_MODEL


@pytest.mark.parametrize("num_ps", [1, 2, 3])
def test_sharded_steps_match_one_process(procs, num_ps):
    procs.start_servers(num_ps, **SMALL_MODEL)
    result = procs.run_driver("equivalence", "trainer0", num_ps, steps=2, clip=0.25)

    assert max(result["initial_diff"].values()) == 0.0, "servers must start from the one-process init"
    for dist_loss, local_loss in result["losses"]:
        assert dist_loss == pytest.approx(local_loss, rel=1e-5, abs=1e-5)
    moved = {name for name, size in result["update_size"].items() if size > 1e-4}
    assert moved == set(result["update_size"]), f"parameters the steps did not change: {set(result['update_size']) - moved}"
    # The updates were real (lr 0.5, clipped to norm 0.25) and are identical to float tolerance.
    for name, diff in result["param_diff"].items():
        assert diff < 1e-5, f"{name} differs by {diff} after {len(result['losses'])} steps"
