"""The registration cache of verbs rails: which user memory the NICs may send from directly.

Registering memory with an RDMA device (ibv_reg_mr) pins its pages and costs about as much as
copying them, so it pays only for buffers that are sent again and again (gradient buckets, a
serving loop's activations). The cache registers the memory of each large user array on first
use, with every rail device, and keeps the registration for as long as the numpy array that
owns the memory lives: a weakref finalizer drops it when that array is freed. This is what makes
reuse safe: a registration can never outlive its memory, so an address that a later allocation
reuses (same virtual address, other pages) is registered afresh, never found stale. Memory
owned by something numpy cannot see the end of (a bytearray, a torch tensor's storage) is not
registered and goes through the bounce slots.

A bounded LRU (R2COMM_VERBS_REG_CACHE, bytes) limits pinned memory; an evicted entry is
deregistered once the zero-copy sends still reading it complete (the transport keeps count)."""
import threading
import weakref
from collections import OrderedDict

import numpy as np


def _owner(arr):
    """The ndarray at the end of arr's chain of views and the byte range of its memory, if
    that ndarray allocated the memory itself (numpy frees it exactly when the array goes);
    None for memory owned by another object (a bytearray, an mmap, a torch tensor's storage),
    whose end numpy does not see."""
    root = arr
    while isinstance(root.base, np.ndarray):
        root = root.base
    if root.base is not None or not root.flags.owndata:
        return None
    try:
        lo, hi = np.lib.array_utils.byte_bounds(root)
    except (AttributeError, ValueError):
        return None
    return root, lo, hi


class RegCache:
    """Registrations of user arrays' memory on the rail devices (one per device), LRU-bounded."""

    def __init__(self, devices, limit, min_bytes):
        self._devices = list(devices)
        self._limit = int(limit)
        self._min = int(min_bytes)
        self._lock = threading.RLock()   # (a finalizer may run inside note, from the GC)
        self._live = OrderedDict()      # id(owner) -> (weakref, lo, hi, handles, finalizer)
        self._bytes = 0
        self.failures = 0               # registrations the devices refused (e.g. memlock limit)
        self.last_error = None

    def note(self, arr):
        """Make sure arr's memory is registered (if large enough and its owner is known)."""
        if not isinstance(arr, np.ndarray) or arr.nbytes < self._min:
            return
        found = _owner(arr)
        if found is None:
            return
        root, lo, hi = found
        key = id(root)
        with self._lock:
            ent = self._live.get(key)
            if ent is not None and ent[0]() is root and ent[1] == lo and ent[2] == hi:
                self._live.move_to_end(key)
                return
            if ent is not None:         # (an id re-used after its owner died: not yet dropped)
                self._drop(key)
            if hi - lo > self._limit:
                return
            handles = []
            try:
                for d in self._devices:
                    handles.append(d.register(lo, hi - lo))
            except Exception as exc:    # pinned-memory limit and the like: the bounce path
                for d, h in zip(self._devices, handles):
                    d.unregister(h)
                self.failures += 1
                self.last_error = str(exc)
                return
            try:
                ref = weakref.ref(root)
            except TypeError:
                for d, h in zip(self._devices, handles):
                    d.unregister(h)
                return
            fin = weakref.finalize(root, self._finalized, key, tuple(handles))
            fin.atexit = False
            self._live[key] = (ref, lo, hi, handles, fin)
            self._bytes += hi - lo
            while self._bytes > self._limit and len(self._live) > 1:
                self._drop(next(iter(self._live)))

    def _finalized(self, key, handles):
        """The owner is being freed (before its memory is): no send may use it any more."""
        with self._lock:
            ent = self._live.get(key)
            if ent is not None and tuple(ent[3]) == handles:
                self._live.pop(key)
                self._bytes -= ent[2] - ent[1]
            for d, h in zip(self._devices, handles):
                d.unregister(h)

    def _drop(self, key):
        ref, lo, hi, handles, fin = self._live.pop(key)
        self._bytes -= hi - lo
        fin.detach()
        for d, h in zip(self._devices, handles):
            d.unregister(h)

    def clear(self):
        with self._lock:
            for key in list(self._live):
                self._drop(key)

    def stats(self):
        """Live entries and bytes, refusals, and the devices' zero-copy counters summed."""
        tot = {}
        for d in self._devices:
            for k, v in d.zcopy_stats().items():
                tot[k] = tot.get(k, 0) + v
        with self._lock:
            tot.update(entries=len(self._live), entry_bytes=self._bytes,
                       refused=self.failures)
        return tot
