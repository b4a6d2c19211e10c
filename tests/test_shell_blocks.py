"""Every ```bash block of README.md and of the documentation (docs/**/*.md) runs as written, as a reader would run
it: the blocks of a page one after the other, top to bottom, in one fresh working directory (so a block may use
what an earlier block of its page wrote, and must not trip over it either).

The runner changes three things and nothing else:
- `pip ...` does nothing: the test environment is what CI installed (the install lines are its own commands);
- `liger-kd` and `python` are this checkout's (`python -m liger_patch_kd.cli`, this interpreter, PYTHONPATH);
- the working directory links `examples/` and `benchmarks/` of the repository, as in a clone.
Hugging Face runs offline (HF_HUB_OFFLINE=1): a model or data set a block names must be a stand-in made here.

A block may carry an HTML comment on the line(s) above it:
- `<!-- shell-test: setup=NAME:PATH ... -->`: before the block, make each stand-in NAME at PATH (STANDINS below: a
  tiny teacher model and tokenizer (with a ChatML template) in a folder named like its hub id, which transformers
  reads before the hub; a JSONL text file; axolotl and DistillKit data; a DistillKit compressor file; `hub:.` the
  recipe's student, teacher and data set, tests/hub_standins.py; a JSONL file of prompts);
- `<!-- shell-test: skip (REASON) -->`: not run, for what a CPU in CI cannot do (a GPU, a launch on several GPUs,
  a server that keeps running) or what CI runs itself; REASON says which.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TIMEOUT_S = 900  # a whole page, on a loaded 2-core CPU
_DIRECTIVE = re.compile(r"<!--\s*shell-test:\s*(.*?)\s*-->", re.S)
LINKED = ("examples", "benchmarks")  # what a block names relative to a clone's root

# stand-ins share the vocabulary the pages name (--vocab-size 151936: Qwen2.5 / Qwen3's embedding rows)
VOCAB, TOP_K = 151936, 64


def bash_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line number, directive or "", code) of each ```bash block, in order."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].strip() == "```bash":
            start, j = i + 1, i + 1
            while lines[j].strip() != "```":
                j += 1
            above = "\n".join(lines[max(0, i - 3) : i])
            found = _DIRECTIVE.findall(above)
            blocks.append((start + 1, found[-1] if found else "", "\n".join(lines[start:j])))
            i = j
        i += 1
    return blocks


PAGE_BLOCKS = [(page, blocks) for page in PAGES if (blocks := bash_blocks(page.read_text()))]


# ------------------------------------------------------------------------------------------------ stand-ins
def _teacher(path: Path) -> None:
    """A one-layer Llama with the pages' vocabulary (VOCAB rows) and a small byte-level BPE tokenizer (ids below
    512), saved as a Hugging Face checkpoint folder."""
    from transformers import PreTrainedTokenizerFast

    from liger_patch_kd.demo import load_corpus
    from liger_patch_kd.demo.toys import build_model, train_bpe_tokenizer
    from tests.hub_standins import CHATML

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=train_bpe_tokenizer(load_corpus()[:20000], 384),
                                        bos_token="<s>", eos_token="</s>", pad_token="<pad>")  # fmt: skip
    tokenizer.chat_template = CHATML  # as the models the pages name have one: conversational rows render
    tokenizer.save_pretrained(path)
    build_model(VOCAB, 16, 1, seed=0, device="cpu").save_pretrained(path)


def _texts(path: Path) -> None:
    """Four short lines of {"text": ...} from the packaged corpus (every position scores all VOCAB rows)."""
    from liger_patch_kd.demo import load_corpus

    text = load_corpus()
    path.write_text("".join(json.dumps({"text": text[i * 200 : i * 200 + 40]}) + "\n" for i in range(4)))


def _store(path: Path) -> Path:
    """A top-TOP_K float32 store of random log-probs over VOCAB (what the converters read and write)."""
    import torch

    from liger_patch_kd.teacher.formats.hf_datasets import dataset_to_store

    g = torch.Generator().manual_seed(0)
    rows = []
    for length in (12, 9, 15):
        ids = torch.randint(0, 384, (length,), generator=g)
        slots = torch.stack([torch.randperm(VOCAB, generator=g)[:TOP_K] for _ in range(length)])
        logprobs = torch.log_softmax(torch.randn(length, VOCAB, generator=g), -1).gather(1, slots)
        rows.append({"input_ids": ids.tolist(), "teacher_token_ids": slots.tolist(),
                     "teacher_logprobs": logprobs.tolist()})  # fmt: skip
    return dataset_to_store(rows, path, vocab_size=VOCAB, top_k=TOP_K, logprob_dtype="float32")


def _axolotl(path: Path) -> None:
    """axolotl's KD layout (input_ids, target_token_ids, target_logprobs, target_mask) as parquet."""
    from liger_patch_kd.teacher.formats.axolotl import store_to_axolotl

    store_to_axolotl(_store(path.parent / f".{path.name}.store")).to_parquet(str(path))


def _compressor(path: Path) -> None:
    """DistillKit's compressor settings, lossless (the ```yaml block of docs/teachers/stores.md)."""
    page = (ROOT / "docs" / "teachers" / "stores.md").read_text()
    path.write_text(re.search(r"```yaml\n(.*?)```", page, re.S).group(1))


