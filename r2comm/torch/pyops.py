"""The collectives of the torch backend that run in Python: what the native backend
(_backend.cpp) hands here, each call returning a Work the native side waits on.

That is: CUDA tensors (a contiguous one goes to r2comm's device-buffer pipeline, r2comm/gpu:
chunked staging through pinned memory overlapped with the wire, reductions on the GPU, ordered
after the work on torch's current stream; this needs cupy, `pip install cupy-cuda12x`;
otherwise it is staged through a host copy); sparse COO tensors in all_reduce (SUM: indices and
values gathered from every rank, summed, coalesced); BAND, BOR, BXOR of integer and bool
tensors (all_reduce, reduce, reduce_scatter: every rank's tensor gathered and folded in rank
order); all_to_all with lists or uneven splits, gather, scatter, all_gather_coalesced and send /
recv (point to point on a duplicate of the group's communicator; a receive without a source
rank takes the first message from any rank, r2comm.ANY_SOURCE); and any call the native side
does not take, whose bad arguments raise here: other ops (PREMUL_SUM) and dtypes raise
R2commArgumentError at the call. Reductions: float16/32/64, int8..int64, uint8..uint64
directly; bfloat16 in float32 (rounded back once); bool as uint8 (SUM, MAX, BOR: logical or;
PRODUCT, MIN, BAND: logical and); AVG is a SUM divided by the group size (floating dtypes).

Errors: an R2commError at the call, or from Work.wait(), is also torch's type (_torch_error):
R2commTimeout ("Timed out") and the others are DistBackendError, R2commNetworkError is
DistNetworkError. engine_error makes the same for the native side's engine errors."""
import functools
import threading

import numpy as np
import torch
import torch.distributed as dist

from .. import IN_PLACE
from ..communicator import ANY_SOURCE
from ..errors import (R2commArgumentError, R2commBufferError, R2commClosedError, R2commError,
                      R2commNetworkError, R2commTimeout)
from ..ops import SUM, PROD, MIN, MAX
from ..request import Request, Status
from ..world import engine_module

_RedOp = dist.ReduceOp
_GPU_REDUCE = {"mode": "device"}   # the world's config.gpu_reduce (backend.py sets it)
_ACCEL = ("cuda", "xpu", "hpu", "mps")

_NUMPY = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64,
          torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32,
          torch.int64: np.int64, torch.uint8: np.uint8}
for _n in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _n):
        _NUMPY[getattr(torch, _n)] = getattr(np, _n)

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
        if _GPU_REDUCE["mode"] != "device":
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
    return hit


_REDUCE = {}      # (torch dtype, ReduceOp kind) -> _redop's answer


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


def raise_as_torchs(exc):
    """Raise R2commError `exc` as torch's type too (_torch_error), chained to it (backend.py's
    grow/join, recover.py's shrink)."""
    new = _torch_error(exc)
    if new is exc:
        raise exc
    raise new from exc


class Work:
    """One operation in flight, as the native backend's PyWork holds it: wait(timeout)
    blocks for it alone and raises its error (r2comm's class and torch's, see _torch_error),
    test() polls, abort() ends it with an error. Its tensors and buffers are held until its
    operation ended."""

    def __init__(self, group, reqs, finish=None, result=(), source=-1):
        self._group = group
        self._reqs = reqs
        self._finish = finish
        self._result = result
        self._lock = threading.Lock()
        self._done = not reqs
        self._error = None
        self._source = source
        if self._done and finish is not None:
            self._finish = None
            self._run_finish(finish)

    def _run_finish(self, finish):
        try:
            finish()
        except BaseException as exc:
            self._error = _torch_error(exc)

    def _complete(self, timeout=None):
        """Wait for the operation (bounded by its timeout) and finish it."""
        with self._lock:
            if not self._done:
                try:
                    Request.Waitall(self._reqs, timeout)
                except BaseException as exc:       # kept for wait()
                    self._error = _torch_error(exc)
                finish, self._finish = self._finish, None
                if finish is not None and self._error is None:
                    self._run_finish(finish)
                self._reqs = ()
                self._done = True

    def wait(self, timeout=None):
        """Wait (at most `timeout` s, None: the operation's own bound); raise its error."""
        if not self._done:
            self._complete(timeout if timeout else None)
        if self._error is not None:
            raise self._error
        return True

    def test(self):
        """True once the operation ended (then completed here); never blocks."""
        if self._done:
            return True
        if not self._lock.acquire(blocking=False):
            return False
        try:
            ready = all(r.Test() for r in self._reqs)
        except Exception:                 # ended with an error: _complete() keeps it
            ready = True
        finally:
            self._lock.release()
        if ready:
            self._complete()
        return self._done

    def abort(self):
        """End every request still running with R2commClosedError, here and on its peers."""
        for r in self._reqs:
            if isinstance(r, _AsRequest):
                r.work.abort()
            else:
                try:
                    r.abort(_CLOSED_CODE, "the group was aborted")
                except Exception:
                    pass

    def result(self):
        return self._result

    def source_rank(self):
        """The rank a receive from any source got its message from; -1 for other works."""
        return self._source.source if isinstance(self._source, Status) else self._source


