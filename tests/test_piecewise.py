"""The compileattn torch.compile backend on CPU: split, piecewise compile, equality with eager."""
import functools
import random

import pytest
import torch

import compileattn as ca
from compileattn.models.llama import LlamaConfig, LlamaForCausalLM
from compileattn.models.opt import OPTConfig, OPTForCausalLM
from compileattn.testing import assert_matches_eager, random_step

BLOCK = 4
NUM_BLOCKS = 128


def _setup(model):
    caches = ca.allocate_kv_caches(model.attention_specs(), NUM_BLOCKS, BLOCK, dtype=torch.float32)
    builder = ca.AttentionMetadataBuilder(block_size=BLOCK, num_blocks=NUM_BLOCKS, max_num_tokens=256,
                                          max_blocks_per_seq=32)
    return caches, builder


def _inputs(vocab):
    def make(n):
        ids = torch.randint(0, vocab, (n,))
        pos = torch.randint(0, 60, (n,))
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(pos, 0)
        return ids, pos
    return make


MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig.tiny(num_layers=3), seed=1),
    "opt": lambda: OPTForCausalLM(OPTConfig.tiny(), seed=2),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_compiled_equals_eager_on_ragged_batches_with_one_compile(name):
    model = MODELS[name]()
    layers = len(model.attention_specs())
    caches, builder = _setup(model)
    compiled = torch.compile(model, backend="compileattn", fullgraph=True)
    rng = random.Random(0)
    sizes = set()
    # distinct pieces: the first, the middle ones (one computation on other weights), the last
    with ca.counters.expect(dynamo_graphs=1, pieces=layers + 1, backend_compiles=3, piece_reuses=layers - 2):
        for i in range(12):
            seqs = random_step(rng, num_seqs=rng.randint(1, 6), block_size=BLOCK, num_blocks=NUM_BLOCKS,
                               max_query_len=9, max_context_len=30)
            pad = sum(s.query_len for s in seqs) + (i % 3)  # some steps padded
            sizes.add(pad)
            assert_matches_eager(model, compiled, builder, caches, seqs, _inputs(model.config.vocab_size),
                                 pad_to=pad)
    assert len(sizes) > 5


@pytest.mark.parametrize("piece_compiler", ["eager", "aot_eager"])
def test_debug_piece_compilers(piece_compiler):
    model = MODELS["llama"]()
    caches, builder = _setup(model)
    compiled = torch.compile(model, backend="compileattn", options={"piece_compiler": piece_compiler})
    rng = random.Random(1)
    for _ in range(3):
        seqs = random_step(rng, num_seqs=3, block_size=BLOCK, num_blocks=NUM_BLOCKS)
        assert_matches_eager(model, compiled, builder, caches, seqs, _inputs(model.config.vocab_size))


def test_config_object_and_unknown_option():
    model = MODELS["opt"]()
    caches, builder = _setup(model)
    cfg = ca.CompileConfig(piece_compiler="eager", hoist_shape_logic=False)
    compiled = torch.compile(model, backend="compileattn", options={"config": cfg})
    seqs = random_step(random.Random(2), num_seqs=2, block_size=BLOCK, num_blocks=NUM_BLOCKS)
    assert_matches_eager(model, compiled, builder, caches, seqs, _inputs(model.config.vocab_size))
    with pytest.raises(TypeError, match="piece_compilr"):
        ca.CompileConfig.from_options({"piece_compilr": "eager"})


def test_splitting_op_runs_without_the_dispatcher():
    """The split graph calls attention_impl directly: the op's dispatcher entry is never hit."""
    model = MODELS["opt"]()
    caches, builder = _setup(model)
    compiled = torch.compile(model, backend="compileattn", options={"piece_compiler": "eager"})
    seqs = random_step(random.Random(3), num_seqs=2, block_size=BLOCK, num_blocks=NUM_BLOCKS)
    assert_matches_eager(model, compiled, builder, caches, seqs, _inputs(model.config.vocab_size))
    md = builder.build(seqs)
    ids, pos = _inputs(model.config.vocab_size)(md.num_tokens)
    with ca.set_forward_context(md, caches), torch.no_grad():
        compiled(ids, pos)  # compiled for these inputs (tracing dispatches the op on fake tensors)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, \
                ca.counters.expect(dynamo_graphs=0):
            compiled(ids, pos)
        assert not _op_events(prof), "the compiled runtime went through the dispatcher"
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            layer = next(iter(caches))
            spec = caches[layer].spec
            q = torch.zeros(md.num_tokens, spec.num_heads, spec.head_dim)
            k = torch.zeros(md.num_tokens, spec.num_kv_heads, spec.head_dim)
            torch.ops.compileattn.attention(q, k, k.clone(), torch.empty_like(q), layer)
        assert _op_events(prof) == ["compileattn::attention"], "the control call must be seen"


