"""When two pieces may share compiled code: equal computations on equal inputs, and nothing the
canonical text could confuse (compilation/piece_signature.py)."""
import operator

import torch
import torch.fx

from compileattn.compilation.piece_signature import canonical_code, parametrize_layer_names, piece_signature


def _trace(fn):
    return torch.fx.symbolic_trace(fn)


def test_same_computation_with_other_names_shares():
    def a(weight_layer_1, x):
        return torch.relu(x @ weight_layer_1) + 1

    def b(weight_layer_7, h):
        return torch.relu(h @ weight_layer_7) + 1

    args = [torch.randn(4, 4), torch.randn(2, 4)]
    assert piece_signature(_trace(a), args, 0) == piece_signature(_trace(b), args, 1)


def test_different_computation_shape_or_dtype_does_not_share():
    def a(w, x):
        return torch.relu(x @ w) + 1

    def c(w, x):
        return torch.relu(x @ w) + 2

    args = [torch.randn(4, 4), torch.randn(2, 4)]
    base = piece_signature(_trace(a), args, 0)
    assert piece_signature(_trace(c), args, 1) != base
    assert piece_signature(_trace(a), [torch.randn(4, 4), torch.randn(3, 4)], 1) != base
    assert piece_signature(_trace(a), [a_.half() for a_ in args], 1) != base


def test_inputs_on_another_gpu_do_not_share():
    """Inductor's code names the device index it was compiled for (``torch.cuda._DeviceGuard(0)``,
    its buffers allocated there): a piece on cuda:1 (another rank sharing the cache_dir, or the
    second GPU of a model split over two) must not run code compiled for cuda:0."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def a(w, x):
        return torch.relu(x @ w) + 1

    with FakeTensorMode():  # no GPU needed: fake tensors carry the device
        on = {i: [torch.empty(4, 4, device=f"cuda:{i}"), torch.empty(2, 4, device=f"cuda:{i}")] for i in (0, 1)}
    assert piece_signature(_trace(a), on[0], 0) != piece_signature(_trace(a), on[1], 1)


def test_lambdas_closures_and_state_never_share():
    def make(k):
        def scale(x):
            return x * k
        return scale

    graphs = []
    for k in (2.0, 3.0):
        g = torch.fx.Graph()
        x = g.placeholder("x")
        g.output(g.call_function(make(k), (x,)))
        graphs.append(torch.fx.GraphModule(torch.nn.Module(), g))
    assert canonical_code(graphs[0]) is None  # a closure: its name does not say what it computes
    args = [torch.randn(3)]
    assert piece_signature(graphs[0], args, 0) != piece_signature(graphs[1], args, 1)

    class WithState(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("c", torch.randn(3))

        def forward(self, x):
            return x + self.c

    assert canonical_code(_trace(WithState())) is None


def test_tensor_constants_and_operator_targets():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(operator.add, (x, torch.ones(3))))
    assert canonical_code(torch.fx.GraphModule(torch.nn.Module(), g)) is None
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(operator.add, (x, 1)))
    assert "_operator.add" in canonical_code(torch.fx.GraphModule(torch.nn.Module(), g))


def test_kv_write_layer_names_become_slots():
    import compileattn  # noqa: F401  (defines the ops)

    g = torch.fx.Graph()
    k, v = g.placeholder("k"), g.placeholder("v")
    w1 = g.call_function(torch.ops.compileattn.write_layer_kv.default, (k, v, "model.layers.3.attn"))
    g.output(w1)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    names = parametrize_layer_names(gm)
    assert names == {"compileattn:piece_layer:0": "model.layers.3.attn"}
    assert "model.layers.3" not in gm.code and "compileattn:piece_layer:0" in gm.code


def test_a_tensor_subclass_input_does_not_share_with_a_plain_tensor():
    """A ``__torch_dispatch__`` subclass (a quantized weight, say) runs other code than a plain
    tensor of the same dtype, shape and strides: one layer's subclass weight shared the compiled
    piece of the other layers' plain weights. A Parameter, and the fake tensor Dynamo traces a
    plain tensor as, are plain tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.two_tensor import TwoTensor

    def a(w, x):
        return torch.relu(x @ w) + 1

    x = torch.randn(2, 4)
    w = torch.randn(4, 4)
    base = piece_signature(_trace(a), [w, x], 0)
    assert piece_signature(_trace(a), [torch.nn.Parameter(w, requires_grad=False), x], 1) == base
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(w), mode.from_tensor(x)]
    assert piece_signature(_trace(a), fake, 1) == base
    two = TwoTensor(torch.randn(4, 4), torch.randn(4, 4))
    assert piece_signature(_trace(a), [two, x], 1) != base
    assert piece_signature(_trace(a), [TwoTensor(torch.randn(4, 4), torch.randn(4, 4)), x], 2) == \
        piece_signature(_trace(a), [two, x], 1)
    # a subclass is compiled through its inner tensors: other ones (an int8 weight's scales per
    # row, not one) are other code under the same outer dtype and shape
    per_tensor = _Quantized(torch.zeros(4, 4, dtype=torch.int8), torch.ones(()))
    per_row = _Quantized(torch.zeros(4, 4, dtype=torch.int8), torch.ones(4, 1))
    assert piece_signature(_trace(a), [per_tensor, x], 1) != piece_signature(_trace(a), [per_row, x], 2)
    assert piece_signature(_trace(a), [per_tensor, x], 1) == \
        piece_signature(_trace(a), [_Quantized(torch.ones(4, 4, dtype=torch.int8), torch.zeros(())), x], 2)


class _Quantized(torch.Tensor):
    """A float32 tensor held as int8 ``data`` times ``scale``: the shape of a quantized weight
    subclass (only what a piece signature reads of it)."""

    @staticmethod
    def __new__(cls, data, scale):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=torch.float32, device=data.device)

    def __init__(self, data, scale):
        self.data_, self.scale = data, scale

    def __tensor_flatten__(self):
        return ["data_", "scale"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return _Quantized(inner["data_"], inner["scale"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return NotImplemented
