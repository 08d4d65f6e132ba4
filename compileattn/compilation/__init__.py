"""The torch.compile side: the ``compileattn`` backend (``backend.py``), which splits the graph at
attention and compiles the pieces (``piecewise.py``, FX passes in ``compileattn.passes``); the
per-step dispatcher that picks full-graph, piecewise or graph-free execution (``dispatch.py``);
the CUDA-graph wrapper per piece and size (``cudagraph.py``); the compile cache (``cache.py``);
``@compileattn.compile`` (``decorator.py``) and debug dumps (``debug.py``)."""
