"""``python -m compileattn``: compile a small Llama with the compileattn backend, check it against
eager on mixed prefill/decode steps and in greedy generation, and print timings.

Exit status 0 when compiled and eager agree (within the dtype's tolerance, and token for token in
generation up to genuine near-ties of the logits in half precision), 1 otherwise.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch

from .argtypes import serving_device
from .testing import near_tie, recording_greedy, rel_error

#: Norm-relative error allowed between compiled and eager outputs. Inductor fuses and reorders
#: (RMSNorm, SwiGLU in fp32 registers where eager rounds each op), so half precision differs by
#: accumulated rounding; fp32 differs by reduction order only.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

#: The mixed-batch script: prompt lengths and the step token budget. With a budget of 64 the first
#: steps split the 100-token prompt (chunked prefill over a cached prefix) while earlier prompts
#: decode, and later prompts are admitted as whole prefills next to those decodes.
PROMPT_LENS = (48, 9, 100, 3, 27, 64, 15, 5)
STEP_BUDGET = 64


def _device(text: str) -> str:
    """``auto`` or a device compileattn serves on (``argtypes.serving_device``), refused with usage."""
    if text == "auto":
        return text
    try:
        serving_device(text, "--device")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected cpu, cuda (cuda:N) or auto: {exc}") from None
    return text


def parse_args(argv):
    from .backends.selector import BACKEND_NAMES

    description = " ".join(__doc__.split("\n\n")[0].split())
    p = argparse.ArgumentParser(prog="python -m compileattn", description=description,
                                epilog="Serving a Hugging Face model directory: python -m compileattn generate --help, "
                                       "python -m compileattn throughput --help")
    p.add_argument("--device", default="auto", type=_device, help="cpu | cuda | auto (cuda when available)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="auto: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 4 on CPU, 8 on CUDA)")
    p.add_argument("--steps", type=int, default=8, help="mixed steps to run and time per pass")
    p.add_argument("--backend", default="auto", choices=BACKEND_NAMES,
                   help="attention backend (a backend that cannot run the model hands it on; the header says "
                        "which one runs)")
    p.add_argument("--new-tokens", type=int, default=12, help="tokens to generate per prompt")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("steps", "new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be >= 1")
    return args


def model_config(device: torch.device, layers: int | None):
    from .models.llama import LlamaConfig

    if device.type == "cuda":
        cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, num_layers=8, num_heads=16, num_kv_heads=4,
                          head_dim=128, intermediate_size=5632)
    else:
        cfg = LlamaConfig.small()
    return cfg if layers is None else dataclasses.replace(cfg, num_layers=layers)


class Timer:
    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def __enter__(self):
        self.sync()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.sync()
        self.seconds = time.perf_counter() - self.start


def fixed_token_sampler(vocab: int):
    """Next tokens from a fixed stream, not from the logits: eager and compiled engines then see the
    same inputs at every step, so their outputs can be compared step by step."""
    count: dict[int, int] = {}

    def sample(logits, seq_ids):
        out = []
        for s in seq_ids:
            count[s] = count.get(s, 0) + 1
            out.append((7919 * s + 104729 * count[s]) % vocab)
        return out
    return sample


def running_backends(engine, model, dtype, requested: str) -> str:
    """Which backend the selector runs for decode and for mixed steps (after any fallback)."""
    spec = next(iter(model.attention_specs().values()))
    sel = engine.builder.selector
    decode = sel.backend_for(spec, dtype, engine.block_size, uniform_decode=True).name
    mixed = sel.backend_for(spec, dtype, engine.block_size, uniform_decode=False).name
    runs = decode if decode == mixed else f"{decode} (decode), {mixed} (mixed steps)"
    why = ""
    if requested not in ("auto", decode, mixed):
        from .backends.selector import get_backend

        try:
            why = get_backend(requested, engine.device).unsupported_reason(spec, dtype, engine.device,
                                                                           engine.block_size)
        except ImportError as exc:
            why = str(exc)
        why = f" ({requested} cannot: {why})"
    return f"attention backend {requested!r} runs {runs}{why}"


def run_mixed(engine, prompts, steps, timer_device, new_tokens):
    """One pass of the mixed-batch script: returns per-step (seconds, kinds, hidden, logits)."""
    engine.reset()
    for p in prompts:
        engine.add_request(p, new_tokens)
    sampler = fixed_token_sampler(engine.vocab_size)
    out = []
    for _ in range(steps):
        if not engine.has_unfinished():
            break
        with Timer(timer_device) as t:
            r = engine.step(STEP_BUDGET, sampler)
        out.append((t.seconds, r.kinds, r.num_padded_tokens, r.hidden.clone(),
                    None if r.logits is None else r.logits.clone()))
    engine.reset()
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["generate"], ["throughput"]):  # the LLM's subcommands (compileattn/cli.py)
        from .cli import main as cli_main

        return cli_main(argv)
    args = parse_args(argv)
    import compileattn
    from .engine import Engine
    from .models.llama import LlamaForCausalLM

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is available", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if device.type == "cuda"
                                                             else torch.float32)
    torch.manual_seed(args.seed)
    cfg = model_config(device, args.layers)
    model = LlamaForCausalLM(cfg, dtype=dtype, device=device, seed=args.seed)

    if device.type == "cuda":
        sizes = compileattn.CompileConfig().capture_sizes

        def pad_fn(n):  # round up to a CUDA-graph capture size, as a server would (and 1 -> 2, below)
            return next((s for s in sizes if s >= max(n, 2)), n)
    else:
        def pad_fn(n):  # Dynamo specialises a dynamic dim of size 1 (a recompile); pad 1 -> 2
            return max(n, 2)

    max_len = max(PROMPT_LENS) + args.new_tokens
    common = dict(block_size=16, num_blocks=len(PROMPT_LENS) * (-(-max_len // 16)) + 8,
                  max_num_tokens=max(STEP_BUDGET, pad_fn(STEP_BUDGET)), max_num_seqs=len(PROMPT_LENS),
                  attention_backend=args.backend, pad_fn=pad_fn)
    # No dynamic=True: the engine marks the token dim dynamic itself (see Engine.mark_dynamic).
    compiled_forward = torch.compile(model.forward, backend="compileattn")
    eager = Engine(model, **common)
    compiled = Engine(model, forward=compiled_forward, **common)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"# compileattn {compileattn.__version__}: Llama-style, {cfg.num_layers} layers, hidden "
          f"{cfg.hidden_size}, heads {cfg.num_heads}/{cfg.num_kv_heads}x{cfg.head_dim}, "
          f"{n_params / 1e6:.1f}M params, {dtype} on {device}; {running_backends(eager, model, dtype, args.backend)}\n")

    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    tol = TOLERANCE[dtype]
    ok = True

    # -- 1. mixed steps, teacher-forced: compare every step, time two passes ------------------------
    before = compileattn.counters.snapshot()
    first_e = run_mixed(eager, prompts, args.steps, device, args.new_tokens)
    first_c = run_mixed(compiled, prompts, args.steps, device, args.new_tokens)
    compile_counts = {k: v - before[k] for k, v in compileattn.counters.snapshot().items()}
    print("| step | decodes | prefills | chunked | tokens (padded) | rel err hidden | rel err logits |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    worst = 0.0
    for i, (e, c) in enumerate(zip(first_e, first_c)):
        _, kinds, padded, he, le = e
        _, _, _, hc, lc = c
        eh = rel_error(hc, he)
        el = rel_error(lc, le) if le is not None else 0.0
        worst = max(worst, eh, el)
        print(f"| {i} | {kinds.count('decode')} | {kinds.count('prefill')} | {kinds.count('chunked_prefill')} "
              f"| {he.shape[0]} ({padded}) | {eh:.1e} | {el:.1e} |")
    if worst > tol:
        ok = False
        print(f"\nFAIL: compiled differs from eager by {worst:.1e} > {tol:.0e} ({dtype})")
    second_e = run_mixed(eager, prompts, args.steps, device, args.new_tokens)
    second_c = run_mixed(compiled, prompts, args.steps, device, args.new_tokens)

    # -- 2. greedy generation both ways -------------------------------------------------------------
    gen_prompts = prompts[:4]
    logits_e: dict[int, list[torch.Tensor]] = {}
    logits_c: dict[int, list[torch.Tensor]] = {}
    with Timer(device) as te:
        tok_e = eager.generate(gen_prompts, args.new_tokens, STEP_BUDGET, sampler=recording_greedy(logits_e))
    with Timer(device) as tc:
        tok_c = compiled.generate(gen_prompts, args.new_tokens, STEP_BUDGET, sampler=recording_greedy(logits_c))
    same = sum(a == b for a, b in zip(tok_e, tok_c))
    near_ties = 0
    for i, (a, b) in enumerate(zip(tok_e, tok_c)):
        if a == b:
            continue
        j = next(k for k in range(len(a)) if a[k] != b[k])
        # Same prefix up to j, so both saw the same context. The divergence is a near-tie when the
        # eager margin between the two tokens is within what the paths' logits differ by anyway.
        le, lc = logits_e[sorted(logits_e)[i]][j], logits_c[sorted(logits_c)[i]][j]
        tie, margin = near_tie(le, lc, a[j], b[j])
        if dtype == torch.float32 or rel_error(lc, le) > tol or not tie:
            ok = False
            print(f"FAIL: prompt {i} diverges at token {j}: eager {a[j]} vs compiled {b[j]}, "
                  f"eager logit margin {margin:.3g}")
        else:
            near_ties += 1

    # -- 3. the table ------------------------------------------------------------------------------
    def median_step(run):
        return statistics.median(t for t, *_ in run) * 1e3

    n_gen = sum(map(len, tok_e))
    print("\n| path | first step (incl. compile) | median step | generate "
          f"{len(gen_prompts)}x{args.new_tokens} tokens |")
    print("|---|---:|---:|---:|")
    print(f"| eager | {first_e[0][0] * 1e3:.1f} ms | {median_step(second_e):.2f} ms | {te.seconds:.2f} s |")
    print(f"| torch.compile(backend=\"compileattn\") | {first_c[0][0]:.2f} s | {median_step(second_c):.2f} ms "
          f"| {tc.seconds:.2f} s |")
    print(f"\nmedian over {len(second_e)} mixed steps of the second pass; generation: {n_gen} tokens per path, "
          f"{same}/{len(tok_e)} prompts token-identical"
          + (f", {near_ties} diverged at a near-tie of the logits" if near_ties else ""))
    print("compile: " + ", ".join(f"{k} {v}" for k, v in compile_counts.items() if v))
    print("\nOK: compiled matches eager" if ok else "\nFAILED: compiled does not match eager")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
