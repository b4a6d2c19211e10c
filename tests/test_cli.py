"""The CLI's first hour: every mistake is one line naming the option and the fix, exit status 2, no traceback and
nothing left behind; --help and argument errors import no torch. Each case runs `python -m liger_patch_kd.cli` (or
examples/distill.py) in a subprocess, as a user would."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import subprocess_env

ROOT = Path(__file__).resolve().parents[1]


def run(*argv: str, script: list[str] | None = None, env: dict | None = None, cwd=None):
    cmd = [sys.executable, *(script or ["-m", "liger_patch_kd.cli"]), *argv]
    environ = subprocess_env(**{"LIGER_KD_DEBUG": "", **(env or {})})
    return subprocess.run(cmd, capture_output=True, text=True, env=environ, cwd=cwd or ROOT, timeout=300)


def assert_one_line_error(out, command: str, *needles: str) -> str:
    """Exit status 2, no traceback, one line `liger-kd <command>: error: ...` (after any progress noise) naming
    every needle."""
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith(f"{command}: error: "), out.stderr
    assert all(n in line for n in needles), (needles, line)
    return line


def test_help_and_argument_errors_import_no_torch():
    """`liger-kd --help` took 6 s importing torch: help, usage errors (an unknown option, a missing required one)
    and the torch-free checks must not, and their lines are the ones a user reads. `liger-kd train` is not here: its
    parser is transformers' HfArgumentParser over KDTrainingArguments, which imports torch."""
    code = """
import sys
from liger_patch_kd import cli
for argv in (["--help"], ["demo", "--help"], ["precompute", "--help"], ["convert", "--help"], ["serve", "--help"],
             ["bench", "--help"], [], ["demo", "--bogus"], ["bench", "--bogus"], ["convert", "--from", "nope"],
             ["precompute"], ["serve"], ["serve", "--teacher", "x", "--port", "99999"],
             ["precompute", "--teacher", "x", "--data", "setup.cfg", "--out", "o", "--temperature", "0"],
             ["precompute", "--teacher", "/nonexistent/model", "--data", "setup.cfg", "--out", "o"]):
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    assert rc in (0, 2), (argv, rc)
print("TORCH", "torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=subprocess_env(), timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "TORCH False", out.stdout
    errors = out.stderr.splitlines()
    for line in (
        "liger-kd bench: error: unrecognized arguments: --bogus (see liger-kd bench --help)",
        "liger-kd precompute: error: the following arguments are required: --data, --out (see liger-kd precompute "
        "--help)",
        "liger-kd serve: error: the following arguments are required: --teacher (see liger-kd serve --help)",
    ):
        assert line in errors, (line, out.stderr)


def test_usage_errors_are_one_line_naming_the_command():
    line = assert_one_line_error(run("demo", "--bogus"), "liger-kd demo", "--bogus", "liger-kd demo --help")
    assert "usage:" not in line
    assert_one_line_error(run(), "liger-kd", "command")


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["serve", "--teacher", "x", "--port", "99999"], ["--port 99999", "1..65535"]),
        (["serve", "--teacher", "x", "--port", "0"], ["--port 0"]),
        (["precompute", "--temperature", "0"], ["--temperature 0", "> 0"]),
        (["precompute", "--top-k", "0"], ["--top-k 0", ">= 1"]),
        (["precompute", "--samples", "256"], ["--samples 256", "in 0..255"]),
        (["precompute", "--samples", "4", "--top-k", "-1"], ["--top-k -1", ">= 0"]),
        (["precompute", "--max-length", "0"], ["--max-length 0", ">= 1", "leave --max-length out"]),
        (["precompute", "--encoding", "packed99"], ["--encoding packed99", "plain", "packed4", "packed16"]),
        (["precompute", "--encoding", "zip"], ["--encoding zip", "plain", "packed10"]),
        (["precompute", "--teacher", "/nonexistent/model"], ["--teacher /nonexistent/model", "no such file"]),
        (["precompute", "--data", "missing.jsonl"], ["--data missing.jsonl", "no such file"]),
        (["convert", "--from", "store", "--to", "hf", "--input", "/nonexistent/store"], ["--input /nonexistent"]),
        (["convert", "--from", "store", "--to", "store", "--input", ".", "--encoding", "packed99"], ["packed16"]),
    ],
)
def test_bad_options_fail_before_any_work(argv, needles, tmp_path):
    """The torch-free checks: each names its option and the fix (the teacher pass never starts)."""
    command = argv[0]
    defaults = {"precompute": ["--teacher", "org/model", "--data", str(ROOT / "setup.cfg"), "--out", "o"],
                "convert": ["--out", "o"]}.get(command, [])  # fmt: skip
    given = set(argv)
    extra = [a for opt, val in zip(defaults[::2], defaults[1::2]) if opt not in given for a in (opt, val)]
    out = run(*argv, *extra, cwd=tmp_path)
    assert_one_line_error(out, f"liger-kd {command}", *needles)
    assert not (tmp_path / "o").exists()
    if command == "serve":
        assert out.stdout == "", "nothing printed (no address) before the check"


@pytest.mark.parametrize("argv", [["demo", "--device", "tpu"], ["bench", "--device", "cuda"]])
def test_a_device_this_build_lacks_is_one_line(argv):
    import torch

    if argv[-1] == "cuda" and torch.cuda.is_available():
        pytest.skip("this build has CUDA")
    line = assert_one_line_error(run(*argv), f"liger-kd {argv[0]}", f"--device {argv[-1]}")
    assert "--device cpu" in line or "leave --device out" in line


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_convert_from_hf_names_the_missing_columns_and_writes_nothing(tmp_path):
    pytest.importorskip("datasets", reason="reading a .jsonl table for --from hf needs the datasets package")
    data = _jsonl(tmp_path / "rows.jsonl", [{"input_ids": [1, 2, 3], "ids": [[1], [2], [3]]}])
    out = run("convert", "--from", "hf", "--to", "store", "--input", str(data), "--out", str(tmp_path / "out"),
              "--vocab-size", "10", "--top-k", "1")  # fmt: skip
    assert_one_line_error(out, "liger-kd convert", "teacher_token_ids", "teacher_logprobs", "found input_ids, ids")
    assert not (tmp_path / "out").exists()


def test_a_failed_convert_removes_the_output_it_created(tmp_path):
    """The columns are there, a value is not right (an id outside --vocab-size): no half-written store remains."""
    row = {"input_ids": [1, 2, 3], "teacher_token_ids": [[1], [99], [2]], "teacher_logprobs": [[-0.1]] * 3}
    data = _jsonl(tmp_path / "rows.jsonl", [row])
    out = run("convert", "--from", "hf", "--to", "store", "--input", str(data), "--out", str(tmp_path / "out"),
              "--vocab-size", "10", "--top-k", "1")  # fmt: skip
    assert_one_line_error(out, "liger-kd convert")
    assert not (tmp_path / "out").exists(), sorted(p.name for p in (tmp_path / "out").iterdir())


@pytest.mark.parametrize("to_format, name", [("hf", "table.parquet"), ("axolotl", "rows.jsonl"), ("hf", "folder")])
def test_an_export_never_overwrites_what_is_there(tmp_path, to_format, name):
    """`--to hf` wrote over an existing .parquet (the store writer refuses a file): one line naming the path, and
    the file (or folder) left byte for byte as it was, not removed as a half-written output either."""
    import numpy as np

    from liger_patch_kd import teacher as TD

    rows = [{"input_ids": [1, 2, 3], "teacher_token_ids": [[1], [2], [0]], "teacher_logprobs": np.log([[0.5]] * 3)}]
    TD.dataset_to_store([{**r, "teacher_logprobs": r["teacher_logprobs"].tolist()} for r in rows], tmp_path / "s",
                        vocab_size=10, top_k=1)  # fmt: skip
    target = tmp_path / name
    if name == "folder":
        target.mkdir()
        (target / "keep.txt").write_text("mine")
    else:
        target.write_bytes(b"someone else's data")
    before = {p: p.read_bytes() for p in [target, *target.rglob("*")] if p.is_file()}
    out = run("convert", "--from", "store", "--to", to_format, "--input", str(tmp_path / "s"), "--out", str(target))
    assert_one_line_error(out, "liger-kd convert", f"--out {target} already exists", "another --out")
    assert {p: p.read_bytes() for p in [target, *target.rglob("*")] if p.is_file()} == before


def test_debug_shows_the_traceback():
    argv = ["serve", "--teacher", "x", "--port", "99999"]
    for out in (run(*argv, "--debug"), run(*argv, env={"LIGER_KD_DEBUG": "1"})):
        assert out.returncode != 0 and "Traceback" in out.stderr and "--port 99999" in out.stderr, out.stderr


def test_the_example_script_is_liger_kd_train(tmp_path):
    """examples/distill.py is `liger-kd train` for launchers that take a file: the same one-line mistakes."""
    script = [str(ROOT / "examples" / "distill.py")]
    out = run("--model_name_or_path", str(tmp_path), "--teacher_model_name_or_path", "/nonexistent/model",
              "--dataset_name", "x.jsonl", script=script, cwd=tmp_path)  # fmt: skip
    assert_one_line_error(out, "liger-kd train", "--teacher_model_name_or_path /nonexistent/model", "no such file")
    out = run("--model_name_or_path", str(tmp_path), "--dataset_name", "./x.jsonl", script=script, cwd=tmp_path)
    assert_one_line_error(out, "liger-kd train", "--dataset_name ./x.jsonl", "no such file")


def test_the_cli_tables_match_the_library():
    """cli.py spells out the formats and packed encodings (so --help needs no torch): they are the library's."""
    from liger_patch_kd import cli_checks as cli
    from liger_patch_kd.teacher.formats import CONVERTERS
    from liger_patch_kd.teacher.store.compact import codec_from_spec

    assert cli.FORMATS == tuple(CONVERTERS)
    for bits in range(0, 24):
        try:
            codec_from_spec(f"packed{bits}", vocab_size=1000, top_k=8)
            accepted = True
        except ValueError:
            accepted = False
        assert accepted == (bits in cli.PACKED_BITS), bits


