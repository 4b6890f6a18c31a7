"""What the in-loop tuner counts as out of memory (``runtime.out_of_memory``); the recovery itself runs on
ranks in ``test_autotuner.py``."""

from __future__ import annotations

import torch

from runtime.out_of_memory import is_out_of_memory


def test_out_of_memory_is_the_devices_error_or_the_cpu_allocators_and_nothing_else():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate "
                                         "memory: you tried to allocate 68719476736 bytes"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))  # not an allocator's error
    assert not is_out_of_memory(KeyboardInterrupt())
