"""Rows of {"text": ...}: tokenized by KDTrainer when it has a tokenizer (a list of dicts and a datasets.Dataset), as
TRL's trainers do; refused in one line, before any work, without one; read by `liger-kd precompute --data` too."""

import json

import pytest
import torch

from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments

from .tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")

TEXTS = ["the cat sat on the mat.", "a dog ran to the park", "the sun is warm today. the cat sat."] * 2


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import PreTrainedTokenizerFast

    from liger_patch_kd.demo.cross_tokenizer import train_bpe_tokenizer

    return PreTrainedTokenizerFast(
        tokenizer_object=train_bpe_tokenizer(" ".join(TEXTS) * 10, 200), pad_token="<pad>", bos_token="<s>",
        eos_token="</s>",
    )  # fmt: skip


def make_args(tmp_path, **overrides) -> KDTrainingArguments:
    base = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=2, learning_rate=1e-3,
        report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, use_kd_patch=True, logging_steps=1,
    )  # fmt: skip
    return KDTrainingArguments(**{**base, **overrides})


def trainer_for(tmp_path, rows, tokenizer, **overrides) -> KDTrainer:
    return KDTrainer(
        model=tiny_model("llama", dtype=torch.float32, seed=1), teacher_model=tiny_model("llama", dtype=torch.float32),
        args=make_args(tmp_path, **overrides), train_dataset=rows, processing_class=tokenizer,
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["list", "datasets.Dataset"])
def test_text_rows_are_tokenized_with_the_students_tokenizer_and_train(tmp_path, tokenizer, kind):
    rows = [{"text": t} for t in TEXTS]
    if kind != "list":
        datasets = pytest.importorskip("datasets")
        rows = datasets.Dataset.from_list(rows)
    trainer = trainer_for(tmp_path, rows, tokenizer)
    assert [list(trainer.train_dataset[i]["input_ids"]) for i in range(len(TEXTS))] == [
        tokenizer(t)["input_ids"] for t in TEXTS
    ]
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    truncated = trainer_for(tmp_path, rows, tokenizer, kd_max_length=4).train_dataset
    assert [list(truncated[i]["input_ids"]) for i in range(len(TEXTS))] == [
        tokenizer(t)["input_ids"][:4] for t in TEXTS
    ]


def test_other_columns_are_kept_and_the_eval_rows_tokenized_too(tmp_path, tokenizer):
    rows = [{"text": t, "note": n} for n, t in enumerate(TEXTS)]
    trainer = KDTrainer(
        model=tiny_model("llama", dtype=torch.float32), teacher_model=tiny_model("llama", dtype=torch.float32),
        args=make_args(tmp_path), train_dataset=rows, eval_dataset={"held": rows[:2]}, processing_class=tokenizer,
    )  # fmt: skip
    assert trainer.train_dataset[3] == {"note": 3, "input_ids": tokenizer(TEXTS[3])["input_ids"]}
    assert trainer.eval_dataset["held"][1]["input_ids"] == tokenizer(TEXTS[1])["input_ids"]


@pytest.mark.parametrize("kind", ["list", "datasets.Dataset"])
def test_a_text_row_of_no_tokens_is_refused_by_its_index_before_training(tmp_path, tokenizer, kind):
    assert tokenizer("")["input_ids"] == []  # this tokenizer adds no BOS: blank text is no tokens
    rows = [{"text": t} for t in TEXTS[:3]] + [{"text": ""}] + [{"text": t} for t in TEXTS[3:]]
    if kind != "list":
        rows = pytest.importorskip("datasets").Dataset.from_list(rows)
    with pytest.raises(ValueError, match=r"train_dataset\[3\]'s 'text' '' tokenizes to no tokens.*remove blank") as e:
        trainer_for(tmp_path, rows, tokenizer)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["list", "datasets.Dataset"])
