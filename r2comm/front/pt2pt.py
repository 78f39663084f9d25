"""Point-to-point calls of Communicator's mpi4py face (a mixin of it): Send/Recv and their
synchronous, ready and non-blocking forms, Sendrecv and Sendrecv_replace (+ I-forms), persistent
requests (Send_init, Recv_init, ...), and probes (Probe, Iprobe, Mprobe, Improbe).

Messages to another rank go through the engine (one message plan each, p2p.py). A call on
PROC_NULL (r2comm's or mpi4py's) completes at once and moves nothing; its status says source
PROC_NULL, tag ANY_TAG, 0 bytes. Messages to this rank itself stay here: a send is matched with
the first receive from this rank (or from ANY_SOURCE) that takes its tag, in the order sent; an
unmatched one waits here as a copy (Ssend/Issend: its request completes when a receive matched
it). An ANY_SOURCE receive posted while no message from this rank waits is given to the engine,
so a later send to this rank does not complete it (it waits for the next such receive).

Ssend/Issend to another rank complete when the receiver holds the whole message (in its
receive buffer or stored for a later receive), not only once a receive matched it: r2comm's
engine acknowledges what arrives. Buffered sends (Bsend, Ibsend, Bsend_init) are outside
r2comm's scope: they raise R2commArgumentError (the engine already copies small messages)."""
from collections import deque

import numpy as np

from . import p2p
from .args import ANY_TAG, ANY_SOURCE, is_any_source, is_proc_null
from .buffers import as_array
from ..errors import R2commArgumentError, R2commMismatchError, R2commTruncateError, unsupported
from ..ops import CODE_DTYPES, dtype_code
from ..request import GroupRequest, LocalRequest, Prequest, Status, fill_status, poll


def _refuse_buffered(name):
    return unsupported(f"{name} (a buffered send)", "use Send/Isend (r2comm's engine copies "
                       "small messages itself) or Ssend/Issend to wait for the receiver")


class _SelfMessage:
    """A message this rank sent to itself and no receive matched yet."""
    __slots__ = ("tag", "data", "dtc", "request")

    def __init__(self, tag, data, dtc, request):
        self.tag, self.data, self.dtc, self.request = tag, data, dtc, request


class Message:
    """A message taken by Mprobe/Improbe (mpi4py's Message): no other receive can match it;
    Recv or Irecv delivers it."""
    __slots__ = ("_comm", "_data", "_req", "_dtc", "_source", "_tag")

    def __init__(self, comm, source, tag, dtc, data=None, req=None):
        self._comm, self._source, self._tag, self._dtc = comm, source, tag, dtc
        self._data, self._req = data, req

    def __bool__(self):
        return self._data is not None or self._req is not None

    def Recv(self, buf, status=None):
        """Receive the message into `buf` (R2commTruncateError when it is larger)."""
        self.Irecv(buf, status).Wait()

    def Irecv(self, buf, status=None):
        """Start receiving the message into `buf`; returns a request."""
        comm = self._comm
        timeout = comm.timeout if comm is not None else 60.0
        if self._source is not None and is_proc_null(self._source):
            return LocalRequest(timeout, status, True, self._source, ANY_TAG, 0)
        arr = as_array(buf, True, "Mrecv buf")
        if self._req is not None:
            self._req.Wait()
        data, self._data, self._req = self._data, None, None
        if data is None:
            raise R2commArgumentError("this message was received already")
        err = _deliver_check(data, self._dtc, arr, self._source)
        if err is None:
            arr.reshape(-1).view(np.uint8)[:data.nbytes] = data.reshape(-1).view(np.uint8)
        req = LocalRequest(timeout, status)
        req.complete(self._source, self._tag, data.nbytes, err)
        return req


def _deliver_check(data, dtc, arr, source):
    """The error of delivering message `data` (element type code dtc) into `arr`, or None."""
    if data.nbytes > arr.nbytes:
        return R2commTruncateError(f"message truncated: rank {source} sent {data.nbytes} bytes, "
                                   f"the receive buffer holds {arr.nbytes}")
    if data.nbytes and dtc != dtype_code(arr.dtype):
        return R2commMismatchError(f"datatype mismatch: rank {source} sent "
                                   f"{CODE_DTYPES[dtc]}, the receive takes {arr.dtype}")
    return None


