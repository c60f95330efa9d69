"""The step clock: how trainers keep in step in the sync, hybrid and ssp modes. The leader (ps0) keeps it.

A trainer asks ``begin`` before it reads parameters for a step, and is answered the step's number
when its mode allows; it reports ``arrive`` once its part of the step is done.

* **sync**: the trainers taking part in the open step are the clock's members. When every member
  has arrived (each after handing its gradients to every server), the step closes: the clock has
  the servers apply the average of the arrived trainers' gradients (``apply``), and only then
  answers the arrivals and grants the next ``begin``s. A trainer new to the clock joins the open
  step if nobody has arrived at it yet, else it takes part from the next.
  Trainers that replicate weights among themselves (``--dense allreduce``) step in **lockstep**:
  their all-reduce needs the same group of trainers in every step of it, so a step begins for all
  its members at once, once each has asked to begin it (and, for the first step, once the job's
  starting count of trainers asks). The members of a step are its *group*; a new group (a trainer
  died, left or joined, or a member found the group broken) has a new ``group_key``, under which
  its members form a new process group before the step (``trainer/core/replica.py``).
* **hybrid**: lockstep as above, every trainer replicating the dense weights; but each trainer's
  rows are its own update, applied before it arrives, so closing a step applies nothing: it
  only lets the group's next step begin.
* **ssp:K**: an update is the trainer's own, applied before it arrives; ``begin`` of a trainer's
  step t waits while the slowest member has not finished step t-K-1.

A member that dies (membership's probe removes it: ``drop``) or leaves (its episode ended) stops
being waited for at once. In sync mode the step it held up closes with the gradients that arrived:
a trainer's gradients count when it arrived, so they are on every server; a dead trainer's partial
hand-over is discarded, and the average is over the trainers whose gradients it holds.

A checkpoint ``freeze``s the clock at the furthest step any member has begun: members finish up to
it and wait at their next ``begin``, where they are ``parked`` (nobody waits on anybody else then,
so the pause cannot deadlock a barrier). ``thaw`` lets them go on.

The parts, one job each:
* ``clock.py``: ``StepClock``, the members, who waits to begin, and the calls above;
* ``pace.py``: each clocked mode's rules (when a step may begin, what an arrival does, whom a
  stall waits for), and the sync step's close;
* ``freeze.py``: a checkpoint's hold on the clock;
* ``lockstep.py``: the group of trainers stepping in lockstep, and its key;
* ``service.py``: the clock's RPC surface on the leader.
None but ``service.py`` uses RPC or torch, or starts a thread.
"""
from ps.leader.clock.clock import StepClock
from ps.leader.clock.pace import STALL_WARNING_SECONDS
from ps.leader.clock.service import StepClockService, applier

__all__ = ["STALL_WARNING_SECONDS", "StepClock", "StepClockService", "applier"]
