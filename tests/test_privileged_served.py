"""A served teacher for rows with the teacher's own prompt: the prefetcher asks a real `liger-kd serve` about each
teacher sequence (teacher prompt + completion), and the loss pairs its completion positions with the student's,
against the hand reference (teacher logits of teacher_prompt + completion from the float64 model in process,
student logits of prompt + completion, completion positions only), padded left / right and packed, empty
completions, and through KDTrainer.train() with bf16 and gradient accumulation."""

import copy

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import liger_patch_kd.models as M  # noqa: E402
from liger_patch_kd import reference  # noqa: E402
from liger_patch_kd import teacher as TD  # noqa: E402
from liger_patch_kd.batch.prompts import tokenize_prompt_row  # noqa: E402
from liger_patch_kd.trainer import KDTrainer, PrivilegedCollator  # noqa: E402

from .test_onpolicy import tokenizer  # noqa: E402, F401  (the BPE tokenizer fixture)
from .test_privileged import (  # noqa: E402
    TEXT,
    _args,
    _assert_is_the_topk_reference,
    _batch,
    _context_teacher,
    _features,
    _rows,
    _rows_of_batch,
    _topk_reference,
)
from .test_teacher_server import SERVED_ATOL, TOP_K, Server, assert_same_topk  # noqa: E402
from .tiny_models import VOCAB, tiny_model  # noqa: E402

