"""The raw verbs pair's MR cache (tests/verbs_pair.py, tests/test_verbs.py): registrations of
user buffers keyed by (address, length, access). Test-only: r2comm's one registration cache of
user memory is r2comm/transport/regcache.py (the verbs kind's).

Registration cache, and why it cannot hand out a stale MR
---------------------------------------------------------
A registration pins the *pages* that backed a virtual range when it was made.  A cache keyed
only by (address, length) breaks when the buffer is freed and another allocation lands at the
same address: the old MR still points at the old pages, so a send reads stale bytes and a
receive writes where nobody looks.  Here each cache entry keeps a buffer export
(a ``memoryview``) of the object it registered, for as long as the MR lives.  While the export
exists the exporter cannot be freed (the view holds a reference), nor resized or closed
(bytearray, numpy and mmap refuse while a buffer is exported), so the virtual range of a live
entry is never reused by another allocation: a hit on (address, length, access) is always
memory the MR really covers.  The price is that cached buffers stay alive until evicted; the
LRU bounds that (``max_entries``, ``max_bytes``), and ``release(obj)``/``clear()`` drop entries
at once (the MR is deregistered first, then the export released).  Buffers the engine owns
(bounce/staging rings) are registered once directly, not through the cache.
"""
import collections

from r2comm.errors import R2commArgumentError
from r2comm._core.verbs_common import buffer_address


class RegCache:
    """LRU of registrations of user buffers keyed by (address, length, access); see the module
    docstring for why a hit is never stale.

    ``register(view, access)`` makes a registration (an object with ``close()``: an `MR`) of a
    memoryview; ``get(obj, access)`` returns a cached or new one."""

    def __init__(self, register, max_entries=256, max_bytes=1 << 30):
        if max_entries < 1 or max_bytes < 1:
            raise R2commArgumentError("RegCache needs room for at least one entry")
        self._register = register
        self.max_entries, self.max_bytes = int(max_entries), int(max_bytes)
        self._entries = collections.OrderedDict()   # key -> (registration, view)
        self.bytes = 0
        self.hits = self.misses = self.evictions = 0

    def __len__(self):
        return len(self._entries)

    def get(self, obj, access=0):
        view = obj if isinstance(obj, memoryview) else memoryview(obj)
        addr, length = buffer_address(view)
        key = (addr, length, int(access))
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]
        self.misses += 1
        if length > self.max_bytes:
            raise R2commArgumentError(f"buffer of {length} bytes exceeds the registration "
                                      f"cache ({self.max_bytes} bytes): use a bounce buffer")
        pinned = memoryview(view)               # the export that keeps the memory in place
        reg = self._register(pinned, int(access))
        self._entries[key] = (reg, pinned)
        self.bytes += length
        self._evict()
        return reg

    def _drop(self, key):
        reg, pinned = self._entries.pop(key)
        self.bytes -= key[1]
        try:
            reg.close()                         # deregister before the memory may go
        finally:
            pinned.release()

    def _evict(self):
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
            self.evictions += 1

    def release(self, obj):
        """Drop every entry for OBJ's memory (any access); returns how many."""
        view = obj if isinstance(obj, memoryview) else memoryview(obj)
        addr, length = buffer_address(view)
        keys = [k for k in self._entries if k[0] == addr and k[1] == length]
        for k in keys:
            self._drop(k)
        return len(keys)

    def clear(self):
        for k in list(self._entries):
            self._drop(k)
