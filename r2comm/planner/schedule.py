"""Schedules as data: what one rank sends and receives in one operation.

A schedule is a list of messages plus chunk-level dependencies. The engine executes any
schedule; tests check schedules without sockets; the simulator can price them.

A message is (kind, peer, step, buf, offset, nbytes, mode, owned):
  kind    "send" or "recv"; peer is a rank of the communicator
  step    distinguishes the messages between one pair (per direction) in one operation
  buf     WORK (the result buffer), SEND (the user's send buffer) or SCRATCH
  mode    COPY, REDUCE (dst = dst op incoming) or REDUCE_REV (dst = incoming op dst), receives;
          REDUCE_SEND / REDUCE_SEND_REV take the other operand from SEND at the same offset
          (dst = send op incoming / incoming op send), so the input need not be copied into
          WORK first (with IN_PLACE, SEND is WORK and they equal REDUCE / REDUCE_REV)
  owned   the engine copies the data (small messages: the op need not wait for acks)
rail_weights {peer: (w_0, ..., w_K-1)}: how this rank's sends to `peer` stripe over the rails
(shares summing to 1; a pair not named stripes as the engine measures it). The planner sets them
where a pair should favour the rails that its peers' traffic with a slow host leaves free
(direct.py); the simulator's replay and the engine honour them on the rails that are up.
A dependency (a, b) means: chunk c of message b waits for chunk c of message a (a receive is
done with a chunk once applied; a send once acknowledged, or once copied if owned). Both
messages must have the same length.
"""
from dataclasses import dataclass, field

WORK, SEND, SCRATCH = 0, 1, 2
COPY, REDUCE, REDUCE_REV, REDUCE_SEND, REDUCE_SEND_REV = 0, 1, 2, 3, 4


@dataclass
class Schedule:
    algo: str
    msgs: list = field(default_factory=list)
    deps: list = field(default_factory=list)
    scratch: int = 0              # bytes of scratch buffer the schedule needs
    pre: list = field(default_factory=list)    # local copies before: (dst_buf, dst_off, src_buf, src_off, n)
    post: list = field(default_factory=list)   # local copies after completion
    cost: float = 0.0             # predicted seconds (planner's cost model)
    fills_work: bool = False      # every byte of WORK is written from SEND and received data,
                                  # so the caller skips copying the input into WORK
    rail_weights: dict = field(default_factory=dict)   # peer -> per-rail shares of my sends
    checked: tuple = field(default=(), compare=False, repr=False)   # the lengths validate()
                                  # passed at (a schedule built once is checked once)

    @property
    def hierarchical(self):
        """A host-aware plan (planner/hierarchical.py), possibly relayed."""
        return self.algo.startswith("hierarchical")

    def send(self, peer, step, buf, off, nbytes, owned=False):
        self.msgs.append(("send", peer, step, buf, off, nbytes, COPY, owned))
        return len(self.msgs) - 1

    def recv(self, peer, step, buf, off, nbytes, mode=COPY):
        self.msgs.append(("recv", peer, step, buf, off, nbytes, mode, False))
        return len(self.msgs) - 1

    def dep(self, a, b):
        if a is not None and b is not None:
            self.deps.append((a, b))

    def bytes_sent(self):
        return sum(m[5] for m in self.msgs if m[0] == "send")

    def bytes_received(self):
        return sum(m[5] for m in self.msgs if m[0] == "recv")

    def validate(self):
        """Structural checks (used by tests and on every new plan; a schedule that passed and
        has not grown since is not looked at again)."""
        msgs = self.msgs
        shape = (len(msgs), len(self.deps), len(self.rail_weights))
        if self.checked == shape:
            return self
        if len({m[:3] for m in msgs}) != len(msgs):
            seen = set()
            for m in msgs:
                if m[:3] in seen:
                    raise ValueError(f"{self.algo}: two {m[0]}s to/from {m[1]} with step {m[2]}")
                seen.add(m[:3])
        for a, b in self.deps:
            if msgs[a][5] != msgs[b][5]:
                raise ValueError(f"{self.algo}: dependency {a}->{b} between different sizes")
        for peer, w in self.rail_weights.items():
            if not w or any(not x >= 0 for x in w) or not abs(sum(w) - 1.0) < 1e-6:
                raise ValueError(f"{self.algo}: rail weights {w!r} for peer {peer}: shares >= 0 "
                                 "summing to 1")
        self.checked = shape
        return self

    def copy(self, algo=None, msgs=None):
        """A copy with its own lists (algo and msgs replaced where given)."""
        return Schedule(self.algo if algo is None else algo,
                        list(self.msgs if msgs is None else msgs), list(self.deps), self.scratch,
                        list(self.pre), list(self.post), self.cost, self.fills_work,
                        dict(self.rail_weights))
