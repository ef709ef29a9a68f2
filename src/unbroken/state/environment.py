"""The environment a generation was written in: the software, hardware and numerics settings
that decide whether a resumed run can be bitwise equal to the uninterrupted one (compared on
restore by `identity.check_environment`, which warns and never refuses)."""

from __future__ import annotations

import platform
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


def environment() -> dict[str, Any]:
    """Software, hardware and numerics settings that decide whether results are bitwise equal.
    Loader knobs such as ``num_workers`` are absent: the data order does not depend on them."""
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    # Device names only once CUDA is initialized: asking for them initializes it, which would
    # add CUDA RNG streams to the process between a save and the next one.
    names = ([torch.cuda.get_device_name(i) for i in range(count)]
             if cuda and torch.cuda.is_initialized() else None)
    distributed = dist.is_available() and dist.is_initialized()
    return {
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "numpy": np.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cuda_available": cuda,
        "cuda_version": torch.version.cuda,
        "cuda_device_count": count,
        "cuda_devices": names,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        # TF32 changes matmul/conv results bitwise, just like the algorithm choice.
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        # CPU reductions split work by thread: 1 and 2 threads give different bits.
        "num_threads": torch.get_num_threads(),
        "world_size": dist.get_world_size() if distributed else 1,
        "rank": dist.get_rank() if distributed else 0,
    }