@pytest.mark.parametrize(
    "name, is_path",
    [("org/model", False), ("gpt2", False), ("/abs/model", True), ("./model", True), ("~/m", True), ("a/b/c", True)],
)
def test_what_counts_as_a_path(name, is_path):
    from liger_patch_kd import cli_checks

    assert cli_checks.looks_like_path(name) is is_path


def test_serve_precision_choices_are_the_teacher_precisions():
    """The CLI spells its --precision choices out (it imports no torch to parse arguments): they are the
    package's TEACHER_PRECISIONS, the one list KDTrainingArguments checks too."""
    from liger_patch_kd import cli
    from liger_patch_kd.models import TEACHER_PRECISIONS

    serve = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices["serve"]._actions
                 if "--precision" in a.option_strings)  # fmt: skip
    assert tuple(serve.choices) == TEACHER_PRECISIONS


@pytest.mark.parametrize("flag, fused", [([], True), (["--no-fused-projections"], False)])
def test_serve_passes_the_samplers_projection_setting(monkeypatch, flag, fused):
    from liger_patch_kd import cli
    from liger_patch_kd.server import app as server

    seen = {}
    monkeypatch.setattr(server, "serve", lambda teacher, **kw: seen.update(kw))
    args = cli.build_parser().parse_args(["serve", "--teacher", "x", *flag])
    args.func(args)
    assert seen["fuse_projections"] is fused


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["precompute", "--teacher", "org/model", "--data", str(ROOT / "setup.cfg"), "--out", "o.parquet"],
         ["--out o.parquet", "store folder", "--out o/"]),
        (["convert", "--from", "store", "--to", "store", "--input", ".", "--out", "o.parquet"],
         ["--out o.parquet", "--to store writes a store folder", "--out o/"]),
        (["convert", "--from", "store", "--to", "distillkit", "--input", ".", "--out", "o.parquet"],
         ["--out o.parquet", "--to distillkit writes a folder", "--out o/"]),
    ],
)  # fmt: skip
def test_a_file_name_for_a_folder_output_is_refused(argv, needles, tmp_path):
    """A store and a DistillKit capture are folders: `--out x.parquet` would make a folder named like a file."""
    assert_one_line_error(run(*argv, cwd=tmp_path), f"liger-kd {argv[0]}", *needles)
    assert not (tmp_path / "o.parquet").exists() and not (tmp_path / "o").exists()


