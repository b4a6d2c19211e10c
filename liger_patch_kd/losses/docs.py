"""Parameter docs the loss entry points share, written once (as Cut Cross-Entropy does).

A docstring names a shared parameter as `{name}` in its `Args:` section and is filled in by `shared_docs`;
N is the number of rows (the product of the leading dims), H the hidden size, V the vocabulary, K the top-k.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)

_FIRST, _REST = " " * 8, " " * 12  # a parameter's line in an `Args:` section, and its continuation lines

PARAMS: dict[str, str] = {
    "student_input": "student_input (Tensor): (N, H) or (B, T, H) last hidden states of the student, row-aligned "
    "with the labels (shift the labels, not the hidden states).",
    "student_weight": "student_weight (Tensor): (V, H) the student's lm_head weight; gradients flow to it.",
    "teacher_input": "teacher_input (Tensor): (N, H_t) or (B, T, H_t) the teacher's last hidden states, one row "
    "per student row (H_t may differ from H). Detached.",
    "teacher_weight": "teacher_weight (Tensor): (V_t, H_t) the teacher's lm_head weight. Detached.",
    "teacher_token_ids": "teacher_token_ids (Tensor): (N, K) or (B, T, K) integer ids of the teacher's top-k "
    "(K may equal V); padding slots have a negative id.",
    "teacher_logprobs": "teacher_logprobs (Tensor): the teacher's log-probs on those ids, same shape, taken at "
    "temperature 1 over its full vocabulary (as vLLM / SGLang return them); padding slots are -inf or <= -1000.",
    "teacher_sample_ids": "teacher_sample_ids (Tensor): (N, J) or (B, T, J) distinct ids drawn from the teacher at "
    "the loss's temperature (in the hybrid: from its distribution outside the top-k); padding slots have id -1.",
    "teacher_sample_counts": "teacher_sample_counts (Tensor): same shape, how many of the row's m draws gave each "
    "id (0 on padding); m = the row's sum.",
    "teacher_sample_logprobs": "teacher_sample_logprobs (Tensor): same shape, the teacher's log-prob of each id at "
    "the temperature the draws were made at (normalised over its full vocabulary there; not re-tempered).",
    "hybrid_topk": "teacher_token_ids / teacher_logprobs (Tensor | None): (N, K) the hybrid's exact top-k, its "
    "log-probs at that same temperature; None for draws alone.",
    "labels": "labels (Tensor | None): (N,) or (B, T) targets of the rows; rows whose label is ignore_index count "
    "for nothing and are never read. Needed for hard_weight > 0; None scores every row.",
    "num_items_in_batch": "num_items_in_batch (int | Tensor | None): the batchmean denominator across gradient "
    "accumulation (the Trainer's count of labelled tokens); default: this call's labelled rows.",
    "student_bias": "student_bias (Tensor | None): (V,) the student's lm_head bias; gradients flow to it.",
    "teacher_bias": "teacher_bias (Tensor | None): (V_t,) the teacher's lm_head bias. Detached.",
    "config": "config (KDLossConfig | None): every loss option (beta, temperature, reduction, weights, chunking, "
    "vocab_size, ...: see KDLossConfig), the one channel for them; default KDLossConfig(). A keyword naming an option "
    "is a TypeError (the nn.Module twins take them as keywords).",
    "sampled_config": "config (KDLossConfig | None): every loss option (see KDLossConfig); default "
    "KDLossConfig(beta=0.0). beta must be 0 (forward KL): the only divergence whose sampled estimate is unbiased at a "
    "bounded variance (reference.sampled_kd_per_row says why). A keyword naming an option is a TypeError.",
    "behaviour_logprobs": 'behaviour_logprobs (Tensor | None): estimator "pg" only, shaped like labels: the '
    "log-prob of each row's label under the policy that sampled it (an engine's weights some steps old), for the "
    "importance ratio exp(log q - log b); None: the student itself (fresh rollouts, ratio 1). Ignored rows are "
    "never read.",
    "return_components": "return_components (bool): return KDLossOutput(loss, soft, hard) instead of the loss.",
    "check_inputs": "check_inputs (bool): validate the data (ids, log-probs, labels) with one host sync.",
    "backend": 'backend (str | None): "triton" or "torch"; default Triton on CUDA, PyTorch elsewhere.',
    "logprob_mask": "mask (Tensor | None): (...) bool or 0/1, the tokens that count (the completion, not the "
    "prompt or padding); the others are never read. Default: every token.",
    "logprob_reduction": 'reduction (str): "mean" over the masked tokens (0 when none), "sum" or "none".',
}

RETURNS_LOSS = (
    "Tensor | KDLossOutput: the loss, a scalar (the leading shape for reduction='none'), differentiable with "
    "respect to the student's input, weight and bias; KDLossOutput(loss, soft, hard) with return_components=True."
)


def args_section(*names: str, indent: int = 8) -> str:
    """The `Args:` lines of the shared parameters `names`, wrapped and indented for a function's docstring
    (`indent=12` for a method's)."""
    return "\n".join(_wrap(PARAMS[name], " " * indent, " " * (indent + 4)) for name in names)


def returns_loss_section(indent: int = 8) -> str:
    """The `Returns:` text of the fused losses, indented for a function's (8) or a method's (12) docstring."""
    return _wrap(RETURNS_LOSS, " " * indent, " " * (indent + 4))


def _wrap(text: str, first: str = _FIRST, rest: str = _REST, width: int = 116) -> str:
    lines, line = [], first
    for word in text.split():
        if len(line) + len(word) + 1 > width and line.strip():
            lines.append(line)
            line = rest
        line += ("" if line.isspace() else " ") + word
    return "\n".join([*lines, line])


def shared_docs(**sections: str) -> Callable[[F], F]:
    """Fill the `{name}` fields of a docstring: each keyword is a section text (`args=args_section(...)`)."""

    def decorate(fn: F) -> F:
        fn.__doc__ = (fn.__doc__ or "").format(**{"returns_loss": returns_loss_section(), **sections})
        return fn

    return decorate
