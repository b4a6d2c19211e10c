"""Several teachers of different tokenizers (KDTrainer(teacher_model={...}, teacher_tokenizer={name: tok})): each row
against its own teacher, same-tokenizer teachers through the several-teacher loss and the others through the align
loss, against the materialised references composed per row (reference.multi_teacher_kd_loss, align/reference.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from liger_patch_kd import KDLossConfig, KDTrainer, KDTrainingArguments, reference
from liger_patch_kd.align import byte_level_to_text
from liger_patch_kd.align import reference as xref
from liger_patch_kd.batch.columns import TOKENIZER_TEACHERS as TEACHERS_KEY
from liger_patch_kd.demo import build_model, load_corpus
from liger_patch_kd.demo.cross_tokenizer import CharTokenizerWithOffsets, train_bpe_tokenizer
from liger_patch_kd.models.kd_io import shift_labels
from liger_patch_kd.trainer.rollouts.onpolicy import require_completions
from liger_patch_kd.trainer.teachers.other_tokenizer import cross_tokenizer_config

pytestmark = pytest.mark.usefixtures("clean_patches")

TEXT = load_corpus()
BPE = train_bpe_tokenizer(TEXT[:8000], 300)  # the student's tokenizer, shared by teachers "same" and "same2"
BPE2 = train_bpe_tokenizer(TEXT[:4000], 200)  # another byte-level BPE
CHAR = CharTokenizerWithOffsets(TEXT)
V = BPE.get_vocab_size()
TOKENIZERS = {"char": CHAR, "bpe2": BPE2}  # "same" / "same2" left out: the student's tokenizer

# routed rows of each kind, a fractional mixture over three teachers (two tokenizers) and an empty completion;
# nobody routes to "same2" here
LOSS_ROWS = [
    {"prompt": "At dawn, ", "completion": "the fox sees a cat.", "teacher": "same"},
    {"prompt": "The mill ", "completion": "stands by the river.", "teacher": "char"},
    {"prompt": "", "completion": "A heron watches the old mill; 8 or 9.", "teacher": "bpe2"},
    {"prompt": "Night: ", "completion": "owls call.", "teacher_weights": {"same": 0.25, "char": 0.5, "bpe2": 0.25}},
    {"prompt": "Empty: ", "completion": "", "teacher": "char"},
]
# mixture of distributions: routed rows and a mixture of the two student-tokenizer teachers; nobody routes to "bpe2"
DISTRIBUTION_ROWS = [
    {"prompt": "At dawn, ", "completion": "the fox sees a cat.", "teacher": "char"},
    {"prompt": "The mill ", "completion": "stands by the river.", "teacher": "same2"},
    {"prompt": "", "completion": "A heron watches the old mill.", "teacher_weights": {"same": 0.5, "same2": 0.5}},
    {"prompt": "Night: ", "completion": "owls call twice.", "teacher": 2},
]


def _models(dtype=torch.float64):
    teachers = {
        "same": build_model(V + 5, 48, 1, 1, "cpu"),  # a head padded past the tokenizer, another hidden size
        "same2": build_model(V, 32, 1, 2, "cpu"),
        "char": build_model(len(CHAR), 40, 1, 3, "cpu"),
        "bpe2": build_model(BPE2.get_vocab_size(), 32, 1, 4, "cpu"),
    }
    for m in teachers.values():  # untrained demo models are near uniform: spread their logits so the terms matter
        with torch.no_grad():
            m.lm_head.weight.mul_(40)
    return build_model(V, 32, 1, 0, "cpu").to(dtype), {k: m.to(dtype) for k, m in teachers.items()}


def _args(tmp_path, **overrides):
    base = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=5, max_steps=1, learning_rate=1e-3,
        logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
        dataloader_num_workers=0, kd_beta=0.3, kd_temperature=2.0, kd_hard_weight=0.2, kd_vocab_size=V,
        kd_teacher_mixture="loss",
    )  # fmt: skip
    return KDTrainingArguments(**{**base, **overrides})


def _trainer(tmp_path, student, teachers, rows=LOSS_ROWS, tokenizers=TOKENIZERS, **overrides):
    return KDTrainer(model=student, teacher_model=teachers, args=_args(tmp_path, **overrides), train_dataset=rows,
                     processing_class=BPE, teacher_tokenizer=tokenizers)  # fmt: skip


def _logits(model, ids, mask=None):
    return model(input_ids=ids, attention_mask=mask).logits.to(torch.float64)


def _reference(trainer, student, teachers, rows, *, soft_only_of=None):
    """Each row collated alone, every model's own logits: the several-teacher reference on the share of the
    student-tokenizer teachers plus each other-tokenizer teacher's align reference, weighted by the row's weight,
    summed over rows and divided by the whole batch's labelled student tokens. `soft_only_of=name`: that teacher's
    KD term alone, per labelled token of the rows it is routed (the logged kd_soft_loss/<name>)."""
    args = trainer.args
    kd = dict(beta=args.kd_beta, temperature=args.kd_temperature, hard_weight=args.kd_hard_weight)
    if soft_only_of is not None:
        kd["hard_weight"] = 0.0
    xcfg = cross_tokenizer_config(args).replace(reduction="sum", hard_weight=kd["hard_weight"])
    setup = trainer.teacher_set.tokenizers
    names, same = setup.names, setup.same
    total, count, own_tokens = 0.0, 0, 0
    for row in rows:
        batch = trainer.data_collator([row])
        w = batch["teacher_mixture"][0].double()
        s_logits = _logits(student, batch["input_ids"])
        targets = shift_labels(batch["labels"], -100)
        count += int((targets != -100).sum())
        share = float(w[same].sum())
        if share > 0 and soft_only_of is None:
            t_logits = [_logits(teachers[names[j]], batch["input_ids"]).detach() for j in same]
            total = total + share * reference.multi_teacher_kd_loss(
                s_logits, t_logits, w[same] / share, targets, None, reduction="sum", vocab_size=V,
                mixture=args.kd_teacher_mixture, **kd,
            )  # fmt: skip
        for name, part in batch[TEACHERS_KEY].items():
            if soft_only_of not in (None, name):
                continue
            own_tokens += int((targets != -100).sum())
            t_logits = _logits(teachers[name], part["teacher_input_ids"], part["teacher_attention_mask"]).detach()
            total = total + w[names.index(name)] * xref.cross_tokenizer_kd_loss(
                s_logits, t_logits, targets, shift_labels(part["teacher_labels"], -100), part["student_align_groups"],
                part["teacher_align_groups"], setup.cross[name].vocab_map,
                part["align_exact_ok"], xcfg,
            )  # fmt: skip
    return total / (own_tokens if soft_only_of is not None else count)


@pytest.mark.parametrize(
    "mixture,rows,kind", [("loss", LOSS_ROWS, "hybrid"), ("distribution", DISTRIBUTION_ROWS, "hybrid"),
                          ("loss", LOSS_ROWS, "chain"), ("distribution", LOSS_ROWS[1:3], "hybrid")]
)  # fmt: skip
def test_compute_loss_and_gradients_equal_the_composed_reference_in_float64(tmp_path, mixture, rows, kind):
    """Rows of both kinds and a mixture; DISTRIBUTION_ROWS route none to bpe2, LOSS_ROWS none to same2, and
    LOSS_ROWS[1:3] none to either student-tokenizer teacher."""
    student, teachers = _models()
    reference_student = copy.deepcopy(student)
    trainer = _trainer(tmp_path, student, teachers, rows, kd_teacher_mixture=mixture, kd_cross_tokenizer_loss=kind)
    batch = trainer.data_collator(rows)
    assert set(batch[TEACHERS_KEY]) == ({"char"} if rows is DISTRIBUTION_ROWS else {"char", "bpe2"})
    expected = _reference(trainer, reference_student, teachers, rows)
    expected.backward()
    num_items = (shift_labels(batch["labels"], -100) != -100).sum()
    loss = trainer.compute_loss(student, batch, num_items_in_batch=num_items)
    loss.backward()
    # float64 throughout: the fused losses sum in chunks, the references in one pass
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-10, atol=0)
    for p, q in zip(student.parameters(), reference_student.parameters()):
        assert (p.grad - q.grad).norm() <= 1e-9 * q.grad.norm()


def test_logged_figures_per_teacher(tmp_path):
    """kd_soft_loss/<name> of a teacher of another tokenizer is its align KD term per labelled token of its rows;
    its top-1 agreement is the share of one-to-one groups where both most likely tokens are the same string (here
    compared by their strings, not through the vocabulary map); a teacher without rows logs 0."""
    student, teachers = _models()
    rows = [r for r in LOSS_ROWS if "teacher" in r]  # routed rows only
    trainer = _trainer(tmp_path, student.train(), teachers, rows)
    batch = trainer.data_collator(rows)
    trainer.compute_loss(student, batch)
    figures = trainer._kd_teacher_metrics
    for name in ("char", "bpe2"):
        expected = _reference(trainer, student, teachers, rows, soft_only_of=name)
        torch.testing.assert_close(figures[f"kd_soft_loss/{name}"].double(), expected.detach(), rtol=1e-9, atol=0)
    assert figures["kd_soft_loss/same2"] == 0 and figures["kd_top1_agreement/same2"] == 0
    assert figures["kd_soft_loss/same"] > 0
    part = batch[TEACHERS_KEY]["char"]
    s_top = _logits(student, batch["input_ids"]).argmax(-1)
    t_top = _logits(teachers["char"], part["teacher_input_ids"]).argmax(-1)
    s_text = {i: byte_level_to_text(tok) for tok, i in BPE.get_vocab().items()}
    t_text = {i: tok for tok, i in CHAR.get_vocab().items()}
    agree = []
    for b, r in zip(*torch.nonzero((part["student_align_groups"] >= 0) & part["align_exact_ok"], as_tuple=True)):
        tb, tr = torch.nonzero(part["teacher_align_groups"] == part["student_align_groups"][b, r], as_tuple=True)
        agree.append(s_text[int(s_top[b, r])] == t_text[int(t_top[tb[0], tr[0]])])
    assert len(agree) > 5
    assert float(figures["kd_top1_agreement/char"]) == pytest.approx(sum(agree) / len(agree), abs=1e-6)


def test_all_rows_ignored_with_no_items_gives_zero_and_zero_gradients(tmp_path):
    """A micro-batch of empty completions only (no label, no aligned group), num_items_in_batch=0, NaN nowhere."""
    student, teachers = _models()
    rows = [{"prompt": "At dawn, ", "completion": "", "teacher": name} for name in ("same", "char", "bpe2")]
    rows.append({"prompt": "Night", "completion": "", "teacher_weights": {"same2": 0.5, "char": 0.5}})
    trainer = _trainer(tmp_path, student, teachers, rows)
    batch = trainer.data_collator(rows)
    assert (batch["labels"] == -100).all() and set(batch[TEACHERS_KEY]) == {"char", "bpe2"}
    loss = trainer.compute_loss(student, batch, num_items_in_batch=0)
    loss.backward()
    assert loss.item() == 0
    assert all(p.grad is None or (torch.isfinite(p.grad).all() and not p.grad.any()) for p in student.parameters())


def test_train_bf16_accumulated_logs_the_reference_and_each_teacher(tmp_path):
    """One optimizer step of 2 x 2 accumulated micro-batches under bf16 autocast, one teacher of the student's
    tokenizer and one of another: the logged loss is the float64 reference of the same four rows to bf16's rounding
    of the products' inputs (8 bits: ~0.4 % per logit; 2 % bounds it with room), and each teacher logs its figures."""
    student, teachers = _models(torch.float32)
    teachers = {"same": teachers["same"], "char": teachers["char"]}
    rows = [{"prompt": "At dawn, ", "completion": "the fox sees a cat.", "teacher": "same"},
            {"prompt": "The mill ", "completion": "stands by the river.", "teacher": "char"},
            {"prompt": "", "completion": "A heron watches.", "teacher_weights": {"same": 0.5, "char": 0.5}},
            {"prompt": "Night: ", "completion": "owls call twice.", "teacher": "char"}]  # fmt: skip
    tokenizers = {"char": CHAR}
    trainer = _trainer(tmp_path, student, teachers, rows, tokenizers, bf16=True, per_device_train_batch_size=2,
                       gradient_accumulation_steps=2)  # fmt: skip
    with torch.no_grad():
        double = {k: copy.deepcopy(m).double() for k, m in teachers.items()}
        expected = float(_reference(trainer, copy.deepcopy(student).double(), double, rows))
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged[0]["loss"] == pytest.approx(expected, rel=2e-2)
    for name in ("same", "char"):
        assert logged[0][f"kd_soft_loss/{name}"] >= 0 and 0 <= logged[0][f"kd_top1_agreement/{name}"] <= 1
    assert logged[0]["kd_soft_loss"] > 0 and logged[0]["kd_hard_loss"] > 0


