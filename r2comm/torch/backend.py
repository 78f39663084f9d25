"""The torch.distributed backend "r2comm": a ProcessGroup whose collectives run on r2comm.

How it plugs in (torch 2.10 to 2.15). torch calls the registered creator (extended_api: it gets
the group's store, ranks, timeout and name) for every process group of the backend, for the
device types it serves (cpu, cuda). The creator returns ProcessGroupR2comm, a Python subclass of
torch's ProcessGroup: torch calls its methods from Python (dist.all_reduce -> pg.allreduce) and
from C++ through ProcessGroup's trampoline (DDP's reducer, functional collectives eager and
compiled). A Python subclass of c10d's Backend cannot be made before torch 2.14 (its constructor
is not bound: "No constructor defined"), so on every torch in the range the group registers, for
each device type, a c10d Backend that only holds what torch keeps per backend (group name,
description, sequence numbers: a FakeProcessGroup that raises on any collective). With it, group
names, sub-groups, DeviceMesh, DTensor, functional collectives, torch.compile and
destroy_process_group(subgroup) work as with torch's own backends.

Bootstrap. The default group builds the r2comm world with Communicator.from_store over the
group's store (torchrun's TCPStore under env://): the job secret, endpoints and host names travel
through it, then r2comm opens its own connections. A sub-group (new_group) of that world uses the
same engine and connections: a child communicator whose id its members agree on through the
sub-group's store; its operations time out after the sub-group's own timeout. A group whose
ranks are not all in the world (the default group is another backend) gets a world of its own.

Data. Each tensor is handed to r2comm as a numpy view of its memory (no copy) when it is a
contiguous CPU tensor. A contiguous CUDA tensor goes to r2comm's device-buffer pipeline
(r2comm/gpu: chunked staging through pinned memory, overlapped with the wire, reductions on the
GPU) as a cupy view of its memory, ordered after the work on torch's current stream (all_reduce,
broadcast, reduce, all_gather_into_tensor, reduce_scatter_tensor, even all_to_all_single); this
needs cupy (`pip install cupy-cuda12x`). Otherwise a tensor is staged: a contiguous host copy
(non-contiguous tensors; CUDA tensors without cupy, and in the list forms of all_gather,
reduce_scatter and all_to_all, gather, scatter and send/recv) that is copied back once the
operation completed. Collectives that only move bytes accept every dtype. Reductions:
float16/32/64, int8..int64, uint8..uint64 directly; bfloat16 is reduced in float32 (converted,
reduced, rounded back once: not bit-identical to Gloo, which rounds after each step); bool as
uint8 (SUM, MAX, BOR: logical or; PRODUCT, MIN, BAND: logical and). AVG is a SUM divided by the
group size (floating dtypes only). BAND, BOR, BXOR of integer and bool tensors (all_reduce,
reduce): every rank's tensor is gathered and folded in rank order. Sparse COO tensors in
all_reduce (SUM): indices and values gathered from every rank, summed, coalesced. gather and
scatter go point to point through the root. A receive without a source rank takes the first
message from any rank (r2comm.ANY_SOURCE). Other ops (PREMUL_SUM) and dtypes raise
R2commArgumentError at the call.

Completion. Each call returns at once with a Work; the group holds every Work in flight, and so
its tensors and buffers, until its operation ended, even one nobody waits for. Work.wait()
waits for that operation (any order) and raises r2comm's exception, which is also torch's:
R2commTimeout ("timed out") and the others are DistBackendError, R2commNetworkError is
DistNetworkError (all RuntimeErrors). Once Work.get_future() was called, the group's completion
thread waits for the operation and hands the future to another thread to set (torch runs .then
callbacks there): a callback may start a collective and wait for it (PowerSGD). Every wait is
bounded by R2COMM_TIMEOUT when it is set, else by the group's timeout."""
import ctypes
import datetime
import functools
import os
import queue
import threading
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch._C._distributed_c10d as _c10d

from .. import IN_PLACE
from ..control.bootstrap_store import StoreComm
from ..communicator import ANY_SOURCE, Communicator
from ..errors import (R2commArgumentError, R2commBufferError, R2commError, R2commNetworkError,
                      R2commTimeout)
from ..ops import SUM, PROD, MIN, MAX
from ..request import Request, Status
from . import lean

BACKEND_NAME = "r2comm"
_RedOp = dist.ReduceOp
_ACCEL = ("cuda", "xpu", "hpu", "mps")

_NUMPY = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64,
          torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32,
          torch.int64: np.int64, torch.uint8: np.uint8}
for _n in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _n):
        _NUMPY[getattr(torch, _n)] = getattr(np, _n)

# world: the Communicator built for the default group, and {global rank: r2comm world rank}
_world = {"comm": None, "ranks": None}


def _check_storage(t):
    """Raise R2commBufferError where strided tensor t reaches past the bytes of its storage:
    torch lets a storage shrink under its tensors (t.untyped_storage().resize_(n)), and reading
    or writing t's elements then goes past the allocation (issue 40, item 6)."""
    if t.layout != torch.strided or t.numel() == 0:
        return
    try:
        held = t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return                  # no storage (a wrapper subclass): nothing there to read past
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    if (last + 1) * t.element_size() > held:
        raise R2commBufferError(f"r2comm backend: the tensor ({tuple(t.shape)}, {t.dtype}, "
                                f"storage offset {t.storage_offset()}) reaches past its "
                                f"storage's {held} bytes (a storage resized under it)")


def _device(t, reduce=False):
    """(cupy view of a CUDA tensor's memory, torch stream it is ordered on) for the device
    pipeline, or None: CPU tensors, non-contiguous ones, dtypes it does not reduce, no cupy
    (then the tensor takes the host copy path). reduce=False: a byte view (any dtype)."""
    if t.device.type != "cuda" or t.is_sparse or not t.is_contiguous():
        return None
    _check_storage(t)
    try:
        import cupy
    except ImportError:
        return None
    from ..gpu import bfloat16
    h = t.detach()
    if h.is_complex():
        h = torch.view_as_real(h)
    flat = h.reshape(-1)
    if not reduce:
        arr = cupy.asarray(flat.view(torch.uint8))
    elif flat.dtype == torch.bfloat16:
        if _world["comm"] is not None and _world["comm"].config.gpu_reduce != "device":
            return None                   # bfloat16 reduces on the device only
        arr = bfloat16(cupy.asarray(flat.view(torch.int16)))
    elif flat.dtype == torch.bool:
        arr = cupy.asarray(flat.view(torch.uint8))
    elif flat.dtype in _NUMPY:
        arr = cupy.asarray(flat)
    else:
        return None
    return arr, torch.cuda.current_stream(t.device)


