"""On-policy faults, each through KDTrainer.train() as users run it: packed prompts all rolled out, a
resumed kd_lmbda mix on its schedule, prompts past the generator's context refused before generation, decoding in
the weights' dtype under mixed precision (static and dynamic cache); and one-line errors for an empty dataset,
teacher ids past the teacher's vocabulary and a negative num_items_in_batch tensor."""

from types import MethodType

import pytest
import torch

from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments
from liger_patch_kd.trainer.rollouts.generate import RolloutSettings, generate_rollouts, prompts_of

from .tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")

PROMPTS = ([5, 6, 7], [8, 9], [10, 11, 12, 13], [14])  # four prompts of different lengths


def _args(out, **overrides):
    base = dict(
        output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=1, max_steps=1,
        learning_rate=1e-3, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
        seed=0, dataloader_num_workers=0, use_kd_patch=True, kd_lmbda=1.0, kd_max_new_tokens=4,
        remove_unused_columns=False,
    )  # fmt: skip
    return KDTrainingArguments(**{**base, **overrides})


def _pair(dtype=torch.float32, hidden=32):
    return (tiny_model("llama", dtype=dtype, seed=1, hidden=hidden),
            tiny_model("llama", dtype=dtype, seed=2, hidden=hidden))  # fmt: skip


def _recording(trainer):
    """Wrap the trainer's rollout source: each generated step's (step, prompts) is recorded."""
    calls, source = [], trainer.onpolicy.source

    def recorded(generator, prompts, settings, **kw):
        calls.append((kw["step"], [list(p) for p in prompts]))
        return source(generator, prompts, settings, **kw)

    trainer.onpolicy.source = recorded
    return calls


# ------------------------------------------------------------------------------------- packed prompts (item 3)
def _train_prompts(out, collator):
    student, teacher = _pair()
    rows = [{"input_ids": p, "labels": [-100] * len(p)} for p in PROMPTS]
    trainer = KDTrainer(model=student, teacher_model=teacher, args=_args(out), train_dataset=rows,
                        data_collator=collator)  # fmt: skip
    calls = _recording(trainer)
    trainer.train()
    return calls, trainer.state.log_history[0]["loss"], student


def test_packed_prompts_are_each_rolled_out_and_train_as_unpacked(tmp_path):
    """DataCollatorWithFlattening packs the step's four prompts into one row: every one is rolled out (it was only
    the first), and the step trains exactly as the same prompts padded (the reference)."""
    from transformers import DataCollatorWithFlattening

    packed_calls, packed_loss, packed = _train_prompts(tmp_path / "packed", DataCollatorWithFlattening())
    plain_calls, plain_loss, plain = _train_prompts(tmp_path / "plain", None)
    assert len(packed_calls) == 1 and len(packed_calls[0][1]) == 4, packed_calls
    assert sorted(map(tuple, packed_calls[0][1])) == sorted(map(tuple, PROMPTS))
    assert packed_calls == plain_calls  # the same prompts in the same order: the same rollouts
    assert packed_loss == plain_loss
    for a, b in zip(packed.parameters(), plain.parameters()):
        assert torch.equal(a, b)


