"""`rpcps up`'s final checkpoint, asked of the leader once the workers stopped: a periodic one
under way then (409) is waited out and the final one asked again, within a bound; any other
refusal is not."""
import pytest

from services.client import SidecarError
from supervise.roster import asked_while_busy


def asker(*answers):
    asked = []

    def ask():
        asked.append(1)
        answer = answers[len(asked) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer
    return ask, asked


def test_a_checkpoint_under_way_is_waited_out_and_the_final_one_asked_again():
    busy = SidecarError("http://ps0", 409, "a checkpoint is being taken")
    ask, asked = asker(busy, busy, {"id": "step-9", "step": 9})
    assert asked_while_busy(ask, within=5.0, every=0.01) == {"id": "step-9", "step": 9} and len(asked) == 3


def test_another_refusal_or_one_past_the_bound_is_raised():
    ask, asked = asker(SidecarError("http://ps0", 503, "cannot checkpoint without ps1"))
    with pytest.raises(SidecarError, match="503"):
        asked_while_busy(ask, within=5.0, every=0.01)
    assert len(asked) == 1
    busy = SidecarError("http://ps0", 409, "a checkpoint is being taken")
    ask, asked = asker(*[busy] * 100)
    with pytest.raises(SidecarError, match="409"):
        asked_while_busy(ask, within=0.05, every=0.01)
    assert 1 < len(asked) < 100
