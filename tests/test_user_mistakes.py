"""Mistakes a user coming from TRL makes on a first run, each refused in one line naming the option and the fix
before any weights load or any step runs: conversations for a tokenizer without a chat template, bf16 on a machine
without a bfloat16 GPU, batch sizes of 0, Liger-Kernel's flag beside ours, a store of another tokenizer, a
--report_to whose package is missing, a hub dataset that does not load, and a misspelt option (answered with the
option it most likely means)."""

import json
from pathlib import Path

import pytest
import torch

from liger_patch_kd import KDTrainer, KDTrainingArguments, cli
from liger_patch_kd.demo import load_corpus
from liger_patch_kd.train_cli import run as train_run

from .hub_standins import tiny_qwen, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("clean_patches")
TEXT = "the fox sees the owl at dawn and the heron waits by the water while the wind turns the reeds. " * 40
CONVERSATIONS = [{"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}
                 for user, assistant in (("the fox sees", "the owl"), ("at dawn", "a heron"))]  # fmt: skip
FAST = ["--max_steps", "1", "--per_device_train_batch_size", "2", "--report_to", "none", "--save_strategy", "no",
        "--use_cpu", "--disable_tqdm", "true"]  # fmt: skip


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, Path]:
    """A student and a teacher sharing a tokenizer with no chat template, and a teacher of another tokenizer."""
    root = tmp_path_factory.mktemp("pair")
    tokenizer = tiny_tokenizer(TEXT, vocab_size=280)
    tokenizer.chat_template = None
    other = tiny_tokenizer(load_corpus(), vocab_size=300)  # more ids than the store's: its fingerprint is what differs
    paths = {name: root / name for name in ("student", "teacher", "other")}
    for name, tok, hidden, seed in (("student", tokenizer, 32, 0), ("teacher", tokenizer, 48, 1),
                                    ("other", other, 32, 2)):  # fmt: skip
        tiny_qwen(len(tok), hidden, 1, seed, tok).save_pretrained(paths[name])
        tok.save_pretrained(paths[name])
    (root / "conversations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CONVERSATIONS))
    (root / "text.jsonl").write_text("".join(json.dumps({"text": TEXT[i : i + 60]}) + "\n" for i in range(0, 600, 60)))
    paths["conversations"], paths["text"] = root / "conversations.jsonl", root / "text.jsonl"
    return paths


@pytest.fixture
def no_model_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the options and data were checked")

    monkeypatch.setattr(train_run, "load_model", refuse)


def train_argv(pair: dict[str, Path], data: str, tmp_path: Path) -> list[str]:
    return ["train", "--model_name_or_path", str(pair["student"]), "--teacher_model_name_or_path", str(pair["teacher"]),
            "--dataset_name", str(pair[data]), "--output_dir", str(tmp_path / "o"), *FAST]  # fmt: skip


def one_line_error(capsys, argv: list[str]) -> str:
    rc = cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"liger-kd {argv[0]}: error: "), (rc, err)
    return err[0]


def test_conversations_without_a_chat_template_are_refused_before_the_weights_load(pair, tmp_path, capsys,
                                                                                   no_model_loads):  # fmt: skip
    line = one_line_error(capsys, train_argv(pair, "conversations", tmp_path))
    needles = [f"--dataset_name {pair['conversations']} (split train)", "'messages'",
               f"--model_name_or_path {pair['student']}'s tokenizer", "chat_template is None", "text rows"]  # fmt: skip
    assert all(n in line for n in needles), line


