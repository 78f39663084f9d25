"""The staging pipeline: a collective on device buffers as segments that overlap.

One call on device buffers (Communicator._device_call) becomes a Pipeline of segments. Each
segment takes a slot of the pinned pool (host memory, plus device scratch where it reduces on the
device) and runs its steps in order:
    d2h    device-to-host copies of the segment's input into the slot (the d2h stream)
    net    an engine collective on the slot's pinned memory (non-blocking, on the staging twin)
    h2d    host-to-device copies of received data (the h2d stream)
    dev    a reduction kernel on the device (the h2d stream, after its copies)
Steps of one segment are sequenced by the driver thread (a copy step is complete when the event
recorded after it is; a net step when its Request is), while different segments run at the same
time: segment k+1's copy runs while segment k is on the wire. Slots come back to the pool when a
segment's last copy completed.

Ordering with the user's work: at the call an event is recorded on the array's stream (or the
`stream=` argument, or the current stream), and both copy streams wait for it, so the pipeline
reads the input only after the work already queued there. The request completes when every
result byte is in device memory (all copy events completed); the user's stream is then made to
wait for the last copy event, so work queued on it afterwards sees the result. Work queued on the
stream between a non-blocking call and its Wait is not ordered after the collective (as with
mpi4py; NCCL differs): wait first.

Sequence numbers. The engine matches collectives by (communicator, sequence), and a rank must
post its sequence numbers in increasing order. The segments' collectives run on a hidden twin of
the communicator (id GPU_BIT | generation | comm id, from comm_ids.py). A device call takes
exactly one sequence number of the communicator itself, s, and is the communicator's device call
number d (counted by every rank alike: host calls do not count); its net steps use twin
sequences (d mod 2^24) * MAX_PHASES + j of twin generation (d >> 24) mod 64, posted in a fixed
order that every rank derives from the call's arguments alone (segment size: R2COMM_GPU_SEGMENT,
the same on every rank). So a call whose argument check fails on one rank (that rank sends the
error for its first twin sequence, the others fail their first step) leaves every rank in step
for the next call. A twin's sequence advances by MAX_PHASES per device call, whatever host calls
come between, and the engine compares sequences modulo 2^32: when a twin id comes back (every
2^30 device calls) its sequence restarts at 0 right after 2^32 - MAX_PHASES + j, one step on, so
no frame of the reused twin is taken for a stale one.

Failures. A step that fails (an engine error, a device error, a timeout) fails the pipeline: the
collectives it posted and that are still running are cancelled (the engine tells the peers), a
local failure is sent to the peers as the error of the next unposted sequence number, the copy
streams are drained (no copy of this call still runs when Wait raises), slots are returned, and
Wait raises the first error. A rail failure is no step failure: the engine moves the chunks to the
surviving rails and the segment's collective completes with the same bits."""
import threading
import time
import weakref

import numpy as np

from ..front.args import IN_PLACE, check_root
from ..control.comm_ids import GPU_GEN_SHIFT as _GEN_SHIFT
from ..errors import (R2commArgumentError, R2commBufferError, R2commError, R2commTimeout,
                      claim_telling, is_remote, mark_remote)
from ..ops import as_op, dtype_code
from . import backend as _be

MAX_PHASES = 256              # net steps per call: twin sequence = (d mod 2^24) * 256 + j
_CALLS_MASK = (1 << 30) - 1   # device call numbers d wrap with the twin ids
_PEER_ARG = 7                 # errors.PEER_ARGUMENT_CODE


def _code_of(exc):
    """The engine error code whose class the peers should raise for `exc` (a local failure that
    is no r2comm error: PEER_ARGUMENT_CODE, i.e. R2commPeerError naming this rank)."""
    from ..errors import CODE_CLASSES
    for code, cls in sorted(CODE_CLASSES.items(), key=lambda kv: -len(kv[1].__mro__)):
        if type(exc) is cls:
            return code
    return _PEER_ARG