def test_a_later_row_without_text_is_refused_by_its_index_and_columns(tmp_path, tokenizer, kind):
    rows = [{"text": TEXTS[0]}, {"text": TEXTS[1]}, {"foo": 1}, {"text": TEXTS[2]}]
    if kind != "list":
        rows = pytest.importorskip("datasets").Dataset.from_list(rows)  # the missing text is a null there
    with pytest.raises(ValueError, match=r"train_dataset\[2\] has no 'text' value \(its columns with a value: "
                                         r"\[('foo')?\]\)") as e:  # fmt: skip
        trainer_for(tmp_path, rows, tokenizer)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["list", "datasets.Dataset"])
@pytest.mark.parametrize("where", ["train_dataset", "eval_dataset"])
def test_a_row_of_no_input_ids_is_refused_by_its_index_before_training(tmp_path, tokenizer, kind, where):
    """A batch of such rows fails in the model's forward (a tensor of 0 elements reshaped); one beside others trains
    on nothing: refused when the Trainer is built."""
    good = [{"input_ids": tokenizer(t)["input_ids"]} for t in TEXTS]
    rows = [*good[:4], {"input_ids": []}, *good[4:]]
    if kind != "list":
        rows = pytest.importorskip("datasets").Dataset.from_list(rows)
    train, evaluation = (rows, None) if where == "train_dataset" else (good, rows)
    with pytest.raises(ValueError, match=rf"{where}\[4\] has no tokens \(input_ids of length 0\): remove empty"):
        KDTrainer(model=tiny_model("llama", dtype=torch.float32),
                  teacher_model=tiny_model("llama", dtype=torch.float32), args=make_args(tmp_path),
                  train_dataset=train, eval_dataset=evaluation, processing_class=tokenizer)  # fmt: skip


def test_kd_max_prompt_length_beside_text_rows_alone_is_refused_not_ignored(tmp_path, tokenizer):
    """A text row is trained whole and has no prompt: kd_max_prompt_length where no rows of the run have a prompt
    (training and evaluation text rows) would cut nothing; refused in one line before tokenizing, naming the
    option, the rows and the fix. Where some rows have prompts (training or evaluation) it cuts those: built.
    kd_max_length still cuts text rows."""
    rows = [{"text": t} for t in TEXTS]
    prompts = [{"prompt": t, "completion": " yes"} for t in TEXTS]  # prompt rows: the option applies to them

    def build(train, evaluation=None, **options):
        return KDTrainer(model=tiny_model("llama", dtype=torch.float32, seed=1),
                         teacher_model=tiny_model("llama", dtype=torch.float32),
                         args=make_args(tmp_path, eval_strategy="no", **options), processing_class=tokenizer,
                         train_dataset=train, **({"eval_dataset": evaluation} if evaluation is not None else {}))

    for evaluation in (None, rows):
        with pytest.raises(ValueError, match=r"train_dataset holds {'text': ...} rows, which have no prompt: "
                                             r"kd_max_prompt_length=3 would never be used; leave it unset") as e:
            build(rows, evaluation, kd_max_prompt_length=3, kd_max_length=4)
        assert "\n" not in str(e.value)
    build(prompts, rows, kd_max_prompt_length=3)  # training's prompts are cut; the text rows are evaluated whole
    build(rows, prompts, kd_max_prompt_length=3)  # the evaluation's prompts are cut
    assert len(trainer_for(tmp_path, rows, tokenizer, kd_max_length=4).train_dataset[0]["input_ids"]) == 4
    trainer_for(tmp_path, prompts, tokenizer, kd_max_prompt_length=3)


