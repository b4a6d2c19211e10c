"""`liger-kd precompute` of TRL's prompt rows ('prompt' + 'completion', text or conversational, and 'messages'):
the store holds the rows tokenized exactly as KDTrainer tokenizes them for training (PromptCollator: the chat
template, kd_max_prompt_length, kd_max_length) with completion-only labels (store format 5), so training on the
store is the objective of training on the rows with the teacher in process."""

import copy
import json

import pytest
import torch

from liger_patch_kd import KDTrainer, KDTrainingArguments
from liger_patch_kd import teacher as TD
from liger_patch_kd.batch.prompts import PromptCollator, prompt_token_rows
from liger_patch_kd.cli import main
from liger_patch_kd.demo import load_corpus
from liger_patch_kd.teacher.precompute import read_jsonl_rows, read_jsonl_sequences

from .hub_standins import conversations, tiny_qwen, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("clean_patches")
MAX_LENGTH, MAX_PROMPT_LENGTH = 40, 24  # short enough that both cuts act on some rows
KERNELS_OFF = {"rope": False, "swiglu": False, "rms_norm": False}


@pytest.fixture(scope="module")
def pair():
    """(tokenizer, teacher, student, rows): tiny float32 Qwen2 models sharing a ChatML BPE tokenizer, and rows of
    every prompt kind."""
    text = load_corpus()
    tokenizer = tiny_tokenizer(text)
    teacher = tiny_qwen(len(tokenizer), 64, 2, 1, tokenizer).eval()
    student = tiny_qwen(len(tokenizer), 32, 2, 0, tokenizer)
    chats = conversations(text, 6)
    rows = chats[:4] + [
        {"prompt": chats[4]["messages"][:1], "completion": chats[4]["messages"][1:]},  # conversational
        {"prompt": chats[5]["messages"][0]["content"], "completion": " " + chats[5]["messages"][1]["content"]},
    ]
    return tokenizer, teacher, student, rows


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# a store's rows were cut when precompute made them: the trainer is given no length options beside it
STORE_OPTIONS = {"kd_max_length": None, "kd_max_prompt_length": None}


def _args(tmp_path, **overrides):
    return KDTrainingArguments(**{
        "output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 6, "max_steps": 1, "report_to": "none",
        "use_cpu": True, "save_strategy": "no", "disable_tqdm": True, "dataloader_num_workers": 0, "kd_beta": 0.0,
        "kd_max_length": MAX_LENGTH, "kd_max_prompt_length": MAX_PROMPT_LENGTH, "remove_unused_columns": False,
        "kd_patch_config": KERNELS_OFF, **overrides,
    })  # fmt: skip


def _store(tmp_path, pair):
    tokenizer, teacher, _, rows = pair
    read = read_jsonl_rows(_write_jsonl(tmp_path / "rows.jsonl", rows), tokenizer=tokenizer, max_length=MAX_LENGTH,
                           max_prompt_length=MAX_PROMPT_LENGTH, vocab_size=len(tokenizer))  # fmt: skip
    # every slot of the vocabulary, in float32: the store holds the teacher's whole distribution, so the stored loss
    # is the in-process one, not a top-k approximation of it
    TD.precompute(teacher, read.sequences, tmp_path / "store", top_k=len(tokenizer), logprob_dtype="float32",
                  labels=read.labels, progress=False)  # fmt: skip
    return TD.TeacherLogprobsDataset(tmp_path / "store", tokenizer=tokenizer)


def test_completion_only_labels_survive_the_store(tmp_path, pair):
    tokenizer, _, _, rows = pair
    store = _store(tmp_path, pair)
    assert store.meta["format_version"] == 5 and store.meta["labels"] is True
    collate = PromptCollator(tokenizer, max_prompt_length=MAX_PROMPT_LENGTH, max_length=MAX_LENGTH)
    for i, row in enumerate(rows):
        expected = collate([row])  # one row: no padding
        item = store[i]
        assert item["input_ids"].tolist() == expected["input_ids"][0].tolist(), i
        assert item["labels"].tolist() == expected["labels"][0].tolist(), i
        scored = item["labels"] != -100
        assert scored.any() and not scored.all(), i  # a prompt and a completion
        assert torch.equal(item["labels"][scored], item["input_ids"][scored])
    assert prompt_token_rows(tokenizer, rows[:1], max_prompt_length=MAX_PROMPT_LENGTH, max_length=MAX_LENGTH)[0][
        "labels"] == store[0]["labels"].tolist()  # fmt: skip
    # the trainer's collator of a store batches the stored labels (the prompt is not scored)
    student = tiny_model_copy(pair)
    trainer = KDTrainer(model=student, args=_args(tmp_path, **STORE_OPTIONS), train_dataset=store,
                        processing_class=tokenizer)  # fmt: skip
    from_store = trainer.data_collator([store[i] for i in range(len(store))])
    from_rows = collate(rows)
    for key in ("input_ids", "attention_mask", "labels"):
        assert torch.equal(from_store[key], from_rows[key]), key