def _div_on(stream, t, n):
    """AVG of a device result: divide on the stream the collective ordered itself on."""
    with torch.cuda.stream(stream):
        with torch.no_grad():
            t.div_(n)


def _opname(op):
    return str(op).split(".")[-1]


_TABLE = {_RedOp.SUM: SUM, _RedOp.PRODUCT: PROD, _RedOp.MIN: MIN, _RedOp.MAX: MAX,
          _RedOp.AVG: SUM}
_BITS = (_RedOp.BAND, _RedOp.BOR, _RedOp.BXOR)
_BOOL = {_RedOp.SUM: MAX, _RedOp.PRODUCT: MIN, _RedOp.BAND: MIN, _RedOp.BOR: MAX}


def _redop(opts, dtype):
    """(r2comm op, divide by size) for a torch ReduceOp on this dtype; (None, the ReduceOp)
    for a bitwise op that the backend folds itself. Valid pairs are remembered in _REDUCE."""
    rop = getattr(opts, "reduceOp", _RedOp.SUM)
    kind = getattr(rop, "op", rop)
    hit = _REDUCE.get((dtype, kind))
    if hit is None:
        hit = _REDUCE[(dtype, kind)] = _redop_of(kind, dtype)
        if hit[0] is not None and dtype in _NUMPY and kind in _TABLE:
            _LEAN[(dtype, _lean_key(kind))] = hit + (_LEAN_MAX * dtype.itemsize,)
    return hit


def _kind_hashes():
    """True where hash(ReduceOp) is its kind's number for every kind (torch's ReduceOp hashes
    so): the lean path then keys on hash(opts.reduceOp), cheaper than reading .op."""
    try:
        return all(hash(dist.ReduceOp(k)) == int(k) for k in _TABLE)
    except Exception:
        return False


def _lean_key(kind):
    return int(kind) if _HASHED else kind


_REDUCE = {}      # (torch dtype, ReduceOp kind) -> _redop's answer
_LEAN = {}        # (torch dtype, _lean_key) -> (op, avg, most bytes): the lean all_reduce path
_LEAN_MAX = 8192  # elements: latency-bound calls (larger ones are reduced in place, no copy)
_HASHED = _kind_hashes()
_LEAN_DTYPES = {}  # c10 scalar type number -> torch dtype (the lean helper's codes; _lean_probe)
_KINDS = {}        # ReduceOp kind number -> kind
_KIND_OPTS = {}    # kind -> AllreduceOptions of it (what _redop reads)


def _lean_probe():
    """The lean helper's probe (lean.py), its codes learnt once; None without the helper."""
    module = lean.helper()
    if module is None:
        return None
    if not _LEAN_DTYPES:
        scratch = np.empty(16, np.uint8)
        opts = dist.AllreduceOptions()
        opts.asyncOp = False
        keys = [(module.probe([torch.zeros(1, dtype=d)], opts, scratch.ctypes.data, 16), d)
                for d in _NUMPY]
        kinds = []
        for kind in _TABLE:
            o = dist.AllreduceOptions()
            o.reduceOp, o.asyncOp = dist.ReduceOp(kind), False
            kinds.append((module.probe([torch.zeros(1)], o, scratch.ctypes.data, 16), kind, o))
        if any(key is None for key, *_ in keys + kinds):      # a helper this torch defeats
            warnings.warn("r2comm.torch: the lean-call helper does not read this torch's "
                          "calls; using the Python path", RuntimeWarning, stacklevel=2)
            lean.disable()
            return None
        for key, dtype in keys:
            _LEAN_DTYPES[key[2] >> 8] = dtype
        for key, kind, o in kinds:
            _KINDS[key[2] & 255] = kind
            _KIND_OPTS[kind] = o
    return module.probe


class _Views:
    """numpy arrays over small contiguous CPU tensors' memory, by (address, bytes, dtype):
    t.numpy() costs about a microsecond a call. An array owns nothing (built on the address,
    not the tensor) and is used only during a call on a live tensor with that address, size
    and dtype, so it always reaches that tensor's memory whatever storage is there now."""

    def __init__(self, most=256):
        self._arrays = {}
        self._most = most

    def get(self, t, nbytes):
        """t's memory as a numpy array (t: contiguous, on the CPU, of a _NUMPY dtype, of
        nbytes bytes); R2commBufferError where they are not all inside its storage."""
        if t.storage_offset() * t.itemsize + nbytes > t.untyped_storage().nbytes():
            _check_storage(t)
        key = (t.data_ptr(), nbytes, t.dtype)
        arr = self._arrays.get(key)
        if arr is not None and not t.is_neg():
            return arr
        return self._add(t, key)

    def _add(self, t, key):
        """t.numpy() (its checks: a negative view raises as before), keeping a view."""
        arr = t.numpy()
        if len(self._arrays) >= self._most:
            self._arrays.clear()
        self._arrays[key] = _at_address(key[0], key[1], arr.dtype)
        return arr


def _at_address(address, nbytes, dtype):
    """A writable numpy array of `dtype` over nbytes at address, owning nothing."""
    return np.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=dtype)


_views = _Views()


def _redop_of(kind, dtype):
    """_redop for a ReduceOp kind (raises R2commArgumentError where it is undefined)."""
    if dtype == torch.bool:
        if kind == _RedOp.AVG:
            raise R2commArgumentError("r2comm backend: AVG of a bool tensor is not defined")
        if kind in _BOOL or kind in _TABLE:
            return _BOOL.get(kind, _TABLE.get(kind)), False
    if kind in _BITS:
        if dtype.is_floating_point or dtype.is_complex:
            raise R2commArgumentError(f"r2comm backend: {_opname(kind)} needs an integer or bool "
                                      f"tensor, got {dtype}")
        return None, kind
    op = _TABLE.get(kind)
    if op is None:
        raise R2commArgumentError(f"r2comm backend: reduce op {_opname(kind)} is not supported "
                                  "(SUM, PRODUCT, MIN, MAX, AVG; BAND, BOR, BXOR on integers)")
    avg = kind == _RedOp.AVG
    if avg and not (dtype.is_floating_point or dtype.is_complex):
        raise R2commArgumentError(f"r2comm backend: AVG needs a floating-point tensor, got {dtype}")
    if dtype.is_complex and kind not in (_RedOp.SUM, _RedOp.AVG):
        raise R2commArgumentError(f"r2comm backend: {_opname(kind)} of complex tensors is not defined")
    if dtype not in _NUMPY and dtype != torch.bfloat16 and not dtype.is_complex:
        raise R2commArgumentError(
            f"r2comm backend: cannot reduce {dtype}; r2comm reduces float16, bfloat16 (in "
            "float32), float32, float64, int8..int64, uint8..uint64 and bool")
    return op, avg