def test_a_prompt_as_long_as_kd_max_length_is_refused_as_it_leaves_nothing_to_score(tmp_path, tokenizer):
    from liger_patch_kd.batch.prompts import PromptCollator

    rows = [{"prompt": TEXTS[0], "completion": " yes"}, {"prompt": TEXTS[2], "completion": " no"}]
    prompt = len(tokenizer(TEXTS[2])["input_ids"])
    PromptCollator(tokenizer, max_length=prompt + 1)(rows)  # one completion token left: trains on it
    with pytest.raises(ValueError, match=rf"prompt row 1 of this batch .*its prompt has {prompt} tokens "
                                         rf"\(kd_max_prompt_length=None\), and kd_max_length={prompt} .*no completion"
                                         rf" token.*kd_max_prompt_length below kd_max_length") as e:  # fmt: skip
        PromptCollator(tokenizer, max_length=prompt)(rows)
    assert "\n" not in str(e.value)
    kept = PromptCollator(tokenizer, max_prompt_length=prompt - 2, max_length=prompt)(rows)  # the fix it names
    assert (kept["labels"] != -100).any(dim=1).all()


@pytest.mark.parametrize("columns_known", [True, False])
def test_text_rows_of_an_iterable_dataset_are_tokenized_lazily_and_train(tmp_path, tokenizer, columns_known):
    datasets = pytest.importorskip("datasets")
    if columns_known:
        rows = datasets.Dataset.from_list([{"text": t} for t in TEXTS]).to_iterable_dataset()
    else:  # a generator's stream: its columns are known only by reading a row
        rows = datasets.IterableDataset.from_generator(lambda: ({"text": t} for t in TEXTS))
        assert rows.column_names is None
    trainer = trainer_for(tmp_path, rows, tokenizer, max_steps=3)
    assert isinstance(trainer.train_dataset, datasets.IterableDataset)  # still lazy
    assert [list(row["input_ids"]) for row in trainer.train_dataset] == [tokenizer(t)["input_ids"] for t in TEXTS]
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))


def test_a_text_row_of_no_tokens_in_an_iterable_dataset_is_refused_when_read(tmp_path, tokenizer):
    datasets = pytest.importorskip("datasets")
    rows = datasets.Dataset.from_list([{"text": t} for t in [*TEXTS[:2], "", *TEXTS[2:]]]).to_iterable_dataset()
    trainer = trainer_for(tmp_path, rows, tokenizer)  # nothing is read before training: a stream may be long
    with pytest.raises(ValueError, match=r"train_dataset\[2\]'s 'text' '' tokenizes to no tokens"):
        trainer.train()


def test_text_rows_without_a_tokenizer_are_refused_in_one_line(tmp_path):
    for rows in ([{"text": t} for t in TEXTS], pytest.importorskip("datasets").Dataset.from_list([{"text": "a"}])):
        with pytest.raises(ValueError, match=r"columns \['text'\].*processing_class=tokenizer") as e:
            trainer_for(tmp_path, rows, None)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"processing_class \(object\) cannot tokenize text"):  # given, not usable
        trainer_for(tmp_path, [{"text": t} for t in TEXTS], object())
    with pytest.raises(ValueError, match=r"columns \['body', 'id'\], none of which KDTrainer trains on"):
        trainer_for(tmp_path, [{"body": "x", "id": 1}], None)
    with pytest.raises(ValueError, match="kd_max_length must be None or an integer >= 1"):
        make_args(tmp_path, kd_max_length=0)


@pytest.mark.parametrize("prompt_length", [8, 9])
def test_a_prompt_cap_at_or_past_the_row_cap_is_refused_before_any_model_loads(tmp_path, prompt_length):
    """kd_max_prompt_length >= kd_max_length: a prompt kept whole can fill the row and leave no completion; said
    when the arguments are made (a new user met it only at the first batch, after both models loaded)."""
    with pytest.raises(ValueError, match=rf"kd_max_prompt_length={prompt_length} must be below kd_max_length=8") as e:
        make_args(tmp_path, kd_max_prompt_length=prompt_length, kd_max_length=8)
    assert "\n" not in str(e.value)
    make_args(tmp_path, kd_max_prompt_length=7, kd_max_length=8)


