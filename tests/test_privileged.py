"""A teacher that sees its own prompt (privileged context): rows, pairing, and the loss against the reference
computed by hand (teacher logits of teacher_prompt + completion, student logits of prompt + completion, completion
positions only), fused and materialised, padded left / right and packed."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import liger_patch_kd.models as M
from liger_patch_kd import reference
from liger_patch_kd.batch.prompts import PromptCollator, tokenize_prompt_row
from liger_patch_kd.config import KDLossConfig
from liger_patch_kd.models.privileged import completion_index
from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments, PrivilegedCollator

from .helpers import rel_err
from .test_onpolicy import tokenizer  # noqa: F401  (the BPE tokenizer fixture with a chat template)
from .tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")

CFG = dict(kd_beta=0.5, kd_temperature=2.0, kd_hard_weight=0.3)


def _args(tmp_path, **overrides):
    base = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=2, learning_rate=1e-3,
        logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
        dataloader_num_workers=0, use_kd_patch=True, remove_unused_columns=False, **CFG,
    )  # fmt: skip
    return KDTrainingArguments(**{**base, **overrides})


def _rows(seed=0):
    """(student prompt, teacher prompt, completion): teacher prompt longer, shorter, equal; one empty completion."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(3, 250, (n,), generator=g).tolist()

    return [(ids(3), ids(7), ids(5)), (ids(6), ids(2), ids(4)), (ids(4), ids(4), []), (ids(1), ids(5), ids(6))]


def _features(rows):
    return [{"input_ids": s + c, "labels": [-100] * len(s) + c, "teacher_input_ids": t + c} for s, t, c in rows]


def _context_teacher(dtype=torch.float64):
    """A tiny teacher whose predictions depend on its context: a random tiny model's hardly do (the residual stream
    is its token's embedding, its logits near zero), so attention outputs and logits are scaled up."""
    teacher = tiny_model("llama", dtype=dtype, seed=2, hidden=96)
    with torch.no_grad():
        teacher.model.norm.weight.mul_(30)
        for layer in teacher.model.layers:
            layer.self_attn.o_proj.weight.mul_(10)
    return teacher


