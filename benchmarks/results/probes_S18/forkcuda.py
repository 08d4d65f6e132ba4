import os, sys, time, ctypes
t0 = time.perf_counter()
import torch
import compileattn
from compileattn.compilation import fork_server
print("parent: why_not_fork_here =", fork_server.why_not_fork_here(), flush=True)
maps = [l.split()[-1] for l in open("/proc/self/maps") if "libcuda" in l]
print("parent libcuda maps:", sorted(set(maps)), flush=True)
pid = os.fork()
if pid == 0:
    try:
        print("child at start:", fork_server.cuda_touched(), flush=True)
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
        import importlib
        for mod in ["triton", "triton.runtime.driver", "torch._dynamo", "torch._inductor.config",
                    "torch._inductor.compile_fx", "torch._inductor.codecache", "torch._inductor.async_compile"]:
            importlib.import_module(mod)
            print(f"child after {mod}:", fork_server.cuda_touched(), flush=True)
        from compileattn.compilation.compile_pool import import_for_worker
        import_for_worker()
        print("child after import_for_worker:", fork_server.cuda_touched(), flush=True)
    except BaseException as e:
        print("child error", repr(e), flush=True)
    finally:
        os._exit(0)
os.waitpid(pid, 0)
# Same in a child forked after only torch + NVML env set in the parent before torch import
