"""``python -m compileattn generate|throughput`` on a tiny checkpoint (``main`` is what ``-m`` runs)."""
import pytest

from compileattn.__main__ import main
from hf_families import byte_level_tokenizer, hf_greedy, load_reference, save_family


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = save_family("llama", tmp_path_factory.mktemp("cli"), vocab_size=256)
    byte_level_tokenizer().save_pretrained(directory)
    return directory


def test_generate_prints_the_greedy_text_of_each_prompt(model_dir, capsys):
    assert main(["generate", "--model", str(model_dir), "--prompt", "Hello", "--prompt-ids", "5,6,7",
                 "--max-new-tokens", "5", "--num-blocks", "32"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "KV cache: 32 blocks" in captured.err  # the CLI logs compileattn's INFO lines to stderr
    reference = load_reference(model_dir)
    tokenizer = byte_level_tokenizer()
    hello = hf_greedy(reference, tokenizer.encode("Hello"), 5)[0]
    assert f"[0] prompt: 'Hello'" in out and f"[0] token_ids: {hello}" in out
    assert f"[0] text: {tokenizer.decode(hello)!r}" in out
    assert f"[1] token_ids: {hf_greedy(reference, [5, 6, 7], 5)[0]}" in out
    assert out.count("finish_reason: length") == 2


def test_generate_keeps_the_command_lines_order_of_prompts(model_dir, capsys):
    """Text prompts were served before token-id prompts whatever the order given, so [0] was not
    the first prompt on the command line."""
    assert main(["generate", "--model", str(model_dir), "--prompt-ids", "5,6,7", "--prompt", "Hello",
                 "--prompt-ids", "9", "--max-new-tokens", "2", "--num-blocks", "32"]) == 0
    out = capsys.readouterr().out
    assert "[0] prompt: [5, 6, 7]" in out and "[1] prompt: 'Hello'" in out and "[2] prompt: [9]" in out
    reference = load_reference(model_dir)
    assert f"[0] token_ids: {hf_greedy(reference, [5, 6, 7], 2)[0]}" in out
    assert f"[2] token_ids: {hf_greedy(reference, [9], 2)[0]}" in out


def test_throughput_reports_tokens_per_second(model_dir, capsys):
    assert main(["throughput", "--model", str(model_dir), "--num-prompts", "6", "--input-len", "4:12",
                 "--output-len", "3:6", "--num-blocks", "64", "--max-num-batched-tokens", "32"]) == 0
    out = capsys.readouterr().out
    assert "6 requests" in out and "output tokens/s" in out and "TPOT p50" in out


def test_throughput_warms_up_within_the_workloads_own_lengths(model_dir, capsys):
    """A workload that fills max_model_len (64 here) exactly: the warm-up's fixed 4 new tokens
    overran it and refused a workload that fits."""
    assert main(["throughput", "--model", str(model_dir), "--num-prompts", "2", "--input-len", "63:63",
                 "--output-len", "1:1", "--num-blocks", "4"]) == 0  # 4 blocks of 16 tokens
    assert "2 requests" in capsys.readouterr().out


def test_generate_with_prefix_caching_gives_the_same_tokens(model_dir, capsys):
    prompt = ",".join(str(t) for t in range(40, 80))
    argv = ["generate", "--model", str(model_dir), "--prompt-ids", prompt, "--prompt-ids", prompt + ",9",
            "--max-new-tokens", "4", "--num-blocks", "32", "--max-num-seqs", "1"]
    assert main(argv) == 0
    plain = capsys.readouterr()
    assert main(argv + ["--enable-prefix-caching"]) == 0
    cached = capsys.readouterr()
    assert cached.out == plain.out and "token_ids" in cached.out
    assert "prefix cache: 32 of 81 looked-up tokens hit" in cached.err  # two blocks of 16 for the second


def test_bad_flags_exit_with_usage(model_dir):
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(model_dir)])  # no prompt
    with pytest.raises(SystemExit):
        main(["throughput", "--model", str(model_dir), "--input-len", "9:3"])


