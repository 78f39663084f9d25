"""When a pipeline step hides its latencies (a leaf: price.py and direct.py both use it)."""


def hides_latency(m, b, alpha, c, b_first=None):
    """Whether a step's message of m bytes at b is on the wire before the next step's first
    chunk is ready (its last chunk starts within α + a chunk time at b_first, the fastest link
    that can feed it; default b): the link then idles through the latencies, which the chain
    counts, and the volume term does not add them. If not, the engine sends the next step's
    chunks (released by a dependency) ahead of the rest of the step, which ends about a
    latency later at every step: volume + hops·α."""
    b_first = b if b_first is None else b_first
    if not (b > 0 and b_first > 0 and c > 0):
        return False
    q = max(1, -(-int(m) // c))
    return (q - 1) * c / b <= alpha + c / b_first
