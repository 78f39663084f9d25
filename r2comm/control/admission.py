"""Which incoming handshakes a listener keeps when more arrive than it takes (issue 28 item 4,
issue 40 items 1 and 2): one policy for the links' listeners and the failure detector's.

A source address proves nothing (any local user can bind a rank's address, loopback or the
host's IP), so every new connection is anonymous until its HELLO carries a valid tag (tcp.py:
only a holder of the job secret makes one); from then on it holds a slot of its pair (peer,
rail). Anonymous connections hold at most `anonymous` of the `total` slots (the rest is kept for
the peers' handshakes) and `per_source` from one address. A newcomer over a cap closes the
oldest anonymous connection of its own address, else the oldest anonymous one: a flood churns
its own connections, and a peer's HELLO, sent right after its connect, takes its connection out
of reach. One pair holds at most `per_pair` slots (the newest stay: a replayed HELLO cannot
keep the real one out). A newcomer finds no room only when every slot holds a valid HELLO."""


class Policy:
    """The caps; room() and pair_excess() say which pending handshakes to close."""

    def __init__(self, total=64, anonymous=32, per_source=8, per_pair=2):
        if not 0 < per_source <= anonymous < total or per_pair < 1:
            raise ValueError(f"admission caps: total {total}, anonymous {anonymous}, per "
                             f"source {per_source}, per pair {per_pair}")
        self.total, self.anonymous = total, anonymous
        self.per_source, self.per_pair = per_source, per_pair

    def room(self, pending, src):
        """Room for a newcomer from address src among `pending` ({key: tcp.ServerHandshake}):
        -> ([(key to close, why)], whether the newcomer may stay)."""
        anon = sorted((hs.since, key) for key, hs in pending.items() if not hs.got_hello)
        out = []
        same = [key for _, key in anon if pending[key].addr[0] == src]
        if len(same) >= self.per_source:
            out.append((same[0], f"more than {self.per_source} without a valid hello from "
                                 f"{src}"))
        elif len(anon) >= self.anonymous:
            out.append((anon[0][1], f"more than {self.anonymous} without a valid hello"))
        if len(pending) - len(out) < self.total:
            return out, True
        rest = [key for _, key in anon if key not in {k for k, _ in out}]
        if not rest:
            return out, False
        out.append((rest[0], f"{self.total} handshakes pending"))
        return out, True

    def pair_excess(self, pending, key):
        """pending[key] just sent a valid HELLO: the keys of the same pair's older handshakes
        beyond per_pair (to close), oldest first."""
        pair = pending[key].pair
        same = sorted((hs.since, k) for k, hs in pending.items()
                      if hs.got_hello and hs.pair == pair)
        return [k for _, k in same[:max(0, len(same) - self.per_pair)]]