class _Staged:
    """A tensor as r2comm sees it: `arr`, a flat numpy view of contiguous host memory (of the
    reduction dtype, or bytes), and writeback() that copies a staged result into the tensor."""
    __slots__ = ("tensor", "host", "arr", "copy")

    def __init__(self, t, reduce=False, out=True):
        if not isinstance(t, torch.Tensor):
            raise R2commArgumentError(f"r2comm backend: expected a tensor, got {type(t).__name__}")
        if t.is_sparse:
            raise R2commArgumentError("r2comm backend: sparse tensors are not supported")
        h = t.detach()
        copy = False
        if h.device.type != "cpu" and h.device.type not in _ACCEL:
            raise R2commArgumentError(f"r2comm backend: tensors on {h.device} are not supported")
        _check_storage(h)                 # before anything reads it (a copy, a view)
        if h.device.type != "cpu":
            h = h.to("cpu")               # staged through host memory: no GPU path yet
            copy = True
        if not h.is_contiguous():
            h = h.contiguous()
            copy = True
        if h.is_complex():
            h = torch.view_as_real(h)
        flat = h.reshape(-1)
        if reduce:
            if flat.dtype == torch.bfloat16:
                flat = flat.float()       # reduced in float32, rounded back once
                copy = True
            elif flat.dtype == torch.bool:
                flat = flat.view(torch.uint8)
            arr = flat.numpy()
        else:
            arr = flat.view(torch.uint8).numpy()
        self.tensor, self.host, self.arr, self.copy = t, flat, arr, copy and out

    def writeback(self):
        if self.copy:
            dst = torch.view_as_real(self.tensor) if self.tensor.is_complex() else self.tensor
            with torch.no_grad():
                dst.copy_(self.host.view(dst.shape))


def _torch_error(exc):
    """exc as torch's error types as well: an R2commError becomes a subclass of its own class
    and of DistNetworkError (lost peers) or DistBackendError (the rest: timeouts, whose message
    says "timed out", mismatches, closed groups), chained to the original."""
    if not isinstance(exc, R2commError) or isinstance(exc, dist.DistError) \
            or isinstance(exc, R2commArgumentError):
        return exc
    cls = type(exc)
    both = _TORCH_ERRORS.get(cls)
    if both is None:
        base = dist.DistNetworkError if isinstance(exc, R2commNetworkError) else dist.DistBackendError
        both = _TORCH_ERRORS[cls] = type(cls.__name__, (cls, base), {"__module__": __name__})
    args = exc.args
    if isinstance(exc, R2commTimeout) and args:
        # Gloo's and NCCL's wording (" Timed out "), which code and torch's tests match
        args = (f"r2comm: Timed out waiting for the operation: {args[0]}",) + args[1:]
    new = both(*args)
    new.__cause__ = exc
    return new


_TORCH_ERRORS = {}


class _Deliverer:
    """Sets finished works' futures on threads that no completion depends on: torch runs a
    future's callbacks where it is set, and a callback may start another collective and wait
    for it (PowerSGD). A thread is started whenever no idle one is there to take the item, so a
    blocked callback never holds up another; idle threads end after a while."""

    def __init__(self, linger=30.0):
        self._q = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0            # threads waiting on the queue
        self._pending = 0         # items put, not yet taken
        self._linger = linger

    def put(self, fn):
        with self._lock:
            self._pending += 1
            spawn = self._pending > self._idle
        self._q.put(fn)
        if spawn:
            threading.Thread(target=self._run, daemon=True, name="r2comm-torch-future").start()

    def _run(self):
        while True:
            with self._lock:
                self._idle += 1
            try:
                fn = self._q.get(timeout=self._linger)
            except queue.Empty:
                with self._lock:
                    self._idle -= 1
                    if self._pending <= self._idle:
                        return
                continue
            with self._lock:
                self._idle -= 1
                self._pending -= 1
            try:
                fn()
            except BaseException:        # a callback's error belongs to its future
                pass


_deliverer = _Deliverer()


class Work(dist._Work):
    """One operation in flight. wait() blocks for it alone and raises its error (r2comm's class
    and torch's, see _torch_error); get_future() is set once it completed, on a thread that no
    completion waits on. The group holds every work in flight (and so its tensors and buffers)
    until its operation ended, whether or not anyone waits for it."""

    def __init__(self, group, reqs, finish=None, result=(), source=-1):
        super().__init__()
        self._group = group
        self._reqs = reqs
        self._finish = finish
        self._result = result
        self._lock = threading.Lock()
        self._done = not reqs
        self._error = None
        self._fut = None
        self._queued = False
        self._settled = False     # the future's value was handed out (once)
        self._source = source
        if not self._done:
            group._inflight[self] = None
        elif finish is not None:
            self._finish = None
            self._run_finish(finish)

    def _run_finish(self, finish):
        try:
            finish()
        except BaseException as exc:
            self._error = _torch_error(exc)

    def _complete(self, timeout=None, deliver=None):
        """Wait for the operation (bounded by its timeout) and finish it; the future is set
        here, or through `deliver` (the completion thread's hand-over)."""
        with self._lock:
            if not self._done:
                try:
                    Request.Waitall(self._reqs, timeout)
                except BaseException as exc:       # kept for wait() and the future
                    self._error = _torch_error(exc)
                finish, self._finish = self._finish, None
                if finish is not None and self._error is None:
                    self._run_finish(finish)
                self._reqs = ()
                self._done = True
                self._group._inflight.pop(self, None)
            settle = self._claim_settle()
        if settle:
            (deliver or _call)(self._settle_future)

    def _claim_settle(self):
        """True once for a done work with a future: the caller sets it (under the lock)."""
        if self._fut is None or not self._done or self._settled:
            return False
        self._settled = True
        return True

    def _settle_future(self):
        fut = self._fut
        if self._error is not None:
            fut.set_exception(self._error)
        else:
            fut.set_result(self._result)

    def wait(self, timeout=None):
        if self._done and self._fut is None and self._error is None:
            return True                   # the synchronous calls' case: nothing to do
        if not self._done:
            secs = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
            self._complete(secs if secs else None)
        else:
            with self._lock:
                settle = self._claim_settle()
            if settle:
                self._settle_future()
        if self._error is not None:
            raise self._error
        return True

    def _poll(self):
        """Complete the operation if it ended; never blocks, never runs a callback."""
        if self._done or not self._lock.acquire(blocking=False):
            return
        try:
            ready = all(r.Test() for r in self._reqs)
        except Exception:                 # ended with an error: _complete() keeps it
            ready = True
        finally:
            self._lock.release()
        if ready:
            self._complete(deliver=_deliverer.put)

    def is_completed(self):
        self._poll()
        return self._done

    def is_success(self):
        return self._done and self._error is None

    def exception(self):
        return self._error

    def get_future(self):
        """A torch Future set when the operation completes (by the group's completion thread
        when nobody waits: what DDP's reducer relies on)."""
        with self._lock:
            if self._fut is None:
                self._fut = torch.futures.Future()
            queue_it = not self._done and not self._queued
            self._queued = True
            settle = self._claim_settle()
        if queue_it:
            self._group._completer.put(self)
        elif settle:
            self._settle_future()
        return self._fut

    def result(self):
        return self._result

    def synchronize(self):
        pass

    def _source_rank(self):
        """The rank a receive from any source got its message from (once it completed)."""
        src = self._source.source if isinstance(self._source, Status) else self._source
        if src < 0:
            raise R2commArgumentError("r2comm backend: only a completed receive from any "
                                      "source has a source rank")
        return src

    source_rank = _source_rank


