"""apply_kd_patch on tiny random models of every registry entry, against the unpatched models' logits."""

import copy

import pytest
import torch
import torch.nn.functional as F

import liger_patch_kd.models as M
from liger_patch_kd import reference as R
from liger_patch_kd.models.registry import FAMILIES, REGISTRY, softcap_of

from .helpers import DEVICE
from .tiny_models import ALL_ARCHS, TEXT_VOCAB, VOCAB, tiny_model, vision_inputs

FAMILY_OF = {key: family for family, keys in FAMILIES.items() for key in keys}
APPLY = {arch: getattr(M, f"apply_kd_patch_to_{FAMILY_OF.get(arch, arch)}") for arch in ALL_ARCHS}
MOE = [k for k, spec in REGISTRY.items() if spec.router_aux_loss]


def _batch(arch="llama", seq=13, batch=2):
    """input_ids, attention_mask, labels and a VLM's image inputs; image placeholders are not scored."""
    ids = torch.randint(0, TEXT_VOCAB, (batch, seq))
    vision = vision_inputs(arch, ids)
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0  # right padding on the second row
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :3] = -100  # a "prompt" that is not scored
    labels[ids >= TEXT_VOCAB] = -100  # image placeholders, as VLM collators mask them
    return ids, mask, labels, vision


def _teacher_inputs(teacher, ids, mask, vision):
    return dict(input_ids=ids, attention_mask=mask, **(vision if type(teacher).__name__.endswith("Generation") else {}))


def _reference_kd(student, teacher, ids, mask, labels, vision, cfg):
    """The objective on the two unpatched models' materialised logits (transformed by their own forwards), plus a
    mixture of experts' router loss as its forward adds it to CE."""
    with torch.no_grad():
        t_logits = teacher(**_teacher_inputs(teacher, ids, mask, vision)).logits
    out = student(input_ids=ids, attention_mask=mask, **vision)
    targets = F.pad(labels[..., 1:], (0, 1), value=-100)
    loss = R.kd_loss(out.logits, t_logits, targets, cfg)
    if getattr(out, "aux_loss", None) is not None:
        loss = loss + student.router_aux_loss_coef * out.aux_loss
    return loss


pytestmark = pytest.mark.usefixtures("clean_patches")


def test_every_registry_entry_is_tested():
    assert sorted(REGISTRY) == sorted(ALL_ARCHS)


@pytest.mark.parametrize("arch", ALL_ARCHS)
@pytest.mark.parametrize("kernels", [True, False])
def test_logits_unchanged_when_not_fused(arch, kernels):
    base = tiny_model(arch, dtype=torch.float32)
    patched = APPLY[arch](
        rope=kernels, swiglu=kernels, rms_norm=kernels, fused_linear_jsd=False, model=copy.deepcopy(base)
    )
    ids, mask, _, vision = _batch(arch)
    vision = {k: v.float() if v.is_floating_point() else v for k, v in vision.items()}
    with torch.no_grad():
        expected = base(input_ids=ids, attention_mask=mask, **vision).logits
        got = patched(input_ids=ids, attention_mask=mask, **vision).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # fp32: kernel vs eager op rounding


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_fused_kd_loss_and_grads_match_reference(arch):
    student = tiny_model(arch, seed=1)
    teacher = tiny_model(arch, seed=2, hidden=96, layers=3)  # a bigger teacher: other hidden size and depth
    cfg = R.KDLossConfig(beta=0.4, temperature=1.5, hard_weight=0.2)
    ids, mask, labels, vision = _batch(arch)
    plain = copy.deepcopy(student)
    expected = _reference_kd(plain, teacher, ids, mask, labels, vision, cfg.replace(teacher_softcap=None))
    expected.backward()

    materialised = APPLY[arch](model=copy.deepcopy(student), kd_config=cfg, fused_linear_jsd=False)
    out = materialised(input_ids=ids, attention_mask=mask, labels=labels, teacher_model=teacher, **vision)
    torch.testing.assert_close(out.loss, expected, rtol=1e-9, atol=1e-11)

    APPLY[arch](model=student, kd_config=cfg)
    student.train()
    out = student(input_ids=ids, attention_mask=mask, labels=labels, teacher_model=teacher, **vision)
    assert out.logits is None
    torch.testing.assert_close(out.loss, expected, rtol=1e-9, atol=1e-11)
    out.loss.backward()
    for (name, p), q in zip(student.named_parameters(), plain.parameters()):
        if q.grad is None:  # a VLM's unused vision parameters, an expert no token was routed to
            assert p.grad is None or not p.grad.any(), name
            continue
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-7, atol=1e-10, msg=lambda m: f"{name}: {m}")
    assert all(p.grad is None for p in teacher.parameters())


