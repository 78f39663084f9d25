"""A rank of a store-bootstrapped job (DirStore) whose view of the store an attacker with write
access changed (issue 40, item 5): argv rank size store_dir. R2T_TAMPER (JSON, this rank's
view only, as if the attacker had rewritten the keys before this rank read them):
  {"params": {...}}       rank 0's parameters as this rank reads them
  "copy_check": true      rank 0's endpoint record carries this rank's secret check (the tag
                          the attacker copies from this rank's record, to pass the old check)
  "forge_params": true    ... and this rank's parameters field
Prints `UP <rank> <integrity>` once started, `OK tamper <rank>` after an allreduce, or
`ERR <rank> <class>: <message>` (exit 3) when start-up or the allreduce raised."""
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import r2comm  # noqa: E402
from r2comm.control.bootstrap_store import DirStore, decode, encode  # noqa: E402

PARAMS = {"chunk_size", "acks", "integrity"}


class TamperedView(DirStore):
    """What this rank reads of the store, rewritten as R2T_TAMPER says."""

    def __init__(self, path, rank, tamper, timeout):
        super().__init__(path, timeout)
        self.rank, self.tamper = rank, tamper

    def get(self, key):
        data = super().get(key)
        try:
            value = decode(data)
        except Exception:
            return data
        if isinstance(value, dict) and set(value) == PARAMS and "params" in self.tamper:
            return encode(self.tamper["params"])
        if isinstance(value, dict) and "check" in value and key.endswith("/0") and self.rank:
            mine = decode(super().get(key[:-1] + str(self.rank)))
            if self.tamper.get("copy_check"):
                value["check"] = mine["check"]
            if self.tamper.get("forge_params"):
                value["params"] = mine["params"]
            return encode(value)
        return data


def main():
    rank, size, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    tamper = json.loads(os.environ.get("R2T_TAMPER", "{}"))
    store = TamperedView(path, rank, tamper, timeout=float(os.environ.get("R2T_STORE_S", "60")))
    t0 = time.monotonic()
    try:
        comm = r2comm.Communicator.from_store(store, rank, size, timeout=10,
                                              store_timeout=store.timeout)
        print(f"UP {rank} {comm._world.boot.params['integrity']}", flush=True)
        a = np.full(1000, rank + 1.0)
        out = np.empty_like(a)
        comm.Allreduce(a, out)
        assert out[0] == sum(range(1, size + 1)), out[0]
        comm.Free()
    except Exception as exc:
        print(f"ERR {rank} {type(exc).__name__}: {exc} ({time.monotonic() - t0:.1f} s)",
              flush=True)
        sys.exit(3)
    print(f"OK tamper {rank}", flush=True)


if __name__ == "__main__":
    main()
