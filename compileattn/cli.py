"""``python -m compileattn generate|throughput``: the LLM from the command line.

generate    load a model directory, generate for each --prompt (text, needs the directory's
            tokenizer) or --prompt-ids, print the results
throughput  offline throughput on random prompts (see compileattn/engine/throughput.py)

A mistake in the user's input is refused as argparse refuses a bad flag: ``<prog> <command>:
error: <message>``, exit status 2, no traceback. Each command checks everything it can before
anything runs (the sampling parameters, the LLM's arguments and model directory, the prompts
against the loaded model), each check in its own ``_refused`` block; the build of the LLM and the
run come after them, outside any, so what fails while they run keeps its traceback (a ValueError
too: a TypeError or ValueError is the user's only where it comes from a check of the input). What
only the build can refuse is told by its type, ``compileattn.refusals.ServingRefused``: the
arguments against the model and the cache (``--max-model-len`` beyond what ``--num-blocks`` hold,
a KV-cache budget holding no block), a checkpoint that does not match its config.json or a config
transformers refuses, a model compileattn cannot serve (``UnsupportedModelError``).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from typing import Iterator, Sequence


def _int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def length_range(text: str) -> tuple[int, int]:
    parts = text.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (None, None)
    except ValueError:
        lo = hi = None
    if lo is None or not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected LO:HI with 1 <= LO <= HI (or one number), got {text!r}")
    return lo, hi


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="directory with config.json + safetensors (save_pretrained)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--eager", action="store_true", help="do not compile (default: compile on CUDA)")
    p.add_argument("--attention-backend", default="auto", help="auto | flash | triton | reference")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-blocks", type=int, default=None, help="KV-cache blocks (default: sized from memory)")
    p.add_argument("--allow-pickle", action="store_true", help="also load pickled *.bin weights")
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="share the KV-cache blocks of prompts that start alike (LLM's enable_prefix_caching)")


@contextlib.contextmanager
def _refused(parser: argparse.ArgumentParser, what: str = "") -> Iterator[None]:
    """Around a check of the user's input: its TypeError, ValueError or FileNotFoundError is the
    input's mistake, refused with ``parser``'s usage and exit status 2 (``what`` prefixes the
    message where the exception's own words do not name the flags)."""
    try:
        yield
    except (TypeError, ValueError, FileNotFoundError) as exc:
        parser.error(f"{what}{exc}")


def _llm(parser: argparse.ArgumentParser, args):
    """The LLM of the engine flags. The user's mistakes are refused before anything loads: the
    LLM's arguments (``LLM.check_arguments``, the checks its constructor makes first) and the model
    directory (``check_model_directory``, the checks ``load_model`` makes first). The constructor
    itself runs outside ``_refused``: it also loads the model, profiles memory on CUDA and builds
    the engine, whose TypeError or ValueError is a failure, not the user's, and keeps its traceback.
    Only its typed refusals are the user's: a ``ServingRefused`` (the arguments against the model
    and the cache they size, the checkpoint against its config, a config transformers refuses),
    refused with the reason; its subclass ``UnsupportedModelError`` (a model, or a layer of it,
    compileattn cannot serve, no attention backend running it included: ``LLM`` raises it for the
    selector's ``UnsupportedConfigurationError``) names the directory too."""
    from .engine.llm import LLM
    from .hf.loading import check_model_directory
    from .hf.model import UnsupportedModelError
    from .refusals import ServingRefused

    arguments = dict(device=args.device, max_num_seqs=args.max_num_seqs,
                     max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                     num_blocks=args.num_blocks, attention_backend=args.attention_backend,
                     allow_pickle=args.allow_pickle, enable_prefix_caching=args.enable_prefix_caching)
    with _refused(parser):
        LLM.check_arguments(**arguments)
        check_model_directory(args.model, args.allow_pickle)
    try:
        return LLM(args.model, dtype=args.dtype, compile_config=None if args.eager else "auto", **arguments)
    except ServingRefused as exc:
        parser.error(f"{args.model} cannot be served: {exc}" if isinstance(exc, UnsupportedModelError)
                     else str(exc))


def parse_args(argv: Sequence[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The command's parser (whose ``error`` refuses a mistake found after parsing) and the arguments."""
    parser = argparse.ArgumentParser(prog="python -m compileattn", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate for prompts with a model directory")
    _add_engine_args(gen)
    # One list for both kinds, so the prompts (and the printed [i]) keep the command line's order.
    gen.add_argument("--prompt", action="append", dest="prompts", default=[], help="a text prompt (repeatable)")
    gen.add_argument("--prompt-ids", action="append", dest="prompts", default=[], type=_int_list,
                     help="a prompt as token ids, e.g. 1,2,3 (repeatable)")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop-token-ids", type=_int_list, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    thr = sub.add_parser("throughput", help="offline throughput on random prompts")
    _add_engine_args(thr)
    thr.add_argument("--num-prompts", type=int, default=200)
    thr.add_argument("--input-len", type=length_range, default=(128, 512), help="LO:HI prompt tokens (default 128:512)")
    thr.add_argument("--output-len", type=length_range, default=(128, 512), help="LO:HI output tokens (default 128:512)")
    thr.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    command = gen if args.command == "generate" else thr
    if args.command == "generate" and not args.prompts:
        command.error("generate needs at least one --prompt or --prompt-ids")
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            command.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.command == "throughput" and args.num_prompts < 1:
        command.error("--num-prompts must be >= 1")
    return command, args


def _generate(parser: argparse.ArgumentParser, args) -> int:
    from .engine.request import SamplingParams

    sampling = dict(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                    stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos)
    with _refused(parser):  # the sampling flags, before the model loads
        SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                       stop_token_ids=args.stop_token_ids or (), ignore_eos=args.ignore_eos, seed=args.seed)
    llm = _llm(parser, args)
    with _refused(parser):  # the prompts against the model: its vocabulary, max_model_len, a tokenizer for text
        llm.check_requests(args.prompts, args.max_new_tokens, **sampling)
    outputs = llm.generate(args.prompts, args.max_new_tokens, **sampling)
    for i, out in enumerate(outputs):
        shown = repr(out.prompt) if out.prompt is not None else str(out.prompt_token_ids)
        print(f"[{i}] prompt: {shown}")
        if out.text is not None:
            print(f"[{i}] text: {out.text!r}")
        print(f"[{i}] token_ids: {out.token_ids}")
        print(f"[{i}] finish_reason: {out.finish_reason}")
    return 0


def _throughput(parser: argparse.ArgumentParser, args) -> int:
    from .engine import throughput

    llm = _llm(parser, args)
    workload = throughput.random_workload(args.num_prompts, args.input_len, args.output_len, llm.engine.vocab_size,
                                          args.seed)
    # A few short requests inside the user's own bounds (a fixed 4 new tokens could overrun a
    # max_model_len the workload itself fits in).
    warm_out = min(4, args.output_len[0])
    warm = throughput.random_workload(min(8, args.num_prompts), args.input_len, (warm_out, warm_out),
                                      llm.engine.vocab_size, args.seed + 1)
    with _refused(parser, "--input-len/--output-len: "):  # the prompts' names are the workload's, not the user's
        throughput.check(llm, workload)
        throughput.check(llm, warm)
    throughput.measure(llm, warm)  # compile-time captures and allocator warm-up stay out of the timing
    result, _ = throughput.measure(llm, workload, use_tqdm=True)
    print(throughput.describe(result))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser, args = parse_args(sys.argv[1:] if argv is None else argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("compileattn")
    logger.addHandler(handler)
    previous = logger.level
    logger.setLevel(logging.INFO)
    try:
        return (_generate if args.command == "generate" else _throughput)(parser, args)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
