"""liger_patch_kd: knowledge distillation for Hugging Face causal LMs without materialised logits.

Everything a user needs is importable from here: the names of `losses.__all__` (loaded at once: torch and
triton only) and KDLossConfig; the names of `models.__all__` (every `apply_kd_patch_to_<family>` among them), the
Trainer and the teacher-data classes load on first use, so `import liger_patch_kd` pulls in neither transformers'
Trainer machinery nor torch._dynamo. The lazy names are read from the subpackage's `__all__` in its source, so
the two lists cannot drift apart.
"""

import ast
from importlib import import_module
from pathlib import Path
from typing import Any

from . import losses
from .config import KDLossConfig
from .losses import *  # noqa: F403 (losses.__all__)

__version__ = "0.2.0.dev0"


def _declared_all(subpackage: str) -> list[str]:
    """The `__all__` list of a subpackage, read from its `__init__.py` without importing it."""
    tree = ast.parse((Path(__file__).parent / subpackage / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise RuntimeError(f"liger_patch_kd.{subpackage} declares no __all__")


# public name -> the submodule that defines it, imported when the name is first used
_LAZY = {
    **dict.fromkeys(_declared_all("models"), ".models"),
    "KDTrainer": ".trainer",
    "KDTrainingArguments": ".trainer",
    **dict.fromkeys(
        (
            "TeacherLogprobsDataset",
            "TeacherDataCollator",
            "TeacherStoreError",
            "StoreWriter",
            "precompute",
            "import_vllm_logprobs",
        ),
        ".teacher",
    ),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["KDLossConfig", "__version__", *losses.__all__, *_LAZY]