def test_prompts_of_splits_packed_rows_and_keeps_padded_ones():
    """Each packed sequence's prompt (its tokens before its first scored label), in order; padded rows as before."""
    packed = {"input_ids": torch.tensor([[5, 6, 7, 20, 8, 9, 21, 22, 14]]),
              "labels": torch.tensor([[-100, -100, -100, 20, -100, -100, 21, 22, -100]]),
              "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 0]])}  # fmt: skip
    assert prompts_of(packed) == [[5, 6, 7], [8, 9], [14]]
    padded = {"input_ids": torch.tensor([[5, 6, 20, 0], [8, 9, 10, 21]]),
              "labels": torch.tensor([[-100, -100, 20, -100], [-100, -100, -100, 21]]),
              "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])}  # fmt: skip
    assert prompts_of(padded) == [[5, 6], [8, 9, 10]]


def _prompts_by_tensors(batch, ignore_index=-100):
    """prompts_of written with tensor ops row by row (its earlier form): the reference of the list version."""
    out = []
    for row in range(batch["input_ids"].shape[0]):
        mask = batch.get("attention_mask")
        keep = mask[row].bool() if mask is not None else torch.ones_like(batch["input_ids"][row], dtype=torch.bool)
        ids, lab = batch["input_ids"][row][keep], batch["labels"][row][keep]
        positions = batch.get("position_ids")
        starts = [0] if positions is None else (positions[row][keep] == 0).nonzero().flatten().tolist()
        starts = starts if starts[:1] == [0] else [0, *starts]
        for begin, end in zip(starts, [*starts[1:], len(ids)]):
            scored = (lab[begin:end] != ignore_index).nonzero()
            out.append(ids[begin : begin + (int(scored[0]) if len(scored) else end - begin)].tolist())
    return out


@pytest.mark.parametrize("seed", range(6))
def test_prompts_of_equals_the_row_by_row_tensor_reading(seed):
    """Random batches: left and right padding (float and int masks), rows scored nowhere, packed rows with
    position ids, one not starting at position 0."""
    g = torch.Generator().manual_seed(seed)
    rows, width = 5, 12
    ids = torch.randint(3, 50, (rows, width), generator=g)
    labels = torch.where(torch.rand(rows, width, generator=g) < 0.3, ids, torch.full_like(ids, -100))
    labels[0] = -100  # scored nowhere: the whole row is its prompt
    batch = {"input_ids": ids, "labels": labels}
    if seed % 3 != 2:
        mask = (torch.rand(rows, width, generator=g) < 0.8).long()
        mask[1, :4] = 0  # left padding
        batch["attention_mask"] = mask.float() if seed % 2 else mask
    if seed % 3 != 0:
        positions = torch.cat([torch.arange(5), torch.arange(7)]).repeat(rows, 1)
        positions[2] += 1  # a row that does not start at position 0
        batch["position_ids"] = positions
    assert prompts_of(batch) == _prompts_by_tensors(batch)
    unpacked = {k: v for k, v in batch.items() if k != "position_ids"}  # one sequence a row: the array path
    assert prompts_of(unpacked) == _prompts_by_tensors(unpacked)
    bare = {"input_ids": ids, "labels": labels}  # no mask either
    assert prompts_of(bare) == _prompts_by_tensors(bare)


# ----------------------------------------------------------------------------- a resumed schedule (item 6)
def _mix_rows():
    return [{"input_ids": [5 + i, 6, 7, 30, 31], "labels": [-100, -100, -100, 30, 31]} for i in range(8)]


def _train_mix(out, max_steps, resume=None, **over):
    student, teacher = _pair()
    args = _args(out, kd_lmbda=0.5, max_steps=max_steps, per_device_train_batch_size=2, **over)
    trainer = KDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=_mix_rows())
    calls = _recording(trainer)
    trainer.train(resume_from_checkpoint=resume)
    return {step for step, _ in calls}


def test_a_resumed_kd_lmbda_mix_generates_the_same_steps(tmp_path):
    """8 steps in one run, or 4, a checkpoint, and a resumed run to 8: the same steps generate (the schedule is a
    function of (seed, step); its stream used to restart at the seed on resume)."""
    whole = _train_mix(tmp_path / "whole", 8)
    first = _train_mix(tmp_path / "split", 4, save_strategy="steps", save_steps=4)
    rest = _train_mix(tmp_path / "split", 8, resume=str(tmp_path / "split" / "checkpoint-4"))
    assert 0 < len(whole) < 8, whole  # a mix
    assert first | rest == whole and all(s < 4 for s in first) and all(s >= 4 for s in rest)


# --------------------------------------------------------------------------- prompts past the context (item 13)
def test_in_process_rollouts_refuse_a_prompt_past_the_context(tmp_path):
    """A 20-token prompt + 4 new tokens on a 16-position generator: one line naming the lengths and the fix,
    before any generation (it used to train silently)."""
    student, teacher = _pair()
    student.config.max_position_embeddings = 16
    rows = [{"input_ids": list(range(3, 23)), "labels": [-100] * 20}] * 4
    trainer = KDTrainer(model=student, teacher_model=teacher, args=_args(tmp_path), train_dataset=rows)
    calls = _recording(trainer)
    match = r"20 tokens \+ kd_max_new_tokens 4 = 24, more than .*max_position_embeddings 16.*kd_max_prompt_length <= 12"
    with pytest.raises(ValueError, match=match):
        trainer.train()
    assert calls == []  # refused before the source was asked
    with pytest.raises(ValueError, match="kd_max_new_tokens below 16"):
        generate_rollouts(student, [[3]], RolloutSettings(max_new_tokens=16), pad_id=0, eos_ids=set(), start_id=1)


# ---------------------------------------------------------------------- decoding under mixed precision (item 15)
@pytest.fixture
def cache_dtypes(monkeypatch):
    """Every (key, value) dtype a KV cache layer is given; the static layer allocates the values in the keys'
    dtype, as transformers 5.17 (the H200's) does, so a step whose keys and values differ fails as it does there."""
    from transformers.cache_utils import DynamicLayer, StaticLayer

    seen = []
    for layer in (DynamicLayer, StaticLayer):
        update = layer.update

        def recorded(self, key, value, *args, _update=update, **kwargs):
            seen.append((key.dtype, value.dtype))
            return _update(self, key, value, *args, **kwargs)

        monkeypatch.setattr(layer, "update", recorded)
    initialise = StaticLayer.lazy_initialization

    def as_in_5_17(self, key_states, value_states, *args, **kwargs):
        initialise(self, key_states, value_states, *args, **kwargs)
        self.values = torch.zeros_like(self.values, dtype=key_states.dtype)

    monkeypatch.setattr(StaticLayer, "lazy_initialization", as_in_5_17)
    return seen


@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
def test_rollouts_decode_in_the_weights_dtype_under_bf16_autocast(tmp_path, cache_dtypes, cache, weights):
    """bf16=True (accelerate's autocast around the forward) with fp32 weights: Llama's keys came out fp32 (RoPE's
    fp32 cos / sin) and its values bf16, and the static cache, allocated in the keys' dtype, refused the values
    (`index_copy_(): ... Float and BFloat16` on the H200). The static cache decodes in the weights' dtype: every
    key and value has it; bf16 weights likewise; the dynamic cache trains as before."""
    student, teacher = _pair(weights)
    rows = [{"input_ids": p, "labels": [-100] * len(p)} for p in PROMPTS]
    args = _args(tmp_path, bf16=True, kd_generation_cache=cache)
    trainer = KDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=rows)
    calls = _recording(trainer)
    trainer.train()
    assert len(calls) == 1 and torch.isfinite(torch.tensor(trainer.state.log_history[0]["loss"]))
    if cache == "static":  # the dynamic cache holds what autocast gives (keys fp32, values bf16 here)
        assert cache_dtypes and set(cache_dtypes) == {(weights, weights)}, set(cache_dtypes)