@pytest.mark.parametrize("generated", [{"kd_lmbda": 0.5}, {"kd_lmbda": 1.0}, {"kd_seq_kd": True}])
def test_text_rows_are_refused_for_generated_steps(tmp_path, tokenizer, generated):
    """A generated step samples after each row's prompt, which a text row does not name (tokenized whole, its
    prompt would be empty): refused when the trainer is built, pointing at prompt / completion rows."""
    with pytest.raises(ValueError, match=r"\{'text': \.\.\.\} rows, and kd_lmbda=.* give rows of \{'prompt'") as e:
        trainer_for(tmp_path, [{"text": t} for t in TEXTS], tokenizer, **generated)
    assert "\n" not in str(e.value)
    prompts = [{"prompt": t[:6], "completion": t[6:]} for t in TEXTS]  # the documented rows build
    trainer_for(tmp_path, prompts, tokenizer, **generated)


def test_precompute_reads_text_lines_with_the_teachers_tokenizer(tmp_path, tokenizer):
    from liger_patch_kd.cli import main
    from liger_patch_kd.teacher import TeacherLogprobsDataset

    teacher_dir = tmp_path / "teacher"
    tiny_model("llama", dtype=torch.float32).save_pretrained(teacher_dir)
    tokenizer.save_pretrained(teacher_dir)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:3]))
    argv = ["precompute", "--teacher", str(teacher_dir), "--data", str(data), "--out", str(tmp_path / "store"),
            "--top-k", "4", "--device", "cpu", "--dtype", "float32"]  # fmt: skip
    assert main(argv) == 0
    store = TeacherLogprobsDataset(tmp_path / "store")
    assert [store[i]["input_ids"].tolist() for i in range(len(store))] == [tokenizer(t)["input_ids"] for t in TEXTS[:3]]
    assert store[0]["teacher_token_ids"].shape == (len(tokenizer(TEXTS[0])["input_ids"]), 4)


def test_precompute_names_the_line_whose_text_is_not_a_string(tmp_path, tokenizer, capsys):
    """{"text": 5} is the data's mistake, told as FILE:LINE, not in the tokenizer's words; --skip-bad-lines skips it."""
    from liger_patch_kd.cli import main
    from liger_patch_kd.teacher import TeacherLogprobsDataset

    teacher_dir = tmp_path / "teacher"
    tiny_model("llama", dtype=torch.float32).save_pretrained(teacher_dir)
    tokenizer.save_pretrained(teacher_dir)
    data = tmp_path / "data.jsonl"
    argv = ["precompute", "--teacher", str(teacher_dir), "--data", str(data), "--out", str(tmp_path / "store"),
            "--top-k", "4", "--device", "cpu", "--dtype", "float32"]  # fmt: skip
    for value, kind in ((5, "5"), (None, "null"), (["a", "b"], '["a", "b"]')):
        data.write_text(json.dumps({"text": TEXTS[0]}) + "\n" + json.dumps({"text": value}) + "\n")
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"liger-kd precompute: error: {data}:2: 'text' must be a JSON string; got {kind}:"), err
        assert "--skip-bad-lines" in err
    assert main([*argv, "--skip-bad-lines"]) == 0
    assert "skipped 1 bad line" in (out := capsys.readouterr().out) and ": 1 text not a string" in out
    assert len(TeacherLogprobsDataset(tmp_path / "store")) == 1


def test_precompute_names_the_data_file_that_is_not_utf8(tmp_path, tokenizer):
    from liger_patch_kd.teacher.precompute import read_jsonl_sequences

    data = tmp_path / "latin.jsonl"
    data.write_bytes(b'{"text": "ok"}\r\n{"text": "caf\xe9"}\r\n')
    with pytest.raises(ValueError, match=rf"--data {data}: not UTF-8 text: byte 0xe9 at offset 29 \(line 2\).*"
                                         r"re-encode the file as UTF-8"):  # fmt: skip
        read_jsonl_sequences(data, tokenizer=tokenizer)
    data.write_bytes(b'{"text": "ok"}\r\n\r\n{"text": "caf\xc3\xa9"}\r\n')  # Windows line ends read as open() reads
    assert read_jsonl_sequences(data, tokenizer=tokenizer)[0] == [tokenizer("ok")["input_ids"],
                                                                  tokenizer("caf\u00e9")["input_ids"]]  # fmt: skip