def _refused(argv, capsys) -> str:
    """``main(argv)`` refused as argparse refuses a bad flag: exit status 2, the command's usage,
    no traceback; the stderr."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "usage: python -m compileattn" in err
    return err


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "-1"], "temperature must be a finite number >= 0, got -1.0"),
    (["--top-p", "2"], "top_p must be in (0, 1], got 2.0"),
    (["--max-new-tokens", "-1"], "max_new_tokens must be >= 0, got -1"),
    (["--prompt-ids", "5,300"], "prompts[1]: prompt token 300 out of range [0, 256)"),
    (["--max-model-len", "4"], "prompts[0]: prompt (3) + max_new_tokens (3) needs 5 positions > max_model_len 4"),
    (["--max-model-len", "0"], "max_model_len must be a positive int, got 0"),
    (["--num-blocks", "0"], "num_blocks must be a positive int, got 0"),
    (["--attention-backend", "nope"], "attention_backend='nope' is unknown"),
    (["--device", "meta"], "device='meta': compileattn serves on 'cpu' or 'cuda', not 'meta'"),
], ids=["temperature", "top-p", "max-new-tokens", "vocab", "max-model-len", "max-model-len-0", "num-blocks",
        "attention-backend", "device"])
def test_generate_refuses_input_mistakes_with_usage_not_a_traceback(model_dir, capsys, flags, message):
    """Each was a traceback ending in the message: the CLI checks the flags, the LLM's arguments and
    the prompts against the loaded model before it generates, and refuses what they refuse."""
    argv = ["generate", "--model", str(model_dir), "--prompt-ids", "5,6,7", "--max-new-tokens", "3",
            "--num-blocks", "32", *flags]
    assert f"python -m compileattn generate: error: {message}" in _refused(argv, capsys)


def test_generate_refuses_a_missing_model_directory_or_config(tmp_path, capsys):
    argv = ["generate", "--prompt-ids", "1", "--model"]
    err = _refused(argv + [str(tmp_path / "missing")], capsys)
    assert f"python -m compileattn generate: error: model directory '{tmp_path / 'missing'}' does not exist" in err
    assert f"error: {tmp_path} has no config.json" in _refused(argv + [str(tmp_path)], capsys)


def test_generate_refuses_the_sampling_flags_before_the_model_loads(tmp_path, capsys):
    err = _refused(["generate", "--model", str(tmp_path / "missing"), "--prompt-ids", "1", "--top-p", "0"], capsys)
    assert "error: top_p must be in (0, 1], got 0.0" in err


def test_generate_refuses_a_text_prompt_without_a_tokenizer(tmp_path, capsys):
    directory = save_family("llama", tmp_path / "no-tokenizer", vocab_size=256)
    err = _refused(["generate", "--model", str(directory), "--prompt", "Hello", "--num-blocks", "32"], capsys)
    assert "error: prompts[0] is a string but this LLM has no tokenizer" in err


def test_throughput_refuses_a_workload_longer_than_max_model_len(model_dir, capsys):
    err = _refused(["throughput", "--model", str(model_dir), "--num-prompts", "2", "--input-len", "60:60",
                    "--output-len", "8:8", "--num-blocks", "4"], capsys)  # max_model_len 64
    assert ("python -m compileattn throughput: error: --input-len/--output-len: prompts[0]: prompt (60) + "
            "max_new_tokens (8) needs 67 positions > max_model_len 64") in err


def test_the_command_line_refuses_with_status_2_and_no_traceback(tmp_path):
    """What ``python -m compileattn`` prints, from a process of its own."""
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-m", "compileattn", "generate", "--model", str(tmp_path / "missing"),
                           "--prompt-ids", "1"], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("python -m compileattn generate: error: model directory ")


@pytest.mark.parametrize("command", ["generate", "throughput"])
@pytest.mark.parametrize("error", [RuntimeError, ValueError])
def test_an_error_of_the_run_keeps_its_traceback(model_dir, monkeypatch, command, error):
    """Only the checks before the run are refused as usage: what the run raises propagates as it
    is, a ValueError too (a kernel's or the engine's own)."""
    from compileattn.engine.engine import Engine

    def fail(self, *args, **kwargs):
        raise error("the step failed")

    monkeypatch.setattr(Engine, "run", fail)
    argv = ([command, "--model", str(model_dir), "--num-blocks", "32"] +
            (["--prompt-ids", "5,6,7"] if command == "generate" else ["--num-prompts", "2", "--input-len", "4:8",
                                                                        "--output-len", "2:3"]))
    with pytest.raises(error, match="the step failed"):
        main(argv)


@pytest.mark.parametrize("where", ["engine", "kv-budget"])
def test_a_value_error_of_the_llms_build_keeps_its_traceback(model_dir, monkeypatch, where):
    """The LLM's constructor ran inside the refusal of the user's input, so a ValueError of its
    build (the engine's, the KV budget's; on CUDA the memory profile's and the compile's) was
    shown as a usage error without its traceback: only the checks of the input are refused."""
    from compileattn.engine import kv_budget
    from compileattn.engine.engine import Engine

    def fail(*args, **kwargs):
        raise ValueError("internal")

    monkeypatch.setattr(*((Engine, "__init__") if where == "engine" else (kv_budget, "blocks_for_memory")), fail)
    argv = ["generate", "--model", str(model_dir), "--prompt-ids", "5,6,7", "--max-new-tokens", "2"]
    with pytest.raises(ValueError, match="^internal$"):
        main(argv + (["--num-blocks", "32"] if where == "engine" else []))  # blocks_for_memory sizes the cache


def test_an_unsupported_model_is_refused_with_the_reason(tmp_path, capsys):
    """``UnsupportedModelError``, the build's typed refusal of the model itself, is the user's input."""
    directory = save_family("llama", tmp_path / "head-dim-16", head_dim=16)
    err = _refused(["generate", "--model", str(directory), "--prompt-ids", "1", "--num-blocks", "32"], capsys)
    assert f"python -m compileattn generate: error: {directory} cannot be served: " in err
    assert "head_dim=16 is not supported" in err


def test_a_configuration_no_backend_runs_is_refused_and_a_backends_own_error_is_not(model_dir, monkeypatch, capsys):
    """The selector's refusal (``UnsupportedConfigurationError``, which ``LLM`` reports as an
    ``UnsupportedModelError`` naming the layer) is refused with the reason; a plain ValueError out
    of a backend's check is a bug, and propagates."""
    from compileattn.backends.reference import ReferenceBackend

    argv = ["throughput", "--model", str(model_dir), "--num-prompts", "2", "--input-len", "4:4", "--output-len",
            "2:2", "--num-blocks", "32"]
    monkeypatch.setattr(ReferenceBackend, "unsupported_reason", lambda self, *a, **k: "not this one")
    err = _refused(argv, capsys)
    assert f"error: {model_dir} cannot be served: model.layers.0.self_attn: no attention backend runs" in err
    assert "reference: not this one" in err

    def bug(self, *args, **kwargs):
        raise ValueError("internal")

    monkeypatch.setattr(ReferenceBackend, "unsupported_reason", bug)
    with pytest.raises(ValueError, match="^internal$"):
        main(argv)


