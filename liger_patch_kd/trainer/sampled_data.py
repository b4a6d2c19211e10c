"""KDTrainer's checks of a store of sampled teacher tokens (teacher/store/samples.py), before any training: the
sampled loss is unbiased only for forward KL and only at the temperature the tokens were drawn at."""

from __future__ import annotations

from typing import Any

from ..config import KDLossConfig
from ..conventions import require_sampled_objective


def check_sampled_dataset(dataset: Any, cfg: KDLossConfig) -> None:
    """ValueError naming kd_beta / kd_temperature when a store of sampled tokens cannot train the objective asked."""
    meta = getattr(dataset, "meta", None)
    if not isinstance(meta, dict) or not meta.get("samples"):
        return
    try:
        require_sampled_objective(cfg)
    except ValueError as e:
        raise ValueError(f"kd_beta: the training store holds sampled teacher tokens; {e}") from None
    drawn_at = meta.get("temperature", 1.0)
    if cfg.temperature != drawn_at:
        raise ValueError(
            f"kd_temperature={cfg.temperature} but the store's teacher tokens were drawn at temperature {drawn_at}: "
            f"the sampled loss estimates KL(P_T || S_T) without bias only at the draws' own T (tempering sparse "
            f"log-probs would need the teacher's full normaliser). Set kd_temperature={drawn_at}, or precompute at "
            f"--temperature {cfg.temperature}"
        )
