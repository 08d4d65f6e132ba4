"""The exit's wait for static pieces still out is bounded for the whole process
(``EXIT_WAIT_FOR_STATIC_S``), not once per compiled function."""
import random
import time

import compileattn as ca
from compileattn.compilation import decorator
from test_static_landing import _setup, _step, held  # noqa: F401 (fixture)


def test_two_functions_waiting_at_exit_share_one_bound(held, monkeypatch, tmp_path):  # noqa: F811
    registered = []

    class Exit:
        register = staticmethod(registered.append)
        unregister = staticmethod(registered.remove)

    monkeypatch.setattr(decorator, "_at_exit", Exit)
    monkeypatch.setattr(decorator, "_exit_wait_started", None, raising=False)
    monkeypatch.setattr(decorator, "EXIT_WAIT_FOR_STATIC_S", 1.0)
    for seed in (0, 1):
        model, caches, builder, make_inputs, cfg = _setup(cache_dir=str(tmp_path / f"cache{seed}"),
                                                          cudagraph_mode="none")
        forward = ca.compile(model.forward, dynamic_arg_dims={"input_ids": 0, "positions": 0}, config=cfg)
        _step(random.Random(seed), model, forward, builder, caches, make_inputs, decode=True)
    assert len(registered) == 2 and len(held) == 2  # nothing answered: both wait
    start = time.monotonic()
    for at_exit in reversed(list(registered)):  # what the interpreter runs at exit
        at_exit()
    assert time.monotonic() - start < 1.8
