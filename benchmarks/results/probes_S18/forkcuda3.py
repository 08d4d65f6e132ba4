import os, sys, ctypes
import torch, compileattn
from compileattn.compilation import fork_server, compile_pool
print("device_count", torch.cuda.device_count(), "why_not", fork_server.why_not_fork_here(), flush=True)
real_touched = fork_server.cuda_touched
def touched():
    why = real_touched()
    paths = {l.split(None, 5)[-1].strip() for l in open("/proc/self/maps") if "libcuda.so" in l}
    for p in paths:
        d = ctypes.CDLL(p, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        c = ctypes.c_int()
        print(f"  [{os.getpid()}] cuDeviceGetCount -> {d.cuDeviceGetCount(ctypes.byref(c))}, torch init {torch.cuda.is_initialized()}, fds {len(os.listdir('/proc/self/fd'))}", file=sys.stderr, flush=True)
    return why
fork_server.cuda_touched = touched
real_closerange = os.closerange
for variant in ["plain"]:
    os.closerange = (lambda a, b: None) if variant == "noclose" else real_closerange
    import gc
    freeze = gc.freeze
    if variant == "nofreeze":
        gc.freeze = lambda: None
    s = fork_server.ForkServer(compile_pool._worker_env(), 10, 120, fork_here=True)
    try:
        w = s.fork(); print(variant, "forked ok", w.pid, flush=True); w.stdin.close()
    except Exception as e:
        print(variant, "ForkError:", e, flush=True)
    s.close()
    gc.freeze = freeze
os.closerange = real_closerange
r, w = os.pipe()
s = fork_server.ForkServer(compile_pool._worker_env(), 10, 120, fork_here=True)
wk = s.fork(); print("forked ok", wk.pid, flush=True)
os.close(w)
print("EOF with server alive:", os.read(r, 1) == b"", flush=True)
wk.stdin.close(); s.close()
