"""CMA (process_vm_readv) vs the shared-memory ring's two memcpys: one process reads another's buffer.

    python bench/cma_vs_ring.py [bytes]      (bench/NOTES.md, shared memory)
"""
import ctypes, os, time, sys
import numpy as np
libc = ctypes.CDLL("libc.so.6", use_errno=True)
class iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]
libc.process_vm_readv.restype = ctypes.c_ssize_t
N = int(sys.argv[1]) if len(sys.argv) > 1 else 64 << 20
src = np.ones(N, np.uint8)
r, w = os.pipe()
pid = os.fork()
if pid == 0:                                   # the sender: keeps its buffer alive
    os.close(r); os.write(w, b"x"); time.sleep(30); os._exit(0)
os.close(w); os.read(r, 1)
dst = np.empty(N, np.uint8)
def cma():
    l = iovec(dst.ctypes.data, N); rr = iovec(src.ctypes.data, N)   # same address in the child (fork)
    n = libc.process_vm_readv(pid, ctypes.byref(l), 1, ctypes.byref(rr), 1, 0)
    assert n == N, ctypes.get_errno()
ring = np.empty(4 << 20, np.uint8)
def two_copies():
    for off in range(0, N, 4 << 20):
        k = min(4 << 20, N - off)
        np.copyto(ring[:k], src[off:off + k]); np.copyto(dst[off:off + k], ring[:k])
for name, f in (("process_vm_readv", cma), ("2 x memcpy via 4 MiB ring", two_copies), ("1 x memcpy", lambda: np.copyto(dst, src))):
    f(); best = 1e9
    for _ in range(7):
        t = time.perf_counter(); f(); best = min(best, time.perf_counter() - t)
    print(f"{N >> 20} MiB {name:28s} {best*1e3:7.2f} ms  {N / best / 1e9:6.2f} GB/s", flush=True)
os.kill(pid, 9)
