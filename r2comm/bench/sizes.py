"""Message sizes: OSU's ``-m [MIN:]MAX`` with binary suffixes, doubling sweeps."""
import re

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMG]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text):
    """'64M' -> 67108864.  Suffixes are binary (K=1024) as in OSU and nccl-tests."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"bad size {text!r} (expected e.g. 8, 4K, 64M, 1G)")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def parse_range(text):
    """'MIN:MAX' or 'MAX' (OSU's -m) -> (min, max); a bare MAX keeps the default MIN (None)."""
    lo, sep, hi = str(text).partition(":")
    if not sep:
        return None, parse_size(lo)
    lo_v = parse_size(lo) if lo.strip() else None
    hi_v = parse_size(hi)
    if lo_v is not None and lo_v > hi_v:
        raise ValueError(f"bad range {text!r}: min > max")
    return lo_v, hi_v


def sweep(lo, hi):
    """OSU sweep: lo, 2lo, 4lo, ... <= hi; 0 is followed by 1."""
    out = []
    s = lo
    if s == 0:
        out.append(0)
        s = 1
    while s <= hi:
        out.append(s)
        s *= 2
    return out


def human(nbytes):
    """Short binary size label for plots and summaries: 4096 -> '4K'."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)
