"""kd_teacher_cuda_graphs: the teacher's decoder replayed from CUDA graphs (models/captured_backbone.py).

On the CPU the same padded buffers run op by op (capture="eager"), which checks everything but the replay itself:
the padding of the length, the keys, which calls it takes and which it leaves to the eager forward, the refusals.
The GPU tests check the replay against the eager forward."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from liger_patch_kd.models import captured_backbone_of, disable_captured_backbone, enable_captured_backbone
from liger_patch_kd.models.backbone import run_backbone
from liger_patch_kd.trainer import KDTrainer
from liger_patch_kd.trainer.teachers.compute import capture_teachers

from .test_trainer import _args, _dataset, _losses
from .tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")  # KDTrainer(use_kd_patch=True) patches the student's classes


def _teacher(dtype=torch.float64, device="cpu"):
    teacher = tiny_model("llama", dtype=dtype, seed=2, hidden=96).to(device).eval().requires_grad_(False)
    teacher.set_attn_implementation("sdpa")  # a right-padded batch reaches an SDPA teacher without its mask
    return teacher


def _hidden(model, ids, **kwargs):
    with torch.no_grad():
        return run_backbone(model, ids, kwargs.pop("attention_mask", None), kwargs).last_hidden_state


def test_padded_replay_is_the_forward_and_shapes_share_a_capture():
    teacher = _teacher()
    g = torch.Generator().manual_seed(0)
    inputs = {n: torch.randint(1, VOCAB, (3, n), generator=g) for n in (5, 7, 8, 9)}
    want = {n: _hidden(teacher, ids) for n, ids in inputs.items()}
    captured = enable_captured_backbone(teacher, capture="eager", length_multiple=8)
    try:
        for n, ids in inputs.items():
            got = _hidden(teacher, ids)
            assert got.shape == want[n].shape
            # the padded tail changes nothing a real position computes (causal attention): the forward on the
            # padded ids, to the bit, whatever the tail holds
            padded = torch.cat([ids, torch.randint(1, VOCAB, (3, -n % 8), generator=g)], dim=1)
            with torch.no_grad():
                torch.testing.assert_close(got, teacher.model(padded, use_cache=False).last_hidden_state[:, :n],
                                           rtol=0, atol=0)  # fmt: skip
            # and the unpadded forward up to RoPE's angles, which transformers computes in fp32 whatever the
            # dtype: a CPU's vectorised sin / cos may round a position differently in a row of another length
            torch.testing.assert_close(got, want[n], rtol=1e-5, atol=1e-6)
        assert captured.captures == 2  # lengths 5, 7, 8 share the 8-wide buffer; 9 takes a 16-wide one
        _hidden(teacher, inputs[5][:2])  # other rows: a shape of its own
        assert captured.captures == 3
    finally:
        disable_captured_backbone(teacher)
    assert captured_backbone_of(teacher) is None


def test_calls_it_cannot_replay_run_eagerly_and_equal():
    teacher = _teacher()
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    captured = enable_captured_backbone(teacher, capture="eager")
    try:
        want = teacher.model(ids, mask).last_hidden_state
        torch.testing.assert_close(_hidden(teacher, ids, attention_mask=mask), want)
        _hidden(teacher, ids, position_ids=torch.arange(6).expand(2, 6))  # packed rows' positions: not replayed
        with torch.enable_grad():
            run_backbone(teacher, ids, None, {})  # a forward with gradients: the student's, never replayed
        teacher.train()
        _hidden(teacher, ids)  # dropout may run: not replayed
        teacher.eval()
        assert captured.captures == 0
        _hidden(teacher, ids, use_cache=False)
        assert captured.captures == 1
    finally:
        disable_captured_backbone(teacher)


def test_keys_follow_the_parameters_and_at_most_max_graphs_are_kept():
    teacher = _teacher()
    captured = enable_captured_backbone(teacher, capture="eager", length_multiple=4, max_graphs=2)
    try:
        g = torch.Generator().manual_seed(2)
        for n in (3, 7, 11):  # three widths, two kept: the least recently used goes
            _hidden(teacher, torch.randint(1, VOCAB, (2, n), generator=g))
        assert len(captured.entries) == 2 and captured.captures == 3
        ids = torch.randint(1, VOCAB, (2, 5), generator=g)
        before = _hidden(teacher, ids).clone()
        with torch.no_grad():  # an update in place (what an EMA teacher does) is what the next call computes with
            teacher.model.norm.weight.mul_(2)
        torch.testing.assert_close(_hidden(teacher, ids), 2 * before)
        teacher.to(torch.float32)  # new storage: every kept buffer is dropped
        _hidden(teacher, ids.clone())
        assert len(captured.entries) == 1
    finally:
        disable_captured_backbone(teacher)


def _trainer(tmp_path, teacher, **overrides):
    """A KDTrainer over a float32 tiny student and `teacher`, with the fused loss (what the captured teacher needs)."""
    return KDTrainer(model=tiny_model("llama", dtype=torch.float32, seed=1), teacher_model=teacher,
                     args=_args(tmp_path, use_kd_patch=True, **overrides), train_dataset=_dataset())  # fmt: skip


def test_trainer_with_captured_teacher_trains_as_the_eager_one(tmp_path, caplog):
    """Through KDTrainer.train(): right-padded batches (the collator pads, the SDPA teacher's mask is dropped) reach
    the captured forward; on the CPU it runs eagerly, said once, and the losses are the eager teacher's."""
    losses, captures = {}, {}
    for graphs in (False, True):
        teacher = _teacher(torch.float32)
        with caplog.at_level("WARNING"):
            trainer = _trainer(tmp_path, teacher, max_steps=4, kd_teacher_cuda_graphs=graphs)
        trainer.train()
        losses[graphs] = torch.tensor(_losses(trainer))
        captured = captured_backbone_of(trainer.teacher_model)
        captures[graphs] = None if captured is None else captured.captures
        disable_captured_backbone(trainer.teacher_model)
    assert captures[False] is None and captures[True] >= 1
    assert any("1 of 1 teachers are not on a CUDA device: their forward runs eagerly" in r.getMessage()
               for r in caplog.records)
    # fp32: the padded products may sum in another order on another shape, nothing more
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=1e-6)


