"""r2comm as a torch.distributed backend: `import r2comm.torch` registers the backend "r2comm".

    import torch.distributed as dist
    import r2comm.torch                      # registers "r2comm"
    dist.init_process_group("r2comm")        # under torchrun (env://), or with a store

The ranks bootstrap through the process group's store (torchrun's TCPStore, or any Store given
to init_process_group): Communicator.from_store, no MPI. Everything after that runs on r2comm's
own connections (every rail to every peer, failover included). See backend.py for what each
collective does; contiguous CUDA tensors take r2comm's device-buffer pipeline when cupy is
installed (r2comm/gpu), else a host copy."""
from .backend import ProcessGroupR2comm, register, BACKEND_NAME  # noqa: F401

register()
