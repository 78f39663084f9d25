"""The verbs registration cache (r2comm/transport/regcache.py) against a stand-in device: what gets
registered, for how long, and when it is dropped. The real devices run the same cache in the
soft-RoCE guests (test_rdma_testbed.py: zero-copy sends with freed and reused buffers)."""
import gc

import numpy as np

from r2comm.transport.regcache import RegCache


class Dev:
    """Records registrations like RailDevice.register/unregister (handles are integers)."""

    def __init__(self, refuse=False):
        self.live, self.next, self.refuse, self.log = {}, 1, refuse, []

    def register(self, addr, n):
        if self.refuse:
            raise OSError(12, "ibv_reg_mr: Cannot allocate memory")
        h = self.next
        self.next += 1
        self.live[h] = (addr, n)
        self.log.append(("reg", addr, n))
        return h

    def unregister(self, h):
        assert h in self.live, f"unregister of unknown handle {h}"
        self.log.append(("dereg",) + self.live.pop(h))

    def zcopy_stats(self):
        return {"live": len(self.live)}


def test_registers_the_owner_once_for_all_its_views_and_drops_it_when_freed():
    devs = [Dev(), Dev()]
    rc = RegCache(devs, 1 << 30, 64 << 10)
    a = np.zeros(1 << 20, np.uint8)
    lo = a.ctypes.data
    rc.note(a[4096:])                 # a view: the owner's whole memory is registered
    rc.note(a.reshape(1024, 1024)[::2])
    rc.note(a)
    for d in devs:
        assert list(d.live.values()) == [(lo, 1 << 20)]
    assert rc.stats()["entries"] == 1
    del a
    gc.collect()
    for d in devs:
        assert d.live == {} and d.log[-1] == ("dereg", lo, 1 << 20)
    assert rc.stats()["entries"] == 0


def test_a_reused_address_is_registered_afresh():
    dev = Dev()
    rc = RegCache([dev], 1 << 30, 64 << 10)
    addrs = []
    for _ in range(6):
        a = np.ones(4 << 20, np.uint8)
        addrs.append(a.ctypes.data)
        rc.note(a)
        assert len(dev.live) == 1     # never the previous array's registration
        del a
        assert dev.live == {}
    regs = [e for e in dev.log if e[0] == "reg"]
    assert len(regs) == 6
    assert len(set(addrs)) < len(addrs), "the allocator never reused an address (test moot)"


def test_small_foreign_and_refused_buffers_are_not_registered():
    dev = Dev()
    rc = RegCache([dev], 1 << 30, 64 << 10)
    rc.note(np.zeros(1000, np.float32))                     # under the minimum
    raw = bytearray(1 << 20)
    rc.note(np.frombuffer(raw, np.uint8))                   # owned by a bytearray
    rc.note(memoryview(raw))                                # not an ndarray
    assert dev.log == []
    bad = RegCache([Dev(), Dev(refuse=True)], 1 << 30, 64 << 10)
    keep = np.zeros(1 << 20, np.uint8)
    bad.note(keep)
    st = bad.stats()
    assert st["refused"] == 1 and st["entries"] == 0 and st["live"] == 0   # (the first undone)


def test_lru_bound_drops_the_least_recently_used():
    dev = Dev()
    rc = RegCache([dev], 3 << 20, 64 << 10)
    arrs = [np.zeros(1 << 20, np.uint8) for _ in range(4)]
    for a in arrs[:3]:
        rc.note(a)
    rc.note(arrs[0])                  # used again: now the most recent
    rc.note(arrs[3])                  # over the bound: arrs[1] goes
    live = sorted(v[0] for v in dev.live.values())
    assert live == sorted(arrs[i].ctypes.data for i in (0, 2, 3))
    assert rc.stats()["entry_bytes"] == 3 << 20
    del arrs[1]
    gc.collect()                      # its finalizer was detached: no second unregister
    rc.clear()
    assert dev.live == {}
    too_big = np.zeros(4 << 20, np.uint8)
    rc.note(too_big)                  # larger than the whole cache: never registered
    assert dev.live == {}