def test_refusals_are_clear_one_line_errors(tmp_path):
    student, teachers = _models(torch.float32)
    mixed = {"prompt": "A", "completion": "b c.", "teacher_weights": {"same": 0.5, "char": 0.5}}
    trainer = _trainer(tmp_path, student, teachers, kd_teacher_mixture="distribution")
    with pytest.raises(ValueError, match="not defined across vocabularies; set kd_teacher_mixture='loss'"):
        trainer.data_collator([mixed])
    trainer.data_collator([{**mixed, "teacher_weights": {"same": 0.5, "same2": 0.5}}])  # one tokenizer: a mixture
    with pytest.raises(ValueError, match="kd_teacher_weights .* mixes teachers of different tokenizers"):
        _trainer(tmp_path, student, teachers, kd_teacher_mixture="distribution",
                 kd_teacher_weights={"same": 0.5, "bpe2": 0.5})  # fmt: skip
    for given in (CHAR, {"char": CHAR, "physics": CHAR}):
        with pytest.raises(ValueError, match="give a dict|unknown teacher"):
            _trainer(tmp_path, student, teachers, tokenizers=given)
    with pytest.raises(ValueError, match="kd_teacher_tokenizer=.*give a dict"):
        _trainer(tmp_path, student, teachers, tokenizers=None, kd_teacher_tokenizer="a/path")
    with pytest.raises(ValueError, match="this run has one teacher"):
        _trainer(tmp_path, student, teachers["char"], tokenizers={"char": CHAR})
    with pytest.raises(ValueError, match="processing_class=student_tokenizer"):
        KDTrainer(model=student, teacher_model=teachers, args=_args(tmp_path), teacher_tokenizer=TOKENIZERS)
    token_rows = [{"input_ids": [1, 5, 6, 7], "labels": [1, 5, 6, 7], "teacher": "char"}]
    with pytest.raises(ValueError, match="read each row's text"):
        _trainer(tmp_path, student, teachers, token_rows)
    with pytest.raises(ValueError, match="read each row's text"):
        KDTrainer(model=student, teacher_model=teachers, args=_args(tmp_path), train_dataset=LOSS_ROWS,
                  processing_class=BPE, teacher_tokenizer=TOKENIZERS, data_collator=lambda rows: rows)  # fmt: skip
    trainer = _trainer(tmp_path, student, teachers)
    with pytest.raises(ValueError, match="prompts without a completion"):  # nothing would be scored on them
        require_completions([trainer.data_collator([{"prompt": "At dawn, ", "teacher": "char"}])], trainer.args)
    for extra in ({"teacher_prompt": "Hint: "}, {"teacher_token_ids": [[1]], "teacher_logprobs": [[0.0]]}):
        with pytest.raises(ValueError, match="do not read yet"):
            trainer.data_collator([{**LOSS_ROWS[0], **extra}])
    served = _args(tmp_path, kd_teacher_url={"same": "http://127.0.0.1:9", "char": "http://127.0.0.1:10"})
    with pytest.raises(ValueError, match="served teachers of another tokenizer"):
        KDTrainer(model=student, args=served, processing_class=BPE, teacher_tokenizer={"char": CHAR})


