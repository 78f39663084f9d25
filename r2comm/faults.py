"""Fault injection specs: R2COMM_FAULT="rank=1,rail=0,after_ms=200,mode=silent" (';' separates
several). Keys: rank, rail, mode (hard|silent), peer, after_ms, after_bytes, restore_ms, start.
start=1: the rail is dark from start-up on, before any connection (a NIC that is down when the
job starts): it never comes up until restore_ms (counted from the end of start-up) lifts it."""
from dataclasses import dataclass

MODES = {"hard": 1, "silent": 2}


@dataclass
class FaultSpec:
    rank: int
    rail: int
    mode: str = "hard"
    peer: int = -1
    after_ms: float = 0.0
    after_bytes: int = -1
    restore_ms: float = -1.0
    start: bool = False


def parse(text):
    specs = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        kv = {}
        for item in part.split(","):
            if "=" not in item:
                raise ValueError(f"R2COMM_FAULT: expected key=value, got {item!r}")
            k, v = item.split("=", 1)
            kv[k.strip()] = v.strip()
        unknown = set(kv) - {"rank", "rail", "mode", "peer", "after_ms", "after_bytes", "restore_ms",
                                  "start"}
        if unknown or "rail" not in kv:
            raise ValueError(f"R2COMM_FAULT: bad spec {part!r} (unknown keys {sorted(unknown)} "
                             "or no rail=)")
        spec = FaultSpec(rank=int(kv.get("rank", -1)), rail=int(kv["rail"]),
                         mode=kv.get("mode", "hard"), peer=int(kv.get("peer", -1)),
                         after_ms=float(kv.get("after_ms", 0)),
                         after_bytes=int(kv.get("after_bytes", -1)),
                         restore_ms=float(kv.get("restore_ms", -1)),
                         start=kv.get("start", "0") not in ("0", "", "false", "no"))
        if spec.mode not in MODES:
            raise ValueError(f"R2COMM_FAULT: mode must be hard or silent, got {spec.mode!r}")
        specs.append(spec)
    return specs
