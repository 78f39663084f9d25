"""One object per transport kind (issue 43): r2comm.transport.KINDS, the choice of the NIC
kind at bootstrap (offer / decide), and an accepted connection's kind from its HELLO."""
from types import SimpleNamespace

import pytest

from r2comm import transport
from r2comm.errors import R2commArgumentError
from r2comm.transport import Transport, shm, tcp, verbs


def test_every_kind_is_one_object_with_the_whole_cold_path():
    assert set(transport.KINDS) == {"tcp", "verbs", "shm"}
    for name, kind in transport.KINDS.items():
        assert isinstance(kind, Transport) and kind.name == name
        assert transport.kind_of(name) is kind
        for attr in ("offer", "dial", "attach", "min_rail_timeout_ms", "registration_cache",
                     "prepare"):
            assert callable(getattr(kind, attr)), (name, attr)
        assert kind.rail_fds >= 1
    assert transport.CONTROL is tcp.TRANSPORT and transport.LOCAL is shm.TRANSPORT
    assert transport.LOCAL.local and not tcp.TRANSPORT.local and not verbs.TRANSPORT.local
    assert (tcp.TRANSPORT.rail_fds, verbs.TRANSPORT.rail_fds) == (1, 3)
    assert verbs.TRANSPORT.attach_blocks and not tcp.TRANSPORT.attach_blocks
    assert tcp.TRANSPORT.min_rail_timeout_ms() == 0


def test_hello_rail_codes_name_one_kind():
    nic = verbs.TRANSPORT
    assert transport.for_hello(transport.CTRL_RAIL, nic) is tcp.TRANSPORT
    assert transport.for_hello(shm.SHM_RAIL, nic) is shm.TRANSPORT
    assert transport.for_hello(shm.TCP_RAIL, nic) is shm.TRANSPORT
    assert transport.for_hello(0, nic) is nic and transport.for_hello(3, tcp.TRANSPORT) is \
        tcp.TRANSPORT
    codes = [transport.CTRL_RAIL, *shm.TRANSPORT.hello_rails]
    assert len(set(codes)) == len(codes)


def test_offer_asks_the_kinds_in_order(monkeypatch):
    assert transport.offer("tcp", ["127.0.0.1"]) == ("tcp", None, "R2COMM_TRANSPORT=tcp")
    monkeypatch.setattr(verbs, "find_devices", lambda addrs, pool=None: [(None, "no device")])
    assert transport.offer("auto", ["127.0.0.1"]) == ("tcp", None, "no device")
    dev, pools = object(), []

    def find(addrs, pool=None):
        pools.append(pool)
        return [(dev, None)] * len(addrs)
    monkeypatch.setattr(verbs, "find_devices", find)
    assert transport.offer("verbs", ["a", "b"]) == ("verbs", [dev, dev], None)
    cfg = SimpleNamespace(verbs_recv_slots=64, verbs_send_slots=32, verbs_conn_send_slots=8)
    assert transport.offer("auto", ["a"], cfg) == ("verbs", [dev], None)
    assert pools == [None, (64, 32, 8)]          # the kind reads its own settings


def test_decide_names_the_kind_and_the_ranks_that_cannot():
    ok, no = ("verbs", "verbs", None), ("verbs", "tcp", "no RDMA device carries rail 1")
    assert transport.decide([ok, ok]) == "verbs"
    with pytest.raises(R2commArgumentError, match=r"^R2COMM_TRANSPORT=verbs, but rank 1 has no "
                                                  r"usable RDMA device: no RDMA device"):
        transport.decide([ok, no])
    assert transport.decide([("auto", "verbs", None), ("auto", "tcp", "x")]) == "tcp"
    assert transport.decide([("auto", "verbs", None)] * 3) == "verbs"
    assert transport.decide([("tcp", "tcp", "R2COMM_TRANSPORT=tcp")] * 2) == "tcp"


def test_local_groups_is_is_local():
    eps = [{"rails": [("127.0.0.1", 1)], "host_key": f"h{r // 3}",
            "shm": None if r == 4 else "k"} for r in range(7)]
    groups = shm.TRANSPORT.local_groups(eps)
    for a in range(7):
        for b in range(7):
            assert shm.TRANSPORT.is_local(eps, a, b) == (a != b and b in groups.get(a, ())), \
                (a, b)