class _DoneWork(Work):
    """A completed operation, reused by a group's synchronous all_reduce (torch waits on it at
    once and drops it): each get_future() is a new future holding the latest result."""

    def wait(self, timeout=None):
        return True

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result(self._result)
        return fut


def _call(fn):
    fn()


class _AsRequest:
    """A Work seen as a Request (Wait, Test), for works made of several."""
    __slots__ = ("work",)

    def __init__(self, work):
        self.work = work

    def Wait(self, timeout=None):
        self.work._complete(timeout)
        if self.work._error is not None:
            raise self.work._error

    def Test(self):
        self.work._poll()
        if self.work._done and self.work._error is not None:
            raise self.work._error
        return self.work._done


class _Completer:
    """The group's completion thread: waits for the works whose future was asked for, in the
    order they were asked, and hands each finished one to the deliverer (never runs a callback
    itself, so nothing it must complete can be stuck behind one)."""

    def __init__(self, name):
        self._q = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def put(self, work):
        self._q.put(work)

    def stop(self):
        self._q.put(None)

    def _run(self):
        while True:
            w = self._q.get()
            if w is None:
                return
            w._complete(deliver=_deliverer.put)


def _holder(rank, size):
    """A c10d Backend that only holds what torch keeps per backend (the group name and
    description, sequence numbers): torch before 2.14 has no Python trampoline for Backend (its
    constructor is not bound), so on every supported torch the collectives stay on
    ProcessGroupR2comm, reached from Python and C++ (DDP's reducer, functional collectives)
    through ProcessGroup's trampoline.
    Anything that still reached the holder raises instead of faking a result."""
    opts = _c10d.FakeProcessGroup.Options()
    opts.error_on_collective = True
    return _c10d.FakeProcessGroup._create_internal(rank, size, opts)


