"""Ranks agree: the same collectives on every rank, and a failing rank stops its peers' waits.

Both use the process group's store (the default group's, where `init_process_group` put it) as a
side channel next to the collectives, never the collectives themselves: a rank that diverged may
be exactly the one that will not join the next collective.

- At record time every rank publishes the list of its trace's collectives (op, group, reduce op,
  tensor shapes, source line) under a key numbered by how many records with collectives of that
  function the process made, reads the other ranks' lists and compares: a difference raises
  `CollectiveMismatchError` on every rank, naming the first differing collective on each rank.
  A rank that records alone (its peers replay) raises too: once a peer has been seen blocked in
  a collective that includes this rank for `BLOCKED_SECONDS` (a rank that finished recording
  issues nothing more until the lists agree, so that peer can never post its list), or after
  `TRACEJIT_DIST_TIMEOUT` seconds without a list.
- A traced call that raises on one rank posts the failure under `tracejit/failure/<rank>`. Every
  collective tracejit runs waits in slices of `POLL_SECONDS`; between slices it checks the failure
  count, and a peer's failure that stands for `FAILURE_GRACE_SECONDS` raises
  `CollectiveAbortedError` instead of waiting for the process group's timeout (30 minutes by
  default). A rank that diverges at replay raises before it issues
  the differing collective (the replay checks each op first), so its peers stop within a slice.
  A rank that runs a collective again after posting (its caller handled the error) retracts the
  post first, so an error every rank raised and handled does not stop later collectives.
- A collective still waiting after a slice posts `tracejit/blocked/<rank>` (which collective,
  on which ranks, how many slices so far), cleared when it returns: what a rank waiting for that
  peer's list of collectives looks at. A collective that returns within a slice posts nothing.
- Before the first slice, a collective over host tensors is polled for a few milliseconds
  (`_spin`): on a small machine waking a parked thread costs more than a small all-reduce.

See docs/distributed.md.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from typing import Any

import torch

from ..debug import collective_spin_seconds
from ..errors import CollectiveAbortedError, CollectiveMismatchError

POLL_SECONDS = 0.25
# How long a posted failure must stand before a waiting peer gives up: a rank that every rank's
# error sent through its handler may rejoin a little later than the others.
FAILURE_GRACE_SECONDS = 5.0
# How long a recording rank must see a peer stay blocked in a collective it takes part in before
# concluding that the peer will never record the same call. The peer's wait may be one this rank
# joined just before it began waiting, still completing: four more slices rule that out.
BLOCKED_SECONDS = 1.0
_FAILURES = "tracejit/failures"
_records_made: dict[str, int] = {}  # function name -> records with collectives this process made of it
_posted = [False]  # this process posted a failure it has not retracted yet
_blocked_waits = [0]  # how many waits of this process outlasted a slice: tells one blocked wait from the next


def distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _store() -> Any:
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def agreement_timeout() -> float:
    return float(os.environ.get("TRACEJIT_DIST_TIMEOUT", "30"))


# -- record time: the same collectives everywhere -----------------------------------------------------

def describe_collectives(record: Any) -> list[str]:
    """One line per collective of the record: what every rank must issue alike, and where."""
    from .collectives import is_collective  # collectives.py waits through this module

    lines = []
    for op in record.ops:
        if not is_collective(op.op):
            continue
        tensors = ", ".join(str(record.tensors[h].meta) for h in op.inputs)
        plain = ", ".join(repr(s) for s in op.statics if isinstance(s, (str, int, float)))
        where = f"{os.path.basename(op.source.filename)}:{op.source.line} in {op.source.function}"
        lines.append(f"{op.op}({tensors}; {plain}) at {where}")
    return lines


def agree_on_collectives(record: Any) -> None:
    """Compare this record's collectives with the other ranks' records of the same call; raise
    CollectiveMismatchError on every rank if they differ. Nothing to do outside torch.distributed."""
    if not distributed():
        return
    mine = describe_collectives(record)
    if not mine:  # a record without collectives (rank 0's evaluation step) concerns no other rank
        return
    name = record.function_name
    number = _records_made[name] = _records_made.get(name, 0) + 1
    store, rank, world = _store(), torch.distributed.get_rank(), torch.distributed.get_world_size()
    prefix = f"tracejit/record/{name}/{number}/"
    store.set(prefix + str(rank), json.dumps(mine))
    lists = {rank: mine}
    deadline = time.monotonic() + agreement_timeout()
    standing_since = None  # a peer's posted failure, as in wait(): it may be one that peer has handled
    advice = ("Every rank must record the same calls: a new input signature or lazy state on one rank only "
              "makes the ranks issue different collectives. Give every rank the same shapes and state.")
    for other in range(world):
        if other == rank:
            continue
        first_seen_blocked, next_look = None, time.monotonic()
        while not store.check([prefix + str(other)]):
            failure = peer_failure(store, rank)
            if failure is None:
                standing_since = None
            elif standing_since is None:
                standing_since = time.monotonic()
            elif time.monotonic() - standing_since >= FAILURE_GRACE_SECONDS:
                raise CollectiveAbortedError(f"tracejit: recording {name}() on rank {rank}: {failure}")
            if time.monotonic() >= next_look:
                next_look = time.monotonic() + POLL_SECONDS
                blocked = _peer_blocked(store, other, rank)
                if blocked is None or first_seen_blocked is None or blocked["wait"] != first_seen_blocked["wait"]:
                    first_seen_blocked = blocked
                elif (blocked["slices"] - first_seen_blocked["slices"]) * POLL_SECONDS >= BLOCKED_SECONDS:
                    raise CollectiveMismatchError(
                        f"tracejit: rank {rank} recorded {name}() (its record #{number} there) and rank {other} "
                        f"did not: rank {other} has been waiting for {blocked['slices'] * POLL_SECONDS:.2f} s in "
                        f"{blocked['collective']} on process group {blocked['group']!r}, a collective rank {rank} "
                        f"will not join (it issues nothing more until the ranks' lists of collectives agree). "
                        + advice)
            if time.monotonic() > deadline:
                raise CollectiveMismatchError(
                    f"tracejit: rank {rank} recorded {name}() (its record #{number} there) and rank {other} did "
                    f"not within {agreement_timeout():.0f} s (TRACEJIT_DIST_TIMEOUT). " + advice)
            time.sleep(0.01)
        lists[other] = json.loads(store.get(prefix + str(other)))
    if any(lists[r] != mine for r in lists):
        error = CollectiveMismatchError(_disagreement(name, lists))
        error.raised_on_every_rank = True  # nobody waits for a peer: no failure to post
        raise error


def _disagreement(name: str, lists: dict[int, list[str]]) -> str:
    length = max(len(v) for v in lists.values())
    first = next(i for i in range(length) if len({tuple(v[i:i + 1]) for v in lists.values()}) > 1)
    lines = [f"tracejit: the ranks recorded different collectives in {name}(); every rank must issue the "
             f"same collectives in the same order. First difference, collective #{first}:"]
    for rank in sorted(lists):
        seen = lists[rank]
        lines.append(f"  rank {rank}: {seen[first] if first < len(seen) else '(no more collectives)'}")
    return "\n".join(lines)


# -- run time: a failing rank stops the others' waits ------------------------------------------------

def post_failure(function_name: str, error: BaseException, records: list) -> None:
    """Tell the other ranks that a traced call failed here, if it issues collectives (or has no
    record yet: its first call may have issued some before it failed)."""
    if not distributed() or isinstance(error, CollectiveAbortedError) or getattr(error, "raised_on_every_rank", False):
        return
    if records and not any(describe_collectives(record) for record in records):
        return
    try:
        store, rank = _store(), torch.distributed.get_rank()
        message = f"rank {rank} failed in {function_name}(): {type(error).__name__}: {error}"
        store.set(f"tracejit/failure/{rank}", message[:4000])
        store.add(_FAILURES, 1)
        _posted[0] = True
    except Exception:  # the store itself is gone (the job is being torn down): nothing to tell
        pass


def _retract_failure() -> None:
    """This rank runs collectives again after a failure it posted (the caller handled the error, as
    every rank does after an error they all raised): its peers are not to stop waiting for it."""
    _posted[0] = False
    _store().set(f"tracejit/failure/{torch.distributed.get_rank()}", "")


def peer_failure(store: Any, rank: int) -> str | None:
    """The failure another rank posted, or None."""
    if store.add(_FAILURES, 0) == 0:
        return None
    for other in range(torch.distributed.get_world_size()):
        key = f"tracejit/failure/{other}"
        if other != rank and store.check([key]):
            message = store.get(key).decode()
            if message:  # empty: retracted
                return message
    return None


_CORES_FOR_EVERY_RANK: dict[str, bool] = {}


def _cores_for_every_rank(group: str) -> bool:
    """Whether this host has a core for each of its ranks in `group` (LOCAL_WORLD_SIZE, as torchrun
    sets it, or else the group's size): ranks that outnumber the cores take turns on them, and a
    rank polling for its collective holds a core a peer needs (4 ranks on 2 cores: 2x slower)."""
    found = _CORES_FOR_EVERY_RANK.get(group)
    if found is None:
        from .collectives import group_ranks  # collectives.py waits through this module

        try:
            ranks = len(group_ranks(group))
        except (ValueError, RuntimeError, KeyError):
            ranks = torch.distributed.get_world_size()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", ranks))
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        found = _CORES_FOR_EVERY_RANK[group] = min(local, ranks) <= cores
    return found


def _spin(work: Any, seconds: float) -> None:
    """Poll `work` for up to `seconds` (TRACEJIT_DIST_SPIN_MS), yielding the CPU between looks. A blocked wait parks the
    thread, and waking it again costs a scheduler round trip that on a small (virtual) machine
    often waits for the next tick: several times a small model's whole all-reduce. Polling is what
    MPI libraries do on the host for the same reason; the yield lets gloo's own threads run."""
    if seconds <= 0:
        return
    deadline = time.perf_counter() + seconds
    while not work.is_completed() and time.perf_counter() < deadline:
        os.sched_yield()


def wait(work: Any, collective: str, group: str, on_host: bool = False) -> None:
    """Wait for a collective's `work`, raising CollectiveAbortedError once a peer's failure has
    stood for FAILURE_GRACE_SECONDS (a peer that handles the error and comes back retracts it).
    Past the first slice, the wait is posted as blocked for a recording peer to see. A collective
    over host tensors (`on_host`) is polled first (see `_spin`); a device
    collective's wait only orders streams, and polling it would synchronize the host."""
    if _posted[0]:
        _retract_failure()
    if on_host and _cores_for_every_rank(group):
        _spin(work, collective_spin_seconds())
    slice_ = datetime.timedelta(seconds=POLL_SECONDS)
    standing_since = None
    slices = 0  # that ran out
    try:
        while True:
            try:
                work.wait(slice_)
                return
            except RuntimeError as error:
                timed_out = "timed out" in str(error).lower()
                failure = _posted_failure()
                if failure is None:
                    if not timed_out:
                        raise
                    standing_since = None
                    slices += 1
                    _post_blocked(collective, group, slices)
                    continue
                # the collective broke (the failed peer's process ended), or the failure stands
                standing_since = time.monotonic() if standing_since is None else standing_since
                if not timed_out or time.monotonic() - standing_since >= FAILURE_GRACE_SECONDS:
                    raise CollectiveAbortedError(
                        f"tracejit: rank {torch.distributed.get_rank()} stopped waiting in {collective} on process "
                        f"group {group!r}: {failure}. The process group now has a collective in flight that will "
                        f"not complete: destroy it (or end the job) rather than issuing more collectives.") from None
    finally:
        if slices:
            _clear_blocked()


def _post_blocked(collective: str, group: str, slices: int) -> None:
    try:
        from .collectives import group_ranks  # collectives.py waits through this module

        if slices == 1:
            _blocked_waits[0] += 1
        post = {"wait": _blocked_waits[0], "slices": slices, "collective": collective, "group": group,
                "ranks": group_ranks(group)}
        _store().set(f"tracejit/blocked/{torch.distributed.get_rank()}", json.dumps(post))
    except Exception:  # the store went away with a failed peer: the collective's own error says enough
        pass


def _clear_blocked() -> None:
    try:
        _store().set(f"tracejit/blocked/{torch.distributed.get_rank()}", "")
    except Exception:
        pass


def _peer_blocked(store: Any, other: int, rank: int) -> dict | None:
    """The collective rank `other` has posted it is blocked in, if this rank takes part in it."""
    key = f"tracejit/blocked/{other}"
    if not store.check([key]):
        return None
    text = store.get(key).decode()
    post = json.loads(text) if text else None
    return post if post and rank in post["ranks"] else None


def _posted_failure() -> str | None:
    try:
        return peer_failure(_store(), torch.distributed.get_rank())
    except Exception:  # the store went away with the failed peer: the collective's own error says enough
        return None
