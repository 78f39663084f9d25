"""The rail-state epoch: the agreement that makes every rank of a communicator switch its plans
at the same operation boundary.

R2COMM_REPLAN=K runs the epoch check at every K-th operation (the same boundary on every rank,
because all ranks run the same sequence of operations). Each rank proposes the agreed epoch,
plus one if its own rails changed (one failed or came back: up/down state or failure count)
since the epoch was agreed; the ranks take the maximum over r2comm's control plane
(control.allgather: point-to-point messages through the engine over two trees, O(1) per rank,
lossless under rail failures, agreed whatever one pair does during the call). A higher epoch is adopted by every rank before the
operation: they gather the rail state (also over the control plane) and re-plan from it, unless
the plans are still static and the state is healthy (every rail up, no slow host). The first
check always starts epoch 1, so a slow NIC seen by the start-up probe is planned for."""
from . import control, planner
from .railview import loopback_only
from .transport.rails import rail_stats


def rail_marks(engine, members):
    """This rank's marks of its rails to `members` (global ranks): (state, failures) per rail."""
    stats = rail_stats(engine)
    return tuple((g, tuple((row.state, row.failures) for row in stats[g]))
                 for g in members if g in stats)


def agreed_epoch(ctl, epoch, changed):
    """The maximum over the ranks of their proposals (epoch, + 1 where `changed`), over the
    control plane `ctl` (collective)."""
    propose = epoch + (1 if changed else 0)
    return int(control.allreduce_max(ctl, [propose])[0])


def gather_state(ctl, world, members, host_of):
    """The live RailState of the ranks `members` (global ranks), the same on every rank
    (collective over the control plane `ctl`). Bandwidths are the engines' measured rates
    (start-up probe, then acknowledgements), R2COMM_RAIL_BW where a rail has no measurement
    yet; loopback "rails" are one device: only the overall scale of the measurements counts."""
    eps = world.boot.endpoints
    nrails = max(len(ep["rails"]) for ep in eps)
    loop = loopback_only(eps[g] for g in members)
    stats = world.transports.rail_stats(world.engine, nrails)
    return planner.agree.agree_state(lambda fixed, exc: control.agree_rails(ctl, fixed, exc),
                                     ctl.rank, members, stats, list(host_of), nrails,
                                     world.cfg.rail_bw or None, rates="scale" if loop else "nic")
