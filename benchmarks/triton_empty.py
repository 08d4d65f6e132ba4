"""An empty Triton kernel: the floor of a Triton launch's host cost, for ``op_overhead.py``.
(A module of its own because Triton resolves a kernel's globals, such as ``tl``, from the module
the kernel is defined in.)"""
import triton
import triton.language as tl


@triton.jit
def empty_kernel(x, n: tl.constexpr):
    pass