def _op_events(prof) -> list[str]:
    """compileattn ops the dispatcher ran (the profiler records each dispatched op by name)."""
    return [e.name for e in prof.events() if e.name in ("compileattn::attention", "compileattn::attend")]


def test_no_graph_break_and_one_op_node_per_layer():
    model = MODELS["llama"]()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=capture, fullgraph=True)
    caches, builder = _setup(model)
    seqs = random_step(random.Random(4), num_seqs=2, block_size=BLOCK, num_blocks=NUM_BLOCKS)
    md = builder.build(seqs)
    with ca.set_forward_context(md, caches):
        compiled(*_inputs(model.config.vocab_size)(md.num_tokens))
    assert len(graphs) == 1
    ops = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "compileattn" in str(n.target)]
    assert len(ops) == len(model.attention_specs())


def test_runtime_finds_the_token_dimension():
    """CUDA graphs key on the token count: the runtime must find a dynamic token dim even though
    Dynamo hands the backend real tensors (plain int shapes), and even when the inputs are views
    of a larger persistent buffer (whose own size Dynamo may lift as another symbol)."""
    from compileattn.compilation.backend import compileattn_backend

    model = MODELS["opt"]()
    caches, builder = _setup(model)
    seen = []

    def backend(gm, example_inputs):
        compiled = compileattn_backend(gm, example_inputs, options={"piece_compiler": "eager"})
        runtime = compiled  # the StepDispatcher
        assert runtime.token_count is not None

        def call(*args):
            seen.append(runtime.token_count(args))
            return compiled(*args)
        return call

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    ids_buf = torch.zeros(64, dtype=torch.long)
    pos_buf = torch.zeros(64, dtype=torch.long)
    expected = []
    for n in (6, 9, 13):
        seqs = [ca.SequenceStep(n - 3, 0, [0, 1, 2, 3]), ca.SequenceStep(3, 2, [4, 5])]
        md = builder.build(seqs, pad_to=n + 1)
        ids, pos = ids_buf[: md.num_tokens], pos_buf[: md.num_tokens]
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(pos, 0)
        with ca.set_forward_context(md, caches):
            compiled(ids, pos)
        expected.append(md.num_tokens)
    assert seen == expected


class _OneLayer(torch.nn.Module):
    """One attention layer ("attn": 2 query heads, 1 KV head, head dim 32, hidden 64) with a side
    projection; ``variant`` is what a subclass's forward varies by."""

    SPEC = ca.AttentionSpec(num_heads=2, num_kv_heads=1, head_dim=32)

    def __init__(self, variant=None):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(64, 4 * 32)
        self.o = torch.nn.Linear(2 * 32, 64)
        self.side = torch.nn.Linear(64, 64)
        self.variant = variant

    def attend(self, x):
        """``x``'s projections through "attn": its output buffer, (tokens, 2, 32)."""
        n = x.shape[0]
        q, k, v = self.qkv(x).split([64, 32, 32], dim=-1)
        out = torch.empty(n, 2, 32, dtype=x.dtype)
        torch.ops.compileattn.attention(q.view(n, 2, 32), k.view(n, 1, 32), v.view(n, 1, 32), out, "attn")
        return out


class _ExtraSizeFirst(_OneLayer):
    """An input with another dynamic size comes before the token input (Dynamo's graph inputs are
    in the order the forward reads them)."""

    def forward(self, extra, x):
        bias = extra.mean(0)
        n = x.shape[0]
        q, k, v = self.qkv(x + bias).split([64, 32, 32], dim=-1)
        out = torch.empty(n, 2, 32, dtype=x.dtype)
        torch.ops.compileattn.attention(q.view(n, 2, 32), k.view(n, 1, 32), v.view(n, 1, 32), out, "attn")
        return self.o(out.view(n, 64))