def test_an_iterable_datasets_known_columns_get_the_same_refusals(tmp_path, tokenizer):
    """A datasets.IterableDataset whose columns are known is checked by its column names (nothing of it read):
    text rows for generated steps, kd_max_prompt_length beside text rows and kd_max_length beside input_ids rows
    are refused as for a list; an iterable whose columns are unknown is left to its first batch."""
    datasets = pytest.importorskip("datasets")
    text = datasets.Dataset.from_list([{"text": t} for t in TEXTS]).to_iterable_dataset()
    with pytest.raises(ValueError, match=r"\{'text': \.\.\.\} rows, and kd_lmbda=1.0"):
        trainer_for(tmp_path, text, tokenizer, kd_lmbda=1.0)
    with pytest.raises(ValueError, match=r"\{'text': \.\.\.\} rows, which have no prompt: kd_max_prompt_length=3"):
        trainer_for(tmp_path, text, tokenizer, kd_max_prompt_length=3)
    ids = datasets.Dataset.from_list([{"input_ids": [5, 6, 7, 8]}] * 4).to_iterable_dataset()
    with pytest.raises(ValueError, match=r"rows given as input_ids, which nothing cuts: kd_max_length=2 would never"):
        trainer_for(tmp_path, ids, tokenizer, kd_max_length=2)
    trainer_for(tmp_path, text, tokenizer, kd_max_length=4)  # kd_max_length cuts text rows: built
    unknown = datasets.IterableDataset.from_generator(lambda: iter({"text": t} for t in TEXTS))
    assert unknown.column_names is None
    trainer_for(tmp_path, unknown, tokenizer, kd_max_prompt_length=3)  # nothing to read the columns from: built


@pytest.mark.parametrize("kind", ["list", "datasets.Dataset"])
def test_a_row_that_would_be_cut_to_nothing_is_refused_by_index_before_training(tmp_path, tokenizer, kind):
    """The collator refuses such a row at its batch: hours into a run, and again on resuming (the order is seeded).
    The Trainer reads every prompt row first, as training will tokenize it, and names the row's index; rows cut
    with a completion token left, or kept short by kd_max_prompt_length, pass."""
    long_prompt = len(tokenizer(TEXTS[2])["input_ids"])
    rows = [{"prompt": TEXTS[0], "completion": " yes"}] * 700 + [{"prompt": TEXTS[2], "completion": " no"}]
    if kind != "list":
        rows = pytest.importorskip("datasets").Dataset.from_list(rows)
    with pytest.raises(ValueError, match=rf"^train_dataset\[700\] .*its prompt has {long_prompt} tokens .*"
                                         rf"kd_max_length={long_prompt} cuts prompt \+ completion"):  # fmt: skip
        trainer_for(tmp_path, rows, tokenizer, kd_max_length=long_prompt)
    trainer_for(tmp_path, rows, tokenizer, kd_max_length=long_prompt + 1)
    trainer_for(tmp_path, rows, tokenizer, kd_max_length=long_prompt, kd_max_prompt_length=long_prompt - 2)
    evaluation = [{"prompt": TEXTS[2], "completion": " no"}]
    with pytest.raises(ValueError, match=r"^eval_dataset\[0\] "):
        KDTrainer(model=tiny_model("llama", dtype=torch.float32, seed=1), teacher_model=tiny_model("llama"),
                  args=make_args(tmp_path, kd_max_length=long_prompt, eval_strategy="steps", eval_steps=1),
                  train_dataset=rows[:1] if kind == "list" else rows.select([0]), eval_dataset=evaluation,
                  processing_class=tokenizer)  # fmt: skip