@pytest.mark.parametrize("arch", MOE)
def test_router_aux_loss_is_added_exactly_when_the_config_asks(arch):
    student, teacher = tiny_model(arch, seed=1), tiny_model(arch, seed=2)
    ids, mask, labels, _ = _batch(arch)
    M.apply_kd_patch(model=student)
    with_aux = student(input_ids=ids, attention_mask=mask, labels=labels, teacher_model=teacher)
    without = student(
        input_ids=ids, attention_mask=mask, labels=labels, teacher_model=teacher, output_router_logits=False
    )
    M.revert_kd_patch(model=student)
    with torch.no_grad():
        aux = student(input_ids=ids, attention_mask=mask).aux_loss  # the unpatched model's own router loss
    assert aux is not None and aux > 0
    torch.testing.assert_close(with_aux.aux_loss, aux, rtol=1e-12, atol=0)
    added = student.router_aux_loss_coef * aux.double()  # transformers computes the router loss in fp32
    torch.testing.assert_close(with_aux.loss - without.loss, added, rtol=1e-6, atol=0)
    assert without.aux_loss is None


@pytest.mark.parametrize("arch", MOE)
def test_expert_mlps_are_knowingly_left_to_transformers(arch):
    model = M.apply_kd_patch(model=tiny_model(arch))
    spec = REGISTRY[arch]
    experts = tuple(spec.classes(spec.experts))
    dense = tuple(spec.classes(spec.mlp))
    if experts:  # transformers 4.57's Qwen3-MoE builds its experts from Qwen3MoeMLP, which the kernel covers
        found = [m for m in model.modules() if isinstance(m, experts)]
        assert found and all("forward" not in m.__dict__ for m in found)
    assert all("forward" in m.__dict__ for m in model.modules() if dense and isinstance(m, dense))


@pytest.mark.parametrize(("student_arch", "teacher_arch"), [("qwen3_vl", "qwen3"), ("gemma3_text", "gemma3")])
def test_a_vlm_and_a_text_model_distil_into_each_other(student_arch, teacher_arch):
    student, teacher = tiny_model(student_arch, seed=1), tiny_model(teacher_arch, seed=2)
    ids, mask, labels, vision = _batch(student_arch)  # images only where the student is a VLM
    cfg = R.KDLossConfig(beta=0.5, temperature=2.0)
    expected = _reference_kd(copy.deepcopy(student), teacher, ids, mask, labels, vision, cfg)
    patched = M.apply_kd_patch(model=student, kd_config=cfg)
    out = patched(input_ids=ids, attention_mask=mask, labels=labels, teacher_model=teacher, **vision)
    torch.testing.assert_close(out.loss, expected, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_teacher_hidden_states_path_and_materialised_path(arch):
    student, teacher = tiny_model(arch, seed=1), tiny_model(arch, seed=2)
    ids, mask, labels, vision = _batch(arch)
    with torch.no_grad():
        t_hidden = teacher.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
    cap = softcap_of(teacher.config)
    cfg = R.KDLossConfig(beta=0.5, teacher_softcap=cap)
    expected = _reference_kd(copy.deepcopy(student), teacher, ids, mask, labels, vision, R.KDLossConfig(beta=0.5))
    fused = APPLY[arch](model=copy.deepcopy(student), kd_config=cfg)
    out = fused(ids, mask, labels, teacher_hidden_states=t_hidden, teacher_weight=teacher.lm_head.weight)
    torch.testing.assert_close(out.loss, expected, rtol=1e-9, atol=1e-11)
    materialised = APPLY[arch](model=copy.deepcopy(student), fused_linear_jsd=False, kd_config=cfg)
    out = materialised(ids, mask, labels, teacher_model=teacher)
    torch.testing.assert_close(out.loss, expected, rtol=1e-9, atol=1e-11)
    assert out.logits is not None and out.logits.shape == (*ids.shape, VOCAB)


def test_patched_model_runs_the_triton_kernels(monkeypatch):
    """The whole patched model with every Triton kernel (interpreted on CPU, compiled on GPU)."""
    monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    base = tiny_model("gemma2", dtype=torch.float32).to(DEVICE)
    teacher = tiny_model("gemma2", dtype=torch.float32, seed=3).to(DEVICE)
    ids, mask, labels, _ = (t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in _batch(seq=9))
    expected = _reference_kd(base, teacher, ids, mask, labels, {}, R.KDLossConfig())
    patched = M.apply_kd_patch(model=copy.deepcopy(base))
    out = patched(input_ids=ids, attention_mask=mask, labels=labels, teacher_model=teacher)
    torch.testing.assert_close(out.loss, expected, rtol=1e-4, atol=1e-6)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in patched.parameters() if p.grad is not None)