# -- pinned pool and streams, one per backend ------------------------------------------------------
class Slot:
    __slots__ = ("host", "dev", "pooled")

    def __init__(self, host, dev, pooled):
        self.host, self.dev, self.pooled = host, dev, pooled


class Pool:
    """`nslots` slots of `slot_bytes` pinned host memory (and as much device scratch, made on
    first need), allocated on first use and reused. A request larger than a slot gets memory of
    its own for that segment (counted in `oversize`)."""

    def __init__(self, backend, slot_bytes, nslots):
        self.backend = backend
        self.slot_bytes = slot_bytes
        self.nslots = nslots
        self.free = []
        self.made = 0
        self.oversize = 0
        self.in_use = 0
        self.peak = 0

    def get(self, host_need, dev_need):
        """A slot, or None when all are in use (taken in the driver thread only)."""
        if host_need > self.slot_bytes or dev_need > self.slot_bytes:
            self.oversize += 1
            be = self.backend
            slot = Slot(be.pinned(max(host_need, 1)), be.empty(dev_need) if dev_need else None,
                        False)
        elif self.free:
            slot = self.free.pop()
        elif self.made < self.nslots:
            self.made += 1
            slot = Slot(self.backend.pinned(self.slot_bytes), None, True)
        else:
            return None
        if dev_need and slot.dev is None:
            slot.dev = self.backend.empty(self.slot_bytes)
        self.in_use += 1
        self.peak = max(self.peak, self.in_use)
        return slot

    def put(self, slot):
        self.in_use -= 1
        if slot.pooled:
            self.free.append(slot)


