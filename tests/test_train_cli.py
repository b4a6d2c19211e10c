"""`liger-kd train` on tiny stand-ins of the recipe's hub models and dataset (tests/hub_standins.py): it trains,
evaluates on the test split, saves a student that reloads with the same logits; a YAML --config with command-line
overrides, TRL's option names, LoRA flags; every mistake one line before any model loads."""

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from liger_patch_kd import cli
from liger_patch_kd.train_cli import parser as train_parser
from liger_patch_kd.train_cli import run as train_run

from .helpers import subprocess_env
from .hub_standins import DATASET_ID, STUDENT_ID, TEACHER_ID, make_hub_standins, tiny_qwen, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("clean_patches")
ROOT = Path(__file__).resolve().parents[1]
FAST = ["--max_steps", "2", "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2",
        "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no", "--use_cpu",
        "--disable_tqdm", "true"]  # fmt: skip
PAIR = ["--model_name_or_path", STUDENT_ID, "--teacher_model_name_or_path", TEACHER_ID, "--dataset_name", DATASET_ID]


@pytest.fixture(scope="module")
def standins(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hub")
    make_hub_standins(root)
    return root


@pytest.fixture
def in_standins(standins, monkeypatch) -> Path:
    monkeypatch.chdir(standins)  # the hub ids resolve to the stand-ins' folders, as HF resolves local paths first
    return standins


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.double()


def test_train_evaluates_saves_and_the_saved_student_gives_the_same_logits(in_standins, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "out"
    ids = torch.tensor([[5, 17, 40, 99, 120, 7]])
    before = logits(AutoModelForCausalLM.from_pretrained(STUDENT_ID), ids)
    trainer = train_run.train([*PAIR, "--output_dir", str(out), "--use_kd_patch", "--learning_rate", "1e-2", *FAST])
    printed = capsys.readouterr().out
    assert "evaluating on the split 'test' (4 rows)" in printed
    assert f"saved the student and its tokenizer to {out.resolve()}" in printed
    evaluated = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert evaluated and evaluated[-1]["eval_loss"] > 0
    logged = [h for h in trainer.state.log_history if "kd_soft_loss" in h]
    assert len(logged) == 2 and all(h["kd_soft_loss"] == pytest.approx(h["loss"], abs=1e-6) for h in logged)
    trained = logits(trainer.model, ids)
    assert not torch.allclose(trained, before)  # it trained
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(logits(reloaded, ids), trained, rtol=0, atol=0)  # the same weights, the same maths
    assert AutoTokenizer.from_pretrained(out).get_vocab() == AutoTokenizer.from_pretrained(STUDENT_ID).get_vocab()
    from liger_patch_kd.train_cli.output import check_output_dir

    check_output_dir(str(out), {}, overwrite=False)  # what this run saved, the next run into `out` may replace


@pytest.mark.multiprocess
def test_train_as_a_subprocess(in_standins, tmp_path):
    env = subprocess_env(PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "liger_patch_kd.cli", "train", *PAIR, "--output_dir", str(tmp_path / "o"),
           "--use_kd_patch", *FAST]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=in_standins, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "liger-kd train: evaluation: eval_loss" in done.stdout
    assert (tmp_path / "o" / "model.safetensors").exists() and (tmp_path / "o" / "tokenizer.json").exists()


def test_a_yaml_config_sets_defaults_and_the_command_line_overrides_it(tmp_path):
    config = tmp_path / "recipe.yaml"
    config.write_text(
        "model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct\n"
        "dataset_name: trl-lib/Capybara\n"
        "output_dir: from_yaml\n"
        "kd_beta: 0.3\n"
        "learning_rate: 1e-5\n"  # YAML reads this as a string; the flag's type parses it
        "lmbda: 0.25\n"  # TRL's name, read as kd_lmbda
        "lora_target_modules: [q_proj, v_proj]\n"
        "use_kd_patch: true\n"
        "env:\n  LIGER_KD_TEST_FROM_YAML: 'yes'\n"
    )
    script, model, args = train_parser.parse(["--config", str(config), "--kd_beta", "0.7", "--output_dir", "cli"])
    assert (args.kd_beta, args.output_dir) == (0.7, "cli")  # the command line wins
    assert args.learning_rate == 1e-5 and args.kd_lmbda == 0.25 and args.use_kd_patch is True
    assert model.model_name_or_path == STUDENT_ID and model.lora_target_modules == ["q_proj", "v_proj"]
    assert script.dataset_name == DATASET_ID and script.dataset_train_split == "train"
    import os

    assert os.environ.pop("LIGER_KD_TEST_FROM_YAML") == "yes"


def test_a_second_config_is_refused_in_one_line(tmp_path, capsys):
    """Two files would each set every default: which one wins is no rule anyone should guess (argparse took the
    second as an option and failed on an unpacking error naming nothing)."""
    for name in ("a.yaml", "b.yaml"):
        (tmp_path / name).write_text("output_dir: o\n")
    a, b = str(tmp_path / "a.yaml"), str(tmp_path / "b.yaml")
    for argv in (["--config", a, "--config", b], [f"--config={a}", "--kd_beta", "0.3", f"--config={b}"]):
        with pytest.raises(ValueError, match=rf"--config is given twice \({a}, {b}\): give one file") as e:
            train_parser.parse(argv)
        assert "\n" not in str(e.value)
    assert cli.main(["train", "--config", a, "--config", b]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--config is given twice" in err, err


def test_trl_names_map_to_ours_and_ambiguous_ones_are_refused():
    _, _, args = train_parser.parse(["--output_dir", "o", "--lmbda", "0.5", "--beta=0.2", "--max_new_tokens", "16",
                                     "--seq_kd"])  # fmt: skip
    assert (args.kd_lmbda, args.kd_beta, args.kd_max_new_tokens, args.kd_seq_kd) == (0.5, 0.2, 16, True)
    with pytest.raises(ValueError, match="--kd_generation_temperature .*--kd_temperature"):
        train_parser.parse(["--output_dir", "o", "--temperature", "0.9"])
    with pytest.raises(ValueError, match="--beta and --kd_beta"):
        train_parser.parse(["--output_dir", "o", "--beta", "0.2", "--kd_beta", "0.3"])


def test_every_kd_option_is_a_flag():
    from liger_patch_kd.trainer import KDTrainingArguments

    flags = {s for action in train_parser.build_parser()._actions for s in action.option_strings}
    names = [f for f in KDTrainingArguments.__dataclass_fields__ if f.startswith("kd_") or f == "use_kd_patch"]
    assert len(names) > 40 and all(f"--{n}" in flags for n in names)
    assert {"--model_name_or_path", "--teacher_model_name_or_path", "--dataset_name", "--dataset_config",
            "--dataset_train_split", "--dataset_test_split", "--torch_dtype", "--dtype", "--trust_remote_code",
            "--use_peft", "--lora_r", "--lora_alpha", "--lora_dropout", "--lora_target_modules",
            "--lora_task_type"} <= flags  # fmt: skip


def test_lora_flags_train_and_save_an_adapter_that_reloads(in_standins, tmp_path):
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    out = tmp_path / "lora"
    trainer = train_run.train([*PAIR, "--output_dir", str(out), "--use_kd_patch", "--use_peft", "--lora_r", "4",
                               "--lora_alpha", "8", "--lora_dropout", "0", "--lora_target_modules", "q_proj", "v_proj",
                               "--learning_rate", "1e-2", *FAST])  # fmt: skip
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"], sorted(adapter["target_modules"])) == (4, 8, ["q_proj", "v_proj"])
    assert not (out / "model.safetensors").exists()  # the adapter alone
    ids = torch.tensor([[5, 17, 40, 99]])
    reloaded = AutoModelForCausalLM.from_pretrained(out)  # the base named in the adapter's config, plus the adapter
    torch.testing.assert_close(logits(reloaded, ids), logits(trainer.model, ids), rtol=1e-6, atol=1e-6)


@pytest.fixture
def no_model_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the options and data were checked")

    monkeypatch.setattr(train_run, "load_model", refuse)


def _other_teacher(root: Path) -> str:
    """A teacher whose tokenizer is not the student's (trained on other text)."""
    tokenizer = tiny_tokenizer("completely different words here and there, " * 50, vocab_size=280)
    path = root / "other_teacher"
    tiny_qwen(len(tokenizer), 32, 1, 0, tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize(
    "change, needles",
    [
        ({"--dataset_name": "missing/folder/data.jsonl"}, ["--dataset_name missing/folder/data.jsonl", "no such file"]),
        ({"--dataset_test_split": "validation"}, ["--dataset_test_split validation", "it has test, train"]),
        ({"--dataset_train_split": "dev"}, ["--dataset_train_split dev", "no such split"]),
        ({"--eval_fraction": "0.5"}, ["--eval_fraction 0.5", "'test'", "--dataset_test_split none"]),
        ({"--teacher_model_name_or_path": None}, ["no teacher", "--kd_teacher_url"]),
        ({"--teacher_model_name_or_path": "OTHER"}, ["its tokenizer", "not the student's", "--kd_teacher_tokenizer"]),
        ({"--dtype": "int8"}, ["--dtype int8", "bfloat16"]),
        ({"--kd_beta": "2"}, ["beta"]),
        ({"--dataset_config": "default"}, ["--dataset_config default", "local"]),
        ({"--eval_strategy": "steps", "--dataset_test_split": "none"}, ["--eval_strategy steps", "no evaluation rows"]),
        ({"--lora_task_type": "BOGUS"}, ["--lora_task_type BOGUS", "CAUSAL_LM"]),
        ({"--resume_from_checkpoint": "missing/ckpt"}, ["--resume_from_checkpoint missing/ckpt", "no such folder"]),
        ({"--resume_from_checkpoint": "."}, ["--resume_from_checkpoint .", "not a checkpoint", "trainer_state.json"]),
        ({"--resume_from_checkpoint": "latest"}, ["--resume_from_checkpoint latest", "holds no checkpoint"]),
        ({"--resume_from_checkpoint": "True"}, ["--resume_from_checkpoint True", "holds no checkpoint"]),
        ({"--kd_store_refresh_steps": "2"}, ["--kd_store_refresh_steps 2", "rollout store"]),
        ({"--save_total_limit": "1", "--save_strategy": "steps", "--output_dir": "CKPT"},
         ["output_dir", "checkpoint-3", "save_total_limit=1", "another output_dir"]),
    ],
)
def test_mistakes_are_one_line_before_any_model_loads(in_standins, tmp_path, capsys, no_model_loads, change, needles):
    options = dict(zip(PAIR[::2], PAIR[1::2]))
    options.update({k: (_other_teacher(tmp_path) if v == "OTHER" else v) for k, v in change.items()})
    if options.get("--output_dir") == "CKPT":  # another run's checkpoint, which rotation would delete
        (tmp_path / "ckpt" / "checkpoint-3").mkdir(parents=True)
        options["--output_dir"] = str(tmp_path / "ckpt")
    argv = [w for k, v in options.items() if v is not None for w in (k, v)]
    rc = cli.main(["train", *FAST, "--output_dir", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err, err
    assert err[-1].startswith("liger-kd train: error: ") and all(n in err[-1] for n in needles), err[-1]


def test_a_usage_mistake_is_one_line(capsys):
    assert cli.main(["train", "--no_such_flag", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["liger-kd train: error: unrecognized arguments: --no_such_flag 1 (see liger-kd train --help)"]
    with pytest.raises(SystemExit) as e:  # argparse's own: a flag without its value
        cli.main(["train", "--kd_beta"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("liger-kd train: error: "), err


def test_local_files_and_held_out_rows(tmp_path):
    """A single .jsonl is the split 'train'; --eval_fraction holds out a seeded share; a folder's shards join."""
    from liger_patch_kd.train_cli.arguments import ScriptArguments
    from liger_patch_kd.train_cli.data import load_splits

    rows = [{"text": f"row {i}"} for i in range(10)]
    file = tmp_path / "rows.jsonl"
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    splits = load_splits(ScriptArguments(dataset_name=str(file), eval_fraction=0.2), seed=3, store_dataset=None)
    assert len(splits.train) == 8 and len(splits.evaluation) == 2
    assert sorted(r["text"] for r in splits.train + splits.evaluation) == sorted(r["text"] for r in rows)
    again = load_splits(ScriptArguments(dataset_name=str(file), eval_fraction=0.2), seed=3, store_dataset=None)
    assert again.evaluation == splits.evaluation  # the seed decides
    assert load_splits(ScriptArguments(dataset_name=str(file)), seed=3, store_dataset=None).evaluation is None
    folder = tmp_path / "sharded" / "data"
    folder.mkdir(parents=True)
    for shard in range(2):
        (folder / f"train-0000{shard}-of-00002.jsonl").write_text(json.dumps(rows[shard]) + "\n")
    (folder / "test.json").write_text(json.dumps(rows[5:7]))
    splits = load_splits(ScriptArguments(dataset_name=str(folder.parent)), seed=0, store_dataset=None)
    assert splits.train == rows[:2] and splits.evaluation == rows[5:7]


def test_prompt_rows_are_cut_at_kd_max_length_and_evaluation_leaves_the_training_terms_alone(tmp_path):
    """What the recipe relies on: kd_max_length bounds conversational rows too, and an evaluation between two
    training logs does not leak into the next log's kd_soft_loss (a mean over the training steps alone)."""
    from liger_patch_kd import KDTrainer, KDTrainingArguments
    from liger_patch_kd.demo import load_corpus

    from .hub_standins import conversations

    text = load_corpus()
    tokenizer = tiny_tokenizer(text)
    student, teacher = (tiny_qwen(len(tokenizer), h, 2, s, tokenizer) for h, s in ((32, 0), (64, 1)))
    rows = conversations(text, 8)
    args = KDTrainingArguments(output_dir=str(tmp_path), use_kd_patch=True, kd_max_length=12,
                               kd_max_prompt_length=8, max_steps=2,
                               per_device_train_batch_size=2, logging_steps=2, report_to="none", use_cpu=True,
                               save_strategy="no", disable_tqdm=True)  # fmt: skip
    trainer = KDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=rows, eval_dataset=rows[:2],
                        processing_class=tokenizer)  # fmt: skip
    batch = trainer.data_collator(rows[:2])
    assert batch["input_ids"].shape[1] == 12
    assert (batch["labels"] != -100).any(dim=1).all()  # a prompt's last 8 tokens leave completion tokens to score
    trainer.evaluate()  # before training: its batches must not be counted in the first log
    trainer.train()
    logged = [h for h in trainer.state.log_history if "kd_soft_loss" in h]
    assert len(logged) == 1 and logged[0]["kd_soft_loss"] == pytest.approx(logged[0]["loss"], abs=1e-6)


def test_the_output_dir_keeps_files_no_earlier_run_wrote(in_standins, tmp_path, capsys, no_model_loads):
    """--output_dir may not be a model's own folder, nor hold model / tokenizer files no `liger-kd train` run saved
    there (a download, another tool's output): refused before any model loads, unless --overwrite_output_dir."""
    from liger_patch_kd.train_cli.output import RECORD, check_output_dir

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text('{"mine": true}')
    (foreign / "notes.txt").write_text("mine")
    for out, needles in ((STUDENT_ID, ["--output_dir " + STUDENT_ID, "--model_name_or_path", "model.safetensors"]),
                         (TEACHER_ID, ["--teacher_model_name_or_path"]),
                         (str(foreign), ["config.json", "--overwrite_output_dir"])):  # fmt: skip
        before = {p.name: p.read_bytes() for p in Path(out).iterdir() if p.is_file()}
        assert cli.main(["train", *PAIR, "--output_dir", out, *FAST]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and all(n in err[0] for n in needles), err
        assert {p.name: p.read_bytes() for p in Path(out).iterdir() if p.is_file()} == before
    assert "notes.txt" not in err[0]  # only what a save would overwrite
    check_output_dir(str(foreign), {}, overwrite=True)  # the user's say-so
    (foreign / RECORD).write_text(json.dumps({"files": ["config.json"]}))  # an earlier run's own files may go
    check_output_dir(str(foreign), {}, overwrite=False)
    (foreign / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"already holds model\.safetensors,"):
        check_output_dir(str(foreign), {}, overwrite=False)


def test_an_output_dir_that_is_a_file_is_refused_before_any_model_loads(in_standins, tmp_path, capsys,
                                                                        no_model_loads):  # fmt: skip
    """A file where the folder should be (or above it) failed only at the save, as a bare '[Errno 17] File exists';
    it is one line naming --output_dir before any model loads, --overwrite_output_dir or not (it overwrites files
    in a folder, never a file that is the folder)."""
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    for out, extra, needle in ((mine, [], "is a file, not a folder"), (mine / "run", [], f"is under {mine}, a file"),
                               (mine, ["--overwrite_output_dir"], "is a file, not a folder")):  # fmt: skip
        assert cli.main(["train", *PAIR, "--output_dir", str(out), *FAST, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--output_dir {out}: {needle}" in err[0], err
    assert mine.read_text() == "mine"


def test_a_folder_holding_one_split_twice_is_refused(tmp_path):
    """train.jsonl beside train.json (or beside data/train.jsonl) would count the split's rows twice; a file that
    only starts with a split's name (train-old-backup.jsonl) is a split of its own, not a shard of 'train'."""
    from liger_patch_kd.train_cli.arguments import ScriptArguments
    from liger_patch_kd.train_cli.data import load_splits

    rows = [{"text": f"row {i}"} for i in range(4)]
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    folder = tmp_path / "twice"
    folder.mkdir()
    (folder / "train.jsonl").write_text(lines)
    (folder / "train-old-backup.jsonl").write_text(lines)
    splits = load_splits(ScriptArguments(dataset_name=str(folder)), seed=0, store_dataset=None)
    assert splits.train == rows
    (folder / "train.json").write_text(json.dumps(rows))
    with pytest.raises(ValueError, match=r"--dataset_name .*'train' is in both .*train\.json and .*train\.jsonl"):
        load_splits(ScriptArguments(dataset_name=str(folder)), seed=0, store_dataset=None)
    (folder / "train.json").unlink()
    (folder / "data").mkdir()
    (folder / "data" / "train.jsonl").write_text(lines)
    with pytest.raises(ValueError, match="'train' is in both"):
        load_splits(ScriptArguments(dataset_name=str(folder)), seed=0, store_dataset=None)


def test_dropping_the_test_split_and_holding_out_a_fraction_evaluates_on_the_fraction(tmp_path):
    """The --eval_fraction refusal's advice (--dataset_test_split none) followed: the fraction is held out."""
    from liger_patch_kd.train_cli.arguments import ScriptArguments
    from liger_patch_kd.train_cli.data import load_splits

    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": f"t{i}"}) + "\n" for i in range(8)))
    (folder / "test.jsonl").write_text(json.dumps({"text": "held"}) + "\n")
    script = ScriptArguments(dataset_name=str(folder), dataset_test_split="none", eval_fraction=0.25)
    splits = load_splits(script, seed=0, store_dataset=None)
    assert (len(splits.train), len(splits.evaluation)) == (6, 2)
    assert all(r["text"] != "held" for r in splits.evaluation)
    alone = load_splits(ScriptArguments(dataset_name=str(folder), dataset_test_split="none"), 0, None)
    assert alone.evaluation is None and "--dataset_test_split none" in alone.description


def test_a_data_file_not_in_utf8_names_the_option_the_file_and_the_byte(tmp_path):
    from liger_patch_kd.train_cli.arguments import ScriptArguments
    from liger_patch_kd.train_cli.data import load_splits

    file = tmp_path / "latin.jsonl"
    file.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError) as e:
        load_splits(ScriptArguments(dataset_name=str(file)), seed=0, store_dataset=None)
    message = str(e.value)
    assert f"--dataset_name {file}: not UTF-8" in message and "0xe9 at offset 28 (line 2)" in message
    assert "re-encode" in message and "\n" not in message


def test_yaml_booleans_are_read_as_the_options_mean_them(tmp_path):
    """An unquoted `no` for a word option is YAML's False: refused naming the key and the fix; a bool option that
    defaults to True (two argparse actions: --x and --no_x) takes the file's false."""
    config = tmp_path / "c.yaml"
    config.write_text("output_dir: o\nsave_strategy: no\n")
    with pytest.raises(ValueError, match=r"--config .*save_strategy: false is read by YAML as the boolean False.*"
                                         r"quote it"):  # fmt: skip
        train_parser.parse(["--config", str(config)])
    config.write_text("output_dir: o\nsave_strategy: 'no'\nremove_unused_columns: false\nuse_cpu: yes\n")
    _, _, args = train_parser.parse(["--config", str(config)])
    assert args.save_strategy == "no" and args.remove_unused_columns is False and args.use_cpu is True
    _, _, args = train_parser.parse(["--config", str(config), "--remove_unused_columns", "true"])
    assert args.remove_unused_columns is True  # the command line still wins


def test_an_options_value_is_never_read_as_a_trl_name():
    _, _, args = train_parser.parse(["--output_dir", "o", "--run_name=--temperature"])
    assert args.run_name == "--temperature"
    renamed = train_parser.with_our_names(["--run_name", "--lmbda", "--lmbda", "0.5"], takes_value={"run_name"})
    assert renamed == ["--run_name", "--lmbda", "--kd_lmbda", "0.5"]
    with pytest.raises(ValueError, match="unrecognized arguments: --kd_lmb"):  # not silently --kd_lmbda
        train_parser.parse(["--output_dir", "o", "--kd_lmb", "0.5"])


def test_a_rollout_store_and_its_teacher_are_one_teacher_when_the_store_is_refreshed(tmp_path):
    """kd_store_refresh_steps rescores regenerated rows with the teacher that scored the store: the pair is allowed
    then (and refused for a store of given sequences, whose rows nothing regenerates)."""
    from types import SimpleNamespace

    from liger_patch_kd.train_cli.arguments import ModelArguments

    model = ModelArguments(model_name_or_path="s", teacher_model_name_or_path="t")
    rollout_store = SimpleNamespace(meta={"rollouts": {"max_new_tokens": 4}})
    args = train_parser.parse(["--output_dir", "o", "--kd_store_refresh_steps", "2"])[2]
    train_run.check_teacher(model, args, tmp_path, rollout_store)
    with pytest.raises(ValueError, match="--kd_store_refresh_steps 2: .* rollout store"):
        train_run.check_teacher(model, args, tmp_path, SimpleNamespace(meta={}))
    args = train_parser.parse(["--output_dir", "o"])[2]
    with pytest.raises(ValueError, match="each name a teacher: give one .the teacher that scored a rollout store "
                                         "goes beside it with --kd_store_refresh_steps"):  # fmt: skip
        train_run.check_teacher(model, args, tmp_path, rollout_store)


def test_every_trl_only_name_is_reported_in_one_line(tmp_path, capsys):
    """A TRL GKDConfig YAML: each TRL name without an option here is named with what to give instead, all at once
    (and unknown keys beside them); TRL's `disable_dropout: false` is what happens here and passes."""
    config = tmp_path / "gkd.yaml"
    config.write_text("output_dir: o\ntemperature: 0.9\nmax_length: 1024\ndisable_dropout: true\npacking: true\n"
                      "lmbda: 0.5\nno_such_key: 1\n")  # fmt: skip
    assert cli.main(["train", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("liger-kd train: error: --config "), err
    for needle in ("--temperature: ", "--kd_generation_temperature", "--max_length: ", "--kd_max_length",
                   "--disable_dropout: dropout is as the model's config says", "attention_dropout", "--packing: ",
                   "DataCollatorWithFlattening", "no option no_such_key"):  # fmt: skip
        assert needle in err[0], needle
    assert "lmbda" not in err[0]  # an alias of ours: read as --kd_lmbda
    config.write_text("output_dir: o\ndisable_dropout: false\nlmbda: 0.5\n")
    _, _, args = train_parser.parse(["--config", str(config)])
    assert args.kd_lmbda == 0.5
    with pytest.raises(ValueError, match="--temperature: .*; --disable_dropout: dropout is as the model's config"):
        train_parser.parse(["--output_dir", "o", "--temperature", "0.9", "--disable_dropout"])


def test_config_is_an_option_of_the_usage(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    out = capsys.readouterr().out
    assert "[--config FILE]" in out.split("\n\n")[0]  # the usage synopsis
    # KDTrainingArguments fields this command refuses for flags of its own are not offered
    assert "model_init_kwargs" not in out and "--dtype" in out and "--teacher_dtype" in out
    _, _, args = train_parser.parse(["--output_dir", "o"])  # no config attribute is left over beside the dataclasses
    assert args.output_dir == "o"


def test_a_token_absent_from_one_vocabulary_is_said_so():
    from liger_patch_kd.train_cli.arguments import ModelArguments
    from liger_patch_kd.train_cli.models import check_same_tokenizer

    class Vocab:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    model = ModelArguments(model_name_or_path="s", teacher_model_name_or_path="t")
    with pytest.raises(ValueError, match="'el' is absent from the student's vocabulary and id 1 in the teacher's"):
        check_same_tokenizer(Vocab({"a": 0}), Vocab({"a": 0, "el": 1}), model)
    with pytest.raises(ValueError, match="'b' is id 1 in the student's and id 2 in the teacher's"):
        check_same_tokenizer(Vocab({"a": 0, "b": 1}), Vocab({"a": 0, "b": 2}), model)


def test_the_materialised_logits_note_names_the_flag_too():
    from liger_patch_kd.trainer.text_rows import materialised_logits_note

    note = materialised_logits_note(10, 100, offline=True)
    assert "use_kd_patch=True (KDTrainingArguments; --use_kd_patch" in note


def test_yaml_numbers_and_lists_are_read_as_the_command_line_reads_them(tmp_path):
    """argparse converts only string defaults: a YAML value of the wrong type for a number option is refused naming
    the key (not passed on, nor refused later under another name), 1e-5 (a string to YAML) is the number, 2.0 the
    integer 2, and a list option's scalar is a list of one, as one word after its flag."""
    config = tmp_path / "c.yaml"
    for text, needle in (("max_steps: 1.5\n", r"max_steps: 1\.5 is not an integer"),
                         ("kd_beta: [0.5]\n", r"kd_beta: \[0\.5\] is not a number"),
                         ("learning_rate: fast\n", r"learning_rate: 'fast' is not a number"),
                         ("lora_target_modules: 5\n", r"lora_target_modules: 5 is not a list of words")):  # fmt: skip
        config.write_text("output_dir: o\n" + text)
        with pytest.raises(ValueError, match=r"--config .*" + needle):
            train_parser.parse(["--config", str(config)])
    config.write_text("output_dir: o\nlearning_rate: 1e-5\nmax_steps: 2.0\nkd_beta: 1\nlora_target_modules: q_proj\n")
    _, model, args = train_parser.parse(["--config", str(config)])
    assert args.learning_rate == 1e-5 and args.max_steps == 2 and isinstance(args.max_steps, int)
    assert args.kd_beta == 1.0 and model.lora_target_modules == ["q_proj"]


def test_lora_all_linear_is_peft_shorthand():
    """`--lora_target_modules all-linear` (the help's example) gives PEFT its shorthand, which PEFT reads only as a
    string: as the list ['all-linear'] it named a module of that name, found none, after the student loaded."""
    pytest.importorskip("peft")
    from liger_patch_kd.train_cli.arguments import ModelArguments
    from liger_patch_kd.train_cli.models import check_model_options, with_lora

    tokenizer = tiny_tokenizer("the cat sat on the mat " * 20, vocab_size=270)
    options = ModelArguments(model_name_or_path="s", use_peft=True, lora_target_modules=["all-linear"])
    check_model_options(options)
    adapted = with_lora(tiny_qwen(len(tokenizer), 32, 1, 0, tokenizer), options)
    adapted_layers = {n.split(".")[-3] for n, _ in adapted.named_modules() if n.endswith("lora_A.default")}
    assert adapted_layers == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    options.lora_target_modules = ["all-linear", "q_proj"]
    with pytest.raises(ValueError, match=r"--lora_target_modules all-linear q_proj: all-linear .* alone"):
        check_model_options(options)


@pytest.mark.multiprocess
def test_a_later_run_into_one_output_dir_leaves_none_of_the_earlier_runs_files(in_standins, tmp_path, capsys):
    """A full run and then a LoRA run into one --output_dir (or the other way round): the later save replaces the
    files the earlier one saved, and removes those it did not rewrite; else a full model's weights beside the
    adapter (or an adapter beside the model) load instead of, or on top of, what the later run trained. Files no
    run of ours saved stay."""
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    lora = ["--use_peft", "--lora_r", "4", "--lora_dropout", "0", "--lora_target_modules", "q_proj", "v_proj"]
    ids = torch.tensor([[5, 17, 40, 99]])
    for first, second in (([], lora), (lora, [])):
        train_run.train([*PAIR, "--output_dir", str(out), "--learning_rate", "1e-2", *first, *FAST])
        (out / "notes.txt").write_text("mine")
        trainer = train_run.train([*PAIR, "--output_dir", str(out), "--learning_rate", "1e-2", *second, *FAST])
        names = {p.name for p in out.iterdir()}
        assert ("adapter_model.safetensors" in names) != ("model.safetensors" in names), names
        assert ("adapter_config.json" in names) == bool(second) and (out / "notes.txt").read_text() == "mine"
        assert "saved there by an earlier run" in capsys.readouterr().out
        reloaded = AutoModelForCausalLM.from_pretrained(out)
        torch.testing.assert_close(logits(reloaded, ids), logits(trainer.model, ids), rtol=1e-6, atol=1e-6)
        for p in out.iterdir():
            p.unlink() if p.is_file() else None


def test_resume_from_checkpoint_latest_continues_from_the_newest_checkpoint(in_standins, tmp_path, capsys):
    """`--resume_from_checkpoint latest` (or `true`, as the Trainer's True means) continues from the newest
    checkpoint in --output_dir: the resumed run ends where an uninterrupted one of the same steps ends."""
    out = tmp_path / "out"
    options = [*PAIR, "--use_kd_patch", "--learning_rate", "1e-2", "--seed", "3",
               *[w for w in FAST if w not in ("--save_strategy", "no")], "--save_strategy", "steps",
               "--save_steps", "1", "--dataset_test_split", "none"]  # fmt: skip
    whole = train_run.train([*options, "--output_dir", str(tmp_path / "whole"), "--max_steps", "3"])
    for step in (1, 2):  # a run of the same options stopped after its second step
        shutil.copytree(tmp_path / "whole" / f"checkpoint-{step}", out / f"checkpoint-{step}")
    capsys.readouterr()
    resumed = train_run.train([*options, "--output_dir", str(out), "--max_steps", "3",
                               "--resume_from_checkpoint", "latest"])  # fmt: skip
    assert f"liger-kd train: resuming from {out / 'checkpoint-2'}\n" in capsys.readouterr().out
    assert resumed.state.global_step == 3
    losses = lambda t: [h["loss"] for h in t.state.log_history if "loss" in h]  # noqa: E731
    assert losses(resumed)[-1] == pytest.approx(losses(whole)[-1], rel=1e-4)  # step 3 of the same run
    for name, p in whole.model.named_parameters():
        torch.testing.assert_close(dict(resumed.model.named_parameters())[name], p, rtol=1e-4, atol=1e-6)


def test_prompt_only_rows_train_on_policy_and_their_evaluation_is_refused_before_any_model_loads(
    in_standins, tmp_path, capsys, no_model_loads
):
    """The on-policy recipe takes a file of prompts alone; evaluation rows held out of it have no completion to
    score (eval_loss would be 0), and conversations ending in the user's turn are no prompt-only form: each one
    line before any model loads, naming the fix."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(8)))
    asked = tmp_path / "asked.jsonl"
    asked.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q {i}"}]}) + "\n"
                             for i in range(8)))  # fmt: skip
    for data, extra, needles in (
        (prompts, ["--eval_fraction", "0.25"], ["(evaluation rows)[0] is a prompt without a completion",
                                                "--dataset_test_split none"]),
        (asked, [], ["its 'messages' rows end with the 'user' turn", "{'prompt': [turns]}"]),
    ):  # fmt: skip
        rc = cli.main(["train", *FAST, *PAIR[:4], "--dataset_name", str(data), "--kd_lmbda", "1",
                       "--output_dir", str(tmp_path / "o"), *extra])  # fmt: skip
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and err and err[-1].startswith("liger-kd train: error: "), err
        assert all(n in err[-1] for n in needles), err[-1]


def test_a_resume_at_another_max_steps_says_what_the_restored_schedule_does(tmp_path):
    """The Trainer restores the learning-rate scheduler with the checkpoint: a run resumed at another --max_steps
    trains its first step at the rate the old schedule had reached (0 at the end of a linear one), then follows the
    new one. Said on the line that names the checkpoint (a new user's trial found the step at 0 unannounced)."""
    from liger_patch_kd.train_cli.output import resume_note

    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 4, "max_steps": 4}))
    assert resume_note(str(checkpoint), 4) == resume_note(str(checkpoint), -1) == \
        f"liger-kd train: resuming from {checkpoint}"  # fmt: skip
    note = resume_note(str(checkpoint), 8)
    assert note.startswith(f"liger-kd train: resuming from {checkpoint} (step 4 of a run of 4 steps); --max_steps 8")
    assert "--max_steps 4 continues the run as it was" in note


@pytest.mark.parametrize("word", ["false", "False", "none", " ", ""])
def test_resume_from_checkpoint_false_or_none_starts_afresh(tmp_path, word):
    from liger_patch_kd.train_cli.output import checked_resume

    assert checked_resume(word, str(tmp_path)) is None  # the Trainer's own False / None, not a folder named so
    assert checked_resume(None, str(tmp_path)) is None and checked_resume(False, str(tmp_path)) is False


def test_resume_latest_passes_over_an_unfinished_save_and_says_so(tmp_path, monkeypatch):
    """A newer checkpoint folder without trainer_state.json (a save cut short by a kill) is not resumed from: the
    newest complete one is, with a warning naming the one passed over."""
    from liger_patch_kd.train_cli.output import checked_resume

    for step, complete in ((2, True), (10, True), (12, False)):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        if complete:
            (folder / "trainer_state.json").write_text("{}")
    with pytest.warns(UserWarning, match=r"resuming from checkpoint-10; the newer checkpoint-12 has no "
                                         r"trainer_state.json"):  # fmt: skip
        assert checked_resume("latest", str(tmp_path)) == str(tmp_path / "checkpoint-10")
    (tmp_path / "checkpoint-12" / "trainer_state.json").write_text("{}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert checked_resume("true", str(tmp_path)) == str(tmp_path / "checkpoint-12")
    # a checkpoint folder itself named `latest` is reached as a path, the keyword still means the newest
    (tmp_path / "latest").mkdir()
    (tmp_path / "latest" / "trainer_state.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert checked_resume("./latest", str(tmp_path)) == "./latest"
    assert checked_resume("latest", str(tmp_path)) == str(tmp_path / "checkpoint-12")


def test_length_options_beside_tokenized_rows_are_refused_before_any_model_loads(in_standins, tmp_path, capsys,
                                                                                  no_model_loads):  # fmt: skip
    """KDTrainer refuses kd_max_length / kd_max_prompt_length beside rows nothing cuts (input_ids rows, a store);
    liger-kd train says so before the weights load, a recipe's YAML values included, naming how to drop them
    there; the stand-in's conversation rows, which they cut, pass to the models' loading."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from liger_patch_kd.teacher import precompute
    from liger_patch_kd.teacher.store import tokenizer_fingerprint

    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(json.dumps({"input_ids": [5, 17, 40, 99, 120, 7]}) + "\n" for _ in range(4)))
    store = tmp_path / "store"
    fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(STUDENT_ID))
    teacher = AutoModelForCausalLM.from_pretrained(TEACHER_ID)
    precompute(teacher, [[5, 17, 40, 99, 120, 7]] * 4, store, top_k=4, tokenizer_fp=fingerprint, progress=False)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("kd_max_length: 1024\nkd_max_prompt_length: 768\n")
    ids_options = ["--teacher_model_name_or_path", TEACHER_ID, "--kd_max_length", "4"]
    for data, extra, needles in (
        (ids, ids_options, ["rows given as input_ids", "kd_max_length=4 would never be used"]),
        (store, ["--config", str(recipe)], ["a teacher store's rows", "kd_max_length=1024 and kd_max_prompt_length=768",
                                            "drop them from the command line and from --config's YAML"]),
    ):  # fmt: skip
        rc = cli.main(["train", *FAST, "--output_dir", str(tmp_path / "o"), "--model_name_or_path", STUDENT_ID,
                       "--dataset_name", str(data), *extra])  # fmt: skip
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and err and err[-1].startswith("liger-kd train: error: "), err
        assert all(n in err[-1] for n in needles), err[-1]
    with pytest.raises(AssertionError, match="a model was loaded"):  # every check passed: the weights would load
        train_run.train([*PAIR, *FAST, "--output_dir", str(tmp_path / "o"), "--kd_max_length", "64",
                         "--kd_max_prompt_length", "32"])  # fmt: skip


def test_the_tiny_pair_is_written_and_its_printed_train_command_runs(tmp_path, monkeypatch, capsys):
    """`liger-kd demo --write-tiny-pair DIR`: a student, a teacher and a chat dataset on disk with no hub, and the
    command it prints trains them as printed (a new user without hub access had nothing to run `liger-kd train`
    on); a folder that holds anything is refused in one line, with nothing written."""
    import shlex

    pytest.importorskip("datasets")
    folder = tmp_path / "tiny"
    cli.main(["demo", "--write-tiny-pair", str(folder)])
    printed = capsys.readouterr().out
    command = printed.strip().splitlines()[-1]
    assert command.startswith("liger-kd train ") and "--use_kd_patch" in command
    assert sorted(p.name for p in folder.iterdir()) == ["data", "student", "teacher"]
    monkeypatch.chdir(tmp_path)
    trainer = train_run.train(shlex.split(command)[2:] + ["--report_to", "none", "--disable_tqdm", "true"])
    assert any("kd_soft_loss" in h for h in trainer.state.log_history)
    assert (folder / "out" / "model.safetensors").exists()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert cli.main(["demo", "--write-tiny-pair", str(tmp_path / "busy")]) == 2
    err = capsys.readouterr().err
    assert "--write-tiny-pair" in err and "not an empty folder" in err
    assert [p.name for p in (tmp_path / "busy").iterdir()] == ["notes.txt"]


def test_an_unreachable_hub_is_one_line_that_keeps_its_offline_hint(monkeypatch):
    """transformers' message for a hub it cannot reach ends with where to read about offline mode (about 260
    characters): the refusal quotes it whole, on one line; a longer error is cut with an ellipsis."""
    import transformers

    from liger_patch_kd.train_cli.arguments import ModelArguments
    from liger_patch_kd.train_cli.models import load_tokenizer
    from liger_patch_kd.utils.errors import reason_of

    offline = ("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them in the "
               "cached files.\nCheck your internet connection or see how to run the library in offline mode at "
               "'https://huggingface.co/docs/transformers/installation#offline-mode'.")  # fmt: skip

    def unreachable(*args, **kwargs):
        raise OSError(offline)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", unreachable)
    with pytest.raises(ValueError) as e:
        load_tokenizer("org/model", ModelArguments(model_name_or_path="org/model"), "--model_name_or_path")
    message = str(e.value)
    assert "\n" not in message and message.startswith("--model_name_or_path org/model: no tokenizer loads from there")
    assert message.endswith("installation#offline-mode'.)")
    assert reason_of(OSError("x" * 600)) == "x" * 497 + "..." and reason_of(OSError()) == "OSError"
