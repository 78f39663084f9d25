"""A rank of a store-bootstrapped job (DirStore) whose store is watched by an attacker: every
value any rank sets is also copied to <store>.seen/ (what a process that reads the store learns).
argv: rank size store_dir, or rank size tcp:<port> (torch's TCPStore on 127.0.0.1, not
watched). After start-up it prints `INFO <json>` (its job id, which derives from the job
secret, and its control endpoint), waits for <store>.go, runs one allreduce
and prints `OK secret <rank>`."""
import json
import os
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import r2comm  # noqa: E402
from r2comm.control.bootstrap_store import DirStore  # noqa: E402


class WatchedStore(DirStore):
    """A DirStore whose every set() value is also kept in <path>.seen (the attacker's view)."""

    def set(self, key, value):
        seen = self.path + ".seen"
        os.makedirs(seen, exist_ok=True)
        with open(os.path.join(seen, self._file(key).rsplit(os.sep, 1)[1]), "wb") as f:
            f.write(value.encode() if isinstance(value, str) else bytes(value))
        super().set(key, value)


def main():
    rank, size, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    if path.startswith("tcp:"):
        import datetime
        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", int(path[4:]), None, False,
                              datetime.timedelta(seconds=60))
    else:
        store = WatchedStore(path, timeout=60)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm = r2comm.Communicator.from_store(store, rank, size, timeout=30)
    for w in caught:
        print(f"WARNING {w.message}", flush=True)
    boot = comm._world.boot
    print("INFO " + json.dumps({"rank": rank, "job": boot.job.hex(),
                                "ctrl": list(boot.endpoints[rank]["ctrl"])}), flush=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(path + ".go") and time.monotonic() < deadline:
        time.sleep(0.02)
    a = np.full(100, rank + 1.0)
    out = np.empty_like(a)
    comm.Allreduce(a, out)
    assert out[0] == sum(range(1, size + 1)), out[0]
    comm.Free()
    print(f"OK secret {rank}", flush=True)


if __name__ == "__main__":
    main()
