"""KDTrainer(model="name or path", teacher_model="name or path"), TRL's convention: loaded with
AutoModelForCausalLM and KDTrainingArguments' model_init_kwargs / teacher_model_init_kwargs (dtype as 'auto', a
torch dtype or its name, under 'dtype' or 'torch_dtype'); bad values are one line when the arguments are made."""

import pytest
import torch

from liger_patch_kd import teacher as TD
from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments

from .tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    from liger_patch_kd.demo import load_corpus
    from liger_patch_kd.demo.cross_tokenizer import train_bpe_tokenizer

    dirs = {}
    for name, seed, dtype in (("student", 1, torch.float32), ("teacher", 3, torch.float64)):
        dirs[name] = tmp_path_factory.mktemp(name)
        tiny_model("llama", dtype=dtype, seed=seed).save_pretrained(dirs[name])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=train_bpe_tokenizer(load_corpus()[:4000], 200),
                                        pad_token="<pad>")  # fmt: skip
    tokenizer.save_pretrained(dirs["student"])
    dirs["vocab"] = tokenizer.get_vocab()
    return dirs


def _args(tmp_path, **overrides):
    return KDTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, report_to="none",
                               use_cpu=True, save_strategy="no", disable_tqdm=True, **overrides)  # fmt: skip


def _rows():
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(1, VOCAB, (6,), generator=g)} for _ in range(4)]


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_models_given_by_path_are_loaded_with_their_init_kwargs(tmp_path, saved, key):
    trainer = KDTrainer(
        model=str(saved["student"]), teacher_model=saved["teacher"], train_dataset=_rows(),
        args=_args(tmp_path, model_init_kwargs={key: "float64"}, teacher_model_init_kwargs={key: torch.float32}),
    )  # fmt: skip
    assert trainer.args.model_init_kwargs == {"dtype": "float64"}  # a name: the arguments still save as JSON
    assert trainer.model.dtype == torch.float64 and trainer.teacher_model.dtype == torch.float32
    want = tiny_model("llama", dtype=torch.float32, seed=1)
    for (name, got), ref in zip(trainer.model.named_parameters(), want.parameters()):
        torch.testing.assert_close(got, ref.double(), rtol=0, atol=0, msg=name)  # the saved weights, cast exactly
    # the tokenizer saved with the student, as TRL loads it
    assert trainer.processing_class is not None and trainer.processing_class.get_vocab() == saved["vocab"]
    trainer.train()
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.state.log_history if "loss" in h)


def test_auto_and_a_teacher_set_of_paths(tmp_path, saved):
    rows = [{**r, "teacher": "ab"[i % 2]} for i, r in enumerate(_rows())]
    trainer = KDTrainer(model=saved["student"], teacher_model={"a": str(saved["teacher"]), "b": saved["teacher"]},
                        train_dataset=rows, data_collator=TD.TeacherDataCollator(),
                        args=_args(tmp_path, teacher_model_init_kwargs='{"dtype": "auto"}'))  # fmt: skip
    assert trainer.model.dtype == torch.float32  # no init kwargs: 'auto', the checkpoint's dtype
    assert {m.dtype for m in trainer.teacher_set.models.values()} == {torch.float64}


def test_bad_names_and_init_kwargs_are_one_line(tmp_path, saved):
    with pytest.raises(ValueError, match=r"model_init_kwargs\['dtype'\] must be 'auto', a torch dtype or its name"):
        _args(tmp_path, model_init_kwargs={"dtype": "bf17"})
    with pytest.raises(ValueError, match="teacher_model_init_kwargs gives both 'dtype' .* and 'torch_dtype'"):
        _args(tmp_path, teacher_model_init_kwargs={"dtype": "auto", "torch_dtype": "bfloat16"})
    with pytest.raises(ValueError, match="model_init_kwargs must be a dict of from_pretrained keyword arguments"):
        _args(tmp_path, model_init_kwargs="bfloat16")
    with pytest.raises(ValueError, match=r"model_init_kwargs=\{'dtype': 'bfloat16'\} is set, but model is already"):
        KDTrainer(model=tiny_model("llama", dtype=torch.float32), teacher_model=str(saved["teacher"]),
                  train_dataset=_rows(), args=_args(tmp_path, model_init_kwargs={"dtype": "bfloat16"}))  # fmt: skip
    with pytest.raises(ValueError, match="teacher_model_init_kwargs=.* no teacher_model is given by name or path"):
        KDTrainer(model=str(saved["student"]), teacher_model=tiny_model("llama", dtype=torch.float32),
                  train_dataset=_rows(), args=_args(tmp_path, teacher_model_init_kwargs={"dtype": "auto"}))  # fmt: skip
    with pytest.raises(ValueError, match=r"teacher_model='.*nowhere': no causal LM loads from there") as e:
        KDTrainer(model=str(saved["student"]), teacher_model=str(tmp_path / "nowhere"), train_dataset=_rows(),
                  args=_args(tmp_path))  # fmt: skip
    assert "\n" not in str(e.value)


def test_a_teacher_path_whose_tokenizer_is_not_the_students_is_refused_before_it_loads(tmp_path, saved, monkeypatch):
    """A teacher given by path comes with its tokenizer: one of another vocabulary of the same size would score
    the student's ids as other tokens with no error anywhere (the vocab_size checks pass). Refused, naming the
    path, a token the two map differently and the fix, before the weights load; across tokenizers it is the
    point."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    other = tmp_path / "other_teacher"
    tiny_model("llama", dtype=torch.float32, seed=3).save_pretrained(other)
    PreTrainedTokenizerFast.from_pretrained(saved["student"]).save_pretrained(other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # one vocabulary size, two tokens swapped
    (other / "tokenizer.json").write_text(json.dumps(spec))
    theirs = AutoTokenizer.from_pretrained(other)
    assert len(theirs) == len(saved["vocab"]) and theirs.get_vocab() != saved["vocab"]
    loads = []
    real = AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loads.append(a) or real(*a, **k))
    for teacher in (str(other), {"a": str(saved["student"]), "b": other}):
        with pytest.raises(ValueError, match=r"teacher_model(\['b'\])?=.*other_teacher.*: its tokenizer \(\d+ tokens\) "
                                             r"is not processing_class's .* kd_teacher_tokenizer="):  # fmt: skip
            KDTrainer(model=str(saved["student"]), teacher_model=teacher, train_dataset=_rows(), args=_args(tmp_path))
    assert loads == []  # said before any weights load
    # the student's own tokenizer saved beside a teacher: accepted
    theirs_too = tmp_path / "same_teacher"
    tiny_model("llama", dtype=torch.float32, seed=3).save_pretrained(theirs_too)
    PreTrainedTokenizerFast.from_pretrained(saved["student"]).save_pretrained(theirs_too)
    KDTrainer(model=str(saved["student"]), teacher_model=str(theirs_too), train_dataset=_rows(), args=_args(tmp_path))
