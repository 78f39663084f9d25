"""The torch.distributed backend "r2comm": a ProcessGroup whose collectives run on r2comm.

How it plugs in. torch 2.13 calls a registered creator for every process group that uses the
backend (the default group, then each new_group). The creator returns a Python subclass of
torch's ProcessGroup; torch calls its methods from Python (dist.all_reduce -> pg.allreduce) and
from C++ through the ProcessGroup trampoline (DDP's reducer: allreduce, broadcast). A Python
subclass of torch's C++ Backend class would not work here: torch has no Python trampoline for
Backend, so C++ callers would never reach the Python methods.

Bootstrap. The default group builds the r2comm world with Communicator.from_store over the
group's store (torchrun's TCPStore under env://): the job secret, endpoints and host names travel
through it, then r2comm opens its own connections. A sub-group (new_group) of that world uses the
same engine and connections: a child communicator whose id its members agree on through the
sub-group's store. A group whose ranks are not all in the world (the default group is another
backend) gets a world of its own.

Data. Each tensor is handed to r2comm as a numpy view of its memory (no copy) when it is a
contiguous CPU tensor. A contiguous CUDA tensor goes to r2comm's device-buffer pipeline
(r2comm/gpu: chunked staging through pinned memory, overlapped with the wire, reductions on the
GPU) as a cupy view of its memory, ordered after the work on torch's current stream (all_reduce,
broadcast, reduce, all_gather_into_tensor, reduce_scatter_tensor, even all_to_all_single); this
needs cupy (`pip install cupy-cuda12x`). Otherwise a tensor is staged: a contiguous host copy
(non-contiguous tensors; CUDA tensors without cupy, and in the list forms of all_gather,
reduce_scatter and all_to_all, and send/recv) that is copied back once the operation completed.
Collectives that only move bytes (broadcast, all-gather, all-to-all, send/recv) accept every
dtype. Reductions: float16/32/64, int8..int64, uint8..uint64 directly; bfloat16 is reduced in
float32 (converted, reduced, rounded back once: not bit-identical to Gloo, which rounds after
each step); bool as uint8 (SUM and MAX: logical or; PRODUCT and MIN: logical and). AVG is a SUM
divided by the group size (floating dtypes only). Other ops (BAND, BOR, BXOR, PREMUL_SUM) and
other dtypes (complex reductions other than SUM, ...) raise R2commArgumentError at the call.

Completion. Each call returns at once with a Work. Work.wait() waits for that operation (any
order) and raises r2comm's exception (R2commTimeout, R2commNetworkError, R2commMismatchError...)
when it failed; once Work.get_future() was called, a per-group completion thread completes the
operation and sets the future (DDP's reducer waits on futures, never calls wait()). Results of
staged tensors (non-contiguous, CUDA, bfloat16 reductions) are copied back at completion. Every wait is bounded by R2COMM_TIMEOUT when it is set, else by the
init_process_group / new_group timeout."""
import datetime
import os
import queue
import threading

import numpy as np
import torch
import torch.distributed as dist

from .. import IN_PLACE
from ..bootstrap_store import StoreComm, MAX as _STORE_MAX
from ..communicator import Communicator
from ..errors import R2commArgumentError, R2commError
from ..ops import SUM, PROD, MIN, MAX
from ..request import Request

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


def _device(t, reduce=False):
    """(cupy view of a CUDA tensor's memory, torch stream it is ordered on) for the device
    pipeline, or None: CPU tensors, non-contiguous ones, dtypes it does not reduce, no cupy
    (then the tensor takes the host copy path). reduce=False: a byte view (any dtype)."""
    if t.device.type != "cuda" or t.is_sparse or not t.is_contiguous():
        return None
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
        if _world["comm"] is not None and _world["comm"]._cfg.gpu_reduce != "device":
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