@pytest.mark.parametrize("mode", ["none", "full_and_piecewise"])
def test_the_token_input_is_the_one_the_attention_query_counts(simulated_graphs, mode):
    """The token count is read from the input whose dim 0 the attention's query has, not from the
    first input with a dynamic dim 0: keyed by ``extra``, every step was refused ("called with 3
    tokens, but the step's metadata has num_tokens=2"), and so was the 1-token step (Dynamo's
    graph for it has a static token count and a dynamic ``extra``)."""
    model, eager = _ExtraSizeFirst(), _ExtraSizeFirst()
    caches = ca.allocate_kv_caches({"attn": model.SPEC}, 16, BLOCK, dtype=torch.float32)
    builder = ca.AttentionMetadataBuilder(block_size=BLOCK, num_blocks=16, max_num_tokens=16, max_blocks_per_seq=4)
    compiled = torch.compile(model, backend="compileattn", options={"piece_compiler": "eager", "cudagraph_mode": mode,
                                                                   "cudagraph_capture_sizes": [1, 2, 4, 8]})
    x_buf, extra_buf = torch.randn(16, 64), torch.randn(16, 64)
    for tokens, extra in ((2, 3), (4, 3), (4, 5), (1, 3), (2, 3), (4, 3)):
        seqs = [ca.SequenceStep(1, 2, [i]) for i in range(tokens)]

        def make(n, extra=extra):
            x, e = x_buf[:n], extra_buf[:extra]
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(e, 0)
            return e, x
        with torch.no_grad():
            assert_matches_eager(eager, compiled, builder, caches, seqs, make)


def test_splitting_at_the_unified_op_only_keeps_it_whole():
    """With splitting_ops naming only ``attention``, the KV-write rewrite must not run (it would
    leave nothing to split at): the graph still splits once per layer."""
    model = MODELS["llama"]()
    layers = len(model.attention_specs())
    caches, builder = _setup(model)
    compiled = torch.compile(model, backend="compileattn", fullgraph=True, options={
        "piece_compiler": "eager", "splitting_ops": ("compileattn::attention",)})
    seqs = random_step(random.Random(5), num_seqs=3, block_size=BLOCK, num_blocks=NUM_BLOCKS)
    with ca.counters.expect(dynamo_graphs=1, pieces=layers + 1):
        assert_matches_eager(model, compiled, builder, caches, seqs, _inputs(model.config.vocab_size))


def test_static_compile_sizes_serve_their_token_count():
    """compile_sizes: each piece is also compiled for those token counts with static shapes; a step
    of exactly that many tokens runs the static code, any other count the dynamic one."""
    from compileattn.compilation.backend import compileattn_backend

    model = MODELS["opt"]()
    layers = len(model.attention_specs())
    caches, builder = _setup(model)
    runtimes = []

    def backend(gm, example_inputs):
        compiled = compileattn_backend(gm, example_inputs, options={"compile_sizes": (8,)})
        runtimes.append(compiled)
        return compiled

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    rng = random.Random(6)
    calls = []

    def step(pad):
        seqs = random_step(rng, num_seqs=2, block_size=BLOCK, num_blocks=NUM_BLOCKS, max_query_len=3)
        assert_matches_eager(model, compiled, builder, caches, seqs, _inputs(model.config.vocab_size), pad_to=pad)

    with ca.counters.expect(dynamo_graphs=1, backend_compiles=2 * (layers + 1)):
        step(8)  # compiles: dynamic + static-8 per piece
        for statics in runtimes[0].static.values():  # count calls of the static code from now on
            statics[8] = functools.partial(lambda fn, *a: calls.append(8) or fn(*a), statics[8])
        step(11)  # another count: dynamic code
        assert calls == []
        step(8)
    (runtime,) = runtimes
    assert set(runtime.static) == {p.name for p in runtime.pieces if not p.is_splitting_op}
    assert len(calls) == layers + 1  # the last 8-token step ran every piece's static code