def test_generate_rollouts_under_an_autocast_wrapper_matches_the_plain_model(cache_dtypes):
    """A forward wrapped as accelerate's prepare_model wraps it (autocast inside, the original kept on the model)
    samples what the plain fp32 model samples, with fp32 keys and values in the static cache."""
    from accelerate.utils import convert_outputs_to_fp32

    plain, wrapped = tiny_model("llama", dtype=torch.float32, seed=1), tiny_model("llama", dtype=torch.float32, seed=1)
    wrapped._original_forward = wrapped.forward
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    wrapped.forward = MethodType(convert_outputs_to_fp32(autocast(type(wrapped).forward)), wrapped)
    settings, kw = RolloutSettings(max_new_tokens=5, cache="static", seed=3), dict(pad_id=0, eos_ids=set(), start_id=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a caller's own autocast changes nothing either
        got = generate_rollouts(wrapped, [[5, 6, 7], [8]], settings, **kw)
    assert got == generate_rollouts(plain, [[5, 6, 7], [8]], settings, **kw)
    assert set(cache_dtypes) == {(torch.float32, torch.float32)}
    assert wrapped.forward.__func__ is not type(wrapped).forward  # the wrapper is back in place


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cache", ["static", "dynamic", "graph"])
@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
def test_on_policy_training_on_a_gpu_with_bf16(tmp_path, cache, weights):
    """The README's on-policy setup on CUDA: bf16=True with fp32 weights (the usual mixed precision) or bf16
    weights, transformers' static cache (compiled decode step), its dynamic one and the captured decode step
    (graph), through KDTrainer.train()."""
    from transformers.cache_utils import DynamicLayer, StaticLayer

    student, teacher = (m.cuda() for m in _pair(weights, hidden=64))
    if cache == "graph":  # the engine builds SDPA's masks (the tiny models default to eager; 'graph' refuses those)
        student.set_attn_implementation("sdpa")
    rows = [{"input_ids": p, "labels": [-100] * len(p)} for p in PROMPTS] * 2
    args = _args(tmp_path, bf16=True, use_cpu=False, kd_generation_cache=cache, max_steps=2, kd_max_new_tokens=8)
    trainer = KDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=rows)
    calls = _recording(trainer)
    layers = StaticLayer if cache == "static" else DynamicLayer  # (graph: its own SlotCache, not recorded)
    update, seen = layers.update, []

    def recorded(self, key, value, *a, **k):
        seen.append((key.dtype, value.dtype))
        return update(self, key, value, *a, **k)

    layers.update = recorded
    try:
        trainer.train()
    finally:
        layers.update = update
    assert len(calls) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.state.log_history[:2])
    if cache == "static":  # in the weights' dtype (trainer/decode.weights_precision)
        assert seen and set(seen) == {(weights, weights)}, set(seen)