def _distillkit(path: Path) -> None:
    """A DistillKit capture folder (data_0.parquet, compression_config.yaml), lossless."""
    from liger_patch_kd.teacher.formats.distillkit import store_to_distillkit

    settings = path.parent / f".{path.name}.yaml"
    _compressor(settings)
    store_to_distillkit(_store(path.parent / f".{path.name}.store"), path, compressor=settings)


def _hub(path: Path) -> None:
    """The recipe's models and data set (Qwen2.5 0.5B / 1.5B, trl-lib/Capybara) as tiny folders under `path`."""
    from tests.hub_standins import make_hub_standins

    make_hub_standins(path)


def _prompts(path: Path) -> None:
    """Two {"prompt": ...} rows (TRL's prompt-only format) from the packaged corpus."""
    from liger_patch_kd.demo import load_corpus

    text = load_corpus()
    path.write_text("".join(json.dumps({"prompt": text[i * 300 : i * 300 + 30]}) + "\n" for i in range(2)))


STANDINS = {"teacher": _teacher, "texts": _texts, "axolotl": _axolotl, "distillkit": _distillkit,
            "compressor": _compressor, "hub": _hub, "prompts": _prompts}  # fmt: skip


def make_standins(spec: str, workdir: Path) -> None:
    """`setup=NAME:PATH NAME:PATH ...` of a directive, made under `workdir`."""
    for item in spec.split():
        name, _, where = item.partition(":")
        assert name in STANDINS and where, f"setup item {item!r}: NAME:PATH with NAME one of {sorted(STANDINS)}"
        path = workdir / where
        path.parent.mkdir(parents=True, exist_ok=True)
        STANDINS[name](path)


# ------------------------------------------------------------------------------------------------ the runner
PRELUDE = """\
set -euo pipefail
pip() { echo "(shell test: pip $* skipped: the test environment is installed)"; }
python() { "$SHELL_TEST_PYTHON" "$@"; }
"""
# `liger-kd` is a program on PATH, not a shell function: `liger-kd serve ... &` is then the server's own process,
# which a block's `kill $(jobs -p)` stops (a function would run in a subshell, and killing it would leave the server
# holding the block's output open)
SHIM = '#!/bin/sh\nexec "$SHELL_TEST_PYTHON" -m liger_patch_kd.cli "$@"\n'


def run_block(code: str, workdir: Path, where: str) -> None:
    with tempfile.TemporaryDirectory() as bin_dir:
        shim = Path(bin_dir) / "liger-kd"
        shim.write_text(SHIM)
        shim.chmod(0o755)
        env = {**os.environ, "SHELL_TEST_PYTHON": sys.executable, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
               os.environ.get("PYTHONPATH")])),
               "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")])}  # fmt: skip
        done = subprocess.run(["bash", "-c", PRELUDE + code], cwd=workdir, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)  # fmt: skip
    assert done.returncode == 0, f"{where} exited {done.returncode}:\n{code}\n--- stdout\n{done.stdout[-4000:]}" \
                                 f"\n--- stderr\n{done.stderr[-4000:]}"  # fmt: skip


def test_the_pages_have_shell_blocks_and_only_known_directives():
    assert len(PAGE_BLOCKS) >= 5
    for page, blocks in PAGE_BLOCKS:
        for line, directive, _ in blocks:
            where = f"{page.relative_to(ROOT)}:{line}"
            if directive.startswith("skip"):
                assert re.fullmatch(r"skip \(.+\)", directive, re.S), f"{where}: skip (REASON), with the reason"
            elif directive:
                assert directive.startswith("setup="), f"{where}: unknown directive {directive!r}"
                for item in directive[len("setup=") :].split():
                    assert item.partition(":")[0] in STANDINS, f"{where}: no stand-in {item!r}"


@pytest.mark.slow  # the README's quick start is `liger-kd demo`
@pytest.mark.multiprocess
@pytest.mark.parametrize("page,blocks", PAGE_BLOCKS, ids=[str(p.relative_to(ROOT)) for p, _ in PAGE_BLOCKS])
def test_the_pages_shell_blocks_run_top_to_bottom(page, blocks, tmp_path):
    workdir = tmp_path / "work"
    workdir.mkdir()
    for name in LINKED:
        (workdir / name).symlink_to(ROOT / name, target_is_directory=True)
    ran = 0
    for line, directive, code in blocks:
        where = f"{page.relative_to(ROOT)}:{line}"
        if directive.startswith("skip"):
            continue
        if directive.startswith("setup="):
            make_standins(directive[len("setup=") :], workdir)
        run_block(code, workdir, where)
        ran += 1
    if ran == 0:
        pytest.skip(f"every shell block of {page.relative_to(ROOT)} is marked skip, each with its reason")


def test_the_runner_fails_on_a_failing_command_and_skips_pip(tmp_path):
    """A block fails on any failing line, not only its last; `pip` lines do nothing (no package is fetched)."""
    run_block("pip install a-package-that-does-not-exist==0.0.0", tmp_path, "pip")
    with pytest.raises(AssertionError, match="--data missing.jsonl"):
        run_block("liger-kd precompute --teacher org/model --data missing.jsonl --out store/\necho after", tmp_path,
                  "failing")  # fmt: skip
    assert not (tmp_path / "store").exists()