class Context:
    """Per backend: the pool and the two copy streams (device-to-host; host-to-device and the
    reduction kernels)."""

    def __init__(self, backend, cfg):
        self.backend = backend
        seg = cfg.gpu_segment
        self.pool = Pool(backend, 2 * seg + 65536, max(2, cfg.gpu_staging // (2 * seg + 65536)))
        self.reset_streams()

    def reset_streams(self):
        self.sd = self.backend.new_stream()
        self.sh = self.backend.new_stream()


_contexts = {}
_ctx_lock = threading.Lock()


def context(backend, cfg):
    """The pool and streams of a backend, for this segment size (pool slots are sized by it)."""
    key = (id(backend), cfg.gpu_segment, cfg.gpu_staging)
    with _ctx_lock:
        ctx = _contexts.get(key)
        if ctx is None or ctx.backend is not backend:
            ctx = _contexts[key] = Context(backend, cfg)
        return ctx


# -- the driver thread ---------------------------------------------------------------------------
class _Driver:
    """One thread per process that advances every pipeline in flight. It polls events and
    requests while any pipeline runs (sleeping POLL s when nothing moved) and blocks otherwise."""
    POLL = 0.0002

    def __init__(self):
        self.cv = threading.Condition()
        self.active = []              # pipelines, oldest first
        self.thread = None

    def add(self, p):
        with self.cv:
            self.active.append(p)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, daemon=True,
                                               name="r2comm-gpu-pipeline")
                self.thread.start()
            self.cv.notify()

    def kick(self):
        with self.cv:
            self.cv.notify()

    def _run(self):
        while True:
            with self.cv:
                while not self.active:
                    self.cv.wait()
                snap = list(self.active)
            moved = False
            may_take = True            # slots go to the oldest pipeline still starting segments
            for p in snap:
                try:
                    moved |= p.advance(may_take)
                except BaseException as exc:      # never lose the thread: fail that pipeline
                    p.fail(exc)
                    moved = True
                if not p.all_started():
                    may_take = False
            with self.cv:
                self.active = [p for p in self.active if not p.finished]
                if not moved and self.active:
                    self.cv.wait(self.POLL)


_driver = _Driver()


# -- one call -----------------------------------------------------------------------------------
class Segment:
    __slots__ = ("index", "steps", "host_need", "dev_need", "at", "slot", "pending", "done")

    def __init__(self, index, steps, host_need, dev_need):
        self.index = index
        self.steps = steps            # [(kind, fn)], kind in d2h / net / h2d / dev
        self.host_need = host_need
        self.dev_need = dev_need
        self.at = 0                   # next step
        self.slot = None
        self.pending = None           # (kind, event or request, order index) of the step in flight
        self.done = False


class Pipeline:
    def __init__(self, comm, twin, queue, base, backend, ctx, segs, order, user_stream, what,
                 timeout):
        self.comm, self.twin, self.base = comm, twin, base
        self.queue = queue            # calls of the twin, in posting order
        self.backend, self.ctx = backend, ctx
        self.segs = segs
        self.order = order            # [(segment, net step number)]: posting order of net steps
        self.post_at = 0              # next entry of order to post
        self.user_stream = user_stream
        self.what = what
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.next_seg = 0
        self.requests = {}            # order index -> Request (posted)
        self.error = None
        self.finished = False
        self.done_event = threading.Event()
        self.abort_seq = None         # a local failure still to be told to the peers
        self.cancel_with = None       # set by Wait (timeout) or close: fail at the next advance
        self.timeline = []            # (what, segment, t) of net steps: posted / done
        self.final_event = None
        self.state = comm.channel.plan_state  # the plans of the parent at the call (its epoch)

    # -- scheduling ----------------------------------------------------------------------------
    def all_started(self):
        return self.finished or self.next_seg >= len(self.segs)

    def _head(self):
        q = self.queue
        return bool(q) and q[0] is self

    def advance(self, may_take):
        if self.finished:
            return False
        if self.error is not None:               # failed while not head: tell peers when head
            return self._finish_failed()
        if self.cancel_with is not None:
            self.fail(self.cancel_with)
            return True
        if time.monotonic() > self.deadline:
            self.fail(R2commTimeout(f"{self.what} on device buffers timed out after "
                                    f"{self.timeout:g} s"))
            return True
        moved = False
        pool = self.ctx.pool
        while may_take and self.next_seg < len(self.segs):
            seg = self.segs[self.next_seg]
            slot = pool.get(seg.host_need, seg.dev_need)
            if slot is None:
                break
            seg.slot = slot
            self.next_seg += 1
            moved = True
        for seg in self.segs[:self.next_seg]:
            while not seg.done and self._step(seg):
                moved = True
        if all(s.done for s in self.segs):
            self._complete()
            moved = True
        return moved

    def _step(self, seg):
        """Advance one segment by at most one step; True when something moved."""
        be = self.backend
        if seg.pending is not None:
            kind, obj, oi = seg.pending
            if kind == "net":
                try:
                    if not obj.Test():
                        return False
                except R2commError as exc:        # the engine's error: the peers know it
                    mark_remote(exc)
                    raise
                self.timeline.append(("net_done", seg.index, time.monotonic()))
            elif not be.query(obj):
                return False
            seg.pending = None
            seg.at += 1
            if seg.at == len(seg.steps):
                self.ctx.pool.put(seg.slot)
                seg.slot = None
                seg.done = True
            return True
        kind, fn = seg.steps[seg.at]
        if kind == "net":
            if not self._head() or self.post_at >= len(self.order) \
                    or self.order[self.post_at][0] != seg.index:
                return False
            oi = self.post_at
            self.twin.channel.follow(self.state)          # the parent's plans at this call's epoch
            self.twin.channel.seek_seq(self.base + oi)
            req = fn(seg.slot)
            self.requests[oi] = req
            self.post_at += 1
            if self.post_at == len(self.order):
                self.queue.pop(0)
            self.timeline.append(("net_post", seg.index, time.monotonic()))
            seg.pending = ("net", req, oi)
            return True
        stream = self.ctx.sd if kind == "d2h" else self.ctx.sh
        fn(seg.slot, stream)
        seg.pending = (kind, be.record(stream), None)
        return True

    def _complete(self):
        be = self.backend
        ev = be.record(self.ctx.sh)
        be.wait_event(self.user_stream, ev)       # later work on the user's stream sees it
        self.final_event = ev
        self.finished = True
        self.done_event.set()

    # -- failure -------------------------------------------------------------------------------
    def fail(self, exc):
        if self.finished:
            return
        if self.error is None:
            self.error = exc
        for oi, req in self.requests.items():
            if not req.done:
                try:
                    req.abort(_code_of(exc), f"{self.what} on device buffers failed: {exc}")
                except Exception:
                    pass
                try:
                    req.Wait(5.0)
                except Exception:
                    pass
        self.requests = {}
        local = not is_remote(exc)
        if local and self.post_at < len(self.order):
            self.abort_seq = self.base + self.post_at
        self._finish_failed()

    def _finish_failed(self):
        """Tell the peers (when this call is the head of the twin's queue), drain the copy
        streams, give the slots back; then the call is finished."""
        q = self.queue
        if self in q:
            if q[0] is not self:
                return False                      # an earlier call still posts: wait for it
            if self.abort_seq is not None and not self.twin.channel.closed:
                try:
                    self.twin.channel.post_error(
                        self.abort_seq, _PEER_ARG,
                        f"rank {self.comm.rank}: {self.what} on device buffers failed: "
                        f"{type(self.error).__name__}: {self.error}")
                except Exception:
                    pass
            q.pop(0)
        be, device_error = self.backend, False
        for stream in (self.ctx.sd, self.ctx.sh):
            try:
                if not be.synchronize(be.record(stream), 30.0):
                    device_error = True
            except Exception:
                device_error = True
        if device_error:                          # a device error is sticky on its streams
            self.ctx.reset_streams()
        for seg in self.segs:
            if seg.slot is not None:
                self.ctx.pool.put(seg.slot)
                seg.slot = None
        self.finished = True
        self.done_event.set()
        return True


class DeviceRequest:
    """The Request of a collective on device buffers: Wait() returns once the result is in
    device memory (and raises the pipeline's first error); Test() polls."""

    def __init__(self, pipeline):
        self._p = pipeline

    @property
    def done(self):
        """True once the pipeline finished (its error, if any, not raised)."""
        return self._p.finished

    def Test(self):
        if self._p.finished and self._p.error is not None:
            raise self._p.error
        return self._p.finished

    def Wait(self, timeout=None):
        p = self._p
        limit = p.timeout if timeout is None else timeout
        if not p.done_event.wait(limit):
            p.cancel_with = R2commTimeout(f"operation timed out after {limit:g} s")
            _driver.kick()
            if not p.done_event.wait(40.0):
                raise R2commTimeout(f"operation timed out after {limit:g} s (and the pipeline "
                                    "did not stop)")
        if p.error is not None:
            raise p.error
        return None

    wait = Wait

    @property
    def pipeline(self):
        return self._p


class _Done:
    """A finished request (a zero-byte call)."""
    done = True

    def Wait(self, timeout=None):
        return None

    wait = Wait

    def Test(self):
        return True


# -- the twin and the call ------------------------------------------------------------------------
class _CommRecord:
    """What the pipeline keeps per communicator: its device call count d, its staging twins
    and each twin's queue of calls (by generation), and the counters of gpu_info."""
    __slots__ = ("calls", "twins", "queues", "stats")

    def __init__(self):
        self.calls = 0
        self.twins = {}
        self.queues = {}
        self.stats = None


_records = weakref.WeakKeyDictionary()     # communicator -> _CommRecord


def _of(comm):
    rec = _records.get(comm)
    if rec is None:
        rec = _records[comm] = _CommRecord()
    return rec


def device_calls(comm):
    """The device call count d of `comm` (the next device call's number)."""
    return _of(comm).calls


def _twin(comm, gen):
    """Staging twin `gen` of `comm` and its queue of calls (made on first use; the twin two
    generations back is dropped)."""
    rec = _of(comm)
    t = rec.twins.get(gen)
    if t is None:
        t = comm.twin("gpu", gen)        # no epoch checks of its own: the parent's plans rule
        t.timeout = comm.timeout
        rec.twins[gen] = t
        rec.queues[gen] = []
        rec.twins.pop(gen - 2, None)
        rec.queues.pop(gen - 2, None)
    return t, rec.queues[gen]


def _take_seq(comm):
    """The call's one sequence number of the communicator (with its epoch check, as Channel.start),
    and its twin's place: (twin generation, first twin sequence) from the device call number."""
    comm.channel.next_seq()                             # wraps: the engine compares modulo 2^32
    rec = _of(comm)
    d = rec.calls
    rec.calls = (d + 1) & _CALLS_MASK
    return (d >> _GEN_SHIFT) & 0x3F, (d & ((1 << _GEN_SHIFT) - 1)) * MAX_PHASES


def tell_peers(comm, exc, what):
    """A local argument error of a device-buffer call: take the call's sequence number and send
    the error as the failure of its first twin step, so the peers' call fails too and the next
    call lines up."""
    if comm.channel.closed or comm.size == 1 or not claim_telling(exc):
        return
    gen, base = _take_seq(comm)
    twin, queue = _twin(comm, gen)
    msg = (f"rank {comm.channel.world_rank(comm.rank)} could not start its {what} on device "
           f"buffers: {type(exc).__name__}: {exc}")
    a = _Abort(twin, queue, base, msg)
    queue.append(a)
    _driver.add(a)


class _Abort:
    """A call that failed its argument check here: its error goes to the peers as the failure
    of its first twin sequence, in turn (after the calls before it posted their steps)."""

    def __init__(self, twin, queue, seq, msg):
        self.twin, self.queue, self.seq, self.msg = twin, queue, seq, msg
        self.finished = False

    def all_started(self):
        return True

    def fail(self, exc):
        self.finished = True

    def advance(self, may_take):
        q = self.queue
        if q and q[0] is not self:
            return False
        if q:
            q.pop(0)
        self.finished = True
        if not self.twin.channel.closed:
            self.twin.channel.post_error(self.seq, _PEER_ARG, self.msg)
        return True


def _no_calls():
    return {"calls": 0, "segments": 0, "bytes": 0, "device_reductions": 0, "backend": None}


def info(comm):
    """Communicator.gpu_info() of `comm`: the path, the reduction mode, segment and pool sizes,
    and counters of its device calls so far."""
    from . import GPU_PATH, GPUDIRECT_REASON
    cfg = comm.channel.config
    pools = [{"backend": c.backend.name, "slot_bytes": c.pool.slot_bytes,
              "slots": c.pool.nslots, "allocated": c.pool.made, "peak_in_use": c.pool.peak,
              "oversize": c.pool.oversize} for c in list(_contexts.values())]
    return {"path": GPU_PATH, "gpudirect": False, "gpudirect_reason": GPUDIRECT_REASON,
            "reduce": cfg.gpu_reduce, "segment": cfg.gpu_segment, "staging": cfg.gpu_staging,
            "pools": pools, **(_of(comm).stats or _no_calls())}


def _seg_len(total, align, want, phases):
    """Segment length: `want` rounded to `align`, grown so that the segments' net steps fit."""
    L = max(align, want // align * align)
    most = MAX_PHASES // phases
    if -(-total // L) > most:
        L = -(-(-(-total // most)) // align) * align
    return L


def start(comm, kind, blocking, args, stream=None):
    """Validate the device buffers of a call, plan its segments and start its pipeline. Blocking
    and non-blocking calls take the same path (their segments' collectives are all non-blocking,
    so unlike host-buffer calls an Allreduce matches an Iallreduce on device buffers)."""
    cfg = comm.channel.config
    n, me = comm.size, comm.rank
    what = {"allreduce": "Allreduce", "reduce": "Reduce", "bcast": "Bcast",
            "allgather": "Allgather", "reduce_scatter_block": "Reduce_scatter_block",
            "alltoall": "Alltoall"}[kind]
    op = None
    root = 0
    if kind in ("allreduce", "reduce_scatter_block"):
        sendbuf, recvbuf, op = args
    elif kind == "reduce":
        sendbuf, recvbuf, op, root = args
    elif kind == "bcast":
        sendbuf, root = IN_PLACE, args[1]
        recvbuf = args[0]
    else:
        sendbuf, recvbuf = args
    if op is not None:
        op = as_op(op)
    if kind in ("reduce", "bcast"):
        check_root(root, n)
    # -- buffers --
    need_recv = kind != "reduce" or me == root
    R = S = None
    if need_recv:
        be, R, rn, rdt, isz = _be.describe(recvbuf, kind != "bcast" or me != root,
                                           f"{what} recvbuf" if kind != "bcast" else "Bcast buf")
    if sendbuf is IN_PLACE or kind == "bcast":
        if kind == "alltoall":
            raise R2commArgumentError("Alltoall: IN_PLACE is not supported")
        if kind == "reduce" and not need_recv:
            raise R2commArgumentError("Reduce: IN_PLACE is only for the root")
        S, sn, sdt = R, rn, rdt
    else:
        if not _be.is_device(sendbuf):
            raise R2commBufferError(f"{what}: sendbuf and recvbuf must both be device arrays or "
                                    "both host arrays")
        sbe, S, sn, sdt, sisz = _be.describe(sendbuf, False, f"{what} sendbuf")
        if not need_recv:
            be, rdt, isz, rn = sbe, sdt, sisz, None
        elif sbe is not be:
            raise R2commBufferError(f"{what}: sendbuf and recvbuf are on different devices")
        if sdt != rdt:
            raise R2commArgumentError(f"{what}: sendbuf dtype {sdt} != recvbuf dtype {rdt}")
    dtype = rdt
    mode = "host"
    if op is not None:
        if dtype not in _be.REDUCE_DTYPES:
            raise R2commArgumentError(f"{what}: cannot reduce {dtype} on device buffers")
        mode = cfg.gpu_reduce if kind in ("allreduce", "reduce_scatter_block") else "host"
        if mode == "device" and not be.can_reduce(op.name, dtype):
            mode = "host"
        if mode == "host":
            if dtype == "bfloat16":
                raise R2commArgumentError(f"{what}: bfloat16 reduces on the device only "
                                          "(R2COMM_GPU_REDUCE=device, and only for Allreduce and "
                                          "Reduce_scatter_block)")
            dtype_code(dtype)
    npdt = np.dtype(np.uint16 if dtype == "bfloat16" else dtype)
    # -- sizes --
    if kind in ("allreduce", "reduce"):
        if need_recv and sendbuf is not IN_PLACE and sn != rn:
            raise R2commBufferError(f"{what}: sendbuf has {sn} bytes, recvbuf {rn}")
        total = sn
    elif kind == "bcast":
        total = rn
    elif kind == "allgather":
        if rn % n:
            raise R2commBufferError(f"Allgather: recvbuf of {rn} bytes is not {n} equal blocks")
        total = rn // n
        if sendbuf is not IN_PLACE and sn != total:
            raise R2commBufferError(f"Allgather: recvbuf must hold {n} x sendbuf ({sn} bytes), "
                                    f"got {rn} bytes")
    elif kind == "reduce_scatter_block":
        if sn % n or (sn // n) % isz:
            raise R2commBufferError(f"Reduce_scatter_block: sendbuf of {sn} bytes is not {n} "
                                    "equal blocks of whole elements")
        total = sn // n
        if sendbuf is not IN_PLACE and rn < total:
            raise R2commBufferError(f"Reduce_scatter_block: recvbuf holds {rn} bytes, needs "
                                    f"{total}")
    else:
        if sn != rn or sn % n:
            raise R2commBufferError(f"Alltoall: sendbuf ({sn} bytes) and recvbuf ({rn} bytes) "
                                    f"must be equal and hold {n} blocks")
        total = sn // n
    # -- from here on the call takes its sequence number: no argument errors below --
    user_stream = be.stream_of(_be.unwrap(recvbuf if need_recv else sendbuf)[0], stream)
    gen, base = _take_seq(comm)
    if total == 0:
        return _Done()
    twin, queue = _twin(comm, gen)
    ctx = context(be, cfg)
    segs, order = _plan(kind, mode, twin, be, S, R, total, isz, npdt, dtype, op, root, n, me,
                        cfg.gpu_segment, sendbuf is IN_PLACE)
    p = Pipeline(comm, twin, queue, base, be, ctx, segs, order, user_stream, what, comm.timeout)
    ev0 = be.record(user_stream)          # the input is ready once the stream's work is done
    be.wait_event(ctx.sd, ev0)
    be.wait_event(ctx.sh, ev0)
    queue.append(p)
    rec = _of(comm)
    rec.stats = st = rec.stats or _no_calls()
    st["calls"] += 1
    st["segments"] += len(segs)
    st["bytes"] += total
    st["backend"] = be.name
    if op is not None and mode == "device":
        st["device_reductions"] += 1
    _driver.add(p)
    return DeviceRequest(p)


def _order(nsegs, phases):
    """Posting order of the net steps: one phase per segment in segment order; with two (an
    all-to-all, then an all-gather of what the device reduced), segment k+1's first comes before
    segment k's second, so the next segment's exchange runs while this one reduces."""
    if phases == 1:
        return [(k, 0) for k in range(nsegs)]
    out = []
    for k in range(nsegs):
        out.append((k, 0))
        if k >= 1:
            out.append((k - 1, 1))
    out.append((nsegs - 1, 1))
    return out


def _plan(kind, mode, twin, be, S, R, total, isz, npdt, dtype, op, root, n, me, want, in_place):
    """The segments (steps) and the posting order of one call."""
    segs = []
    u8 = np.uint8

    def host_view(slot, off, nbytes, dt=u8):
        return slot.host[off:off + nbytes].view(dt)

    if kind == "allreduce" and mode == "device":
        blk_align = n * isz
        L = _seg_len(total, blk_align, want, 2)
        offs = list(range(0, total, L))
        for k, off in enumerate(offs):
            ln = min(L, total - off)
            Lp = -(-ln // blk_align) * blk_align          # padded to n whole-element blocks
            b = Lp // n

            def d2h(slot, st, off=off, ln=ln, Lp=Lp):
                slot.host[ln:Lp] = 0
                be.d2h(slot.host, 0, S, off, ln, st)

            def a2a(slot, Lp=Lp):
                return twin.Ialltoall(host_view(slot, 0, Lp), host_view(slot, Lp, Lp))

            def h2d(slot, st, Lp=Lp):
                be.h2d(slot.dev, 0, slot.host, Lp, Lp, st)

            def red(slot, st, Lp=Lp, b=b):
                be.reduce(slot.dev, Lp, slot.dev, [j * b for j in range(n)], b // isz, op.name,
                          dtype, st)

            def d2h_block(slot, st, Lp=Lp, b=b):
                be.d2h(slot.host, me * b, slot.dev, Lp, b, st)

            def gather(slot, Lp=Lp):
                return twin.Iallgather(IN_PLACE, host_view(slot, 0, Lp))

            def h2d_out(slot, st, off=off, ln=ln):
                be.h2d(R, off, slot.host, 0, ln, st)

            segs.append(Segment(k, [("d2h", d2h), ("net", a2a), ("h2d", h2d), ("dev", red),
                                    ("d2h", d2h_block), ("net", gather), ("h2d", h2d_out)],
                                2 * Lp, Lp + b))
        return segs, _order(len(segs), 2)

    if kind == "reduce_scatter_block" and mode == "device":
        L = _seg_len(total, isz, want // n, 1)
        for k, off in enumerate(range(0, total, L)):
            ln = min(L, total - off)

            def d2h(slot, st, off=off, ln=ln):
                for j in range(n):
                    be.d2h(slot.host, j * ln, S, j * total + off, ln, st)

            def a2a(slot, ln=ln):
                return twin.Ialltoall(host_view(slot, 0, n * ln), host_view(slot, n * ln, n * ln))

            def h2d(slot, st, ln=ln):
                be.h2d(slot.dev, 0, slot.host, n * ln, n * ln, st)

            def red(slot, st, off=off, ln=ln):
                be.reduce(R, off, slot.dev, [j * ln for j in range(n)], ln // isz, op.name,
                          dtype, st)

            segs.append(Segment(k, [("d2h", d2h), ("net", a2a), ("h2d", h2d), ("dev", red)],
                                2 * n * ln, n * ln))
        return segs, _order(len(segs), 1)

    if kind in ("allreduce", "reduce", "bcast"):
        L = _seg_len(total, isz, want, 1)
        for k, off in enumerate(range(0, total, L)):
            ln = min(L, total - off)
            steps = []
            sends = kind != "bcast" or me == root
            gets = kind == "allreduce" or me == root if kind != "bcast" else me != root
            if sends:
                steps.append(("d2h", lambda slot, st, off=off, ln=ln:
                              be.d2h(slot.host, 0, S, off, ln, st)))
            if kind == "allreduce":
                net = (lambda slot, ln=ln: twin.Iallreduce(IN_PLACE, host_view(slot, 0, ln, npdt),
                                                           op))
            elif kind == "reduce":
                net = (lambda slot, ln=ln: twin.Ireduce(IN_PLACE, host_view(slot, 0, ln, npdt),
                                                        op, root) if me == root else
                       twin.Ireduce(host_view(slot, 0, ln, npdt), None, op, root))
            else:
                net = lambda slot, ln=ln: twin.Ibcast(host_view(slot, 0, ln), root)
            steps.append(("net", net))
            if gets:
                steps.append(("h2d", lambda slot, st, off=off, ln=ln:
                              be.h2d(R, off, slot.host, 0, ln, st)))
            segs.append(Segment(k, steps, ln, 0))
        return segs, _order(len(segs), 1)

    # per-block collectives: segment k covers bytes [off, off + ln) of every block
    L = _seg_len(total, isz, want // n, 1)
    for k, off in enumerate(range(0, total, L)):
        ln = min(L, total - off)
        if kind == "allgather":
            def d2h(slot, st, off=off, ln=ln):
                src_off = me * total + off if in_place else off
                be.d2h(slot.host, 0, S, src_off, ln, st)

            def net(slot, ln=ln):
                return twin.Iallgather(host_view(slot, 0, ln), host_view(slot, ln, n * ln))

            def h2d(slot, st, off=off, ln=ln):
                for j in range(n):
                    be.h2d(R, j * total + off, slot.host, ln + j * ln, ln, st)
            need = ln + n * ln
        elif kind == "alltoall":
            def d2h(slot, st, off=off, ln=ln):
                for j in range(n):
                    be.d2h(slot.host, j * ln, S, j * total + off, ln, st)

            def net(slot, ln=ln):
                return twin.Ialltoall(host_view(slot, 0, n * ln), host_view(slot, n * ln, n * ln))

            def h2d(slot, st, off=off, ln=ln):
                for j in range(n):
                    be.h2d(R, j * total + off, slot.host, n * ln + j * ln, ln, st)
            need = 2 * n * ln
        else:                                   # reduce_scatter_block in the engine (host mode)
            def d2h(slot, st, off=off, ln=ln):
                for j in range(n):
                    be.d2h(slot.host, j * ln, S, j * total + off, ln, st)

            def net(slot, ln=ln):
                return twin.Ireduce_scatter_block(host_view(slot, 0, n * ln, npdt),
                                                  host_view(slot, n * ln, ln, npdt), op)

            def h2d(slot, st, off=off, ln=ln):
                be.h2d(R, off, slot.host, n * ln, ln, st)
            need = n * ln + ln
        segs.append(Segment(k, [("d2h", d2h), ("net", net), ("h2d", h2d)], need, 0))
    return segs, _order(len(segs), 1)
