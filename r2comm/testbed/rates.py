"""Link rates: parsing tc-style strings and turning them into tbf parameters.

Rates are kept as integer bits per second (None = unlimited) so the state
file and `status` are unambiguous, and handed to tc as "<n>bit".
"""
import re

from ._iproute import TestbedError

_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
          "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*$")
UNLIMITED_WORDS = ("unlimited", "none")

#: tbf bucket: enough for ~4 ms at line rate (so timer granularity does not
#: throttle below the target), never less than a few full-size GSO frames.
_BURST_SECONDS = 0.004
_MIN_BURST_BYTES = 3 * 65536
#: How long a packet may wait in the tbf queue before it is dropped.
TBF_LATENCY = "50ms"


def parse_rate(text):
    """'500mbit' -> 500_000_000 bits/s; 'unlimited'/'none' -> None.

    Units follow tc: kbit/mbit/gbit/tbit are bits, kbps/mbps/gbps are bytes,
    all decimal.  A bare number is refused: tc would read it as bytes/s,
    which is never what anyone meant.
    """
    word = str(text).strip().lower()
    if word in UNLIMITED_WORDS:
        return None
    match = _RATE_RE.match(word)
    if not match or match.group(2) not in _UNITS:
        raise TestbedError(f"bad rate {text!r}: use e.g. 500mbit, 1gbit, 100mbps or unlimited")
    bps = int(float(match.group(1)) * _UNITS[match.group(2)])
    if bps < 8000:
        raise TestbedError(f"rate {text!r} is below 8kbit; tbf cannot shape that usefully")
    return bps


def format_rate(bps):
    """500_000_000 -> '500mbit' (exact when possible), None -> 'unlimited'."""
    if bps is None:
        return "unlimited"
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bps % _UNITS[unit] == 0:
            return f"{bps // _UNITS[unit]}{unit}"
    return f"{bps}bit"


def tbf_args(bps):
    """Arguments after `tc qdisc replace dev X root` that shape to BPS."""
    burst = max(int(bps / 8 * _BURST_SECONDS), _MIN_BURST_BYTES)
    return ["tbf", "rate", f"{bps}bit", "burst", str(burst), "latency", TBF_LATENCY]
