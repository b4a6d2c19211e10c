"""The house rules of tools/check_layout.py hold for the whole package."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_layout_has_no_problem():
    spec = importlib.util.spec_from_file_location("check_layout", ROOT / "tools" / "check_layout.py")
    check_layout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check_layout)
    problems = check_layout.check(ROOT)
    assert not problems, "\n".join(problems)


def test_files_run_over_both_backends_build_their_data_on_the_device():
    """A test file parametrised over helpers.backends() must put its tensors on helpers.DEVICE. On a GPU machine
    the interpreter is off, so CPU tensors with backend="triton" are refused and the compiled kernel is never
    tested: the sampled loss's first GPU run failed that way (its log, sampled_gpu_tests.log, is in git at
    f966e27), which no CPU run can show, as DEVICE is the CPU there."""
    offenders = [
        path.name
        for path in sorted((ROOT / "tests").glob("test_*.py"))
        if "backends()" in (text := path.read_text()) and "DEVICE" not in text
    ]
    assert not offenders, f"run over backends() without helpers.DEVICE: {offenders}"


def _check_layout():
    spec = importlib.util.spec_from_file_location("check_layout", ROOT / "tools" / "check_layout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_cycle_between_files_of_one_package_is_reported(tmp_path):
    """Files of one room importing each other (one only for its type, one through its package's re-export) form a
    cycle; the check must see each of them (arguments -> served -> arguments was one)."""
    _write(tmp_path, {
        "liger_patch_kd/__init__.py": "",
        "liger_patch_kd/trainer/__init__.py": "from .settings import Settings\n",
        "liger_patch_kd/trainer/settings.py": "from .served import check\n\nclass Settings:\n    pass\n",
        "liger_patch_kd/trainer/served.py": (
            "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .settings import Settings\n\n"
            "def check(args: 'Settings') -> None:\n    pass\n"
        ),
        "liger_patch_kd/models/__init__.py": "from .heads import head\n",
        "liger_patch_kd/models/heads.py": "from .state import unwrap\n\ndef head():\n    return unwrap\n",
        "liger_patch_kd/models/state.py": "def unwrap():\n    from ..models import head\n    return head\n",
        "liger_patch_kd/models/fine.py": "from .state import unwrap\n",
    })  # fmt: skip
    problems = _check_layout().check(tmp_path, benchmarks=None)
    assert problems == [
        "import cycle: liger_patch_kd.models.heads -> liger_patch_kd.models.state",
        "import cycle: liger_patch_kd.trainer.served -> liger_patch_kd.trainer.settings",
    ], problems


def test_the_client_and_the_server_importing_each_other_are_reported(tmp_path):
    """The server sits above teacher/, so the layers alone let it import the client; APART refuses that, and the
    client importing the server, even for a type only (which the layer rules skip)."""
    _write(tmp_path, {
        "liger_patch_kd/__init__.py": "",
        "liger_patch_kd/wire/__init__.py": "",
        "liger_patch_kd/wire/formats.py": "",
        "liger_patch_kd/teacher/__init__.py": "",
        "liger_patch_kd/teacher/client/__init__.py": "",
        "liger_patch_kd/teacher/client/client.py": "from ...wire import formats\n",
        "liger_patch_kd/teacher/client/hints.py": (
            "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from ...server.limits import Limits\n"
        ),
        "liger_patch_kd/server/__init__.py": "",
        "liger_patch_kd/server/limits.py": "from ..wire.formats import *\n",
        "liger_patch_kd/server/app.py": "from ..teacher.client.client import API_KEY_ENV\nfrom .limits import *\n",
    })  # fmt: skip
    problems = _check_layout().check(tmp_path, benchmarks=None)
    assert problems == [
        "liger_patch_kd/server/app.py:1: imports liger_patch_kd.teacher.client.client: server and teacher.client "
        "never import each other (they meet in wire/)",
        "liger_patch_kd/teacher/client/hints.py:4: imports liger_patch_kd.server.limits: teacher.client and server "
        "never import each other (they meet in wire/)",
    ], problems


def test_rollouts_and_teachers_importing_each_other_are_reported(tmp_path):
    """The trainer's rollouts and teachers share one room of one layer, so the layers alone let each import the
    other; APART refuses both directions (what both need is a batch/ collator or row check)."""
    _write(tmp_path, {
        "liger_patch_kd/__init__.py": "",
        "liger_patch_kd/batch/__init__.py": "",
        "liger_patch_kd/batch/prompts.py": "",
        "liger_patch_kd/trainer/__init__.py": "",
        "liger_patch_kd/trainer/rollouts/__init__.py": "",
        "liger_patch_kd/trainer/rollouts/onpolicy.py": "from ...batch import prompts\nfrom ..teachers.plan import x\n",
        "liger_patch_kd/trainer/teachers/__init__.py": "",
        "liger_patch_kd/trainer/teachers/plan.py": "def f():\n    from ..rollouts import y\n",
    })  # fmt: skip
    problems = _check_layout().check(tmp_path, benchmarks=None)
    assert problems == [
        "liger_patch_kd/trainer/rollouts/onpolicy.py:2: imports liger_patch_kd.trainer.teachers.plan: trainer.rollouts "
        "and trainer.teachers never import each other (they meet in batch/)",
        "liger_patch_kd/trainer/teachers/plan.py:2: imports liger_patch_kd.trainer.rollouts: trainer.teachers and "
        "trainer.rollouts never import each other (they meet in batch/)",
    ], problems


def test_benchmarks_importing_each_other_are_reported(tmp_path):

    check_layout = _check_layout()
    _write(tmp_path, {
        "liger_patch_kd/__init__.py": "",
        **{f"liger_patch_kd/ops/op{i}.py": "" for i in range(40)},  # a large room is a review question, not a rule
        "liger_patch_kd/ops/long.py": "x = 1\n" * 2000,
        "benchmarks/__init__.py": "",
        "benchmarks/common.py": "",
        "benchmarks/bench_a.py": "from .bench_b import run\nfrom .common import *\n",
        "benchmarks/bench_b.py": "def run():\n    from benchmarks import bench_a\n",
        "benchmarks/bench_c.py": "from .common.steps import step\n",
        "benchmarks/common/steps.py": "from . import cuda_time\n",
        "benchmarks/loss/__init__.py": "",
        "benchmarks/loss/bench_d.py": "from ..training.bench_e import run\n",  # a room's benchmark is one too
        "benchmarks/training/__init__.py": "",
        "benchmarks/training/bench_e.py": "def run():\n    pass\n",
    })  # fmt: skip
    problems = check_layout.check(tmp_path)
    assert problems == [
        "benchmarks/bench_a.py:1: imports the benchmark benchmarks.bench_b: move what they share to benchmarks/common",
        "benchmarks/bench_b.py:2: imports the benchmark benchmarks.bench_a: move what they share to benchmarks/common",
        "benchmarks/loss/bench_d.py:1: imports the benchmark benchmarks.training.bench_e: move what they share to "
        "benchmarks/common",
        "import cycle between benchmarks: benchmarks.bench_a -> benchmarks.bench_b",
    ], problems


# The words the history rule refuses, put together here so that this file does not read as history itself.
ISSUE, WAVE, ROUND, SESSION = "iss" + "ue", "wa" + "ve", "rou" + "nd", "sess" + "ion"


def test_history_in_code_tests_and_docs_is_reported_and_things_named_session_are_not(tmp_path):
    _write(tmp_path, {
        "liger_patch_kd/__init__.py": "",
        "liger_patch_kd/engine.py": (
            f"\"\"\"The decode {SESSION} (cache, graph); one {SESSION} per model, the {SESSION}'s key.\"\"\"\n"
            f"MODES = ('{ISSUE}30-loss',)  # a mode named after a tracker number is history too\n"
        ),
        "tests/test_x.py": f"\"\"\"Bad replies are refused ({ISSUE} 38, item 2).\"\"\"\n# {ROUND} 3's probe\n",
        "benchmarks/run.sh": f"#!/bin/sh\n# the 2-GPU runs ({ISSUE.title()} #18)\n",
        "docs/page.md": (
            f"Added in {WAVE} 5, fixed in the third {SESSION}.\n"
            f"TRL #3055 and [trl {ISSUE} 3055](https://github.com/huggingface/trl/issues/3055) are another project's.\n"
            f"Values {ROUND} 2 decimals; a {SESSION} 2 later.\n"
        ),
    })  # fmt: skip
    problems = _check_layout().history_problems(tmp_path)
    assert [p.split(" is history")[0] for p in problems] == [
        f"liger_patch_kd/engine.py:2: '{ISSUE}30'",
        f"tests/test_x.py:1: '{ISSUE} 38'",
        f"tests/test_x.py:2: '{ROUND} 3'",
        f"benchmarks/run.sh:2: '{ISSUE.title()} #18'",
        f"docs/page.md:1: '{WAVE} 5'",
        f"docs/page.md:1: 'third {SESSION}'",
        f"docs/page.md:3: '{SESSION} 2'",
    ], problems


def test_prose_naming_a_file_module_or_path_that_does_not_exist_is_reported(tmp_path):
    _write(tmp_path, {
        "liger_patch_kd/__init__.py": "",
        "liger_patch_kd/teacher/__init__.py": "from .store import verify_store\n",
        "liger_patch_kd/teacher/store.py": "def verify_store():\n    pass\n",
        "liger_patch_kd/teacher/serve/__init__.py": "",
        "liger_patch_kd/teacher/serve/client.py": (
            '"""Asks the server (serve.py; the wire format: protocols.py, as in teacher/serve/wire/), see\n'
            "liger_patch_kd.teacher.store.verify_store, liger_patch_kd.teacher.verify_store and teacher.store, not\n"
            "liger_patch_kd.teacher.stores or models.cross_tokenizer; client.py, ./store.py, teacher/store.py,\n"
            'tests/test_store.py, tests/test_gone.py; trainer.train() and teacher.half() are objects\' methods."""\n'
            "# benchmarks/results/x_*.json and benchmarks/results/y_*.json; https://x.org/a/missing.py is a link\n"
            "x = 'missing.py in a string is code, not prose'\n"
        ),
        "liger_patch_kd/trainer/__init__.py": "",
        "liger_patch_kd/models/__init__.py": "",
        "tests/test_store.py": "",
        "benchmarks/results/x_1.json": "{}",
        "docs/guides/page.md": "See [the store](../teachers/store.md), [here](page.md) and MEASUREMENTS.md.\n",
        "docs/teachers/store.md": "",
        "docs/reference/generated.md": "gone.py: a generated page is checked through its source\n",
        "liger_patch_kd/reference/__init__.py": '"""The oracle (oracle.py)."""\n',
    })  # fmt: skip
    problems = _check_layout().stale_name_problems(tmp_path)
    assert problems == [
        "liger_patch_kd/reference/__init__.py:1: names oracle.py, which does not exist",
        "liger_patch_kd/teacher/serve/client.py:1: names serve.py, which does not exist",
        "liger_patch_kd/teacher/serve/client.py:1: names protocols.py, which does not exist",
        "liger_patch_kd/teacher/serve/client.py:1: names teacher/serve/wire/, which does not exist",
        "liger_patch_kd/teacher/serve/client.py:3: names liger_patch_kd.teacher.stores, which does not exist",
        "liger_patch_kd/teacher/serve/client.py:3: names models.cross_tokenizer, which does not exist",
        "liger_patch_kd/teacher/serve/client.py:4: names tests/test_gone.py, which does not exist",
        "liger_patch_kd/teacher/serve/client.py:5: names benchmarks/results/y_*.json, which does not exist",
        "docs/guides/page.md:1: names MEASUREMENTS.md, which does not exist",
    ], problems


