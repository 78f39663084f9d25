"""The one allocator of communicator ids. Every frame carries a 32-bit communicator id:
- normal communicators (the world: 0; Dup, Split, torch groups) take ids agreed by their ranks
  (the maximum of every rank's next free id, over the bootstrap communicator: O(log n)), so a
  rank that created more communicators than another never reuses an id;
- each one's control-plane twin (control.py) is CONTROL_BIT | id, and its plan-switch twin
  (replan.py: the agreements that move its plans to a new epoch) CONTROL_BIT | EPOCH_BIT | id;
- each one's device-buffer staging twins (gpu/pipeline.py) are GPU_BIT | generation << 24 | id;
- each one's fault-tolerance twin (control/recovery.py: its agreements) CONTROL_BIT | GPU_BIT |
  id; a communicator made by Shrink takes the maximum of its survivors' next free ids, agreed
  by them over the fault-tolerance twin (MPI cannot be used once a rank died): shrunk().
So normal ids stay below 2**24 where staging twins are used, and below GPU_BIT always."""
from ..errors import R2commArgumentError

CONTROL_BIT = 0x80000000      # communicator id bit of control-plane twins
EPOCH_BIT = 0x20000000        # with CONTROL_BIT: the plan-switch twins
GPU_BIT = 0x40000000          # communicator id bit of staging twins
GPU_GEN_SHIFT = 24            # a staging twin's generation sits above the parent's id
GPU_GENERATIONS = 64


class CommIds:
    """Hands out the communicator ids of one world (one engine)."""

    WORLD = 0                    # the world communicator's id

    def __init__(self):
        self.next_free = 1       # the world communicator is id 0

    def agree(self, agree_max, count=1):
        """The first of `count` new ids, the same on every rank: `agree_max(v)` returns the
        maximum of v over the ranks that create them (a collective of theirs)."""
        base = int(agree_max(self.next_free))
        self.next_free = base + count
        return base

    def shrunk(self, top):
        """The id of a communicator made by Shrink: `top`, the maximum of its survivors' next
        free ids, which they agreed on (recovery.py): the same on every survivor, and free on
        each."""
        top = int(top)
        if not self.next_free <= top < EPOCH_BIT:
            raise R2commArgumentError(f"agreed communicator id {top} below this rank's next "
                                      f"free id {self.next_free} or beyond the normal ids")
        self.next_free = top + 1
        return top

    @staticmethod
    def ft(comm_id):
        """The id of the fault-tolerance twin of communicator `comm_id` (recovery.py's
        agreements; normal ids stay below EPOCH_BIT)."""
        if comm_id >= EPOCH_BIT:
            raise R2commArgumentError(f"communicator id {comm_id} beyond the fault-tolerance "
                                      f"twins'")
        return CONTROL_BIT | GPU_BIT | comm_id

    @staticmethod
    def control(comm_id):
        """The id of the control-plane twin of communicator `comm_id`."""
        return CONTROL_BIT | comm_id

    @staticmethod
    def epoch(comm_id):
        """The id of the plan-switch twin of communicator `comm_id` (normal ids stay below
        EPOCH_BIT)."""
        if comm_id >= EPOCH_BIT:
            raise R2commArgumentError(f"communicator id {comm_id} beyond the plan-switch twins'")
        return CONTROL_BIT | EPOCH_BIT | comm_id

    @staticmethod
    def gpu_twin(comm_id, generation):
        """The id of staging twin `generation` (0 .. 63) of communicator `comm_id`."""
        if comm_id >= (1 << GPU_GEN_SHIFT) or generation >= GPU_GENERATIONS:
            raise R2commArgumentError("device-buffer collectives: communicator id or call count "
                                      "beyond what the staging twin can number")
        return GPU_BIT | (generation << GPU_GEN_SHIFT) | comm_id