def tiny_model_copy(pair):
    return copy.deepcopy(pair[2])


@pytest.mark.parametrize("use_kd_patch", [True, False], ids=["fused", "materialised"])
def test_a_store_of_messages_rows_trains_the_in_process_objective(tmp_path, pair, use_kd_patch):
    tokenizer, teacher, _, rows = pair
    store = _store(tmp_path, pair)
    losses = []
    for teacher_model, data in ((teacher, rows), (None, store)):
        student = tiny_model_copy(pair)
        trainer = KDTrainer(model=student, teacher_model=teacher_model, train_dataset=data, processing_class=tokenizer,
                            args=_args(tmp_path, use_kd_patch=use_kd_patch,
                                       **(STORE_OPTIONS if data is store else {})))  # fmt: skip
        batch = trainer.data_collator([data[i] for i in range(len(data))])
        num_items = (batch["labels"][:, 1:] != -100).sum()
        losses.append(trainer.compute_loss(student, batch, num_items_in_batch=num_items).detach())
    in_process, stored = losses
    assert in_process > 0
    # the same float32 teacher log-softmax, computed once in the step and once by precompute (another batch
    # shape, so other reduction orders): float32 rounding of a loss of order 1
    torch.testing.assert_close(stored, in_process, rtol=1e-5, atol=1e-6)


def test_precompute_cli_reads_prompt_rows_and_names_every_accepted_format(tmp_path, pair, capsys):
    tokenizer, teacher, _, rows = pair
    teacher.save_pretrained(tmp_path / "teacher")
    tokenizer.save_pretrained(tmp_path / "teacher")
    base = ["precompute", "--teacher", str(tmp_path / "teacher"), "--top-k", "4", "--device", "cpu"]
    data = _write_jsonl(tmp_path / "rows.jsonl", rows)
    assert main([*base, "--data", str(data), "--out", str(tmp_path / "s"), "--max-length", str(MAX_LENGTH),
                 "--max-prompt-length", str(MAX_PROMPT_LENGTH)]) == 0  # fmt: skip
    assert "labels on the completions only" in capsys.readouterr().out
    store = TD.TeacherLogprobsDataset(tmp_path / "s")
    assert len(store) == len(rows) and (store[0]["labels"] == -100).any()
    # a line with none of the accepted columns: one line naming every accepted row format
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"question": "why?", "answer": "because"}])
    assert main([*base, "--data", str(bad), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    for accepted in ("'text'", "'input_ids'", "'prompt' + 'completion'", "'messages'", "['answer', 'question']"):
        assert accepted in err, accepted
    # skipping every line says so, and which
    assert main([*base, "--data", str(bad), "--out", str(tmp_path / "b"), "--skip-bad-lines"]) == 2
    assert "no usable lines (skipped: 1 no accepted columns" in capsys.readouterr().err
    # a prompt without completion has nothing to score offline: the rollouts are the way
    lone = _write_jsonl(tmp_path / "lone.jsonl", [{"prompt": "the cat"}])
    assert main([*base, "--data", str(lone), "--out", str(tmp_path / "b")]) == 2
    assert "--rollouts-from" in capsys.readouterr().err
    # --max-prompt-length on text rows would cut nothing: refused
    text = _write_jsonl(tmp_path / "text.jsonl", [{"text": "the cat sat"}])
    assert main([*base, "--data", str(text), "--out", str(tmp_path / "b"), "--max-prompt-length", "4"]) == 2
    assert "drop --max-prompt-length" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_text_stores_are_unchanged_and_labels_are_checked(tmp_path, pair):
    tokenizer, teacher, _, rows = pair
    text = _write_jsonl(tmp_path / "text.jsonl", [{"text": "the cat sat"}, {"input_ids": [1, 2, 3]}])
    sequences, _ = read_jsonl_sequences(text, tokenizer=tokenizer)
    assert read_jsonl_rows(text, tokenizer=tokenizer).labels is None  # every token scored, as before
    TD.precompute(teacher, sequences, tmp_path / "plain", top_k=4, progress=False)
    plain = TD.TeacherLogprobsDataset(tmp_path / "plain")
    assert plain.meta["format_version"] == 2 and "labels" not in plain[0]
    with pytest.raises(ValueError, match="call read_jsonl_rows"):  # labels never dropped silently
        read_jsonl_sequences(_write_jsonl(tmp_path / "rows.jsonl", rows), tokenizer=tokenizer)
    with pytest.raises(ValueError, match="labels of sequence 0: each must be the token itself"):
        TD.precompute(teacher, [[1, 2, 3]], tmp_path / "x", top_k=4, labels=[[-100, 5, 3]], progress=False)
    with pytest.raises(ValueError, match="labels of sequence 0 score no token"):
        TD.precompute(teacher, [[1, 2, 3]], tmp_path / "x", top_k=4, labels=[[1, -100, -100]], progress=False)
    assert not (tmp_path / "x").exists()


def test_a_reader_refuses_a_newer_format_and_a_labelled_store_without_its_labels(tmp_path, pair):
    _store(tmp_path, pair)
    manifest = tmp_path / "store" / "manifest.json"
    meta = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**meta, "format_version": 6}))
    with pytest.raises(TD.TeacherStoreError, match="store format 6; this version reads up to 5: upgrade"):
        TD.TeacherLogprobsDataset(tmp_path / "store")
    manifest.write_text(json.dumps({**meta, "labels": "yes"}))
    with pytest.raises(TD.TeacherStoreError, match="labels must be true or false"):
        TD.TeacherLogprobsDataset(tmp_path / "store")
    # a plain store's shards with a manifest that says they hold labels: the missing array is named
    text = _write_jsonl(tmp_path / "text.jsonl", [{"input_ids": [1, 2, 3]}])
    TD.precompute(pair[1], read_jsonl_sequences(text)[0], tmp_path / "plain", top_k=4, progress=False)
    manifest = tmp_path / "plain" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format_version": 5, "labels": True}))
    with pytest.raises(TD.TeacherStoreError, match="has no 'labels' array"):
        TD.TeacherLogprobsDataset(tmp_path / "plain")[0]