def test_measured_figures_in_the_package_are_reported_and_sizes_are_not(tmp_path):
    _write(tmp_path, {
        "liger_patch_kd/__init__.py": "",
        "liger_patch_kd/kernel.py": (
            '"""One pass: 1.38 ms on a GPU, 3.4 TB/s, 650 TFLOP/s, 9,393 tokens/s, 4.9x faster than torch.\n\n'
            'A 1B model at 64 rows holds 3.4 GB on an H200. The chunk is 1 GiB; 16 rows; a 10 s timeout."""\n'
            "WAIT = 0.5  # 20 us a poll\n"
            "TEXT = 'a string: 5 ms is code, not prose'\n"
        ),
    })  # fmt: skip
    problems = _check_layout().measured_figure_problems(tmp_path)
    assert [p.split(" is a measured")[0] for p in problems] == [
        "liger_patch_kd/kernel.py:1: '1.38 ms'",
        "liger_patch_kd/kernel.py:1: '3.4 TB/s'",
        "liger_patch_kd/kernel.py:1: '650 TFLOP/s'",
        "liger_patch_kd/kernel.py:1: '9,393 tokens/s'",
        "liger_patch_kd/kernel.py:1: '4.9x faster'",
        "liger_patch_kd/kernel.py:3: '1B model at 64 rows holds 3.4 GB on an H200'",
        "liger_patch_kd/kernel.py:4: '20 us'",
    ], problems


