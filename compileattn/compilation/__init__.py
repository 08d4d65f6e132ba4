"""The torch.compile side: the ``compileattn`` backend (``backend.py``), which splits the graph at
attention and compiles each distinct piece once (``piecewise.py``, ``piece_signature.py``; FX passes
in ``compileattn.passes``); the per-step dispatcher that picks full-graph, piecewise or graph-free
execution (``dispatch.py``) and saves itself (``artifact.py``); the CUDA-graph wrapper per piece and
size (``cudagraph.py``); the per-piece compile cache and cache-dir checks (``cache.py``);
``@compileattn.compile`` (``decorator.py``, its argument check ``argcheck.py``, its Dynamo-free warm
start ``warm_start.py``) and debug dumps (``debug.py``)."""