def test_identical_pieces_compile_once_and_each_writes_its_own_layer():
    """The middle pieces of a deep model are one computation on other weights: compiled once,
    shared. Each still writes its own layer's KV cache (assert_matches_eager compares every cache)."""
    model = LlamaForCausalLM(LlamaConfig.tiny(num_layers=6), seed=3)
    caches, builder = _setup(model)
    compiled = torch.compile(model, backend="compileattn", fullgraph=True)
    rng = random.Random(4)
    # 7 pieces: the first, five identical middle ones (each makes its own layer's rotary views:
    # passes/split.py), the last
    with ca.counters.expect(dynamo_graphs=1, pieces=7, backend_compiles=3, piece_reuses=4):
        for _ in range(4):
            seqs = random_step(rng, num_seqs=rng.randint(1, 5), block_size=BLOCK, num_blocks=NUM_BLOCKS,
                               max_query_len=7, max_context_len=25)
            assert_matches_eager(model, compiled, builder, caches, seqs, _inputs(model.config.vocab_size),
                                 pad_to=sum(s.query_len for s in seqs) + 1)


def test_pieces_compile_for_inference_under_grad_mode():
    """A model whose parameters require grad, compiled with grad mode on: the pieces are compiled
    for inference (no joint forward/backward graph, so no warning about the ops' autograd
    kernels) and the result is eager's."""
    import warnings

    from compileattn.testing import AttentionBlock

    spec = ca.AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=32)
    torch.manual_seed(0)
    block = AttentionBlock(spec, hidden=128)
    assert all(p.requires_grad for p in block.parameters()) and torch.is_grad_enabled()
    caches = ca.allocate_kv_caches({"block.attn": spec}, num_blocks=8, block_size=16, dtype=torch.float32)
    builder = ca.AttentionMetadataBuilder(block_size=16, num_blocks=8, max_num_tokens=16, max_blocks_per_seq=2)
    metadata = builder.build([ca.SequenceStep(1, 5, [1]), ca.SequenceStep(3, 0, [2])], pad_to=4)
    x = torch.randn(4, 128)
    compiled = torch.compile(block, backend="compileattn", options={"piece_compiler": "aot_eager"})
    with warnings.catch_warnings(record=True) as caught, ca.set_forward_context(metadata, caches):
        warnings.simplefilter("always")
        out = compiled(x)
    assert not [w for w in caught if "autograd kernel" in str(w.message)]
    with torch.no_grad(), ca.set_forward_context(metadata, ca.allocate_kv_caches(
            {"block.attn": spec}, num_blocks=8, block_size=16, dtype=torch.float32)):
        expected = block(x)
    torch.testing.assert_close(out[:4], expected)


class _OutputInAView(_OneLayer):
    """Attention writes a view of a larger buffer (``buf.unbind(0)[0]``); the projection reads the
    buffer itself: it must run after the op, however the view was made."""

    def forward(self, x):
        n = x.shape[0]
        q, k, v = self.qkv(x).split([64, 32, 32], dim=-1)
        buf = torch.zeros(2, n, 2, 32, dtype=x.dtype)
        out = self.variant(buf)
        torch.ops.compileattn.attention(q.view(n, 2, 32), k.view(n, 1, 32), v.view(n, 1, 32), out, "attn")
        return self.o(buf[0].reshape(n, 64))


@pytest.mark.parametrize("make_view", [lambda b: b.unbind(0)[0], lambda b: b.chunk(2)[0].squeeze(0),
                                       lambda b: torch.narrow(b, 0, 0, 1)[0], lambda b: b[0],
                                       lambda b: b.contiguous()[0], lambda b: b.mT.mT[0]],
                         ids=["unbind", "chunk", "torch.narrow", "getitem",
                              "contiguous", "mT"])  # the last two: only the traced storage tells
