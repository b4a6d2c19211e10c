"""examples/recipes/: each `liger-kd train` config is one of the accuracy benchmark's recipes (the same objective,
option for option, and the same learning rate relative to the others), and each runs as written on tiny stand-ins
of its hub models and dataset (tests/hub_standins.py), with only its length and device overridden. The served
teacher's config is checked as parsed: its server is the served-teacher tests' business."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from benchmarks.accuracy.bench_time_to_accuracy import OFFLINE, OURS_GKD, RECIPES, SERVED_GKD
from liger_patch_kd import KDTrainingArguments, cli
from liger_patch_kd.train_cli import parser as train_parser
from liger_patch_kd.train_cli import run as train_run

from .hub_standins import DATASET_ID, STUDENT_ID, TEACHER_ID, make_hub_standins

pytestmark = pytest.mark.usefixtures("clean_patches")
RECIPES_DIR = Path(__file__).resolve().parents[1] / "examples" / "recipes"
RECIPE_OF = {  # config -> the benchmark's recipe it is
    "off-policy-jsd.yaml": "off-policy KD, JSD (beta 0.5)",
    "off-policy-forward-kl.yaml": "off-policy KD, forward KL (beta 0)",
    "on-policy-gkd.yaml": OURS_GKD,
    "gkd-mix.yaml": "GKD mix (lmbda 0.5, warm-up 25 %)",
    "reverse-kl-pg.yaml": "on-policy reverse KL (pg)",
    "sequence-kd.yaml": "SFT on teacher samples (seq KD)",
    "offline-on-policy.yaml": OFFLINE,
    "served-teacher.yaml": SERVED_GKD,
}
# the options that make the objective (the rest: lengths, batch, models, where things are)
OBJECTIVE = ("kd_beta", "kd_lmbda", "kd_onpolicy_loss", "kd_seq_kd", "kd_soft_weight", "kd_hard_weight",
             "kd_onpolicy_warmup_steps", "kd_temperature", "kd_teacher_protocol", "kd_store_refresh_steps",
             "kd_store_refresh_fraction")  # fmt: skip
BASE_LR = 1.0e-5  # the configs' learning rate where the benchmark uses its --lr (1e-3 there)
SHORT = ["--max_steps", "2", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
         "--logging_steps", "1", "--use_cpu", "--report_to", "none", "--disable_tqdm", "true",
         "--kd_max_new_tokens", "8"]  # fmt: skip


def defaults() -> dict:
    return {f.name: f.default for f in dataclasses.fields(KDTrainingArguments) if f.name in OBJECTIVE}


def test_every_config_is_a_benchmark_recipe_option_for_option():
    assert sorted(p.name for p in RECIPES_DIR.glob("*.yaml")) == sorted(RECIPE_OF)
    for name, recipe in RECIPE_OF.items():
        # --use_cpu: the configs' bf16 is a GPU's; on a machine without one it is refused unless the CPU is asked for
        _, _, training = train_parser.parse(["--config", str(RECIPES_DIR / name), "--use_cpu"])
        wanted = {**defaults(), **{k: v for k, v in RECIPES[recipe].items() if k in OBJECTIVE}}
        assert {k: getattr(training, k) for k in OBJECTIVE} == wanted, name
        relative = RECIPES[recipe].get("learning_rate", 1e-3) / 1e-3
        assert training.learning_rate == pytest.approx(BASE_LR * relative), name
        assert training.use_kd_patch and training.bf16, name


@pytest.fixture(scope="module")
def standins(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hub")
    make_hub_standins(root)
    return root


@pytest.mark.parametrize("name", [n for n in RECIPE_OF if n not in ("offline-on-policy.yaml", "served-teacher.yaml")])
def test_each_live_teacher_config_trains_as_written(standins, monkeypatch, tmp_path, name):
    monkeypatch.chdir(standins)  # the hub ids resolve to the stand-ins' folders
    out = tmp_path / "out"
    trainer = train_run.train(["--config", str(RECIPES_DIR / name), *SHORT, "--output_dir", str(out)])
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert trainer.state.global_step == 2 and losses and all(torch.isfinite(torch.tensor(losses)))
    assert (out / "model.safetensors").exists()


def test_the_offline_config_trains_on_the_store_its_comment_makes(standins, monkeypatch, tmp_path):
    """The comment's precompute command (shortened), then the config as written: its dataset_name is that store."""
    monkeypatch.chdir(standins)
    config = (RECIPES_DIR / "offline-on-policy.yaml").read_text()
    store = next(line.split(":")[1].split("#")[0].strip() for line in config.splitlines()
                 if line.startswith("dataset_name:"))  # fmt: skip
    assert f"--out {store}" in config and f"--rollouts-from {STUDENT_ID}" in config and TEACHER_ID in config
    prompts = tmp_path / "prompts.jsonl"
    rows = [json.loads(line) for line in (standins / DATASET_ID / "train.jsonl").read_text().splitlines()][:4]
    prompts.write_text("".join(json.dumps({"prompt": r["messages"][:1]}) + "\n" for r in rows))
    assert cli.main(["precompute", "--rollouts-from", STUDENT_ID, "--teacher", TEACHER_ID, "--data", str(prompts),
                     "--max-new-tokens", "8", "--top-k", "32", "--out", store, "--device", "cpu"]) == 0  # fmt: skip
    try:
        trainer = train_run.train(["--config", str(RECIPES_DIR / "offline-on-policy.yaml"), *SHORT[:-2],
                                   "--output_dir", str(tmp_path / "out")])  # fmt: skip
    finally:
        import shutil

        shutil.rmtree(standins / store)  # the module's stand-ins stay as the other tests found them
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert trainer.state.global_step == 2 and losses and all(torch.isfinite(torch.tensor(losses)))