def test_kdtrainer_refuses_conversations_without_a_chat_template_when_built(pair, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pair["student"])
    assert tokenizer.chat_template is None
    student, teacher = (AutoModelForCausalLM.from_pretrained(pair[n]) for n in ("student", "teacher"))
    args = KDTrainingArguments(output_dir=str(tmp_path / "o"), max_steps=1, per_device_train_batch_size=2,
                               report_to="none", use_cpu=True)  # fmt: skip
    prompt_rows = [{"prompt": r["messages"][:1], "completion": r["messages"][1:]} for r in CONVERSATIONS]
    for rows, column in ((CONVERSATIONS, "'messages'"), (prompt_rows, "'prompt'")):
        with pytest.raises(ValueError, match=f"train_dataset: its rows are conversations \\({column}.*chat_template"):
            KDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=rows, processing_class=tokenizer)
    with pytest.raises(ValueError, match="eval_dataset: its rows are conversations"):
        KDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=[{"text": TEXT[:40]}] * 2,
                  eval_dataset=CONVERSATIONS, processing_class=tokenizer)  # fmt: skip
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    KDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=CONVERSATIONS, processing_class=tokenizer)


@pytest.mark.skipif(torch.cuda.is_available(), reason="refused only where no GPU computes in bfloat16")
def test_bf16_without_a_bfloat16_gpu_names_the_option_and_both_ways_out(tmp_path):
    with pytest.raises(ValueError, match=r"^bf16=True \(--bf16\): this machine has no GPU .*float32.*use_cpu=True"):
        KDTrainingArguments(output_dir=str(tmp_path), bf16=True)
    with pytest.raises(ValueError, match=r"^bf16_full_eval=True \(--bf16_full_eval\)"):
        KDTrainingArguments(output_dir=str(tmp_path), bf16_full_eval=True)
    assert KDTrainingArguments(output_dir=str(tmp_path), bf16=True, use_cpu=True).bf16  # bfloat16 autocast on a CPU


@pytest.mark.parametrize("name", ["per_device_train_batch_size", "per_device_eval_batch_size",
                                  "gradient_accumulation_steps"])  # fmt: skip
def test_batch_counts_below_one_are_refused_when_the_arguments_are_made(tmp_path, name):
    with pytest.raises(ValueError, match=f"^{name} \\(--{name}\\) must be an integer >= 1; got 0$"):
        KDTrainingArguments(output_dir=str(tmp_path), **{name: 0})


def test_gradient_accumulation_of_zero_is_one_line_before_the_weights_load(pair, tmp_path, capsys, no_model_loads):
    line = one_line_error(capsys, [*train_argv(pair, "text", tmp_path), "--gradient_accumulation_steps", "0"])
    assert "gradient_accumulation_steps (--gradient_accumulation_steps) must be an integer >= 1; got 0" in line


def test_liger_kernels_flag_points_to_use_kd_patch(tmp_path):
    for ours in (True, False):
        with pytest.raises(ValueError, match=r"^use_liger_kernel=True .*use_kd_patch=True .*leave use_liger_kernel"):
            KDTrainingArguments(output_dir=str(tmp_path), use_liger_kernel=True, use_kd_patch=ours)


def test_a_store_of_another_tokenizer_names_both_options_and_the_fix(pair, tmp_path, capsys, no_model_loads):
    store = tmp_path / "store"
    assert cli.main(["precompute", "--teacher", str(pair["teacher"]), "--data", str(pair["text"]), "--top-k", "4",
                     "--out", str(store)]) == 0  # fmt: skip
    capsys.readouterr()
    line = one_line_error(capsys, ["train", "--model_name_or_path", str(pair["other"]), "--dataset_name", str(store),
                                   "--output_dir", str(tmp_path / "o"), *FAST])  # fmt: skip
    needles = [f"--dataset_name {store} (a teacher store) and --model_name_or_path {pair['other']}",
               "mean other tokens", "liger-kd precompute --tokenizer",
               f"the store's teacher: {pair['teacher']}"]  # fmt: skip
    assert all(n in line for n in needles), line