pytestmark = [pytest.mark.usefixtures("clean_patches"), pytest.mark.multiprocess]
KERNELS_OFF = {"rope": False, "swiglu": False, "rms_norm": False}  # float32 kernels off: float64 stays float64


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the float64 context teacher, its server): the server loads the saved float64 weights."""
    teacher, path = _context_teacher(), tmp_path_factory.mktemp("privileged_teacher")
    teacher.save_pretrained(path)
    srv = Server(path).start()
    yield teacher, srv
    srv.stop()


def _served_args(tmp_path, srv, **overrides):
    served = dict(kd_teacher_url=srv.url, kd_teacher_protocol="liger", kd_teacher_top_k=TOP_K,
                  kd_patch_config=KERNELS_OFF)  # fmt: skip
    return _args(tmp_path, **{**served, **overrides})


@pytest.mark.parametrize("use_kd_patch", [True, False], ids=["fused", "materialised"])
@pytest.mark.parametrize("layout", ["right", "left", "packed"])
def test_served_topk_of_the_teachers_rows_is_the_hand_reference(tmp_path, served, layout, use_kd_patch):
    teacher, srv = served
    student = tiny_model("llama", seed=1)  # float64
    if layout == "left":  # eager attention gives NaN on left padding in float64 (see test_privileged)
        student.config._attn_implementation = "sdpa"
    rows = _rows()  # teacher prompt longer, shorter, equal than the student's; one empty completion
    num_items = torch.tensor(sum(len(c) for _, _, c in rows))
    reference_student = copy.deepcopy(student)
    trainer = KDTrainer(model=student, args=_served_args(tmp_path, srv, use_kd_patch=use_kd_patch),
                        train_dataset=_features(rows))  # fmt: skip
    prefetcher = trainer.get_train_dataloader()
    batch = prefetcher.with_teacher(_batch(rows, layout))  # asked about teacher_input_ids
    assert batch["teacher_token_ids"].shape == (*batch["teacher_input_ids"].shape, TOP_K)
    loss = trainer.compute_loss(student, batch, num_items_in_batch=num_items)
    loss.backward()
    # the server sends float32 log-probs, each within SERVED_ATOL of the float64 ones (test_teacher_server)
    _assert_is_the_topk_reference(trainer, loss, student, reference_student, teacher, rows, num_items, TOP_K,
                                  SERVED_ATOL)  # fmt: skip


def test_all_empty_completions_give_zero_and_no_nan(tmp_path, served):
    _, srv = served
    student = tiny_model("llama", seed=1)
    rows = [(s, t, []) for s, t, _ in _rows()]
    trainer = KDTrainer(model=student, args=_served_args(tmp_path, srv), train_dataset=_features(rows))
    batch = trainer.get_train_dataloader().with_teacher(_batch(rows, "right"))
    loss = trainer.compute_loss(student, batch, num_items_in_batch=torch.tensor(0))
    loss.backward()
    assert loss.item() == 0
    assert all(torch.isfinite(p.grad).all() and not p.grad.any() for p in student.parameters() if p.grad is not None)


@pytest.mark.parametrize("rows", ["text", "packed"])
def test_train_with_bf16_and_accumulation_against_the_server(tmp_path, served, tokenizer, rows):  # noqa: F811
    """KDTrainer.train() (bf16 autocast, 2 micro-batches, fused) on text rows, or token rows packed, the teacher
    served: each micro-batch's loss, from the step's starting weights, against the float64 hand reference."""
    teacher, srv = served
    data, collator = [{"prompt": p, "completion": c, "teacher_prompt": t} for p, c, t in TEXT], None
    if rows == "packed":
        data = _features([(*(tokenize_prompt_row(tokenizer, {"prompt": r[k]})[0] for k in ("prompt", "teacher_prompt")),
                           tokenize_prompt_row(tokenizer, r)[1]) for r in data])  # fmt: skip
        collator = PrivilegedCollator(packing=True)
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    start = copy.deepcopy(student).double()
    args = _served_args(tmp_path, srv, bf16=True, gradient_accumulation_steps=2, max_steps=1, kd_hard_weight=0.0)
    trainer = KDTrainer(model=student, processing_class=tokenizer, train_dataset=data, data_collator=collator,
                        args=args)  # fmt: skip
    seen = []
    inner = trainer.compute_loss

    def spy(model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = inner(model, inputs, return_outputs, num_items_in_batch)
        seen.append((copy.deepcopy(dict(inputs)), num_items_in_batch, loss.detach()))
        return loss

    trainer.compute_loss = spy
    trainer.train()
    assert len(seen) == 2 and int(seen[0][1]) == sum(int((b["labels"] != -100).sum()) for b, _, _ in seen)
    for inputs, num_items, loss in seen:
        assert inputs["teacher_token_ids"].shape[:2] == inputs["teacher_input_ids"].shape  # the teacher's rows
        batch_rows = _rows_of_batch(inputs)
        expected, _ = _topk_reference(start, teacher, batch_rows, trainer.kd_config, num_items, TOP_K, SERVED_ATOL)
        # bf16 products through two layers and two heads (as test_privileged's train test: measured 3e-4)
        torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-2, atol=1e-5)
        same_prompt = [(s, s, c) for s, _, c in batch_rows]
        wrong, _ = _topk_reference(start, teacher, same_prompt, trainer.kd_config, num_items, TOP_K, 0)
        assert (wrong - expected).abs() > 2 * (1e-2 * expected.abs() + 1e-5), (wrong, expected)


def test_several_served_teachers_refuse_privileged_rows(tmp_path):
    """Not yet: each row's own server would be asked about its teacher rows; refused before any request, when the
    Trainer is built (its dataloader asks the servers what they serve)."""
    urls = {"a": "http://127.0.0.1:9", "b": "http://127.0.0.1:10"}
    features = [dict(f, teacher="ab"[i % 2]) for i, f in enumerate(_features(_rows()))]
    args = _args(tmp_path, kd_teacher_url=urls, kd_teacher_protocol="liger", kd_teacher_top_k=4)
    with pytest.raises(ValueError, match="teacher_input_ids.*several served teachers"):
        KDTrainer(model=tiny_model("llama", seed=1), train_dataset=features, args=args)


def test_sampled_teacher_tokens_of_the_teachers_rows_are_paired_alike(tmp_path, served):
    """kd_teacher_samples: the server's draws on each teacher row (the same draws for the same sequence and seed),
    gathered into the student's positions, against reference.sampled_kd_loss on each row's own reply."""
    _, srv = served
    student = tiny_model("llama", seed=1)
    rows, m = _rows(), 4
    num_items = torch.tensor(sum(len(c) for _, _, c in rows))
    reference_student = copy.deepcopy(student)
    args = _served_args(tmp_path, srv, kd_teacher_samples=m, kd_teacher_top_k=2, kd_beta=0.0, kd_temperature=1.0,
                        kd_hard_weight=0.0)  # fmt: skip
    trainer = KDTrainer(model=student, args=args, train_dataset=_features(rows))
    batch = trainer.get_train_dataloader().with_teacher(_batch(rows, "packed"))
    loss = trainer.compute_loss(student, batch, num_items_in_batch=num_items)
    loss.backward()
    client = TD.TeacherClient(srv.url, "liger", top_k=2, vocab_size=VOCAB, samples=m, sample_seed=0)
    parts = {k: [] for k in ("s", "ids", "counts", "lp", "top_ids", "top_lp", "targets")}
    for (s, t, c), draws in zip(rows, client.fetch([t + c for s, t, c in rows])):
        if not c:
            continue
        at = slice(len(t) - 1, len(t) + len(c) - 1)
        logits = reference_student(input_ids=torch.tensor([s + c])).logits[0]
        parts["s"].append(logits[len(s) - 1 : len(s) + len(c) - 1])
        for key, value in (("ids", draws.ids), ("counts", draws.counts), ("lp", draws.logprobs),
                           ("top_ids", draws.topk_ids), ("top_lp", draws.topk_logprobs)):  # fmt: skip
            parts[key].append(value[at])
        parts["targets"] += c
    client.close()
    cat = {k: torch.cat(v) if k != "targets" else torch.tensor(v) for k, v in parts.items()}
    expected = reference.sampled_kd_loss(
        cat["s"], cat["ids"].long(), cat["counts"], cat["lp"].double(), cat["targets"], trainer.kd_config, num_items,
        topk_ids=cat["top_ids"].long(), topk_logprobs=cat["top_lp"].double(),
    )  # fmt: skip
    # the same draws and float32 log-probs (the server's batching may move a log-prob by an ulp: SERVED_ATOL)
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-4, atol=1e-6)
    M.revert_kd_patch(model=student)


def test_on_policy_rollouts_with_a_teacher_prompt_are_scored_on_the_teachers_rows(tmp_path, served, tokenizer):  # noqa: F811
    """kd_lmbda=1, prompt rows with a teacher_prompt: the student samples after its own prompt, the server scores
    the same completion after the teacher prompt (each teacher row's top-k is the teacher's own on that row)."""
    teacher, srv = served
    prompts = [{"prompt": p, "teacher_prompt": t} for p, _, t in TEXT]
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    args = _served_args(tmp_path, srv, kd_lmbda=1.0, kd_max_new_tokens=4, max_steps=1, gradient_accumulation_steps=2)
    trainer = KDTrainer(model=student, processing_class=tokenizer, train_dataset=prompts, args=args)
    trainer.get_train_dataloader()  # connects the served teacher
    (batch,) = trainer.onpolicy.replace(
        student, [trainer.data_collator(prompts[:2])], tokenizer=tokenizer, step=0, device=torch.device("cpu"),
        attach_teacher=trainer._served.with_teacher,
    )  # fmt: skip
    for row in range(2):
        keep = batch["teacher_attention_mask"][row].bool()
        seq, labels = batch["teacher_input_ids"][row][keep], batch["teacher_labels"][row][keep]
        assert (labels != -100).any() and not torch.equal(
            seq, batch["input_ids"][row][batch["attention_mask"][row].bool()]
        )
        with torch.no_grad():
            ref = torch.log_softmax(teacher(seq[None]).logits[0].double(), -1)
        ids, values = batch["teacher_token_ids"][row][keep], batch["teacher_logprobs"][row][keep]
        assert_same_topk(ids[:-1], values[:-1], ref[:-1])  # the last position predicts nothing
    trainer.train()
    assert all(torch.isfinite(torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h])))
