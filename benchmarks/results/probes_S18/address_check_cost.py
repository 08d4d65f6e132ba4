import time, torch, sys
f = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
print(torch.__version__, "helper:", f is not None, flush=True)
for n in (148, 291, 600):
    ts = [torch.nn.Parameter(torch.randn(4, device="cuda")) for _ in range(n)]
    ptrs = [t.data_ptr() for t in ts]
    idx = list(range(n))
    res = {}
    for rep in range(5):
        t0 = time.perf_counter()
        for _ in range(20000): f(ts, ptrs, idx)
        t1 = time.perf_counter()
        for _ in range(2000):
            for i, p in zip(idx, ptrs):
                if ts[i].data_ptr() != p: break
        t2 = time.perf_counter()
        t3 = time.perf_counter()
        for _ in range(20000): pass
        t4 = time.perf_counter()
        res.setdefault("c", []).append((t1 - t0) / 20000 * 1e6)
        res.setdefault("py", []).append((t2 - t1) / 2000 * 1e6)
    print(n, "C helper us min/med", min(res["c"]), sorted(res["c"])[2], "py loop us", min(res["py"]), flush=True)
    bad = list(ptrs); bad[-1] += 4
    print("  detects:", f(ts, ptrs, idx), f(ts, bad, idx))