def test_refusals_name_the_option_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match="kd_teacher_cuda_graphs replays an in-process teacher_model.*pass teacher_m"):
        KDTrainer(model=tiny_model("llama", dtype=torch.float32, seed=1), train_dataset=_dataset(),
                  args=_args(tmp_path, use_kd_patch=True, kd_teacher_cuda_graphs=True))  # fmt: skip
    sharded = SimpleNamespace(kd_self_distill=False, fsdp="full_shard", deepspeed=None, use_kd_patch=True,
                              kd_patch_config=None)  # fmt: skip
    with pytest.raises(ValueError, match="cannot replay a teacher sharded by FSDP / DeepSpeed"):
        capture_teachers(sharded, (_teacher(),))
    with pytest.raises(ValueError, match="kd_teacher_cuda_graphs replays the teacher's decoder inside the fused loss"):
        KDTrainer(model=tiny_model("llama", dtype=torch.float32, seed=1), teacher_model=_teacher(torch.float32),
                  train_dataset=_dataset(), args=_args(tmp_path, kd_teacher_cuda_graphs=True))  # fmt: skip
    with pytest.raises(ValueError, match="without it .use_kd_patch=False, or kd_patch_config fused_linear_jsd"):
        KDTrainer(model=tiny_model("llama", dtype=torch.float32, seed=1), teacher_model=_teacher(torch.float32),
                  train_dataset=_dataset(), args=_args(tmp_path, use_kd_patch=True, kd_teacher_cuda_graphs=True,
                                                       kd_patch_config={"fused_linear_jsd": False}))  # fmt: skip
    with pytest.raises(ValueError, match="capture must be one of"):
        enable_captured_backbone(_teacher(), capture="compiled")
    for bad in (None, 2.5, True, 0):
        with pytest.raises(ValueError, match="length_multiple and max_graphs must be whole numbers >= 1"):
            enable_captured_backbone(_teacher(), capture="eager", length_multiple=bad)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"capture='graph' needs the model on a CUDA device.*\['cpu'\]"):
            enable_captured_backbone(_teacher(), capture="graph")


def test_inference_mode_and_no_grad_calls_keep_their_own_buffers():
    """A call under inference_mode makes inference tensors; a later no_grad call of the same shape must not write
    into them (torch refuses an in-place update of an inference tensor outside inference mode)."""
    teacher = _teacher()
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(5))
    want = _hidden(teacher, ids)
    captured = enable_captured_backbone(teacher, capture="eager", length_multiple=8)
    try:
        with torch.inference_mode():
            first = run_backbone(teacher, ids, None, {}).last_hidden_state
        second = _hidden(teacher, ids)
        assert captured.captures == 2
        for got in (first, second):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    finally:
        disable_captured_backbone(teacher)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("dtype,autocast", [(torch.bfloat16, False), (torch.float32, True)])
