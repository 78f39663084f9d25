"""Request: a handle on an operation in flight (mpi4py's Request), and its relatives: a
request done here without the engine (LocalRequest: PROC_NULL, messages to this rank), one over
several (GroupRequest: Isendrecv), a persistent one (Prequest: Send_init, Recv_init). As in
mpi4py, a request is true until it completes (Wait or a successful Test; a Prequest until
Free) and then equals REQUEST_NULL (r2comm's or mpi4py's)."""
import sys
import threading
import time
import weakref

from .errors import R2commTimeout, R2commClosedError, from_code

_ACTIVE, _DONE, _ERROR = 0, 1, 2
UNDEFINED = -32766          # Waitany/Testany with no active request (MPI.UNDEFINED's value)
POLL_MAX_S = 0.002          # longest sleep between two polls of Waitany / a local request


def fill_status(status, source, tag, nbytes):
    """Set source, tag and byte count of an r2comm Status or an mpi4py MPI.Status."""
    if status is None:
        return
    status.source, status.tag = source, tag
    if isinstance(status, Status):
        status.count = nbytes
    else:                                   # mpi4py's: counted in MPI.BYTE elements
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None and hasattr(status, "Set_elements"):
            status.Set_elements(mpi.BYTE, nbytes)


def poll(ready, limit, what):
    """Call ready() until it returns something other than None, sleeping 10 us growing to
    POLL_MAX_S between calls; R2commTimeout naming `what` after `limit` seconds."""
    deadline, pause = time.monotonic() + limit, 1e-5
    while True:
        got = ready()
        if got is not None:
            return got
        if time.monotonic() > deadline:
            raise R2commTimeout(f"{what}: nothing within {limit:g} s")
        time.sleep(pause)
        pause = min(pause * 2, POLL_MAX_S)


def _is_null(obj):
    if obj is REQUEST_NULL:
        return True
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and obj is getattr(mpi, "REQUEST_NULL", None)


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


class BaseRequest:
    """What every request kind shares: truth and REQUEST_NULL, mpi4py's class methods."""
    __slots__ = ("__weakref__",)

    def _active(self):
        """Whether the request is started and not completed yet (Waitany's active set)."""
        raise NotImplementedError

    def _token(self):
        """What equal requests share (a copy made by Request(req) or Prequest(preq))."""
        return self

    def __bool__(self):
        return self._active()

    def __eq__(self, other):
        if _is_null(other):
            return not self
        return isinstance(other, BaseRequest) and other._token() is self._token()

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return id(self._token())

    def Get_status(self, status=None):
        """Whether the request completed (mpi4py's Get_status), without ending it; `status`
        gets its source, tag and count once it has."""
        done = not self._active() or self._ready()
        if done and status is not None:
            self._status_into(status)
        return done

    def _ready(self):
        return False

    def _status_into(self, status):
        pass

    def Cancel(self):
        """MPI may fail to cancel; r2comm never cancels (the operation completes as usual)."""

    def Free(self):
        """Forget the request (an operation in flight still completes)."""

    def toint(self):
        """-1: r2comm requests have no integer handle (mpi4py's toint())."""
        return -1

    def py2f(self):
        """-1: no Fortran handle."""
        return -1

    @staticmethod
    def Waitall(requests, timeout=None):
        """Wait for every request; raise the first error after all have ended. The second
        argument may be mpi4py's list of statuses instead of a timeout (filled in order)."""
        statuses = None
        if isinstance(timeout, list):
            statuses, timeout = timeout, None
        deadline = None if timeout is None else time.monotonic() + timeout
        first = None
        out = []
        for i, r in enumerate(requests):
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                out.append(r.Wait(left))
                if statuses is not None and i < len(statuses):
                    r._status_into(statuses[i])
            except Exception as exc:        # keep waiting for the others
                out.append(None)
                first = first or exc
        if first is not None:
            raise first
        return out

    @staticmethod
    def Waitany(requests, status=None):
        """Index of a request of `requests` that completed (Wait done on it), or UNDEFINED when
        none is active; bounded by the first active request's communicator timeout."""
        live = [i for i, r in enumerate(requests) if r._active()]
        if not live:
            return UNDEFINED

        def first_done():
            for i in live:
                if requests[i].Test():
                    if status is not None:
                        requests[i]._status_into(status)
                    return i
            return None
        return poll(first_done, requests[live[0]].timeout_s(), "Waitany: no request completed")

    @staticmethod
    def Testany(requests, status=None):
        """(index, True) of a request that completed, (UNDEFINED, True) when none is active,
        else (UNDEFINED, False)."""
        live = [i for i, r in enumerate(requests) if r._active()]
        for i in live:
            if requests[i].Test():
                if status is not None:
                    requests[i]._status_into(status)
                return i, True
        return UNDEFINED, not live

    @staticmethod
    def Testall(requests, statuses=None):
        """True once every request completed (those that did are ended)."""
        return all([r.Test() for r in requests])

    def timeout_s(self):
        """Seconds a wait on this request may take (its communicator's timeout)."""
        return 60.0