# ------------------------------------------------------------------------------------ one-line errors (item 14)
def test_an_empty_dataset_is_refused_by_name(tmp_path):
    student, teacher = _pair()
    with pytest.raises(ValueError, match="train_dataset has 0 rows"):
        KDTrainer(model=student, teacher_model=teacher, args=_args(tmp_path, kd_lmbda=0.0), train_dataset=[])


def test_teacher_ids_past_the_teachers_vocabulary_are_refused_by_name(tmp_path):
    """A teacher_input_ids id past the teacher's embedding: one line with the max id, the vocabulary and the fix
    (it was an IndexError from the embedding; on a GPU a device-side assert)."""
    student, teacher = _pair()
    completion = [30, 31]
    rows = [{"input_ids": [5, 6] + completion, "labels": [-100, -100] + completion,
             "teacher_input_ids": [9, VOCAB + 5] + completion, "teacher_labels": [-100, -100] + completion}] * 4
    trainer = KDTrainer(model=student, teacher_model=teacher, args=_args(tmp_path, kd_lmbda=0.0), train_dataset=rows)
    match = rf"teacher_input_ids hold 4 id\(s\) outside the teacher's vocabulary \[0, {VOCAB}\) \(max id {VOCAB + 5}"
    with pytest.raises(ValueError, match=match):
        trainer.train()


@pytest.mark.parametrize("count", [-3, torch.tensor(-3)], ids=["int", "tensor"])
def test_a_negative_num_items_in_batch_is_refused_as_a_tensor_too(count):
    from liger_patch_kd.align.config import check_num_items as align_check
    from liger_patch_kd.losses import fused_linear_jsd

    h, w = torch.randn(6, 8, dtype=torch.float64), torch.randn(11, 8, dtype=torch.float64)
    labels = torch.tensor([1, 2, -100, 3, 4, 5])
    with pytest.raises(ValueError, match="num_items_in_batch must be a count >= 0"):
        fused_linear_jsd(h, w, h, w, labels, num_items_in_batch=count)
    with pytest.raises(ValueError, match="num_items_in_batch must be a count >= 0"):
        align_check(count)
    fused_linear_jsd(h, w, h, w, labels, num_items_in_batch=torch.tensor(5))  # a count is fine


