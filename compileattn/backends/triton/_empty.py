"""An empty Triton kernel: the floor of a Triton launch's host cost, for benchmarks/op_overhead.py.
(At module level because Triton resolves a kernel's globals, such as ``tl``, from its module.)"""
import triton
import triton.language as tl


@triton.jit
def empty_kernel(x, n: tl.constexpr):
    pass
