"""Channel: a communicator's line to the engine, held by its mpi4py face (communicator.py).

A Channel is a group of ranks on a world (world.py) with its own communicator id: its sequence
of calls, the plans of its rail-state epoch (plans.py; switches agreed in replan.py), the posting
of a collective or of one point-to-point message to the engine, and the telling of a local
argument error to the peers. It knows nothing of MPI and nothing of the mpi4py face.

Everything below the class doc that has no leading underscore is its interface, and the only
way in: the Communicator (which holds one), the control plane (control/tree.py and
control/bandwidth.py run on a Channel twin), the plan-switch rounds (control/replan.py),
gpu/pipeline.py, the torch backend and request.py."""
import logging
import threading
import time

import numpy as np

from .control import recovery, tree as control
from .front import p2p, railview
from .errors import (R2commArgumentError, R2commBufferError, R2commClosedError,
                     R2commResourceError,
                     R2commTimeout, PEER_ARGUMENT_CODE, claim_telling)
from .front.plans import NONBLOCKING as _NONBLOCKING, SEQ_MASK, call_name, compile_call
from .ops import U8, dtype_code
from .control.replan import seq_before, same_rows
from .request import LocalRequest, Request, fill_status
from .world import agree_max, engine_module as _engine

_CELL_SWITCH = 1           # engine.CELL_SWITCH (r2_capi.h R2_CELL_SWITCH)

AGREE_POLL_S = 0.02        # replan()/rail_state(): a retry while the ranks' facts still differ

log = logging.getLogger("r2comm")


