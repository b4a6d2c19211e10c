"""Several served teachers: kd_teacher_url={"a": url1, "b": url2} against two real `liger-kd serve` processes,
each row asked of its own teacher and trained as offline data."""

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from liger_patch_kd import teacher as TD  # noqa: E402
from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments  # noqa: E402

from .test_teacher_server import TOP_K, Server, assert_same_topk  # noqa: E402
from .tiny_models import VOCAB, tiny_model  # noqa: E402

pytestmark = [pytest.mark.usefixtures("clean_patches"), pytest.mark.multiprocess]


def _teacher(seed):
    model = tiny_model("llama", seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # far from uniform, so the two teachers' top-k differ
    return model


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    teachers, running = {}, {}
    try:
        for name, seed in (("a", 3), ("b", 4)):
            path = tmp_path_factory.mktemp(f"teacher_{name}")
            teachers[name] = _teacher(seed)
            teachers[name].save_pretrained(path)
            running[name] = Server(path).start(wait=False)
        for srv in running.values():
            TD.TeacherClient(srv.url, top_k=TOP_K, vocab_size=VOCAB, timeout=90).wait_until_ready()
        yield teachers, running
    finally:
        for srv in running.values():
            srv.stop()


def _rows(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(1, VOCAB, (int(torch.randint(5, 11, (1,), generator=g)),), generator=g),
         "teacher": "ab"[i % 3 == 0]}
        for i in range(n)
    ]  # fmt: skip


def _args(tmp_path, urls, **overrides):
    base = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=2, learning_rate=1e-3,
        logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
        dataloader_num_workers=0, use_kd_patch=True, kd_teacher_url=urls, kd_teacher_protocol="liger",
        kd_teacher_top_k=TOP_K, kd_patch_config={"rope": False, "swiglu": False, "rms_norm": False},
    )  # fmt: skip
    return KDTrainingArguments(**{**base, **overrides})


def test_each_row_gets_its_own_served_teachers_topk_and_trains(tmp_path, servers):
    teachers, running = servers
    urls = {name: srv.url for name, srv in running.items()}
    rows = _rows()
    trainer = KDTrainer(model=tiny_model("llama", dtype=torch.float32, seed=1), args=_args(tmp_path, urls),
                        train_dataset=rows, data_collator=TD.TeacherDataCollator())  # fmt: skip
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["teacher_mixture"].sum(-1).eq(1).all()  # kept for the per-teacher figures
    by_ids = {tuple(r["input_ids"].tolist()): r["teacher"] for r in rows}
    seen = set()
    for row in range(batch["input_ids"].shape[0]):
        n = int(batch["attention_mask"][row].sum())
        ids = batch["input_ids"][row, :n]
        name = by_ids[tuple(ids.tolist())]
        seen.add(name)
        with torch.no_grad():
            ref = torch.log_softmax(teachers[name](input_ids=ids[None]).logits[0].float(), -1).double()
        # the last position predicts nothing: no teacher row there (id -1), as with one served teacher
        assert_same_topk(batch["teacher_token_ids"][row, : n - 1], batch["teacher_logprobs"][row, : n - 1], ref[:-1])
        assert (batch["teacher_token_ids"][row, n - 1 :] == -1).all()
    assert seen == {"a", "b"}  # the batch mixes both teachers
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2 and all(torch.isfinite(torch.tensor([h["loss"] for h in logged])))
    for name in ("a", "b"):  # each served teacher's own rows: one no-grad forward per teacher on logging steps
        assert logged[0][f"kd_soft_loss/{name}"] > 0 and 0 <= logged[0][f"kd_top1_agreement/{name}"] <= 1


def test_a_row_mixing_served_teachers_is_refused(tmp_path, servers):
    _, running = servers
    urls = {name: srv.url for name, srv in running.items()}
    rows = [{**r, "teacher": None, "teacher_weights": {"a": 0.5, "b": 0.5}} for r in _rows(4)]
    for r in rows:
        r.pop("teacher")
    trainer = KDTrainer(model=tiny_model("llama", dtype=torch.float32, seed=1), args=_args(tmp_path, urls),
                        train_dataset=rows, data_collator=TD.TeacherDataCollator())  # fmt: skip
    with pytest.raises(ValueError, match="weighs several served teachers"):
        next(iter(trainer.get_train_dataloader()))
