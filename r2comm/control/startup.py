"""Start-up on the rails that connect: agreeing on which connections came up.

Links.establish() tries every connection a rank opens (each rail, then the control connection,
to every higher rank) in parallel until the start-up deadline (R2COMM_CONNECT_TIMEOUT) and
reports, per connection, None (up) or why not. agree() exchanges those reports so that every
rank holds the same table (the opener's word decides: it alone knows whether its handshake
finished), and then:

  * a data rail that did not connect starts DOWN for that pair on both ends (Links.settle:
    Engine.links.mark_unconnected, event rail_never_up with the reason) and is probed for fail-back
    like a rail that failed later, so bringing the NIC up re-admits it;
  * the first plan follows the table's NIC facts (facts(): a NIC that the kernel reported down
    or whose rail failed towards two or more other hosts is down for every pair through it,
    other rails that did not connect are pair exceptions; a pair with no common rail is
    relayed around, as after a later failure);
  * check() raises R2commNetworkError, on every rank and with the same message, when a control
    connection did not come up (R2COMM_CTRL_ADDR is wrong or the management network is down:
    that is configuration to fix, not a NIC to route around) or when the rails that came up
    leave the ranks in disconnected groups (a true partition).

No rank busy-polls while it waits: MPI collectives spin, so every wait for the other ranks
here is a non-blocking barrier tested between short sleeps (quiet_barrier)."""
import json
import time

from ..errors import R2commArgumentError, R2commNetworkError, R2commProtocolError, R2commTimeout
from ..transport import CTRL_RAIL, LOCAL

CTRL = "ctrl"          # the control connection's key in a report (transport.CTRL_RAIL on the wire)


def quiet_barrier(mpi_comm, timeout, what):
    """MPI barrier without a busy CPU: Ibarrier, tested between sleeps (_test_quietly).
    Raises R2commTimeout after `timeout` s."""
    if mpi_comm.Get_size() == 1:
        return
    if not hasattr(mpi_comm, "Ibarrier"):    # a store bootstrap (StoreComm) waits quietly itself
        mpi_comm.Barrier()
        return
    _test_quietly(mpi_comm, mpi_comm.Ibarrier(), timeout, what)


NAP_MIN_S, NAP_SHORT_S, NAP_LONG_S = 50e-6, 1e-3, 10e-3   # _test_quietly's sleeps ...
NAP_SHORT_FOR_S = 1.0                                      # ... short for the first second
RECORD_MAX = 1 << 16     # bytes of one rank's JSON record in quiet_allgather / quiet_bcast


def _mpi_quiet(mpi_comm):
    """True for an mpi4py communicator (non-blocking collectives); False for a StoreComm."""
    return hasattr(mpi_comm, "Iallgather")


def _encode(obj):
    data = json.dumps(obj, separators=(",", ":")).encode()
    if len(data) > RECORD_MAX - 4:
        raise R2commArgumentError(f"r2comm start-up: a record of {len(data)} bytes is over "
                                  f"{RECORD_MAX - 4}")
    return data


def _decode(slot, what):
    """One length-prefixed JSON record of an exchange, validated (never unpickled)."""
    n = int.from_bytes(bytes(slot[:4]), "little")
    if n > len(slot) - 4:
        raise R2commProtocolError(f"r2comm start-up: {what}: a record claims {n} bytes, "
                                  f"{len(slot) - 4} arrived")
    try:
        return json.loads(bytes(slot[4:4 + n]))
    except (ValueError, RecursionError) as exc:
        raise R2commProtocolError(f"r2comm start-up: {what}: a record is not JSON: "
                                  f"{exc}") from None


def _slot(data, width):
    import numpy as np
    buf = np.zeros(width, np.uint8)
    buf[:4] = np.frombuffer(len(data).to_bytes(4, "little"), np.uint8)
    buf[4:4 + len(data)] = np.frombuffer(data, np.uint8)
    return buf


def quiet_bcast(mpi_comm, obj, root, timeout, what, width=4096):
    """Root's JSON-able `obj` on every rank, without a busy CPU (Ibcast of one length-prefixed
    JSON record, tested between sleeps); a StoreComm's bcast otherwise."""
    if not _mpi_quiet(mpi_comm) or mpi_comm.Get_size() == 1:
        return mpi_comm.bcast(obj, root=root)
    data = _encode(obj) if mpi_comm.Get_rank() == root else b""
    if len(data) > width - 4:
        raise R2commArgumentError(f"r2comm start-up: {what}: {len(data)} bytes to broadcast")
    buf = _slot(data, width)
    from mpi4py import MPI
    _test_quietly(mpi_comm, mpi_comm.Ibcast([buf, MPI.BYTE], root=root), timeout, what)
    return _decode(buf, what)


