"""r2comm as a torch.distributed backend: `import r2comm.torch` registers the backend "r2comm".

    import torch.distributed as dist
    import r2comm.torch                      # registers "r2comm"
    dist.init_process_group("r2comm")        # under torchrun (env://), or with a store

The ranks bootstrap through the process group's store (torchrun's TCPStore, or any Store given
to init_process_group): Communicator.from_store, no MPI. Everything after that runs on r2comm's
own connections (every rail to every peer, failover included). The group is a c10d Backend in
C++ (_backend.cpp, built against the installed torch: native.py); backend.py makes it, pyops.py
holds the collectives it hands to Python. communicator(group) is a group's Communicator;
shrink(group) the survivors' group after a rank died (recover.py); grow(store, joiners, prefix=)
in the survivors and join(store, prefix=) in a replacement make the default group whole again."""
from .backend import BACKEND_NAME, communicator, grow, join, native_backend, register, shrink

__all__ = ["BACKEND_NAME", "communicator", "grow", "join", "native_backend", "register",
           "shrink"]

register()
