"""The registry refuses a model whose forward does something to its logits or loss that its entry does not declare."""

import pytest
import torch
import transformers

import liger_patch_kd.models as M
from liger_patch_kd.models.forward_audit import forward_features
from liger_patch_kd.models.registry import REGISTRY

from .tiny_models import TEXT_VOCAB, tiny_config, tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")


@pytest.mark.parametrize("key", sorted(REGISTRY))
def test_every_entry_declares_what_its_forward_does(key):
    spec = REGISTRY[key]
    declared = set(spec.logits) | ({"router_aux_loss"} if spec.router_aux_loss else set())
    assert forward_features(spec.model_class().forward) == declared


class _DoubledLogits(transformers.LlamaForCausalLM):
    """A fine-tune's subclass that scales its logits: a registered class, a forward the registry does not know."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(hidden_states)
        logits = logits * 2.0
        return transformers.modeling_outputs.CausalLMOutputWithPast(logits=logits)


def test_a_subclass_that_changes_the_logits_is_refused_as_student_and_teacher():
    model = _DoubledLogits(tiny_config("llama")).double()
    with pytest.raises(ValueError, match=r"logits = logits \* 2\.0"):
        M.apply_kd_patch(model=model)
    student = M.apply_kd_patch(model=tiny_model("llama"))
    ids = torch.randint(0, TEXT_VOCAB, (1, 6))
    with pytest.raises(ValueError, match="cannot be distilled"):
        student(input_ids=ids, labels=ids, teacher_model=model)


def test_a_softcap_in_the_config_that_the_forward_ignores_is_refused():
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        M.apply_kd_patch(model=tiny_model("llama", final_logit_softcapping=30.0))


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("FalconH1ForCausalLM", "lm_head_multiplier"),  # logits scaled inside the lm_head line
        ("MiniCPM3ForCausalLM", "hidden_states / self.config.logits_scaling"),  # hidden states scaled first
        ("BambaForCausalLM", "z_loss"),  # another loss term
        ("RecurrentGemmaForCausalLM", ""),  # another soft-cap spelling (4.57 is refused one step earlier)
    ],
)
def test_forwards_that_transform_logits_otherwise_are_recognised_as_unknown(name, why):
    cls = getattr(transformers, name, None)
    if cls is None:
        pytest.skip(f"{name} is not in transformers {transformers.__version__}")
    with pytest.raises(ValueError, match="cannot be distilled") as refused:
        forward_features(cls.forward)
    assert why in str(refused.value)


def _scaled_moe_forward(self, input_ids=None, attention_mask=None, labels=None, output_router_logits=None, **kwargs):
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    hidden_states = outputs.last_hidden_state
    logits = self.lm_head(hidden_states)
    logits = logits / self.config.logits_scaling
    loss = None
    if labels is not None:
        loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
    aux_loss = None
    if output_router_logits:
        aux_loss = load_balancing_loss_func(  # noqa: F821 - read, never run
            outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask
        )
        if labels is not None:
            loss += self.router_aux_loss_coef * aux_loss.to(loss.device)
    return loss, logits


def test_a_combination_of_known_steps_is_recognised():
    """A Granite-MoE-like forward scales its logits and adds a router loss: both are named."""
    assert forward_features(_scaled_moe_forward) == {"logits_scaling", "router_aux_loss"}