class Channel:
    """The engine side of a communicator (see the module doc).

    Channel(world, members, comm_id): ranks `members` (world ranks, in rank order; this rank
    among them) of `world` under communicator id `comm_id` (from the world's allocator, ids).
    twin: a hidden twin (control plane, plan-switch rounds, staging) that runs no epoch checks
    of its own and takes no part in the background plan-switch rounds."""

    def __init__(self, world, members, comm_id, twin=False):
        self._world = world
        self._engine = world.engine
        self._cfg = world.cfg
        self._members = members               # global rank of each rank of this communicator
        self._rank_of = {g: i for i, g in enumerate(members)}   # global rank -> rank here
        self._id = comm_id
        # the id, sequence number, timeout, plans' generation and Python-call flags, where
        # C-level callers (engine.run, the torch backend's C++) read them (engine.ChannelCell)
        cell = self._cell = _engine().ChannelCell(comm_id, world.cfg.timeout)
        cell.set_flag(_engine().CELL_EPOCH, bool(world.cfg.replan_every))
        cell.set_flag(_engine().CELL_REGMEM, world.regcache is not None)
        self._plans = {}
        self._state = None                    # RailState the plans are made for (None: static)
        self._relay = False                   # it has broken pairs: peers are relayed around
        self._reach = None                    # then: the members this rank posts to
        self._epoch = 0                       # agreed rail-state epoch: +1 at every switch
        self._is_ctl = twin                   # a twin: no epoch checks of its own
        self.rank = members.index(world.boot.rank)
        self.size = len(members)
        self._topo = railview.topology(world.boot.endpoints, members)
        # plan switches (replan.py): _pending is None unless a switch is being agreed (_limit:
        # the call that waits for it) or agreed and not reached yet (_switches, in call order)
        self._gate = threading.Condition()
        self._pending = None
        self._limit = None
        self._switches = []
        # the first plans follow the start-up facts: NICs that did not come up, pairs with no
        # common rail relayed around (startup.py, facts.py)
        self.round_digest = world.start_digest   # the facts this communicator last agreed on
        state = world.plan_state(world.start_facts, members)
        self.round_state = state              # ... and their plan state
        if state is not None:
            self._adopt(state)
        if not twin and self.size > 1 and world.replans is not None:
            world.replans.register(self)

    # -- what the cell holds (ChannelCell), as attributes -----------------------------------------
    # (the sequence number has one owner, the cell: every call takes its number with
    # cell.take(), here in start() or, for C-level callers and Engine.run, in C)
    @property
    def timeout(self):
        """Seconds: the bound of every blocking wait of this communicator."""
        return self._cell.timeout

    @timeout.setter
    def timeout(self, seconds):
        self._cell.timeout = seconds

    @property
    def _pending(self):
        """True while a plan switch is being agreed or is due (_cross), else None."""
        return True if self._cell.flags & _CELL_SWITCH else None

    @_pending.setter
    def _pending(self, value):
        self._cell.set_flag(_CELL_SWITCH, value is not None)

    def check(self):
        """R2commClosedError once this communicator was freed or its world closed."""
        if self._engine is None or self._world.closed:
            raise R2commClosedError("communicator has been freed")

    def compiled(self, coll, nbytes, itemsize, root=0, dtc=0, redop=0, separate=False,
                  layout=None):
        """(compiled Plan, Schedule, element count, descriptor), cached per operation shape; the
        plan's peers are connected when it is compiled.
        The count and descriptor travel in every frame header so that ranks with other
        arguments are detected (plans.py). layout: a vector collective's (planner/vector.py)."""
        key = (coll, nbytes, itemsize, root, dtc, redop, separate, layout)
        hit = self._plans.get(key)
        if hit is None:
            *hit, peers = compile_call(_engine().Plan, coll, self.rank, self._members, nbytes, itemsize,
                               root, dtc, redop, separate, self._cfg, self._state, self._topo,
                               layout)
            self._world.links.connect_for(peers)     # connections on first use (links.py)
            if len(self._plans) > 256:
                self._plans.clear()
            self._plans[key] = hit
        return hit

    def tell_peers(self, exc, kind, blocking):
        """A local argument error in a collective (the caller raises it): take the call's
        sequence number and send every peer an ABORT with the error (engine.post_error), so
        their call of this collective raises R2commPeerError naming this rank, and the next
        collective lines up on every rank."""
        if self.closed or self.size == 1 or not claim_telling(exc):
            return
        try:
            self._before_call()             # the peers' call crosses a switch here too
        except Exception:
            log.exception("r2comm: plan switch or epoch check before a failed call")
        seq = self._cell.take()
        msg = (f"rank {self._world.boot.rank} could not start its {call_name(kind, blocking)} "
               f"(call #{seq} on communicator {self._id}): {type(exc).__name__}: {exc}")
        try:
            self.post_error(seq, PEER_ARGUMENT_CODE, msg)
        except Exception:                   # never hide the caller's own error
            log.exception("r2comm: could not tell the peers about a local argument error")

    def _adopt(self, state):
        self._state = state
        self._relay = state is not None and state.has_broken_pairs()
        self._reach = None                # (the members this rank posts to, when relaying)
        if self._relay:
            cut = state.broken_peers(self.rank)
            self._reach = [g for i, g in enumerate(self._members) if i not in cut]
        self._plans.clear()
        self._cell.bump_gen()             # (C-level callers' plans too)

    def switch_plans(self, state, force=False):
        """Plans for `state` from the call about to start on (every rank switches at the same
        call): a new epoch, unless the state is the one the plans follow already (force: a
        new epoch anyway, as replan() starts one)."""
        old = self._state
        if not force and (state is old or (state is not None and old is not None and
                                           state.fingerprint() == old.fingerprint())):
            return
        self._adopt(state)
        self._epoch += 1
        try:
            self._engine.note_event(
                "replanned", -1, -1, f"communicator {self._id}: epoch {self._epoch} from call "
                f"{self._cell.seq}: plans for "
                f"{'the static state' if state is None else state.describe()}")
        except (RuntimeError, AttributeError):      # closed, or a test's stand-in engine
            pass

    def _agreed_facts(self):
        """(digest, facts) that every rank holds, agreed over the control plane (collective):
        the ranks' digests are compared until they are equal (an announcement may still be
        spreading), at most `timeout` s."""
        ctl = control.plane(self)
        deadline = time.monotonic() + self.timeout
        while True:
            if self._world.nicwatch is not None:      # (the engine follows them first)
                self._world.nicwatch.apply()
            digest, entries = self._world.facts.snapshot()
            if same_rows(control.allgather(ctl, [float(digest)])):
                return digest, entries
            if time.monotonic() > deadline:       # (the same verdict on every rank)
                raise R2commTimeout(f"communicator {self._id}: the ranks' NIC facts did not "
                                    f"agree within {self.timeout:g} s")
            time.sleep(AGREE_POLL_S)

    def agreed_state(self):
        """The agreed rail state of this communicator from the NIC facts, the same on every
        rank (collective): per host and NIC, plus the pair exceptions."""
        _, entries = self._agreed_facts()
        return self._world.plan_state(entries, self._members, always=True)

    def _maybe_replan(self):
        """R2COMM_REPLAN=K: the epoch check at every K-th operation: where every rank holds the
        same facts and they differ from the plans', the plans switch here (collective)."""
        if self._is_ctl:
            return
        digest, entries = self._world.facts.snapshot()
        if not same_rows(control.allgather(control.plane(self), [float(digest)])):
            return                                  # (still spreading: a later check)
        self.switch_plans(self._world.plan_state(entries, self._members))

    def _before_call(self):
        """What every call runs before it takes its sequence number: a due plan switch crossed
        (_cross), and at every K-th call the epoch check of R2COMM_REPLAN=K."""
        if self._pending is not None:
            self._cross()
        if self._cfg.replan_every and self._cell.seq % self._cfg.replan_every == 0:
            self._maybe_replan()

    # -- plan switches agreed in the background (replan.py) --------------------------------------
    def _cross(self):
        """At the start of a call while a plan switch is being agreed or is due: switch where
        the call is the agreed one, and wait while the round in progress holds it."""
        deadline = time.monotonic() + self.timeout
        with self._gate:
            while True:
                while self._switches and not seq_before(self._cell.seq, self._switches[0][0]):
                    self.switch_plans(self._switches.pop(0)[1])
                if self._limit is None or seq_before(self._cell.seq, self._limit):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise R2commTimeout(f"communicator {self._id}: call {self._cell.seq} waited "
                                        f"{self.timeout:g} s for a plan switch round")
                self._gate.wait(min(left, 0.5))
            self._pending = True if (self._switches or self._limit is not None) else None

    def hold_calls(self, margin):
        """A switch round begins: calls from the next one + `margin` on wait for its end
        (release_calls). Returns that call number."""
        with self._gate:
            self._limit = (self._cell.seq + margin) & SEQ_MASK
            self._pending = True
            return self._limit

    def release_calls(self, decision):
        """The round ended: decision (first call, plan state, facts digest) of an agreed switch,
        or None. Waiting calls go on."""
        with self._gate:
            self._limit = None
            if decision is not None:
                at, state, digest = decision
                self._switches.append((at, state))
                self.round_digest, self.round_state = digest, state
            self._pending = True if self._switches else None
            self._gate.notify_all()

    @property
    def comm_id(self):
        """This communicator's id (comm_ids.py)."""
        return self._id

    def start(self, coll, nbytes, itemsize, dtc, redop, work, send, root=0, post=None,
               result=None, extra_pre=(), blocking=False, layout=None):
        """Build/fetch the schedule, do the local pre-copies, post it to the engine (layout: a
        vector collective's, planner/vector.py)."""
        self.check()
        self._before_call()
        separate = send is not None and send is not work
        plan, sched, count, desc = self.compiled(coll, nbytes, itemsize, root, dtc, redop,
                                                  separate, layout)
        if sched.fills_work:
            extra_pre = ()      # the schedule reads the input from SEND itself
        if blocking and post is None and result is None and self._world.regcache is None and \
                getattr(work, "nbytes", -1) == nbytes and \
                (not separate or getattr(send, "nbytes", -1) == nbytes) and \
                not (sched.scratch or sched.pre or sched.post or extra_pre):
            # nothing to copy, register or finish here: the one-call path (Engine.run)
            members = self._reach if self._relay else self._members
            self._run_blocking(coll, plan, count, desc, work, send if separate else None, nbytes,
                               dtc, redop, members)
            return LocalRequest(self.timeout, done=True)
        scratch = np.empty(sched.scratch, np.uint8) if sched.scratch else None
        keep = [work, send, scratch]
        ptr = [0, 0, 0]
        eng = _engine()
        for i, (obj, writable) in enumerate(((work, True), (send, False), (scratch, True))):
            if obj is not None:
                keep[i] = eng.Buffer(obj, writable)
                ptr[i] = keep[i].ptr
        rc = self._world.regcache
        if rc is not None:               # RDMA rails: large user buffers go zero-copy
            rc.note(work)
            if separate:
                rc.note(send)
        memcopy = eng.memcopy
        for (db, do, sb, so, n) in (*extra_pre, *sched.pre):
            if n:
                memcopy(ptr[db] + do, ptr[sb] + so, n)
        seq = self._cell.take()
        # (peers this rank cannot reach are relayed around: the members it posts to, once)
        members = self._reach if self._relay else self._members
        # (the engine's `count` is the element count, its `tag` a collective's call descriptor)
        oid = self._engine.post(plan, ptr[0], ptr[1], ptr[2], dtc, redop, self._id, seq, count,
                                self.timeout, members, 0, desc if blocking else desc | _NONBLOCKING)
        posts = [(db, do, sb, so, n) for (db, do, sb, so, n) in sched.post if n]

        def finish():
            for (db, do, sb, so, n) in posts:
                memcopy(ptr[db] + do, ptr[sb] + so, n)
            if post is not None:
                post()
        return Request(self, oid, keep, finish if (posts or post) else None, result)

    def _run_blocking(self, coll, plan, count, desc, work, send, nbytes, dtc, redop, members):
        """A blocking call whose plan needs no scratch and no local copies, in one engine call
        (Engine.run: export the buffers, take the cell's sequence number, post, wait, release;
        `send` None: in place). A failed or timed-out call raises its error as Request.Wait()
        would; buffers the engine refuses raise R2commBufferError, told to the peers."""
        try:
            oid = self._engine.run(plan, work, send, nbytes, dtc, redop, self._cell, count,
                                   members, desc)
        except (ValueError, BufferError, TypeError) as exc:   # raised before anything posted
            blocking = not desc & _NONBLOCKING
            err = R2commBufferError(f"{call_name(coll, blocking)}: {exc}")
            self.tell_peers(err, coll, blocking)
            raise err from exc
        if oid:          # failed or timed out: a Request raises its error as Wait() would
            eng = _engine()
            keep = [eng.Buffer(work, True)] + ([eng.Buffer(send, False)] if send is not None
                                               else [])
            req = Request(self, oid, keep)
            req.conclude(self.timeout)
            req.Wait()

    def run_cached(self, key, coll, work, send, nbytes, itemsize, dtc, redop, blocking):
        """A call of the plan kept under `key` (compiled at first use) through _run_blocking,
        for the latency-bound calls a front end has checked already (numpy buffers of the
        plan's size and dtype). False, having done nothing, where the one-call path does not
        apply (a switch due, epoch checks, registered memory, relayed members, freed, or a plan
        with scratch or local copies): the general path then handles the call."""
        if self._cell.flags or self._relay or self._world.closed:
            return False
        hit = self._plans.get(key)
        if hit is None:
            try:
                plan, sched, count, desc = self.compiled(coll, nbytes, itemsize, 0, dtc, redop,
                                                          send is not None)
            except (R2commArgumentError, R2commResourceError) as exc:
                self.tell_peers(exc, coll, blocking)
                raise
            ok = not (sched.scratch or sched.pre or sched.post) and sched.fills_work
            # kept among the plans: whatever drops those (a new rail state) drops these too
            hit = self._plans[key] = (plan, count, desc) if ok else False
        if not hit:
            return False
        self._run_blocking(coll, hit[0], hit[1], hit[2] if blocking else hit[2] | _NONBLOCKING,
                           work, send, nbytes, dtc, redop, self._members)
        return True

    # -- r2comm's internal interface: gpu/pipeline, torch/backend, control, request -----------
    # (not part of the mpi4py face; what those modules may ask of a communicator)
    @property
    def closed(self):
        """True once this communicator was freed or its world closed."""
        return self._engine is None or self._world.closed

    @property
    def engine(self):
        """The engine this communicator posts to (None once freed)."""
        return self._engine

    @property
    def config(self):
        """The job's settings (r2comm.config.Config)."""
        return self._cfg

    def global_ranks(self):
        """The world rank of each rank of this communicator, in rank order."""
        return list(self._members)

    def local_rank(self, grank):
        """This communicator's rank of world rank `grank` (-1: not a member)."""
        return self._rank_of.get(grank, -1)

    def next_seq(self):
        """Take this communicator's next sequence number (after a due plan switch or epoch
        check); R2commClosedError once it was freed."""
        self.check()
        self._before_call()
        return self._cell.take()

    def native_plan(self, coll, nbytes, itemsize, root, dtc, redop, separate):
        """A collective's plan for a C-level caller (the torch backend's C++), which caches it
        until the cell's generation moves: (Plan, element count, call descriptor, scratch
        bytes, local copies before and after as (dst buffer, offset, src buffer, offset,
        bytes) tuples, whether the plan reads its input from SEND itself, the members to post
        to, the generation it is for). Its peers are connected here."""
        self.check()
        gen = self._cell.gen
        try:
            plan, sched, count, desc = self.compiled(coll, nbytes, itemsize, root, dtc, redop,
                                                      separate)
        except (R2commArgumentError, R2commResourceError) as exc:
            self.tell_peers(exc, coll, False)     # (the peers' call fails too)
            raise
        members = self._reach if self._relay else self._members
        return (plan, count, desc, sched.scratch, [tuple(c) for c in sched.pre if c[4]],
                [tuple(c) for c in sched.post if c[4]], bool(sched.fills_work),
                list(members), gen)

    @property
    def cell(self):
        """This communicator's ChannelCell (what C-level callers read at each call)."""
        return self._cell

    def native_cross(self):
        """What a C-level caller runs before a call while the cell has flags: a due plan
        switch crossed, an epoch check (R2COMM_REPLAN=K); R2commClosedError once freed. The
        sequence number is then taken from the cell."""
        self.check()
        self._before_call()

    @property
    def next_call(self):
        """The sequence number this communicator's next call takes (modulo 2^32)."""
        return self._cell.seq

    def seek_seq(self, seq):
        """Make `seq` (modulo 2^32) this communicator's next sequence number (a staging twin's
        steps)."""
        self._cell.seq = seq & SEQ_MASK

    def twin(self, kind, generation=0):
        """A channel over the same ranks and world with the id
        the world's allocator gives twin `kind` ("control", "epoch": the plan-switch rounds',
        "gpu" with its generation) of this one; it runs no epoch checks of its own."""
        ids = self._world.ids
        if kind not in ("control", "epoch", "gpu"):
            raise ValueError(f"twin kind {kind!r}: 'control', 'epoch' or 'gpu'")
        cid = ids.control(self._id) if kind == "control" else ids.epoch(self._id) \
            if kind == "epoch" else ids.gpu_twin(self._id, generation)
        return Channel(self._world, list(self._members), cid, twin=True)

    def derive(self, boot_comm, members):
        """A new channel of this world over `members` (world ranks, in rank order), its id
        agreed over bootstrap communicator `boot_comm` (collective over boot_comm: an mpi4py
        communicator or a torch store's, of exactly those ranks)."""
        cid = self._world.ids.agree(agree_max(boot_comm))
        return Channel(self._world, members, cid)

    def connect(self, ranks):
        """Connect (on first use) every rail to each of `ranks` (ranks of this communicator)
        not connected yet, all in parallel; a connection that stays down is marked so."""
        self._world.links.connect_for([self._members[r] for r in ranks])

    def post_error(self, seq, code, message):
        """Fail call `seq` of this communicator on every peer with error `code`: an ABORT to
        each peer this rank holds a connection to (its ring neighbours here connected first);
        each peer relays it along its own plan's connections when its call `seq` fails
        (failover.pxi relay_abort), so O(1) connections, not one to every peer (issue 31)."""
        n = self.size
        ring = {self._members[(self.rank + step) % n] for step in (-1, 1)}
        self._world.links.connect_for(sorted(ring - {self._members[self.rank]}))
        self._engine.post_error(self._id, seq, self._members, code, message)

    def plans_for_next_call(self):
        """Apply a plan switch or epoch check due at the next call (what start() does first), so
        the caller sees the plan state that call runs under; returns it (vcoll.py)."""
        self._before_call()
        return self._state

    @property
    def plan_state(self):
        """The RailState the plans follow (None: static plans)."""
        return self._state

    def follow(self, state):
        """Plan from RailState `state` from now on (a twin follows its parent's epoch)."""
        if state is not self._state:
            self._adopt(state)

    @property
    def epoch(self):
        """The agreed rail-state epoch: 0 at start, +1 at every switch of the plans."""
        return self._epoch

    @property
    def topo(self):
        """Which ranks share a host and their rails (front/railview.py's topology)."""
        return self._topo

    @property
    def rails(self):
        """The number of rails each rank listens on (a message's `rail` indexes them)."""
        return len(self._world.boot.rail_addrs)

    def world_rank(self, rank):
        """The world rank of rank `rank` of this communicator."""
        return self._members[rank]

    def barrier(self):
        """Return once every rank of this channel entered it (blocking, bounded by timeout)."""
        self.start("barrier", 0, 1, U8, 0, None, None, blocking=True).Wait()

    def message(self, kind, arr, peer, tag, status=None, rail=None):
        """Post one point-to-point message ("send" or "recv") of numpy array `arr` to or from
        rank `peer` of this channel (a receive: ANY_SOURCE too; never this rank: the front end
        keeps those), with `tag` (a receive: ANY_TAG too); `rail` pins a send to one rail
        while it is up. A receive's `status` gets the source, tag and bytes once it completes.
        Returns its Request."""
        self.check()
        any_source = p2p.check(kind, peer, tag, rail, self.rank, self.size, self.rails)
        eng = _engine()
        gpeer = -1 if any_source else self._members[peer]
        if not any_source:                 # on first use (ANY_SOURCE: the sender connects)
            self._world.links.connect_for((gpeer,))
        nbytes = arr.nbytes
        plan, owned = p2p.message_plan(eng.Plan, kind, gpeer, nbytes, self._cfg.eager)
        b = eng.Buffer(arr, kind == "recv")
        if kind == "send" and not owned and self._world.regcache is not None:
            self._world.regcache.note(arr)
        oid = self._engine.post(plan, b.ptr, 0, 0, dtype_code(arr.dtype), 0, self._id, 0, 0,
                                self.timeout, [] if any_source else [gpeer], 1, int(tag), nbytes,
                                -1 if rail is None else int(rail))
        if status is not None:
            fill_status(status, peer, tag, 0)
        return Request(self, oid, [b], None, None, status)

    def probe_message(self, source, tag):
        """(source rank, tag, bytes, element type code) of the message from rank `source`
        (-1: any) with `tag` (ANY_TAG too) that a receive would take now, or None."""
        hit = self._engine.p2p_probe(self._id, -1 if source < 0 else self._members[source],
                                     int(tag))
        if hit is None:
            return None
        return self.local_rank(hit[0]), hit[1], hit[2], hit[3]

    def free(self):
        """Drop this channel's engine: later calls raise R2commClosedError (C-level callers
        see the cell's CLOSED flag and come through Python)."""
        if self._engine is not None:
            recovery.release(self)        # (its last agreement's responder, if any)
        self._engine = None
        self._cell.set_flag(_engine().CELL_CLOSED, True)

    # -- fault tolerance (ULFM, issue 44): what control/recovery.py asks of a channel ----------
    def dead_ranks(self, confirmed=True):
        """Ranks of this communicator known dead: those the failure detector declared dead
        (control/liveness.py: confirmed deaths), and unless `confirmed` also the peers the
        engine holds lost (every rail failed). Without a detector (R2COMM_LIVENESS=0), the
        engine's lost peers either way."""
        self.check()
        det = self._world.liveness
        out = set()
        if det is not None:
            out = {self._rank_of[g] for g in det.dead() if g in self._rank_of}
        if det is None or not confirmed:
            me = self._world.boot.rank
            links = self._engine.links
            out |= {i for i, g in enumerate(self._members) if g != me and not links.peer_ok(g)}
        out.discard(self.rank)
        return out

    def peer_alive(self, rank):
        """False for a rank of this communicator the engine holds lost (nothing is posted to
        it: the engine would fail it at once)."""
        g = self._members[rank]
        return g == self._world.boot.rank or self._engine.links.peer_ok(g)

    def ft_twin(self):
        """A channel over the same ranks and world with the id CommIds.ft gives this one:
        the agreements of control/recovery.py run on it (it is never revoked with this one)."""
        return Channel(self._world, list(self._members), self._world.ids.ft(self._id),
                       twin=True)

    def post_recv_any(self, buf, tag):
        """(Request, Status) of a receive into `buf` from any rank with `tag`."""
        from .front.args import ANY_SOURCE
        from .request import Status
        status = Status()
        return self.message("recv", buf, ANY_SOURCE, tag, status), status

    def next_free_id(self):
        """The next communicator id this rank's allocator would hand out (comm_ids.py)."""
        return self._world.ids.next_free

    def shrunk(self, members, top):
        """The channel of world ranks `members` (rank order, this rank among them) on this
        world, with the id CommIds.shrunk(top) (`top`: the maximum of the survivors' next free
        ids, agreed)."""
        return Channel(self._world, list(members), self._world.ids.shrunk(top))

    def revoke(self, message):
        """Revoke this communicator here and on every rank (engine.revoke: its operations fail
        with R2commRevokedError). The live ring neighbours are connected first, so that the
        revocation has a path around dead ranks."""
        self.check()
        dead = self.dead_ranks(confirmed=False)
        live = [i for i in range(self.size) if i not in dead]
        if len(live) > 1:
            k = live.index(self.rank)
            ring = {live[(k - 1) % len(live)], live[(k + 1) % len(live)]} - {self.rank}
            try:
                self._world.links.connect_for(sorted(self._members[r] for r in ring))
            except Exception:        # (a neighbour that died meanwhile: the others relay)
                log.exception("r2comm: Revoke could not connect a ring neighbour")
        self._engine.revoke(self._id, message)

    @property
    def revoked(self):
        """True once this communicator was revoked (on any rank, as far as this one knows)."""
        return self._engine is not None and self._engine.is_revoked(self._id)
