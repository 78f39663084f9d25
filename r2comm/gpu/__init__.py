"""Device (GPU) buffers: the chunked, pipelined staging path of r2comm's collectives.

A collective called with device arrays (cupy arrays, CUDA tensors through the torch backend, or
the host stand-in's arrays in tests) runs as a pipeline of segments (pipeline.py): per segment a
device-to-host copy into a pinned buffer of a pool, the engine's non-blocking collective(s) on
that pinned memory, and a host-to-device copy of the result, with the copies on their own streams
so that segment k+1's copy overlaps segment k on the wire. Reductions either run on the device
(R2COMM_GPU_REDUCE=device, the default: all-to-all of the segment, a reduction kernel in rank
order, all-gather of the reduced blocks) or in the engine on the pinned host copies (=host).

Everything device-specific sits behind a small interface (device.DeviceBackend) with two
implementations: cupy (cupy_backend.py, imported only when a cupy array is passed) and a host
stand-in (standin.py: numpy memory, one worker thread per stream acting as the copy engine, with
settable delays) on which the pipeline's logic is tested without a GPU.

GPUDirect RDMA (registering device memory with the NIC) is not implemented: every rail reports
the staged-pipelined path (Communicator.gpu_path, Rail.gpu_path)."""
from .backend import (DeviceBackend, backend_for, is_device, bfloat16, Typed,  # noqa: F401
                      GPU_PATH, GPUDIRECT_REASON)