def test_a_read_of_the_written_buffer_is_not_hoisted_before_the_op(make_view):
    model = _OutputInAView(make_view)
    caches = ca.allocate_kv_caches({"attn": model.SPEC}, 8, BLOCK, dtype=torch.float32)
    builder = ca.AttentionMetadataBuilder(block_size=BLOCK, num_blocks=8, max_num_tokens=16, max_blocks_per_seq=4)
    compiled = torch.compile(model, backend="compileattn", options={"piece_compiler": "eager"})
    seqs = [ca.SequenceStep(5, 0, [1, 2]), ca.SequenceStep(3, 0, [3])]

    def make(n):
        x = torch.randn(n, 64)
        torch._dynamo.mark_dynamic(x, 0)
        return (x,)
    with torch.no_grad():  # autograd refuses an in-place write into one of unbind's views
        assert_matches_eager(model, compiled, builder, caches, seqs, make)


class _WriteAfterTheOp(_OneLayer):
    """A tensor the attention op does not touch is written in place after the op, then read: the
    read must stay after the write (the hoist pass moves reads independent of the op before it)."""

    def __init__(self, write):
        super().__init__(write)
        self.register_buffer("steps", torch.zeros(64))

    def forward(self, x):
        n = x.shape[0]
        h = self.side(x)
        out = self.attend(x)
        h = self.variant(self, h, x)
        return self.o(out.view(n, 64)) + h * 2


def _add_(m, h, x):
    h.add_(1.0)
    return h


def _copy_(m, h, x):
    h.copy_(x * 0.5)
    return h


def _zero_a_view(m, h, x):
    h[:, :4].zero_()
    return h


def _relu_inplace(m, h, x):
    torch.nn.functional.relu(h, inplace=True)
    return h


def _add_out(m, h, x):
    torch.add(h, 1.0, out=h)
    return h


def _count(m, h, x):
    m.steps.add_(1.0)
    return h + m.steps


def _aten_add_(m, h, x):
    torch.ops.aten.add_(h, 1.0)  # a packet without a "default" overload: its schema is the arguments' choice
    return h


def _leaky_relu_module(m, h, x):
    torch.nn.LeakyReLU(0.1, inplace=True)(h)  # F.leaky_relu(h, 0.1, True): inplace passed positionally
    return h


def _matches_eager_over_two_steps(model, eager, options, steps=(
        [ca.SequenceStep(5, 0, [1, 2]), ca.SequenceStep(3, 0, [3])], [ca.SequenceStep(4, 2, [4, 5])])):
    """``model`` under ``torch.compile(backend="compileattn", options=options)`` equals ``eager`` (a
    twin) over ``steps`` of a one-layer model (``model.SPEC`` named "attn"), its token dim dynamic."""
    caches = ca.allocate_kv_caches({"attn": model.SPEC}, 8, BLOCK, dtype=torch.float32)
    builder = ca.AttentionMetadataBuilder(block_size=BLOCK, num_blocks=8, max_num_tokens=16, max_blocks_per_seq=4)
    compiled = torch.compile(model, backend="compileattn", options=options)

    def make(n):
        x = torch.randn(n, 64)
        torch._dynamo.mark_dynamic(x, 0)
        return (x,)
    with torch.no_grad():
        for seqs in steps:
            assert_matches_eager(eager, compiled, builder, caches, seqs, make)


@pytest.mark.parametrize("write", [_add_, _copy_, _zero_a_view, _relu_inplace, _add_out, _count, _leaky_relu_module,
                                   _aten_add_],
                         ids=["add_", "copy_", "view.zero_", "relu(inplace=True)", "add(out=)", "buffer",
                              "LeakyReLU(inplace=True)", "aten.add_"])
def test_a_read_after_an_in_place_write_after_the_op_is_not_hoisted_before_the_write(write):
    _matches_eager_over_two_steps(_WriteAfterTheOp(write), _WriteAfterTheOp(write), {"piece_compiler": "eager"})


class _OneLayerTwice(_OneLayer):
    """One attention layer run twice (shared layers), the second call on a tensor that does not
    depend on the first call's output: its KV write must stay after the first attention, which
    would otherwise read the second call's keys and values from the layer's cache."""

    def forward(self, x):
        n = x.shape[0]
        first = self.attend(x)
        second = self.attend(self.side(x))
        return self.o(first.view(n, 64)) + self.o(second.view(n, 64))


def test_a_layer_run_twice_writes_its_cache_after_its_first_attention():
    _matches_eager_over_two_steps(_OneLayerTwice(), _OneLayerTwice(), {"piece_compiler": "eager"})


