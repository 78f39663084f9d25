"""Every environment variable r2comm reads, in one place."""
import os
from dataclasses import dataclass, field


def _parsed(name, default, conv, kind):
    """The variable converted by conv, default when unset; a bad value names the variable."""
    v = os.environ.get(name)
    if v in (None, ""):
        return default
    try:
        return conv(v)
    except (TypeError, ValueError):
        from .errors import R2commArgumentError
        raise R2commArgumentError(f"{name}={v!r}: expected {kind}") from None


def _int(name, default):
    return _parsed(name, default, int, "an integer")


def _float(name, default):
    return _parsed(name, default, float, "a number")


def _bytes(name, default):
    """A byte count from the environment (K/M/G suffixes), at least 0; default when unset."""
    return max(_parsed(name, default, _size, "a byte count such as 65536, 64K or 4M"), 0)


def _floats(name):
    return _parsed(name, [], lambda v: [float(x) for x in v.split(",") if x.strip()],
                   "comma-separated numbers")


def _size(text):
    text = text.strip().upper()
    mult = 1
    for suffix, m in (("KIB", 1 << 10), ("MIB", 1 << 20), ("GIB", 1 << 30),
                      ("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if text.endswith(suffix):
            text, mult = text[: -len(suffix)], m
            break
    return int(float(text) * mult)


@dataclass
class Config:
    rails: list = field(default_factory=list)      # R2COMM_RAILS: addresses or interface names
    ctrl_addr: str = "127.0.0.1"                   # R2COMM_CTRL_ADDR: control/management address
    timeout: float = 60.0                          # R2COMM_TIMEOUT (s): every blocking wait
    connect_timeout: float = 5.0                   # R2COMM_CONNECT_TIMEOUT (s): start-up bound on
                                                   #   connecting the rails; a rail not up by then
                                                   #   starts down and is probed for fail-back
    chunk_size: int = 512 << 10                    # R2COMM_CHUNK_SIZE (bytes, K/M suffixes)
    rail_timeout_ms: float = 500.0                 # R2COMM_RAIL_TIMEOUT_MS: silent-stall deadline
    peer_timeout_ms: float = 1500.0                # R2COMM_PEER_TIMEOUT_MS: all rails down -> error
    window: int = 16 << 20                         # R2COMM_WINDOW: unacknowledged bytes per rail
    eager: int = 64 << 10                          # R2COMM_EAGER: sends up to this size are copied
    rail_bw: list = field(default_factory=list)    # R2COMM_RAIL_BW: relative bandwidth per rail
    probe_ms: float = 100.0                        # R2COMM_PROBE_MS: first fail-back probe delay
    probe_max_ms: float = 5000.0                   # R2COMM_PROBE_MAX_MS: longest (flapping) delay
    fault: str = ""                                # R2COMM_FAULT: fault injection spec(s)
    debug: str = ""                                # R2COMM_DEBUG: INFO logs failover events
    algo: str = ""                                 # R2COMM_ALGO: force an algorithm
    acks: bool = True                              # R2COMM_ACKS=0: benchmark only, no loss protection
    replan_auto: bool = True                       # R2COMM_REPLAN=auto (default): plans follow
                                                   #   the NIC facts by themselves (replan.py)
    replan_every: int = 0                          # R2COMM_REPLAN=K: check every K ops instead;
                                                   #   R2COMM_REPLAN=0: neither (replan() only)
    bw_probe: int = 1 << 20                        # R2COMM_PROBE: start-up probe message bytes, 0 off
    bw_probe_set: bool = False                     # R2COMM_PROBE given (else: off on loopback rails)
    hedge: int = -1                                # R2COMM_HEDGE: tail copies on another rail;
                                                   #   0 never, 1 for quiet rails, 2 also slow
                                                   #   ones; -1: 2, or 1 on loopback-only rails
    sockbuf: int = 4 << 20                         # R2COMM_SOCKBUF: SO_RCVBUF of a rail, 0 autotune
    notsent_lowat: int = 64 << 10                  # R2COMM_NOTSENT_LOWAT: unsent bytes a rail's
                                                   #   socket holds (TCP_NOTSENT_LOWAT), 0 off
    window_ms: float = 150.0                       # R2COMM_WINDOW_MS: a rail's window, in ms of
                                                   #   its measured throughput (cap: R2COMM_WINDOW)
    integrity: str = "checksum"                    # R2COMM_INTEGRITY: checksum (header FNV-1a) or
                                                   #   mac (Poly1305 per frame); rank 0's wins
    spin_us: float = -1.0                          # R2COMM_SPIN_US: busy-poll before blocking;
                                                   #   -1: 1000, or 50 on an oversubscribed host
    agree: bool = True                             # R2COMM_AGREE=0: no agreement exchange in
                                                   #   Bcast/Reduce (faster; a root or leaf may
                                                   #   return before a mismatch is seen); the same
                                                   #   on every rank
    transport: str = "tcp"                         # R2COMM_TRANSPORT: tcp, verbs or auto (verbs
                                                   # where every rail has an RDMA device)
    verbs_zcopy: bool = True                       # R2COMM_VERBS_ZCOPY: verbs rails send large
                                                   #   user buffers straight from their pages
                                                   #   (registered on first use); 0: all copied
    verbs_reg_cache: int = 1 << 30                 # R2COMM_VERBS_REG_CACHE: user memory kept
                                                   #   registered (pinned), bytes per device
    verbs_recv_slots: int = 64                     # R2COMM_VERBS_RECV_SLOTS: 64 KiB receive
                                                   #   slots per RDMA device (its shared receive
                                                   #   queue), whatever the number of peers
    verbs_send_slots: int = 32                     # R2COMM_VERBS_SEND_SLOTS: 64 KiB send slots
                                                   #   per RDMA device
    verbs_conn_send_slots: int = 16                # R2COMM_VERBS_CONN_SEND_SLOTS: of which one
                                                   #   connection holds at most this many
    verbs_reg_min: int = 64 << 10                  # R2COMM_VERBS_REG_MIN: smaller buffers are
                                                   #   never registered (copied)
    gpu_staging: int = 32 << 20                    # R2COMM_GPU_STAGING: pinned host memory of the
                                                   #   device-buffer staging pool (bytes, per
                                                   #   process and device backend; >= 2 slots)
    gpu_segment: int = 2 << 20                     # R2COMM_GPU_SEGMENT: bytes of a device buffer
                                                   #   per pipeline segment; the same on every rank
    gpu_reduce: str = "device"                     # R2COMM_GPU_REDUCE: device (reduction kernels
                                                   #   on the GPU: all-to-all, reduce, all-gather)
                                                   #   or host (the engine reduces the pinned
                                                   #   copies); the same on every rank
    shm: bool = True                               # R2COMM_SHM=0: local peers over TCP too; else
                                                   #   ranks on one host (r2comm.control.hostid) talk
                                                   #   through shared memory (r2comm/transport/shm.py)
    shm_ring: int = 4 << 20                        # R2COMM_SHM_RING: bytes per direction of a
                                                   #   shared-memory link (a power of two)
    job_secret: bytes = field(default=b"", repr=False)  # R2COMM_JOB_SECRET_FILE / R2COMM_JOB_SECRET:
                                                   #   a secret given to every rank out of band,
                                                   #   mixed into every key (bootstrap.py)
    warn_no_secret: bool = True                    # R2COMM_WARN_NO_SECRET=0: no warning when a
                                                   #   store bootstrap runs without job_secret
    liveness: bool = True                          # R2COMM_LIVENESS=0: no failure detector
                                                   #   (r2comm/control/liveness.py)
    liveness_period_ms: float = 200.0              # R2COMM_LIVENESS_PERIOD_MS: heartbeat period
    liveness_suspect_ms: float = 2000.0            # R2COMM_LIVENESS_SUSPECT_MS: a ring neighbour
                                                   #   silent this long is suspected and probed
    liveness_frozen_ms: float = 60000.0            # R2COMM_LIVENESS_FROZEN_MS: a process whose
                                                   #   kernel answers but that stays silent
                                                   #   (stopped) is declared dead after this;
                                                   #   0: as soon as the suspicion is confirmed

    @classmethod
    def from_env(cls):
        c = cls()
        rails = os.environ.get("R2COMM_RAILS", "")
        c.rails = [r.strip() for r in rails.split(",") if r.strip()]
        c.ctrl_addr = os.environ.get("R2COMM_CTRL_ADDR", c.ctrl_addr) or c.ctrl_addr
        c.timeout = _float("R2COMM_TIMEOUT", c.timeout)
        c.connect_timeout = _float("R2COMM_CONNECT_TIMEOUT", c.connect_timeout)
        if not c.connect_timeout > 0:
            from .errors import R2commArgumentError
            raise R2commArgumentError(f"R2COMM_CONNECT_TIMEOUT={c.connect_timeout}: must be > 0 "
                                      "(seconds)")
        c.chunk_size = _bytes("R2COMM_CHUNK_SIZE", c.chunk_size)
        c.chunk_size = max(CHUNK_MIN, min(c.chunk_size, CHUNK_MAX)) // 8 * 8   # whole elements
        c.rail_timeout_ms = _float("R2COMM_RAIL_TIMEOUT_MS", c.rail_timeout_ms)
        c.peer_timeout_ms = _float("R2COMM_PEER_TIMEOUT_MS", c.peer_timeout_ms)
        c.window = _bytes("R2COMM_WINDOW", c.window)
        c.eager = _bytes("R2COMM_EAGER", c.eager)
        c.rail_bw = _floats("R2COMM_RAIL_BW")
        c.probe_ms = _float("R2COMM_PROBE_MS", c.probe_ms)
        c.probe_max_ms = _float("R2COMM_PROBE_MAX_MS", c.probe_max_ms)
        c.fault = os.environ.get("R2COMM_FAULT", "")
        c.debug = os.environ.get("R2COMM_DEBUG", "").upper()
        c.algo = os.environ.get("R2COMM_ALGO", "")
        c.acks = os.environ.get("R2COMM_ACKS", "1") != "0"
        mode = os.environ.get("R2COMM_REPLAN", "").strip().lower()
        c.replan_auto = mode in ("", "auto")
        c.replan_every = 0 if c.replan_auto else _int("R2COMM_REPLAN", 0)
        if c.replan_every < 0:
            from .errors import R2commArgumentError
            raise R2commArgumentError(f"R2COMM_REPLAN={mode!r}: 'auto' (the default), 0 (off) "
                                      "or a number of operations K > 0")
        c.bw_probe = _bytes("R2COMM_PROBE", c.bw_probe)
        c.bw_probe_set = os.environ.get("R2COMM_PROBE") not in (None, "")
        c.hedge = _int("R2COMM_HEDGE", c.hedge)
        if c.hedge not in (-1, 0, 1, 2):
            from .errors import R2commArgumentError
            raise R2commArgumentError(f"R2COMM_HEDGE={c.hedge}: must be 0, 1 or 2")
        c.sockbuf = _bytes("R2COMM_SOCKBUF", c.sockbuf)
        c.spin_us = _float("R2COMM_SPIN_US", c.spin_us)
        c.notsent_lowat = _bytes("R2COMM_NOTSENT_LOWAT", c.notsent_lowat)
        c.integrity = (os.environ.get("R2COMM_INTEGRITY", "") or c.integrity).strip().lower()
        if c.integrity not in INTEGRITY_MODES:
            from .errors import R2commArgumentError
            raise R2commArgumentError(f"R2COMM_INTEGRITY={c.integrity!r}: must be checksum or mac")
        c.window_ms = _float("R2COMM_WINDOW_MS", c.window_ms)
        c.agree = os.environ.get("R2COMM_AGREE", "1") != "0"
        c.transport = (os.environ.get("R2COMM_TRANSPORT", "") or c.transport).strip().lower()
        if c.transport not in ("tcp", "verbs", "auto"):
            from .errors import R2commArgumentError
            raise R2commArgumentError(f"R2COMM_TRANSPORT={c.transport!r}: must be tcp, verbs or "
                                      "auto")
        c.verbs_zcopy = os.environ.get("R2COMM_VERBS_ZCOPY", "1").strip() != "0"
        c.verbs_reg_cache = _bytes("R2COMM_VERBS_REG_CACHE", c.verbs_reg_cache)
        c.verbs_reg_min = max(16 << 10, _bytes("R2COMM_VERBS_REG_MIN", c.verbs_reg_min))
        c.verbs_recv_slots = _int("R2COMM_VERBS_RECV_SLOTS", c.verbs_recv_slots)
        c.verbs_send_slots = _int("R2COMM_VERBS_SEND_SLOTS", c.verbs_send_slots)
        c.verbs_conn_send_slots = min(c.verbs_send_slots, _int("R2COMM_VERBS_CONN_SEND_SLOTS",
                                                               c.verbs_conn_send_slots))
        if c.verbs_recv_slots < 2 or c.verbs_send_slots < 1 or c.verbs_conn_send_slots < 1:
            from .errors import R2commArgumentError
            raise R2commArgumentError(
                f"R2COMM_VERBS_RECV_SLOTS={c.verbs_recv_slots} (at least 2), "
                f"R2COMM_VERBS_SEND_SLOTS={c.verbs_send_slots} (at least 1), "
                f"R2COMM_VERBS_CONN_SEND_SLOTS={c.verbs_conn_send_slots} (at least 1)")
        c.gpu_staging = _bytes("R2COMM_GPU_STAGING", c.gpu_staging)
        c.gpu_segment = _bytes("R2COMM_GPU_SEGMENT", c.gpu_segment)
        if c.gpu_segment < 4096:
            from .errors import R2commArgumentError
            raise R2commArgumentError(f"R2COMM_GPU_SEGMENT={c.gpu_segment}: must be >= 4096 bytes")
        c.gpu_reduce = (os.environ.get("R2COMM_GPU_REDUCE", "") or c.gpu_reduce).strip().lower()
        if c.gpu_reduce not in ("device", "host"):
            from .errors import R2commArgumentError
            raise R2commArgumentError(f"R2COMM_GPU_REDUCE={c.gpu_reduce!r}: must be device or host")
        c.job_secret = job_secret_from_env()
        c.warn_no_secret = os.environ.get("R2COMM_WARN_NO_SECRET", "1").strip() != "0"
        c.shm = os.environ.get("R2COMM_SHM", "1").strip() != "0"
        c.shm_ring = _bytes("R2COMM_SHM_RING", c.shm_ring)
        if c.shm_ring < 4096 or c.shm_ring & (c.shm_ring - 1) or c.shm_ring > 1 << 30:
            from .errors import R2commArgumentError
            raise R2commArgumentError(f"R2COMM_SHM_RING={c.shm_ring}: must be a power of two "
                                      "between 4096 and 1 GiB (bytes, K/M suffixes)")
        if c.window_ms <= 0:
            from .errors import R2commArgumentError
            raise R2commArgumentError(f"R2COMM_WINDOW_MS={c.window_ms}: must be > 0")
        c.liveness = os.environ.get("R2COMM_LIVENESS", "1").strip() != "0"
        c.liveness_period_ms = _float("R2COMM_LIVENESS_PERIOD_MS", c.liveness_period_ms)
        c.liveness_suspect_ms = _float("R2COMM_LIVENESS_SUSPECT_MS", c.liveness_suspect_ms)
        c.liveness_frozen_ms = _float("R2COMM_LIVENESS_FROZEN_MS", c.liveness_frozen_ms)
        if not 0 < c.liveness_period_ms < c.liveness_suspect_ms or c.liveness_frozen_ms < 0:
            from .errors import R2commArgumentError
            raise R2commArgumentError(
                f"R2COMM_LIVENESS_PERIOD_MS={c.liveness_period_ms:g}, R2COMM_LIVENESS_SUSPECT_MS="
                f"{c.liveness_suspect_ms:g}, R2COMM_LIVENESS_FROZEN_MS={c.liveness_frozen_ms:g}: "
                "need 0 < period < suspect and frozen >= 0")
        return c


CHUNK_MIN, CHUNK_MAX = 4096, 64 << 20   # bytes: the chunk sizes a job may run with
INTEGRITY_MODES = ("checksum", "mac")
JOB_SECRET_MIN = 16         # bytes: shorter out-of-band secrets are refused (guessable offline)


def job_secret_from_env():
    """The out-of-band job secret: the bytes of R2COMM_JOB_SECRET_FILE or of R2COMM_JOB_SECRET
    (surrounding whitespace dropped), b"" when neither is set."""
    from .errors import R2commArgumentError
    path = os.environ.get("R2COMM_JOB_SECRET_FILE", "").strip()
    text = os.environ.get("R2COMM_JOB_SECRET", "")
    if path and text:
        raise R2commArgumentError("R2COMM_JOB_SECRET_FILE and R2COMM_JOB_SECRET are both set: "
                                  "set one")
    if path:
        try:
            with open(path, "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                secret = f.read(1 << 16).strip()
        except OSError as exc:
            raise R2commArgumentError(f"R2COMM_JOB_SECRET_FILE={path!r}: {exc}") from None
        if mode & 0o077:
            import warnings
            warnings.warn(f"r2comm: R2COMM_JOB_SECRET_FILE {path} can be read by other users "
                          f"(mode {mode & 0o777:o}); make it 0600", stacklevel=3)
        what = f"R2COMM_JOB_SECRET_FILE={path!r}"
    elif text:
        secret, what = text.strip().encode(), "R2COMM_JOB_SECRET"
    else:
        return b""
    if len(secret) < JOB_SECRET_MIN:
        raise R2commArgumentError(f"{what}: the job secret has {len(secret)} bytes; at least "
                                  f"{JOB_SECRET_MIN} are needed (e.g. 32 random bytes, hex)")
    return secret