def test_a_misspelt_option_is_answered_with_the_one_it_most_likely_means(tmp_path, capsys):
    line = one_line_error(capsys, ["train", "--output_dir", "o", "--kd_bta", "0.5", "--learning-rat", "1e-5"])
    assert line.endswith("unrecognized arguments: --kd_bta 0.5 --learning-rat 1e-5 (did you mean --kd_beta, "
                         "--learning-rate? see liger-kd train --help)"), line  # fmt: skip
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text('output_dir: o\nsave_strateg: "no"\n')
    line = one_line_error(capsys, ["train", "--config", str(recipe)])
    assert line.endswith("no option save_strateg (did you mean save_strategy? see liger-kd train --help)"), line
    with pytest.raises(SystemExit) as e:
        cli.main(["precompute", "--teacher", "t", "--data", "d.jsonl", "--out", "s", "--topk", "3"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err == ("liger-kd precompute: error: unrecognized arguments: --topk 3 (did you mean "
                                         "--top-k? see liger-kd precompute --help)"), err  # fmt: skip


def test_a_report_to_whose_package_is_missing_is_one_line_before_the_weights_load(pair, tmp_path, capsys,
                                                                                  no_model_loads):  # fmt: skip
    from transformers.integrations import get_available_reporting_integrations

    missing = [n for n in ("wandb", "swanlab", "dvclive", "trackio") if n not in get_available_reporting_integrations()]
    if not missing:
        pytest.skip("every integration this test could name is installed")
    line = one_line_error(capsys, [*train_argv(pair, "text", tmp_path), "--report_to", missing[0]])
    assert f"--report_to {missing[0]}: " in line and "install" in line and "--report_to none" in line, line
    line = one_line_error(capsys, [*train_argv(pair, "text", tmp_path), "--report_to", "wandbb"])
    assert "--report_to wandbb: wandbb is not supported" in line, line


def test_a_hub_dataset_that_does_not_load_names_the_option(pair, tmp_path, capsys, no_model_loads, monkeypatch):
    datasets = pytest.importorskip("datasets")

    def unreachable(name, config=None):  # what load_dataset raises offline (ConnectionError is an OSError)
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    argv = train_argv(pair, "text", tmp_path)
    argv[argv.index("--dataset_name") + 1] = "my-org/no-such-rows"
    line = one_line_error(capsys, argv)
    needles = ["--dataset_name my-org/no-such-rows: no local file or folder of that name", "Couldn't reach",
               "check the name"]  # fmt: skip
    assert all(n in line for n in needles), line


@pytest.mark.parametrize(
    "rows, options, needles",
    [
        ([{"text": TEXT[:60]}] * 4, ["--kd_lmbda", "0.5"], ["(split train) has {'text': ...} rows", "kd_lmbda=0.5"]),
        ([{"prompt": TEXT[:30]}] * 4, [], ["kd_lmbda=0.0", "prompts without a completion"]),
    ],
)
def test_rows_the_run_cannot_train_on_are_one_line_before_the_weights_load(pair, tmp_path, capsys, no_model_loads,
                                                                           rows, options, needles):  # fmt: skip
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = train_argv(pair, "text", tmp_path)
    argv[argv.index("--dataset_name") + 1] = str(data)
    line = one_line_error(capsys, [*argv, *options])
    assert all(n in line for n in needles), line


def test_a_shortened_option_is_a_mistake_not_the_option_it_starts(capsys, monkeypatch):
    """`liger-kd demo --ful` would start the full demo's minutes under argparse's prefix matching."""

    def started(args):
        raise AssertionError(f"--ful was read as --full={args.full} and the demo started")

    monkeypatch.setattr(cli, "_demo", started)
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--ful"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err == ("liger-kd demo: error: unrecognized arguments: --ful (did you mean --full? "
                                         "see liger-kd demo --help)"), err  # fmt: skip


def test_a_run_of_no_step_is_refused_rather_than_saving_the_student_untrained(pair, tmp_path, capsys, no_model_loads):
    argv = train_argv(pair, "text", tmp_path)
    argv[argv.index("--max_steps") + 1] = "-1"  # transformers' default: the epochs decide
    line = one_line_error(capsys, [*argv, "--num_train_epochs", "0"])
    assert "--num_train_epochs 0: no training step would run" in line and "--max_steps > 0" in line, line
