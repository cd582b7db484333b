"""The CUDA caching allocator's peak over one backward, for the memory tests."""

import torch


def backward_peak(out: torch.Tensor, grad: torch.Tensor) -> int:
    """Bytes allocated at most during ``out.backward(grad)`` above what was allocated when it
    started."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out.backward(grad)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base
