"""Request: a handle on an operation in flight (mpi4py's Request)."""
import time

from .errors import R2commTimeout, R2commClosedError, from_code

_ACTIVE, _DONE, _ERROR = 0, 1, 2


class Status:
    """What a receive got (mpi4py's Status, the parts r2comm knows)."""
    def __init__(self):
        self.source = -1
        self.tag = -1
        self.count = 0          # bytes received

    def Get_count(self, datatype=None):
        """Bytes received (the datatype argument is accepted for mpi4py compatibility)."""
        return self.count

    def Get_source(self):
        """The rank the message came from."""
        return self.source

    def Get_tag(self):
        """The message's tag."""
        return self.tag


class Request:
    """A handle on an operation in flight, returned by the I* methods (mpi4py's Request).
    Wait() blocks until it ends and raises its error; Test() polls. Keep the buffers alive and
    untouched until it completes."""
    __slots__ = ("_comm", "_oid", "_keep", "_post", "_done", "_error", "_result", "_status",
                 "_timeout", "_nrecv")

    def __init__(self, comm, oid, keep, post=None, result=None, status=None):
        self._comm = comm
        self._oid = oid
        self._keep = keep          # Buffer exports and scratch: alive until completion
        self._post = post          # callable run once on success (local copies)
        self._done = False
        self._error = None
        self._result = result
        self._status = status
        self._timeout = comm.timeout
        self._nrecv = 0

    def _finish(self, state, err, msg, nrecv):
        eng = self._comm.engine
        if self._status is not None and state == _DONE:
            gpeer, tag = eng.p2p_matched(self._oid)    # the source and tag it matched
            if gpeer >= 0:
                self._status.source, self._status.tag = self._comm.local_rank(gpeer), tag
        eng.release(self._oid)
        self._done = True
        self._nrecv = nrecv
        if state == _ERROR:
            self._error = from_code(err, msg)
        elif self._post is not None:
            self._post()            # local copies, while the buffers are still held
        for b in self._keep:
            if hasattr(b, "release"):
                b.release()
        self._keep = ()
        if self._status is not None:
            self._status.count = nrecv

    def _settle(self, state, err, msg, nrecv, limit):
        """The outcome of a wait of `limit` seconds: a timed-out operation is cancelled (and
        raises R2commTimeout if even that does not end it), an ended one finished."""
        if state == _ACTIVE:
            eng = self._comm.engine
            eng.cancel(self._oid, 1, f"operation timed out after {limit:g} s")
            state, err, msg, nrecv = eng.wait(self._oid, 5.0)
            if state == _ACTIVE:
                raise R2commTimeout(f"operation timed out after {limit:g} s")
        self._finish(state, err, msg, nrecv)

    def Test(self):
        """True once the operation ended (raises its error, like Wait)."""
        if not self._done:
            state, err, msg, nrecv = self._comm.engine.test(self._oid)
            if state in (_DONE, _ERROR):
                self._finish(state, err, msg, nrecv)
        if self._done and self._error is not None:
            raise self._error
        return self._done

    def Wait(self, timeout=None):
        """Block until the operation ends; raise R2commTimeout after `timeout` seconds."""
        if not self._done:
            eng = self._comm.engine
            if eng is None:
                raise R2commClosedError("communicator was freed while the operation ran")
            limit = self._timeout if timeout is None else timeout
            self._settle(*eng.wait(self._oid, limit), limit)
        if self._error is not None:
            raise self._error
        return self._result

    wait = Wait

    # -- r2comm's internal interface (the communicator's fast path, the GPU pipeline) --------
    @property
    def done(self):
        """True once the operation ended (its error, if any, not raised)."""
        return self._done

    def conclude(self, limit):
        """Settle an operation the engine already ended, or gave up on after `limit` s."""
        self._settle(*self._comm.engine.wait(self._oid, 0.0), limit)

    def abort(self, code, message):
        """End the operation with error `code` here and on its peers (the engine's cancel)."""
        self._comm.engine.cancel(self._oid, code, message)

    @staticmethod
    def Waitall(requests, timeout=None):
        """Wait for every request; raise the first error after all have ended."""
        deadline = None if timeout is None else time.monotonic() + timeout
        first = None
        out = []
        for r in requests:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                out.append(r.Wait(left))
            except Exception as exc:        # keep waiting for the others
                out.append(None)
                first = first or exc
        if first is not None:
            raise first
        return out
