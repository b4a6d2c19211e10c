"""KDTrainer's checks of the temperature a store's teacher signal was taken at, before any training: sampled teacher
tokens (teacher/store/samples.py) train without bias only for forward KL and only at the temperature they were drawn
at; top-k log-probs taken at a temperature other than 1 are a teacher tempered already, which the loss (tempering
stored log-probs by kd_temperature) must not temper again."""

from __future__ import annotations

from typing import Any

from transformers.utils import logging

from ...batch.columns import TEACHER_SAMPLE_IDS
from ...config import KDLossConfig
from ...conventions import require_sampled_objective
from ...teacher.store import store_meta

logger = logging.get_logger(__name__)


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


def check_tempered_topk(dataset: Any, cfg: KDLossConfig, name: str = "train_dataset") -> None:
    """A store of top-k log-probs taken at a temperature T_s != 1 (`liger-kd precompute --temperature`, an axolotl
    import with keep_temperature) holds a teacher tempered already, and the loss tempers stored log-probs by
    kd_temperature: any kd_temperature but 1 would temper it twice (the teacher at T_s x kd_temperature against the
    student at kd_temperature). Refused, naming both and the fix; at kd_temperature 1 the stored teacher trains as it
    is against the student at 1, which is said once. A store of sampled tokens is check_sampled_dataset's."""
    meta = store_meta(dataset)
    if meta is None or meta.get("samples") or not meta.get("top_k"):
        return
    stored = float(meta.get("temperature", 1.0))
    if stored == 1.0:
        return
    if cfg.temperature != 1.0:
        raise ValueError(
            f"kd_temperature={cfg.temperature}: the {name} store holds its teacher's top-{meta['top_k']} log-probs at "
            f"temperature {stored} already, and the loss tempers stored log-probs by kd_temperature, so the teacher "
            f"would be at {stored * cfg.temperature:g} against the student at {cfg.temperature:g}. Precompute at "
            f"--temperature 1 and train with kd_temperature={stored:g} (tempering stored temperature-1 log-probs is "
            f"exact), or set kd_temperature=1 to train the stored teacher as it is"
        )
    logger.warning(
        "the %s store holds its teacher's log-probs at temperature %g, and kd_temperature=1 trains the student at "
        "temperature 1 against them; for KL(P_T || S_T) precompute at --temperature 1 and set kd_temperature=%g",
        name, stored, stored,
    )
