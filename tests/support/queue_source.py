"""A source of the tests' own (``rpcps up --source tests.support.queue_source:RatingsQueue``), as a
user writes one against ``rpcps.data.Source``: a stand-in for a message queue whose message at
offset ``k`` is a rating drawn from ``k`` alone, so any process reads the same messages. Trainer
``share`` of ``shares`` takes offsets ``share``, ``share + shares``, …; its position is its next
offset; held-out messages are offsets from ``HELD_OUT`` on, never trained on."""
import random

from rpcps.data import BaseSource, Records

HELD_OUT = 1 << 40
GENRES = ("Drama", "Comedy", "War", "Action")


def message(k: int) -> dict:
    draw = random.Random(k)
    user, movie = draw.randrange(50), draw.randrange(100)
    liked = draw.random() < (0.8 if (user + movie) % 3 == 0 else 0.3)
    return {"label": int(liked), "user_id": user, "movie_id": movie, "genres": draw.sample(GENRES, 2),
            "occupation": draw.randrange(21), "age": draw.randrange(18, 60), "year": draw.randrange(1950, 2000)}


class RatingsQueue(BaseSource):
    """Written as the data guide's queue is: four methods over ``rpcps.data.BaseSource``."""

    def __init__(self, schema, share, shares, batch_size):
        super().__init__(schema, share, shares, batch_size)
        self.records = Records(schema)
        self.offset = share                      # the next message this trainer takes
        self.description = "the tests' ratings queue"

    @property
    def truncated(self):
        return self.records.truncated

    def next(self):
        offsets = range(self.offset, self.offset + self.batch_size * self.shares, self.shares)
        self.offset = offsets[-1] + self.shares
        return self.records.batch([message(k) for k in offsets])

    def held_out(self, count, batch_size):
        for start in range(HELD_OUT, HELD_OUT + count, batch_size):
            yield self.records.batch([message(k) for k in range(start, min(start + batch_size, HELD_OUT + count))])

    def state(self):
        return {"offset": self.offset}

    def restore(self, states, mine):
        # The same trainers: each its own offset. Divided anew: from the earliest, as a queue's
        # consumer group would (a few messages trained twice, none lost).
        earliest = min(s["offset"] for s in states) if mine is None else mine["offset"]
        self.offset = earliest - earliest % self.shares + self.share
        return f"offset {self.offset}"


class Dropping(RatingsQueue):
    """A queue that drops its consumer after a few messages: every start of a trainer fails the
    same way, after it has begun to train."""

    def next(self):
        self.served = getattr(self, "served", 0) + 1
        if self.served > 40:
            raise ConnectionError("the ratings queue at 127.0.0.1:9 reset the connection")
        return super().next()