def test_a_flags_help_shows_no_stored_default():
    """`--no-fused-projections` stores False when given: its help must not read "(default: True)"; options with a
    value still show theirs."""
    out = run("serve", "--help")
    text = " ".join(out.stdout.split())
    flag = text[text.index("--no-fused-projections sample") :]
    flag = flag[: flag.index("--attn-implementation")]
    assert "(default: True)" not in flag and "(default: False)" not in flag, flag
    assert "(default: 8000)" in text  # --port


def test_bench_has_its_own_heading(monkeypatch):
    """`liger-kd bench` is the demo's first step alone: it must not announce itself as step [1/5] of five."""
    import liger_patch_kd.demo as demo
    from liger_patch_kd import cli

    headings = []
    monkeypatch.setattr(demo, "loss_memory_demo", lambda device, heading="[1/5]": headings.append(heading))
    assert cli.main(["bench", "--device", "cpu"]) == 0
    assert headings and "/5]" not in headings[0] and "bench" in headings[0]


def test_kd_self_distill_parses_its_choices_on_a_command_line():
    """Typed as a Literal: HfArgumentParser offers exactly the modes and gives back the same values as Python."""
    from transformers import HfArgumentParser

    from liger_patch_kd import KDTrainingArguments

    def parsed(*argv):
        (args,) = HfArgumentParser(KDTrainingArguments).parse_args_into_dataclasses(["--output_dir", "o", *argv])
        return args.kd_self_distill

    assert parsed() is False and parsed("--kd_self_distill", "True") is True
    assert parsed("--kd_self_distill", "frozen") == "frozen" and parsed("--kd_self_distill", "adapter") == "adapter"
    with pytest.raises(SystemExit):
        parsed("--kd_self_distill", "copy")