class _AutocastAfterTheOp(_OneLayer):
    """A projection independent of the op, after it, in an autocast region that starts after the
    op (``variant`` True) or ends right after it: moved before the op, it would leave or enter
    the region and compute in another dtype."""

    def forward(self, x):
        n = x.shape[0]
        q, k, v = self.qkv(x).split([64, 32, 32], dim=-1)
        out = torch.empty(n, 2, 32, dtype=x.dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not self.variant):
            torch.ops.compileattn.attention(q.view(n, 2, 32), k.view(n, 1, 32), v.view(n, 1, 32), out, "attn")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.variant):
            h = self.side(x).float()
        return self.o(out.view(n, 64)) + h


@pytest.mark.parametrize("starts_after", [True, False], ids=["enters-after", "exits-after"])
def test_nothing_moves_before_the_op_across_an_autocast_switch(starts_after):
    _matches_eager_over_two_steps(_AutocastAfterTheOp(starts_after), _AutocastAfterTheOp(starts_after),
                                  {"piece_compiler": "eager"})


class _ReadThenActivateInPlace(_OneLayer):
    """After the op, ``h`` is read by a node that stays there, then activated in place by a module
    that passes ``inplace`` positionally (``F.leaky_relu(h, 0.1, True)``, ``F.hardtanh(h, 0., 6.,
    True)``): the activation must not move before the op, above the read."""

    def forward(self, x):
        n = x.shape[0]
        h = self.side(x)
        out = self.attend(x)
        y = self.o(out.view(n, 64)) + h
        h = self.variant(h)
        return y + h * 2


@pytest.mark.parametrize("act", [lambda: torch.nn.LeakyReLU(0.1, inplace=True), lambda: torch.nn.ReLU6(inplace=True),
                                 lambda: torch.nn.ELU(inplace=True)], ids=["LeakyReLU", "ReLU6", "ELU"])
def test_an_in_place_activation_with_a_positional_inplace_is_not_hoisted_above_a_read(act):
    _matches_eager_over_two_steps(_ReadThenActivateInPlace(act()), _ReadThenActivateInPlace(act()),
                                  {"piece_compiler": "eager"})


class _AliasedPieceInputs(_OneLayer):
    """Two tensors sharing storage, made before the attention op, reach the piece after it, which
    writes one in place: Inductor's compile of that piece failed at its first call (``wrong
    number of dimensions``) until the piece got their base and made the views itself."""

    def forward(self, x):
        n = x.shape[0]
        written, read = self.variant(self.side(x))
        out = self.attend(x)
        written.mul_(2.0)
        return self.o(out.view(n, 64)) + read.sum(-1, keepdim=True)


@pytest.mark.parametrize("views", [lambda h: (h[:, :4], h), lambda h: (h[:, :4], h[:, 2:6]),
                                   lambda h: (h.narrow(1, 0, 4), h.split(8, dim=1)[1].t().t()),
                                   lambda h: (h, h[:, :4]), lambda h: (h, h.view(-1, 8, 8).transpose(1, 2)[:, 0])],
                         ids=["slice-and-base", "two-slices", "narrow-and-split",
                              "base-and-slice", "base-and-transposed"])  # the last two: a view read past the write
@pytest.mark.parametrize("sizes", [[], [4]], ids=["dynamic", "static"])
def test_a_piece_writing_one_of_two_inputs_sharing_storage_compiles_with_inductor(views, sizes):
    _matches_eager_over_two_steps(_AliasedPieceInputs(views), _AliasedPieceInputs(views),
                                  {"piece_compiler": "inductor", "compile_sizes": sizes, "compile_workers": 0},
                                  steps=([ca.SequenceStep(1, 2, [0]), ca.SequenceStep(3, 0, [1])],
                                         [ca.SequenceStep(5, 0, [2, 3])]))


class _OutWriteBeforeTheOp(_OneLayer):
    """``torch.mul(h, 2.0, out=h)`` before the op returns ``h`` itself; the piece after the op writes
    ``h`` and reads both: the call is not a view to make again in that piece (it would write ``h``
    a second time)."""

    def forward(self, x):
        n = x.shape[0]
        h = self.side(x)
        doubled = torch.mul(h, 2.0, out=h)
        out = self.attend(x)
        h[:, :4].zero_()
        return self.o(out.view(n, 64)) + doubled + h


