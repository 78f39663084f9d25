"""Bootstrap through mpi4py (or a store, bootstrap_store.StoreComm): job secret, agreed engine
parameters, endpoint exchange.

The job secret is HMAC(out-of-band secret, salt): rank 0 draws the 32-byte salt and broadcasts
it; the out-of-band secret (R2COMM_JOB_SECRET_FILE / R2COMM_JOB_SECRET, config.Config.job_secret,
empty when unset) never leaves the rank. Everything keyed (every hello's tag, the handshake
proofs, the per-connection frame-MAC keys, shared-memory segment names, the job id that
segment headers carry) derives from the job secret, so a process that read the salt but lacks
the out-of-band secret can neither join nor pass a handshake. Under mpi4py the lowercase calls
used here unpickle what other ranks sent: that is mpi4py's trust model (the MPI launcher and the
ranks it started are trusted; no outside process can write into an MPI communicator). A
StoreComm never unpickles."""
import hashlib
import hmac
import logging
import os
import socket
import warnings
from dataclasses import dataclass

from . import fdlimit, hostid
from . import liveness
from .. import transport as _transport
from ..transport import rails as _rails
from ..config import CHUNK_MAX, CHUNK_MIN, INTEGRITY_MODES
from ..errors import R2commArgumentError, R2commProtocolError, R2commSecurityWarning
from .startup import quiet_allgather, quiet_bcast

log = logging.getLogger("r2comm")
SALT_LEN = 32


@dataclass
class Bootstrap:
    rank: int
    size: int
    secret: bytes
    job: bytes
    params: dict
    rail_addrs: list
    listeners: list          # one per rail, then the control listener
    transport: str           # the job's NIC rails' kind: "tcp" or "verbs" (transport.decide)
    rail_devices: list       # the NIC kind's devices per rail (its offer; verbs), or None
    endpoints: list          # per rank: {"rails": [(addr, port)], "ctrl": (addr, port), "host": str,
                             #  "host_key": str (r2comm.control.hostid: same key = same host),
                             #  "shm": shm.shm_key() or None (R2COMM_SHM=0),
                             #  "pid": int (names its shm segments),
                             #  "detector": (addr, port) of its failure detector or None}
    detector: object = None  # this rank's failure-detector listener (liveness.listener) or None


def run(mpi_comm, cfg, rails=None):
    """Job secret, shared parameters and every rank's endpoints: under mpi4py three quiet
    collectives (salt and parameters in one Ibcast, then the JSON endpoint records: a MAX of
    their lengths and one Iallgather), none of them busy-polling while ranks still arrive.
    Rank 0's parameters are checked on every rank (check_params) and bound into the secret
    check every rank verifies of every other (secret_check): a rank that read other parameters
    (a store someone else wrote to) fails start-up on every rank with R2commProtocolError."""
    rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
    what = "start-up (waiting for every rank to create its Communicator)"
    mine = dict(chunk_size=cfg.chunk_size, acks=cfg.acks, integrity=cfg.integrity)
    store = hasattr(mpi_comm, "bcast_secret")  # a StoreComm: the salt's key is deleted later
    if store:
        if rank == 0 and not cfg.job_secret and cfg.warn_no_secret:
            _warn_no_secret()
        salt = _share_salt(mpi_comm, rank)
        params = mpi_comm.bcast(mine if rank == 0 else None, root=0)
    else:                                     # parameters every rank must share: rank 0's
        shared = quiet_bcast(mpi_comm, {"salt": os.urandom(SALT_LEN).hex(), "params": mine}
                             if rank == 0 else None, 0, cfg.timeout, what)
        salt, params = _salt_and_params(shared)
    listeners, addrs, detector, record, secret = [], [], None, None, b""
    where = "rails=" if rails is not None else "R2COMM_RAILS"
    try:
        params = check_params(params)
        secret = job_secret(salt, cfg.job_secret)
        addrs = _rails.resolve_all(rails if rails is not None else cfg.rails, where)
        for k, a in enumerate(addrs):
            listeners.append(_rails.listen_on(a, where, k))
        listeners.append(_rails.listen_on(_rails.resolve(cfg.ctrl_addr, "R2COMM_CTRL_ADDR"),
                                          "R2COMM_CTRL_ADDR"))
        if cfg.liveness and size > 1:         # the failure detector's (control/liveness.py)
            detector = liveness.listener(listeners[-1].getsockname()[0])
        kind, devices, why = _transport.offer(cfg.transport, addrs, cfg)
        record = {"rails": [s.getsockname() for s in listeners[:-1]],
                  "transport": (cfg.transport, kind, why),
                  "ctrl": listeners[-1].getsockname(), "host": socket.gethostname(),
                  "host_key": hostid.host_key(), "pid": os.getpid(),
                  "shm": _transport.LOCAL.record(cfg),
                  "params": params, "check": secret_check(secret, rank, params),
                  "detector": detector.getsockname() if detector else None,
                  "fds": fdlimit.own_record()}
    except R2commProtocolError as exc:        # what rank 0 sent, as this rank read it
        record = {"error": f"rank {rank}: {exc}", "protocol": True}
    except (OSError, ValueError) as exc:      # said by every rank below, not only this one
        record = {"error": f"rank {rank}: {exc}"}
    sockets = listeners + ([detector] if detector else [])
    try:
        endpoints = quiet_allgather(mpi_comm, record, cfg.timeout, what)
        _raise_errors(endpoints)
        # every rank read the salt before it published its endpoints: the salt can go
        forget = getattr(mpi_comm, "forget_secrets", None)
        if forget is not None:
            forget()
            if params["integrity"] == "mac" and not cfg.job_secret:
                _warn_store_mac(rank)
        endpoints = validate_endpoints(endpoints, size)
        _same_secret(endpoints, secret, rank, params)
        transport = _transport.decide([ep["transport"] for ep in endpoints])
    except BaseException:
        for s in sockets:
            s.close()
        raise
    job = hashlib.sha256(secret).digest()[:8]
    return Bootstrap(rank, size, secret, job, params, addrs, listeners, transport,
                     devices if transport == kind else None, endpoints, detector)


