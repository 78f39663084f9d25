"""The fake transport (r2comm/_core/fake_transport.pxi, in the test extension) injected by the
tests: R2COMM_TEST_TRANSPORT=fake:seed=1,block=..,short=..,delay=..,lose=..,fail=..,
fail_bytes=..,max_fails=.. is read here, never by r2comm; install() hooks it into every new
engine (r2comm.world.ENGINE_HOOKS) before the engine starts. Run with R2COMM_SHM=0: the fake
transport exercises the TCP path, local peers included."""
import importlib.util
import os

from r2comm.config import _size
from r2comm.errors import R2commArgumentError

KEYS = {"seed": int, "block": float, "short": float, "delay": float, "lose": float,
        "fail": float, "fail_bytes": _size, "max_fails": int}


def parse(text):
    """R2COMM_TEST_TRANSPORT=fake:key=value,... -> r2comm._core.testing.use_fake_transport's
    keyword arguments ({} for an empty text)."""
    text = text.strip()
    if not text:
        return {}
    kind, _, rest = text.partition(":")
    if kind != "fake":
        raise R2commArgumentError(f"R2COMM_TEST_TRANSPORT={text!r}: only 'fake:...' exists")
    if importlib.util.find_spec("r2comm._core.testing") is None:
        raise R2commArgumentError("R2COMM_TEST_TRANSPORT needs r2comm's test extension, which "
                                  "this install lacks (build with R2COMM_TEST_HOOKS=1)")
    out = {"seed": 0}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, _, val = item.partition("=")
        if key not in KEYS:
            raise R2commArgumentError(f"R2COMM_TEST_TRANSPORT: unknown key {key!r} "
                                      f"(known: {', '.join(KEYS)})")
        out[key] = KEYS[key](val)
    return out


def install(text=None):
    """Run every new engine's rails on the fake transport (seeded per rank) as the spec
    (default: $R2COMM_TEST_TRANSPORT) says; nothing for an empty spec."""
    spec = parse(os.environ.get("R2COMM_TEST_TRANSPORT", "") if text is None else text)
    if not spec:
        return
    from r2comm import world
    from r2comm._core import testing

    def hook(engine, boot):
        fake = dict(spec)
        testing.use_fake_transport(engine, fake.pop("seed") * 1009 + boot.rank, **fake)
    world.ENGINE_HOOKS.append(hook)