class ProcessGroupR2comm(dist.ProcessGroup):
    """torch.distributed's collectives on an r2comm Communicator (see the module doc)."""

    def __init__(self, store, rank, size, timeout, global_ranks=(), devices=("cpu", "cuda")):
        super().__init__(rank, size)
        secs = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
        if os.environ.get("R2COMM_TIMEOUT"):
            secs = None                       # the Communicator reads R2COMM_TIMEOUT itself
        world, ranks = _world["comm"], _world["ranks"]
        granks = list(global_ranks)
        usable = (granks and world is not None and not world.closed
                  and all(g in ranks for g in granks))
        if not usable:
            comm = Communicator.from_store(store, rank, size, prefix="r2comm",
                                           store_timeout=secs or 300.0, timeout=secs)
            if not granks or world is None or world.closed:
                _world["comm"] = comm
                _world["ranks"] = {(granks[i] if granks else i): i for i in range(size)}
        else:
            sc = StoreComm(store, rank, size, "r2comm-group", secs or 300.0)
            members = [ranks[g] for g in granks]
            comm = world.derive(sc, members)          # its id agreed over the group's store
            comm.timeout = world.timeout if secs is None else secs    # the group's own
        if comm.rank != rank or comm.size != size:
            raise R2commError(f"r2comm backend: group rank {rank}/{size} became "
                              f"{comm.rank}/{comm.size}")
        self._comm = comm
        self._xchg = comm.Dup() if size > 1 else comm    # point to point: uneven all-to-all,
        self._inflight = {}                               # gather, scatter, send/recv
        self._sweep_at = 64
        self._ops_issued = 0                              # the group's sequence number
        self._coalesced = None
        self._completer = _Completer(f"r2comm-torch-{rank}")
        self._done = _DoneWork(self, [])                  # what synchronous calls return
        self._probe = _lean_probe()                       # the lean all_reduce (lean.py)
        self._scratch = np.empty(_LEAN_MAX * 8, np.uint8)  # its send copy
        self._scratch_at = self._scratch.ctypes.data
        self._scratch_room = self._scratch.nbytes
        self._scratch_lock = threading.Lock()
        self._lean_calls = {}         # the probe's key -> _lean_call's answer
        self._prepared_calls = {}     # (bytes, numpy dtype, op) -> comm.prepare_allreduce's
        holder = _holder(rank, size)
        for d in devices:
            self._register_backend(torch.device(d), dist.ProcessGroup.BackendType.CUSTOM, holder)
        self._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)

    # -- plumbing ----------------------------------------------------------------------------
    @property
    def comm(self):
        """The r2comm Communicator of this group (rails, events, fail_rail...)."""
        return self._comm

    def _submit(self, reqs, finish=None, result=(), source=-1):
        """A Work for these requests, held by the group until its operation ended. Works
        nobody waits for are completed here, a sweep each time their number doubled."""
        if len(self._inflight) >= self._sweep_at:
            for w in list(self._inflight):
                w._poll()
            self._sweep_at = max(64, 2 * len(self._inflight))
        self._ops_issued += 1
        w = Work(self, reqs, finish, result, source)
        if self._coalesced is not None:
            self._coalesced.append(w)
        return w

    def getBackendName(self):
        return BACKEND_NAME

    def _get_sequence_number_for_group(self):
        """How many operations this group has issued (torch's sequence number)."""
        return self._ops_issued

    def _set_sequence_number_for_group(self):
        """Sequence numbers start at 0 on every rank (nothing to agree on)."""

    def name(self):
        return BACKEND_NAME

    @property
    def pending_works(self):
        """How many operations of this group are in flight (waited for or not)."""
        return len(self._inflight)

    def _wait_for_pending_works(self):
        """Complete every operation in flight, each bounded by its timeout (errors stay with
        their works)."""
        for w in list(self._inflight):
            w._complete()

    def shutdown(self):
        """Complete every operation in flight, then stop the completion thread."""
        self._wait_for_pending_works()
        self._completer.stop()

    abort = shutdown

    def _start_coalescing(self, device=None):
        self._coalesced = []

    def _end_coalescing(self, device=None):
        works, self._coalesced = self._coalesced or [], None
        return self._join(works, [])

    def _join(self, works, result):
        """One Work for several: done when all are, raising the first error."""
        return self._submit([_AsRequest(w) for w in works], None, result)


    # -- collectives -------------------------------------------------------------------------
    def _one(self, tensors, what):
        if not isinstance(tensors, (list, tuple)) or len(tensors) != 1:
            raise R2commArgumentError(f"r2comm backend: {what} takes exactly one tensor per rank")
        return tensors[0]

    def _reduce_finish(self, staged, avg):
        def finish():
            for s in staged:
                if avg:
                    s.host.div_(self.size())
                s.writeback()
        return finish

    def allreduce(self, tensors, opts=None):
        probe = self._probe
        if probe is not None:               # the C++ helper reads the call (lean.py)
            if self._scratch_lock.acquire(False):   # else another thread's call is on it
                try:
                    key = probe(tensors, opts, self._scratch_at, self._scratch_room)
                    if key is not None:
                        call = self._lean_calls.get(key)
                        if call is None:
                            call = self._lean_call(key)
                        if call:            # _allreduce_now, inlined (a call's cost counts)
                            t = tensors[0]
                            try:
                                call[2](call[1], call[0])
                            except R2commError as exc:
                                return self._failed_now(t, exc)
                            self._ops_issued += 1
                            if call[3]:
                                t.div_(self.size())
                            done = self._done
                            done._result = tensors
                            return done
                finally:
                    self._scratch_lock.release()
        elif len(tensors) == 1 and opts is not None and not opts.asyncOp:
            t = tensors[0]              # torch waits at once (async_op=False): the lean path
            if t.is_cpu and not t.is_sparse and t.is_contiguous() and not t.requires_grad:
                rop = opts.reduceOp
                hit = _LEAN.get((t.dtype, hash(rop) if _HASHED else rop.op))
                if hit is not None:
                    nbytes = t.nbytes
                    if 0 < nbytes <= hit[2]:
                        arr = _views.get(t, nbytes)
                        run = self._prepared(nbytes, arr.dtype, hit[0])
                        if run is not None:
                            return self._allreduce_now(t, arr, arr.copy(), run, hit[1])
        return self._allreduce(tensors, opts)

    def _failed_now(self, t, exc):
        """A synchronous all_reduce's error: an argument error raises (the general path's
        wrapper makes it torch's); any other is kept on a Work for wait() to raise."""
        if isinstance(exc, R2commArgumentError):
            raise exc
        w = Work(self, [], None, [t])
        w._error = _torch_error(exc)
        return w

    def _lean_call(self, key):
        """(recv, send, run, avg) for the helper's key (address, bytes, scalar type * 256 +
        reduce op): a numpy view of the tensor's memory, one of the scratch (the helper copied
        the tensor there), the prepared allreduce, and whether to divide; False where the lean
        path does not apply (the general path then handles the call and its errors)."""
        address, nbytes, code = key
        dtype = _LEAN_DTYPES.get(code >> 8)
        kind = _KINDS.get(code & 255)
        call = False
        if dtype is not None and kind in _TABLE and nbytes <= _LEAN_MAX * dtype.itemsize:
            try:
                op, avg = _redop(_KIND_OPTS[kind], dtype)
            except R2commArgumentError:
                op = None
            npdt = np.dtype(_NUMPY[dtype])
            run = None if op is None else self._prepared(nbytes, npdt, op)
            if run is not None:
                call = (_at_address(address, nbytes, npdt), self._scratch[:nbytes].view(npdt),
                        run, avg)
        if len(self._lean_calls) >= 256:
            self._lean_calls.clear()
        self._lean_calls[key] = call
        return call

    def _prepared(self, nbytes, npdt, op):
        """The Communicator's prepared allreduce for these bytes, numpy dtype and r2comm op;
        None where it cannot be had (a freed group: the general path raises the error)."""
        key = (nbytes, npdt, op)
        run = self._prepared_calls.get(key)
        if run is None:
            try:
                run = self._comm.prepare_allreduce(nbytes, npdt, op)
            except R2commError:
                return None
            if len(self._prepared_calls) >= 256:
                self._prepared_calls.clear()
            self._prepared_calls[key] = run
        return run

    def _allreduce(self, tensors, opts):
        t = self._one(tensors, "allreduce")
        if t.is_sparse:
            return self._sparse_allreduce(t, opts)
        op, avg = _redop(opts, t.dtype)
        if op is None:
            return self._bitwise([t], avg, [t])
        if t.device.type == "cpu" and t.dtype in _NUMPY and t.is_contiguous() and t.numel():
            _check_storage(t)
            arr = t.detach().view(-1).numpy()         # no staging
            req = self._comm.Iallreduce(IN_PLACE, arr, op)
            return self._submit([req], (lambda: t.detach().div_(self.size())) if avg else None,
                                [t])
        d = _device(t, reduce=True)
        if d is not None:
            arr, st = d
            req = self._comm.Iallreduce(IN_PLACE, arr, op, stream=st.cuda_stream)
            n = self.size()
            return self._submit([req], (lambda: _div_on(st, t, n)) if avg else None, [t])
        s = _Staged(t, reduce=True)
        if s.arr.size == 0:
            return self._submit([], None, [t])
        req = self._comm.Iallreduce(IN_PLACE, s.arr, op)
        return self._submit([req], self._reduce_finish([s], avg), [t])

    def _allreduce_now(self, t, recv, send, run, avg):
        """A synchronous all_reduce of t in one engine call: run(send, recv), the prepared
        Allreduce (8 B calls cost about what Communicator.Allreduce does), matched with the
        peers' call as a non-blocking one, since a peer may have made it asynchronous; recv
        is t's memory, send a copy of it (the in-place schedule has local copies, the fast
        path none). Returns the group's done Work."""
        try:
            run(send, recv)
        except R2commError as exc:
            return self._failed_now(t, exc)
        self._ops_issued += 1
        if avg:
            t.div_(self.size())
        done = self._done
        done._result = [t]
        return done

    def allreduce_coalesced(self, tensors, opts=None):
        return self._join([self.allreduce([t], opts) for t in tensors], list(tensors))

    def _bitwise(self, tensors, kind, result, root=None):
        """BAND, BOR, BXOR of integer or bool tensors (r2comm's engine has no bitwise ops):
        every rank's tensor gathered, then folded in rank order (on `root` only, for reduce)."""
        fold = _BITWISE[kind]
        works = []
        for t in tensors:
            s = _Staged(t, out=False)
            n = self.size()
            blocks = torch.empty((n, s.host.numel()), dtype=s.host.dtype)
            if s.arr.nbytes == 0:
                continue
            req = self._comm.Iallgather(s.arr, blocks.view(-1).view(torch.uint8).numpy())

            def finish(t=t, blocks=blocks):
                if root is not None and self.rank() != root:
                    return
                acc = blocks[0].clone()
                for k in range(1, n):
                    fold(acc, blocks[k], out=acc)
                with torch.no_grad():
                    t.copy_(acc.view(t.shape))
            works.append(self._submit([req], finish, [t]))
        return self._join(works, result)

    def _sparse_allreduce(self, t, opts):
        """SUM of sparse COO tensors as Gloo does it: every rank's indices and values gathered
        (padded to the largest count), summed and coalesced; the result replaces the tensor."""
        rop = getattr(opts, "reduceOp", _RedOp.SUM)
        if getattr(rop, "op", rop) != _RedOp.SUM:
            raise R2commArgumentError("r2comm backend: sparse all_reduce supports SUM only")
        if t.device.type != "cpu":
            raise R2commArgumentError("r2comm backend: sparse all_reduce takes CPU tensors")
        mine = t.detach().coalesce()
        idx, val = mine.indices().contiguous(), mine.values().contiguous()
        n, nnz = self.size(), idx.shape[1]
        counts = np.empty(n, np.int64)
        self._comm.Allgather(np.array([nnz], np.int64), counts)
        most = int(counts.max())
        pidx = torch.zeros((n, idx.shape[0], most), dtype=torch.int64)
        pval = torch.zeros((n, most) + tuple(val.shape[1:]), dtype=val.dtype)
        pidx[self.rank(), :, :nnz] = idx
        pval[self.rank(), :nnz] = val
        wi = self.all_gather_single(pidx.view(-1), pidx[self.rank()].reshape(-1).clone())
        wv = self.all_gather_single(pval.view(-1), pval[self.rank()].reshape(-1).clone())

        def finish():
            wi.wait()
            wv.wait()
            total = None
            for r in range(n):
                k = int(counts[r])
                part = torch.sparse_coo_tensor(pidx[r, :, :k], pval[r, :k], mine.shape)
                total = part if total is None else total + part
            with torch.no_grad():
                t.copy_(total.coalesce())
        return self._submit([_AsRequest(wi), _AsRequest(wv)], finish, [t])

    def broadcast(self, tensors, opts=None):
        t = self._one(tensors, "broadcast")
        root = getattr(opts, "rootRank", 0)
        d = _device(t)
        if d is not None:
            req = self._comm.Ibcast(d[0], root, stream=d[1].cuda_stream)
            return self._submit([req], None, [t])
        s = _Staged(t, out=self.rank() != root)
        if s.arr.size == 0:
            return self._submit([], None, [t])
        req = self._comm.Ibcast(s.arr, root)
        return self._submit([req], s.writeback, [t])

    def reduce(self, tensors, opts=None):
        t = self._one(tensors, "reduce")
        root = getattr(opts, "rootRank", 0)
        op, avg = _redop(opts, t.dtype)
        if op is None:
            return self._bitwise([t], avg, [t], root)
        mine = self.rank() == root
        d = _device(t, reduce=True)
        if d is not None:
            arr, st = d
            req = (self._comm.Ireduce(IN_PLACE, arr, op, root, stream=st.cuda_stream) if mine
                   else self._comm.Ireduce(arr, None, op, root, stream=st.cuda_stream))
            n = self.size()
            return self._submit([req], (lambda: _div_on(st, t, n)) if avg and mine else None, [t])
        s = _Staged(t, reduce=True, out=mine)
        if s.arr.size == 0:
            return self._submit([], None, [t])
        req = (self._comm.Ireduce(IN_PLACE, s.arr, op, root) if mine
               else self._comm.Ireduce(s.arr, None, op, root))
        return self._submit([req], self._reduce_finish([s], avg and mine) if mine else None, [t])

    def allgather(self, output_lists, inputs, opts=None):
        t = self._one(inputs, "allgather")
        outs = self._one(output_lists, "allgather")
        n = self.size()
        if len(outs) != n:
            raise R2commArgumentError(f"r2comm backend: allgather needs {n} output tensors, "
                                      f"got {len(outs)}")
        for o in outs:
            if o.dtype != t.dtype or o.numel() != t.numel():
                raise R2commArgumentError("r2comm backend: allgather outputs must have the "
                                          f"input's dtype and size ({t.dtype}, {t.numel()})")
        s = _Staged(t, out=False)
        flat = torch.empty(n * s.arr.nbytes, dtype=torch.uint8)
        if s.arr.nbytes == 0:
            return self._submit([], None, outs)
        req = self._comm.Iallgather(s.arr, flat.numpy())

        def finish():
            blocks = flat.view(n, -1)
            with torch.no_grad():
                for i, o in enumerate(outs):
                    _copy_bytes(o, blocks[i])
        return self._submit([req], finish, outs)

    def all_gather_single(self, output, input, opts=None):
        n = self.size()
        if output.dtype != input.dtype or output.numel() != n * input.numel():
            raise R2commArgumentError(f"r2comm backend: all_gather_into_tensor needs an output "
                                      f"of {n} x the input ({input.dtype}, {input.numel()}), got "
                                      f"{output.dtype}, {output.numel()}")
        di, do = _device(input), _device(output)
        if di is not None and do is not None and input.numel():
            req = self._comm.Iallgather(di[0], do[0], stream=do[1].cuda_stream)
            return self._submit([req], None, [output])
        s, o = _Staged(input, out=False), _Staged(output)
        if s.arr.nbytes == 0:
            return self._submit([], None, [output])
        req = self._comm.Iallgather(s.arr, o.arr)
        return self._submit([req], o.writeback, [output])

    _allgather_base = all_gather_single

    def reduce_scatter(self, outputs, input_lists, opts=None):
        out = self._one(outputs, "reduce_scatter")
        ins = self._one(input_lists, "reduce_scatter")
        n = self.size()
        if len(ins) != n or any(i.dtype != out.dtype or i.numel() != out.numel() for i in ins):
            raise R2commArgumentError(f"r2comm backend: reduce_scatter needs {n} inputs of the "
                                      f"output's dtype and size ({out.dtype}, {out.numel()})")
        flat = torch.cat([i.detach().reshape(-1).to("cpu") for i in ins])
        return self._reduce_scatter(out, flat, opts)

    def reduce_scatter_single(self, output, input, opts=None):
        n = self.size()
        if input.dtype != output.dtype or input.numel() != n * output.numel():
            raise R2commArgumentError(f"r2comm backend: reduce_scatter_tensor needs an input of "
                                      f"{n} x the output ({output.dtype}, {output.numel()}), got "
                                      f"{input.dtype}, {input.numel()}")
        return self._reduce_scatter(output, input, opts)

    _reduce_scatter_base = reduce_scatter_single

    def _reduce_scatter(self, output, flat_input, opts):
        op, avg = _redop(opts, output.dtype)
        if op is None:
            raise R2commArgumentError(f"r2comm backend: reduce_scatter with {_opname(avg)} is not "
                                      "supported (SUM, PRODUCT, MIN, MAX, AVG)")
        di, do = _device(flat_input, reduce=True), _device(output, reduce=True)
        if di is not None and do is not None and output.numel():
            st = do[1]
            req = self._comm.Ireduce_scatter_block(di[0], do[0], op, stream=st.cuda_stream)
            n = self.size()
            return self._submit([req], (lambda: _div_on(st, output, n)) if avg else None,
                                [output])
        s, o = _Staged(flat_input, reduce=True, out=False), _Staged(output, reduce=True)
        if o.arr.size == 0:
            return self._submit([], None, [output])
        req = self._comm.Ireduce_scatter_block(s.arr, o.arr, op)   # holds s.arr until done
        return self._submit([req], self._reduce_finish([o], avg), [output])

    def alltoall(self, outputs, inputs, opts=None):
        n = self.size()
        if len(outputs) != n or len(inputs) != n:
            raise R2commArgumentError(f"r2comm backend: all_to_all needs {n} input and {n} output "
                                      "tensors")
        ins = [_Staged(t, out=False) for t in inputs]
        outs = [_Staged(t) for t in outputs]
        sizes = {s.arr.nbytes for s in ins} | {s.arr.nbytes for s in outs}
        if len(sizes) == 1:                   # equal blocks: the alltoall schedule
            block = sizes.pop()
            if block == 0:
                return self._submit([], None, list(outputs))
            send = np.concatenate([s.arr for s in ins])
            recv = np.empty_like(send)
            req = self._comm.Ialltoall(send, recv)

            def finish():
                for i, s in enumerate(outs):
                    s.arr[:] = recv[i * block:(i + 1) * block]
                    s.writeback()
            return self._submit([req], finish, list(outputs))
        reqs = self._exchange([s.arr for s in ins], [s.arr for s in outs])

        def finish_p2p():
            for s in outs:
                s.writeback()
        return self._submit(reqs, finish_p2p, list(outputs))

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        n = self.size()
        if output.dtype != input.dtype:
            raise R2commArgumentError("r2comm backend: all_to_all_single needs one dtype")
        rows_in = input.shape[0] if input.dim() else 1
        rows_out = output.shape[0] if output.dim() else 1
        if not input_splits and not output_splits and input.numel() == output.numel() \
                and rows_in % n == 0 and input.numel():
            di, do = _device(input), _device(output)
            if di is not None and do is not None:
                req = self._comm.Ialltoall(di[0], do[0], stream=do[1].cuda_stream)
                return self._submit([req], None, [output])
        s, o = _Staged(input, out=False), _Staged(output)
        if not input_splits and not output_splits and s.arr.nbytes == o.arr.nbytes \
                and rows_in % n == 0:
            if s.arr.nbytes == 0:
                return self._submit([], None, [output])
            req = self._comm.Ialltoall(s.arr, o.arr)
            return self._submit([req], o.writeback, [output])
        isp = list(input_splits) or _even(rows_in, n, "input")
        osp = list(output_splits) or _even(rows_out, n, "output")
        if len(isp) != n or len(osp) != n or sum(isp) != rows_in or sum(osp) != rows_out \
                or min(isp + osp) < 0:
            raise R2commArgumentError(f"r2comm backend: all_to_all_single splits {isp} / {osp} "
                                      f"do not cover the {rows_in} / {rows_out} rows in {n} parts")
        rin = s.arr.nbytes // max(rows_in, 1)
        rout = o.arr.nbytes // max(rows_out, 1)
        sends = _cut(s.arr, [k * rin for k in isp])
        recvs = _cut(o.arr, [k * rout for k in osp])
        reqs = self._exchange(sends, recvs)
        return self._submit(reqs, o.writeback, [output])

    alltoall_base = all_to_all_single

    def _exchange(self, sends, recvs):
        """Uneven all-to-all from point-to-point messages on the group's duplicate."""
        me, n = self.rank(), self.size()
        if sends[me].nbytes != recvs[me].nbytes:
            raise R2commArgumentError(f"r2comm backend: all-to-all rank {me} sends itself "
                                      f"{sends[me].nbytes} bytes but expects {recvs[me].nbytes}")
        recvs[me][:] = sends[me]
        reqs = []
        try:
            for j in range(n):
                if j != me and recvs[j].nbytes:
                    reqs.append(self._xchg.Irecv(recvs[j], j, 0))
            for j in range(n):
                if j != me and sends[j].nbytes:
                    reqs.append(self._xchg.Isend(sends[j], j, 0))
        except BaseException:
            try:
                Request.Waitall(reqs, 5.0)
            except Exception:
                pass
            raise
        return reqs

    # -- point to point ----------------------------------------------------------------------
    def send(self, tensors, dst, tag=0):
        t = self._one(tensors, "send")
        s = _Staged(t, out=False)
        if s.arr.nbytes == 0:
            return self._submit([], None, [t])
        req = self._comm.Isend(s.arr, dst, tag)
        return self._submit([req], None, [t])

    def recv(self, tensors, src, tag=0):
        if src is None or src == ANY_SOURCE:
            return self.recv_anysource(tensors, tag)
        t = self._one(tensors, "recv")
        s = _Staged(t)
        if s.arr.nbytes == 0:
            return self._submit([], None, [t])
        req = self._comm.Irecv(s.arr, src, tag)
        return self._submit([req], s.writeback, [t])

    def recv_anysource(self, tensors, tag=0):
        """A receive from any rank of the group (r2comm.ANY_SOURCE): the Work's
        _source_rank() says which rank sent the message."""
        t = self._one(tensors, "recv")
        s = _Staged(t)
        if s.arr.nbytes == 0:
            # an empty send moves no message (see send), so nothing could say where it came from
            raise R2commArgumentError("r2comm backend: recv of an empty tensor needs src")
        status = Status()
        req = self._comm.Irecv(s.arr, ANY_SOURCE, tag, status=status)
        return self._submit([req], s.writeback, [t], source=status)

    def barrier(self, opts=None):
        """A barrier of the group (device_ids, if given, name no work for this backend)."""
        return self._submit([self._comm.Ibarrier()])

    # -- gather, scatter, coalesced forms ----------------------------------------------------
    def gather(self, output_lists, inputs, opts=None):
        """Every rank's tensor to the root's list (point to point on the group's duplicate)."""
        t = self._one(inputs, "gather")
        root, me, n = getattr(opts, "rootRank", 0), self.rank(), self.size()
        if not 0 <= root < n:
            raise R2commArgumentError(f"r2comm backend: gather root {root} is not a rank of "
                                      f"this group (size {n})")
        s = _Staged(t, out=False)
        if me != root:
            if output_lists and any(len(o) for o in output_lists):
                raise R2commArgumentError("r2comm backend: gather takes output tensors on the "
                                          "root only")
            reqs = [self._xchg.Isend(s.arr, root, _TAG_GATHER)] if s.arr.nbytes else []
            return self._submit(reqs, None, [])
        outs = self._one(output_lists, "gather")
        self._same_blocks(outs, t, "gather")
        staged = [_Staged(o) for o in outs]
        staged[me].arr[:] = s.arr
        reqs = [self._xchg.Irecv(staged[j].arr, j, _TAG_GATHER)
                for j in range(n) if j != me and s.arr.nbytes]

        def finish():
            for o in staged:
                o.writeback()
        return self._submit(reqs, finish, list(outs))

    def scatter(self, outputs, input_lists, opts=None):
        """The root's list, one tensor to each rank (point to point on the group's duplicate)."""
        t = self._one(outputs, "scatter")
        root, me, n = getattr(opts, "rootRank", 0), self.rank(), self.size()
        if not 0 <= root < n:
            raise R2commArgumentError(f"r2comm backend: scatter root {root} is not a rank of "
                                      f"this group (size {n})")
        o = _Staged(t)
        if me != root:
            if input_lists and any(len(i) for i in input_lists):
                raise R2commArgumentError("r2comm backend: scatter takes input tensors on the "
                                          "root only")
            reqs = [self._xchg.Irecv(o.arr, root, _TAG_SCATTER)] if o.arr.nbytes else []
            return self._submit(reqs, o.writeback, [t])
        ins = self._one(input_lists, "scatter")
        self._same_blocks(ins, t, "scatter")
        staged = [_Staged(i, out=False) for i in ins]
        o.arr[:] = staged[me].arr
        reqs = [self._xchg.Isend(staged[j].arr, j, _TAG_SCATTER)
                for j in range(n) if j != me and o.arr.nbytes]
        return self._submit(reqs, o.writeback, [t])

    def _same_blocks(self, tensors, like, what):
        n = self.size()
        if len(tensors) != n or any(x.dtype != like.dtype or x.numel() != like.numel()
                                    for x in tensors):
            raise R2commArgumentError(f"r2comm backend: {what} needs {n} tensors of the "
                                      f"input's dtype and size ({like.dtype}, {like.numel()})")

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        """all_gather_coalesced: output_lists[r][k] receives rank r's inputs[k]."""
        n = self.size()
        if len(output_lists) != n or any(len(o) != len(inputs) for o in output_lists):
            raise R2commArgumentError(f"r2comm backend: all_gather_coalesced needs {n} output "
                                      f"lists of {len(inputs)} tensors")
        works = [self.allgather([[output_lists[r][k] for r in range(n)]], [t])
                 for k, t in enumerate(inputs)]
        return self._join(works, [o for lst in output_lists for o in lst])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        if len(outputs) != len(inputs):
            raise R2commArgumentError("r2comm backend: as many outputs as inputs")
        works = [self.all_gather_single(o, i) for o, i in zip(outputs, inputs)]
        return self._join(works, list(outputs))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        if len(outputs) != len(inputs):
            raise R2commArgumentError("r2comm backend: as many outputs as inputs")
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._join(works, list(outputs))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced


