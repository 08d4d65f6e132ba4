"""Tensor parallelism: which heads each rank keeps, plans and sharding, and TP=N against TP=1 in
real processes (torchrun, gloo on the CPU; NCCL with real CUDA graphs on two GPUs).

The multi-process tests start ``compileattn.parallel.check`` (or the smoke / benchmark scripts)
under torchrun with a timeout, so a hang fails the test instead of blocking CI; the check itself
compares every step with TP=1 and asserts the compile counters, and these tests assert the key
numbers again from its per-rank JSON.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from compileattn.models.llama import LlamaConfig, LlamaForCausalLM
from compileattn.models.opt import OPTConfig, OPTForCausalLM
from compileattn.parallel import HeadShard, RowParallelLinear, TPGroup, init_tp, shard_model
from compileattn.parallel.group import NCCL_ENV

ROOT = Path(__file__).resolve().parents[1]


def fake_tp(rank: int, world: int) -> TPGroup:
    """A group for sharding alone (no collective runs): only its name is read."""
    return TPGroup(rank, world, torch.device("cpu"), group=types.SimpleNamespace(group_name="fake"))


# -- heads --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("heads,kv,tp", [(32, 8, 2), (32, 8, 8), (64, 8, 4), (4, 2, 4), (8, 1, 2), (8, 2, 8),
                                         (12, 12, 4), (16, 4, 16)])
def test_each_rank_keeps_the_kv_heads_its_query_heads_use(heads, kv, tp):
    group = heads // kv
    seen_q = []
    for rank in range(tp):
        s = HeadShard(heads, kv, rank, tp)
        assert len(s.q_heads) == s.local_heads == heads // tp
        assert len(s.kv_heads) == s.local_kv_heads == max(kv // tp, 1)
        # every query head of this rank attends with a KV head this rank keeps, at the same local
        # group position as in the unsharded layer (local GQA maps local q i to local kv i // g)
        local_group = s.local_heads // s.local_kv_heads
        for i, q in enumerate(s.q_heads):
            assert q // group in s.kv_heads
            assert s.kv_heads[i // local_group] == q // group
        seen_q += list(s.q_heads)
    assert seen_q == list(range(heads))


def test_each_rank_keeps_the_alibi_slopes_of_its_query_heads():
    from compileattn import AttentionSpec, alibi_slopes

    full = AttentionSpec(16, 4, 64, sliding_window=7, alibi_slopes=alibi_slopes(16))
    per_rank = [HeadShard(16, 4, rank, 4).spec(full) for rank in range(4)]
    assert [s.alibi_slopes for s in per_rank] == [full.alibi_slopes[4 * r:4 * r + 4] for r in range(4)]
    assert all(s.sliding_window == 7 and s.num_heads == 4 for s in per_rank)
    assert HeadShard(16, 4, 1, 4).spec(AttentionSpec(16, 4, 64)).alibi_slopes is None


@pytest.mark.parametrize("heads,kv,tp,match", [(6, 2, 4, "num_heads"), (12, 6, 4, "num_kv_heads"),
                                               (12, 4, 6, "multiple of num_kv_heads"), (8, 3, 2, "divisible"),
                                               # were a ZeroDivisionError
                                               (8, 0, 2, "num_kv_heads must be >= 1"),
                                               (8, 2, 0, "tp must be >= 1")])
def test_head_layouts_that_cannot_be_sharded_are_refused(heads, kv, tp, match):
    with pytest.raises(ValueError, match=match):
        HeadShard(heads, kv, 0, tp)


def test_head_counts_follow_the_int_rule():
    """A count read from a config as a numpy integer is a count; a float or a bool is refused
    with a TypeError naming it, as every other count of the package is (``argtypes``)."""
    shard = HeadShard(np.int64(8), np.int64(2), np.int64(1), np.int64(2))
    assert (shard.num_heads, shard.num_kv_heads, shard.rank, shard.tp) == (8, 2, 1, 2)
    assert type(shard.num_heads) is int and type(shard.rank) is int
    for args, name in (((8.0, 2, 0, 2), "num_heads"), ((8, True, 0, 2), "num_kv_heads"), ((8, 2, 0.0, 2), "rank")):
        with pytest.raises(TypeError, match=name):
            HeadShard(*args)


def test_rank_outside_the_group_is_refused():
    with pytest.raises(ValueError, match="outside"):
        HeadShard(8, 2, 2, 2)


# -- sharding -----------------------------------------------------------------------------------------


def test_llama_shards_each_part_of_its_fused_projections():
    full = LlamaForCausalLM(LlamaConfig.tiny(num_heads=4, num_kv_heads=2, head_dim=32, hidden_size=64,
                                             intermediate_size=96), seed=0)
    d, inter = 32, 96
    w_qkv = full.model.layers[0].self_attn.qkv_proj.weight
    w_o = full.model.layers[0].self_attn.o_proj.weight
    w_gu = full.model.layers[0].mlp.gate_up_proj.weight
    for rank in range(2):
        m = shard_model(copy.deepcopy(full), tp=fake_tp(rank, 2))
        attn = m.model.layers[0].self_attn
        q, k, v = w_qkv[:128], w_qkv[128:192], w_qkv[192:]
        expected = torch.cat([q[rank * 2 * d:(rank + 1) * 2 * d], k[rank * d:(rank + 1) * d], v[rank * d:(rank + 1) * d]])
        torch.testing.assert_close(attn.qkv_proj.weight, expected, rtol=0, atol=0)
        assert isinstance(attn.o_proj, RowParallelLinear) and attn.o_proj.group_name == "fake"
        torch.testing.assert_close(attn.o_proj.weight, w_o[:, rank * 2 * d:(rank + 1) * 2 * d], rtol=0, atol=0)
        gate, up = w_gu[:inter], w_gu[inter:]
        half = inter // 2
        torch.testing.assert_close(m.model.layers[0].mlp.gate_up_proj.weight,
                                   torch.cat([gate[rank * half:(rank + 1) * half], up[rank * half:(rank + 1) * half]]),
                                   rtol=0, atol=0)
        assert (attn.num_heads, attn.num_kv_heads, attn.q_size, attn.kv_size) == (2, 1, 64, 32)
        specs = m.attention_specs()
        assert {(s.num_heads, s.num_kv_heads, s.head_dim) for s in specs.values()} == {(2, 1, 32)}
        assert specs["model.layers.0.self_attn.attn"].scale == full.attention_specs()["model.layers.0.self_attn.attn"].scale
        # embeddings and the LM head stay whole
        assert m.model.embed_tokens.weight.shape == full.model.embed_tokens.weight.shape


def test_replicated_kv_head_follows_the_query_heads():
    full = LlamaForCausalLM(LlamaConfig.tiny(num_heads=4, num_kv_heads=2), seed=0)
    w = full.model.layers[1].self_attn.qkv_proj.weight
    k = w[128:192]
    for rank, kv_head in ((0, 0), (1, 0), (2, 1), (3, 1)):
        m = shard_model(copy.deepcopy(full), tp=fake_tp(rank, 4))
        got = m.model.layers[1].self_attn.qkv_proj.weight
        torch.testing.assert_close(got[32:64], k[kv_head * 32:(kv_head + 1) * 32], rtol=0, atol=0)


def test_opt_row_parallel_bias_is_added_once_after_the_sum():
    full = OPTForCausalLM(OPTConfig.tiny(), seed=0)
    m = shard_model(copy.deepcopy(full), tp=fake_tp(1, 2))
    layer = m.model.layers[0]
    assert isinstance(layer.fc2, RowParallelLinear) and isinstance(layer.self_attn.out_proj, RowParallelLinear)
    torch.testing.assert_close(layer.fc2.bias, full.model.layers[0].fc2.bias, rtol=0, atol=0)  # whole, not split
    assert layer.fc1.bias.shape == (full.config.ffn_dim // 2,)
    assert layer.self_attn.hidden_size == 32 and layer.self_attn.attn.spec.num_heads == 1


def test_plan_problems_are_refused_with_the_reason():
    from compileattn.refusals import UnsupportedModelError

    model = LlamaForCausalLM(LlamaConfig.tiny(), seed=0)
    with pytest.raises(UnsupportedModelError, match="sequence_parallel"):
        shard_model(copy.deepcopy(model), plan={**model.tp_plan, "model.norm": "sequence_parallel"},
                    tp=fake_tp(0, 2))
    with pytest.raises(ValueError, match="matched no module"):
        shard_model(copy.deepcopy(model), plan={**model.tp_plan, "model.layers.*.nope": "colwise"}, tp=fake_tp(0, 2))
    with pytest.raises(UnsupportedModelError, match=r"^model\.norm \(RMSNorm\) is planned 'colwise'; only nn\.Linear"):
        shard_model(copy.deepcopy(model), plan={"model.norm": "colwise"}, tp=fake_tp(0, 2))
    partial = {k: v for k, v in model.tp_plan.items() if "o_proj" not in k}
    with pytest.raises(ValueError, match="shard together"):
        shard_model(copy.deepcopy(model), plan=partial, tp=fake_tp(0, 2))
    twice = shard_model(copy.deepcopy(model), tp=fake_tp(0, 2))
    with pytest.raises(ValueError, match="already sharded"):
        shard_model(twice, tp=fake_tp(0, 2))
    with pytest.raises(ValueError, match="no tensor-parallel plan"):
        shard_model(nn.Sequential(nn.Linear(4, 4)), tp=fake_tp(0, 2))


@pytest.mark.parametrize("style", ["embedding_rowwise", "embedding_colwise"])
def test_an_embedding_style_leaves_a_tied_embedding_and_its_lm_head_whole(style):
    """transformers 5.17 plans ``embed_tokens: embedding_rowwise`` for every config with tied
    embeddings (Cohere's default); both Hugging Face embedding styles end with the full hidden state
    on every rank, so the embedding (and the LM head sharing its weight) stays whole while the
    layers shard as without it."""
    import transformers

    from hf_families import _config

    torch.manual_seed(0)
    full = transformers.AutoModelForCausalLM.from_config(_config("cohere", tie_word_embeddings=True))
    assert full.lm_head.weight is full.model.embed_tokens.weight
    full.config.base_model_tp_plan = {**full.config.base_model_tp_plan, "embed_tokens": style}
    m = shard_model(copy.deepcopy(full), tp=fake_tp(1, 2))
    assert type(m.model.embed_tokens) is nn.Embedding and m.lm_head.weight is m.model.embed_tokens.weight
    torch.testing.assert_close(m.model.embed_tokens.weight, full.model.embed_tokens.weight, rtol=0, atol=0)
    assert isinstance(m.model.layers[0].self_attn.o_proj, RowParallelLinear)
    assert m.model.layers[0].mlp.gate_proj.out_features == full.config.intermediate_size // 2


def test_a_per_head_qk_norm_keeps_its_heads_rows_and_a_norm_over_all_heads_is_refused():
    """Cohere's qk LayerNorm has a weight row per head, (heads, head_dim): each rank keeps its query
    heads' rows in ``q_norm`` and its KV heads' in ``k_norm`` (left whole, it broke the forward with
    a shape error, or with one head per rank would have normalised with another head's weights).
    A norm over the whole query width (OLMo-2's) mixes every head: refused before any change."""
    import transformers

    from compileattn.refusals import UnsupportedModelError

    torch.manual_seed(0)
    cohere = transformers.CohereForCausalLM(transformers.CohereConfig(
        vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=1, use_qk_norm=True, tie_word_embeddings=False))
    attn = cohere.model.layers[0].self_attn
    q_w, k_w = torch.randn(4, 16), torch.randn(1, 16)
    attn.q_norm.weight.data.copy_(q_w)
    attn.k_norm.weight.data.copy_(k_w)
    for rank in range(2):
        m = shard_model(copy.deepcopy(cohere), tp=fake_tp(rank, 2))
        local = m.model.layers[0].self_attn
        torch.testing.assert_close(local.q_norm.weight, q_w[2 * rank:2 * rank + 2], rtol=0, atol=0)
        torch.testing.assert_close(local.k_norm.weight, k_w, rtol=0, atol=0)  # the one KV head, replicated
    olmo2 = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(
        vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2))
    before = {k: v.clone() for k, v in olmo2.state_dict().items()}
    # Its own plan gathers q and k for that norm (a style refused anyway); Llama's plan is the one that would run it
    plan = {f"model.{k}": v for k, v in transformers.LlamaConfig().base_model_tp_plan.items()}
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.0\.self_attn\.q_norm\.weight has shape \(64,\)"):
        shard_model(olmo2, plan=plan, tp=fake_tp(0, 2))
    assert all(torch.equal(before[k], v) for k, v in olmo2.state_dict().items())


def test_an_own_hf_plan_group_that_matches_nothing_stays_replicated_and_one_matched_in_part_is_refused():
    """Cohere2-MoE keeps dense Cohere2's plan, whose ``layers.*.mlp.*`` entries name projections its
    routed MLP does not have: its attention is sharded and its experts stay whole on every rank
    (refused as "matched no module" before). An own plan of which one entry of a group matched is
    still refused."""
    import transformers

    from compileattn.refusals import UnsupportedModelError
    from hf_families import _config

    torch.manual_seed(0)
    moe = transformers.AutoModelForCausalLM.from_config(_config("cohere2_moe"))
    full = dict(moe.named_parameters())
    m = shard_model(copy.deepcopy(moe), tp=fake_tp(1, 2))
    assert isinstance(m.model.layers[0].self_attn.o_proj, RowParallelLinear)
    for name, p in m.named_parameters():
        if ".mlp." in name:
            torch.testing.assert_close(p, full[name], rtol=0, atol=0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2))
    llama.config.base_model_tp_plan = {**llama.config.base_model_tp_plan, "layers.*.mlp.nope": "colwise"}
    with pytest.raises(UnsupportedModelError, match=r"matched no module: \['layers\.\*\.mlp\.nope'\]"):
        shard_model(llama, tp=fake_tp(0, 2))


def test_a_refused_plan_leaves_the_model_as_it_was():
    """The layers before the one that does not divide were sharded before the refusal; a second
    attempt then failed on the half-sharded model."""
    model = LlamaForCausalLM(LlamaConfig.tiny(intermediate_size=130), seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.mlp\.\w+ \(\w+\): \d+ rows cannot be split evenly over "
                                         r"4 ranks"):
        shard_model(model, tp=fake_tp(0, 4))
    assert set(before) == set(model.state_dict())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(isinstance(m, RowParallelLinear) for m in model.modules())


def test_a_planned_module_that_is_not_a_linear_is_refused_as_the_model_not_fitting_its_plan():
    """Named after every layer's projections, it is still refused before any of them changes, with
    the type of every other plan mismatch (``LLM``'s callers tell it from a failure by that type),
    not a ``TypeError``."""
    from compileattn.refusals import UnsupportedModelError

    model = LlamaForCausalLM(LlamaConfig.tiny(), seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedModelError, match=r"^model\.norm \(\w+\) is planned 'rowwise'") as refused:
        shard_model(model, plan={**model.tp_plan, "model.norm": "rowwise"}, tp=fake_tp(0, 2))
    assert not isinstance(refused.value, TypeError)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(isinstance(m, RowParallelLinear) for m in model.modules())


def test_one_rank_leaves_the_model_alone():
    model = LlamaForCausalLM(LlamaConfig.tiny(), seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert shard_model(model, tp=TPGroup(0, 1, torch.device("cpu"))) is model
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(isinstance(m, RowParallelLinear) for m in model.modules())


def test_a_one_rank_tp_engine_runs_the_step_it_is_given():
    """``Engine.run_step`` through the driver's wrapped ``prepare`` (rank 0 decides and broadcasts)."""
    from compileattn import SequenceStep
    from compileattn.engine import Engine
    from compileattn.parallel.driver import TPEngine

    kw = dict(num_blocks=16, max_num_tokens=16, max_num_seqs=4, block_size=4)
    tp = TPEngine(LlamaForCausalLM(LlamaConfig.tiny(), seed=0), tp=TPGroup(0, 1, torch.device("cpu")),
                  record_steps=True, **kw)
    plain = Engine(LlamaForCausalLM(LlamaConfig.tiny(), seed=0), **kw)
    step = ([SequenceStep(2, 0, [0])], [1, 2], [0, 1])
    torch.testing.assert_close(tp.run_step(*step), plain.run_step(*step))
    assert [plan.input_ids for plan in tp.steps_run] == [(1, 2)]


@dataclasses.dataclass(frozen=True)
class BroadcastsRecorded(TPGroup):
    """Rank 0 of a group whose broadcasts and agreements are recorded, not sent."""

    sent: list = dataclasses.field(default_factory=list)

    def broadcast_object(self, obj=None, src=0):
        self.sent.append(obj)
        return obj

    def agree(self, call, payload=None):
        self.sent.append(call)
        return [payload] * self.world_size


def recorded_engine(**kwargs):
    from compileattn.parallel.driver import TPEngine

    tp = BroadcastsRecorded(0, 2, torch.device("cpu"))
    return tp, TPEngine(LlamaForCausalLM(LlamaConfig.tiny(), seed=0), tp=tp, num_blocks=16, max_num_tokens=16,
                        max_num_seqs=4, block_size=4, **kwargs)


def test_every_stop_ends_one_serve_which_the_first_step_or_stop_meets():
    """Each ``stop_workers`` ends one ``serve()`` of the others, a step run or not since the last:
    they cannot see rank 0's requests. Rank 0 meets each ``serve()``'s opening agreement before its
    first step or stop; the steps after it are plain broadcasts."""
    from compileattn import SequenceStep
    from compileattn.parallel.driver import StepPlan

    tp, engine = recorded_engine()
    engine.stop_workers()
    engine.stop_workers()
    engine.run_step([SequenceStep(2, 0, [0])], [1, 2], [0, 1])
    engine.run_step([SequenceStep(1, 2, [0])], [3], [2])
    engine.stop_workers()
    assert [m if isinstance(m, (str, type(None))) else type(m) for m in tp.sent] == [
        "TPEngine.serve", None, "TPEngine.serve", None, "TPEngine.serve", StepPlan, StepPlan, None]


@pytest.mark.parametrize("prompts", [[[1] * 99], []], ids=["refused-prompt", "no-prompts"])
def test_the_stop_after_a_generate_that_ran_no_step_still_ends_serve(prompts):
    """Rank 0 calls ``generate`` then ``stop_workers`` while the other ranks ``serve()``. A generate
    that broadcast no step (its prompt refused before the first one, or no prompts) still ends
    with a stop that meets their ``serve()`` and ends it."""
    tp, engine = recorded_engine(max_model_len=32)
    engine.stop_workers()  # the first round's serve() ended
    try:
        engine.generate(prompts, max_new_tokens=2, max_tokens_per_step=16)
    except ValueError:
        assert prompts  # the prompt longer than max_model_len
    finally:
        engine.stop_workers()
    assert tp.sent == ["TPEngine.serve", None, "TPEngine.serve", None]


def test_init_tp_refuses_what_it_cannot_serve(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="tp_size=4 but WORLD_SIZE=2"):
        init_tp(4, device="cpu")
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    with pytest.raises(ValueError, match="TORCH_NCCL_BLOCKING_WAIT"):
        init_tp(device="cpu")


def test_init_tp_refuses_a_device_other_than_its_groups(monkeypatch):
    """Called again, it returned the group it made whatever ``device`` asked for: a caller asking
    for CUDA got a CPU group (and the reverse)."""
    made = TPGroup(0, 2, torch.device("cpu"), all_reduce="gloo")
    monkeypatch.setattr("compileattn.parallel.group._tp", made)
    assert init_tp(device="cpu") is made and init_tp() is made
    with pytest.raises(ValueError, match=r"already initialised on cpu, not device='cuda'"):
        init_tp(device="cuda")
    with pytest.raises(ValueError, match=r"device must be 'cuda' or 'cpu', got 'gpu'"):
        init_tp(device="gpu")


@pytest.mark.parametrize("world,rank", [(2, 2), (2, -1), (0, 0), (-1, 0), (1, 1)])
def test_init_tp_refuses_a_rank_outside_the_world(monkeypatch, world, rank):
    """Refused before any rendezvous: a rank past the end waited for the group's timeout to connect to
    a store no rank hosts, then failed with a network error."""
    import datetime

    monkeypatch.setattr("compileattn.parallel.group._tp", None)  # not one a test before made
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    with pytest.raises(ValueError, match=f"RANK={rank} is not a rank of WORLD_SIZE={world}"):
        init_tp(device="cpu", timeout=datetime.timedelta(seconds=2))
    assert not torch.distributed.is_initialized()


# -- processes ----------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, argv: list[str], log_dir: Path, timeout: float = 240.0) -> tuple[int, str]:
    """Run ``argv`` (a ``-m module ...`` or script) under torchrun; on timeout end it and its ranks,
    so a hang fails the test with the ranks' output instead of blocking CI. torchrun starts each
    rank in a session of its own, so killing torchrun's process group left the hung ranks running
    (for the group's 600 s timeout), holding the output pipe the test then waited on: torchrun is
    sent SIGTERM, which it passes on to its ranks, and killed only if it has not ended by then."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(_free_port()), *argv, "--log-dir", str(log_dir)]
    env = {**os.environ, **NCCL_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"{' '.join(argv)} did not finish in {timeout:.0f} s (a hang?); output:\n{out[-4000:]}")
    return proc.returncode, out


def run_check(nproc: int, args: list[str], tmp_path: Path, timeout: float = 240.0) -> list[dict]:
    """The check's verdict per rank; fails the test with the output if any rank failed."""
    rc, out = torchrun(nproc, ["-m", "compileattn.parallel.check", "--timeout-s", "120", *args], tmp_path, timeout)
    results = []
    for rank in range(nproc):
        lines = [ln for ln in (tmp_path / f"rank{rank}.log").read_text().splitlines() if "TPCHECK " in ln]
        assert lines, f"rank {rank} reported nothing; output:\n{out[-4000:]}"
        results.append(json.loads(lines[-1].split("TPCHECK ", 1)[1]))
    bad = [p for r in results for p in [r.get("error")] + [q for m in r.get("modes", {}).values() for q in m["problems"]]
           if p]
    assert rc == 0 and not bad, f"problems: {bad}; output:\n{out[-4000:]}"
    return results


def test_llama_tp2_equals_tp1_eager_compiled_and_with_graphs(tmp_path):
    results = run_check(2, ["--model", "llama", "--modes", "eager,compiled,piecewise,full_and_piecewise,engine"],
                        tmp_path)
    for r in results:
        assert r["local_heads"] == [[2, 1]]
        modes = r["modes"]
        for mode in ("eager", "compiled", "piecewise", "full_and_piecewise"):
            assert modes[mode]["rel_err_vs_tp1_eager"] <= 1e-5
            assert modes[mode]["cross_rank_max_abs"] == 0.0  # the all-reduce gives every rank the same sum
        for mode in ("compiled", "piecewise", "full_and_piecewise"):
            c = modes[mode]["counters"]
            # 2 layers x (o_proj, down_proj): every all-reduce inside a piece, none at a split
            assert (c["collectives_in_pieces"], c["collectives_at_splits"], c["dynamo_graphs"]) == (4, 0, 1)
        for mode in ("piecewise", "full_and_piecewise"):
            c = modes[mode]["counters"]
            assert c["cudagraph_captures"] > 0 and c["cudagraph_replays"] >= 6 and c["eager_steps"] == 1
        assert modes["full_and_piecewise"]["counters"]["full_graphs"] > 0
        assert modes["engine"]["steps"] >= 4
    engines = [{k: r["modes"]["engine"][k] for k in ("steps", "padded_sizes")} for r in results]
    assert engines[0] == engines[1]


def test_opt_tp2_equals_tp1_with_aot_eager_pieces(tmp_path):
    results = run_check(2, ["--model", "opt", "--modes", "eager,piecewise", "--piece-compiler", "aot_eager"], tmp_path)
    for r in results:
        assert r["local_heads"] == [[2, 2]]  # MHA, 4 heads
        assert r["modes"]["piecewise"]["counters"]["collectives_in_pieces"] == 4


@pytest.mark.slow
def test_inductor_pieces_keep_the_all_reduce(tmp_path):
    results = run_check(2, ["--model", "llama", "--layers", "1", "--modes", "piecewise", "--piece-compiler",
                            "inductor"], tmp_path, timeout=400)
    for r in results:
        c = r["modes"]["piecewise"]["counters"]
        assert (c["collectives_in_pieces"], c["collectives_at_splits"], c["backend_compiles"]) == (2, 0, 2)
        assert r["modes"]["piecewise"]["rel_err_vs_tp1_eager"] <= 1e-5


def test_hf_llama_sharded_by_its_plan_with_replicated_kv(tmp_path):
    results = run_check(2, ["--model", "hf-llama", "--modes", "eager", "--kv-heads", "1"], tmp_path)
    for r in results:
        m = r["modes"]["eager"]
        # 4 query heads, 1 KV head: each rank keeps 2 query heads and the (replicated) KV head
        assert (m["local_q_rows"], m["local_kv_rows"], m["num_key_value_groups"]) == (64, 32, 2)
        assert m["rel_err_vs_tp1_eager"] <= 1e-5


def test_llama_tp4_equals_tp1_with_replicated_kv_heads(tmp_path):
    results = run_check(4, ["--model", "llama", "--modes", "eager,piecewise"], tmp_path, timeout=300)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    for r in results:
        assert r["local_heads"] == [[1, 1]]  # 4 query heads, 2 KV heads, 4 ranks
        assert r["modes"]["piecewise"]["counters"]["collectives_in_pieces"] == 4
        assert r["modes"]["piecewise"]["rel_err_vs_tp1_eager"] <= 1e-5


def test_gpu_smoke_script_runs_on_cpu(tmp_path):
    rc, out = torchrun(2, ["-m", "compileattn.parallel.smoke", "--device", "cpu", "--rounds", "2"], tmp_path, 120)
    assert rc == 0, out[-4000:]
    for rank in range(2):
        assert "smoke: PASSED" in (tmp_path / f"rank{rank}.log").read_text()


def test_latency_tp_benchmark_plumbing_on_cpu(tmp_path):
    """The benchmark's rank coordination (rank 0's budget decisions, TP=1 on rank 0 alone, rows
    merged over ranks, the TP=2-vs-TP=1 check) on tiny shapes with simulated graphs."""
    rc, out = torchrun(2, ["benchmarks/latency_tp.py", "--cpu-smoke", "--benches", "llama8b-tp1,llama8b-tp2,llama8b-tp2-nccl",
                           "--batches", "2", "--steps", "2", "--warmup", "1", "--no-plot", "--out",
                           str(tmp_path / "ltp")], tmp_path, 240)
    assert rc == 0, out[-4000:]
    payload = json.loads((tmp_path / "ltp.json").read_text())
    by = {(r["bench"], r["column"]): r for r in payload["rows"]}
    assert set(by) == {(b, c) for b in ("llama8b-tp1", "llama8b-tp2", "llama8b-tp2-nccl")
                       for c in ("ca-piecewise", "ca-full")}
    assert all(r["status"] == "ok" for r in by.values()), [r["reason"] for r in by.values()]
    assert by[("llama8b-tp2", "ca-full")]["rank1_p50_us"] > 0 and "rank1_p50_us" not in by[("llama8b-tp1", "ca-full")]
    assert [c["ok"] for c in payload["checks"]] == [True]
    md = (tmp_path / "ltp.md").read_text()
    assert "TP=2 ÷ TP=1" in md and "TP=2 ÷ TP=1, Llama-3-8B shape (p50), every all-reduce on NCCL" in md
    assert "2 layers, TP=2, every all-reduce on NCCL" in md  # the shared model's layer count


@pytest.mark.cuda
def test_tp2_equals_tp1_bf16_with_real_cuda_graphs(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (run on nvidia-h200-x2: .ci/gpu-tp)")
    results = run_check(2, ["--device", "cuda", "--dtype", "bfloat16", "--graphs", "real", "--piece-compiler",
                            "inductor", "--modes", "eager,piecewise,full_and_piecewise,engine", "--heads", "8",
                            "--kv-heads", "2", "--head-dim", "128", "--hidden", "512"], tmp_path, timeout=400)
    for r in results:
        for mode in ("piecewise", "full_and_piecewise"):
            c = r["modes"][mode]["counters"]
            assert c["collectives_in_pieces"] == 4 and c["cudagraph_replays"] > 0
        assert r["modes"]["full_and_piecewise"]["counters"]["full_graphs"] > 0


def tiny_hf_llama(directory: Path) -> Path:
    """A 2-layer transformers Llama (GQA 4/2, head dim 32, random weights, seed 0) saved to ``directory``."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(directory)
    return directory


LLM_TP_SCRIPT = r'''
import json, sys
import torch
import compileattn
import compileattn.parallel

model_dir, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
config = compileattn.CompileConfig(piece_compiler="eager", cudagraph_mode="none") if mode == "compiled" else None
prefix = dict(block_size=4, enable_prefix_caching=True) if mode == "prefix" else {}
llm = compileattn.LLM(model_dir, tensor_parallel_size=2, dtype="float32", compile_config=config,
                      num_blocks=64, max_num_seqs=4, max_num_batched_tokens=16, **prefix)
prompts = [[5, 6, 7, 8, 9], [3] * 11, [1, 2]]
rank = torch.distributed.get_rank()
print(f"rank {rank}: loaded", file=sys.stderr, flush=True)  # stages, for a failure's log
outputs = llm.generate(prompts, max_new_tokens=6, use_tqdm=False)
print(f"rank {rank}: generated", file=sys.stderr, flush=True)
json.dump([o.token_ids for o in outputs], open(f"{out}.{rank}.json", "w"))
if mode == "prefix":  # again: rank 0 plans from the prefix cache, the others run its steps
    outputs = llm.generate(prompts, max_new_tokens=6, use_tqdm=False)
    json.dump([[o.token_ids for o in outputs], llm.engine.prefix_cache_stats.hit_tokens],
              open(f"{out}.{rank}.again.json", "w"))
try:
    llm.generate([[1] * 500], max_new_tokens=4, use_tqdm=False)  # too long for the cache: rank 0 refuses
except Exception as exc:
    json.dump(str(exc), open(f"{out}.{rank}.err.json", "w"))
try:  # the ranks disagree: each got rank 0's outputs for prompts it never passed; now every rank refuses
    llm.generate([[1, 2, 3 + rank]], max_new_tokens=2, use_tqdm=False)
except ValueError as exc:
    json.dump(str(exc), open(f"{out}.{rank}.differ.json", "w"))
try:  # rank 1 refuses its own arguments before the ranks compare them: rank 0 must not wait for it
    llm.generate([[1, 2, 3]], max_new_tokens=2, use_tqdm=False, ignore_eos="yes" if rank == 1 else False)
except (TypeError, ValueError) as exc:
    json.dump(f"{type(exc).__name__}: {exc}", open(f"{out}.{rank}.refused.json", "w"))
print(f"rank {rank}: shutting down", file=sys.stderr, flush=True)
compileattn.parallel.shutdown_tp()
# Nothing may keep a destroyed group alive: its gloo threads would then be torn down at interpreter
# exit, which aborts the process now and then ("terminate called without an active exception").
import os
if os.path.isdir("/proc/self/task"):
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    if any("gloo" in n for n in names):
        raise SystemExit(f"rank {rank}: gloo threads outlive shutdown_tp: {sorted(names)}")
print(f"rank {rank}: done", file=sys.stderr, flush=True)
'''


@pytest.mark.parametrize("mode", ["eager", "compiled", "prefix"])
def test_llm_tensor_parallel_size_2_equals_one_process(tmp_path, mode):
    """``LLM(..., tensor_parallel_size=2)`` under torchrun (gloo): every rank returns rank 0's
    outputs, equal to one process's greedy tokens (fp32); a request rank 0 refuses raises on
    every rank instead of leaving the others waiting. ``prefix``: with prefix caching, a second
    call served from the cache rank 0 keeps gives the same tokens on every rank."""
    import compileattn

    model_dir = tiny_hf_llama(tmp_path / "model")
    expected = [o.token_ids for o in compileattn.LLM(str(model_dir), dtype="float32", compile_config=None, num_blocks=64,
                                                     max_num_seqs=4, max_num_batched_tokens=16).generate(
        [[5, 6, 7, 8, 9], [3] * 11, [1, 2]], max_new_tokens=6, use_tqdm=False)]
    script = tmp_path / "llm_tp.py"
    script.write_text(LLM_TP_SCRIPT)
    out = tmp_path / "tokens"
    rc, log = torchrun(2, [str(script), str(model_dir), str(out), mode], tmp_path, timeout=240)
    assert rc == 0, log[-4000:]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"tokens.{rank}.json").read_text()) == expected
        assert "max_model_len" in json.loads((tmp_path / f"tokens.{rank}.err.json").read_text())
        assert "the ranks' arguments differ" in json.loads((tmp_path / f"tokens.{rank}.differ.json").read_text())
        refused = json.loads((tmp_path / f"tokens.{rank}.refused.json").read_text())
        assert refused.startswith("TypeError: ignore_eos must be a bool" if rank == 1 else
                                  "ValueError: tensor parallel generate: rank 1 refused its arguments (TypeError: "
                                  "ignore_eos must be a bool"), refused
        if mode == "prefix":
            again, hits = json.loads((tmp_path / f"tokens.{rank}.again.json").read_text())
            assert again == expected
            if rank == 0:  # whole blocks of 4, the last token left to compute: 4 + 8 + 0
                assert hits == 12


HF_FAMILIES_TP_SCRIPT = r'''
import json, sys
import torch
import compileattn
import compileattn.parallel
sys.path.insert(0, "tests")
from hf_families import prompts

out, model_dirs = sys.argv[1], sys.argv[2].split(",")
tokens = {}
for model_dir in model_dirs:  # one group for every family: a family's build reuses the group init_tp made
    llm = compileattn.LLM(model_dir, tensor_parallel_size=2, dtype="float32", compile_config=None, num_blocks=64,
                          max_num_seqs=4, max_num_batched_tokens=16)
    tokens[model_dir] = [o.token_ids for o in llm.generate(prompts(), max_new_tokens=8, use_tqdm=False)]
json.dump(tokens, open(f"{out}.{torch.distributed.get_rank()}.json", "w"))
compileattn.parallel.shutdown_tp()
'''
#: The families ``tests/hf_families.py`` serves that tensor parallelism serves too (every one but the
#: two ``test_hf_families_tp_cannot_shard_are_refused_up_front`` names), each with what TP must get right.
TP_FAMILIES = ("qwen2", "qwen3", "gemma2", "gemma3",  # Llama's layout, per-head_dim q/k norms, softcaps
               "cohere",  # a (heads, head_dim) qk LayerNorm: each rank keeps its heads' rows
               "cohere2", "cohere2_moe",  # the MoE's routed experts (no plan entry) replicated
               "granite", "granitemoe", "granitemoeshared", "granitemoehybrid",  # multipliers; experts replicated
               "hyperclovax")  # a logit scale after the (replicated) LM head
#: Families again with a config change TP must serve, by directory name: (family, overrides).
TP_VARIANTS = {"cohere_tied": ("cohere", dict(tie_word_embeddings=True))}  # 5.17 plans embedding_rowwise


def test_hf_families_tp2_equal_tp1(tmp_path):
    """Every family served with ``tensor_parallel_size=2`` (gloo, fp32) gives one process's greedy
    tokens, on prompts that cross the sliding windows. One torchrun serves them all, one after the
    other in the same group: a torchrun per family costs its start and imports each time."""
    import compileattn
    from hf_families import _config, prompts, save_family

    expected, dirs = {}, []
    # A family whose config has no plan in this transformers (Granite-MoE's in 5.17) is refused as OPT is
    variants = {**{f: (f, {}) for f in TP_FAMILIES}, **TP_VARIANTS}
    for name, (family, overrides) in variants.items():
        if not _config(family, **overrides).base_model_tp_plan:
            continue
        model_dir = str(save_family(family, tmp_path / name, **overrides))
        dirs.append(model_dir)
        expected[model_dir] = [o.token_ids for o in compileattn.LLM(
            model_dir, dtype="float32", compile_config=None, num_blocks=64, max_num_seqs=4,
            max_num_batched_tokens=16).generate(prompts(), max_new_tokens=8, use_tqdm=False)]
    script = tmp_path / "families_tp.py"
    script.write_text(HF_FAMILIES_TP_SCRIPT)
    rc, log = torchrun(2, [str(script), str(tmp_path / "tokens"), ",".join(dirs)], tmp_path, timeout=400)
    assert rc == 0, log[-4000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"tokens.{rank}.json").read_text())
        wrong = [Path(d).name for d in dirs if got[d] != expected[d]]
        assert not wrong, (rank, wrong)


@pytest.mark.parametrize("family,reason", [
    ("phi3", r"Phi3ForCausalLM: unsupported tensor-parallel style\(s\) \['colwise_gather_output', 'rowwise_split_input'\]"),
    ("opt", "OPTForCausalLM has no tensor-parallel plan")])
def test_hf_families_tp_cannot_shard_are_refused_up_front(family, reason):
    """Phi-3's plan gathers its fused projections' outputs (and its attention slices the fused qkv
    at the full model's query width, read from the config); transformers' OPT has no plan. Each is
    refused by the sharding, before any module changes (``LLM`` shards while it loads, so every rank
    raises the same ``UnsupportedModelError``), not served with wrong shapes."""
    import transformers

    from compileattn.refusals import UnsupportedModelError
    from hf_families import _config

    model = transformers.AutoModelForCausalLM.from_config(_config(family))
    with pytest.raises(UnsupportedModelError, match=reason):
        shard_model(model, tp=fake_tp(0, 2))
    assert getattr(model, "tp_shard", None) is None


STEP_FAILURE_SCRIPT = r'''
import json, sys, time
import torch
import compileattn
from compileattn.parallel.failure import TPGroupFailed

model_dir, out, failing_rank, device = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
config = compileattn.CompileConfig() if device == "cuda" else None  # on GPUs: the collectives in CUDA graphs
llm = compileattn.LLM(model_dir, tensor_parallel_size=2, dtype="float32", device=device, compile_config=config,
                      num_blocks=64, max_num_seqs=4, max_num_batched_tokens=16)
rank = torch.distributed.get_rank()
first = llm.generate([[5, 6, 7, 8, 9]], max_new_tokens=3, use_tqdm=False)
if rank == failing_rank:  # this rank's third step of the next call raises, in its forward
    forward, calls = llm.engine.runner.forward, []

    def failing_forward(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure in the forward")
        return forward(*args)

    llm.engine.runner.forward = failing_forward
start = time.perf_counter()
try:
    llm.generate([[1, 2, 3], [4] * 9], max_new_tokens=8, use_tqdm=False)
    first_error = None
except TPGroupFailed as exc:
    first_error = str(exc)
seconds = time.perf_counter() - start
start = time.perf_counter()
try:  # the group is gone: refused at once, with the same reason
    llm.generate([[1, 2, 3]], max_new_tokens=2, use_tqdm=False)
    second_error = None
except TPGroupFailed as exc:
    second_error = str(exc)
json.dump({"first": first_error, "seconds": seconds, "second": second_error,
           "second_seconds": time.perf_counter() - start, "tokens": first[0].token_ids},
          open(f"{out}.{rank}.json", "w"))
print(f"rank {rank}: done", file=sys.stderr, flush=True)
'''


@pytest.mark.parametrize("device, failing_rank", [("cpu", 1), ("cpu", 0),
                                                  pytest.param("cuda", 1, marks=pytest.mark.cuda)])
def test_a_step_failing_on_one_rank_fails_every_rank_at_once_with_its_reason(tmp_path, device, failing_rank):
    """A rank whose forward raises mid-``generate`` leaves its peer inside that step's collectives:
    it publishes its reason and shuts the group down, so the peer's collective fails at once (not
    after the group's 600 s timeout) and every rank raises ``TPGroupFailed`` naming the failing rank
    and its exception; a later ``generate`` is refused with the same reason before any collective.
    On GPUs rank 0 waits on a CUDA graph whose all-reduce rank 1 never joins: its polling wait sees
    the store."""
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (run on nvidia-h200-x2: .ci/gpu-tp)")
    model_dir = tiny_hf_llama(tmp_path / "model")
    script = tmp_path / "step_failure.py"
    script.write_text(STEP_FAILURE_SCRIPT)
    out = tmp_path / "result"
    rc, log = torchrun(2, [str(script), str(model_dir), str(out), str(failing_rank), device], tmp_path, timeout=240)
    assert rc == 0, log[-4000:]
    reason = f"rank {failing_rank} failed in a step: RuntimeError: injected failure in the forward"
    for rank in (0, 1):
        result = json.loads((tmp_path / f"result.{rank}.json").read_text())
        assert len(result["tokens"]) == 3  # the group served before the failure
        assert result["first"] is not None and reason in result["first"], (rank, result)
        assert result["seconds"] < 60, result  # the group's timeout is 600 s
        assert result["second"] is not None and reason in result["second"], (rank, result)
        assert result["second_seconds"] < 1, result


LATE_FAILURE_SCRIPT = r"""
import json, sys, time
import torch
import compileattn

model_dir, out, case = sys.argv[1], sys.argv[2], sys.argv[3]
llm = compileattn.LLM(model_dir, tensor_parallel_size=2, dtype="float32", compile_config=None, num_blocks=64,
                      max_num_seqs=4, max_num_batched_tokens=16)
rank = torch.distributed.get_rank()
llm.generate([[5, 6, 7]], max_new_tokens=2, use_tqdm=False)
if rank == 1 and case == "after-last-step":  # the call's third (last) step fails after its forward's collectives
    run, calls = llm.engine._runner_run, []

    def failing_run(prepared):
        hidden = run(prepared)
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure after the last forward")
        return hidden

    llm.engine._runner_run = failing_run
if rank == 1 and case == "at-outputs":  # interrupted after serve(), as rank 0 broadcasts the outputs
    broadcast, calls = llm.tp.broadcast_object, []

    def interrupted_broadcast(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:  # 3 steps, serve's end, the outputs
            raise KeyboardInterrupt("injected interrupt")
        return broadcast(*args, **kwargs)

    object.__setattr__(llm.tp, "broadcast_object", interrupted_broadcast)
if rank == 0 and case == "rank-0-before-forward":  # its second step is broadcast, then rank 0 fails before running it
    launch, calls = llm.engine._launch, []

    def failing_launch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("injected interrupt before the forward")
        return launch(*args, **kwargs)

    llm.engine._launch = failing_launch
errors = []
for _ in range(2):
    start = time.perf_counter()
    try:
        llm.generate([[1, 2, 3]], max_new_tokens=3, ignore_eos=True, use_tqdm=False)
        errors.append([None, time.perf_counter() - start])
    except BaseException as exc:
        errors.append([f"{type(exc).__name__}: {exc}", time.perf_counter() - start])
json.dump(errors, open(f"{out}.{rank}.json", "w"))
print(f"rank {rank}: done", file=sys.stderr, flush=True)
"""


@pytest.mark.parametrize("case", ["after-last-step", "at-outputs", "rank-0-before-forward"])
def test_a_rank_failing_outside_the_steps_collectives_is_named_on_every_rank(tmp_path, case):
    """A rank that fails after its last collective of a call (its last step's forward done, or
    interrupted as rank 0 broadcasts the outputs) shuts the group down; rank 0 sees that only in
    ``generate``'s own collectives (the end of ``serve``, the outputs, the next call's agreement),
    which raised gloo's bare "connection closed" there, or waited for ever once the ranks' calls no
    longer paired up. They end the group as a step does: every rank raises ``TPGroupFailed`` naming
    rank 1, and so does the next call. Rank 0 failing after it broadcast a step, before running it,
    cannot end ``generate`` cleanly (its broadcast of the end met rank 1 inside the step's
    all-reduce: both waited for ever): it ends the group too."""
    model_dir = tiny_hf_llama(tmp_path / "model")
    script = tmp_path / "late_failure.py"
    script.write_text(LATE_FAILURE_SCRIPT)
    rc, log = torchrun(2, [str(script), str(model_dir), str(tmp_path / "errors"), case], tmp_path, timeout=120)
    assert rc == 0, log[-4000:]
    reason = {"after-last-step": "rank 1 failed in a step: RuntimeError: injected failure after the last forward",
              "at-outputs": "rank 1 failed in generate: KeyboardInterrupt: injected interrupt",
              "rank-0-before-forward": "rank 0 failed in generate: KeyboardInterrupt: injected interrupt before the "
                                       "forward"}[case]
    for rank in (0, 1):
        errors = json.loads((tmp_path / f"errors.{rank}.json").read_text())
        for error, seconds in errors:
            assert error is not None and error.startswith("TPGroupFailed: ") and reason in error, (rank, errors)
            assert seconds < 30, (rank, errors)


PEER_DEATH_SCRIPT = r'''
import json, os, sys, time
import torch
import compileattn

model_dir, out, dying = sys.argv[1], sys.argv[2], int(sys.argv[3])
llm = compileattn.LLM(model_dir, tensor_parallel_size=2, dtype="float32", compile_config=None, num_blocks=64,
                      max_num_seqs=4, max_num_batched_tokens=16)
rank = torch.distributed.get_rank()
llm.generate([[5, 6, 7]], max_new_tokens=2, use_tqdm=False)
if rank == dying:  # this rank's process ends in its second forward of the next call, publishing nothing
    forward, calls = llm.engine.runner.forward, []

    def dying_forward(*args):
        calls.append(1)
        if len(calls) == 2:
            os._exit(0)
        return forward(*args)

    llm.engine.runner.forward = dying_forward
start = time.perf_counter()
try:
    llm.generate([[1, 2, 3]], max_new_tokens=5, ignore_eos=True, use_tqdm=False)
    error = None
except BaseException as exc:
    error = f"{type(exc).__name__}: {exc}"
json.dump([error, getattr(llm.engine.failure, "ranks", None), time.perf_counter() - start],
          open(f"{out}.{rank}.json", "w"))
'''


@pytest.mark.parametrize("dying", [1, 0])
def test_a_rank_whose_process_dies_is_named_by_the_others(tmp_path, dying):
    """A rank whose process ends mid-``generate`` (killed, ``os._exit``) publishes no reason; its
    peer sees only gloo's "connection closed/reset by peer" in a collective. The peer names the
    rank that died, not itself (it said "rank 0 failed in a step: ... Connection closed by peer")."""
    model_dir = tiny_hf_llama(tmp_path / "model")
    script = tmp_path / "peer_death.py"
    script.write_text(PEER_DEATH_SCRIPT)
    rc, log = torchrun(2, [str(script), str(model_dir), str(tmp_path / "error"), str(dying)], tmp_path, timeout=120)
    survivor = 1 - dying
    error, ranks, seconds = json.loads((tmp_path / f"error.{survivor}.json").read_text())
    assert error is not None and error.startswith(f"TPGroupFailed: rank {dying} failed in a step: its process "
                                                  f"ended"), (error, log[-4000:])
    assert f"rank {survivor} failed" not in error, error
    assert ranks == [dying] and seconds < 30, (ranks, seconds)
    assert not (tmp_path / f"error.{dying}.json").exists()


def test_a_dead_peer_among_several_is_named_by_every_survivor():
    """With more than two ranks a survivor whose collective lost a peer cannot tell from gloo's
    error which peer ended: the survivors mark themselves alive in the store and name the rank that
    never answered (and publish that, so a rank failing later reads the same reason)."""
    import threading

    from compileattn.parallel.failure import fail_group

    store = torch.distributed.HashStore()
    groups = [TPGroup(r, 3, torch.device("cpu"), store=store, token="t") for r in range(3)]
    lost = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:30858")
    errors = {}
    threads = [threading.Thread(target=lambda r=r: errors.__setitem__(r, fail_group(groups[r], lost)))
               for r in (0, 1)]  # rank 2 died: it never answers
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for r in (0, 1):
        assert errors[r].ranks == (2,), (r, str(errors[r]))
        assert str(errors[r]).startswith("rank 2 failed in a step: its process ended"), str(errors[r])
    late = fail_group(groups[0], lost)  # the published reason, at once
    assert late.ranks == (2,)
    two = TPGroup(0, 2, torch.device("cpu"), store=torch.distributed.HashStore(), token="u")
    assert fail_group(two, lost).ranks == (1,)  # the only peer
    assert fail_group(two, RuntimeError("boom")).ranks == (1,)  # its reason is published now
    own = TPGroup(0, 2, torch.device("cpu"), store=torch.distributed.HashStore(), token="v")
    assert fail_group(own, RuntimeError("out of memory")).ranks == (0,)  # not a lost peer: this rank's own


MISMATCHED_CALLS_SCRIPT = r'''
import json, logging, sys, time
import torch
import compileattn
import compileattn.parallel.group

model_dir, out = sys.argv[1], sys.argv[2]
compileattn.parallel.group.ARRIVAL_WARN_S = 0.5
warnings = []
handler = logging.Handler()
handler.emit = lambda record: warnings.append(record.getMessage()) if record.levelno == logging.WARNING else None
logging.getLogger("compileattn").addHandler(handler)
llm = compileattn.LLM(model_dir, tensor_parallel_size=2, dtype="float32", compile_config=None, num_blocks=64,
                      max_num_seqs=4, max_num_batched_tokens=16)
rank = torch.distributed.get_rank()
start = time.perf_counter()
try:  # rank 1 calls the group's barrier while rank 0 is in generate
    if rank == 0:
        llm.generate([[1, 2, 3]], max_new_tokens=3, use_tqdm=False)
    else:
        llm.tp.barrier()
    mismatch = None
except Exception as exc:
    mismatch = f"{type(exc).__name__}: {exc}"
seconds = time.perf_counter() - start
warnings.clear()
if rank == 1:  # a rank late to generate (its own work first): the waiting rank says whom it waits for
    time.sleep(2)
tokens = llm.generate([[1, 2, 3]], max_new_tokens=3, use_tqdm=False)[0].token_ids  # the group is intact
json.dump({"mismatch": mismatch, "seconds": seconds, "tokens": tokens, "warnings": warnings},
          open(f"{out}.{rank}.json", "w"))
'''


def test_a_rank_in_barrier_while_another_is_in_generate_raises_on_both(tmp_path):
    """``tp.barrier()`` on one rank while another is in ``generate`` paired no collective: both
    waited for the group's 600 s timeout. The group's host calls name themselves in their gather,
    so both raise at once naming each rank's call, and the group serves on. A rank late to
    ``generate`` (or in a ``torch.distributed`` collective of its own, which no gather sees) is
    named in a warning by the ranks waiting for it."""
    model_dir = tiny_hf_llama(tmp_path / "model")
    script = tmp_path / "mismatched_calls.py"
    script.write_text(MISMATCHED_CALLS_SCRIPT)
    rc, log = torchrun(2, [str(script), str(model_dir), str(tmp_path / "result")], tmp_path, timeout=90)
    assert rc == 0, log[-4000:]
    results = [json.loads((tmp_path / f"result.{rank}.json").read_text()) for rank in (0, 1)]
    for result in results:
        assert result["mismatch"] is not None and result["mismatch"].startswith(
            "CallMismatch: tensor parallel: the ranks are in different calls (rank 0: LLM.generate; rank 1: "
            "TPGroup.barrier)"), results
        assert result["seconds"] < 30, results
        assert result["tokens"] == results[0]["tokens"] and len(result["tokens"]) == 3
    assert any("waited" in w and "rank 1" in w for w in results[0]["warnings"]), results[0]["warnings"]
    assert not results[1]["warnings"], results[1]["warnings"]


UNMATCHED_SERVE_SCRIPT = r'''
import datetime, json, sys, time
import compileattn.parallel
from compileattn.models.llama import LlamaConfig, LlamaForCausalLM
from compileattn.parallel import CallMismatch, init_tp, shard_model
from compileattn.parallel.driver import TPEngine

tp = init_tp(device="cpu", timeout=datetime.timedelta(seconds=30))
engine = TPEngine(shard_model(LlamaForCausalLM(LlamaConfig.tiny(), seed=0), tp=tp), tp=tp, num_blocks=16,
                  max_num_tokens=16, max_num_seqs=4, block_size=4)
# Rank 0's extra call first, then the others' extra call; each raises on both ranks.
extra = {0: ["stop_workers", "barrier"], 1: ["barrier", "serve"]}[tp.rank]
mismatches, seconds, served = [], [], []
for call in extra:
    if tp.is_driver:
        engine.generate([[1, 2, 3]], max_new_tokens=2, max_tokens_per_step=16)
        engine.stop_workers()
    else:
        served.append(engine.serve())
    start = time.perf_counter()
    try:
        engine.stop_workers() if call == "stop_workers" else engine.serve() if call == "serve" else tp.barrier()
    except CallMismatch as exc:
        mismatches.append(str(exc))
    seconds.append(time.perf_counter() - start)
if tp.is_driver:  # the group serves on
    engine.generate([[1, 2, 3]], max_new_tokens=2, max_tokens_per_step=16)
    engine.stop_workers()
else:
    served.append(engine.serve())
tp.barrier()
json.dump({"mismatches": mismatches, "seconds": seconds, "served": served}, open(f"{sys.argv[1]}.{tp.rank}.json", "w"))
compileattn.parallel.shutdown_tp()
'''


def test_a_stop_without_a_serve_or_a_serve_without_a_stop_raises_on_every_rank(tmp_path):
    """Each ``stop_workers`` ends one ``serve()``. A second stop while the others were elsewhere (a
    barrier) waited for the group's timeout, then broke the group; a ``serve()`` that rank 0 never
    stopped left that rank in its receive. ``serve()`` opens with an agreement that rank 0's next
    step or stop meets, so both raise ``CallMismatch`` at once on every rank, and the group serves on."""
    script = tmp_path / "unmatched_serve.py"
    script.write_text(UNMATCHED_SERVE_SCRIPT)
    rc, log = torchrun(2, [str(script), str(tmp_path / "unmatched")], tmp_path, timeout=120)
    assert rc == 0, log[-4000:]
    results = [json.loads((tmp_path / f"unmatched.{rank}.json").read_text()) for rank in (0, 1)]
    for result in results:
        assert [m.split(")")[0] for m in result["mismatches"]] == [
            "tensor parallel: the ranks are in different calls (rank 0: TPEngine.serve; rank 1: TPGroup.barrier",
            "tensor parallel: the ranks are in different calls (rank 0: TPGroup.barrier; rank 1: TPEngine.serve"], results
        assert all(s < 10 for s in result["seconds"]), results
    assert results[1]["served"] == [2, 2, 2], results  # a prefill and a decode step per generate


ROUNDS_SCRIPT = r'''
import datetime, json, sys, time
import compileattn.parallel
from compileattn.models.llama import LlamaConfig, LlamaForCausalLM
from compileattn.parallel import init_tp, shard_model
from compileattn.parallel.driver import TPEngine

tp = init_tp(device="cpu", timeout=datetime.timedelta(seconds=20))
engine = TPEngine(shard_model(LlamaForCausalLM(LlamaConfig.tiny(), seed=0), tp=tp), tp=tp, num_blocks=16,
                  max_num_tokens=16, max_num_seqs=4, block_size=4)
rounds = [[[1, 2, 3]], [], [[4, 5]]]  # rank 0's requests per round: the second has none, so it runs no step
served, error = [], None
start = time.perf_counter()
try:
    for prompts in rounds:
        if tp.is_driver:  # rank 0 used as an Engine, then stop_workers, once per round
            for prompt in prompts:
                engine.add_request(prompt, max_new_tokens=2)
            while engine.has_unfinished():
                engine.step(16)
            engine.stop_workers()
        else:  # the others cannot see rank 0's requests: one serve() per round
            served.append(engine.serve())
    tp.barrier()
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"
json.dump({"served": served, "error": error, "seconds": time.perf_counter() - start},
          open(f"{sys.argv[1]}.{tp.rank}.json", "w"))
compileattn.parallel.shutdown_tp()
'''


def test_each_stop_workers_ends_one_serve_even_for_a_round_without_steps(tmp_path):
    """Rank 0 steps through its requests and calls ``stop_workers`` once per round while the other
    ranks, which cannot see its requests, call ``serve()`` once per round. A round with no step
    (no requests, or all refused) made rank 0 take its stop for a repeated one and broadcast
    nothing: the others waited in ``serve()`` while rank 0 went on."""
    script = tmp_path / "rounds.py"
    script.write_text(ROUNDS_SCRIPT)
    rc, log = torchrun(2, [str(script), str(tmp_path / "rounds")], tmp_path, timeout=120)
    results = [json.loads((tmp_path / f"rounds.{rank}.json").read_text()) for rank in (0, 1)]
    assert rc == 0 and not any(r["error"] for r in results), (results, log[-4000:])
    assert results[1]["served"] == [2, 0, 2], results  # a prefill and a decode step per prompt
    assert all(r["seconds"] < 15 for r in results), results


EXIT_WITHOUT_SHUTDOWN_SCRIPT = r'''
import atexit, json, os, sys
import torch.distributed as dist
out, rank = sys.argv[1], os.environ["RANK"]
# Registered before init_tp's own exit handler, so it runs after it (atexit is last in, first out).
atexit.register(lambda pid=os.getpid(): os.getpid() == pid and json.dump(dist.is_initialized(),
                                                                         open(f"{out}.{rank}.json", "w")))
import compileattn.parallel
tp = compileattn.parallel.init_tp(device="cpu")
tp.broadcast_object({"step": 1} if tp.rank == 0 else None)
child = os.fork()
if child == 0:  # a forked child ending through sys.exit runs the handlers it inherited: not on its parent's group
    atexit._run_exitfuncs()
    json.dump(dist.is_initialized(), open(f"{out}.{rank}.child.json", "w"))
    os._exit(0)
os.waitpid(child, 0)
tp.broadcast_object({"step": 2} if tp.rank == 0 else None)  # the group still serves; the last collective
'''


def test_a_script_ending_without_shutdown_has_its_group_destroyed_before_the_interpreter_finalises(tmp_path):
    """A script that ends with the group alive left it to interpreter finalisation, where a gloo
    worker still releasing its last work took the GIL of the finalising interpreter and aborted the
    rank ("terminate called without an active exception", 1 run in 7 of a two-rank script):
    ``init_tp`` destroys the group it made at exit, in the process that made it only (a forked
    child's exit leaves its parent's group alone)."""
    script = tmp_path / "exit_without_shutdown.py"
    script.write_text(EXIT_WITHOUT_SHUTDOWN_SCRIPT)
    rc, log = torchrun(2, [str(script), str(tmp_path / "initialised_at_exit")], tmp_path, timeout=90)
    assert rc == 0, log[-4000:]
    assert [json.loads((tmp_path / f"initialised_at_exit.{rank}.json").read_text()) for rank in (0, 1)] == [False, False]
    assert [json.loads((tmp_path / f"initialised_at_exit.{rank}.child.json").read_text()) for rank in (0, 1)] == [True, True]


BUILD_FAILURE_SCRIPT = r'''
import json, sys
import torch
import compileattn
from compileattn.engine.llm import LLM
from compileattn.parallel.failure import TPGroupFailed

model_dir, out, case = sys.argv[1], sys.argv[2], sys.argv[3]
rank = int(__import__("os").environ["RANK"])
if case == "one-rank" and rank == 1:  # this rank's load fails; rank 0's load-time probe is in its all-reduces
    def failing_load(*args, **kwargs):
        raise OSError("injected: the checkpoint is unreadable on this rank")

    LLM._load = staticmethod(failing_load)
# rank 1 compiles (its warm-up step's all-reduces), rank 0 does not
config = compileattn.CompileConfig(piece_compiler="eager", cudagraph_mode="none") if case == "settings-differ" and rank == 1 else None
# rank 1's block tables would hold one block: rank 0's steps of longer sequences failed on it
max_model_len = 16 if case == "max-model-len-differs" and rank == 1 else None
try:
    compileattn.LLM(model_dir, tensor_parallel_size=2, dtype="float32", compile_config=config, num_blocks=64,
                    max_num_seqs=4, max_num_batched_tokens=16, max_model_len=max_model_len)
    error = None
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"
json.dump(error, open(f"{out}.{rank}.json", "w"))
'''


@pytest.mark.parametrize("case", ["one-rank", "every-rank", "settings-differ", "max-model-len-differs"])
def test_an_llm_that_fails_to_build_on_one_rank_fails_on_every_rank(tmp_path, case):
    """A rank whose build fails (its checkpoint unreadable) would leave the others in the load-time
    probe's all-reduces until the group's timeout: it raises its own error and the others
    ``TPGroupFailed`` naming it, at once. A model every rank refuses (head dim 16) raises its own
    ``UnsupportedModelError`` on every rank, as without tensor parallelism. Ranks built with
    different settings (one compiling, one not: the compile's warm-up step holds all-reduces the
    other rank never runs) are refused on every rank, naming the setting, before any collective
    pairs up wrongly (it waited, or was left with "connection closed"); so are ranks given different
    ``max_model_len`` (each rank's block tables hold that many tokens: rank 0 scheduled a longer
    sequence than rank 1 could run, which ended the group at the first such step)."""
    import transformers

    if case in ("one-rank", "settings-differ", "max-model-len-differs"):
        model_dir = tiny_hf_llama(tmp_path / "model")
    else:
        model_dir = tmp_path / "model"
        transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256)).save_pretrained(model_dir)
    script = tmp_path / "build_failure.py"
    script.write_text(BUILD_FAILURE_SCRIPT)
    rc, log = torchrun(2, [str(script), str(model_dir), str(tmp_path / "error"), case], tmp_path, timeout=180)
    assert rc == 0, log[-4000:]
    errors = [json.loads((tmp_path / f"error.{rank}.json").read_text()) for rank in (0, 1)]
    if case == "one-rank":
        assert errors[1] == "OSError: injected: the checkpoint is unreadable on this rank", errors
        assert errors[0].startswith("TPGroupFailed: rank 1 failed while building the LLM: OSError: injected"), errors
    elif case == "settings-differ":
        for error in errors:
            assert error.startswith("ValueError: tensor parallel LLM: the ranks' settings differ: compiled (rank 0: "
                                    "False; rank 1: True)"), errors
    elif case == "max-model-len-differs":
        for error in errors:
            assert error.startswith("ValueError: tensor parallel LLM: the ranks' settings differ: max_model_len (rank "
                                    "0: None; rank 1: 16)"), errors
    else:
        for error in errors:
            assert error.startswith("UnsupportedModelError: ") and "head_dim=16" in error, errors


def test_rank_0_waiting_for_a_step_learns_of_a_peer_failure_from_the_store():
    """On GPUs rank 0 waits for a step whose collective kernel a failed peer will never join, and
    nothing interrupts a wait on a CUDA graph: its wait polls the step's event and, now and then,
    the store, and raises once a peer published its failure; with none, it returns when the
    event completes."""
    import threading
    import time

    from compileattn.parallel.failure import PeerFailed, failure_reasons, wait_watching_peers

    class Event:
        def __init__(self, done_after_s: float | None):
            self.done_at = None if done_after_s is None else time.monotonic() + done_after_s

        def query(self) -> bool:
            return self.done_at is not None and time.monotonic() >= self.done_at

    store = torch.distributed.HashStore()
    tp = TPGroup(0, 2, torch.device("cpu"), store=store, token="t")
    wait_watching_peers(tp, Event(0.05), poll_s=0.01)  # no failure: returns when the step is done
    assert failure_reasons(tp) == {}
    threading.Timer(0.1, lambda: store.set("compileattn/tp/t/failed/1", "OutOfMemoryError: ...")).start()
    start = time.monotonic()
    with pytest.raises(PeerFailed):
        wait_watching_peers(tp, Event(None), poll_s=0.01)  # a step that never completes
    assert time.monotonic() - start < 5
    assert failure_reasons(tp) == {1: "OutOfMemoryError: ..."}
    other = TPGroup(0, 2, torch.device("cpu"), store=store, token="u")  # a later group: not its failure
    assert failure_reasons(other) == {}


def test_rank_0_waiting_for_a_step_no_peer_joins_gives_up_after_the_group_timeout():
    """A peer that ended (or hangs) without publishing a reason never joins the step's collective,
    and nothing interrupts a wait on a CUDA graph: rank 0's wait polled the store for ever."""
    import threading
    import time

    from compileattn.parallel.failure import wait_watching_peers

    class Never:
        def query(self) -> bool:
            return False

    tp = TPGroup(0, 2, torch.device("cpu"), store=torch.distributed.HashStore(), token="t")
    tp = dataclasses.replace(tp, timeout_s=0.2)
    raised = []

    def wait():
        try:
            wait_watching_peers(tp, Never(), poll_s=0.01)
        except TimeoutError as exc:
            raised.append(str(exc))

    start = time.monotonic()
    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(10)
    assert not waiter.is_alive(), "the wait did not end"
    assert time.monotonic() - start < 5 and raised and "no rank published a failure" in raised[0], raised


@pytest.mark.slow
def test_gpu_tp_script_dry_run_on_cpu(tmp_path):
    """``.ci/gpu-tp``, the 2-GPU command, in its CPU mode (gloo, simulated graphs, tiny shapes):
    its phases, limits and log plumbing run as on the lent machine, so the script cannot rot
    between the sessions that have two GPUs."""
    env = {**os.environ, **NCCL_ENV, "GPU_TP_CPU": "1", "GPU_TP_TOTAL_S": "400",
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    proc = subprocess.run(["bash", str(ROOT / ".ci" / "gpu-tp"), str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=480)
    log = (tmp_path / "gpu_tp.log").read_text()
    assert proc.returncode == 0, log[-4000:]
    assert "smoke: PASSED" in log and "check exit 0 (PASSED)" in log and "bench exit 0" in log
    assert (tmp_path / "latency_tp.json").exists()


@pytest.mark.parametrize("modes", ["", ",", " , "])
def test_the_check_refuses_an_empty_mode_list(modes, capsys):
    """``--modes ""`` ran no mode and reported PASS: a check that could not fail."""
    from compileattn.parallel import check

    with pytest.raises(SystemExit):
        check.parse_args(["--model", "llama", "--modes", modes])
    assert "--modes names no mode" in capsys.readouterr().err