def _left_padded(rows):
    """Left padding by hand, position ids counting the attended tokens (what a left-padding collator gives)."""

    def side(seqs, labelled):
        width = max(len(x) for x in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
        for r, (seq, lab) in enumerate(zip(seqs, labelled)):
            ids[r, width - len(seq) :], mask[r, width - len(seq) :] = torch.tensor(seq), 1
            labels[r, width - len(seq) :] = torch.tensor(lab)
        return ids, mask, labels, (mask.cumsum(1) - 1).clamp(min=0)

    s = side([a + c for a, _, c in rows], [[-100] * len(a) + c for a, _, c in rows])
    t = side([b + c for _, b, c in rows], [[-100] * len(b) + c for _, b, c in rows])
    return {"input_ids": s[0], "attention_mask": s[1], "labels": s[2], "position_ids": s[3],
            "teacher_input_ids": t[0], "teacher_attention_mask": t[1], "teacher_labels": t[2],
            "teacher_position_ids": t[3]}  # fmt: skip


def _batch(rows, layout):
    if layout == "left":
        return _left_padded(rows)
    return PrivilegedCollator(packing=layout == "packed")(_features(rows))


def _hand_reference(student, teacher, rows, cfg: KDLossConfig, num_items):
    """Each row alone, unpadded: the student's logits of prompt + completion and the teacher's of teacher prompt +
    completion at the positions predicting the completion, scored by reference.kd_loss."""
    s_rows, t_rows, targets = [], [], []
    for s, t, c in rows:
        if not c:
            continue
        s_rows.append(student(input_ids=torch.tensor([s + c])).logits[0, len(s) - 1 : len(s) + len(c) - 1])
        with torch.no_grad():
            t_rows.append(teacher(input_ids=torch.tensor([t + c])).logits[0, len(t) - 1 : len(t) + len(c) - 1])
        targets += c
    return reference.kd_loss(torch.cat(s_rows), torch.cat(t_rows), torch.tensor(targets), cfg, num_items)


def _topk_reference(student, teacher, rows, cfg, num_items, k, atol):
    """(loss, teacher log-probs leaf): each row alone, unpadded; the teacher's top-k of its own row (float64, in
    process) at the positions predicting the completion, the student's logits at its own, reference.topk_kd_loss.
    Also checks that no scored position has a near-tie at the top-k's edge: a store or a server whose log-probs are
    each within `atol` of these could swap ids across a gap <= 2 * atol."""
    s_rows, ids, values, targets = [], [], [], []
    for s, t, c in rows:
        if not c:
            continue
        s_rows.append(student(input_ids=torch.tensor([s + c])).logits[0, len(s) - 1 : len(s) + len(c) - 1])
        with torch.no_grad():
            lp = teacher(input_ids=torch.tensor([t + c])).logits[0, len(t) - 1 : len(t) + len(c) - 1].log_softmax(-1)
        top = lp.topk(k + 1, dim=-1)
        assert (top.values[:, -2] - top.values[:, -1]).min() > 2 * atol  # the test is well posed
        ids.append(top.indices[:, :k])
        values.append(top.values[:, :k])
        targets += c
    leaf = torch.cat(values).requires_grad_(True)
    loss = reference.topk_kd_loss(torch.cat(s_rows), torch.cat(ids), leaf, torch.tensor(targets), cfg, num_items)
    return loss, leaf


def _assert_is_the_topk_reference(trainer, loss, student, reference_student, teacher, rows, num_items, k, atol):
    """After `loss.backward()` on the trained `student`: its loss and every gradient are `_topk_reference`'s (on
    `reference_student`, its copy from before the step) within what teacher data whose log-probs are each within
    `atol` of the float64 ones move them: to first order the loss by at most sum |dL/dlog p| * atol, the gradients
    by a relative ~1e-5. The teacher read at the student's prompt instead gives another loss, far outside that."""
    M.revert_kd_patch(model=student)
    expected, leaf = _topk_reference(reference_student, teacher, rows, trainer.kd_config, num_items, k, atol)
    expected.backward()
    bound = float(leaf.grad.abs().sum()) * atol + 1e-12
    loss, expected = float(loss.detach()), float(expected.detach())
    assert abs(loss - expected) <= bound, (loss, expected, bound)
    for (name, p), q in zip(student.named_parameters(), reference_student.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-4, name
    same_prompt = [(s, s, c) for s, _, c in rows]
    wrong, _ = _topk_reference(reference_student, teacher, same_prompt, trainer.kd_config, num_items, k, 0)
    assert abs(float(wrong.detach()) - expected) > 100 * bound


@pytest.mark.parametrize("use_kd_patch", [True, False], ids=["fused", "materialised"])
@pytest.mark.parametrize("layout", ["right", "left", "packed"])
def test_the_loss_is_the_hand_reference_whatever_the_layout(tmp_path, layout, use_kd_patch):
    student, teacher = tiny_model("llama", seed=1), _context_teacher()  # float64
    if layout == "left":  # transformers' eager attention gives NaN on left padding in float64 (not in sdpa, float32)
        for model in (student, teacher):
            model.config._attn_implementation = "sdpa"
    rows = _rows()
    num_items = torch.tensor(sum(len(c) for _, _, c in rows))
    reference_student = copy.deepcopy(student)
    # the kernels (RMSNorm, RoPE, SwiGLU) work in float32: off, so that float64 is float64 throughout
    kernels_off = {"rope": False, "swiglu": False, "rms_norm": False}
    args = _args(tmp_path, use_kd_patch=use_kd_patch, kd_patch_config=kernels_off)
    trainer = KDTrainer(model=student, teacher_model=teacher, args=args)
    loss = trainer.compute_loss(student, _batch(rows, layout), num_items_in_batch=num_items)
    loss.backward()
    M.revert_kd_patch(model=student)
    expected = _hand_reference(reference_student, teacher, rows, trainer.kd_config, num_items)
    expected.backward()
    # float64 throughout; the batched paths and the row-by-row reference sum in other orders: measured ~2e-10 on
    # the loss, and ~4e-8 norm-wise on the gradients, as for plain KD (one prompt) on the same models
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-8, atol=1e-12)
    for (name, p), q in zip(student.named_parameters(), reference_student.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-6, name
    # the teacher reading the student's prompt instead gives another loss, by far more than the tolerance
    same_prompt = [(s, s, c) for s, _, c in rows]
    wrong = _hand_reference(reference_student, teacher, same_prompt, trainer.kd_config, num_items)
    assert (wrong - expected).abs() > 1e-3 * expected.abs()


@pytest.mark.parametrize("use_kd_patch", [True, False], ids=["fused", "materialised"])
def test_all_ignored_rows_with_zero_items_give_zero_and_no_nan(tmp_path, use_kd_patch):
    student, teacher = tiny_model("llama", seed=1), tiny_model("llama", seed=2)
    trainer = KDTrainer(model=student, teacher_model=teacher, args=_args(tmp_path, use_kd_patch=use_kd_patch))
    rows = [(s, t, []) for s, t, _ in _rows()]
    loss = trainer.compute_loss(student, _batch(rows, "right"), num_items_in_batch=torch.tensor(0))
    loss.backward()
    assert loss.item() == 0
    assert all(torch.isfinite(p.grad).all() and not p.grad.any() for p in student.parameters() if p.grad is not None)


def test_rows_are_checked_naming_the_row():
    rows = _features(_rows())
    bad = copy.deepcopy(rows)
    bad[1]["teacher_input_ids"][-1] += 1  # another last completion token on the teacher's side
    with pytest.raises(ValueError, match="row 1: the teacher's completion"):
        PrivilegedCollator()(bad)
    empty = copy.deepcopy(rows)
    empty[3]["teacher_input_ids"] = empty[3]["input_ids"][1:]  # the completion alone: no teacher prompt
    with pytest.raises(ValueError, match="row 3: the teacher's prompt is empty"):
        PrivilegedCollator()(empty)
    given = copy.deepcopy(rows)
    given[0]["teacher_labels"] = [-100] * len(given[0]["teacher_input_ids"])
    with pytest.raises(ValueError, match="row 0"):
        PrivilegedCollator()(given)
    no_labels = [{k: v for k, v in r.items() if k != "labels"} for r in rows]
    with pytest.raises(ValueError, match="needs 'labels'"):
        PrivilegedCollator()(no_labels)


def test_the_forward_checks_the_pairing_and_the_teacher_source(tmp_path):
    student, teacher = tiny_model("llama", seed=1), tiny_model("llama", seed=2)
    trainer = KDTrainer(model=student, teacher_model=teacher, args=_args(tmp_path))
    batch = _batch(_rows(), "right")
    shifted = dict(batch, teacher_labels=batch["teacher_labels"].roll(1, dims=1))  # paired with other tokens
    with pytest.raises(ValueError, match="row 0: the student scores"):
        trainer.compute_loss(student, shifted)
    with pytest.raises(ValueError, match="needs teacher_labels"):
        trainer.compute_loss(student, {k: v for k, v in batch.items() if k != "teacher_labels"})
    ids = torch.zeros(*batch["input_ids"].shape, 2, dtype=torch.long)
    offline = dict(batch, teacher_token_ids=ids, teacher_logprobs=torch.zeros(ids.shape))
    with pytest.raises(ValueError, match="must be the teacher's on its own rows"):  # the student's positions
        trainer.compute_loss(student, offline)
    with pytest.raises(ValueError, match="batch size"):
        completion_index(torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 3, dtype=torch.long), -100)


def test_text_rows_give_the_teacher_its_prompt_before_the_same_tokens(tokenizer):  # noqa: F811
    rows = [
        {"prompt": "the cat", "completion": " sat on the mat.", "teacher_prompt": "a dog ran to the park. the cat"},
        {"prompt": [{"role": "user", "content": "the sun"}], "completion": [{"role": "assistant", "content": "is"}],
         "teacher_prompt": [{"role": "system", "content": "warm today."}, {"role": "user", "content": "the sun"}]},
        {"prompt": "a dog", "completion": " ran."},  # no teacher prompt: the teacher sees the student's
    ]  # fmt: skip
    batch = PromptCollator(tokenizer)(rows)
    for r, row in enumerate(rows):
        prompt, completion = tokenize_prompt_row(tokenizer, row)
        teacher_prompt, _ = tokenize_prompt_row(tokenizer, {"prompt": row.get("teacher_prompt", row["prompt"])})
        t_len = len(teacher_prompt) + len(completion)
        assert batch["teacher_input_ids"][r, :t_len].tolist() == teacher_prompt + completion
        assert batch["teacher_labels"][r, :t_len].tolist() == [-100] * len(teacher_prompt) + completion
        assert batch["teacher_attention_mask"][r].sum() == t_len
        assert (batch["labels"][r][batch["labels"][r] != -100]).tolist() == completion
    assert len(tokenize_prompt_row(tokenizer, {"prompt": rows[0]["teacher_prompt"]})[0]) > len(
        tokenize_prompt_row(tokenizer, rows[0])[0]
    )


def _sequences(ids, labels, mask=None, positions=None):
    """(prompt, completion) of each sequence of a batch: padded rows (mask) or packed ones (position ids)."""
    out = []
    for r in range(ids.shape[0]):
        keep = mask[r].bool() if mask is not None else torch.ones_like(ids[r], dtype=torch.bool)
        row_ids, row_labels = ids[r][keep], labels[r][keep]
        starts = [0] if positions is None else (positions[r][keep] == 0).nonzero().squeeze(-1).tolist()
        for a, b in zip(starts, [*starts[1:], len(row_ids)]):
            seq, lab = row_ids[a:b], row_labels[a:b]
            scored = (lab != -100).nonzero()
            first = int(scored[0]) if len(scored) else len(seq)
            out.append((seq[:first].tolist(), lab[lab != -100].tolist()))
    return out


def _rows_of_batch(inputs):
    student = _sequences(inputs["input_ids"], inputs["labels"], inputs.get("attention_mask"),
                         inputs.get("position_ids"))  # fmt: skip
    teacher = _sequences(inputs["teacher_input_ids"], inputs["teacher_labels"], inputs.get("teacher_attention_mask"),
                         inputs.get("teacher_position_ids"))  # fmt: skip
    assert [c for _, c in student] == [c for _, c in teacher]
    return [(s, t, c) for (s, c), (t, _) in zip(student, teacher)]


TEXT = [("the cat", " sat on the mat.", "the sun is warm today. the cat"),
        ("a dog ran", " to the park.", "the cat sat. a dog ran"),
        ("the sun", " is warm.", "the"), ("on the", " mat.", "the cat sat on the")]  # fmt: skip


@pytest.mark.parametrize("rows", ["text", "packed"])
def test_train_with_bf16_and_accumulation_scores_each_step_as_the_reference(tmp_path, tokenizer, rows):  # noqa: F811
    """KDTrainer.train() (bf16 autocast, 2 micro-batches) on text rows, or token-level rows packed: every
    micro-batch's loss, computed from the step's starting weights, against the float64 hand reference on the same
    tokens with the step's item count."""
    data, collator = [{"prompt": p, "completion": c, "teacher_prompt": t} for p, c, t in TEXT], None
    if rows == "packed":  # the same rows as token ids, packed
        data = _features([(*(tokenize_prompt_row(tokenizer, {"prompt": r[k]})[0] for k in ("prompt", "teacher_prompt")),
                           tokenize_prompt_row(tokenizer, r)[1]) for r in data])  # fmt: skip
        collator = PrivilegedCollator(packing=True)
    for use_kd_patch in (True, False):
        student, teacher = tiny_model("llama", dtype=torch.float32, seed=1), _context_teacher(torch.float32)
        start = copy.deepcopy(student).double()
        trainer = KDTrainer(
            model=student, teacher_model=teacher, processing_class=tokenizer, train_dataset=data,
            data_collator=collator,
            args=_args(tmp_path, bf16=True, gradient_accumulation_steps=2, max_steps=1, use_kd_patch=use_kd_patch,
                       kd_hard_weight=0.0),  # the KD term alone: what the teacher's prompt changes
        )  # fmt: skip
        seen = []
        inner = trainer.compute_loss

        def spy(model, inputs, return_outputs=False, num_items_in_batch=None, inner=inner):
            loss = inner(model, inputs, return_outputs, num_items_in_batch)
            seen.append((copy.deepcopy({k: v for k, v in inputs.items()}), num_items_in_batch, loss.detach()))
            return loss

        trainer.compute_loss = spy
        trainer.train()
        assert len(seen) == 2 and int(seen[0][1]) == sum(int((b["labels"] != -100).sum()) for b, _, _ in seen)
        for inputs, num_items, loss in seen:
            batch_rows = _rows_of_batch(inputs)
            assert len(batch_rows) == 2 and ("position_ids" in inputs) == (rows == "packed")
            cfg, reference_teacher = trainer.kd_config, copy.deepcopy(teacher).double()
            expected = _hand_reference(start, reference_teacher, batch_rows, cfg, num_items).detach()
            # bf16 products (8-bit mantissa, relative error 2^-9 each) through two decoder layers and two heads,
            # errors that average out over the terms (measured: 3e-4 fused, 1e-6 materialised)
            torch.testing.assert_close(loss.double(), expected, rtol=1e-2, atol=1e-5)
            same_prompt = [(s, s, c) for s, _, c in batch_rows]
            wrong = _hand_reference(start, reference_teacher, same_prompt, cfg, num_items).detach()
            assert (wrong - expected).abs() > 2 * (1e-2 * expected.abs() + 1e-5), (wrong, expected)  # can fail


def test_kd_self_distill_options_are_checked(tmp_path):
    with pytest.raises(ValueError, match="kd_self_distill must be one of"):
        _args(tmp_path, kd_self_distill="copy")
    with pytest.raises(ValueError, match="needs a PEFT model"):
        KDTrainer(model=tiny_model("llama"), args=_args(tmp_path, kd_self_distill="adapter"))


def test_a_datasets_dataset_keeps_the_teacher_columns(tmp_path):
    datasets = pytest.importorskip("datasets")
    data = datasets.Dataset.from_list(_features(_rows()))
    student, teacher = tiny_model("llama", dtype=torch.float32, seed=1), _context_teacher(torch.float32)
    trainer = KDTrainer(model=student, teacher_model=teacher, train_dataset=data,
                        args=_args(tmp_path, remove_unused_columns=True, max_steps=1))  # fmt: skip
    batch = next(iter(trainer.get_train_dataloader()))
    assert {"teacher_input_ids", "teacher_labels", "teacher_attention_mask"} <= set(batch)
    trainer.train()


def test_a_cut_completion_is_cut_alike_for_the_teacher(tokenizer):  # noqa: F811
    row = {"prompt": "the cat", "completion": " sat on the mat.", "teacher_prompt": "a dog ran to the park. the cat"}
    prompt, completion = tokenize_prompt_row(tokenizer, row)
    teacher_prompt = tokenize_prompt_row(tokenizer, {"prompt": row["teacher_prompt"]})[0]
    kept = completion[: len(completion) - 2]
    batch = PromptCollator(tokenizer, max_length=len(prompt) + len(kept))(
        [row, {"prompt": "a", "teacher_prompt": "the sun"}]
    )
    assert batch["teacher_input_ids"][0, : len(teacher_prompt) + len(kept)].tolist() == teacher_prompt + kept
    assert batch["teacher_labels"][0][batch["teacher_labels"][0] != -100].tolist() == kept
    assert (batch["teacher_labels"][1] == -100).all() and batch["kd_has_completion"].tolist() == [True, False]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_completion_index_pairs_the_kth_scored_positions_of_any_layout(data):
    """Against a plain loop: random prompt and completion lengths, padding on either side."""
    batch = data.draw(st.integers(1, 4))
    rows = [(data.draw(st.integers(1, 5)), data.draw(st.integers(1, 5)), data.draw(st.integers(0, 5)))
            for _ in range(batch)]  # fmt: skip

    def side(lengths, left):
        width = max(p + c for p, c in lengths) + data.draw(st.integers(0, 2))
        targets = torch.full((batch, width), -100)
        for r, (p, c) in enumerate(lengths):
            offset = width - p - c if left else 0
            targets[r, offset + p - 1 : offset + p + c - 1] = torch.arange(c) + 10 * r  # row-aligned (shifted)
        return targets

    student = side([(s, c) for s, _, c in rows], data.draw(st.booleans()))
    teacher = side([(t, c) for _, t, c in rows], data.draw(st.booleans()))
    index = completion_index(student, teacher, -100)
    for r in range(batch):
        s_pos = (student[r] != -100).nonzero().squeeze(-1).tolist()
        t_pos = (teacher[r] != -100).nonzero().squeeze(-1).tolist()
        assert [int(index[r, p]) for p in s_pos] == [r * teacher.shape[1] + p for p in t_pos]
    assert int(index.min()) >= 0 and int(index.max()) < teacher.numel()


@pytest.mark.parametrize("use_kd_patch", [True, False], ids=["fused", "materialised"])
@pytest.mark.parametrize("layout", ["right", "packed"])
def test_offline_top_k_of_the_teachers_rows_is_paired_alike(tmp_path, layout, use_kd_patch):
    """A store's top-k computed on teacher_input_ids (here by hand, K = 16 of the teacher's log-softmax): gathered
    into the student's positions, against the hand reference (reference.topk_kd_loss on each row alone)."""
    student, teacher = tiny_model("llama", seed=1), _context_teacher()
    rows, k = _rows(), 16
    features = _features(rows)
    ids_rows, lp_rows, s_rows, targets = [], [], [], []
    reference_student = copy.deepcopy(student)
    for f, (s, t, c) in zip(features, rows):
        with torch.no_grad():
            logprobs = teacher(input_ids=torch.tensor([t + c])).logits[0].log_softmax(-1)
        top = logprobs.topk(k, dim=-1)
        f["teacher_token_ids"], f["teacher_logprobs"] = top.indices, top.values
        if c:
            ids_rows.append(top.indices[len(t) - 1 : len(t) + len(c) - 1])
            lp_rows.append(top.values[len(t) - 1 : len(t) + len(c) - 1])
            s_rows.append(
                reference_student(input_ids=torch.tensor([s + c])).logits[0, len(s) - 1 : len(s) + len(c) - 1]
            )
            targets += c
    num_items = torch.tensor(len(targets))
    args = _args(
        tmp_path, use_kd_patch=use_kd_patch, kd_patch_config={"rope": False, "swiglu": False, "rms_norm": False}
    )
    trainer = KDTrainer(model=student, args=args)  # no teacher model: the top-k in the batch
    batch = PrivilegedCollator(packing=layout == "packed")(features)
    assert batch["teacher_token_ids"].shape[:2] == batch["teacher_input_ids"].shape
    loss = trainer.compute_loss(student, batch, num_items_in_batch=num_items)
    loss.backward()
    cfg = trainer.kd_config
    expected = reference.topk_kd_loss(torch.cat(s_rows), torch.cat(ids_rows), torch.cat(lp_rows),
                                      torch.tensor(targets), cfg, num_items)  # fmt: skip
    expected.backward()
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-8, atol=1e-12)  # as above
    for (name, p), q in zip(student.named_parameters(), reference_student.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-6, name


def test_teacher_data_laid_along_the_students_rows_is_refused(tmp_path):
    """Top-k of the student's rows (what a server asked about input_ids would send) is not the teacher's on its own
    rows: refused naming the shapes (a served teacher is asked about teacher_input_ids: test_privileged_served)."""
    trainer = KDTrainer(model=tiny_model("llama", seed=1), args=_args(tmp_path, kd_teacher_url="http://127.0.0.1:1"))
    batch = _batch(_rows(), "right")
    ids = torch.zeros(*batch["input_ids"].shape, 2, dtype=torch.long)
    served = dict(batch, teacher_token_ids=ids, teacher_logprobs=torch.zeros(ids.shape))
    with pytest.raises(ValueError, match=r"teacher_token_ids of shape \(4, 10, 2\) must be the teacher's"):
        trainer.compute_loss(trainer.model, served)
