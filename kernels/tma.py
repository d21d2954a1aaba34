"""Whether a tensor can be read through a TMA tensor descriptor (Hopper's bulk tensor copies), for the kernels
that load through descriptors where they can and through pointers elsewhere."""

from __future__ import annotations

import torch


def tma_ready(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor can describe `t`: Hopper or later (or the interpreter), unit last stride,
    16-byte aligned base and strides."""
    if t.is_cuda and torch.cuda.get_device_capability(t.device)[0] < 9:
        return False
    size = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(st * size % 16 == 0 for st in t.stride()[:-1]))
