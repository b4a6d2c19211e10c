"""Every ```python block of README.md and of the documentation (docs/**/*.md) runs as written, each in a fresh
namespace in a fresh temporary directory; every `liger-kd` command of a ```bash block parses with the CLI's own
parser, and every `python -m MODULE` names a module that exists.

A block may carry an HTML comment on the line(s) above it:
- `<!-- readme-test: prelude=NAME -->`: the names listed in PRELUDES[NAME] are put in its namespace first (the
  README says where they come from: `student`, `teacher`, `tokenizer`, `data` ... are the reader's own);
- `<!-- readme-test: skip (REASON) -->`: skipped with that reason (only for what a CPU cannot run: GPUs, launches).
Without a comment a block must run from nothing.
"""

import importlib.util
import json
import re
import shlex
import signal
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
TIMEOUT_S = 300  # per block, on a loaded 2-core CPU
_DIRECTIVE = re.compile(r"<!--\s*readme-test:\s*(.*?)\s*-->")


def python_blocks(text: str, language: str = "python") -> list[tuple[int, str, str]]:
    """(line number, directive or "", code) of each fenced ```<language> block, in order."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].strip() == f"```{language}":
            start, j = i + 1, i + 1
            while lines[j].strip() != "```":
                j += 1
            above = [ln for ln in lines[max(0, i - 3) : i] if ln.strip()]
            found = [m.group(1) for ln in above if (m := _DIRECTIVE.search(ln))]
            blocks.append((start, found[-1] if found else "", "\n".join(lines[start:j])))
            i = j
        i += 1
    return blocks


def _tiny_pair() -> dict:
    """A character tokenizer on the packaged corpus, a 2-layer student and a 2-layer teacher (Llama, float32),
    a few rows of data, one batch, and the student saved as a checkpoint (STUDENT_PATH)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from liger_patch_kd.demo import CharTokenizer, load_corpus

    class Tokenizer(CharTokenizer):  # the Trainer saves its processing_class with the checkpoint; the demo's cannot
        def save_pretrained(self, directory):
            Path(directory, "vocab.json").write_text(json.dumps(self.get_vocab()))

        def __call__(self, text, add_special_tokens=True, truncation=False, max_length=None):  # as HF's: {"text"} rows
            ids = [self.bos_token_id] * add_special_tokens + self.encode(text)
            return {"input_ids": ids[:max_length] if truncation and max_length else ids}

    text = load_corpus()
    tokenizer = Tokenizer(text)

    def model(hidden, seed):
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        return LlamaForCausalLM(cfg)

    student, teacher = model(32, 0), model(64, 1)
    ids = tokenizer.encode(text[:2048])
    data = [{"input_ids": ids[i : i + 32]} for i in range(0, 8 * 32, 32)]
    input_ids = torch.tensor([row["input_ids"] for row in data[:2]])
    student.save_pretrained("student_checkpoint")
    return dict(student=student, teacher=teacher, tokenizer=tokenizer, data=data, input_ids=input_ids,
                mask=torch.ones_like(input_ids), labels=input_ids.clone(),
                STUDENT_PATH="student_checkpoint")  # fmt: skip


def _store() -> dict:
    """_tiny_pair plus a top-8 store of the teacher's log-probs on `data`, in ./store/."""
    from liger_patch_kd.teacher import precompute

    names = _tiny_pair()
    precompute(names["teacher"], [r["input_ids"] for r in names["data"]], "store", top_k=8, progress=False)
    return names


def _hub_standins() -> dict:
    """The recipe's hub models and dataset as tiny local folders under their hub ids (./Qwen/..., ./trl-lib/...),
    which Hugging Face reads before the hub (tests/hub_standins.py); no names are added."""
    from .hub_standins import make_hub_standins

    make_hub_standins(Path.cwd())
    return {}


PRELUDES = {"tiny_pair": _tiny_pair, "store": _store, "hub_standins": _hub_standins}


def _collect(language: str) -> list[tuple[str, str, str]]:
    """("page:line", directive, code) of every ```<language> block of README.md and docs/."""
    return [(f"{page.relative_to(ROOT)}:{line}", directive, code)
            for page in PAGES for line, directive, code in python_blocks(page.read_text(), language)]  # fmt: skip


BLOCKS = _collect("python")
SHELL_BLOCKS = _collect("bash")


def test_the_readme_has_python_blocks_and_only_known_directives():
    assert sum(where.startswith("README.md:") for where, _, _ in BLOCKS) >= 1
    assert len(BLOCKS) >= 10  # the guides' examples
    for line, directive, _ in BLOCKS:
        assert directive == "" or directive.startswith("skip (") or directive.split("=", 1)[0] == "prelude", line
        if directive.startswith("prelude="):
            assert directive.split("=", 1)[1] in PRELUDES, (line, directive)


