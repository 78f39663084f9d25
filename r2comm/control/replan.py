"""Plans that follow the NIC facts by default (issue 39): every communicator switches to plans for
the new facts at one call that every rank agrees on, without any call of the user's.

A world runs one thread for it. When this rank's facts (facts.FactBook) differ from the ones a
communicator last agreed on, the thread runs a *switch round* for that communicator, on its
plan-switch twin (control.py's allgather: point-to-point messages through the engine, O(log n)
rounds, lossless under rail failures; comm_ids.epoch):

  1. The rank promises not to start call number limit = (its next call) + SWITCH_MARGIN of that
     communicator until the round ends: a call that reaches it waits (Channel._cross).
  2. Every rank's (limit, facts digest) is gathered; the same table arrives on every rank.
  3. Same digest everywhere: the new plans start at call B = the largest limit. No rank has
     started call B (each stopped short of its own limit, B is at least that), so every rank
     runs calls before B on the old plans and B on the new ones, whatever it was doing while
     the round ran. Digests that differ (an announcement still spreading) decide nothing:
     the round is run again shortly, until they agree.

Every rank of a communicator enters its round, since every rank eventually holds the new
facts (the detector's spread and heartbeat digests), and each round's outcome is the same on
every rank, so the next trigger is too. Rounds run one at a time, communicators in order of
their ids, so two communicators that share ranks never wait on each other. A flapping NIC
does not make a storm of plans: its announcements are held back (nicwatch.py), and a
communicator runs at most one round per ROUND_GAP_S. With R2COMM_REPLAN=0 nothing here runs
(plans follow the start-up facts and comm.replan() alone); with R2COMM_REPLAN=K the older
check at every K-th call decides instead (Channel._maybe_replan)."""
import logging
import threading
import time
import weakref

import numpy as np

from . import tree as control
from ..errors import R2commError

log = logging.getLogger("r2comm")

SWITCH_MARGIN = 2         # calls a rank may start while its communicator's round runs (the
                          # switch comes that many calls after the round: a few ms, not 32 ops)
ROUND_GAP_S = 0.05        # a communicator's rounds start at least this far apart
ROUND_TIMEOUT_S = 10.0    # one round's bound (a round that fails decides nothing)
RETRY_MAX_S = 5.0         # a failing communicator's rounds back off up to this
SPREAD_MAX_S = 0.5        # rounds that found the digests still differing: again this soon at
                          # the most (an announcement is spreading; it reaches every rank in
                          # a few detector periods)
CLOSE_WAIT_S = 1.0        # close() waits this long for a round in progress
SEQ_MASK = 0xFFFFFFFF


def seq_before(a, b):
    """Call number a comes before b (uint32 sequence numbers, compared modulo 2**32)."""
    return ((a - b) & SEQ_MASK) >= 1 << 31


def latest(seqs):
    """The latest of call numbers that lie within 2**31 of each other."""
    out = seqs[0]
    for s in seqs[1:]:
        if seq_before(out, s):
            out = s
    return out


class Replans:
    """The plan-switch thread of one world (see the module doc)."""

    def __init__(self, world):
        self.world = world
        self.book = world.facts
        self.rounds = 0                       # rounds run here (tests, stats)
        self.switches = 0                     # rounds that agreed on a switch
        self._comms = weakref.WeakValueDictionary()   # communicator id -> Channel
        self._retry = {}                      # communicator id -> (not before, back-off)
        self._last = {}                       # communicator id -> when its last round started
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="r2comm-replan", daemon=True)

    def register(self, comm):
        """Follow the facts for communicator `comm` (a Channel with its own sequence)."""
        self._comms[comm.comm_id] = comm
        with self.book.cond:
            self.book.cond.notify_all()

    def start(self):
        self._thread.start()

    def close(self):
        self._stop.set()
        with self.book.cond:
            self.book.cond.notify_all()
        if self._thread.is_alive():       # (a round waiting on ranks that closed ends with
            self._thread.join(CLOSE_WAIT_S)   # the engine: the thread is a daemon)

    def _run(self):
        seen = -1
        while not self._stop.is_set():
            seen = self.book.wait_change(seen, 1.0)     # (a change wakes it at once)
            if self._stop.is_set() or self.world.closed:
                return
            for cid in sorted(self._comms.keys()):
                comm = self._comms.get(cid)
                if comm is None or self._stop.is_set():
                    continue
                try:
                    self._maybe_round(comm)
                except RuntimeError:                 # the engine was closed
                    return
                except Exception:                    # noqa: BLE001 (logged; others go on)
                    log.exception("r2comm rank %d: plan switch round", self.world.boot.rank)

    def _maybe_round(self, comm):
        if comm.closed:
            return
        if self.world.nicwatch is not None:      # the engine follows what the round agrees on
            self.world.nicwatch.apply()
        digest, entries = self.book.snapshot()
        if digest == comm.round_digest:
            return
        now = time.monotonic()
        cid = comm.comm_id
        not_before = max(self._retry.get(cid, (0.0, 0.0))[0],
                         self._last.get(cid, 0.0) + ROUND_GAP_S)
        if now < not_before:
            time.sleep(min(not_before - now, ROUND_GAP_S))
            with self.book.cond:
                self.book.cond.notify_all()          # (look again at once)
            return
        self._last[cid] = now
        self.rounds += 1
        ok = self.round(comm, digest, entries)
        if ok:
            self._retry.pop(cid, None)
            return
        # digests that differed (None): soon again, gently slower; a failed round: back off
        first, factor, most = (ROUND_GAP_S, 1.25, SPREAD_MAX_S) if ok is None else \
            (0.05, 2.0, RETRY_MAX_S)
        back = min(max(self._retry.get(cid, (0.0, 0.0))[1], first) * factor, most)
        self._retry[cid] = (time.monotonic() + back, back)

    def round(self, comm, digest, entries):
        """One switch round for `comm` (module doc): True when it ended with the ranks agreed
        (a switch, or nothing to switch), None when their digests still differed, False when
        the round failed (both: it must be run again)."""
        limit = comm.hold_calls(SWITCH_MARGIN)
        decision = None
        try:
            ctl = control.epoch_plane(comm)
            ctl.follow(comm.round_state)
            table = control.allgather(ctl, [float(limit), float(digest)],
                                      timeout=min(comm.timeout, ROUND_TIMEOUT_S))
            digests = table[:, 1]
            if not (digests == digests[0]).all():
                return None
            at = latest([int(x) & SEQ_MASK for x in table[:, 0]])
            state = self.world.plan_state(entries, comm.global_ranks())
            decision = (at, state, digest)
            self.switches += 1
            return True
        except R2commError as exc:
            log.info("r2comm rank %d: a plan switch round of communicator %d failed: %s",
                     self.world.boot.rank, comm.comm_id, exc)
            return False
        finally:
            comm.release_calls(decision)


def same_rows(table):
    """Every row of an allgathered table equal to the first (tests, replan())."""
    table = np.asarray(table)
    return bool((table == table[0]).all())