@pytest.mark.parametrize("kind", ["loss", "align"])
def test_row_scale_weighs_each_rows_terms_and_is_checked(kind):
    """Both losses with row_scale equal the sum over rows of each row's own loss times its share (float64)."""
    from liger_patch_kd.align import CrossTokenizerConfig, VocabMap, fused_linear_cross_tokenizer_kd
    from liger_patch_kd.losses import fused_linear_multi_teacher_jsd

    g = torch.Generator().manual_seed(0)
    n, vocab = 12, 30
    h_s = torch.randn(n, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w_s = torch.randn(vocab, 8, generator=g, dtype=torch.float64)
    h_t, w_t = (
        torch.randn(n, 6, generator=g, dtype=torch.float64),
        torch.randn(vocab, 6, generator=g, dtype=torch.float64),
    )
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[[2, 7]] = -100
    scale = torch.rand(n, generator=g, dtype=torch.float64)
    scale[4] = 0.0
    opts = dict(beta=0.3, temperature=2.0, hard_weight=0.4)
    if kind == "loss":
        mix = torch.softmax(torch.randn(n, 2, generator=g, dtype=torch.float64), -1)

        def run(row_scale, reduction="batchmean"):
            return fused_linear_multi_teacher_jsd(h_s, w_s, [h_t, h_t * 0.5], [w_t, w_t], mix, labels,
                                                  row_scale=row_scale, mixture="loss",
                                                  config=KDLossConfig(reduction=reduction, **opts))  # fmt: skip
    else:
        groups = torch.where(labels >= 0, torch.cumsum(labels >= 0, 0) - 1, -1)  # one-to-one groups
        vocab_map = VocabMap.build({str(i): i for i in range(vocab)}, {str(i): i for i in range(vocab)})
        cfg = CrossTokenizerConfig(kind="hybrid", **opts)

        def run(row_scale, reduction="batchmean"):
            return fused_linear_cross_tokenizer_kd(h_s, w_s, h_t, w_t, labels, labels, groups, groups, vocab_map,
                                                   labels >= 0, config=cfg.replace(reduction=reduction),
                                                   row_scale=row_scale)  # fmt: skip

    expected = (run(None, "none") * scale).sum() / (labels >= 0).sum()
    (grad_expected,) = torch.autograd.grad(expected, h_s)
    loss = run(scale)
    (grad,) = torch.autograd.grad(loss, h_s)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, grad_expected, rtol=1e-10, atol=1e-14)
    for bad, match in ((torch.full((n,), -1.0, dtype=torch.float64), "finite and >= 0"), (scale[:5], "row_scale")):
        with pytest.raises(ValueError, match=match):
            run(bad)


def test_teachers_of_other_tokenizers_are_refused_beyond_one_process(tmp_path, monkeypatch):
    """The student's decoder runs outside its forward on this path: under DDP its gradients would not be synced."""
    student, teachers = _models(torch.float32)
    monkeypatch.setattr(KDTrainingArguments, "world_size", property(lambda self: 2))
    with pytest.raises(ValueError, match="run in one process \\(world_size is 2\\)"):
        _trainer(tmp_path, student, teachers)
