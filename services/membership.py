"""Who is in the RPC group, and the leader's repair of it.

torch RPC's dynamic groups have no failure detector: one crashed member, or one failed join, wedges
every later join and leave (``../shared/research/torch-rpc-facts.md`` Q1/Q2). ps0, which hosts the
rendezvous store, therefore leads membership (the agent does in the RL workload):

* joiners queue a request in the store and wait for the leader's answer before ``init_rpc``; the
  leader first probes every member and evicts the dead, so a join never meets a dead peer, and it
  refuses a name that a live member holds (instead of letting torch wedge the group); a request may
  carry a note, which the leader's role answers before the joiner is in the group (``on_join``);
* every ``probe_interval`` it probes members and evicts one after ``probe_failures`` misses;
* a leaving member asks the leader to remove it (one code path with eviction), then shuts down
  locally, so a leave never blocks on another member;
* a membership token held too long by a non-member (a joiner that died mid-join) is forced free;
* an evicted member is told so in the store (``evicted_key``): one that was only stopped or cut off
  for a while (SIGSTOP, a partition) finds out once it runs again, and leaves to rejoin.

This module is the only user of torch's private membership internals (``agent.store``, the
``names/_ALL_WORKER_INFOS`` key, ``_update_group_membership``); they are pinned to torch 2.13.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable, Optional

import torch.distributed.rpc as rpc

from services.remote import Service, call, remote, serve, withdraw
from services.config import LeaderConfig
from services.errors import JoinRefused, NotSupported
from services.names import leader_of

log = logging.getLogger(__name__)

JOIN_QUEUE = "rpcps/join_queue"
RANK_COUNTER = "rpcps/next_rank"
MAX_RANK = 32767  # torch's worker-id limit; ranks are never reused, so this bounds joins per store life
JOIN_SETTLE = 5.0  # seconds a just-joined member may take to answer probes before it counts as dead
TOKEN_STUCK_AFTER = 15.0  # seconds one holder may keep the group's membership token
_TOKEN = "RpcGroupManagementToken"
_MEMBERS_KEY = "names/_ALL_WORKER_INFOS"


def approval_key(rank: int) -> str:
    return f"rpcps/join_answer/{rank}"


def evicted_key(rank: int) -> str:
    """Set in the store when the leader evicts the member of ``rank`` (ranks are never reused)."""
    return f"rpcps/evicted/{rank}"


def noop() -> None:
    """Liveness probe target."""


def current_members() -> list[str]:
    return sorted(w.name for w in rpc._get_current_rpc_agent().get_worker_infos())


def member_ranks() -> dict[str, int]:
    """Each member's rank by name, as this process sees the group: a member that left and joined
    again under its name has a new rank."""
    return {w.name: w.id for w in rpc._get_current_rpc_agent().get_worker_infos()}


def reachable(name: str, timeout: float = 5.0) -> bool:
    """True once an RPC to member ``name`` gets through, False while its address is still unknown.

    torch adds a joining member to the worker list a moment before its address (a store read
    comes between), and an RPC sent in that moment fails with "could not find destination url".
    """
    try:
        rpc.rpc_sync(name, noop, timeout=timeout)
        return True
    except RuntimeError as exc:
        if "could not find destination url" in str(exc):
            return False
        raise


class ProbeLedger:
    """The leader's record of its members' liveness: when it first saw each (its join), each one's
    failed probes in a row, and since when each has been silent. Pure: the leader feeds it probe
    results (True: answered; False: failed, as a dead member's do; None: no answer in time) and
    asks whom to evict. ``silence``: seconds a member that does not answer, but is not known dead,
    is given (a supervisor with a deadline of its own judges it: ``rpcps up --member-timeout``);
    None: a silent probe is a failed one."""

    def __init__(self, failures: int, settle: float = JOIN_SETTLE, clock: Callable[[], float] = time.monotonic,
                 silence: Optional[float] = None) -> None:
        self.failures, self.settle, self.silence, self._clock = failures, settle, silence, clock
        self._misses: dict[str, int] = {}
        self._first_seen: dict[str, float] = {}
        self._silent_since: dict[str, float] = {}

    def seen(self, names: list[str]) -> None:
        now = self._clock()
        for n in names:
            self._first_seen.setdefault(n, now)

    def after_round(self, results: dict[str, Optional[bool]]) -> set[str]:
        """Record one probe round; the members to evict now: ``failures`` failed probes in a row,
        or silent for ``silence`` seconds."""
        now = self._clock()
        for n, ok in results.items():
            if ok is None and self.silence is not None:
                self._silent_since.setdefault(n, now)
            else:
                self._silent_since.pop(n, None)
                self._misses[n] = 0 if ok else self._misses.get(n, 0) + 1
        for n in [n for n in self._misses if n not in results]:
            del self._misses[n]
        for n in [n for n in self._silent_since if n not in results]:
            del self._silent_since[n]
        return ({n for n, misses in self._misses.items() if misses >= self.failures} |
                {n for n, since in self._silent_since.items() if now - since >= self.silence})

    def settled(self, unreachable: set[str], deadline: float) -> set[str]:
        """Of members that did not answer before a join, those to evict now: a member that joined
        a moment ago may still be inside ``init_rpc``, so it gets ``settle`` seconds (or until
        ``deadline``) before it counts as dead."""
        now = self._clock()
        return {n for n in unreachable if now - self._first_seen.get(n, now) >= self.settle or now >= deadline}

    def forget(self, name: str) -> None:
        """``name`` is gone: a later member of that name is a new one."""
        self._misses.pop(name, None)
        self._silent_since.pop(name, None)
        self._first_seen.pop(name, None)


class TokenWatch:
    """Who holds the group's membership token, and since when. One holder keeping it past
    ``stuck_after`` seconds is a joiner that died holding it: it would block every later join and
    leave, so the leader forces it free."""

    def __init__(self, stuck_after: float = TOKEN_STUCK_AFTER, clock: Callable[[], float] = time.monotonic) -> None:
        self.stuck_after, self._clock = stuck_after, clock
        self._holder, self._since = "", 0.0

    def stuck(self, holder: str) -> bool:
        now = self._clock()
        if holder != self._holder:
            self._holder, self._since = holder, now
            return False
        return bool(holder) and now - self._since > self.stuck_after


class Membership(Service):
    """Every member has one; the leader's also leads (``GroupLeader``)."""

    def __init__(self, me: str, *, probe_interval: float = 1.0, probe_failures: int = 2,
                 silence: Optional[float] = None, on_evicted: Optional[Callable[[], None]] = None) -> None:
        self.me = me
        self.is_leader = me == leader_of(me)
        self._listeners: list[Callable[[str], None]] = []
        self._listeners_lock = threading.Lock()
        self.leader = GroupLeader(me, ProbeLedger(probe_failures, silence=silence), probe_interval, self._notify,
                                  on_evicted) if self.is_leader else None

    @classmethod
    def for_role(cls, cfg: Any, on_evicted: Optional[Callable[[], None]] = None) -> "Membership":
        """A role's membership; a leader's configuration (``LeaderConfig``) sets how it probes. A
        leader with a supervisor's lease leaves a silent member to the supervisor's deadline."""
        probes = ({"probe_interval": cfg.probe_interval, "probe_failures": cfg.probe_failures,
                   "silence": cfg.lease_timeout} if isinstance(cfg, LeaderConfig) else {})
        return cls(cfg.name, on_evicted=on_evicted, **probes)

    def add_listener(self, fn: Callable[[str], None]) -> None:
        """``fn(name)`` runs whenever a member is removed from this process's view."""
        with self._listeners_lock:
            self._listeners.append(fn)

    @remote
    def forget(self, worker_info: Any) -> None:
        """Run on every member when the leader removes ``worker_info``."""
        agent = rpc._get_current_rpc_agent()
        if worker_info.name in {w.name for w in agent.get_worker_infos()}:
            agent._update_group_membership(worker_info, [], {}, False)
        self._notify(worker_info.name)

    @remote
    def leave(self, name: str) -> None:
        """Run on the leader when ``name`` leaves voluntarily."""
        if self.leader is None:
            raise NotSupported(f"{self.me} does not lead the group; ask {leader_of(self.me)}")
        self.leader.remove({name}, reason="left")

    def evict(self, names: list[str], reason: str) -> None:
        """The leader: ``names`` out of the group although they still answer (a server that did not
        take the job's new layout). Each finds out from the store and leaves to rejoin, as a member
        evicted while frozen does."""
        if self.leader is None:
            raise NotSupported(f"{self.me} does not lead the group; ask {leader_of(self.me)}")
        self.leader.remove(set(names), reason=reason)

    def _notify(self, name: str) -> None:
        with self._listeners_lock:
            listeners = list(self._listeners)
        for fn in listeners:
            try:
                fn(name)
            except Exception:  # a listener's failure must not stop the others or the watchdog
                log.exception("membership listener failed for %s", name)

    def install(self) -> None:
        serve(self)

    def uninstall(self) -> None:
        withdraw(self)

    def on_join(self, fn: Callable[[str, dict], dict]) -> None:
        """The leader: ``fn(name, note)`` answers each joiner's note before it is admitted."""
        assert self.leader is not None, f"{self.me} is no leader"
        self.leader.on_join = fn

    def start_leader(self, store: Any) -> None:
        assert self.leader is not None, f"{self.me} is no leader"
        self.leader.start(store)

    def stop(self) -> None:
        if self.leader is not None:
            self.leader.stop()


class GroupLeader:
    """The leader's watchdog: answers join requests, probes members, evicts the dead, frees a stuck token."""

    def __init__(self, me: str, ledger: ProbeLedger, probe_interval: float, notify: Callable[[str], None],
                 on_evicted: Optional[Callable[[], None]]) -> None:
        self.me = me
        self._probe_interval = probe_interval
        self._notify, self._on_evicted = notify, on_evicted
        self._ledger = ledger
        self._token = TokenWatch()
        self._op_lock = threading.Lock()  # one removal at a time (watchdog vs. leave requests)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._store: Any = None  # the leader's plain client of the rendezvous store
        # (joiner's name, its note) -> the reply it gets with its admission; runs before it is in the group
        self.on_join: Optional[Callable[[str, dict], dict]] = None

    def start(self, store: Any) -> None:
        self._store = store
        self._thread = threading.Thread(target=self._watch, name="membership", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def _watch(self) -> None:
        next_probe = time.monotonic() + self._probe_interval
        while not self._stop.is_set():
            try:
                self._answer_joins()
                if time.monotonic() >= next_probe:
                    next_probe = time.monotonic() + self._probe_interval
                    dead = self._ledger.after_round(probe(self._others()))
                    if dead:
                        self.remove(dead, reason="missed the leader's liveness probes")
                    self._repair_token()
            except Exception:  # the watchdog must survive any single failure
                if self._stop.is_set():
                    return
                log.exception("membership watchdog error")
            self._stop.wait(0.05)

    def _answer_joins(self) -> None:
        while self._store.queue_len(JOIN_QUEUE) > 0:
            req = json.loads(self._store.queue_pop(JOIN_QUEUE, False))
            name, rank = req["name"], int(req["rank"])
            refusal = self._admit(name)
            answer: dict[str, Any] = {"ok": refusal is None, "refused": refusal}
            if refusal is None and self.on_join is not None:
                answer["reply"] = self.on_join(name, req.get("note") or {})
            log.info("join request %s (rank %d): %s", name, rank, refusal or "admitted")
            self._store.set(approval_key(rank), json.dumps(answer))

    def _admit(self, name: str) -> Optional[str]:
        """None to admit ``name``, else why not."""
        # A join contacts every member; make sure each one answers first.
        deadline = time.monotonic() + JOIN_SETTLE
        while True:
            unreachable = {n for n, ok in probe(self._others()).items() if not ok}
            settled = self._ledger.settled(unreachable, deadline)
            if settled:
                self.remove(settled, reason="unreachable before a join")
            if not unreachable - settled:
                break
            self._stop.wait(0.1)
        if name in self._others():
            return f"the name {name} belongs to a live member"
        return None

    def _others(self) -> list[str]:
        names = [n for n in current_members() if n != self.me]
        self._ledger.seen(names)
        return names

    def _repair_token(self) -> None:
        store = rpc._get_current_rpc_agent().store
        holder = store.get(_TOKEN).decode()  # exists since the leader's own join
        if self._token.stuck(holder):
            _force_free(store, holder, self._token.stuck_after)

    def remove(self, names: set[str], reason: str) -> None:
        """Take the group token, drop ``names`` (and any half-joined leftovers) from the store's
        member list and from every live member's view, then give the token back."""
        with self._op_lock:
            agent = rpc._get_current_rpc_agent()
            store = agent.store
            infos = {w.name: w for w in agent.get_worker_infos()}
            mine = f"Token_for_{self.me}_evict"
            _acquire_token(store, mine)
            try:
                listed = [e for e in store.get(_MEMBERS_KEY).decode().split(",") if e]
                # An entry the leader never heard of, while we hold the token, is a joiner that died
                # mid-join: the next joiner would try to reach it and fail.
                drop = [e for e in listed if e.rsplit("-", 1)[0] in names or e.rsplit("-", 1)[0] not in infos]
                store.set(_MEMBERS_KEY, "".join(e + "," for e in listed if e not in drop))
                gone = [infos[n] for n in names if n in infos and n != self.me]
                for info in gone:
                    agent._update_group_membership(info, [], {}, False)
                survivors = [n for n in infos if n != self.me and n not in names]
                for info in gone:
                    for n in survivors:
                        try:
                            call(n, Membership.forget, info, timeout=5)
                        except Exception as exc:
                            log.warning("could not tell %s that %s is gone: %s", n, info.name, str(exc).splitlines()[0])
            finally:
                store.set(_TOKEN, "")
                store.set(mine, "Done")
            if reason != "left" and self._store is not None:
                for info in gone:       # for a member that still runs, to find out and rejoin
                    self._store.set(evicted_key(info.id), reason)
            for info in gone:
                self._ledger.forget(info.name)
                log.info("removed %s from the group (%s)", info.name, reason)
                self._notify(info.name)
                if reason != "left" and self._on_evicted is not None:
                    self._on_evicted()
            for e in drop:
                if e.rsplit("-", 1)[0] not in infos:
                    log.warning("dropped half-joined member %s from the store", e)


def probe(names: list[str], timeout: float = 2.0) -> dict[str, Optional[bool]]:
    """Whether each member answers a no-op RPC within ``timeout`` (all asked at once): True; False
    when the ask failed (a dead member's connection is refused or reset); None when no answer came
    in time (frozen, or cut off)."""
    futs = {}
    for n in names:
        try:
            futs[n] = rpc.rpc_async(n, noop, timeout=timeout)
        except Exception:
            futs[n] = None
    result = {}
    for n, f in futs.items():
        try:
            if f is None:
                raise RuntimeError("send failed")
            f.wait()
            result[n] = True
        except Exception as exc:
            result[n] = None if "ran for more than set timeout" in str(exc) else False
    return result


def _acquire_token(store: Any, mine: str) -> None:
    """Take the group's membership token. Bounded: a holder that keeps it past the watch's limit is
    forced free, so the wait ends within about that long."""
    watch = TokenWatch()
    while True:
        holder = store.compare_set(_TOKEN, "", mine).decode()
        if holder == mine:
            return
        if watch.stuck(holder):
            _force_free(store, holder, watch.stuck_after)
        time.sleep(0.05)  # noqa: sleep-ok (polling the store, bounded by the forced release)


def _force_free(store: Any, holder: str, seconds: float) -> None:
    log.warning("membership token held by %r for %.0fs; forcing it free", holder, seconds)
    store.set(holder, "Done")
    store.compare_set(_TOKEN, holder, "")


def request_leave(me: str, timeout: float = 5.0) -> None:
    """Ask the leader to remove this member; best effort (the watchdog evicts it anyway)."""
    try:
        call(leader_of(me), Membership.leave, me, timeout=timeout)
    except Exception as exc:
        log.warning("leader did not confirm the leave (%s); it will evict us by probe", str(exc).splitlines()[0])


def check_answer(answer: str, name: str) -> dict[str, Any]:
    """The leader's reply to an admitted joiner's note; ``JoinRefused`` if it was not admitted."""
    parsed = json.loads(answer)
    if not parsed["ok"]:
        raise JoinRefused(f"the leader refused {name}: {parsed['refused']}")
    return parsed.get("reply") or {}