def test_graph_replay_is_the_eager_forward(dtype, autocast):
    teacher = _teacher(dtype, "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randint(1, VOCAB, (4, n), device="cuda", generator=g) for n in (17, 30, 64, 70, 17)]
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        want = [_hidden(teacher, ids) for ids in inputs]
        captured = enable_captured_backbone(teacher)
        try:
            assert captured.capture == "graph"
            got = [_hidden(teacher, ids).clone() for ids in inputs]
            assert captured.captures == 2  # 17, 30, 64 share the 64-wide graph; 70 takes the 128-wide one
            for a, b in zip(got, want):
                # bf16 activations: the padded products may pick another kernel, one bf16 step at most apart
                torch.testing.assert_close(a.float(), b.float(), rtol=2**-6, atol=2**-6)
            with torch.no_grad():
                teacher.model.norm.weight.mul_(2)  # read in place by the next replay
            torch.testing.assert_close(_hidden(teacher, inputs[0]).float(), 2 * got[0].float(), rtol=2**-6, atol=2**-6)
        finally:
            disable_captured_backbone(teacher)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_trainer_bf16_with_captured_teacher_matches_the_eager_one(tmp_path):
    losses = {}
    for graphs in (False, True):
        trainer = KDTrainer(
            model=tiny_model("llama", dtype=torch.float32, seed=1).cuda(),
            teacher_model=_teacher(torch.float32, "cuda"),
            args=_args(tmp_path, use_kd_patch=True, max_steps=4, use_cpu=False, bf16=True,
                       kd_teacher_cuda_graphs=graphs),
            train_dataset=_dataset(),
        )  # fmt: skip
        trainer.train()
        losses[graphs] = torch.tensor(_losses(trainer))
        if graphs:
            assert captured_backbone_of(trainer.teacher_model).captures >= 1
            disable_captured_backbone(trainer.teacher_model)
    torch.testing.assert_close(losses[True], losses[False], rtol=2e-2, atol=1e-3)


def test_every_in_process_member_of_a_teacher_set_is_captured(tmp_path):
    """KDTrainer(teacher_model={"math": m1, "code": m2}): each member's forward goes through its own captures, and
    the loss is the eager set's."""
    from .test_multi_teacher_trainer import _args as set_args
    from .test_multi_teacher_trainer import _models, _rows

    losses, captured = {}, {}
    for graphs in (False, True):
        student, teachers = _models(torch.float32)
        for teacher in teachers.values():
            teacher.set_attn_implementation("sdpa")
        trainer = KDTrainer(model=student, teacher_model=teachers, train_dataset=_rows(),
                            args=set_args(tmp_path, use_kd_patch=True, max_steps=2, per_device_train_batch_size=2,
                                          kd_teacher_cuda_graphs=graphs))  # fmt: skip
        trainer.train()
        losses[graphs] = torch.tensor(_losses(trainer))
        captured[graphs] = {name: captured_backbone_of(m) for name, m in teachers.items()}
        for m in teachers.values():
            disable_captured_backbone(m)
    assert all(c is None for c in captured[False].values())
    assert all(c is not None and c.captures >= 1 for c in captured[True].values()), captured[True]
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_a_forward_that_cannot_be_captured_runs_eagerly_and_leaves_the_device_usable(caplog):
    """A forward that waits on the GPU while captured (a .item() in a hook; a hook that synchronises) fails its
    capture, which must not leave torch's CUDA generator marked as capturing (every random op would fail after
    it). Both run eagerly, to the bit, and a later capture works."""
    teacher = _teacher(torch.bfloat16, "cuda")
    ids = torch.randint(1, VOCAB, (2, 12), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    want = _hidden(teacher, ids).clone()
    layer = teacher.model.layers[0]
    def read_back(module, args):  # a host sync inside the forward (returns None: the inputs stay as they are)
        float(args[0].sum())

    hook = layer.register_forward_pre_hook(read_back)
    captured = enable_captured_backbone(teacher)
    try:
        with caplog.at_level("WARNING"):
            torch.testing.assert_close(_hidden(teacher, ids), want, rtol=0, atol=0)
        assert captured.captures == 0 and len(captured.refused) == 1
        assert any("could not be captured" in r.getMessage() for r in caplog.records)
        assert torch.cuda.current_stream() == torch.cuda.default_stream()  # the caller's stream is back
        torch.randint(0, 10, (4,), device="cuda")  # the generator works outside a capture again
    finally:
        hook.remove()

    def sync_while_captured(module, args):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()

    hook = layer.register_forward_pre_hook(sync_while_captured)
    captured = enable_captured_backbone(teacher)
    try:
        torch.testing.assert_close(_hidden(teacher, ids), want, rtol=0, atol=0)
        assert captured.captures == 0 and len(captured.refused) == 1
        torch.randint(0, 10, (4,), device="cuda")  # the generator works outside a capture again
        torch.nn.functional.dropout(torch.ones(8, device="cuda"), 0.5, training=True)
    finally:
        hook.remove()
    captured = enable_captured_backbone(teacher)  # and a later capture works
    try:
        torch.testing.assert_close(_hidden(teacher, ids).float(), want.float(), rtol=2**-6, atol=2**-6)
        assert captured.captures == 1
    finally:
        disable_captured_backbone(teacher)


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "default"}])
def test_lengths_are_not_padded_where_the_position_encoding_follows_them(rope):
    """RoPE "dynamic" changes its frequencies past the trained length: a padded length would change every real
    position's encoding, so such a model's lengths are captured as they are; no model's past its trained length."""
    teacher = tiny_model("llama", seed=2, hidden=96, rope_scaling={**rope, "rope_theta": 10000.0}).eval()
    teacher.config.max_position_embeddings = 20  # the trained length the tiny config leaves at its default
    teacher.set_attn_implementation("sdpa")
    captured = enable_captured_backbone(teacher, capture="eager", length_multiple=8)
    try:
        ids = torch.randint(1, VOCAB, (2, 18), generator=torch.Generator().manual_seed(3))
        got = _hidden(teacher, ids)
        width = next(iter(captured.entries.values())).input_ids.shape[1]
        assert width == (18 if rope["rope_type"] == "dynamic" else 20)  # 24 would cross the trained length
        with torch.no_grad():
            torch.testing.assert_close(got, teacher.model(ids, use_cache=False).last_hidden_state, rtol=1e-5,
                                       atol=1e-6)  # fmt: skip
    finally:
        disable_captured_backbone(teacher)


