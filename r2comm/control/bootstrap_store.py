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

Values travel in a fixed encoding, never pickle (encode/decode below: JSON with tagged bytes,
tuples and dicts, size- and depth-bounded), so whoever can write to the store can at worst make
a start-up fail with a clear error, never run code in a rank. The job secret is not published:
rank 0 publishes a random salt (bcast_secret), every rank mixes it with the out-of-band secret
R2COMM_JOB_SECRET_FILE / R2COMM_JOB_SECRET when one is set (bootstrap.py), and rank 0 deletes
the salt's key once every rank has read it (forget_secrets). Without an out-of-band secret,
whoever reads the store during start-up learns the job secret: keep the store private then.

Every collective of a StoreComm uses fresh keys, <prefix>/<sequence number>/..., which all ranks
derive alike because they call the collectives in the same order; keys other than the salt's are
not deleted (a start-up writes a few KiB per rank)."""
import datetime
import functools
import operator
import json
import numbers
import os
import tempfile
import time
import warnings

from ..errors import R2commArgumentError, R2commPeerError, R2commProtocolError, R2commTimeout

UNDEFINED = -32766          # Split color "not a member" (the value MPICH gives MPI.UNDEFINED)


MAX_VALUE_BYTES = 1 << 20   # longest encoded value read from a store
MAX_DEPTH = 16              # deepest nesting of lists/tuples/dicts in a value


def encode(obj):
    """obj (None, bool, int, float, str, bytes, list, tuple, dict, nested) as store bytes."""
    return json.dumps(_tagged(obj, 0), separators=(",", ":")).encode()


def _tagged(obj, depth):
    if depth > MAX_DEPTH:
        raise R2commArgumentError(f"StoreComm: value nested deeper than {MAX_DEPTH} levels")
    if obj is None or isinstance(obj, (bool, str, float)):
        return obj
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        return float(obj)
    if isinstance(obj, (bytes, bytearray)):
        return {"b": bytes(obj).hex()}
    if isinstance(obj, list):
        return [_tagged(x, depth + 1) for x in obj]
    if isinstance(obj, tuple):
        return {"t": [_tagged(x, depth + 1) for x in obj]}
    if isinstance(obj, dict):
        return {"d": [[_tagged(k, depth + 1), _tagged(v, depth + 1)] for k, v in obj.items()]}
    raise R2commArgumentError(f"StoreComm: cannot send a {type(obj).__name__} through the store "
                              "(None, bool, int, float, str, bytes, list, tuple, dict)")


def decode(data):
    """The object encode() made of `data`; R2commPeerError for the error record a sender
    published instead of a value it could not encode; R2commProtocolError for anything else."""
    if not isinstance(data, (bytes, bytearray)) or len(data) > MAX_VALUE_BYTES:
        raise R2commProtocolError(f"r2comm store value: not bytes of at most {MAX_VALUE_BYTES}")
    try:
        tree = json.loads(bytes(data).decode("utf-8"))
        if isinstance(tree, dict) and isinstance(tree.get("e"), str) and len(tree) == 1:
            raise R2commPeerError(tree["e"][:1000])       # the sender could not encode its value
        return _untagged(tree, 0)
    except (ValueError, RecursionError, TypeError) as exc:
        raise R2commProtocolError(f"r2comm store value is not r2comm's encoding: "
                                  f"{str(exc)[:200]}") from None


def _untagged(obj, depth):
    if depth > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [_untagged(x, depth + 1) for x in obj]
    if not isinstance(obj, dict) or len(obj) != 1:
        raise ValueError("unknown tagged value")
    (tag, body), = obj.items()
    if tag == "b" and isinstance(body, str):
        return bytes.fromhex(body)
    if tag == "t" and isinstance(body, list):
        return tuple(_untagged(x, depth + 1) for x in body)
    if tag == "d" and isinstance(body, list):
        out = {}
        for item in body:
            if not isinstance(item, list) or len(item) != 2:
                raise ValueError("a dict item is not a pair")
            out[_untagged(item[0], depth + 1)] = _untagged(item[1], depth + 1)   # TypeError:
        return out                                                           # unhashable key
    raise ValueError(f"unknown tag {tag!r}")


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

    def delete_key(self, key):
        """Remove key; True if it existed."""
        try:
            os.unlink(self._file(key))
            return True
        except FileNotFoundError:
            return False

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
        self._secret_keys = []      # keys of bcast_secret this rank set, deleted by forget_secrets

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
        return self._read(key)

    def _read(self, key):
        try:
            return decode(self.store.get(key))
        except R2commProtocolError as exc:
            raise R2commProtocolError(f"r2comm store bootstrap (rank {self.rank}/{self.size}): "
                                      f"key {key!r}: {exc}") from None

    def _set(self, key, obj):
        """Publish obj under key; a value that cannot be encoded is published as an error
        (the readers raise R2commPeerError instead of waiting out their timeout), then raised."""
        try:
            data = encode(obj)
        except R2commArgumentError as exc:
            self.store.set(key, json.dumps({"e": f"rank {self.rank}: {exc}"}).encode())
            raise
        self.store.set(key, data)

    def allgather(self, obj):
        base = self._key()
        self._set(f"{base}/{self.rank}", obj)
        keys = [f"{base}/{r}" for r in range(self.size)]
        self._wait(keys)
        return [self._read(k) for k in keys]

    def bcast(self, obj, root=0):
        return self._bcast(obj, root)[0]

    def _bcast(self, obj, root):
        if not isinstance(root, int) or not 0 <= root < self.size:
            raise R2commArgumentError(f"StoreComm.bcast: root {root!r} is not in 0..{self.size - 1}")
        key = self._key()
        if self.rank == root:
            self._set(key, obj)
            return obj, key
        return self._get(key), None

    def bcast_secret(self, obj, root=0):
        """bcast of a value that must not stay in the store: its key is deleted by
        forget_secrets(), which the root calls once every rank has read it."""
        obj, key = self._bcast(obj, root)
        if key is not None:
            self._secret_keys.append(key)
        return obj

    def forget_secrets(self):
        """Delete the keys this rank set in bcast_secret (call it after a collective that every
        rank entered after reading them). False when the store cannot delete keys."""
        keys, self._secret_keys = self._secret_keys, []
        delete = getattr(self.store, "delete_key", None)
        ok = True
        for key in keys:
            try:
                if delete is None:
                    raise AttributeError("the store has no delete_key()")
                delete(key)
            except Exception as exc:       # e.g. torch's FileStore: not implemented
                ok = False
                warnings.warn(f"r2comm store bootstrap: could not delete key {key!r} from "
                              f"{type(self.store).__name__} ({exc}); it holds the salt of the "
                              "job secret", stacklevel=2)
        return ok

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


def announce_growth(store, prefix, old_size, size):
    """Rank 0 of a communicator that grows (Communicator.Grow): publish under `prefix` that
    ranks old_size .. size-1 are to join. R2commArgumentError where `prefix` was used by an
    earlier growth on this store (a prefix names one growth)."""
    if store.add(f"{prefix}/announced", 1) != 1:
        raise R2commArgumentError(f"Grow: prefix {prefix!r} was used by an earlier growth on "
                                  "this store; give every growth a prefix of its own")
    store.set(f"{prefix}/size", f"{old_size} {size}")


def claim_growth(store, prefix, timeout):
    """A joining process (Communicator.join): (rank, size) of its place in the growth under
    `prefix`, claimed once (store.add), after waiting at most `timeout` s for rank 0's
    announcement. What the store holds is checked, never trusted."""
    store.wait([f"{prefix}/size"], datetime.timedelta(seconds=timeout))
    raw = store.get(f"{prefix}/size")
    try:
        old, size = (int(v) for v in bytes(raw).decode("ascii").split())
    except (ValueError, UnicodeDecodeError):
        raise R2commArgumentError(f"join: the store's growth record under {prefix!r} is not "
                                  f"two integers: {bytes(raw)[:40]!r}") from None
    if not 1 <= old < size <= 1 << 20:
        raise R2commArgumentError(f"join: growth from {old} to {size} ranks under {prefix!r}")
    rank = old + int(store.add(f"{prefix}/joined", 1)) - 1
    if rank >= size:
        raise R2commArgumentError(f"join: {size - old} ranks were to join under {prefix!r}, "
                                  f"this process would be joiner number {rank - old + 1}")
    return rank, size


def instance_prefix(store, prefix):
    """A fresh prefix per Communicator.from_store call on one store: the n-th call in every
    process gets the same name, since all ranks build their communicators in the same order."""
    n = _instances.get((id(store), prefix), 0)
    _instances[(id(store), prefix)] = n + 1
    return f"{prefix}/{n}"