def quiet_allgather(mpi_comm, obj, timeout, what):
    """Every rank's JSON-able `obj` (a list, rank order), without a busy CPU: a quiet MAX of the
    records' lengths, then one Iallgather of that width (each rank's memory: n x the longest
    record); a StoreComm's allgather otherwise. JSON turns tuples into lists."""
    if not _mpi_quiet(mpi_comm) or mpi_comm.Get_size() == 1:
        return mpi_comm.allgather(obj)
    import numpy as np
    from mpi4py import MPI
    data = _encode(obj)
    mine, most = np.array([len(data) + 4], np.int64), np.zeros(1, np.int64)
    _test_quietly(mpi_comm, mpi_comm.Iallreduce(mine, most, op=MPI.MAX), timeout, what)
    width = int(most[0])
    if not 4 <= width <= RECORD_MAX:
        raise R2commProtocolError(f"r2comm start-up: {what}: record width {width}")
    rows = np.zeros((mpi_comm.Get_size(), width), np.uint8)
    _test_quietly(mpi_comm, mpi_comm.Iallgather([_slot(data, width), MPI.BYTE],
                                                [rows, MPI.BYTE]), timeout, what)
    blob = rows.tobytes()                 # one copy; each record sliced from it as bytes
    return [_decode(blob[i:i + width], what) for i in range(0, len(blob), width)]


def _test_quietly(mpi_comm, req, timeout, what):
    """Test MPI request `req` between sleeps (50 us growing to 1 ms for a second, then to
    10 ms) until it completes; R2commTimeout after `timeout` s."""
    start = time.monotonic()
    deadline = start + timeout
    nap = NAP_MIN_S
    while not req.Test():
        now = time.monotonic()
        if now > deadline:
            raise R2commTimeout(f"rank {mpi_comm.Get_rank()}: {what}: the other ranks did not "
                                f"arrive within {timeout:.0f} s")
        time.sleep(nap)
        # MPI's non-blocking collectives progress only inside Test: every round of one waits
        # for the partner's next Test, so the naps stay short while the others are busy with
        # the same start-up, and grow long only for a rank that waits for late ones
        nap = min(nap * 1.5, NAP_SHORT_S if now - start < NAP_SHORT_FOR_S else NAP_LONG_S)


class StartOutcome:
    """The agreed start-up table, identical on every rank.

    failed[(a, b, rail)] = why the connection between ranks a < b did not come up (rail: a data
    rail index, or CTRL); nrails[a][b]: the data rails of that pair (None: read from the
    endpoints when asked, so that a healthy start-up costs O(1) here, not O(n^2));
    addrs[r]: rank r's endpoints (bootstrap)."""

    def __init__(self, size, nrails, failed, endpoints, rail_addrs, kernel_down=None):
        self.size = size
        self.nrails = nrails
        self._pair_rails = {}
        self.probe_bytes = None               # agree(): the start-up probe's message size
        self.failed = failed
        self.kernel_down = kernel_down or {}  # rank -> its rails whose NIC the kernel said down
        self.endpoints = endpoints
        self.rail_addrs = rail_addrs          # per rank: its local rail addresses (None: the
                                              # endpoints' own, read where a message names one)

    def rail_up(self, a, b, k):
        lo, hi = min(a, b), max(a, b)
        return (lo, hi, k) not in self.failed

    def down_rails(self):
        """[(a, b, rail, reason)] of data rails that did not connect (a < b)."""
        return sorted((a, b, k, why) for (a, b, k), why in self.failed.items() if k != CTRL)

    def healthy(self):
        return not self.failed

    def describe(self, a, b, k):
        """'rail 1 (198.18.1.1 -> 198.18.1.2:4711)' or 'control connection (...)'."""
        if k == CTRL:
            addr, port = self.endpoints[b]["ctrl"]
            return f"control connection (R2COMM_CTRL_ADDR, to {addr}:{port})"
        if LOCAL.is_local(self.endpoints, a, b):
            addr, port = self.endpoints[b]["ctrl"]
            return f"{LOCAL.title} (set up through {addr}:{port})"
        addr, port = self.endpoints[b]["rails"][k]
        mine = self.rail_addrs[a][k] if self.rail_addrs is not None else \
            self.endpoints[a]["rails"][k][0]
        return f"rail {k} ({mine} -> {addr}:{port})"

    def _lines(self, keys):
        return "; ".join(f"rank {a} - rank {b}: {self.describe(a, b, k)}: {self.failed[(a, b, k)]}"
                         for (a, b, k) in keys)

    def connected_groups(self):
        """Groups of ranks connected by working pairs (a pair works with one common rail)."""
        from ..planner.state import connected_components
        return connected_components(self.size, self.pair_ok)

    def pair_ok(self, a, b):
        lo, hi = min(a, b), max(a, b)
        return any(self.rail_up(lo, hi, k) for k in range(self.rails_of(lo, hi)))

    def rails_of(self, a, b):
        """The data rails between ranks a and b."""
        if self.nrails is not None:
            return self.nrails[a][b]
        key = (min(a, b), max(a, b))
        if key not in self._pair_rails:
            self._pair_rails[key] = LOCAL.data_rails(self.endpoints, *key)
        return self._pair_rails[key]

    def check(self, connect_timeout):
        """Raise R2commNetworkError (every rank computes the same) when a control connection
        failed or the working rails do not connect every rank."""
        ctrl = sorted(key for key in self.failed if key[2] == CTRL)
        if ctrl:
            raise R2commNetworkError(
                f"r2comm start-up: control connections did not come up within "
                f"{connect_timeout:g} s (R2COMM_CONNECT_TIMEOUT); each pair of ranks needs one on "
                f"the management network (R2COMM_CTRL_ADDR): {self._lines(ctrl)}")
        if not any(k != CTRL for (_, _, k) in self.failed):
            return                        # every data rail tried came up: one group
        groups = self.connected_groups()
        if len(groups) > 1:
            broken = [(a, b) for a in range(self.size) for b in range(a + 1, self.size)
                      if not self.pair_ok(a, b)]
            keys = sorted(key for key in self.failed if (key[0], key[1]) in broken)
            raise R2commNetworkError(
                f"r2comm start-up: the rails that connected within {connect_timeout:g} s leave the "
                f"ranks in disconnected groups {groups} (no path between ranks "
                f"{', '.join(f'{a} and {b}' for a, b in broken)}): {self._lines(keys)}")

    def facts(self, host_of, nrails):
        """The NIC facts of this table ({key: facts.Fact}, the same on every rank; facts.py):
        a NIC the kernel reported down, or whose rail failed towards two or more other hosts,
        is down for every pair through it; other failed rails are pair exceptions. O(failures),
        never a table over every pair. host_of: the fact host of every rank (facts.fact_hosts);
        nrails: the most rails a rank lists."""
        from . import facts
        data = {key: why for key, why in self.failed.items() if key[2] != CTRL}
        return facts.startup_facts(data, host_of, self.kernel_down, nrails)