def test_instance_patch_leaves_others_untouched_and_reverts():
    a, b = tiny_model("llama"), tiny_model("llama")
    M.apply_kd_patch_to_llama(model=a)
    M.apply_kd_patch_to_llama(model=a)  # twice is harmless
    assert getattr(a.forward, "__func__", None) is M.kd_causal_lm_forward
    assert "forward" not in b.__dict__ and type(b).forward is not M.kd_causal_lm_forward
    norm = a.model.norm
    assert "forward" in norm.__dict__ and "forward" not in b.model.norm.__dict__
    M.revert_kd_patch(model=a)
    assert "forward" not in a.__dict__ and "forward" not in norm.__dict__


@pytest.mark.parametrize("family", sorted({FAMILY_OF.get(arch, arch) for arch in ALL_ARCHS}))
def test_class_patch_and_revert_restore_every_original(family):
    specs = [REGISTRY[k] for k in FAMILIES.get(family, (family,))]
    rope = [(s.load(), "apply_rotary_pos_emb") for s in specs if hasattr(s.load(), "apply_rotary_pos_emb")]
    classes = [(c, "forward") for s in specs for c in (s.model_class(), *s.classes(s.rms_norm), *s.classes(s.mlp))]
    owners = rope + classes
    before = [getattr(owner, name) for owner, name in owners]
    M.apply_kd_patch(model_type=family)
    M.apply_kd_patch(model_type=family)  # twice is harmless
    assert all(s.model_class().forward is M.kd_causal_lm_forward for s in specs)
    changed = {key for key, old in zip(owners, before) if getattr(*key) is not old}
    # every class is patched; RoPE exactly where the entry says the module's function is Llama's
    assert changed == set(classes) | {(s.load(), n) for s in specs if s.rope for (m, n) in rope if m is s.load()}
    M.revert_kd_patch(model_type=family)
    assert all(getattr(owner, name) is old for (owner, name), old in zip(owners, before))


def test_class_patch_before_loading_and_revert():
    import transformers.models.llama.modeling_llama as llama

    original_forward, original_rope = llama.LlamaForCausalLM.forward, llama.apply_rotary_pos_emb
    M.apply_kd_patch_to_llama(beta=0.0)
    M.apply_kd_patch_to_llama(beta=0.0)
    model = tiny_model("llama")
    assert type(model).forward is M.kd_causal_lm_forward
    teacher = tiny_model("llama", seed=5)
    ids, mask, labels, _ = _batch()
    loss = model(input_ids=ids, attention_mask=mask, labels=labels, teacher_model=teacher).loss
    M.revert_kd_patch(model_type="llama")
    assert llama.LlamaForCausalLM.forward is original_forward and llama.apply_rotary_pos_emb is original_rope
    expected = _reference_kd(model, teacher, ids, mask, labels, {}, R.KDLossConfig(beta=0.0))
    torch.testing.assert_close(loss, expected)


@pytest.mark.parametrize("how", ["instance", "class"])
def test_transformers_code_runs_the_originals_inside_and_restores_the_patch_after(how):
    """generate() runs inside transformers_code: every kernel and the forward are transformers' own there (one
    compilable graph), and the patch is back, object for object, when the block ends, also after an error."""
    import transformers.models.llama.modeling_llama as llama

    rope, norm_forward = llama.apply_rotary_pos_emb, llama.LlamaRMSNorm.forward
    model = tiny_model("llama")
    if how == "instance":
        M.apply_kd_patch_to_llama(model=model)
    else:
        M.apply_kd_patch_to_llama()
    patched = (llama.apply_rotary_pos_emb, llama.LlamaRMSNorm.forward, model.model.norm.__dict__.get("forward"))
    try:
        with M.transformers_code(model):
            assert llama.apply_rotary_pos_emb is rope and llama.LlamaRMSNorm.forward is norm_forward
            assert "forward" not in model.model.norm.__dict__ and "forward" not in model.model.layers[0].mlp.__dict__
            assert not getattr(model.forward, "__liger_kd__", False)
            first = model.forward
        with M.transformers_code(model):
            assert model.forward is first  # the same bound method: a compiled decode step is not recompiled
        with pytest.raises(RuntimeError), M.transformers_code(model):
            raise RuntimeError("an error inside generate()")
        now = (llama.apply_rotary_pos_emb, llama.LlamaRMSNorm.forward, model.model.norm.__dict__.get("forward"))
        assert all(a is b for a, b in zip(now, patched))
        assert getattr(llama.apply_rotary_pos_emb, "__liger_kd__", False)
    finally:
        M.revert_kd_patch(model=model) if how == "instance" else M.revert_kd_patch(model_type="llama")


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_generate_is_unchanged_by_the_patch(arch):
    ids = torch.randint(0, TEXT_VOCAB, (1, 8))
    vision = {k: v.float() if v.is_floating_point() else v for k, v in vision_inputs(arch, ids).items()}
    if arch == "gemma3":
        vision.pop("token_type_ids")  # generation rebuilds it; transformers would reject a prompt-length one
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0, **vision)
    # transformers 4.57 cannot generate with output_router_logits=True (its router loss meets a one-token step)
    moe = {"output_router_logits": False} if arch in MOE else {}
    expected = tiny_model(arch, dtype=torch.float32, **moe).generate(ids, **kwargs)
    model = APPLY[arch](model=tiny_model(arch, dtype=torch.float32, **moe))
    out = model.generate(ids, **kwargs)
    assert out.shape == (1, 12)
    assert torch.equal(out, expected)


