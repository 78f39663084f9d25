"""Puts the default group of torch's own test files on r2comm (tests/test_torch_suites.py):
with R2T_SUITE_BACKEND=r2comm, every process of the run (pytest's and the ranks torch's test
bases spawn or fork; this folder is on their PYTHONPATH, so Python imports this module at
start-up) gets an init_process_group that asks for "r2comm" where the test asked for Gloo
("gloo" -> "r2comm", "cpu:gloo,..." -> "cpu:r2comm,..."). Groups the tests make with
new_group(backend=...) keep what they ask for. Without R2T_SUITE_BACKEND=r2comm this module
does nothing (the Gloo reference run)."""
import functools
import os


def _install():
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    import r2comm.torch  # noqa: F401  (registers "r2comm")

    original = c10d.init_process_group

    def swap(backend):
        if not isinstance(backend, str):
            return backend
        if backend == "gloo":
            return "r2comm"
        return ",".join("cpu:r2comm" if part == "cpu:gloo" else part
                        for part in backend.split(","))

    @functools.wraps(original)
    def init_process_group(backend=None, *args, **kwargs):
        return original(swap(backend), *args, **kwargs)

    c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group


if os.environ.get("R2T_SUITE_BACKEND") == "r2comm":
    _install()
