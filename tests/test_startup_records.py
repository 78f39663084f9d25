"""The start-up exchange's records (r2comm/control/startup.py quiet_bcast / quiet_allgather): JSON in a
length-prefixed slot, never unpickled; a slot whose length or JSON is wrong is a clear
R2commProtocolError, whatever its bytes (a fuzz loop over random and mutated slots)."""
import json
import random

import numpy as np
import pytest

from r2comm.control import startup
from r2comm.errors import R2commArgumentError, R2commProtocolError


def test_a_record_round_trips_through_its_slot():
    rec = {"rails": [["127.0.0.1", 4711]], "pid": 7, "shm": None, "fds": [12, 1024, -1]}
    data = startup._encode(rec)
    slot = startup._slot(data, len(data) + 4 + 9)
    assert startup._decode(slot, "test") == rec


def test_length_past_the_slot_and_bad_json_are_protocol_errors():
    slot = startup._slot(b'{"a":1}', 16)
    slot[:4] = np.frombuffer((13).to_bytes(4, "little"), np.uint8)
    with pytest.raises(R2commProtocolError, match="claims 13 bytes, 12 arrived"):
        startup._decode(slot, "test")
    with pytest.raises(R2commProtocolError, match="not JSON"):
        startup._decode(startup._slot(b"\x80\x04K\x01.", 16), "test")     # a pickle
    deep = b"[" * 100000 + b"]" * 100000
    with pytest.raises(R2commProtocolError, match="not JSON"):
        startup._decode(startup._slot(deep, len(deep) + 4), "test")


def test_an_oversized_record_is_refused_before_it_is_sent():
    with pytest.raises(R2commArgumentError, match="over"):
        startup._encode({"host": "x" * startup.RECORD_MAX})


def test_fuzzed_slots_decode_or_raise_protocol_errors():
    rng = random.Random(31)
    good = startup._slot(startup._encode({"rails": [["10.0.0.1", 1]], "check": "ab"}), 64)
    decoded = 0
    for i in range(3000):
        slot = good.copy()
        if i % 3 == 0:
            slot = np.frombuffer(rng.randbytes(rng.randrange(0, 80)), np.uint8).copy()
        else:
            for _ in range(rng.randrange(1, 6)):
                if len(slot):
                    slot[rng.randrange(len(slot))] = rng.randrange(256)
        try:
            out = startup._decode(slot, "fuzz")
        except R2commProtocolError:
            continue
        json.dumps(out)                  # whatever decoded is plain JSON data
        decoded += 1
    assert decoded > 0