def test_a_model_that_attends_both_ways_is_not_padded():
    teacher = _teacher()
    teacher.config.use_bidirectional_attention = True  # the padded tail would be seen by every real position
    captured = enable_captured_backbone(teacher, capture="eager", length_multiple=8)
    try:
        _hidden(teacher, torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4)))
        assert next(iter(captured.entries.values())).input_ids.shape[1] == 5
    finally:
        disable_captured_backbone(teacher)



def _resumable_run(out, max_steps, device, resume=None, **overrides):
    """A KDTrainer run with the captured teacher, saving every 2 steps; its logged losses."""
    on_gpu = device == "cuda"
    trainer = KDTrainer(
        model=tiny_model("llama", dtype=torch.float32, seed=1).to(device),
        teacher_model=_teacher(torch.float32, device),
        args=_args(out, use_kd_patch=True, max_steps=max_steps, kd_teacher_cuda_graphs=True, save_strategy="steps",
                   save_steps=2, use_cpu=not on_gpu, bf16=on_gpu, **overrides),
        train_dataset=_dataset(),
    )  # fmt: skip
    try:
        trainer.train(resume_from_checkpoint=resume)
        assert captured_backbone_of(trainer.teacher_model).captures >= 1
        return _losses(trainer)
    finally:
        disable_captured_backbone(trainer.teacher_model)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")])])  # fmt: skip
