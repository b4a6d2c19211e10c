"""apply_kd_patch_to_<arch> on tiny random models of every supported architecture."""

import copy

import pytest
import torch
import torch.nn.functional as F

import liger_patch_kd.models as M
from liger_patch_kd import reference as R
from liger_patch_kd.models.registry import softcap_of

from .helpers import DEVICE
from .tiny_models import ARCHS, VOCAB, tiny_model

APPLY = {arch: getattr(M, f"apply_kd_patch_to_{arch}") for arch in ARCHS}


def _batch(seq=13, batch=2):
    ids = torch.randint(0, VOCAB, (batch, seq))
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0  # right padding on the second row
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :3] = -100  # a "prompt" that is not scored
    return ids, mask, labels


def _reference_kd(student, teacher, ids, mask, labels, cfg):
    """The objective on the two unpatched models' materialised logits (soft-capped by their own forwards)."""
    with torch.no_grad():
        t_logits = teacher(input_ids=ids, attention_mask=mask).logits
    s_logits = student(input_ids=ids, attention_mask=mask).logits
    targets = F.pad(labels[..., 1:], (0, 1), value=-100)
    return R.kd_loss(s_logits, t_logits, targets, cfg)


@pytest.fixture(autouse=True)
def _clean_patches():
    yield
    M.revert_kd_patch()


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("kernels", [True, False])
def test_logits_unchanged_when_not_fused(arch, kernels):
    base = tiny_model(arch, dtype=torch.float32)
    patched = APPLY[arch](
        rope=kernels, swiglu=kernels, rms_norm=kernels, fused_linear_jsd=False, model=copy.deepcopy(base)
    )
    ids, mask, _ = _batch()
    with torch.no_grad():
        expected = base(input_ids=ids, attention_mask=mask).logits
        got = patched(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # fp32: kernel vs eager op rounding


@pytest.mark.parametrize("arch", list(ARCHS))
def test_fused_kd_loss_and_grads_match_reference(arch):
    student = tiny_model(arch, seed=1)
    teacher = tiny_model(arch, seed=2, hidden=96, layers=3)  # a bigger teacher: other hidden size and depth
    cfg = R.KDLossConfig(beta=0.4, temperature=1.5, hard_weight=0.2)
    ids, mask, labels = _batch()
    plain = copy.deepcopy(student)
    expected = _reference_kd(plain, teacher, ids, mask, labels, cfg.replace(teacher_softcap=None))
    expected.backward()

    APPLY[arch](model=student, kd_config=cfg)
    student.train()
    out = student(input_ids=ids, attention_mask=mask, labels=labels, teacher_model=teacher)
    assert out.logits is None
    torch.testing.assert_close(out.loss, expected, rtol=1e-9, atol=1e-11)
    out.loss.backward()
    for (name, p), q in zip(student.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-7, atol=1e-10, msg=lambda m: f"{name}: {m}")
    assert all(p.grad is None for p in teacher.parameters())


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_teacher_hidden_states_path_and_materialised_path(arch):
    student, teacher = tiny_model(arch, seed=1), tiny_model(arch, seed=2)
    ids, mask, labels = _batch()
    with torch.no_grad():
        t_hidden = teacher.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
    cap = softcap_of(teacher.config)
    cfg = R.KDLossConfig(beta=0.5, teacher_softcap=cap)
    expected = _reference_kd(copy.deepcopy(student), teacher, ids, mask, labels, R.KDLossConfig(beta=0.5))
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
    ids, mask, labels = (t.to(DEVICE) for t in _batch(seq=9))
    expected = _reference_kd(base, teacher, ids, mask, labels, R.KDLossConfig())
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


def test_class_patch_before_loading_and_revert():
    import transformers.models.llama.modeling_llama as llama

    original_forward, original_rope = llama.LlamaForCausalLM.forward, llama.apply_rotary_pos_emb
    M.apply_kd_patch_to_llama(beta=0.0)
    M.apply_kd_patch_to_llama(beta=0.0)
    model = tiny_model("llama")
    assert type(model).forward is M.kd_causal_lm_forward
    teacher = tiny_model("llama", seed=5)
    ids, mask, labels = _batch()
    loss = model(input_ids=ids, attention_mask=mask, labels=labels, teacher_model=teacher).loss
    M.revert_kd_patch(model_type="llama")
    assert llama.LlamaForCausalLM.forward is original_forward and llama.apply_rotary_pos_emb is original_rope
    expected = _reference_kd(model, teacher, ids, mask, labels, R.KDLossConfig(beta=0.0))
    torch.testing.assert_close(loss, expected)


def test_generate_works_on_patched_model():
    model = M.apply_kd_patch_to_qwen3(model=tiny_model("qwen3", dtype=torch.float32))
    ids = torch.randint(0, VOCAB, (1, 5))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 9)
    unpatched = tiny_model("qwen3", dtype=torch.float32)
    expected = unpatched.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0
    )
    assert torch.equal(out, expected)


def test_no_labels_or_no_teacher_is_the_original_forward():
    model = M.apply_kd_patch_to_llama(model=tiny_model("llama"))
    ids, mask, labels = _batch()
    out = model(input_ids=ids, attention_mask=mask, labels=labels)  # plain CE: no teacher given
    assert out.logits is not None and out.loss is not None


def test_errors():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="not supported"):
        M.apply_kd_patch(model=gpt2)
    student = M.apply_kd_patch_to_llama(model=tiny_model("llama"))
    teacher = tiny_model("llama", vocab=VOCAB + 3)
    ids, mask, labels = _batch()
    with pytest.raises(ValueError, match="vocab"):
        student(input_ids=ids, attention_mask=mask, labels=labels, teacher_model=teacher)
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
