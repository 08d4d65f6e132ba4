"""The README's examples run as written: every ```python block in a fresh interpreter, and every
``python -m compileattn ...`` line of its shell blocks on the checkpoint the Hugging Face example
writes (its ``DIR``). A README whose example stopped working (a renamed argument, a changed
default) fails here rather than for the first reader who copies it.

``./dev demo`` / ``./dev test`` are what CI runs; ``torchrun ... compileattn.parallel.check`` is
``tests/test_parallel.py``'s; ``.ci/gpu*`` need GPUs.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def blocks(language: str) -> list[str]:
    """The README's fenced blocks of ``language``, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.M | re.S)


PYTHON_BLOCKS = blocks("python")
CLI_LINES = [line.split("#")[0].strip() for block in blocks("bash") for line in block.splitlines()
             if line.startswith("python -m compileattn ")]


def run(argv: list[str], tmp_path: Path, timeout: float = 300) -> str:
    """``argv`` in a fresh process from the checkout, temporary files under ``tmp_path``; its stdout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               TMPDIR=str(tmp_path))
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=timeout)
    assert proc.returncode == 0, f"{shlex.join(argv)}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_the_readme_has_the_examples_this_file_runs():
    """A README reorganised so that this file finds nothing would pass vacuously."""
    assert len(PYTHON_BLOCKS) >= 2 and any("compileattn.LLM(" in b for b in PYTHON_BLOCKS)
    assert {line.split()[3] for line in CLI_LINES} >= {"generate", "throughput"}


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_python_example_runs(index, tmp_path):
    run([sys.executable, "-c", PYTHON_BLOCKS[index]], tmp_path)


def test_command_line_examples_run_on_the_checkpoint_the_llm_example_writes(tmp_path):
    example = next(b for b in PYTHON_BLOCKS if "compileattn.LLM(" in b)
    model_dir = run([sys.executable, "-c", example], tmp_path).strip().splitlines()[-1]  # it prints model_dir last
    assert (Path(model_dir) / "config.json").is_file()
    for line in CLI_LINES:
        argv = [sys.executable if word == "python" else model_dir if word == "DIR" else word
                for word in shlex.split(line)]
        assert run(argv, tmp_path).strip(), f"{line} printed nothing"


@pytest.mark.parametrize("shown, function", [("`LLM(model, ", "LLM"), ("`generate(prompts, ", "LLM.generate"),
                                             ("`flash_attn_varlen_func(q, ", "flash_attn_varlen_func"),
                                             ("`flash_attn_with_kvcache(q, ", "flash_attn_with_kvcache")])
def test_the_signatures_shown_are_the_real_ones(shown, function):
    """The README's signature lines are what a reader ports a call from: every parameter is shown,
    in order, with its default where one is written as a literal (a parameter left out, such as
    the entry points' ``k_scale``/``v_scale``/``validate``, is one the reader does not know of)."""
    import ast
    import functools
    import inspect

    import compileattn

    start = README.index(shown) + 1
    text = " ".join(README[start:README.index("`", start)].split())
    fn = functools.reduce(getattr, function.split("."), compileattn)
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
    names = re.findall(r"(?:\(|, |or )(\w+)(?==|,|\))", text)
    assert names == [p.name for p in params], text
    keyword_only = next(p.name for p in params if p.kind is p.KEYWORD_ONLY)
    assert f"*, {keyword_only}=" in text
    for name, default in re.findall(r"(\w+)=([^,()|]+?)(?=,|\)| or| \()", text):
        assert ast.literal_eval(default.strip()) == inspect.signature(fn).parameters[name].default, name
