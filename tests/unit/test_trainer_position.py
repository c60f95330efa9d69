from trainer.lm.position import resume_point

DATA = "wikitext-2"


def saved(name, count, position, epoch=0, rows=100, steps=10, data=DATA):
    return {"name": name, "num_trainers": count, "data": data, "position": position, "epoch": epoch,
            "rows": rows, "steps": steps, "hidden": ["h", "c"]}


def test_same_trainers_resume_exactly():
    point, _ = resume_point([saved("trainer0", 2, 40), saved("trainer1", 2, 42, steps=11)], "trainer1", 2, DATA, 100)
    assert (point.position, point.epoch, point.steps, point.hidden, point.exact) == (42, 0, 11, ["h", "c"], True)


def test_a_different_count_starts_each_share_as_far_in_as_the_saved_trainers_had_come():
    two = [saved("trainer0", 2, 40, epoch=1), saved("trainer1", 2, 60, epoch=1)]   # 1.5 epochs on average
    point, why = resume_point(two, "trainer2", 3, DATA, 66)
    assert (point.position, point.epoch, point.exact, point.hidden) == (33, 1, False, None)
    assert point.steps == 20 // 3 and "2 trainers saved, 3 now" in why
    # Fewer trainers: each new share is longer, the fraction is the same.
    point, _ = resume_point(two, "trainer0", 1, DATA, 200)
    assert (point.position, point.epoch) == (100, 1)


def test_other_data_or_no_positions_start_from_the_beginning():
    assert resume_point([saved("trainer0", 1, 40, data="synthetic")], "trainer0", 1, DATA, 100)[0] is None
    assert resume_point([], "trainer0", 1, DATA, 100)[0] is None


def test_a_share_at_its_very_end_stays_inside_the_new_share():
    point, _ = resume_point([saved("trainer0", 2, 99, rows=99)], "trainer0", 1, DATA, 50)
    assert point.position <= 48 and point.epoch == 1
