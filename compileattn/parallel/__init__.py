"""Tensor parallelism over ``torch.distributed``: the TP group, sharding plans, the all-reduce
kept inside compiled pieces, and a driver whose rank 0 decides every step.

Launch: ``torchrun --nproc-per-node N -m compileattn.parallel.check ...`` (or your script), then
in each process::

    tp = init_tp()                                   # NCCL on GPUs, gloo on CPUs; warmed up
    model = shard_model(LlamaForCausalLM(cfg, device=tp.device))   # this rank's heads and columns
    caches = allocate_kv_caches(model.attention_specs(), ...)      # this rank's KV heads

``group.py`` explains what CUDA-graph capture of NCCL collectives needs and where each point is
met; ``comm.py`` which all-reduce algorithm runs when (NCCL, or one-shot / two-shot over
symmetric memory).
"""
from .comm import all_reduce
from .driver import StepPlan, TPEngine
from .failure import TPGroupFailed
from .group import CallMismatch, TPGroup, get_tp, init_tp, shutdown_tp
from .layers import HeadShard, RowParallelLinear
from .shard import shard_model

__all__ = ["CallMismatch", "HeadShard", "RowParallelLinear", "StepPlan", "TPEngine", "TPGroup", "TPGroupFailed",
           "all_reduce", "get_tp", "init_tp", "shard_model", "shutdown_tp"]