def test_teacher_ids_past_the_vocabulary_across_tokenizers_are_refused_by_name():
    """Across tokenizers the teacher reads its own tokenizer's ids: one past its embedding is named too."""
    from liger_patch_kd.align import CrossTokenizerCollator, CrossTokenizerConfig, VocabMap, byte_level_to_text
    from liger_patch_kd.demo import BOS, load_corpus
    from liger_patch_kd.demo import build_model as build
    from liger_patch_kd.demo.cross_tokenizer import CharTokenizerWithOffsets, train_bpe_tokenizer
    from liger_patch_kd.trainer.teachers.other_tokenizer import compute_cross_tokenizer_loss

    char, bpe = CharTokenizerWithOffsets(load_corpus()), train_bpe_tokenizer(load_corpus()[:4000], 300)
    student, teacher = build(bpe.get_vocab_size(), 32, 1, seed=0, device="cpu"), build(len(char), 32, 1, 1, "cpu")
    collator = CrossTokenizerCollator(bpe, char, student_prefix_ids=(BOS,), teacher_prefix_ids=(BOS,))
    batch = collator([{"prompt": "At dawn, ", "completion": "the fox sees a cat."}])
    batch["teacher_input_ids"][0, 1] = len(char) + 2
    vocab_map = VocabMap.build(bpe, char, normalize=byte_level_to_text)
    match = rf"outside the teacher's vocabulary \[0, {len(char)}\) \(max id {len(char) + 2}"
    with pytest.raises(ValueError, match=match):
        compute_cross_tokenizer_loss(student, teacher, batch, CrossTokenizerConfig(), vocab_map)


def test_packed_privileged_rows_give_each_sequence_its_prompt_and_teacher_prompt(tmp_path):
    """PrivilegedCollator(packing=True): the student's and the teacher's packed rows are each split at their own
    position ids, so a generated step asks for every sequence, with its own teacher prompt."""
    from liger_patch_kd.batch.privileged import PrivilegedCollator
    from liger_patch_kd.trainer.rollouts.onpolicy import OnPolicySteps

    rows = [{"input_ids": [3, 4, 5], "labels": [-100, -100, 5], "teacher_input_ids": [1, 2, 3, 4, 5]},
            {"input_ids": [6, 4], "labels": [-100, 4], "teacher_input_ids": [2, 6, 4]},
            {"input_ids": [7, 8, 9, 10], "labels": [-100, -100, 9, 10], "teacher_input_ids": [11, 9, 10]}]  # fmt: skip
    batch = PrivilegedCollator(packing=True)(rows)
    assert batch["input_ids"].shape[0] == 1  # one packed row per side
    plan = OnPolicySteps(_args(tmp_path)).plan(tiny_model("llama", dtype=torch.float32), [batch], None)
    assert plan.prompts == [[[3, 4], [6], [7, 8]]]
    assert plan.teacher_prompts == [[[1, 2, 3, 4], [2, 6], [11]]]


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
def test_on_policy_training_with_the_captured_step_under_bf16_autocast_on_cpu(tmp_path, weights):
    """The decode engine's path (kd_generation_cache='graph', eager on a CPU) through KDTrainer.train() with bf16=True:
    fp32 weights under bf16 autocast and bf16 weights both train two generated steps to a finite loss."""
    student, teacher = _pair(weights, hidden=64)
    student.set_attn_implementation("sdpa")  # the engine builds SDPA's masks
    rows = [{"input_ids": p, "labels": [-100] * len(p)} for p in PROMPTS] * 2
    args = _args(tmp_path, bf16=True, use_cpu=True, kd_generation_cache="graph", max_steps=2, kd_max_new_tokens=8)
    trainer = KDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=rows)
    calls = _recording(trainer)
    trainer.train()
    assert len(calls) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.state.log_history[:2])