def _float64_completion_kl(teacher, student, tokenizer, rows) -> float:
    """Forward KL(teacher || student) per completion token, on float64 copies and materialised logits, with the
    rows tokenized one at a time (no padding)."""
    collate = PromptCollator(tokenizer, max_prompt_length=MAX_PROMPT_LENGTH, max_length=MAX_LENGTH)
    t64, s64 = copy.deepcopy(teacher).double(), copy.deepcopy(student).double()
    total, count = 0.0, 0
    for row in rows:
        batch = collate([row])
        with torch.no_grad():
            p = torch.log_softmax(t64(input_ids=batch["input_ids"]).logits[0, :-1], -1)
            q = torch.log_softmax(s64(input_ids=batch["input_ids"]).logits[0, :-1], -1)
        scored = batch["labels"][0, 1:] != -100
        total += float((p.exp() * (p - q)).sum(-1)[scored].sum())
        count += int(scored.sum())
    return total / count


def test_prompt_rows_evaluate_beside_token_rows_or_alone(tmp_path, pair):
    """An eval_dataset of prompt rows with no train_dataset, or beside a train_dataset of text rows (liger-kd
    train's test split of messages beside a train split of text): each batch is collated by its rows' kind, and
    eval_loss is the float64 KL over the completion tokens. Before, the collator followed the training rows only,
    and the evaluation failed with KeyError 'input_ids' (after the training)."""
    tokenizer, teacher, student, rows = pair
    expected = _float64_completion_kl(teacher, student, tokenizer, rows)
    texts = [{"text": "the cat sat on the mat and looked at the door"}] * 2
    for train in (None, texts):
        trainer = KDTrainer(model=tiny_model_copy(pair), teacher_model=teacher, processing_class=tokenizer,
                            train_dataset=train, eval_dataset=rows,
                            args=_args(tmp_path, per_device_eval_batch_size=4,
                                       per_device_train_batch_size=2))  # fmt: skip
        if train is not None:
            trainer.train()  # the text rows train with the same collator
            trainer.model.load_state_dict(student.state_dict())
        # float32 steps against a float64 reference: rounding of a loss of order 1 (padding changes the order)
        assert trainer.evaluate()["eval_loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("row", [0, 4])  # a `messages` row, a conversational `prompt` row
def test_conversations_without_a_chat_template_are_the_tokenizers_fault_not_the_lines(tmp_path, pair, row):
    """Every conversation of the file would fail alike: the error names the tokenizer and --tokenizer, and
    --skip-bad-lines (which would skip them all) neither hides it nor is offered."""
    tokenizer, _, _, rows = pair
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    path = _write_jsonl(tmp_path / "rows.jsonl", [rows[row], rows[5]])
    for skip in (False, True):
        with pytest.raises(ValueError, match="chat template.*--tokenizer") as caught:
            read_jsonl_rows(path, tokenizer=plain, vocab_size=len(plain), skip_bad_lines=skip)
        assert "skip-bad-lines" not in str(caught.value) and ":1:" in str(caught.value)
    assert read_jsonl_rows(_write_jsonl(tmp_path / "text.jsonl", [rows[5]]), tokenizer=plain).sequences  # text rows