def _redop(opts, dtype):
    """(r2comm op, divide by size) for a torch ReduceOp on this dtype."""
    rop = getattr(opts, "reduceOp", _RedOp.SUM)
    kind = getattr(rop, "op", rop)
    table = {_RedOp.SUM: SUM, _RedOp.PRODUCT: PROD, _RedOp.MIN: MIN, _RedOp.MAX: MAX,
             _RedOp.AVG: SUM}
    if kind not in table:
        raise R2commArgumentError(f"r2comm backend: reduce op {_opname(kind)} is not supported "
                                  "(SUM, PRODUCT, MIN, MAX, AVG)")
    avg = kind == _RedOp.AVG
    if dtype == torch.bool:
        if avg:
            raise R2commArgumentError("r2comm backend: AVG of a bool tensor is not defined")
        return {_RedOp.SUM: MAX, _RedOp.PRODUCT: MIN}.get(kind, table[kind]), False
    if avg and not (dtype.is_floating_point or dtype.is_complex):
        raise R2commArgumentError(f"r2comm backend: AVG needs a floating-point tensor, got {dtype}")
    if dtype.is_complex and kind not in (_RedOp.SUM, _RedOp.AVG):
        raise R2commArgumentError(f"r2comm backend: {_opname(kind)} of complex tensors is not defined")
    if dtype not in _NUMPY and dtype != torch.bfloat16 and not dtype.is_complex:
        raise R2commArgumentError(
            f"r2comm backend: cannot reduce {dtype}; r2comm reduces float16, bfloat16 (in "
            "float32), float32, float64, int8..int64, uint8..uint64 and bool")
    return table[kind], avg


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
        if h.device.type != "cpu":
            if h.device.type not in _ACCEL:
                raise R2commArgumentError(f"r2comm backend: tensors on {h.device} are not supported")
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


class Work(dist._Work):
    """One operation in flight: wait() blocks for it alone and raises r2comm's error;
    get_future() is set by the group's completion thread (what DDP waits on)."""

    def __init__(self, reqs, finish=None, result=(), completer=None):
        super().__init__()
        self._completer = completer   # queue of the group's completion thread
        self._queued = False
        self._reqs = list(reqs)
        self._finish = finish
        self._result = list(result)
        self._lock = threading.Lock()
        self._done = False
        self._error = None
        self._fut = torch.futures.Future()

    def _complete(self, timeout=None):
        with self._lock:
            if self._done:
                return
            try:
                Request.Waitall(self._reqs, timeout)
                if self._finish is not None:
                    self._finish()
            except BaseException as exc:       # kept for wait() and the future
                self._error = exc
            self._done = True
            self._reqs = ()
            self._finish = None
        if self._error is not None:
            self._fut.set_exception(self._error)
        else:
            self._fut.set_result(self._result)

    def wait(self, timeout=None):
        secs = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        self._complete(secs if secs else None)
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self):
        """Polls without blocking; a finished operation is completed here (results copied)."""
        if self._done:
            return True
        if not self._lock.acquire(blocking=False):     # the completion thread is on it
            return False
        try:
            ready = all(r.Test() for r in self._reqs)
        except R2commError:
            ready = True
        finally:
            self._lock.release()
        if ready:
            self._complete()
        return self._done

    def is_success(self):
        return self._done and self._error is None

    def exception(self):
        return self._error

    def get_future(self):
        """A torch Future set when the operation completes (by the group's completion thread,
        so nobody has to wait() for it: what DDP's reducer relies on)."""
        with self._lock:
            queue_it = not self._queued and not self._done and self._completer is not None
            self._queued = True
        if queue_it:
            self._completer.put(self)
        return self._fut

    def result(self):
        return self._result

    def synchronize(self):
        pass


def _done_work(result=()):
    return Work([], None, result)


