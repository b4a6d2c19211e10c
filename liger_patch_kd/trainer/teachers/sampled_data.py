"""KDTrainer's checks of a store of sampled teacher tokens (teacher/store/samples.py), before any training: the
sampled loss is unbiased only for forward KL and only at the temperature the tokens were drawn at."""

from __future__ import annotations

from typing import Any

from ...batch.columns import TEACHER_SAMPLE_IDS
from ...config import KDLossConfig
from ...conventions import require_sampled_objective
from ...teacher.store import store_meta


def check_sampled_dataset(dataset: Any, cfg: KDLossConfig, first_row: Any = None, declared: float | None = None):
    """ValueError naming kd_beta / kd_temperature when sampled teacher tokens cannot train the objective asked: a
    store says its draw temperature in its metadata; rows without one (`first_row` carries teacher_sample_ids) take
    it from kd_teacher_sample_temperature (`declared`), or train only at T = 1, never at a guessed temperature."""
    meta = store_meta(dataset)
    if meta is not None and meta.get("samples"):
        drawn_at, holder, where = meta.get("temperature", 1.0), "store holds", "the store's teacher tokens were"
    elif isinstance(first_row, dict) and first_row.get(TEACHER_SAMPLE_IDS) is not None:
        if declared is None and cfg.temperature != 1.0:
            raise ValueError(
                f"kd_temperature={cfg.temperature} on rows of sampled teacher tokens without a store's metadata: "
                f"their draw temperature is unknown, and the sampled loss is unbiased only at it. Set "
                f"kd_teacher_sample_temperature to the temperature they were drawn at (it must equal kd_temperature), "
                f"or read them from a store (precompute records it)"
            )
        drawn_at, holder, where = (1.0 if declared is None else declared), "rows hold", "the rows' teacher tokens were"
    else:
        return
    try:
        require_sampled_objective(cfg)
    except ValueError as e:
        raise ValueError(f"kd_beta: the training {holder} sampled teacher tokens; {e}") from None
    if cfg.temperature != drawn_at:
        raise ValueError(
            f"kd_temperature={cfg.temperature} but {where} drawn at temperature {drawn_at}: "
            f"the sampled loss estimates KL(P_T || S_T) without bias only at the draws' own T (tempering sparse "
            f"log-probs would need the teacher's full normaliser). Set kd_temperature={drawn_at}, or precompute at "
            f"--temperature {cfg.temperature}"
        )
