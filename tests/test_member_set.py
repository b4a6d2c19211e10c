"""A run's teacher set is one MemberSet over members built as each kind alone is (plan.py's KINDS); a member of
another tokenizer is a wrapper, refused in one line at resolve time around a kind whose signal cannot be aligned."""

import pytest
import torch

from liger_patch_kd import teacher as TD
from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments
from liger_patch_kd.trainer.teachers.in_process import InProcessTeacher
from liger_patch_kd.trainer.teachers.member_set import MemberSet
from liger_patch_kd.trainer.teachers.routes import TeacherRoutes
from liger_patch_kd.trainer.teachers.served import ServedTeacher
from liger_patch_kd.trainer.teachers.served_hidden import ServedHiddenTeacher
from liger_patch_kd.trainer.teachers.stored import StoredTeacher

from .tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")


def _args(tmp_path, **overrides):
    base = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=1, report_to="none",
        use_cpu=True, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    return KDTrainingArguments(**{**base, **overrides})


def _rows(extra=lambda i, ids: {}, n=2):
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        ids = torch.randint(1, VOCAB, (8,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone(), **extra(i, ids)})
    return rows


def _student():
    return tiny_model("llama", dtype=torch.float32, seed=1)


def test_in_process_members_are_the_in_process_kind(tmp_path):
    teachers = {"a": tiny_model("llama", dtype=torch.float32, seed=2), "b": tiny_model("llama", seed=3)}
    rows = _rows(lambda i, ids: {"teacher": "ab"[i % 2]})
    trainer = KDTrainer(model=_student(), teacher_model=teachers, args=_args(tmp_path), train_dataset=rows,
                        data_collator=TD.TeacherDataCollator())  # fmt: skip
    source = trainer.teacher_source
    assert isinstance(source, MemberSet) and source is trainer.teacher_set
    assert all(type(m) is InProcessTeacher for m in source.members.values())
    assert source.models == {name: m.model for name, m in source.members.items()} and not source.from_rows


def test_stored_rows_naming_their_teacher_are_stored_members(tmp_path):
    topk = lambda i, ids: {"teacher": "xy"[i % 2], "teacher_token_ids": torch.zeros(len(ids), 2, dtype=torch.long),  # noqa: E731
                           "teacher_logprobs": torch.full((len(ids), 2), -0.7)}  # fmt: skip
    trainer = KDTrainer(model=_student(), args=_args(tmp_path), train_dataset=_rows(topk),
                        data_collator=TD.TeacherDataCollator())  # fmt: skip
    source = trainer.teacher_source
    assert isinstance(source, MemberSet) and source.names == ("x", "y") and source.models is None
    assert all(type(m) is StoredTeacher for m in source.members.values()) and source.from_rows


def test_served_members_take_their_own_protocol(tmp_path):
    """No server is asked before the first DataLoader: the members are built from their own url and protocol."""
    urls = {"h": "http://127.0.0.1:9", "t": "http://127.0.0.1:10"}
    args = _args(tmp_path, kd_teacher_url=urls, kd_teacher_protocol={"h": "hidden", "t": "liger"})
    trainer = KDTrainer(model=_student(), args=args, train_dataset=_rows(lambda i, ids: {"teacher": "ht"[i % 2]}),
                        data_collator=TD.TeacherDataCollator())  # fmt: skip
    members = trainer.teacher_source.members
    assert type(members["h"]) is ServedHiddenTeacher and members["h"].url == urls["h"]
    assert type(members["t"]) is ServedTeacher and (members["t"].url, members["t"].protocol) == (urls["t"], "liger")


def test_a_set_of_members_in_process_and_in_the_rows_is_refused(tmp_path):
    routes = TeacherRoutes(["a", "b"], _args(tmp_path))
    members = {"a": InProcessTeacher(tiny_model("llama", seed=2), True), "b": StoredTeacher(True)}
    with pytest.raises(ValueError, match=r"mixes members in process \['a'\].*\['b'\]"):
        MemberSet(routes, members, True)


@pytest.mark.parametrize(
    "overrides,kind",
    [
        (dict(kd_teacher_url="http://127.0.0.1:9", kd_teacher_protocol="hidden"), "served hidden"),
        (dict(kd_self_distill="frozen"), "self"),
    ],
)
def test_another_tokenizer_wraps_only_what_it_can_align(tmp_path, overrides, kind):
    with pytest.raises(ValueError, match=f"teacher_tokenizer.*wraps a teacher in process.*'{kind}'"):
        KDTrainer(model=_student(), args=_args(tmp_path, **overrides), train_dataset=_rows(),
                  teacher_tokenizer=object())  # fmt: skip