class ProcessGroupR2comm(dist.ProcessGroup):
    """torch.distributed's collectives on an r2comm Communicator (see the module doc)."""

    def __init__(self, store, rank, size, timeout, global_ranks=()):
        super().__init__(rank, size)
        secs = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
        if os.environ.get("R2COMM_TIMEOUT"):
            secs = None                       # the Communicator reads R2COMM_TIMEOUT itself
        world, ranks = _world["comm"], _world["ranks"]
        granks = list(global_ranks)
        usable = (granks and world is not None and not world._world.closed
                  and all(g in ranks for g in granks))
        if not usable:
            comm = Communicator.from_store(store, rank, size, prefix="r2comm",
                                           store_timeout=secs or 300.0, timeout=secs)
            if not granks or world is None or world._world.closed:
                _world["comm"] = comm
                _world["ranks"] = {(granks[i] if granks else i): i for i in range(size)}
        else:
            sc = StoreComm(store, rank, size, "r2comm-group", secs or 300.0)
            members = [ranks[g] for g in granks]
            cid = sc.allreduce(world._world.next_comm_id, op=_STORE_MAX)
            world._world.next_comm_id = cid + 1
            comm = Communicator._child(world._world, sc, members, cid)
            comm.timeout = world.timeout
        if comm.rank != rank or comm.size != size:
            raise R2commError(f"r2comm backend: group rank {rank}/{size} became "
                              f"{comm.rank}/{comm.size}")
        self._comm = comm
        self._xchg = comm.Dup() if size > 1 else comm    # uneven all-to-all (point to point)
        self._queue = queue.Queue()
        self._thread = threading.Thread(target=self._completer, daemon=True,
                                        name=f"r2comm-torch-{rank}")
        self._thread.start()

    # -- plumbing ----------------------------------------------------------------------------
    @property
    def comm(self):
        """The r2comm Communicator of this group (rails, events, fail_rail...)."""
        return self._comm

    def _completer(self):
        while True:
            w = self._queue.get()
            if w is None:
                return
            w._complete()

    def _submit(self, reqs, finish=None, result=()):
        """A Work for these requests. Only works whose future is asked for go to the
        completion thread: a plain wait() completes its operation itself, without a thread
        hand-over (measured: 1 KiB allreduce 511 us with every work queued, see the report)."""
        return Work(reqs, finish, result, self._queue)

    def getBackendName(self):
        return BACKEND_NAME

    def name(self):
        return BACKEND_NAME

    def shutdown(self):
        self._queue.put(None)

    abort = shutdown

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
        t = self._one(tensors, "allreduce")
        op, avg = _redop(opts, t.dtype)
        d = _device(t, reduce=True)
        if d is not None:
            arr, st = d
            req = self._comm.Iallreduce(IN_PLACE, arr, op, stream=st.cuda_stream)
            n = self.size()
            return self._submit([req], (lambda: _div_on(st, t, n)) if avg else None, [t])
        s = _Staged(t, reduce=True)
        if s.arr.size == 0:
            return _done_work([t])
        req = self._comm.Iallreduce(IN_PLACE, s.arr, op)
        return self._submit([req], self._reduce_finish([s], avg), [t])

    def allreduce_coalesced(self, tensors, opts=None):
        reqs, staged, avg = [], [], False
        for t in tensors:
            op, avg = _redop(opts, t.dtype)
            s = _Staged(t, reduce=True)
            if s.arr.size:
                staged.append(s)
                reqs.append(self._comm.Iallreduce(IN_PLACE, s.arr, op))
        return self._submit(reqs, self._reduce_finish(staged, avg), list(tensors))

    def broadcast(self, tensors, opts=None):
        t = self._one(tensors, "broadcast")
        root = getattr(opts, "rootRank", 0)
        d = _device(t)
        if d is not None:
            req = self._comm.Ibcast(d[0], root, stream=d[1].cuda_stream)
            return self._submit([req], None, [t])
        s = _Staged(t, out=self.rank() != root)
        if s.arr.size == 0:
            return _done_work([t])
        req = self._comm.Ibcast(s.arr, root)
        return self._submit([req], s.writeback, [t])

    def reduce(self, tensors, opts=None):
        t = self._one(tensors, "reduce")
        root = getattr(opts, "rootRank", 0)
        op, avg = _redop(opts, t.dtype)
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
            return _done_work([t])
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
            return _done_work(outs)
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
            return _done_work([output])
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
        di, do = _device(flat_input, reduce=True), _device(output, reduce=True)
        if di is not None and do is not None and output.numel():
            st = do[1]
            req = self._comm.Ireduce_scatter_block(di[0], do[0], op, stream=st.cuda_stream)
            n = self.size()
            return self._submit([req], (lambda: _div_on(st, output, n)) if avg else None,
                                [output])
        s, o = _Staged(flat_input, reduce=True, out=False), _Staged(output, reduce=True)
        if o.arr.size == 0:
            return _done_work([output])
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
                return _done_work(list(outputs))
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
                return _done_work([output])
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
            return _done_work([t])
        req = self._comm.Isend(s.arr, dst, tag)
        return self._submit([req], None, [t])

    def recv(self, tensors, src, tag=0):
        t = self._one(tensors, "recv")
        s = _Staged(t)
        if s.arr.nbytes == 0:
            return _done_work([t])
        req = self._comm.Irecv(s.arr, src, tag)
        return self._submit([req], s.writeback, [t])

    def recv_anysource(self, tensors, tag=0):
        raise R2commArgumentError("r2comm backend: recv needs a source rank (r2comm has no "
                                  "any-source receive)")

    def barrier(self, opts=None):
        return self._submit([self._comm.Ibarrier()])


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


def _create(dist_opts, pg_options=None):
    return ProcessGroupR2comm(dist_opts.store, dist_opts.group_rank, dist_opts.group_size,
                              dist_opts.timeout, list(dist_opts.global_ranks_in_group))


def register():
    """Register "r2comm" with torch.distributed (idempotent): CPU tensors, and CUDA tensors
    (r2comm's device pipeline with cupy, else staged through a host copy)."""
    if BACKEND_NAME.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True,
                                  devices=["cpu", "cuda"])