def test_a_column_spelled_outside_the_contract_module_is_reported(tmp_path):
    """A known column name as a string literal anywhere in the package but batch/columns.py is a second spelling;
    docstrings and f-string text are prose, and other strings pass."""
    _write(tmp_path, {
        "liger_patch_kd/__init__.py": "",
        "liger_patch_kd/batch/__init__.py": "",
        "liger_patch_kd/batch/columns.py": (
            'TEACHER_TOKEN_IDS = "teacher_token_ids"\nCONTRACT_NAMES = frozenset({TEACHER_TOKEN_IDS})\n'
        ),
        "liger_patch_kd/trainer/__init__.py": "",
        "liger_patch_kd/trainer/rows.py": (
            '"""Reads teacher_token_ids."""\n\ndef ids(row):\n    return row["teacher_token_ids"]\n'
        ),
        "liger_patch_kd/trainer/prose.py": (
            '"""teacher_token_ids"""\n\ndef why(n):\n    return f"{n} teacher_token_ids", "teacher_tokens"\n'
        ),
    })  # fmt: skip
    problems = _check_layout().column_literal_problems(tmp_path)
    assert problems == [
        "liger_patch_kd/trainer/rows.py:4: spells the column 'teacher_token_ids': import its name from "
        "liger_patch_kd.batch.columns"
    ]


def test_the_contract_module_names_the_project_columns():
    names = _check_layout().contract_names(ROOT)
    assert {"teacher_token_ids", "teacher_logprobs", "teacher_input_ids", "kd_generated"} <= names
