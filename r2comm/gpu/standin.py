"""A host-memory stand-in for a GPU, so the staging pipeline's logic runs in tests without one.

"Device memory" is numpy memory wrapped in HostArray. Each HostStream is a FIFO of work run in
order by its own worker thread (the copy engine or the SMs of a real device): copies, reductions,
event records and waits, and any callable a test enqueues as a "kernel". So work on one stream is
ordered, work on different streams runs concurrently, and the host sees completion only through
events, as with CUDA. Delays per copy (seconds, plus bytes / rate) make copies slow enough to
observe overlap and ordering; `fail_copy_at=k` makes the k-th copy fail (an asynchronous device
error, reported by the next query or synchronize of an event recorded after it).

The timeline (`log`: (kind, tag, t_start, t_end) per copy and reduction) and the counters
(`pinned_allocs`, `active`, `max_active`) are what the tests check."""
import contextlib
import itertools
import threading
import time
from collections import deque

import numpy as np

from ..errors import R2commBufferError, R2commError
from .device import DeviceBackend, reduce_blocks


class DeviceError(R2commError):
    """An asynchronous error of the (stand-in) device, reported at an event."""


class HostArray:
    """A stand-in device array: `data` is its memory (numpy). Read it only after the stream
    that wrote it was synchronized (backend.sync(stream)). `dtype` may be "bfloat16" (2-byte
    storage). `stream`: the stream of the array's producer (like __cuda_array_interface__'s)."""

    def __init__(self, backend, data, dtype=None, stream=None):
        self.__r2comm_device__ = backend
        self.data = data
        self.dtype = dtype or data.dtype.name
        self.stream = stream

    @property
    def nbytes(self):
        return self.data.nbytes

    @property
    def size(self):
        return self.data.size

    def __getitem__(self, key):
        """A view (slices of contiguous memory), like a device array's."""
        return HostArray(self.__r2comm_device__, self.data[key], self.dtype, self.stream)

    def __repr__(self):
        return f"<HostArray {self.dtype} x {self.data.size}>"


class HostEvent:
    __slots__ = ("done", "error", "tag")

    def __init__(self, tag=""):
        self.done = threading.Event()
        self.error = None
        self.tag = tag


class HostStream:
    """An in-order work queue with its own worker thread."""
    _ids = itertools.count()

    def __init__(self, backend, name=None):
        self.backend = backend
        self.name = name or f"stream{next(self._ids)}"
        self._q = deque()
        self._cv = threading.Condition()
        self.error = None            # the first error of work on this stream (sticky)
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"r2comm-standin-{self.name}")
        self._thread.start()

    def put(self, fn):
        with self._cv:
            self._q.append(fn)
            self._cv.notify()

    def pending(self):
        with self._cv:
            return len(self._q)

    def _run(self):
        while True:
            with self._cv:
                while not self._q:
                    self._cv.wait()
                fn = self._q[0]
            try:
                fn(self)
            except BaseException as exc:          # an asynchronous device error
                if self.error is None:
                    self.error = exc
            with self._cv:
                self._q.popleft()

    def __repr__(self):
        return f"<HostStream {self.name}>"


