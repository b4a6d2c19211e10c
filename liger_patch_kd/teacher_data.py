"""Kept for code written against 0.1.0: everything here now lives in `liger_patch_kd.teacher`."""

from .teacher import *  # noqa: F403
from .teacher import __all__  # noqa: F401