def quiet_max(mpi_comm, values, timeout, what):
    """The element-wise maximum over ranks of a few ints, without a busy CPU (Iallreduce
    tested between sleeps, as quiet_barrier); a store bootstrap: a barrier, then None."""
    if mpi_comm.Get_size() == 1:
        return list(values)
    if not hasattr(mpi_comm, "Iallreduce"):
        quiet_barrier(mpi_comm, timeout, what)
        return None
    import numpy as np
    from mpi4py import MPI
    mine, out = np.array(values, np.int64), np.zeros(len(values), np.int64)
    _test_quietly(mpi_comm, mpi_comm.Iallreduce(mine, out, op=MPI.MAX), timeout, what)
    return [int(v) for v in out]


KERNEL = -1           # a report's peer for "the kernel says this rank's NIC is down"


def agree(mpi_comm, boot, outcome, timeout, probe_bytes=0, nic_down=()):
    """Exchange every rank's Links.establish() report (quietly) -> the same StartOutcome on
    every rank. outcome: {(peer, rail): None or reason} for the connections this rank opened,
    rail CTRL_RAIL for the control connection; nic_down: this rank's rails whose NIC the
    kernel reports down (or an injected start=1 fault darkens). One quiet reduction of the
    failure counts (and of probe_bytes: the start-up probe's message size,
    StartOutcome.probe_bytes, the largest any rank asked for; None where unknown, a store
    bootstrap); the reports themselves travel only when something failed somewhere, and are
    validated on arrival."""
    mine = {(p, CTRL if k == CTRL_RAIL else k): why
            for (p, k), why in outcome.items() if why is not None}
    for k in nic_down:
        mine[(KERNEL, int(k))] = "the kernel reports the NIC down"
    failed, kernel = {}, {}
    most = quiet_max(mpi_comm, [len(mine), probe_bytes], timeout,
                     "start-up (waiting for the other ranks' connections)")
    eps = boot.endpoints
    if most is None or most[0] != 0:
        for a, rep in enumerate(mpi_comm.allgather(mine)):
            if type(rep) is dict and not rep:
                continue                          # (most ranks: nothing failed)
            for (b, k), why in _checked_report(a, rep, eps):
                if b == KERNEL:
                    kernel.setdefault(a, []).append(k)
                else:
                    failed[(a, b, k)] = why
    start = StartOutcome(len(eps), None, failed, eps, None, kernel)
    start.probe_bytes = None if most is None else most[1]
    return start


def _checked_report(a, rep, eps):
    """Rank a's start-up report, validated (it crossed a process boundary): [((peer, rail),
    why)] with peer a higher rank (the opener reports) or KERNEL, rail one of that pair's data
    rails (or of rank a's, for KERNEL) or CTRL, why a short string."""
    n = len(eps)
    if not isinstance(rep, dict) or len(rep) > 4 * (n + 1) * 64:
        raise R2commProtocolError(f"r2comm start-up: rank {a}'s report is malformed")
    out = []
    for key, why in rep.items():
        ok = isinstance(key, (tuple, list)) and len(key) == 2 and isinstance(why, str) and \
            len(why) <= 4096
        if ok:
            b, k = key
            rail = type(k) is int and 0 <= k < len(eps[a]["rails"])
            ok = type(b) is int and (rail if b == KERNEL else
                                     a < b < n and (rail or k == CTRL))
        if not ok:
            raise R2commProtocolError(f"r2comm start-up: rank {a}'s report names "
                                      f"{str(key)[:80]!r}: not one of its connections")
        out.append(((b, k), why))
    return out
