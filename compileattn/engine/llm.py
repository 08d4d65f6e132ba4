"""``compileattn.LLM``: offline generation with a Hugging Face checkpoint (or an own model).

``LLM(model)`` loads the model (a local directory written by ``save_pretrained``, or a
``PreTrainedModel`` already in memory), routes its attention through compileattn, sizes the paged
KV cache, compiles the forward (on CUDA by default: piecewise CUDA graphs, full graphs for decode
steps) and serves ``generate`` with continuous batching. The model is taken over: it is put in eval
mode and its attention implementation switched to compileattn's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import time
from numbers import Real
from pathlib import Path
from typing import Any, Sequence

import torch

from ..config import CompileConfig
from ..argtypes import as_int, integer_as_int, is_bool, serving_device
from . import kv_budget
from .engine import Engine, check_positive_ints
from .request import FinishReason, Request, SamplingParams
from .sampler import sampling_key
from .throughput import counted

logger = logging.getLogger("compileattn")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class RequestMetrics:
    """Seconds from the start of the ``generate`` call, measured on the host after each step."""

    first_token_s: float
    finish_s: float
    num_preemptions: int

    def time_per_output_token_s(self, num_output_tokens: int) -> float | None:
        """Decode time per token after the first (None with fewer than two tokens)."""
        if num_output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (num_output_tokens - 1)


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    #: Generated tokens; a stop or EOS token that ended the request is the last one.
    token_ids: list[int]
    #: The decoded ``token_ids`` (special tokens skipped) when the LLM has a tokenizer.
    text: str | None
    finish_reason: FinishReason
    metrics: RequestMetrics


def _dtype(value: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    if value is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(value, str):
        if value not in _DTYPES:
            raise ValueError(f"dtype={value!r}; choose from {list(_DTYPES)}")
        return _DTYPES[value]
    if value not in _DTYPES.values():
        raise TypeError(f"dtype={value}; supported: {list(_DTYPES)}")
    return value


def _device(value: torch.device | str | int | None) -> torch.device | None:
    """``device`` as a ``torch.device`` the engine can run on (``argtypes.serving_device``), or None
    (the default)."""
    return None if value is None else serving_device(value)


def _eos_token_ids(hf_model, tokenizer) -> tuple[int, ...]:
    """EOS ids from the generation config, else the model config, else the tokenizer."""
    candidates = [getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None),
                  getattr(getattr(hf_model, "config", None), "eos_token_id", None),
                  getattr(tokenizer, "eos_token_id", None)]
    for eos in candidates:
        if eos is not None:
            return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    return ()


class LLM:
    """Offline generation with continuous batching over a paged KV cache.

    Args:
        model: a directory with ``config.json`` and safetensors weights (and, optionally, a
            tokenizer), a transformers ``PreTrainedModel``, or a model with compileattn's interface
            (``compileattn.models``).
        tokenizer: overrides the directory's tokenizer; needed for string prompts and ``text``.
        dtype, device: where the model runs (default: bfloat16 on CUDA when available, else
            float32 on the CPU; an in-memory model is moved only when they are given). ``device``
            is a ``torch.device``, 'cpu', 'cuda', 'cuda:N' or an int N (a CUDA index, as in torch).
        block_size: tokens per KV-cache block.
        max_num_seqs: sequences per step at most.
        max_num_batched_tokens: tokens per step at most (prefill chunks and decodes together).
        max_model_len: longest sequence (prompt + output); default: the model's, capped by the cache.
        kv_cache_memory, num_blocks: cache size as bytes or as a block count (at most one);
            default: measured on CUDA (``gpu_memory_utilization`` of the device); on the CPU 256 MiB at
            most, or one sequence of ``max_model_len`` tokens where that is more.
        compile_config: ``"auto"`` (compile on CUDA with the default ``CompileConfig``, eager
            elsewhere), a ``CompileConfig``, or None (eager).
        attention_backend: the attention kernels (``"auto"``, ``"flash"``, ``"triton"``,
            ``"reference"``); a ``CompileConfig`` passed in names its own.
        allow_pickle: also load pickled ``*.bin`` weights (they can run code).
        enable_prefix_caching: prompts that start alike (a shared system prompt, say) share the
            KV-cache blocks of their common prefix, within and across ``generate`` calls, and only
            the rest is computed. Off by default: in half precision a prefix served from the cache
            differs in rounding from a full prefill, so outputs agree within tolerance but not
            bit for bit with caching off.
        tensor_parallel_size: shard the model over this many processes, one GPU each (gloo on the
            CPU), by its ``base_model_tp_plan`` (or an own model's ``tp_plan``). Every process runs
            the same program under ``torchrun --nproc-per-node N``: each builds its ``LLM`` and calls
            ``generate`` with the same arguments; rank 0 schedules and samples, the others run the
            steps it broadcasts, and every rank returns rank 0's outputs.

    Raises ``compileattn.refusals.ServingRefused`` (a ValueError) where these arguments or this
    model cannot be served, with the reason: a ``max_model_len`` beyond the model or the cache, a
    cache budget that holds no block, a directory whose config transformers refuses or whose
    weights do not match it, a model compileattn cannot serve (``UnsupportedModelError``). Those
    are refusals by design; any other exception out of the build is a failure.
    """

    def __init__(self, model: Any, *, tokenizer: Any = None, dtype: torch.dtype | str | None = None,
                 device: torch.device | str | int | None = None, block_size: int = 16, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, max_model_len: int | None = None,
                 kv_cache_memory: int | None = None, num_blocks: int | None = None,
                 gpu_memory_utilization: float = 0.9, compile_config: CompileConfig | str | None = "auto",
                 attention_backend: str = "auto", allow_pickle: bool = False, tensor_parallel_size: int = 1,
                 enable_prefix_caching: bool = False):
        checked = self.check_arguments(
            tokenizer=tokenizer, device=device, block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            kv_cache_memory=kv_cache_memory, num_blocks=num_blocks, gpu_memory_utilization=gpu_memory_utilization,
            attention_backend=attention_backend, allow_pickle=allow_pickle, tensor_parallel_size=tensor_parallel_size,
            enable_prefix_caching=enable_prefix_caching)
        device, block_size, max_num_seqs, max_num_batched_tokens, max_model_len, kv_cache_memory, num_blocks = (
            checked[k] for k in ("device", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                                 "kv_cache_memory", "num_blocks"))
        allow_pickle, tensor_parallel_size = checked["allow_pickle"], checked["tensor_parallel_size"]
        self.tp = None
        building = contextlib.nullcontext()
        if tensor_parallel_size > 1:
            from ..parallel import init_tp
            from ..parallel.failure import building_in_step

            self.tp = init_tp(tensor_parallel_size, device=None if device is None else torch.device(device).type)
            device = self.tp.device
            building = building_in_step(self.tp)  # a rank failing here would leave the others in a collective
        with building:
            if self.tp is not None:  # resolved once: the call below returns a resolved config as it is
                compile_config = self._compile_config(compile_config, self.tp.device, attention_backend,
                                                      max_num_seqs, max_num_batched_tokens)
                self._agree_on_build(self.tp, model, dtype, block_size, max_num_seqs, max_num_batched_tokens,
                                     max_model_len, compile_config)
            self.model, self.tokenizer, hf_model = self._load(model, tokenizer, dtype, device, allow_pickle, self.tp)
            param = next(self.model.parameters())
            device, dtype = param.device, param.dtype
            compile_config = self._compile_config(compile_config, device, attention_backend, max_num_seqs,
                                                  max_num_batched_tokens)
            if compile_config is not None:
                attention_backend = compile_config.attention_backend
            self._check_backends(attention_backend, dtype, device, block_size)

            specs = self.model.attention_specs()
            model_len = min(self.model.max_position, max_model_len or self.model.max_position)
            if num_blocks is None:
                if kv_cache_memory is None:
                    kv_cache_memory = (kv_budget.profile_cuda_budget(
                        self.model, block_size=block_size, max_num_tokens=max_num_batched_tokens,
                        max_num_seqs=max_num_seqs, max_model_len=model_len, dtype=dtype, device=device,
                        attention_backend=attention_backend, gpu_memory_utilization=gpu_memory_utilization)
                        if device.type == "cuda" else
                        kv_budget.cpu_default_bytes(specs, block_size, dtype, max_num_seqs, model_len))
                num_blocks = kv_budget.blocks_for_memory(specs, block_size, dtype, kv_cache_memory)
            if self.tp is not None:  # every rank must hand out the same blocks: the smallest cache
                num_blocks = min(self.tp.all_gather_object(num_blocks))
            if max_model_len is None:
                max_model_len = min(model_len, num_blocks * block_size)
            kv_budget.log_capacity(num_blocks, block_size, kv_budget.bytes_per_block(specs, block_size, dtype),
                                   max_model_len, max_num_seqs)
            engine_args = dict(block_size=block_size, num_blocks=num_blocks, max_num_tokens=max_num_batched_tokens,
                               max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                               attention_backend=attention_backend, compile_config=compile_config,
                               eos_token_ids=_eos_token_ids(hf_model, self.tokenizer),
                               enable_prefix_caching=enable_prefix_caching)
            if self.tp is None:
                self.engine = Engine(self.model, **engine_args)
            else:
                from ..parallel import TPEngine

                self.engine = TPEngine(self.model, tp=self.tp, **engine_args)

    # -- construction --------------------------------------------------------------------------

    @staticmethod
    def check_arguments(*, tokenizer: Any = None, device: torch.device | str | int | None = None, block_size: int = 16,
                        max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, max_model_len: int | None = None,
                        kv_cache_memory: int | None = None, num_blocks: int | None = None,
                        gpu_memory_utilization: float = 0.9, attention_backend: str = "auto",
                        allow_pickle: bool = False, tensor_parallel_size: int = 1,
                        enable_prefix_caching: bool = False) -> dict[str, Any]:
        """The constructor's arguments that need no model, checked as the constructor checks them
        (it calls this first): the TypeError or ValueError naming the argument, or the arguments by
        name, normalized (``device`` a ``torch.device`` or None, numpy's integers as ints,
        ``kv_cache_memory`` a number, ``allow_pickle`` a bool). Nothing is loaded, sized or
        initialized; so a caller that must tell a mistake in its arguments from a failure of the
        build (the command line: the build also profiles memory on CUDA and compiles, whose own
        ValueErrors are not the user's) checks them first. The model directory's own checks are
        ``hf.loading.check_model_directory``. Defaults are the constructor's."""
        if kv_cache_memory is not None and num_blocks is not None:
            raise ValueError("pass kv_cache_memory or num_blocks, not both")
        device = _device(device)
        # numpy's integers as ints (``argtypes``): the engine takes Python ints only, and they size
        # the cache and the steps.
        block_size, max_num_seqs, max_num_batched_tokens, num_blocks, max_model_len, tensor_parallel_size = map(
            integer_as_int, (block_size, max_num_seqs, max_num_batched_tokens, num_blocks, max_model_len,
                             tensor_parallel_size))
        # Before anything is loaded or sized with them (a 0 divided the KV budget's log line).
        check_positive_ints(block_size=block_size, max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens,
                            **{k: v for k, v in (("num_blocks", num_blocks), ("max_model_len", max_model_len))
                               if v is not None})
        if kv_cache_memory is not None:
            memory = as_int(kv_cache_memory)  # an int, numpy's, a 0-dim integer tensor; or a float
            if memory is None and isinstance(kv_cache_memory, Real) and not is_bool(kv_cache_memory):
                memory = kv_cache_memory
            if memory is None or not 0 < memory < math.inf:
                raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {kv_cache_memory!r}")
            kv_cache_memory = memory
        kv_budget.check_utilization(gpu_memory_utilization)
        if tokenizer is not None and not all(callable(getattr(tokenizer, m, None)) for m in ("encode", "decode")):
            raise TypeError(f"tokenizer must have encode() and decode() (a transformers tokenizer), got "
                            f"{type(tokenizer).__name__}")
        from ..backends.selector import check_backend_name

        check_backend_name(attention_backend)
        if not isinstance(enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be a bool, got {enable_prefix_caching!r}")
        # Read as a truth value, a string such as "false" would load pickled weights, which can run code.
        if not is_bool(allow_pickle):
            raise TypeError(f"allow_pickle must be a bool, got {allow_pickle!r}")
        allow_pickle = bool(allow_pickle)
        if not isinstance(tensor_parallel_size, int) or isinstance(tensor_parallel_size, bool) or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive int, got {tensor_parallel_size!r}")
        return dict(tokenizer=tokenizer, device=device, block_size=block_size, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                    kv_cache_memory=kv_cache_memory, num_blocks=num_blocks,
                    gpu_memory_utilization=gpu_memory_utilization, attention_backend=attention_backend,
                    allow_pickle=allow_pickle, tensor_parallel_size=tensor_parallel_size,
                    enable_prefix_caching=enable_prefix_caching)

    @staticmethod
    def _agree_on_build(tp, model, dtype, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                        max_model_len: int | None, compile_config: CompileConfig | None) -> None:
        """Under tensor parallelism every rank must build with the settings that decide which
        forwards it runs (the compile's warm-up step, one capture per size and kind), how each
        step is padded and which steps it can run (``max_model_len`` sizes each rank's block tables:
        rank 0 schedules up to its own), or the build's and the steps' collectives pair up wrongly
        or a step fails on one rank alone: a rank compiling while another did not waited for ever
        in the warm-up's all-reduce, capture sizes that differ aborted a rank in gloo ("collective
        mismatch") with "connection reset" on the other, and a rank with a shorter max_model_len
        ended the group at rank 0's first longer sequence.
        One gather before the load's first collective; every rank raises a ValueError naming the
        settings that differ (the settings each rank may keep its own, such as a ``cache_dir``,
        are not compared)."""
        if dtype is not None or isinstance(model, (str, Path)):
            dtype = _dtype(dtype, tp.device)
        mode = None if compile_config is None else compile_config.resolved_cudagraph_mode(tp.device.type)
        mine = {"dtype": str(dtype), "block_size": block_size, "max_num_seqs": max_num_seqs,
                "max_num_batched_tokens": max_num_batched_tokens, "max_model_len": max_model_len,
                "compiled": compile_config is not None,
                "compile_config.cudagraph_mode": mode,
                "compile_config.capture_sizes": None if compile_config is None else compile_config.capture_sizes}
        settings = tp.agree("LLM(...)", mine)
        differ = [f"{name} (" + "; ".join(f"rank {r}: {s[name]!r}" for r, s in enumerate(settings)) + ")"
                  for name in mine if len({repr(s[name]) for s in settings}) > 1]
        if differ:
            raise ValueError(f"tensor parallel LLM: the ranks' settings differ: {', '.join(differ)}; every rank must "
                             f"build its LLM with the same settings (they decide the forwards each rank runs, and "
                             f"so the collectives that must pair up)")

    @staticmethod
    def _load(model, tokenizer, dtype, device, allow_pickle, tp=None):
        """(served model, tokenizer or None, the transformers model or None); with ``tp``, this
        rank's shard (sharded before the attention probe, so each layer's spec has its local heads)."""
        from_dir = isinstance(model, (str, Path))
        if from_dir or _is_pretrained(model):
            from ..hf.model import HFCausalLM

            if from_dir:
                from ..hf.loading import load_model, load_tokenizer

                device = torch.device(device if device is not None else
                                      ("cuda" if torch.cuda.is_available() else "cpu"))
                hf_model = load_model(model, dtype=_dtype(dtype, device), device=device, allow_pickle=allow_pickle)
                if tokenizer is None:
                    tokenizer = load_tokenizer(model)
            else:
                hf_model = model
                if dtype is not None or device is not None:
                    target = torch.device(device) if device is not None else hf_model.device
                    hf_model.to(device=target, dtype=_dtype(dtype, target) if dtype is not None else None)
            if tp is not None:
                from ..parallel import shard_model

                shard_model(hf_model.eval(), tp=tp)
            return HFCausalLM(hf_model, served_by="LLM"), tokenizer, hf_model
        if not all(hasattr(model, a) for a in ("attention_specs", "compute_logits", "vocab_size", "max_position")):
            raise TypeError(f"model must be a directory, a transformers PreTrainedModel or a compileattn model "
                            f"(forward, compute_logits, attention_specs, vocab_size, max_position); got "
                            f"{type(model).__name__}")
        if dtype is not None or (device is not None and tp is None):
            raise ValueError("dtype/device apply to transformers models; build a compileattn model where it runs")
        if tp is not None:
            from ..parallel import shard_model

            shard_model(model, tp=tp)
        return model, tokenizer, None

    @staticmethod
    def _compile_config(compile_config, device: torch.device, attention_backend: str, max_num_seqs: int,
                        max_num_batched_tokens: int) -> CompileConfig | None:
        if compile_config == "auto":
            if device.type != "cuda":
                return None
            # Decode steps of up to max_num_seqs tokens replay full graphs; mixed steps up to 256
            # tokens replay piecewise ones. A server captures its graphs once while warming up:
            # it waits for the static pieces rather than capture again mid-serving.
            return CompileConfig(attention_backend=attention_backend,
                                 max_capture_size=min(max(256, max_num_seqs), max_num_batched_tokens),
                                 background_static_compiles=False)
        if compile_config is not None and not isinstance(compile_config, CompileConfig):
            raise TypeError(f"compile_config must be a CompileConfig, 'auto' or None, got {compile_config!r}")
        return compile_config

    def _check_backends(self, attention_backend: str, dtype: torch.dtype, device: torch.device,
                        block_size: int) -> None:
        """Refuse, before any cache is allocated, a layer no attention backend runs: the selector's
        ``UnsupportedConfigurationError`` becomes an ``UnsupportedModelError`` naming the layer. Only
        that refusal: another ValueError out of the selection (a backend's own bug) propagates as
        it is, not reported as a model compileattn cannot serve."""
        from ..backends.selector import UnsupportedConfigurationError, choose, regime_of

        for name, spec in self.model.attention_specs().items():
            try:
                for uniform_decode in (True, False):
                    choose(attention_backend, spec, dtype, device, block_size, regime_of(device, uniform_decode))
            except UnsupportedConfigurationError as exc:
                from ..hf.model import UnsupportedModelError

                raise UnsupportedModelError(f"{name}: {exc}") from None

    # -- generation ----------------------------------------------------------------------------

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 max_new_tokens: int | Sequence[int] = 16, *, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (a string, needing a tokenizer, or a list of token ids);
        results in prompt order. ``max_new_tokens`` may be one per prompt. ``seed`` fixes the
        sampling of ``temperature`` > 0: prompt i draws with the seed ``sampling_key(seed, i)``, so
        a call repeats its tokens, prefix caching, batch sizes and preemptions notwithstanding
        (None: random draws)."""
        engine = self.engine
        failure = getattr(engine, "failure", None)
        if failure is not None:  # before any collective: the group is gone
            raise type(failure)(f"this LLM cannot generate: {failure}", failure.ranks)
        try:
            if engine.has_unfinished():
                raise RuntimeError("the engine has unfinished requests from an interrupted call; create a new LLM")
            prompts, token_prompts, params = self._requests(prompts, max_new_tokens, temperature, top_p, seed,
                                                            stop_token_ids, ignore_eos)
        except Exception as exc:
            if self.tp is not None:  # so no rank waits alone for the others' agreement
                self._agree_across_ranks(None, refused=exc)
            raise
        if self.tp is not None:
            self._agree_across_ranks(hashlib.sha256(repr((token_prompts, params)).encode()).hexdigest())
        if self.tp is not None and not self.tp.is_driver:
            engine.serve()  # rank 0's steps, until its generate ends
            with engine.group_ends_on_error("in generate"):
                result = self.tp.broadcast_object(None)
            if isinstance(result, BaseException):
                raise RuntimeError(f"rank 0's generate failed: {result}") from result
            return result
        start = time.perf_counter()
        stats = engine.prefix_cache_stats
        looked_up, hit = stats.queried_tokens, stats.hit_tokens
        try:
            outputs = self._run(engine, params, token_prompts, prompts, use_tqdm, start)
        except BaseException as exc:
            if self.tp is not None and engine.failure is None:  # else the group is shut down on every rank
                with engine.group_ends_on_error("in generate"):
                    if engine.step_unrun:  # the others are in its collectives, not waiting for the end: end the group
                        raise
                    engine.stop_workers()
                    self.tp.broadcast_object(RuntimeError(f"{type(exc).__name__}: {exc}"))
            raise
        if self.tp is not None:
            with engine.group_ends_on_error("in generate"):
                engine.stop_workers()
                self.tp.broadcast_object(outputs)
        elapsed = time.perf_counter() - start
        num_out = sum(len(o.token_ids) for o in outputs)
        logger.info("generated %s for %s in %.2f s (%.1f tokens/s, %s)", counted(num_out, "token"),
                    counted(len(outputs), "request"), elapsed, num_out / elapsed if elapsed > 0 else 0.0,
                    counted(sum(o.metrics.num_preemptions for o in outputs), "preemption"))
        if engine.prefix_caching:
            logger.info("prefix cache: %d of %d looked-up tokens hit", stats.hit_tokens - hit,
                        stats.queried_tokens - looked_up)
        return outputs

    def check_requests(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                       max_new_tokens: int | Sequence[int] = 16, *, temperature: float = 0.0, top_p: float = 1.0,
                       seed: int | None = None, stop_token_ids: Sequence[int] | None = None,
                       ignore_eos: bool = False) -> None:
        """Raise the TypeError or ValueError that ``generate`` raises for these arguments, running
        nothing (an iterator of prompts is read up): ``generate`` makes the same checks before its
        first step, so a caller that must tell the user's mistakes from failures of the run (the
        command line) checks first and then generates."""
        self._requests(prompts, max_new_tokens, temperature, top_p, seed, stop_token_ids, ignore_eos)

    def _requests(self, prompts, max_new_tokens, temperature, top_p, seed, stop_token_ids, ignore_eos):
        """``generate``'s arguments checked and converted: (prompts as a list, their token ids, one
        ``SamplingParams`` each); a TypeError or ValueError naming the argument, or the prompt whose
        tokens this engine cannot serve (``Engine.check_prompts``)."""
        if isinstance(prompts, torch.Tensor):
            raise TypeError("prompts must be a string, a list of token ids or a list of those, got a Tensor "
                            "(pass tensor.tolist())")
        if isinstance(prompts, (bytes, bytearray, dict)) or not hasattr(prompts, "__iter__"):  # str has __iter__
            raise TypeError(f"prompts must be a string, a list of token ids or a list of those, got "
                            f"{type(prompts).__name__}")
        if not isinstance(prompts, str):
            prompts = list(prompts)  # once: an iterator's items are read here, not also by the test below
        if isinstance(prompts, str) or (prompts and all(as_int(t) is not None for t in prompts)):
            prompts = [prompts]
        if as_int(stop_token_ids) is not None:
            raise TypeError(f"stop_token_ids must be a sequence of token ids, got the int {stop_token_ids} "
                            f"(pass [{stop_token_ids}])")
        stop = _token_ids("stop_token_ids", stop_token_ids if stop_token_ids is not None else ())
        if not is_bool(ignore_eos):
            raise TypeError(f"ignore_eos must be a bool, got {ignore_eos!r}")
        ignore_eos = bool(ignore_eos)
        for name, value in (("temperature", temperature), ("top_p", top_p)):
            if isinstance(value, bool):
                raise TypeError(f"{name} must be a number, got {value!r}")
        length = as_int(max_new_tokens)
        if length is not None:
            lengths = [length] * len(prompts)
        elif isinstance(max_new_tokens, (str, bytes)) or not hasattr(max_new_tokens, "__iter__"):
            raise TypeError(f"max_new_tokens must be an int or one int per prompt, got {max_new_tokens!r}")
        else:  # SamplingParams takes numpy's integers as ints and refuses anything else, by name
            lengths = list(max_new_tokens)
        if len(lengths) != len(prompts):
            raise ValueError(f"max_new_tokens has {len(lengths)} entries for {len(prompts)} prompts")
        seed = integer_as_int(seed)  # numpy's integers as ints, as SamplingParams takes them
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        params = [SamplingParams(max_new_tokens=n, temperature=temperature, top_p=top_p,
                                 stop_token_ids=stop, ignore_eos=ignore_eos,
                                 seed=None if seed is None else sampling_key(seed, i))
                  for i, n in enumerate(lengths)]
        token_prompts = self.engine.check_prompts(params, [self._encode(p, i) for i, p in enumerate(prompts)])
        return prompts, token_prompts, params

    def _agree_across_ranks(self, digest: str | None, refused: BaseException | None = None) -> None:
        """Under tensor parallelism every rank must call ``generate`` with the same arguments: rank 0
        schedules and every rank returns rank 0's outputs, so a rank that passed other prompts got
        outputs for prompts it never passed. One gather of a digest per call; a rank that refused
        its arguments (``refused``, which it raises itself) takes part too, so the others raise
        instead of waiting for it. The gather ends the group on error as a step does: a peer that
        failed or left is named, not seen as a bare "connection closed"."""
        with self.engine.group_ends_on_error("in generate"):
            answers = self.tp.agree("LLM.generate", (digest, None if refused is None else f"{type(refused).__name__}: "
                                                                                         f"{refused}"))
        refusals = {rank: why for rank, (_, why) in enumerate(answers) if why is not None}
        if refused is not None:
            return
        if refusals:
            raise ValueError("tensor parallel generate: " + "; ".join(
                f"rank {rank} refused its arguments ({why})" for rank, why in refusals.items()) +
                "; every rank must call generate with the same prompts, lengths and sampling settings")
        digests = [d for d, _ in answers]
        if len(set(digests)) > 1:
            raise ValueError(f"tensor parallel generate: the ranks' arguments differ (rank {self.tp.rank}: "
                             f"{digest[:16]}; all ranks: {[d[:16] for d in digests]}); every rank must call "
                             f"generate with the same prompts, lengths and sampling settings")

    def _run(self, engine, params, token_prompts, prompts, use_tqdm: bool, start: float) -> list[RequestOutput]:
        ids = engine.add_requests(params, token_prompts)
        bar = _progress_bar(len(ids)) if use_tqdm and len(ids) > 1 else None
        try:
            engine.run(on_finished=None if bar is None else (lambda done: bar.update(len(done))))
        except BaseException:
            engine.reset()
            raise
        finally:
            if bar is not None:
                bar.close()
        return [self._output(engine.pop_request(i), prompt, start) for i, prompt in zip(ids, prompts)]

    def _encode(self, prompt, index: int) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TypeError(f"prompts[{index}] is a string but this LLM has no tokenizer; pass token ids, or a "
                                f"tokenizer (LLM(..., tokenizer=...) or one saved in the model directory)")
            ids = self.tokenizer.encode(prompt)
            try:
                return list(_token_ids(f"tokenizer.encode(prompts[{index}])", ids))
            except TypeError:  # a tokenizers.Tokenizer has encode() too, giving an Encoding
                raise TypeError(f"tokenizer.encode(prompts[{index}]) gave {type(ids).__name__}, not token ids; "
                                f"pass a transformers tokenizer") from None
        try:
            return list(_token_ids(f"prompts[{index}]", prompt))
        except TypeError:
            raise TypeError(f"prompts[{index}] must be a string or a list of token ids") from None

    def _output(self, req: Request, prompt, start: float) -> RequestOutput:
        tokens = req.output
        text = self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else None
        first = req.first_token_time if req.first_token_time is not None else req.finish_time or start
        finish = req.finish_time if req.finish_time is not None else first
        return RequestOutput(prompt if isinstance(prompt, str) else None, req.prompt, tokens, text,
                             req.finish_reason, RequestMetrics(first - start, finish - start, req.num_preemptions))


def _token_ids(name: str, values) -> tuple[int, ...]:
    """Token ids as Python ints, from a list, a tuple, a 1-d tensor or array (numpy's integers
    too); a TypeError naming ``name`` for anything else (bytes, a dict, floats, bools)."""
    if isinstance(values, torch.Tensor):
        items = values.tolist() if values.dim() == 1 and not values.is_floating_point() else [None]
    elif isinstance(values, (str, bytes, bytearray, dict)) or not hasattr(values, "__iter__"):
        items = [None]
    else:
        items = values
    tokens = tuple(as_int(t) for t in items)
    if None in tokens:
        raise TypeError(f"{name} must be a list of token ids (ints), got {values!r}")
    return tokens


def _is_pretrained(model) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def _progress_bar(total: int):
    """A tqdm bar, or None without tqdm (the ``hf`` extra's): an own model needs only the core install."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="generate", unit="req", dynamic_ncols=True)
