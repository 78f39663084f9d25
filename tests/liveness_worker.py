"""One rank of a failure-detector-only job (tests/test_liveness.py): no engine, no data mesh.

usage: liveness_worker.py DIR RANK SIZE key=value...
  period, suspect, frozen, probe   Settings (seconds)
  hb_every=S                       this rank heartbeats every S s (a slow rank; tests only)
  mute=R                           this rank sends no heartbeat to rank R (a slow link)
  max=S                            exit after S s at most (default 60)
The ranks meet through DIR (addr.<rank> files: port and pid; a shared secret in DIR/secret; all
run on this host, so each knows the others' pids); each writes its
state to DIR/state.<rank>.json every 50 ms (atomically) and stops when DIR/stop appears."""
import json
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from r2comm.control import liveness  # noqa: E402


class MisbehavingDetector(liveness.Detector):
    """A detector whose heartbeats come only every `hb_every` s (a slow rank), or never go to
    the ranks in `mute` (a one-way silence): what tests inject, never production."""
    hb_every = None
    mute = frozenset()
    _next_beat = 0.0

    def heartbeat_peers(self):
        return super().heartbeat_peers() - set(self.mute)

    def _beat(self, now):
        if self.hb_every is not None:
            if now < self._next_beat:
                return
            self._next_beat = now + self.hb_every
        super()._beat(now)


def main():
    d, rank, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    kw = dict(a.split("=", 1) for a in sys.argv[4:])
    with open(os.path.join(d, "secret"), "rb") as f:
        secret = f.read()
    lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lst.bind(("127.0.0.1", 0))
    lst.listen(1024)
    tmp = os.path.join(d, f"addr.{rank}.tmp")
    with open(tmp, "w") as f:
        f.write(f"{lst.getsockname()[1]} {os.getpid()}")
    os.replace(tmp, os.path.join(d, f"addr.{rank}"))
    until = time.monotonic() + 60
    while time.monotonic() < until and not all(os.path.exists(os.path.join(d, f"addr.{r}"))
                                               for r in range(size)):
        time.sleep(0.02)
    addrs, pids = [], {}
    for r in range(size):
        with open(os.path.join(d, f"addr.{r}")) as f:
            port, pid = f.read().split()
        addrs.append(("127.0.0.1", int(port)))
        if r != rank:
            pids[r] = int(pid)
    told = {}

    def on_dead(r, reason, process):
        told[r] = (time.time(), reason, process)
    s = liveness.Settings(float(kw.get("period", 0.2)), float(kw.get("suspect", 2.0)),
                          float(kw.get("frozen", 60.0)), float(kw.get("probe", liveness.PROBE_S)))
    det = MisbehavingDetector(rank, size, secret, lst, addrs, s, on_dead, pids)
    if "hb_every" in kw:
        det.hb_every = float(kw["hb_every"])
    if "mute" in kw:
        det.mute = {int(kw["mute"])}
    det.start()
    t0 = time.monotonic()
    end = t0 + float(kw.get("max", 60))
    while time.monotonic() < end and not os.path.exists(os.path.join(d, "stop")):
        state = {"rank": rank, "pid": os.getpid(), "t": time.time(),
                 "up_s": time.monotonic() - t0, "sent": dict(det.sent),
                 "refuted": det.refuted, "fds": det.fds(), "excluded": det.excluded,
                 "neighbours": det.neighbours(),
                 "told": {str(r): v for r, v in told.items()}}
        tmp = os.path.join(d, f"state.{rank}.tmp")
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, os.path.join(d, f"state.{rank}.json"))
        time.sleep(0.05)
    det.close()


if __name__ == "__main__":
    main()
