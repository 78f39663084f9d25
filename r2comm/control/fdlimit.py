"""File descriptors at start-up (issue 31).

A rank connects at start-up only to its ring neighbours and its local peers (links.start_peers):
per peer one socket per common data rail plus the control connection (a shared-memory peer: its
doorbell and the control connection); a rail holds its kind's rail_fds (a verbs rail adds its
completion channel and its epoll fd to the socket kept beside the queue pair); the failure detector (liveness.py) holds
DETECTOR_FDS more. Plans connect more peers on first use (links.connect_for), bounded by the
peers of the plans a rank runs (O(1) for ring plans, O(log n) for tree and halving ones; an
alltoall or point-to-point to every peer reaches the full mesh), so fds_needed is the start-up
figure, not a bound for the whole run: each first use checks its own room (Links.connect_for). Before connecting each rank

  * raises its soft RLIMIT_NOFILE to the hard limit (once per process, raise_soft_limit), and
  * publishes the fds it holds and its limits in its endpoint record (own_record); from the
    records every rank judges every rank's start-up budget alike (check: no collective): above
    WARN_FRACTION rank 0 logs a warning, above the limit every rank raises R2commResourceError
    with the same message, instead of EMFILE in some rank's connection attempt."""
import logging
import resource

from . import liveness
from .. import transport
from .links import open_fds, start_peers
from ..errors import R2commResourceError

log = logging.getLogger("r2comm")
WARN_FRACTION = 0.8      # warn when a rank would hold more than this share of its fd limit
DETECTOR_FDS = liveness.STEADY_FDS   # the failure detector (control/liveness.py)
NR_OPEN_FALLBACK = 1 << 20

_limits = None           # (soft before, soft now, hard) once raise_soft_limit ran


def raise_soft_limit():
    """Lift the soft RLIMIT_NOFILE to the hard limit, once per process -> (soft before, soft
    now, hard). An unlimited hard limit lifts it to the kernel's nr_open."""
    global _limits
    if _limits is None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = hard if hard != resource.RLIM_INFINITY else _nr_open()
        now = soft
        if soft != resource.RLIM_INFINITY and soft < target:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                now = target
            except (ValueError, OSError) as exc:
                log.debug("r2comm: could not raise RLIMIT_NOFILE to %d: %s", target, exc)
        _limits = (soft, now, hard)
    return _limits


def _nr_open():
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return NR_OPEN_FALLBACK


def connection_fds(endpoints, me, kind, groups=None):
    """The fds rank `me` holds for its connections once start-up is done (endpoints: the
    bootstrap's, kind: the NIC rails' kind, its name): its start-up peers' and the
    detector's."""
    per_rail = transport.kind_of(kind).rail_fds
    n = len(endpoints)
    if n < 2:
        return 0
    local = (groups if groups is not None else transport.LOCAL.local_groups(endpoints)).get(me, ())
    total = DETECTOR_FDS
    for peer in {(me - 1) % n, (me + 1) % n, *local} - {me}:    # links.start_peers
        rails = transport.LOCAL.data_rails(endpoints, me, peer)
        total += 1 + (rails if peer in local else rails * per_rail)
    return total


def fds_needed(endpoints, me, kind):
    """What this rank will hold: the fds it has open now plus its connections."""
    return open_fds() + connection_fds(endpoints, me, kind)


def own_record():
    """[fds open now, the soft limit once raised, the hard limit] for this rank's endpoint
    record (bootstrap): every rank judges every rank's budget from these, with no collective."""
    _, limit, hard = raise_soft_limit()
    cap = limit if limit != resource.RLIM_INFINITY else NR_OPEN_FALLBACK
    return [open_fds(), int(cap), int(hard)]


def check(endpoints, kind, me):
    """The fd budget before the start-up connections, judged alike on every rank from the
    endpoint records' "fds" (own_record): a warning (rank 0) when a rank would hold more than
    WARN_FRACTION of its limit, R2commResourceError on every rank when one would hold more than
    its limit. O(n) arithmetic per rank, no messages. Returns (ratio, need, cap, hard, rank)."""
    groups = transport.LOCAL.local_groups(endpoints)
    worst = (0.0, 0, 0, 0, 0)
    for r, ep in enumerate(endpoints):
        opened, cap, hard = ep["fds"]
        need = opened + connection_fds(endpoints, r, kind, groups)
        worst = max(worst, (need / max(cap, 1), need, cap, hard, r))
    ratio, need, cap, hard, rank = worst
    if ratio > 1.0:
        raise R2commResourceError(
            f"r2comm start-up: rank {rank} would hold about {need} file descriptors "
            f"({len(start_peers(endpoints, rank))} peers connected at start-up, on every rail and "
            f"for control, and the failure detector), "
            f"over its limit of {cap} (RLIMIT_NOFILE; r2comm lifts the soft limit to the hard "
            f"one, {_show(hard)}): raise the hard limit (`ulimit -n` / `ulimit -Hn`, limits.conf or the "
            f"launcher's), or run fewer ranks or rails")
    if ratio > WARN_FRACTION and me == 0:
        log.warning("r2comm: rank %d will hold about %d file descriptors, %.0f%% of its limit "
                    "of %d (RLIMIT_NOFILE, hard limit %s): more sockets (fail-back, user files) "
                    "may fail with EMFILE; raise `ulimit -n`", rank, need, ratio * 100, cap,
                    _show(hard))
    return worst


def _show(limit):
    return "unlimited" if limit == resource.RLIM_INFINITY else str(limit)
