"""A collective's call descriptor and its compiled plan.

Every DATA frame of a collective carries, besides the comm id and the sequence number, what its
sender called, so that the first frame that disagrees is caught by an integer compare in the
engine (check_match) and both sides can be named in the error:
  header.aux = kind & 7 (bits 0-2) | non-blocking (bit 3) | root (bits 4-19, 0xFFFF: >= 65535)
               | kind >> 3 (bits 20-21) | 10-bit hash of the rest of the plan (bits 22-31:
               algorithm, size, sizes; a vector collective's counts where every rank knows them)
  header.count = element count (low 32 bits)     header.dtype, header.redop as before

Rooted collectives (Bcast, Reduce) leave ranks that hear from nobody (a Bcast root, a Reduce
leaf): their data alone cannot tell them that the others called the same thing. They get an
agreement: header-only frames that carry the descriptor over a binary tree in rank order (rank
r's parent (r - 1) // 2), a fan-in to rank 0 (a rank's frame to its parent gated on its
children's) then a fan-out (a rank's frames to its children gated on its parent's), so every
rank hears, through a checked chain, from every other rank before its call returns (no rank
leaves before all arrived), and a rank whose call differs fails a neighbour's compare; the abort
travels along the connections the plans made (failover.pxi relay_abort). Each rank exchanges
with at most 3 peers (2 * depth dependent steps), so the connections the agreement adds do not
grow with n (issue 31). The other collectives need none: every rank's result already depends on
a frame from every rank."""
import zlib

from .. import planner
from ..planner import vector
from ..planner.schedule import WORK, COPY

KINDS = {"allreduce": 1, "reduce": 2, "bcast": 3, "allgather": 4, "reduce_scatter_block": 5,
         "alltoall": 6, "barrier": 7, "gather": 8, "scatter": 9, "gatherv": 10, "scatterv": 11,
         "allgatherv": 12, "alltoallv": 13, "reduce_scatter": 14, "scan": 15, "exscan": 16}
KIND_NAMES = {1: "Allreduce", 2: "Reduce", 3: "Bcast", 4: "Allgather",
              5: "Reduce_scatter_block", 6: "Alltoall", 7: "Barrier", 8: "Gather", 9: "Scatter",
              10: "Gatherv", 11: "Scatterv", 12: "Allgatherv", 13: "Alltoallv",
              14: "Reduce_scatter", 15: "Scan", 16: "Exscan"}
NONBLOCKING = 8
# A communicator's sequence numbers are uint32 on the wire and wrap: the engine compares them
# modulo 2**32 (engine_state.pxi: seq_before), so call 2**32 follows call 2**32 - 1 as any other.
SEQ_MASK = 0xFFFFFFFF
AGREE_STEP = 0xFFF000
AGREED = ("bcast", "reduce")


def call_name(kind, blocking=True):
    """The mpi4py name of collective `kind` ("allreduce" -> "Allreduce"; "Iallreduce")."""
    name = KIND_NAMES[KINDS[kind]]
    return name if blocking else "I" + name[0].lower() + name[1:]


def agreement_peers(rank, n):
    """(parent or None, children) of `rank` in the agreement's tree over ranks 0..n-1."""
    parent = (rank - 1) // 2 if rank else None
    return parent, [c for c in (2 * rank + 1, 2 * rank + 2) if c < n]


def agreement(rank, n, base):
    """The agreement's messages (schedule tuples, global indices from `base`) and deps: a
    fan-in over the tree (step AGREE_STEP) then a fan-out (step AGREE_STEP + 1)."""
    parent, children = agreement_peers(rank, n)
    msgs, deps = [], []

    def add(kind, peer, step, own):
        msgs.append((kind, peer, AGREE_STEP + step, WORK, 0, 0, COPY, own))
        return base + len(msgs) - 1

    heard = [add("recv", c, 0, False) for c in children]        # the subtrees' fan-in
    if parent is not None:
        up = add("send", parent, 0, True)
        deps += [(h, up) for h in heard]
        heard = [add("recv", parent, 1, False)]                 # the fan-out: all arrived
    for c in children:
        down = add("send", c, 1, True)
        deps += [(h, down) for h in heard]
    return msgs, deps


def _agreement_reachable(state, size):
    """The agreement's tree pairs (r, (r - 1) // 2) all work under `state` (None: static plans;
    a state with no broken pair: at once)."""
    return state is None or not state.has_broken_pairs() or \
        all(state.working(r, (r - 1) // 2) for r in range(1, size))


def descriptor(coll, nbytes, itemsize, dtc, redop, root, algo, size, layout=None):
    """(element count for header.count, header.aux without the non-blocking bit). A vector
    collective's `layout` (planner/vector.py) gives the count and the part every rank shares."""
    if layout is not None:
        nbytes, shared = vector.shared_shape(coll, layout)
        h = zlib.crc32(f"{coll}|{itemsize}|{dtc}|{redop}|{root}|{algo}|{size}|{shared}".encode())
    count = nbytes // itemsize if itemsize else nbytes
    if layout is None:
        h = zlib.crc32(f"{coll}|{nbytes}|{itemsize}|{dtc}|{redop}|{root}|{algo}|{size}|"
                       f"{count >> 32}".encode())
    kind = KINDS.get(coll, 0)
    desc = ((kind & 7) | (min(root, 0xFFFF) << 4) | ((kind >> 3) << 20) |
            ((h & 0x3FF) << 22)) if kind else 0
    return count & 0xFFFFFFFF, desc


def compile_call(Plan, coll, rank, members, nbytes, itemsize, root, dtc, redop, separate, cfg,
                 state, topo, layout=None):
    """(compiled Plan, Schedule, element count, descriptor, the global ranks it exchanges with)
    of one call shape on this rank (members: the communicator's global ranks; Plan: the
    engine's plan class; layout: a vector collective's, planner/vector.py)."""
    size = len(members)
    algo = cfg.algo
    if coll != "allreduce" and algo not in planner.GENERIC_ALGOS:
        algo = ""
    if coll in vector.KINDS:
        sched = vector.build(coll, rank, size, layout, root, cfg.eager, separate, state, topo)
    else:
        sched = planner.build(coll, rank, size, nbytes, itemsize, root, cfg.eager, algo,
                              state=state, separate_send=separate, topo=topo)
    sched.validate()
    msgs, deps, algo = list(sched.msgs), list(sched.deps), sched.algo
    if coll in AGREED and cfg.agree and size > 1 and _agreement_reachable(state, size):
        more, mdeps = agreement(rank, size, len(msgs))
        msgs += more
        deps += mdeps
        algo += "+agree"
    weights = send_rail_weights(sched, msgs)
    if members[0] != 0 or members[-1] != size - 1 or members != list(range(size)):
        msgs = [(k, members[p], st, b, off, n, mode, own)      # (the world's ranks are its own)
                for (k, p, st, b, off, n, mode, own) in msgs]
    count, desc = descriptor(coll, nbytes, itemsize, dtc, redop, root, algo, size, layout)
    return Plan(msgs, deps, algo, None, weights), sched, count, desc, {m[1] for m in msgs}


def send_rail_weights(sched, msgs):
    """The engine Plan's per-message rail shares: the schedule's rail_weights for each send to a
    peer it names, None for every other message (None in all: the engine's own striping)."""
    rw = sched.rail_weights
    if not rw:
        return None
    return [rw.get(m[1]) if m[0] == "send" else None for m in msgs]
