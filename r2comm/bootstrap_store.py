"""Bootstrap through a key-value store instead of MPI.

r2comm's bootstrap (bootstrap.run) and the Communicator's constructor, Dup and Split talk to the
other ranks through a small "bootstrap comm": Get_rank, Get_size, bcast, allgather, allreduce,
Barrier, Dup, Split and Free, the way mpi4py's Comm spells them. An mpi4py communicator is one
implementation (the default under mpiexec); StoreComm below is the other: the same calls over a
key-value store with torch's Store interface, of which it uses only

    set(key, value)      get(key) -> bytes      add(key, n) -> int      wait([keys], timeout)

so torch's TCPStore / FileStore (what torchrun's env:// rendezvous provides) work, and so does
DirStore, a directory of files, for launchers without torch. What travels through the store is
small and only at start-up (and at Dup/Split): the job secret, the parameters rank 0 decides
(chunk size, acknowledgements), each rank's endpoints and host name, bootstrap errors, and the
communicator ids of Dup/Split. Everything after that is r2comm's own TCP connections.

Values are pickled, as mpi4py's lowercase calls do: whoever can write to the store can make the
ranks unpickle what they wrote, and read the job secret, so the store must be private to the
job (torchrun's TCPStore listens on MASTER_ADDR:MASTER_PORT; keep that on a private network).

Every collective of a StoreComm uses fresh keys, <prefix>/<sequence number>/..., which all ranks
derive alike because they call the collectives in the same order; keys are never deleted (a
start-up writes a few KiB per rank)."""
import datetime
import functools
import operator
import os
import pickle
import tempfile
import time

from .errors import R2commArgumentError, R2commTimeout

UNDEFINED = -32766          # Split color "not a member" (the value MPICH gives MPI.UNDEFINED)


class _Op:
    __slots__ = ("name", "fn")

    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def __repr__(self):
        return f"StoreComm.{self.name}"


MAX = _Op("MAX", max)
MIN = _Op("MIN", min)
SUM = _Op("SUM", operator.add)
PROD = _Op("PROD", operator.mul)
_OPS = {o.name: o for o in (MAX, MIN, SUM, PROD)}


def _op_fn(op):
    """A reduction function from this module's ops, r2comm's (r2comm.MAX) or a name."""
    if isinstance(op, _Op):
        return op.fn
    name = op if isinstance(op, str) else getattr(op, "name", "")
    name = str(name).upper().replace("MPI_", "")
    if name not in _OPS:
        raise R2commArgumentError(f"StoreComm: unknown reduction op {op!r} (MAX, MIN, SUM, PROD)")
    return _OPS[name].fn