def test_no_labels_or_no_teacher_is_the_original_forward():
    model = M.apply_kd_patch_to_llama(model=tiny_model("llama"))
    ids, mask, labels, _ = _batch()
    out = model(input_ids=ids, attention_mask=mask, labels=labels)  # plain CE: no teacher given
    assert out.logits is not None and out.loss is not None


def test_errors():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB))
    with pytest.raises(ValueError, match="not supported"):
        M.apply_kd_patch(model=gpt2)
    student = M.apply_kd_patch_to_llama(model=tiny_model("llama"))
    teacher = tiny_model("llama", vocab=VOCAB + 3)
    ids, mask, labels, _ = _batch()
    with pytest.raises(ValueError, match="vocab"):
        student(input_ids=ids, attention_mask=mask, labels=labels, teacher_model=teacher)
    with pytest.raises(ValueError, match="not supported"):  # an unknown teacher could transform its logits
        student(input_ids=ids, attention_mask=mask, labels=labels, teacher_model=gpt2.double())
    with pytest.raises(ValueError, match="one teacher source"):
        student(
            input_ids=ids,
            labels=labels,
            teacher_model=teacher,
            teacher_token_ids=ids[..., None],
            teacher_logprobs=ids[..., None].float(),
        )
    with pytest.raises(ValueError, match="teacher_weight"):
        student(input_ids=ids, labels=labels, teacher_hidden_states=torch.zeros(2, 13, 64))
    with pytest.raises(ValueError, match="patches"):
        M.apply_kd_patch_to_qwen3(model=tiny_model("llama"))


@pytest.mark.parametrize("arch", ["granite", "cohere", "gemma2"])
def test_precomputed_teacher_topk_has_the_models_own_logit_transform(arch):
    from liger_patch_kd.teacher.precompute import teacher_topk

    teacher = tiny_model(arch, seed=3)
    ids, mask, _, _ = _batch(arch)
    token_ids, logprobs = teacher_topk(teacher, ids, mask, k=5)
    with torch.no_grad():
        full = torch.log_softmax(teacher(input_ids=ids, attention_mask=mask).logits.float(), -1)
    expected = full.topk(5, -1)
    torch.testing.assert_close(logprobs.float(), expected.values, rtol=1e-5, atol=1e-5)
    # ids through the values they point at: two float32 log-probs within rounding of each other may swap places
    # (chunked (B*T, H) products vs the model's own forward); a wrong transform is off by far more than 1e-5
    torch.testing.assert_close(full.gather(-1, token_ids.long()), expected.values, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["granite", "cohere2", "mixtral", "gpt_oss", "qwen3_moe", "gemma3", "qwen2_5_vl"])
def test_trainer_step_matches_reference(tmp_path, arch):
    """KDTrainer (use_kd_patch=True) on a batch: its loss and gradients are the unpatched models' objective."""
    from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments

    student, teacher = tiny_model(arch, seed=1), tiny_model(arch, seed=2)
    ids, mask, labels, vision = _batch(arch)
    plain = copy.deepcopy(student).train()
    cfg = R.KDLossConfig(beta=0.5, temperature=2.0, hard_weight=0.3)
    expected = _reference_kd(plain, teacher, ids, mask, labels, vision, cfg)
    expected.backward()
    args = KDTrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, use_kd_patch=True, kd_beta=0.5,
        kd_temperature=2.0, kd_hard_weight=0.3, max_steps=1,
    )  # fmt: skip
    trainer = KDTrainer(model=student, teacher_model=teacher, args=args)
    student.train()
    loss = trainer.compute_loss(student, dict(input_ids=ids, attention_mask=mask, labels=labels, **vision))
    torch.testing.assert_close(loss, expected, rtol=1e-9, atol=1e-11)
    loss.backward()
    for p, q in zip(student.parameters(), plain.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-7, atol=1e-10)
