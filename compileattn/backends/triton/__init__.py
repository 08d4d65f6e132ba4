"""The ``triton`` backend: own Triton kernels (KV write, GQA-packed split-KV paged decode,
unified varlen attention), CUDA-graph capturable, runnable on the CPU under TRITON_INTERPRET=1.

Modules: ``tile`` (shared device helpers), ``kv_write``, ``decode``, ``unified`` (kernels),
``config`` (tile/split heuristics), ``launch`` (bound launchers), ``backend`` (TritonBackend and
its per-step plan), ``_mode`` (interpreter-mode bookkeeping).
"""


def __getattr__(name):
    # Lazy, so importing the package does not import triton until the backend is asked for.
    if name == "TritonBackend":
        from .backend import TritonBackend

        return TritonBackend
    raise AttributeError(name)
