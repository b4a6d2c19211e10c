"""The public surface: every exported name resolves, every architecture family has its apply function at the
root and in `liger_patch_kd.models`, and importing the package stays light."""

import importlib
import subprocess
import sys

import pytest

import liger_patch_kd
from liger_patch_kd.models.registry import family_names

PACKAGES = ["liger_patch_kd", "liger_patch_kd.losses", "liger_patch_kd.models", "liger_patch_kd.ops.divergence",
            "liger_patch_kd.models.state", "liger_patch_kd.losses.checks", "liger_patch_kd.trainer",
            "liger_patch_kd.teacher", "liger_patch_kd.align"]  # fmt: skip
ROOT_SUBPACKAGES = ("losses", "models", "trainer", "teacher", "align")  # every name of their __all__ at the root


@pytest.mark.parametrize("package", PACKAGES)
def test_every_name_in_all_resolves(package):
    module = importlib.import_module(package)
    missing = [name for name in module.__all__ if getattr(module, name, None) is None]
    assert not missing, f"{package}.__all__ names that do not resolve: {missing}"
    assert len(set(module.__all__)) == len(module.__all__), "a name is listed twice"


@pytest.mark.parametrize("family", family_names())
def test_every_family_has_its_apply_function_at_the_root_and_in_models(family):
    import liger_patch_kd.models as M

    name = f"apply_kd_patch_to_{family}"
    assert name in M.__all__ and callable(getattr(M, name))
    assert name in liger_patch_kd.__all__ and getattr(liger_patch_kd, name) is getattr(M, name)


def test_root_exports_what_models_and_losses_export():
    import liger_patch_kd.losses as losses
    import liger_patch_kd.models as M

    assert set(M.__all__) <= set(liger_patch_kd.__all__)
    assert set(losses.__all__) <= set(liger_patch_kd.__all__)


def test_root_exports_every_public_name_of_the_trainer_teacher_and_align_once():
    """The names the docs cite (verify_store, import_sglang_logprobs, KDTrainer, PrivilegedCollator, VocabMap ...)
    import from the package root as the same objects, and no two subpackages declare one name."""
    seen = {}
    for sub in ROOT_SUBPACKAGES:
        module = importlib.import_module(f"liger_patch_kd.{sub}")
        for name in module.__all__:
            assert name not in seen, f"{name} is declared by both {seen[name]} and {sub}"
            seen[name] = sub
            assert getattr(liger_patch_kd, name) is getattr(module, name), name
    assert set(seen) | {"KDLossConfig", "__version__"} == set(liger_patch_kd.__all__)
    for name in ("verify_store", "import_sglang_logprobs", "KDTrainer", "KDTrainingArguments", "TeacherClient"):
        assert name in seen


def test_import_does_not_load_the_trainer_transformers_or_dynamo():
    code = (
        "import sys, liger_patch_kd; "
        "print(sorted(m for m in ('torch._dynamo', 'transformers', 'transformers.trainer') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize(
    "function",
    [
        "fused_linear_jsd", "fused_linear_topk_kd", "kl_estimator", "topk_kd_from_logprobs", "apply_kd_patch",
        "FusedLinearJSDLoss", "FusedLinearTopKKDLoss",
    ],
)  # fmt: skip
def test_entry_points_document_args_and_returns(function):
    doc = getattr(liger_patch_kd, function).__doc__
    assert "Args:" in doc and "{" not in doc, doc
    if not function.startswith("Fused"):
        assert "Returns:" in doc