def test_a_run_resumed_from_a_checkpoint_continues_as_the_uninterrupted_one(tmp_path, device):
    """4 steps in one run (saving at step 2), and a new Trainer resumed from its step-2 checkpoint to step 4: the
    resumed run's teacher is captured afresh (a new Trainer's teacher) and its last steps log the uninterrupted
    run's losses, up to fp32 rounding (the resumed student's weights come back from the checkpoint's file)."""
    whole = _resumable_run(tmp_path / "whole", 4, device)
    resumed = _resumable_run(tmp_path / "resumed", 4, device, resume=str(tmp_path / "whole" / "out" / "checkpoint-2"))
    # the resumed run's history starts with the checkpoint's two logged steps
    assert len(whole) == 4 and resumed[:2] == whole[:2] and len(resumed) == 4
    # on the GPU, bf16 autocast and SDPA's backward (atomics) round differently from run to run
    tolerance = dict(rtol=1e-5, atol=1e-7) if device == "cpu" else dict(rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(torch.tensor(resumed[2:]), torch.tensor(whole[2:]), **tolerance)


def test_enabling_again_with_the_same_settings_keeps_the_graphs(tmp_path):
    """A second Trainer over the same teacher (a sweep, a benchmark's warm-up then its timed run) replays what the
    first captured; other settings start afresh; after disable, enable starts afresh too."""
    teacher = _teacher(torch.float32)
    first = enable_captured_backbone(teacher, capture="eager", length_multiple=8)
    _hidden(teacher, torch.randint(0, VOCAB, (2, 5)))
    assert first.captures == 1
    assert enable_captured_backbone(teacher, capture="eager", length_multiple=8) is first
    other = enable_captured_backbone(teacher, capture="eager", length_multiple=16)
    assert other is not first and other.captures == 0 and captured_backbone_of(teacher) is other
    disable_captured_backbone(teacher)
    assert enable_captured_backbone(teacher, capture="eager", length_multiple=16) is not other
    disable_captured_backbone(teacher)
    kept = []
    for _ in range(2):  # through KDTrainer: the teacher's graphs of the first run are the second run's
        trainer = _trainer(tmp_path, teacher, max_steps=2, kd_teacher_cuda_graphs=True)
        trainer.train()
        kept.append(captured_backbone_of(teacher))
    assert kept[0] is kept[1] and kept[0].captures >= 1
    disable_captured_backbone(teacher)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")])])  # fmt: skip
def test_a_peft_adapter_switch_replays_the_capture_of_the_adapters_in_force(device):
    """PEFT's switches are plain attributes a captured graph would not see: they are in the key, so a teacher whose
    adapter is switched (or disabled) between calls computes with the adapters in force, and going back replays the
    first capture."""
    peft = pytest.importorskip("peft")
    lora = dict(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    torch.manual_seed(0)
    dtype = torch.float64 if device == "cpu" else torch.float32
    wrapped = peft.get_peft_model(_teacher(dtype, device), peft.LoraConfig(**lora))
    wrapped.add_adapter("other", peft.LoraConfig(**lora))
    teacher = wrapped.base_model.model.requires_grad_(False)
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3)).to(device)
    want = {}
    for state in ("default", "other", "off"):
        wrapped.set_adapter("default" if state == "off" else state)
        with wrapped.disable_adapter() if state == "off" else contextlib.nullcontext():
            want[state] = _hidden(teacher, ids).clone()
    captured = enable_captured_backbone(teacher, capture="graph" if device == "cuda" else "eager")
    try:
        for state in ("default", "other", "off", "default"):
            wrapped.set_adapter("default" if state == "off" else state)
            with wrapped.disable_adapter() if state == "off" else contextlib.nullcontext():
                got = _hidden(teacher, ids)
            # float32 on a GPU: the padded products may pick another kernel (one rounding step apart)
            torch.testing.assert_close(got, want[state], **({} if device == "cpu" else dict(rtol=1e-4, atol=1e-4)))
        assert captured.captures == 3  # one capture per adapter state; the last call replays the first
        assert not torch.allclose(want["default"], want["other"]) and not torch.allclose(want["default"], want["off"])
    finally:
        disable_captured_backbone(teacher)


def test_a_change_made_after_enabling_is_what_the_next_call_computes():
    """What a graph bakes in besides the weights (a plain attribute, a config flag its forward reads) is in its key
    and its padding is decided per call (an adversarial pass: Gemma-3's use_bidirectional_attention set after
    enabling kept the padded buffer, whose tail real positions then saw: 0.39 off its own forward)."""
    teacher = _teacher()
    captured = enable_captured_backbone(teacher, capture="eager", length_multiple=8)
    try:
        ids = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
        _hidden(teacher, ids)
        for module in teacher.modules():
            if hasattr(module, "variance_epsilon"):
                module.variance_epsilon = 0.25
        with torch.no_grad():
            want = teacher.model(input_ids=ids, use_cache=False).last_hidden_state
        torch.testing.assert_close(_hidden(teacher, ids), want)
        assert captured.captures == 2  # the epsilon is another state: another capture
    finally:
        disable_captured_backbone(teacher)
    gemma = tiny_model("gemma3_text", dtype=torch.float64, seed=2).eval().requires_grad_(False)
    gemma.set_attn_implementation("sdpa")
    captured = enable_captured_backbone(gemma, capture="eager", length_multiple=8)
    try:
        _hidden(gemma, ids)
        gemma.config.use_bidirectional_attention = True  # read by Gemma-3's forward at run time
        with torch.no_grad():
            want = gemma.model(input_ids=ids, use_cache=False).last_hidden_state
        torch.testing.assert_close(_hidden(gemma, ids), want)
        assert [entry.input_ids.shape[1] for entry in captured.entries.values()] == [8, 5]  # then not padded
    finally:
        disable_captured_backbone(gemma)
