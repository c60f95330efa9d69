"""`rpcps up`'s events for the leader's changes of layout, from what its /status shows of the last
one as the supervisor polls it: `move` once under way, `moved` once ended, each once per attempt."""
from supervise.launcher import _human
from supervise.roster import ChangeEvents


def change(attempt, state, **extra):
    return {"epoch": 2, "attempt": attempt, "from": ["ps0", "ps1"], "to": ["ps0", "ps1", "ps2"], "state": state,
            "moved_slots": 1365, "moved_units": [], **extra}


def test_each_attempt_is_told_begun_and_ended_once_a_fast_one_begun_first():
    said = []
    events = ChangeEvents(said.append)
    events.seen(None)
    events.seen({"epoch": 1})                          # a leader that made none: nothing to tell
    for shown in (change("2.a", "moving"), change("2.a", "moving"),
                  change("2.a", "failed", error="ps2: gone"), change("2.a", "failed", error="ps2: gone"),
                  change("2.b", "done", bytes=10, ahead_bytes=2_000_000, pause_seconds=0.25, seconds=3.0)):
        events.seen(shown)
    assert [(e["event"], e.get("state")) for e in said] == \
        [("move", None), ("moved", "failed"), ("move", None), ("moved", "done")], said
    assert said[0]["moved_slots"] == 1365 and said[1]["error"] == "ps2: gone" and said[3]["pause_seconds"] == 0.25
    lines = [_human(e, None) for e in said]
    assert lines[0] == "layout 2: moving 1365 slots from ps0, ps1 onto ps0, ps1, ps2"
    assert lines[1] == "the change to layout 2 failed, the layout before stays in force: ps2: gone"
    assert lines[3] == "layout 2 in force: trainers held 0.25s, 2.0 MB moved in 3.0s"
