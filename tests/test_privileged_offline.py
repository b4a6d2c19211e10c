"""Offline privileged rows: a store precomputed on the teacher's own sequences (teacher prompt + completion),
joined with the student's rows (teacher.JoinedTeacherData), trains the student on its own prompts; against the
hand reference (the float64 teacher's top-k of its own rows, the student's logits of its own, completion
positions only), padded and packed, fused and materialised, and through train() with bf16 and accumulation."""

import copy

import pytest
import torch

from liger_patch_kd import teacher as TD
from liger_patch_kd.batch.prompts import PromptCollator, privileged_token_rows
from liger_patch_kd.trainer import KDTrainer, PrivilegedCollator

from .test_onpolicy import tokenizer  # noqa: F401  (the BPE tokenizer fixture)
from .test_privileged import (
    TEXT,
    _args,
    _assert_is_the_topk_reference,
    _context_teacher,
    _features,
    _rows,
    _rows_of_batch,
    _topk_reference,
)
from .tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")
K = 16
# precompute takes log_softmax of float32 logits and stores float32: each value within a few float32 ulps of the
# float64 one (|log-prob| < 32 here: ulp <= 4e-6)
STORE_ATOL = 1e-5
KERNELS_OFF = {"rope": False, "swiglu": False, "rms_norm": False}  # float32 kernels off: float64 stays float64


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """(the float64 context teacher, the rows, their store precomputed on teacher_input_ids)."""
    teacher, rows = _context_teacher(), _rows()
    features = _features(rows)
    path = tmp_path_factory.mktemp("privileged_store")
    TD.precompute(teacher, [f["teacher_input_ids"] for f in features], path, top_k=K, logprob_dtype="float32",
                  progress=False)  # fmt: skip
    return teacher, rows, TD.TeacherLogprobsDataset(path)


@pytest.mark.parametrize("use_kd_patch", [True, False], ids=["fused", "materialised"])
@pytest.mark.parametrize("layout", ["right", "packed"])
def test_a_store_of_the_teachers_rows_trains_the_student_on_its_own(tmp_path, store, layout, use_kd_patch):
    teacher, rows, data = store
    student = tiny_model("llama", seed=1)  # float64
    reference_student = copy.deepcopy(student)
    joined = TD.JoinedTeacherData(_features(rows), data)
    num_items = torch.tensor(sum(len(c) for _, _, c in rows))
    trainer = KDTrainer(model=student, args=_args(tmp_path, use_kd_patch=use_kd_patch, kd_patch_config=KERNELS_OFF),
                        train_dataset=joined)  # fmt: skip
    batch = PrivilegedCollator(packing=layout == "packed")([joined[i] for i in range(len(joined))])
    loss = trainer.compute_loss(student, batch, num_items_in_batch=num_items)
    loss.backward()
    # the stored values are each within STORE_ATOL of the float64 log-probs
    _assert_is_the_topk_reference(trainer, loss, student, reference_student, teacher, rows, num_items, K, STORE_ATOL)


def test_train_with_bf16_and_accumulation_from_the_store(tmp_path, store):
    teacher, rows, data = store
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    start = copy.deepcopy(student).double()
    joined = TD.JoinedTeacherData(_features(rows), data)
    args = _args(tmp_path, bf16=True, gradient_accumulation_steps=2, max_steps=1, kd_hard_weight=0.0)
    trainer = KDTrainer(model=student, args=args, train_dataset=joined)  # no teacher_model: the store
    seen, inner = [], trainer.compute_loss

    def spy(model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = inner(model, inputs, return_outputs, num_items_in_batch)
        seen.append((copy.deepcopy(dict(inputs)), num_items_in_batch, loss.detach()))
        return loss

    trainer.compute_loss = spy
    trainer.train()
    assert len(seen) == 2
    for inputs, num_items, loss in seen:
        batch_rows = _rows_of_batch(inputs)
        expected, _ = _topk_reference(start, teacher, batch_rows, trainer.kd_config, num_items, K, STORE_ATOL)
        # bf16 products through two layers and a head (as test_privileged's train test)
        torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-2, atol=1e-5)


def test_a_store_of_other_sequences_is_refused_naming_the_row(store):
    _, rows, data = store
    features = _features(rows)
    with pytest.raises(ValueError, match="4 rows but the store holds 3"):
        TD.JoinedTeacherData(features[:3] + features[:1], torch.utils.data.Subset(data, range(3)))
    swapped = [features[1], features[0], *features[2:]]
    with pytest.raises(ValueError, match="row 0: the store's sequence 0"):
        TD.JoinedTeacherData(swapped, data)[0]


def test_text_rows_become_the_token_rows_training_collates(tmp_path, tokenizer):  # noqa: F811
    """privileged_token_rows tokenizes as PromptCollator does: collating its rows gives the very batch the text
    rows give (so a store precomputed on their teacher_input_ids is the teacher's on what training reads); a text
    store trains through JoinedTeacherData."""
    text = [{"prompt": p, "completion": c, "teacher_prompt": t} for p, c, t in TEXT]
    rows = privileged_token_rows(tokenizer, text)
    from_text = PromptCollator(tokenizer)(text)
    from_rows = PrivilegedCollator(pad_token_id=tokenizer.pad_token_id)(rows)
    for key, value in from_rows.items():
        assert torch.equal(value, from_text[key]), key
    teacher = _context_teacher(torch.float32)
    TD.precompute(teacher, [r["teacher_input_ids"] for r in rows], tmp_path / "s", top_k=K, progress=False)
    data = TD.JoinedTeacherData(rows, TD.TeacherLogprobsDataset(tmp_path / "s"))
    KDTrainer(model=tiny_model("llama", dtype=torch.float32, seed=1), args=_args(tmp_path, max_steps=1),
              train_dataset=data).train()  # fmt: skip
    with pytest.raises(ValueError, match="row 0 needs a 'teacher_prompt'"):
        privileged_token_rows(tokenizer, [{"prompt": "the", "completion": " cat"}])


def test_a_joined_sampled_store_is_checked_against_its_own_draw_temperature(tmp_path):
    """JoinedTeacherData passes the store's metadata on: tokens drawn at T=2 train at kd_temperature=2, and the
    default T=1 is refused (before, the join hid the metadata: T=2 was refused as unknown and T=1 trained on draws
    of another temperature)."""
    teacher, rows = _context_teacher(torch.float32), _rows()
    features = _features(rows)
    TD.precompute(teacher, [f["teacher_input_ids"] for f in features], tmp_path / "s", top_k=4, temperature=2.0,
                  samples=4, progress=False)  # fmt: skip
    store = TD.TeacherLogprobsDataset(tmp_path / "s")
    joined = TD.JoinedTeacherData(features, store)
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    for data in (joined, TD.JoinedTeacherData(features, torch.utils.data.Subset(store, range(len(store))))):
        with pytest.raises(ValueError, match="kd_temperature=1.0 but the store's teacher tokens were drawn at .*2.0"):
            KDTrainer(model=student, args=_args(tmp_path, kd_beta=0.0, kd_temperature=1.0), train_dataset=data)
    KDTrainer(model=student, args=_args(tmp_path, kd_beta=0.0, kd_temperature=2.0), train_dataset=joined)