class DirStore:
    """A key-value store in a directory every rank can reach (a shared or local file system):
    torch's Store calls set/get/add/wait, enough for Communicator.from_store without torch.

    Writes are atomic (a temporary file renamed into place); add() takes a lock file."""

    def __init__(self, path, timeout=300.0):
        self.path = os.fspath(path)
        self.timeout = float(timeout)
        os.makedirs(self.path, exist_ok=True)

    def _file(self, key):
        safe = "".join(c if c.isalnum() or c in "-_." else f"%{ord(c):02x}" for c in str(key))
        return os.path.join(self.path, safe or "%")

    def set(self, key, value):
        data = value.encode() if isinstance(value, str) else bytes(value)
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, self._file(key))

    def get(self, key):
        self.wait([key])
        with open(self._file(key), "rb") as f:
            return f.read()

    def add(self, key, amount):
        lock = self._file(key) + ".lock"
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                break
            except FileExistsError:
                if time.monotonic() > deadline:
                    raise R2commTimeout(f"DirStore.add({key!r}): lock {lock} held for "
                                        f"{self.timeout:g} s") from None
                time.sleep(0.001)
        try:
            try:
                with open(self._file(key), "rb") as f:
                    value = int(f.read() or b"0")
            except FileNotFoundError:
                value = 0
            value += int(amount)
            self.set(key, str(value))
            return value
        finally:
            os.close(fd)
            os.unlink(lock)

    def check(self, keys):
        return all(os.path.exists(self._file(k)) for k in keys)

    def wait(self, keys, timeout=None):
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        limit = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + limit
        pause = 0.0005
        while not self.check(keys):
            if time.monotonic() > deadline:
                missing = [k for k in keys if not os.path.exists(self._file(k))]
                raise R2commTimeout(f"DirStore: keys {missing} not set within {limit:g} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.02)


class StoreComm:
    """The bootstrap calls of an mpi4py Comm, over a key-value store (see the module doc).

    StoreComm(store, rank, size, prefix="r2comm", timeout=300.0): every rank of the group
    makes one with the same store, size and prefix and its own rank."""

    UNDEFINED = UNDEFINED
    MAX = MAX

    def __init__(self, store, rank, size, prefix="r2comm", timeout=300.0):
        if not isinstance(size, int) or size < 1:
            raise R2commArgumentError(f"StoreComm: size must be a positive integer, got {size!r}")
        if not isinstance(rank, int) or not 0 <= rank < size:
            raise R2commArgumentError(f"StoreComm: rank {rank!r} is not in 0..{size - 1}")
        for name in ("set", "get", "wait"):
            if not callable(getattr(store, name, None)):
                raise R2commArgumentError(f"StoreComm: store {store!r} has no {name}() (torch's "
                                          "Store interface: set/get/add/wait)")
        self.store = store
        self.rank, self.size = rank, size
        self.prefix = prefix
        self.timeout = float(timeout)
        self._seq = 0

    # mpi4py names
    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def _key(self):
        self._seq += 1
        return f"{self.prefix}/{self._seq}"

    def _wait(self, keys):
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout))
        except Exception as exc:       # torch: DistStoreError / RuntimeError on a timeout
            raise R2commTimeout(f"r2comm store bootstrap (rank {self.rank}/{self.size}): "
                                f"waiting for {keys[:4]}{'...' if len(keys) > 4 else ''} "
                                f"failed after up to {self.timeout:g} s: {exc}") from exc

    def _get(self, key):
        self._wait([key])
        return pickle.loads(self.store.get(key))

    def allgather(self, obj):
        base = self._key()
        self.store.set(f"{base}/{self.rank}", pickle.dumps(obj))
        keys = [f"{base}/{r}" for r in range(self.size)]
        self._wait(keys)
        return [pickle.loads(self.store.get(k)) for k in keys]

    def bcast(self, obj, root=0):
        if not isinstance(root, int) or not 0 <= root < self.size:
            raise R2commArgumentError(f"StoreComm.bcast: root {root!r} is not in 0..{self.size - 1}")
        key = self._key()
        if self.rank == root:
            self.store.set(key, pickle.dumps(obj))
            return obj
        return self._get(key)

    def allreduce(self, obj, op=SUM):
        return functools.reduce(_op_fn(op), self.allgather(obj))

    def Barrier(self):
        self.allgather(None)

    barrier = Barrier

    def Dup(self):
        return StoreComm(self.store, self.rank, self.size, f"{self._key()}/dup", self.timeout)

    def Split(self, color=0, key=0):
        undefined = color is None or color == UNDEFINED or color < 0
        tag = self._key()
        rows = self.allgather(None if undefined else (color, key, self.rank))
        if undefined:
            return None
        mine = sorted((k, r) for (c, k, r) in filter(None, rows) if c == color)
        return StoreComm(self.store, mine.index((key, self.rank)), len(mine),
                         f"{tag}/split{color}", self.timeout)

    def Free(self):
        pass

    def __repr__(self):
        return f"<r2comm StoreComm rank {self.rank}/{self.size} prefix {self.prefix!r}>"


_instances = {}


def instance_prefix(store, prefix):
    """A fresh prefix per Communicator.from_store call on one store: the n-th call in every
    process gets the same name, since all ranks build their communicators in the same order."""
    n = _instances.get((id(store), prefix), 0)
    _instances[(id(store), prefix)] = n + 1
    return f"{prefix}/{n}"
