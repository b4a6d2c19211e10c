"""Kept for code written against 0.1.0: everything here now lives in `liger_patch_kd.teacher` (and its rooms
teacher.store, teacher.formats, teacher.client); this module re-exports the names it exported then."""

from .teacher import *  # noqa: F403
from .teacher import __all__ as _TEACHER_ALL
from .teacher.precompute import teacher_topk_and_next, topk_of_logits
from .teacher.store import FORMAT_VERSION, LOGPROB_DTYPES, PackedCodec

__all__ = [*_TEACHER_ALL, "FORMAT_VERSION", "LOGPROB_DTYPES", "PackedCodec", "teacher_topk_and_next", "topk_of_logits"]