@pytest.mark.parametrize("piece_compiler", ["eager", "inductor"])
def test_an_out_write_into_its_input_is_not_made_again_as_a_view(piece_compiler):
    _matches_eager_over_two_steps(_OutWriteBeforeTheOp(), _OutWriteBeforeTheOp(), {"piece_compiler": piece_compiler})


class _FloatOfTheTokenCount(_OneLayer):
    """A float of the token count used on both sides of the attention op (``before``), or after it
    only, where the hoist pass moves its arithmetic before the op: either way the piece before the
    op handed it on."""

    def forward(self, x):
        n = x.shape[0]
        if self.variant:
            scale = 1.0 / (n + 1)
            x = x * scale
        out = self.attend(x)
        return self.o(out.view(n, 64)) * (scale if self.variant else 1.0 / (n + 1))


@pytest.mark.parametrize("before", [True, False], ids=["used-before-and-after", "used-after"])
def test_a_float_of_the_token_count_does_not_cross_pieces_so_static_sizes_compile(before):
    """A piece returning a float failed its static-size Inductor compile (``compile_sizes``, on
    CUDA by default): the float is a Python float there, which Inductor refuses as an output."""
    _matches_eager_over_two_steps(
        _FloatOfTheTokenCount(before), _FloatOfTheTokenCount(before),
        {"piece_compiler": "inductor", "compile_sizes": [4], "compile_workers": 0},
        steps=([ca.SequenceStep(1, 2, [0]), ca.SequenceStep(3, 0, [1])],  # 4 tokens: the static piece
               [ca.SequenceStep(5, 0, [2, 3])]))


def test_a_write_two_overlapping_inputs_see_is_refused_at_compile():
    """The pieces are compiled without the inputs' aliasing: torch.compile with compileattn's
    backend and Inductor pieces returned 2y + 2 for ``d = y * 2; x.add_(1)`` with ``y``
    overlapping ``x`` (eager and torch.compile's Inductor: 2y). Views of one buffer that share no
    byte, and overlapping inputs only read, compile."""
    def read_then_incremented(x, y):
        d = y * 2
        x.add_(1)
        return d

    def summed(x, y):
        return x * 2 + y

    buf = torch.arange(8.0)
    compiled = torch.compile(read_then_incremented, backend="compileattn", options={"piece_compiler": "eager"})
    with pytest.raises(Exception, match=r"inputs L\['y'\] and L\['x'\] share memory and the compiled code writes "
                                        r"it \(add_\)"):
        compiled(buf[:4], buf[2:6])
    assert torch.equal(buf, torch.arange(8.0))
    assert torch.equal(compiled(buf[:4], buf[4:]), torch.arange(4.0, 8.0) * 2)
    assert torch.equal(buf[:4], torch.arange(1.0, 5.0))
    buf = torch.arange(8.0)
    reads = torch.compile(summed, backend="compileattn", options={"piece_compiler": "eager"})
    assert torch.equal(reads(buf[:4], buf[2:6]), summed(buf[:4], buf[2:6]))


def test_an_input_of_data_dependent_size_is_refused_naming_it():
    """``mark_unbacked`` leaves a size without an example value, which the backend reads for every
    dynamic size (pinned sizes, capture sizes, overlap checks): it failed inside with a KeyError or
    a guard on a data-dependent expression; it is refused naming the input, and a dim marked
    dynamic compiles."""
    def doubled_sum(x):
        return (x * 2).sum(0)

    x = torch.randn(5, 3)
    torch._dynamo.decorators.mark_unbacked(x, 0)
    compiled = torch.compile(doubled_sum, backend="compileattn", options={"piece_compiler": "eager"})
    with pytest.raises(Exception, match=r"input L\['x'\] has a data-dependent size \(torch._dynamo.mark_unbacked\)"):
        compiled(x)
    torch._dynamo.reset()
    y = torch.randn(5, 3)
    torch._dynamo.mark_dynamic(y, 0)
    assert torch.equal(torch.compile(doubled_sum, backend="compileattn", options={"piece_compiler": "eager"})(y),
                       doubled_sum(y))