class PointToPoint:
    """Communicator's point-to-point calls (see the module doc)."""

    # -- messages to this rank -----------------------------------------------------------------
    def _self_queues(self):
        if getattr(self, "_self_sent", None) is None:
            self._self_sent = deque()       # _SelfMessage, in the order sent
            self._self_posted = deque()     # (arr, tag, request): receives from this rank
        return self._self_sent, self._self_posted

    def _take_self(self, tag):
        """The first message to this rank that a receive with `tag` takes (removed), or None."""
        sent, _ = self._self_queues()
        for m in sent:
            if tag == ANY_TAG or m.tag == tag:
                sent.remove(m)
                return m
        return None

    def _deliver_self(self, m, arr, req):
        err = _deliver_check(m.data, m.dtc, arr, self.rank)
        if err is None:
            arr.reshape(-1).view(np.uint8)[:m.data.nbytes] = m.data.reshape(-1).view(np.uint8)
        req.complete(self.rank, m.tag, m.data.nbytes, err)
        m.request.complete(self.rank, m.tag, m.data.nbytes)

    def _send_self(self, arr, tag, sync):
        sent, posted = self._self_queues()
        req = LocalRequest(self.timeout)
        m = _SelfMessage(tag, arr.copy(), dtype_code(arr.dtype), req)
        for entry in posted:
            if entry[1] == ANY_TAG or entry[1] == tag:
                posted.remove(entry)
                self._deliver_self(m, entry[0], entry[2])
                return req
        sent.append(m)
        if not sync:
            req.complete()
        return req

    def _recv_self(self, arr, tag, status):
        req = LocalRequest(self.timeout, status)
        m = self._take_self(tag)
        if m is not None:
            self._deliver_self(m, arr, req)
        else:
            self._self_queues()[1].append((arr, tag, req))
        return req

    # -- sends ---------------------------------------------------------------------------------
    def _isend(self, buf, dest, tag, rail, sync, name):
        if is_proc_null(dest):
            return LocalRequest(self.timeout, None, True, dest, ANY_TAG, 0)
        arr = as_array(buf, False, f"{name} buf")
        if isinstance(dest, (int, np.integer)) and dest == self.rank:
            p2p.check("send", dest, tag, rail, self.rank, self.size, 1 << 30, self_ok=True)
            return self._send_self(arr, int(tag), sync)
        return self._p2p("send", arr, dest, tag, rail=rail)

    def Isend(self, buf, dest, tag=0, rail=None):
        """Start sending `buf` to rank `dest` (PROC_NULL: nothing); returns a Request. rail: pin
        the message to one rail while it is up (probes, experiments); if that rail fails, its
        chunks move to the others like any others."""
        return self._isend(buf, dest, tag, rail, False, "Send")

    def Send(self, buf, dest, tag=0, rail=None):
        """Send `buf` to rank `dest` with `tag` (>= 0); returns once the buffer may be
        reused. Messages between a pair with the same tag arrive in order. `rail` pins the
        message to one rail while it is up (see Isend)."""
        self.Isend(buf, dest, tag, rail).Wait()

    def Issend(self, buf, dest, tag=0):
        """Start a synchronous send (see Ssend); returns a Request."""
        return self._isend(buf, dest, tag, None, True, "Ssend")

    def Ssend(self, buf, dest, tag=0):
        """Send that returns once the receiver took the message: to this rank, once a receive
        matched it; to another, once the receiver holds all of it (module doc)."""
        self.Issend(buf, dest, tag).Wait()

    def Irsend(self, buf, dest, tag=0):
        """Ready send (a matching receive is posted already): Isend."""
        return self.Isend(buf, dest, tag)

    def Rsend(self, buf, dest, tag=0):
        """Ready send (a matching receive is posted already): Send."""
        self.Isend(buf, dest, tag).Wait()

    def Ibsend(self, buf, dest, tag=0):
        """Buffered sends are outside r2comm's scope: R2commArgumentError (use Isend)."""
        raise _refuse_buffered("Ibsend")

    def Bsend(self, buf, dest, tag=0):
        """Buffered sends are outside r2comm's scope: R2commArgumentError (use Send)."""
        raise _refuse_buffered("Bsend")

    # -- receives ------------------------------------------------------------------------------
    def Irecv(self, buf, source=ANY_SOURCE, tag=ANY_TAG, status=None):
        """Start receiving from rank `source` (ANY_SOURCE: any rank; PROC_NULL: nothing) into
        `buf` (ANY_TAG matches any tag); returns a Request. A `status` (r2comm.Status or
        mpi4py's MPI.Status) receives the source, tag and byte count of the message matched."""
        if is_proc_null(source):
            return LocalRequest(self.timeout, status, True, source, ANY_TAG, 0)
        arr = as_array(buf, True, "Recv buf")
        if isinstance(source, (int, np.integer)) and source == self.rank:
            p2p.check("recv", source, tag, None, self.rank, self.size, 1, self_ok=True)
            return self._recv_self(arr, int(tag), status)
        if is_any_source(source) and isinstance(tag, (int, np.integer)):
            m = self._take_self(int(tag)) if getattr(self, "_self_sent", None) else None
            if m is not None:
                req = LocalRequest(self.timeout, status)
                self._deliver_self(m, arr, req)
                return req
        return self._p2p("recv", arr, source, tag, status)

    def Recv(self, buf, source=ANY_SOURCE, tag=ANY_TAG, status=None):
        """Receive a message from rank `source` into `buf`; R2commTruncateError when the
        message is larger than the buffer."""
        self.Irecv(buf, source, tag, status).Wait()

    def _p2p(self, kind, arr, peer, tag, status=None, rail=None):
        return self._chan.message(kind, arr, peer, tag, status, rail)

    # -- send and receive at once --------------------------------------------------------------
    def Isendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=None, recvtag=ANY_TAG,
                  status=None):
        """Start Sendrecv; returns one request for both."""
        rr = self.Irecv(recvbuf, dest if source is None else source, recvtag, status)
        sr = self.Isend(sendbuf, dest, sendtag)
        return GroupRequest([rr, sr], status_part=rr)

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=None, recvtag=ANY_TAG,
                 status=None):
        """Send `sendbuf` to `dest` and receive into `recvbuf` from `source` (default:
        `dest`; ANY_SOURCE and PROC_NULL as for Recv) at the same time, without deadlock."""
        self.Isendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag, status).Wait()

    def Isendrecv_replace(self, buf, dest, sendtag=0, source=None, recvtag=ANY_TAG,
                          status=None):
        """Start Sendrecv_replace; returns one request for both."""
        arr = None if is_proc_null(dest) and is_proc_null(source) else \
            as_array(buf, True, "Sendrecv_replace buf")
        if arr is None:
            return LocalRequest(self.timeout, status, True, source, ANY_TAG, 0)
        got = Status()
        tmp = np.empty_like(arr)
        rr = self.Irecv(tmp, dest if source is None else source, recvtag, got)
        sr = self.Isend(arr, dest, sendtag)

        def replace():
            n = got.count
            arr.reshape(-1).view(np.uint8)[:n] = tmp.reshape(-1).view(np.uint8)[:n]
            if status is not None:
                fill_status(status, got.source, got.tag, n)
        return GroupRequest([rr, sr], replace, status_part=rr)

    def Sendrecv_replace(self, buf, dest, sendtag=0, source=None, recvtag=ANY_TAG,
                         status=None):
        """Send `buf` to `dest`, then replace its contents with the message received from
        `source` (default: `dest`)."""
        self.Isendrecv_replace(buf, dest, sendtag, source, recvtag, status).Wait()

    # -- persistent requests -------------------------------------------------------------------
    def Send_init(self, buf, dest, tag=0):
        """A persistent send: each Start() sends `buf` as Isend would."""
        return Prequest(lambda: self.Isend(buf, dest, tag), self.timeout)

    def Ssend_init(self, buf, dest, tag=0):
        """A persistent synchronous send (Issend at each Start())."""
        return Prequest(lambda: self.Issend(buf, dest, tag), self.timeout)

    def Rsend_init(self, buf, dest, tag=0):
        """A persistent ready send (Irsend at each Start())."""
        return Prequest(lambda: self.Irsend(buf, dest, tag), self.timeout)

    def Bsend_init(self, buf, dest, tag=0):
        """Buffered sends are outside r2comm's scope: R2commArgumentError (use Send_init)."""
        raise _refuse_buffered("Bsend_init")

    def Recv_init(self, buf, source=ANY_SOURCE, tag=ANY_TAG):
        """A persistent receive: each Start() receives into `buf` as Irecv would."""
        return Prequest(lambda: self.Irecv(buf, source, tag), self.timeout)

    # -- probes --------------------------------------------------------------------------------
    def _look(self, source, tag):
        """(source, tag, bytes, dtype code, a message to this rank or None) of the message a
        receive from `source` with `tag` would take now, or None."""
        if not isinstance(tag, (int, np.integer)) or tag < ANY_TAG:
            raise R2commArgumentError(f"bad tag {tag!r}")
        self._chan.check()
        mine = isinstance(source, (int, np.integer)) and source == self.rank
        anyone = is_any_source(source)
        if not (mine or anyone):
            p2p.check("recv", source, tag, None, self.rank, self.size, 1)
        if mine or anyone:
            for m in (getattr(self, "_self_sent", None) or ()):
                if tag == ANY_TAG or m.tag == tag:
                    return self.rank, m.tag, m.data.nbytes, m.dtc, m
            if mine:
                return None
        hit = self._chan.probe_message(-1 if anyone else int(source), tag)
        return None if hit is None else (*hit, None)

    def Iprobe(self, source=ANY_SOURCE, tag=ANY_TAG, status=None):
        """Whether a message from `source` with `tag` is here for a receive to take; its
        source, tag and size go to `status` (left as it was when there is none)."""
        if is_proc_null(source):
            fill_status(status, source, ANY_TAG, 0)
            return True
        hit = self._look(source, tag)
        if hit is not None:
            fill_status(status, hit[0], hit[1], hit[2])
        return hit is not None

    def _wait_look(self, source, tag):
        return poll(lambda: self._look(source, tag), self.timeout,
                    f"Probe: no message from {source} with tag {tag}")

    def Probe(self, source=ANY_SOURCE, tag=ANY_TAG, status=None):
        """Wait (at most the communicator's timeout) until a message from `source` with `tag` is
        here; its source, tag and size go to `status`. Returns True."""
        if is_proc_null(source):
            fill_status(status, source, ANY_TAG, 0)
            return True
        hit = self._wait_look(source, tag)
        fill_status(status, hit[0], hit[1], hit[2])
        return True

    def _claim(self, hit, status):
        """Take the message `hit` (_look's) for a Message: no other receive matches it."""
        src, tag, nbytes, dtc, mine = hit
        fill_status(status, src, tag, nbytes)
        if mine is not None:
            self._self_sent.remove(mine)
            mine.request.complete(src, tag, nbytes)
            return Message(self, src, tag, dtc, data=mine.data)
        dt = CODE_DTYPES[dtc]
        data = np.empty(nbytes // dt.itemsize, dt)
        req = self._p2p("recv", data, src, tag)      # the first such message: this one
        return Message(self, src, tag, dtc, data=data, req=req)

    def Improbe(self, source=ANY_SOURCE, tag=ANY_TAG, status=None):
        """A Message for the message a receive from `source` with `tag` would take now (taken:
        no other receive matches it), or None when there is none."""
        if is_proc_null(source):
            fill_status(status, source, ANY_TAG, 0)
            return Message(self, source, ANY_TAG, 0)
        hit = self._look(source, tag)
        return None if hit is None else self._claim(hit, status)

    def Mprobe(self, source=ANY_SOURCE, tag=ANY_TAG, status=None):
        """Improbe that waits (at most the communicator's timeout) for such a message."""
        if is_proc_null(source):
            return self.Improbe(source, tag, status)
        return self._claim(self._wait_look(source, tag), status)
