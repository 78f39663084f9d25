# cython: language_level=3
# distutils: language = c++
"""Shared-memory links' segments and their hand-over to an engine (r2comm/transport/shm.py):
create, map and check a POSIX shm segment, and attach a mapped segment with its doorbell socket
to an Engine as a connection of the shm transport, whose table (shm.pxd, r2_shm.h) lives here
and reaches the engine through transport.pxd only (Engine.links.attach_transport), as verbs' does."""
import errno
import os
from libc.stdint cimport uint32_t, uint64_t, intptr_t
from r2comm._core.transport cimport Transport
from r2comm._core.shm cimport (shm_transport, r2_shm_setup, shm_setup, r2_shm_ring_ok, r2_shm_ring_of,
                               r2_shm_create, r2_shm_attach)

cdef extern from "<sys/mman.h>" nogil:
    int munmap(void* addr, size_t n)

cdef Transport SHM_TP                 # local peers' transport (shm.pxd)
shm_transport(&SHM_TP)


def transport_address():
    """The address of the shm transport's transport.pxd table (Engine.links.attach_transport)."""
    return <uint64_t>&SHM_TP


def attach(engine, int peer, int rail, int fd, uint32_t conn_id, uint64_t base, uint64_t map_len,
           int side, bytes tx_key=b"", bytes rx_key=b""):
    """Hand a shared-memory link to `engine` (an r2comm._core.engine.Engine) as (peer, rail):
    the mapped segment at `base` (map_len bytes, from shm_create / shm_attach; side 0 the
    creator, 1 the peer) and the connected, authenticated, non-blocking doorbell socket fd. On
    success the connection owns both (unmapped and closed with it); on an exception the caller
    still does."""
    cdef r2_shm_setup st
    shm_setup(&st, fd, base, map_len, side, "shm attach")
    # the engine adopts the connection from st during this call (shm_adopt copies what it keeps)
    engine.links.attach_transport(peer, rail, <uint64_t>&SHM_TP, <uint64_t><intptr_t>&st,
                                  conn_id, tx_key, rx_key)


def shm_create(bytes name, uint64_t ring_bytes, uint32_t conn_id, bytes job, uint64_t pid):
    """Create, size and map the POSIX shm segment `name` of a shared-memory link (two rings of
    ring_bytes each, a power of two from 4 KiB to 1 GiB; mode 0600, O_EXCL) and fill its header:
    (address, length). Raises OSError (the name is gone again then)."""
    cdef size_t n = 0
    cdef int err = 0
    cdef char* base
    cdef const char* cname = name
    cdef const char* cjob
    if not r2_shm_ring_ok(ring_bytes):
        raise ValueError(f"ring size {ring_bytes}: a power of two from 4096 to 2**30")
    if len(job) != 8:
        raise ValueError("job id: 8 bytes")
    cjob = job
    with nogil:
        base = r2_shm_create(cname, ring_bytes, conn_id, cjob, pid, &n, &err)
    if base == NULL:
        raise OSError(err, f"shm segment {name.decode()}: {os.strerror(err)}")
    return <uint64_t>base, n


SHM_EOWNER = errno.EPERM     # shm_attach: the segment is another user's or open to group/other
SHM_EBADSEG = errno.EPROTO   # shm_attach: its header or size is not what the handshake named


def shm_attach(bytes name, uint32_t conn_id, bytes job):
    """Map the existing segment `name` after checking that only this user can open it and that
    its header names this job and connection with a valid ring size matching its length:
    (address, length). Raises OSError: errno SHM_EOWNER (owner or mode), SHM_EBADSEG (header or
    size), or that of shm_open / mmap."""
    cdef size_t n = 0
    cdef int err = 0
    cdef char* base
    cdef const char* cname = name
    cdef const char* cjob
    if len(job) != 8:
        raise ValueError("job id: 8 bytes")
    cjob = job
    with nogil:
        base = r2_shm_attach(cname, conn_id, cjob, &n, &err)
    if base == NULL:
        why = {SHM_EOWNER: "not this user's, or group/other may open it",
               SHM_EBADSEG: "its header or size is not the segment the handshake named"}
        raise OSError(err, f"shm segment {name.decode()}: {why.get(err, os.strerror(err))}")
    return <uint64_t>base, n


def shm_unmap(uint64_t base, uint64_t n):
    """Unmap a segment mapped by shm_create / shm_attach that no connection took over."""
    if base:
        munmap(<void*>base, n)