_CLOSED_CODE = 6          # the engine's E_CLOSED: R2commClosedError


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
        self.work.test()
        if self.work._done and self.work._error is not None:
            raise self.work._error
        return self.work._done


class Ops:
    """The collectives the native backend (_backend.cpp) hands to Python, on the group's
    Communicator `comm` (see the module doc). Each returns a Work at once; argument errors
    raise at the call."""

    def __init__(self, comm, rank, size, remake=None, on_shutdown=None, xchg=None):
        if comm.rank != rank or comm.size != size:
            raise R2commError(f"r2comm backend: group rank {rank}/{size} became "
                              f"{comm.rank}/{comm.size}")
        self._comm = comm
        # point to point (uneven all-to-all, gather, scatter, send/recv): a communicator of
        # the same ranks with its own sequence, `xchg` where given (a Shrink()'s twin)
        if xchg is None:
            xchg = comm.Dup() if size > 1 else comm
        self._xchg = xchg
        self._rank, self._size = rank, size
        self._remake = remake        # remake(excluded ranks) -> a backend without them (shrink)
        self._aborted = False
        self._on_shutdown = on_shutdown

    # -- plumbing ----------------------------------------------------------------------------
    @property
    def comm(self):
        """The r2comm Communicator of this group (rails, events, fail_rail...)."""
        return self._comm

    @property
    def pt2pt_comm(self):
        """The Communicator of the same ranks this group's point-to-point calls run on (the
        group's own where it has one rank)."""
        return self._xchg

    def rank(self):
        return self._rank

    def size(self):
        return self._size

    def _submit(self, reqs, finish=None, result=(), source=-1):
        """A Work for these requests."""
        if self._aborted:
            raise R2commClosedError("r2comm backend: the group was aborted")
        return Work(self, reqs, finish, result, source)

    def _join(self, works, result):
        """One Work for several: done when all are, raising the first error."""
        return self._submit([_AsRequest(w) for w in works], None, result)

    def native_cross(self):
        """The native side's call while its cell has flags: a plan switch due, an epoch
        check; R2commClosedError (torch's type too) once the communicator was freed or the
        group aborted."""
        if self._aborted:
            raise R2commClosedError("r2comm backend: the group was aborted")
        self._comm.channel.native_cross()

    def native_plan(self, coll, nbytes, itemsize, root, dtc, redop, separate):
        """The native side's plan of a call shape (Channel.native_plan)."""
        return self._comm.channel.native_plan(coll, nbytes, itemsize, root, dtc, redop, separate)

    def shutdown(self):
        """The group ends (its works are complete)."""
        if self._on_shutdown is not None:
            self._on_shutdown()

    def abort(self):
        """The group's abort: its later calls raise R2commClosedError (the native backend
        ends the works in flight)."""
        self._aborted = True
        self._comm.channel.cell.set_flag(engine_module().CELL_CLOSED, True)

    def shrink(self, excluded, flags=0):
        """A backend of this group without ranks `excluded` (torch's shrink_group): the
        remaining ranks agree on a new communicator over the group's store."""
        if self._remake is None:
            raise R2commArgumentError("r2comm backend: this group cannot be shrunk")
        return self._remake(sorted(int(r) for r in excluded))

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

    def allreduce(self, tensors, kind):
        return self._allreduce(tensors, _Opts(kind))

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

    def broadcast(self, tensors, root=0, root_tensor=0):
        t = self._one(tensors, "broadcast")
        self._check_root(root, root_tensor, "broadcast")
        d = _device(t)
        if d is not None:
            req = self._comm.Ibcast(d[0], root, stream=d[1].cuda_stream)
            return self._submit([req], None, [t])
        s = _Staged(t, out=self.rank() != root)
        if s.arr.size == 0:
            return self._submit([], None, [t])
        req = self._comm.Ibcast(s.arr, root)
        return self._submit([req], s.writeback, [t])

    def reduce(self, tensors, kind, root=0, root_tensor=0):
        t = self._one(tensors, "reduce")
        self._check_root(root, root_tensor, "reduce")
        op, avg = _redop(_Opts(kind), t.dtype)
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

    def allgather(self, output_lists, inputs):
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

    def all_gather_single(self, output, input):
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


    def reduce_scatter(self, outputs, input_lists, kind):
        out = self._one(outputs, "reduce_scatter")
        ins = self._one(input_lists, "reduce_scatter")
        n = self.size()
        if len(ins) != n or any(i.dtype != out.dtype or i.numel() != out.numel() for i in ins):
            raise R2commArgumentError(f"r2comm backend: reduce_scatter needs {n} inputs of the "
                                      f"output's dtype and size ({out.dtype}, {out.numel()})")
        flat = torch.cat([i.detach().reshape(-1).to("cpu") for i in ins])
        return self._reduce_scatter(out, flat, _Opts(kind))

    def reduce_scatter_single(self, output, input, kind):
        n = self.size()
        if input.dtype != output.dtype or input.numel() != n * output.numel():
            raise R2commArgumentError(f"r2comm backend: reduce_scatter_tensor needs an input of "
                                      f"{n} x the output ({output.dtype}, {output.numel()}), got "
                                      f"{input.dtype}, {input.numel()}")
        return self._reduce_scatter(output, input, _Opts(kind))

    def _reduce_scatter(self, output, flat_input, opts):
        op, avg = _redop(opts, output.dtype)
        if op is None:                 # BAND, BOR, BXOR: every input gathered, then folded
            return self._bitwise_scatter(output, flat_input, avg)
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

    def _bitwise_scatter(self, output, flat_input, kind):
        """reduce_scatter with BAND, BOR or BXOR (integers, bool): every rank's input
        gathered, folded in rank order, this rank's block kept."""
        n, me = self.size(), self.rank()
        s = _Staged(flat_input, out=False)
        if s.arr.nbytes == 0:
            return self._submit([], None, [output])
        blocks = torch.empty((n, s.host.numel()), dtype=s.host.dtype)
        req = self._comm.Iallgather(s.arr, blocks.view(-1).view(torch.uint8).numpy())
        fold = _BITWISE[kind]

        def finish():
            acc = blocks[0].clone()
            for k in range(1, n):
                fold(acc, blocks[k], out=acc)
            mine = acc.view(n, -1)[me]
            with torch.no_grad():
                output.copy_(mine.view(output.shape) if output.dim() else mine.reshape(()))
        return self._submit([req], finish, [output])

    def alltoall(self, outputs, inputs):
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

    def all_to_all_single(self, output, input, output_splits, input_splits):
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

    def barrier(self):
        """A barrier of the group."""
        return self._submit([self._comm.Ibarrier()])

    # -- gather, scatter, coalesced forms ----------------------------------------------------
    def gather(self, output_lists, inputs, root=0):
        """Every rank's tensor to the root's list (point to point on the group's duplicate)."""
        t = self._one(inputs, "gather")
        me, n = self.rank(), self.size()
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

    def scatter(self, outputs, input_lists, root=0):
        """The root's list, one tensor to each rank (point to point on the group's duplicate)."""
        t = self._one(outputs, "scatter")
        me, n = self.rank(), self.size()
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

    def allgather_coalesced(self, output_lists, inputs):
        """all_gather_coalesced: output_lists[r][k] receives rank r's inputs[k]."""
        n = self.size()
        if len(output_lists) != n or any(len(o) != len(inputs) for o in output_lists):
            raise R2commArgumentError(f"r2comm backend: all_gather_coalesced needs {n} output "
                                      f"lists of {len(inputs)} tensors")
        works = [self.allgather([[output_lists[r][k] for r in range(n)]], [t])
                 for k, t in enumerate(inputs)]
        return self._join(works, [o for lst in output_lists for o in lst])

    def _check_root(self, root, root_tensor, what):
        if root_tensor:
            raise R2commArgumentError(f"r2comm backend: {what} takes one tensor per rank "
                                      f"(root tensor {root_tensor})")
        if not 0 <= root < self.size():
            raise R2commArgumentError(f"r2comm backend: {what} root {root} is not a rank of "
                                      f"this group (size {self.size()})")


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


# every collective the native backend hands here
for _name in ("native_cross", "native_plan", "shrink", "allreduce", "broadcast", "reduce", "allgather", "all_gather_single",
              "reduce_scatter", "reduce_scatter_single", "alltoall", "all_to_all_single", "send",
              "recv", "recv_anysource", "barrier", "gather", "scatter", "allgather_coalesced"):
    setattr(Ops, _name, _torch_errors_at_the_call(getattr(Ops, _name)))
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


class _Opts:
    """What _redop reads of torch's options: the reduce op of kind number `kind`."""
    __slots__ = ("reduceOp",)

    def __init__(self, kind):
        self.reduceOp = _RedOp.RedOpType(kind)


def engine_error(code, message):
    """The exception of an engine error (code, message) as torch's callers get it: r2comm's
    class (errors.from_code) that is torch's DistBackendError or DistNetworkError too."""
    from ..errors import from_code
    return _torch_error(from_code(code, message))


def set_gpu_reduce(mode):
    """The world's config.gpu_reduce: "device" lets bfloat16 reduce on the GPU."""
    _GPU_REDUCE["mode"] = mode