@pytest.mark.parametrize("line,directive,code", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_readme_block_runs_as_written(line, directive, code, tmp_path, monkeypatch, clean_patches):
    if directive.startswith("skip"):
        pytest.skip(directive[len("skip") :].strip(" ()"))
    monkeypatch.chdir(tmp_path)  # "out", "store/" ... land in the test's own directory
    namespace = {"__name__": "__readme__"}

    def too_long(*_):
        raise TimeoutError(f"{line}: the block ran past {TIMEOUT_S} s")

    previous = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(TIMEOUT_S)
    try:
        if directive.startswith("prelude="):
            namespace.update(PRELUDES[directive.split("=", 1)[1]]())
        exec(compile(code, line, "exec"), namespace)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_the_readmes_yaml_files_are_accepted(tmp_path):
    """Each ```yaml block is what its command reads: a `liger-kd train --config` file (it names
    model_name_or_path) parses with the train command's parser; the `--compressor cfg.yaml` example is a valid,
    lossless DistillKit compressor configuration."""
    yaml = pytest.importorskip("yaml")
    from liger_patch_kd.teacher.formats.distillkit_codec import CompressorConfig
    from liger_patch_kd.train_cli.parser import parse

    found = [m for page in PAGES for m in re.findall(r"```yaml\n(.*?)```", page.read_text(), re.S)]
    assert found
    kinds = set()
    for text in found:
        loaded = yaml.safe_load(text)
        if "model_name_or_path" in loaded:
            config = tmp_path / "recipe.yaml"
            config.write_text(text)
            _, model, _ = parse(["--config", str(config)])
            assert model.model_name_or_path == loaded["model_name_or_path"]
            kinds.add("train")
        else:
            cfg = CompressorConfig.from_any(loaded)
            assert cfg.exact_k == cfg.k  # the lossless example
            kinds.add("compressor")
    assert kinds == {"train", "compressor"}


def shell_commands(code: str) -> list[list[str]]:
    """The commands of a ```bash block: continuation lines joined, comments dropped, `&&` chains and background
    `&` split."""
    commands, current = [], []
    for line in code.replace("\\\n", " ").splitlines():
        for word in shlex.split(line, comments=True):
            if word in ("&&", "||", ";", "&"):
                commands.append(current)
                current = []
            else:
                current.append(word)
        commands.append(current)
        current = []
    return [c for c in commands if c]


@pytest.mark.parametrize("line,directive,code", SHELL_BLOCKS, ids=[b[0] for b in SHELL_BLOCKS])
def test_shell_block_commands_exist(line, directive, code):
    """`liger-kd ...` lines parse with the CLI's parser (options, choices, required ones); `python -m X` names a
    module of this checkout (or an installed one); `python FILE` a file of the repository."""
    from liger_patch_kd.cli import build_parser

    for words in shell_commands(code):
        while words and "=" in words[0] and not words[0].startswith("-"):  # VAR=value prefixes
            words = words[1:]
        if words[:2] == ["liger-kd", "train"]:  # its own parser: every option must be one it knows
            from liger_patch_kd.train_cli.parser import build_parser as train_parser
            from liger_patch_kd.train_cli.parser import split_config, with_our_names

            _, rest = split_config(words[2:])  # a --config file named in prose need not exist here
            parsed = train_parser().parse_args_into_dataclasses(with_our_names(rest), return_remaining_strings=True)
            unknown = parsed[-1]
            assert not unknown, f"{line}: liger-kd train does not take {unknown}"
        elif words[:1] == ["liger-kd"]:
            _, unknown = build_parser().parse_known_args(words[1:])
            assert not unknown, f"{line}: liger-kd does not take {unknown}"
        elif words[:2] == ["python", "-m"]:
            module, top = words[2], words[2].split(".")[0]
            path = ROOT / Path(*module.split("."))
            ours = path.with_suffix(".py").exists() or (path / "__main__.py").exists()
            assert ours or (not (ROOT / top).exists() and importlib.util.find_spec(top)), f"{line}: no module {module}"
        elif words[:1] == ["python"] and words[1].endswith(".py"):
            assert (ROOT / words[1]).exists(), f"{line}: no file {words[1]}"
        elif words[:2] == ["accelerate", "launch"]:
            files = [w for w in words if w.endswith((".py", ".yaml"))]
            assert all((ROOT / f).exists() for f in files), f"{line}: {files}"