class Request(BaseRequest):
    """A handle on an operation in flight, returned by the I* methods (mpi4py's Request).
    Wait() blocks until it ends and raises its error; Test() polls. Keep the buffers alive and
    untouched until it completes. Request(req) is a copy equal to `req` (mpi4py's)."""
    __slots__ = ("_comm", "_oid", "_keep", "_post", "_done", "_error", "_result", "_status",
                 "_timeout", "_nrecv", "_alias")

    def __new__(cls, comm=None, *args, **kwargs):
        if isinstance(comm, BaseRequest):        # Request(req): a copy of another request
            copy = object.__new__(cls)
            copy._alias = comm
            return copy
        return object.__new__(cls)

    def __init__(self, comm, oid=0, keep=(), post=None, result=None, status=None):
        if isinstance(comm, BaseRequest):
            return
        self._alias = None
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

    def _token(self):
        return self if self._alias is None else self._alias._token()

    def _active(self):
        if self._alias is not None:
            return self._alias._active()
        return not self._done

    def timeout_s(self):
        """Seconds a wait on it may take (its communicator's timeout)."""
        return self._timeout

    def _status_into(self, status):
        src, tag = getattr(self, "_matched", (None, None))
        if src is not None:
            fill_status(status, src, tag, self._nrecv)

    def _finish(self, state, err, msg, nrecv):
        eng = self._comm.engine
        if self._status is not None and state == _DONE:
            gpeer, tag = eng.p2p_matched(self._oid)    # the source and tag it matched
            if gpeer >= 0:
                fill_status(self._status, self._comm.local_rank(gpeer), tag, nrecv)
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
        if isinstance(self._status, Status):
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

    def Test(self, status=None):
        """True once the operation ended (raises its error, like Wait)."""
        if self._alias is not None:
            return self._alias.Test(status)
        if not self._done:
            state, err, msg, nrecv = self._comm.engine.test(self._oid)
            if state in (_DONE, _ERROR):
                self._finish(state, err, msg, nrecv)
        if self._done and self._error is not None:
            raise self._error
        return self._done

    def Wait(self, timeout=None, status=None):
        """Block until the operation ends; raise R2commTimeout after `timeout` seconds (the
        communicator's timeout by default). mpi4py's Wait(status) is accepted too."""
        if timeout is not None and not isinstance(timeout, (int, float)):
            timeout, status = None, timeout          # mpi4py's Wait(status)
        if self._alias is not None:
            return self._alias.Wait(timeout, status)
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
        """End the operation with error `code` here and on its peers (the engine's cancel);
        R2commClosedError once its communicator was freed."""
        self._comm.check()
        self._comm.engine.cancel(self._oid, code, message)


class _Null(BaseRequest):
    """REQUEST_NULL: the request no operation is behind."""
    __slots__ = ()

    def _active(self):
        return False

    def __repr__(self):
        return "r2comm.REQUEST_NULL"


REQUEST_NULL = _Null()


class LocalRequest(BaseRequest):
    """A request that this rank completes by itself: a call on PROC_NULL (done at once), a
    message to or from this rank (done when matched, or at once for a standard send)."""
    __slots__ = ("_done", "_error", "_source", "_tag", "_nbytes", "_status", "_timeout",
                 "_consumed")

    def __init__(self, timeout, status=None, done=False, source=None, tag=None, nbytes=0):
        self._timeout = timeout
        self._consumed = False
        self._status = status
        self._error = None
        self._done = False
        self._source = source
        self._tag, self._nbytes = tag, nbytes
        if done:
            self.complete(source, tag, nbytes)

    def complete(self, source=None, tag=None, nbytes=0, error=None):
        """The operation ended (matched, or failed with `error`)."""
        if source is not None:
            self._source, self._tag, self._nbytes = source, tag, nbytes
            fill_status(self._status, source, tag, nbytes)
        self._error = error
        self._done = True

    def _ready(self):
        return self._done

    def _active(self):
        return not self._consumed

    def _status_into(self, status):
        if self._source is not None:
            fill_status(status, self._source, self._tag, self._nbytes)

    def timeout_s(self):
        """Seconds a wait on it may take (its communicator's timeout)."""
        return self._timeout

    def Test(self, status=None):
        """True once it completed (then it is no longer active); raises its error."""
        if self._done:
            self._consumed = True
            if status is not None:
                self._status_into(status)
            if self._error is not None:
                raise self._error
        return self._done

    def Wait(self, timeout=None, status=None):
        """Block until it completes (at most `timeout` s); raises its error."""
        if timeout is not None and not isinstance(timeout, (int, float)):
            timeout, status = None, timeout
        limit = self._timeout if timeout is None else timeout
        if not self._done:                    # (only another thread can complete it)
            poll(lambda: True if self._done else None, limit, self._waits_for)
        return self.Test(status)

    _waits_for = "a message to this rank that no receive matched"