def test_bench_reports_an_out_of_memory_row_instead_of_stopping(monkeypatch, capsys):
    """On a GPU too small for the materialised logits, `liger-kd bench` prints that row as out of memory and ends
    its table, instead of stopping after its heading with a traceback."""
    import torch

    from liger_patch_kd import reference
    from liger_patch_kd.demo import loss_memory_demo

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(reference, "kd_loss", no_memory)
    loss_memory_demo(torch.device("cpu"), heading="bench")
    lines = capsys.readouterr().out.splitlines()
    fused = next(line for line in lines if line.startswith("fused"))
    materialised = next(line for line in lines if line.startswith("materialised logits"))
    assert "out of memory" in materialised and "out of memory" not in fused and "peak MiB:" in lines[-1]


def test_an_interrupted_command_says_what_it_kept_and_how_to_go_on(capsys):
    """Ctrl-C: status 130, one line; a precompute says its finished shards are kept and a rerun resumes from them."""
    from liger_patch_kd import cli

    def interrupted():
        raise KeyboardInterrupt

    assert cli._guarded("precompute", interrupted, debug=False) == 130
    said = capsys.readouterr().err
    assert said == ("liger-kd precompute: interrupted; any shard finished so far is kept: rerun the same command to "
                    "resume\n")  # fmt: skip
    assert cli._guarded("serve", interrupted, debug=False) == 130
    assert capsys.readouterr().err == "liger-kd serve: interrupted\n"