def _raise_errors(endpoints):
    """The bootstrap errors ranks published instead of their records, raised on every rank:
    R2commProtocolError where one is about what rank 0 sent, else R2commArgumentError."""
    errors = [ep for ep in endpoints if isinstance(ep, dict) and "error" in ep]
    if errors:
        text = "r2comm bootstrap failed: " + "; ".join(str(ep["error"])[:512]
                                                       for ep in errors[:16])
        if any(ep.get("protocol") is True for ep in errors):
            raise R2commProtocolError(text)
        raise R2commArgumentError(text)


def _salt_and_params(shared):
    """The salt and parameters rank 0 broadcast (their values are checked by job_secret and
    check_params, on every rank)."""
    try:
        return bytes.fromhex(shared["salt"]), shared["params"]
    except (KeyError, TypeError, ValueError):
        return None, None


def check_params(params):
    """Rank 0's parameters (they crossed a process boundary, a store maybe) -> a checked copy;
    R2commProtocolError saying what is wrong."""
    try:
        return _params(params)
    except ValueError as exc:
        raise R2commProtocolError(f"r2comm bootstrap: rank 0's parameters are invalid ({exc})"
                                  ) from None


def _params(v):
    if not isinstance(v, dict) or set(v) != {"chunk_size", "acks", "integrity"}:
        raise ValueError("not {chunk_size, acks, integrity}")
    cs, acks, integrity = v["chunk_size"], v["acks"], v["integrity"]
    if not (isinstance(cs, int) and not isinstance(cs, bool) and CHUNK_MIN <= cs <= CHUNK_MAX
            and cs % 8 == 0):
        raise ValueError(f"chunk_size {repr(cs)[:32]} is not a multiple of 8 from {CHUNK_MIN} "
                         f"to {CHUNK_MAX}")
    if not isinstance(acks, bool):
        raise ValueError(f"acks {repr(acks)[:32]} is not a bool")
    if not (isinstance(integrity, str) and integrity in INTEGRITY_MODES):
        raise ValueError(f"integrity {repr(integrity)[:32]} is not one of {INTEGRITY_MODES}")
    return {"chunk_size": cs, "acks": acks, "integrity": integrity}


def job_secret(salt, oob_secret):
    """The job secret: the broadcast salt keyed with the out-of-band secret (b"" if none)."""
    if not isinstance(salt, bytes) or len(salt) != SALT_LEN:
        raise R2commProtocolError(f"r2comm bootstrap: the job salt is not {SALT_LEN} bytes")
    return hmac.new(oob_secret, b"r2comm job secret" + salt, hashlib.sha256).digest()


def secret_check(secret, rank, params):
    """A tag of the job secret, the rank and the parameters it runs with, that every rank
    verifies of every other (_same_secret): whoever lacks the job secret cannot make another
    rank's tag, nor one for other parameters."""
    text = f"{rank}|{params['chunk_size']}|{int(params['acks'])}|{params['integrity']}"
    return hmac.new(secret, b"r2comm secret check|" + text.encode(),
                    hashlib.sha256).hexdigest()[:32]


def _share_salt(comm, rank):
    """Rank 0's random salt on every rank (a StoreComm deletes it later: forget_secrets)."""
    salt = os.urandom(SALT_LEN) if rank == 0 else None
    once = getattr(comm, "bcast_secret", None)
    return once(salt, root=0) if once is not None else comm.bcast(salt, root=0)


_warned = set()       # warnings this process gave once already


def _warn_no_secret():
    """Rank 0 of a store bootstrap without an out-of-band secret: once per process."""
    if "no secret" in _warned:
        return
    _warned.add("no secret")
    msg = ("r2comm: this job starts through a store without an out-of-band secret "
           "(R2COMM_JOB_SECRET_FILE / R2COMM_JOB_SECRET): whoever can read the store during "
           "start-up (torch's TCPStore has no authentication) can derive the job secret, join "
           "as any rank and inject data; give every rank one (README, Security). "
           "R2COMM_WARN_NO_SECRET=0 silences this warning")
    warnings.warn(msg, R2commSecurityWarning, stacklevel=3)
    log.warning(msg)


