"""liger_patch_kd: knowledge distillation for Hugging Face causal LMs without materialised logits.

Everything a user needs is importable from here: KDLossConfig (loaded at once: no torch); the names of
`losses.__all__` (torch and triton), of `models.__all__` (every `apply_kd_patch_to_<family>` among them), of
`trainer.__all__` (KDTrainer, KDTrainingArguments), `teacher.__all__` (stores, converters, served teachers) and
`align.__all__` (cross-tokenizer) load on first use, so `import liger_patch_kd` imports no torch (the `liger-kd` CLI
answers --help and argument errors without it) and neither transformers' Trainer machinery nor torch._dynamo. The
lazy names are read from the subpackage's `__all__` in its source, so the two lists cannot drift apart.
"""

import ast
from importlib import import_module
from pathlib import Path
from typing import Any

from .config import KDLossConfig

__version__ = "0.2.0.dev0"


def _declared_all(subpackage: str) -> list[str]:
    """The `__all__` list of a subpackage, read from its `__init__.py` without importing it."""
    tree = ast.parse((Path(__file__).parent / subpackage / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise RuntimeError(f"liger_patch_kd.{subpackage} declares no __all__")


# public name -> the submodule that defines it, imported when the name is first used: every name of these
# subpackages' __all__ (the Trainer and its collators, teacher data and servers, cross-tokenizer alignment)
_LAZY = {
    sub_name: f".{subpackage}"
    for subpackage in ("losses", "models", "trainer", "teacher", "align")
    for sub_name in _declared_all(subpackage)
}


def __getattr__(name: str) -> Any:
    if name == "losses":  # `liger_patch_kd.losses` without importing it first, as when it loaded eagerly
        return import_module(".losses", __name__)
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["KDLossConfig", "__version__", *_LAZY]