class ThreadRequest(LocalRequest):
    """A request that a helper thread of its own completes: `fn()` runs there (Iagree,
    Ishrink: a control-path call that blocks), and its exception is the request's error."""
    __slots__ = ()
    _waits_for = "a fault-tolerant agreement (Iagree / Ishrink)"

    def __init__(self, fn, timeout, name):
        super().__init__(timeout)
        threading.Thread(target=self._run, args=(fn,), name=name, daemon=True).start()

    def _run(self, fn):
        try:
            fn()
        except BaseException as exc:          # (raised by Wait/Test in the caller's thread)
            self.complete(error=exc)
        else:
            self.complete()


class GroupRequest(BaseRequest):
    """One request over several (Isendrecv, Isendrecv_replace): complete once all are, then
    `then()` runs (a copy into the user's buffer)."""
    __slots__ = ("_parts", "_then", "_done", "_status_part")

    def __init__(self, parts, then=None, status_part=None):
        self._parts, self._then, self._done = parts, then, False
        self._status_part = status_part

    def _active(self):
        return not self._done

    def timeout_s(self):
        """Seconds a wait on it may take (its communicator's timeout)."""
        return max(p.timeout_s() for p in self._parts)

    def _status_into(self, status):
        if self._status_part is not None:
            self._status_part._status_into(status)

    def _end(self):
        self._done = True
        if self._then is not None:
            self._then()

    def Test(self, status=None):
        """True once it completed (then it is no longer active); raises its error."""
        if not self._done and all([p.Test() for p in self._parts]):
            self._end()
        if self._done and status is not None:
            self._status_into(status)
        return self._done

    def Wait(self, timeout=None, status=None):
        """Block until it completes (at most `timeout` s); raises its error."""
        if timeout is not None and not isinstance(timeout, (int, float)):
            timeout, status = None, timeout
        if not self._done:
            BaseRequest.Waitall(self._parts, timeout)
            self._end()
        if status is not None:
            self._status_into(status)


class _Persistent:
    """What copies of one persistent request share: how to start it, the operation in flight."""
    __slots__ = ("start", "inner", "freed", "timeout", "__weakref__")

    def __init__(self, start, timeout):
        self.start, self.inner, self.freed, self.timeout = start, None, False, timeout


_HANDLES = weakref.WeakValueDictionary()      # Prequest.handle -> its shared state


class Prequest(BaseRequest):
    """A persistent request (Send_init, Recv_init, ...): Start() runs its operation again,
    Wait()/Test() end that run, Free() forgets it. Prequest(preq) is a copy equal to it."""
    __slots__ = ("_state",)

    def __init__(self, start, timeout=None):
        if isinstance(start, Prequest):
            self._state = start._state
        else:
            self._state = _Persistent(start, 60.0 if timeout is None else timeout)
            _HANDLES[id(self._state)] = self._state

    @property
    def handle(self):
        """An integer naming the request (fromhandle() gives it back)."""
        return id(self._state)

    @classmethod
    def fromhandle(cls, handle):
        """The persistent request whose `handle` this is (a copy equal to it)."""
        st = _HANDLES.get(handle)
        if st is None:
            raise ValueError(f"no persistent request has handle {handle}")
        copy = cls.__new__(cls)
        copy._state = st
        return copy

    def _token(self):
        return self._state

    def __bool__(self):
        return not self._state.freed

    def _active(self):
        return self._state.inner is not None

    def timeout_s(self):
        """Seconds a wait on it may take (its communicator's timeout)."""
        return self._state.timeout

    def _ready(self):
        inner = self._state.inner
        return inner is not None and inner.Get_status()

    def _status_into(self, status):
        if self._state.inner is not None:
            self._state.inner._status_into(status)

    def Start(self):
        """Start the operation again (the previous run must have ended)."""
        st = self._state
        if st.freed:
            raise ValueError("Start() of a freed persistent request")
        if st.inner is not None and st.inner._active():
            raise ValueError("Start() of a persistent request whose run has not ended")
        st.inner = st.start()

    @staticmethod
    def Startall(requests):
        """Start() every request of the list."""
        for r in requests:
            r.Start()

    def Test(self, status=None):
        """True once it completed (then it is no longer active); raises its error."""
        inner = self._state.inner
        if inner is None:
            return True
        done = inner.Test(status)
        if done:
            self._state.inner = None
        return done

    def Wait(self, timeout=None, status=None):
        """Block until it completes (at most `timeout` s); raises its error."""
        if timeout is not None and not isinstance(timeout, (int, float)):
            timeout, status = None, timeout
        inner = self._state.inner
        if inner is not None:
            try:
                inner.Wait(timeout, status)
            finally:
                self._state.inner = None

    def Free(self):
        """Forget it: it equals REQUEST_NULL from now on (a run in flight still ends)."""
        self._state.freed = True
        _HANDLES.pop(id(self._state), None)