def test_arguments_only_the_build_can_refuse_are_refused_with_usage(model_dir, capsys):
    """A max_model_len beyond the cache the given num_blocks hold is seen only while the LLM is built
    (the engine's check, a ``ServingRefused``): it was a traceback; it is refused with the reason."""
    err = _refused(["generate", "--model", str(model_dir), "--prompt-ids", "5,6,7", "--max-model-len", "1000",
                    "--num-blocks", "2"], capsys)
    assert "python -m compileattn generate: error: max_model_len must be in [1, 32] " in err
    assert "num_blocks * block_size 32), got 1000" in err


def test_a_checkpoint_that_does_not_match_its_config_is_refused(tmp_path, capsys):
    """The load's check of the checkpoint's keys against its config.json (a ``ServingRefused``)
    was a traceback; it is the directory's mistake, refused with the reason."""
    from safetensors.torch import load_file, save_file

    directory = save_family("llama", tmp_path / "drop", vocab_size=256)
    weights = load_file(directory / "model.safetensors")
    del weights["model.layers.1.self_attn.q_proj.weight"]
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    err = _refused(["generate", "--model", str(directory), "--prompt-ids", "1", "--num-blocks", "32"], capsys)
    assert (f"python -m compileattn generate: error: the checkpoint in {directory} has no weights for "
            f"model.layers.1.self_attn.q_proj.weight (its config.json and weights do not match)") in err


def test_a_config_transformers_refuses_is_refused(tmp_path, capsys):
    """transformers' refusal of config.json (here an unknown model_type) was a traceback."""
    (tmp_path / "config.json").write_text('{"model_type": "nope"}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    err = _refused(["throughput", "--model", str(tmp_path), "--num-prompts", "2", "--num-blocks", "32"], capsys)
    assert "python -m compileattn throughput: error: The checkpoint you are trying to load has model type `nope`" in err