class HostBackend(DeviceBackend):
    """The stand-in device. copy_delay: seconds per copy; copy_rate: bytes/s (None: instant);
    reduce_delay: seconds per reduction; fail_copy_at: the k-th copy (1-based) fails."""
    name = "host-standin"

    def __init__(self, copy_delay=0.0, copy_rate=None, reduce_delay=0.0, fail_copy_at=None):
        self.copy_delay = copy_delay
        self.copy_rate = copy_rate
        self.reduce_delay = reduce_delay
        self.fail_copy_at = fail_copy_at
        self.default_stream = HostStream(self, "default")
        self._local = threading.local()
        self._lock = threading.Lock()
        self.log = []                 # (kind, tag, t0, t1)
        self.copies = 0
        self.active = 0
        self.max_active = 0
        self.pinned_allocs = 0
        self.pinned_bytes = 0
        self.device_allocs = 0
        self.reductions = 0

    # -- arrays and streams (what a test uses) ----------------------------------------------------
    def array(self, data, dtype=None, stream=None):
        """A device array holding a copy of `data` (dtype="bfloat16": uint16 storage)."""
        return HostArray(self, np.array(data, copy=True), dtype, stream)

    def zeros(self, n, dtype):
        store = np.uint16 if dtype == "bfloat16" else dtype
        return HostArray(self, np.zeros(n, store), dtype)

    @contextlib.contextmanager
    def use_stream(self, stream):
        """Make `stream` the current stream of this thread (cupy's `with stream:`)."""
        old = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield stream
        finally:
            self._local.stream = old

    def current_stream(self):
        return getattr(self._local, "stream", None) or self.default_stream

    def launch(self, stream, fn):
        """Enqueue a "kernel": fn() runs on the stream's worker, in order."""
        stream.put(lambda s: fn())

    def sync(self, stream, timeout=30.0):
        """Wait for everything queued on `stream`; raise its device error."""
        ev = self.record(stream)
        if not self.synchronize(ev, timeout):
            raise TimeoutError(f"stand-in stream {stream.name} did not drain in {timeout} s")

    # -- the interface ---------------------------------------------------------------------------
    def flat(self, obj, writable, what):
        if not isinstance(obj, HostArray):
            raise R2commBufferError(f"{what}: not a stand-in device array")
        d = obj.data
        if not d.flags.c_contiguous:
            raise R2commBufferError(f"{what} is not contiguous")
        if writable and not d.flags.writeable:
            raise R2commBufferError(f"{what} is read-only")
        return d.reshape(-1).view(np.uint8), d.nbytes, obj.dtype, d.itemsize

    def stream_of(self, obj, stream=None):
        if stream is not None:
            return stream
        own = getattr(getattr(obj, "array", obj), "stream", None)
        return own if own is not None else self.current_stream()

    def new_stream(self):
        return HostStream(self)

    def record(self, stream, tag=""):
        ev = HostEvent(tag)

        def mark(s):
            ev.error = s.error
            ev.done.set()
        stream.put(mark)
        return ev

    def wait_event(self, stream, event):
        def wait(s):
            if not event.done.wait(120.0):
                raise DeviceError(f"stand-in: {s.name} waited 120 s for an event")
        stream.put(wait)

    def query(self, event):
        if not event.done.is_set():
            return False
        if event.error is not None:
            raise DeviceError(f"device error: {event.error}")
        return True

    def synchronize(self, event, timeout):
        if not event.done.wait(timeout):
            return False
        return self.query(event)

    def _copy(self, kind, dst, src, n, stream, tag):
        with self._lock:
            self.copies += 1
            k = self.copies
        fail = self.fail_copy_at is not None and k == self.fail_copy_at

        def run(s):
            if s.error is not None:
                return                      # a failed stream runs nothing more (sticky)
            with self._lock:
                self.active += 1
                self.max_active = max(self.max_active, self.active)
            t0 = time.monotonic()
            try:
                delay = self.copy_delay + (n / self.copy_rate if self.copy_rate else 0.0)
                if delay > 0:
                    time.sleep(delay)
                if fail:
                    raise DeviceError(f"stand-in: copy #{k} ({kind}, {n} bytes) failed (injected)")
                dst()[:] = src()
            finally:
                with self._lock:
                    self.active -= 1
                    self.log.append((kind, tag, t0, time.monotonic()))
        stream.put(run)

    def d2h(self, host, host_off, dev, dev_off, n, stream, tag=""):
        self._copy("d2h", lambda: host[host_off:host_off + n], lambda: dev[dev_off:dev_off + n],
                   n, stream, tag)

    def h2d(self, dev, dev_off, host, host_off, n, stream, tag=""):
        self._copy("h2d", lambda: dev[dev_off:dev_off + n], lambda: host[host_off:host_off + n],
                   n, stream, tag)

    def pinned(self, nbytes):
        with self._lock:
            self.pinned_allocs += 1
            self.pinned_bytes += nbytes
        return np.empty(nbytes, np.uint8)

    def empty(self, nbytes):
        with self._lock:
            self.device_allocs += 1
        return np.empty(nbytes, np.uint8)

    def reduce(self, dst, dst_off, src, src_offs, count, op, dtype, stream, tag=""):
        isz = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
        n = count * isz

        def run(s):
            if s.error is not None:
                return
            t0 = time.monotonic()
            if self.reduce_delay:
                time.sleep(self.reduce_delay)
            out = reduce_blocks([src[o:o + n] for o in src_offs], op, dtype)
            dst[dst_off:dst_off + n] = out.view(np.uint8)
            with self._lock:
                self.reductions += 1
                self.log.append(("reduce", tag, t0, time.monotonic()))
        stream.put(run)
