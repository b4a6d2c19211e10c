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
            TD.TeacherClient(srv.url, top_k=TOP_K, vocab_size=VOCAB, timeout=90, retries=20).wait_until_ready()
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


def _first_batch_loss(trainer) -> tuple[float, int]:
    """compute_loss on the trainer's first batch over its own token count: (the loss, that count)."""
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    count = int((batch["labels"][:, 1:] != -100).sum())
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, dict(batch), num_items_in_batch=torch.tensor(count))
    return float(loss), count


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_a_hidden_teacher_and_a_topk_teacher_in_one_set_are_each_their_own_served_teacher(tmp_path, servers, beta):
    """kd_teacher_protocol={"a": "hidden", "b": "liger"}: the first batch's loss times its token count is teacher
    a's exact loss over a's tokens (one served hidden teacher, b's labels ignored) plus teacher b's top-k loss over
    b's tokens (one served liger teacher, a's labels ignored), each from its own single-teacher run; then it trains."""
    _, running = servers
    urls = {name: srv.url for name, srv in running.items()}
    rows = [{**r, "labels": r["input_ids"].clone()} for r in _rows()]
    options = dict(kd_beta=beta, kd_temperature=2.0)

    def model():
        return tiny_model("llama", dtype=torch.float32, seed=1)

    mixed = KDTrainer(model=model(), args=_args(tmp_path, urls, kd_teacher_protocol={"a": "hidden", "b": "liger"},
                                                **options), train_dataset=rows,
                      data_collator=TD.TeacherDataCollator())  # fmt: skip
    loss, count = _first_batch_loss(mixed)
    parts = 0.0
    for name, protocol in (("a", "hidden"), ("b", "liger")):
        own = [{"input_ids": r["input_ids"], "labels": r["labels"] if r["teacher"] == name else torch.full_like(
            r["labels"], -100)} for r in rows]  # fmt: skip
        single = KDTrainer(model=model(), args=_args(tmp_path, urls[name], kd_teacher_protocol=protocol, **options),
                           train_dataset=own, data_collator=TD.TeacherDataCollator())  # fmt: skip
        part, n = _first_batch_loss(single)
        parts += part * n
        count -= n
    assert count == 0  # the same rows, each token scored in exactly one single-teacher run
    assert loss > 0
    # float32 students, passes summed in another order: float32 rounding of the sums
    assert abs(loss * _first_batch_loss(mixed)[1] - parts) <= 1e-5 * abs(parts)
    mixed.train()
    logged = [h for h in mixed.state.log_history if "loss" in h]
    assert len(logged) == 2 and all(torch.isfinite(torch.tensor([h["loss"] for h in logged])))


def test_per_teacher_protocols_are_checked_with_the_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"kd_teacher_protocol names \['a'\] and kd_teacher_url \['a', 'b'\]"):
        _args(tmp_path, {"a": "http://127.0.0.1:1", "b": "http://127.0.0.1:2"}, kd_teacher_protocol={"a": "hidden"})
    with pytest.raises(ValueError, match=r"kd_teacher_protocol values must be in .*got \{'b': 'grpc'\}"):
        _args(tmp_path, {"a": "http://127.0.0.1:1", "b": "http://127.0.0.1:2"},
              kd_teacher_protocol={"a": "hidden", "b": "grpc"})  # fmt: skip
    with pytest.raises(ValueError, match="kd_teacher_protocol is a dict .* but kd_teacher_url is not"):
        _args(tmp_path, "http://127.0.0.1:1", kd_teacher_protocol={"a": "hidden"})


def test_a_mixed_batch_with_every_label_ignored_is_loss_zero(tmp_path, servers):
    """Every label ignored (num_items_in_batch 0): no kind has a token, one pass still runs, loss 0 and finite
    gradients, as one served teacher gives it."""
    _, running = servers
    urls = {name: srv.url for name, srv in running.items()}
    rows = [{**r, "labels": torch.full_like(r["input_ids"], -100)} for r in _rows()]
    trainer = KDTrainer(model=tiny_model("llama", dtype=torch.float32, seed=1),
                        args=_args(tmp_path, urls, kd_teacher_protocol={"a": "hidden", "b": "liger"}),
                        train_dataset=rows, data_collator=TD.TeacherDataCollator())  # fmt: skip
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    assert batch["teacher_head_set"]  # the batch holds a hidden teacher's rows: the mixed path
    loss = trainer.compute_loss(trainer.model, dict(batch), num_items_in_batch=torch.tensor(0))
    loss.backward()
    assert float(loss) == 0.0
    assert all(torch.isfinite(p.grad).all() for p in trainer.model.parameters() if p.grad is not None)


@pytest.mark.parametrize("protocol", ["hidden", {"a": "hidden", "b": "hidden"}], ids=["one-str", "per-teacher"])
def test_every_served_teacher_hidden_is_the_in_process_teachers_loss(tmp_path, servers, protocol):
    """kd_teacher_protocol="hidden" for every served teacher (one str for all, or a dict): each row is scored by its
    own teacher's hidden states and head, the batch's loss is the in-process teachers' (teacher_model={name: model})
    on the same batch, trainer.evaluate() gives their eval_loss too, and it trains."""
    teachers, running = servers
    urls = {name: srv.url for name, srv in running.items()}
    rows = [{**r, "labels": r["input_ids"].clone()} for r in _rows()]
    options = dict(kd_beta=0.5, kd_temperature=2.0, kd_hard_weight=0.25)

    def trainer(**kw):
        return KDTrainer(model=tiny_model("llama", dtype=torch.float32, seed=1), train_dataset=rows,
                         eval_dataset=rows, data_collator=TD.TeacherDataCollator(), **kw)  # fmt: skip

    served = trainer(args=_args(tmp_path, urls, kd_teacher_protocol=protocol, **options))
    batch = served._prepare_inputs(next(iter(served.get_train_dataloader())))
    assert sorted(batch["teacher_head_set"]) == ["a", "b"] and "teacher_token_ids" not in batch
    in_process = trainer(teacher_model=dict(teachers), args=_args(tmp_path, None, **options))
    count = torch.tensor(int((batch["labels"][:, 1:] != -100).sum()))
    own = {k: v for k, v in batch.items() if k not in ("teacher_hidden_set", "teacher_head_set")}
    with torch.no_grad():
        want = in_process.compute_loss(in_process.model, own, num_items_in_batch=count)
        got = served.compute_loss(served.model, dict(batch), num_items_in_batch=count)
    # float64 teachers; the server's states reach the float32 student as float32 (each sequence in a batch of the
    # server's making): float32 rounding of the states and of the student's sums, ~1e-7 relative
    assert float(want) > 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    want, got = (torch.tensor(t.evaluate()["eval_loss"]) for t in (in_process, served))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    served.train()
    logged = [h for h in served.state.log_history if "loss" in h]
    assert len(logged) == 2 and all(torch.isfinite(torch.tensor([h["loss"] for h in logged])))
