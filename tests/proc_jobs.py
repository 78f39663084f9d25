"""Jobs of worker processes that write their results to files (tests/test_shrink.py,
tests/test_grow.py): a bounded wait for all of them and the collection of what they wrote."""
import json
import os
import subprocess
import time


def wait_all(procs, until):
    """Wait for every process of {tag: Popen} until time.monotonic() `until`; kill the rest.
    Returns the tags of those killed (hung)."""
    hung = []
    for tag, p in procs.items():
        try:
            p.wait(max(0.1, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung.append(tag)
            p.kill()
            p.wait(10)
    return hung


def collect(d, tags):
    """({tag: DIR/res.<tag>.json read}, {tag: the tail of DIR/err.<tag>}) of those present."""
    results, errors = {}, {}
    for tag in tags:
        try:
            with open(os.path.join(d, f"res.{tag}.json")) as f:
                results[tag] = json.load(f)
        except (OSError, ValueError):
            pass
        if os.path.exists(os.path.join(d, f"err.{tag}")):
            with open(os.path.join(d, f"err.{tag}")) as f:
                errors[tag] = f.read()[-3000:]
    return results, errors
