"""The demo's measures on sampled text, the distribution on-policy distillation trains on.

Teacher forcing on held-out text (same_tokenizer.evaluate) scores every student on the same contexts. Scoring each
student on its own samples does not: each is then judged on different contexts, and a student whose samples are
easy to predict looks good. So every student is scored on one common set, the samples of all the students of the
run together (`kl_on_samples`), and each student's own samples are judged by one fixed judge, the teacher
(`teacher_nll`: the teacher's negative log-likelihood per sampled token; the teacher's own samples give its
entropy rate, the reference a well-matched student approaches).
"""

from __future__ import annotations

import torch

from .. import reference
from .toys import PAD

PROMPT, NEW = 16, 32  # each sample: the first PROMPT tokens of a held-out window, then NEW sampled ones


@torch.no_grad()
def sample_continuations(model, windows: list[list[int]], device, seed: int = 0) -> torch.Tensor:
    """(len(windows), PROMPT + NEW) ids: each window's first PROMPT tokens continued by `model` at temperature 1
    (no top-k, no EOS stop), seeded."""
    model.eval()
    prompts = torch.tensor([w[:PROMPT] for w in windows], device=device)
    torch.manual_seed(seed)
    return model.generate(
        input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=NEW,
        do_sample=True, top_k=0, pad_token_id=PAD, eos_token_id=None,
    )  # fmt: skip


def _sampled_labels(sequences: torch.Tensor) -> torch.Tensor:
    """Row-aligned labels scoring the sampled tokens only (position t predicts token t + 1)."""
    labels = torch.full_like(sequences, -100)
    labels[:, PROMPT - 1 : -1] = sequences[:, PROMPT:]
    return labels


@torch.no_grad()
def kl_on_samples(student, teacher, sequences: torch.Tensor) -> float:
    """KL(teacher || student) per sampled token of `sequences` (teacher forcing on them)."""
    student.eval()
    s, t = student(input_ids=sequences).logits.float(), teacher(input_ids=sequences).logits.float()
    return float(reference.generalized_jsd(s, t, _sampled_labels(sequences), beta=0.0))


@torch.no_grad()
def teacher_nll(teacher, sequences: torch.Tensor) -> float:
    """The teacher's negative log-likelihood (nats) per sampled token of `sequences`."""
    labels = _sampled_labels(sequences)
    per_row = reference.cross_entropy_per_row(teacher(input_ids=sequences).logits.float(), labels)
    return float(per_row[labels != -100].mean())


def score_on_samples(students: dict[str, torch.nn.Module], teacher, windows: list[list[int]], device,
                     seed: int = 0) -> dict[str, dict[str, float]]:  # fmt: skip
    """Per student: "kl_samples", its KL(teacher || student) on every student's samples of `windows` pooled (one
    common set of contexts), and "teacher_nll", the teacher's NLL of its own samples."""
    own = {name: sample_continuations(model, windows, device, seed) for name, model in students.items()}
    pooled = torch.cat(list(own.values()))
    return {name: dict(kl_samples=kl_on_samples(model, teacher, pooled), teacher_nll=teacher_nll(teacher, own[name]))
            for name, model in students.items()}  # fmt: skip
