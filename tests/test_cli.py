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