def _torch_errors_at_the_call(fn):
    """fn with an R2commError it raises at the call (a freed group, too few fds for the
    connections its plan needs, a peer lost in a step it waits for) raised as torch's type as
    well (_torch_error), as Work.wait() raises the errors that come later."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except R2commError as exc:
            new = _torch_error(exc)
            if new is exc:
                raise
            raise new from exc
    return call


# every collective torch calls (the lean all_reduce converts its own errors in _allreduce_now)
for _name in ("_allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather",
              "all_gather_single", "_allgather_base", "reduce_scatter", "reduce_scatter_single",
              "_reduce_scatter_base", "alltoall", "all_to_all_single", "alltoall_base", "send",
              "recv", "recv_anysource", "barrier", "gather", "scatter", "allgather_coalesced",
              "allgather_into_tensor_coalesced", "all_gather_single_coalesced",
              "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced"):
    setattr(ProcessGroupR2comm, _name,
            _torch_errors_at_the_call(getattr(ProcessGroupR2comm, _name)))
del _name


_TAG_GATHER, _TAG_SCATTER = 1, 2
_BITWISE = {_RedOp.BAND: torch.bitwise_and, _RedOp.BOR: torch.bitwise_or,
            _RedOp.BXOR: torch.bitwise_xor}


def _even(rows, n, what):
    if rows % n:
        raise R2commArgumentError(f"r2comm backend: all_to_all_single {what} of {rows} rows is "
                                  f"not {n} equal parts; give split sizes")
    return [rows // n] * n


def _cut(arr, sizes):
    out, off = [], 0
    for k in sizes:
        out.append(arr[off:off + k])
        off += k
    return out


def _copy_bytes(t, block):
    """Copy the bytes `block` into tensor t (any layout, device, dtype)."""
    src = block.view(t.dtype if t.dtype != torch.bool else torch.uint8)
    if t.dtype == torch.bool:
        src = src.view(torch.bool)
    t.copy_(src.view(t.shape) if t.dim() else src.reshape(()))


_DEVICES = ("cpu", "cuda")


def _create(dist_opts, pg_options=None):
    return ProcessGroupR2comm(dist_opts.store, dist_opts.group_rank, dist_opts.group_size,
                              dist_opts.timeout, list(dist_opts.global_ranks_in_group), _DEVICES)


def register():
    """Register "r2comm" with torch.distributed (idempotent) for the devices it serves: CPU
    tensors, and CUDA tensors (r2comm's device pipeline with cupy, else staged through a host
    copy)."""
    if BACKEND_NAME.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True,
                                  devices=list(_DEVICES))