def _warn_store_mac(rank):
    msg = (f"r2comm rank {rank}: R2COMM_INTEGRITY=mac under a store bootstrap without "
           "R2COMM_JOB_SECRET_FILE / R2COMM_JOB_SECRET: whoever read the store during start-up "
           "can derive every frame key; give the ranks an out-of-band secret (see the README, "
           "Security)")
    warnings.warn(msg, R2commSecurityWarning, stacklevel=3)
    log.warning(msg)


def _same_secret(endpoints, secret, rank, params):
    """Raise on every rank when another rank read other parameters from rank 0
    (R2commProtocolError) or its secret check is not the one this rank derives for it: another
    job secret (out-of-band secrets differ), or parameters someone else forged in its record."""
    other = [r for r, ep in enumerate(endpoints) if ep["params"] != params]
    if other:
        r = other[0]
        raise R2commProtocolError(
            f"r2comm bootstrap: ranks {other[:8]} run with other parameters than rank {rank} "
            f"(rank {r}: {endpoints[r]['params']}, rank {rank}: {params}): what rank 0 sent was "
            "changed on the way (someone else can write to the store?)")
    differ = [r for r, ep in enumerate(endpoints)
              if not hmac.compare_digest(ep["check"], secret_check(secret, r, params))]
    if differ:
        raise R2commArgumentError(
            f"r2comm bootstrap: ranks {differ[:8]} have another job secret than rank {rank} "
            "(or their records were forged): R2COMM_JOB_SECRET_FILE / R2COMM_JOB_SECRET must be "
            "the same on every rank (or unset on every rank)")


def _addr_port(v, what):
    if not (isinstance(v, (tuple, list)) and len(v) == 2 and isinstance(v[0], str)
            and isinstance(v[1], int) and not isinstance(v[1], bool) and 0 < v[1] < 65536):
        raise ValueError(f"{what} is not an (IPv4 address, port) pair")
    try:                                 # dotted-quad IPv4 only (~1 us; ipaddress: ~20 us
        socket.inet_pton(socket.AF_INET, v[0])      # per address, n x rails of them)
    except OSError:
        raise ValueError(f"{what}: {v[0][:64]!r} is not an IPv4 address") from None
    return (v[0], v[1])


def _fd_record(v):
    """[fds open, limit, hard limit] (fdlimit.own_record): three ints."""
    if not (isinstance(v, (list, tuple)) and len(v) == 3 and
            all(isinstance(x, int) and not isinstance(x, bool) and -1 <= x < 1 << 62 for x in v)):
        raise ValueError("fds is not [open, limit, hard limit]")
    return [int(x) for x in v]


def _text(v, what, none_ok=False, limit=4096):
    if (v is None and none_ok) or (isinstance(v, str) and len(v) <= limit):
        return v
    raise ValueError(f"{what} is not a string of at most {limit} characters")


def validate_endpoints(endpoints, size):
    """Every rank's endpoint record checked once (types, addresses, ports, lengths) -> validated
    copies; R2commProtocolError naming the rank otherwise."""
    if not isinstance(endpoints, list) or len(endpoints) != size:
        raise R2commProtocolError(f"r2comm bootstrap: {size} endpoint records expected")
    out = []
    for r, ep in enumerate(endpoints):
        try:
            if not isinstance(ep, dict):
                raise ValueError("not a dict")
            rails = ep["rails"]
            if not isinstance(rails, (list, tuple)) or len(rails) > 64:
                raise ValueError("rails is not a list of at most 64")
            tr = ep["transport"]
            if not (isinstance(tr, (tuple, list)) and len(tr) == 3 and
                    all(x is None or isinstance(x, str) for x in tr)):
                raise ValueError("transport is not (want, can, why)")
            pid = ep["pid"]
            if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 1 << 31:
                raise ValueError("pid is not a process id")
            out.append({"rails": [_addr_port(a, f"rail {k}") for k, a in enumerate(rails)],
                        "transport": tuple(tr), "ctrl": _addr_port(ep["ctrl"], "ctrl"),
                        "host": _text(ep["host"], "host"),
                        "host_key": _text(ep["host_key"], "host_key"), "pid": pid,
                        "shm": _text(ep["shm"], "shm", none_ok=True),
                        "params": _params(ep["params"]),
                        "check": _text(ep["check"], "check", limit=64),
                        "detector": None if ep.get("detector") is None else
                        _addr_port(ep["detector"], "detector"),
                        "fds": _fd_record(ep["fds"])})
        except (KeyError, TypeError, ValueError) as exc:
            raise R2commProtocolError(f"r2comm bootstrap: rank {r}'s endpoint record is "
                                      f"invalid: {exc}") from None
    return out
