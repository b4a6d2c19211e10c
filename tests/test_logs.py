"""The package's log lines follow the Trainer's log level (utils/logs.py): `log_level="info"` (`liger-kd train
--log_level info`) shows them as transformers' own show, with no logging set up by the user, and a user's own
logging set-up is neither quietened nor doubled. Run in fresh interpreters: pytest puts handlers on the root logger,
which is the very case the handler rule reads."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)  # fmt: skip


def test_package_lines_show_at_an_explicit_level_once_through_one_handler_of_its_own():
    done = _run("""
        import logging
        from liger_patch_kd.utils.logs import follow_log_level
        log = logging.getLogger("liger_patch_kd.some.module")
        log.info("hidden: nothing asked for INFO")
        follow_log_level(logging.INFO, explicit=True)
        follow_log_level(logging.INFO, explicit=True)  # a second trainer adds no second handler
        log.info("shown once")
        log.debug("below the level")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "[liger_patch_kd] shown once\n"


def test_a_users_logging_is_kept_neither_quietened_by_a_passive_level_nor_doubled():
    done = _run("""
        import logging
        logging.basicConfig(level=logging.INFO, format="user: %(name)s %(message)s")
        from liger_patch_kd.utils.logs import follow_log_level
        follow_log_level(logging.WARNING, explicit=False)  # log_level "passive": transformers' WARNING
        logging.getLogger("liger_patch_kd.x").info("still shown")
        follow_log_level(logging.INFO, explicit=True)
        logging.getLogger("liger_patch_kd.x").info("in the user's format, once")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "user: liger_patch_kd.x still shown\nuser: liger_patch_kd.x in the user's format, once\n"


def test_a_passive_level_leaves_the_package_quiet_and_an_explicit_error_level_quietens_it():
    done = _run("""
        import logging
        from liger_patch_kd.utils.logs import follow_log_level
        follow_log_level(logging.WARNING, explicit=False)
        logging.getLogger("liger_patch_kd.x").info("hidden")
        logging.getLogger("liger_patch_kd.x").warning("a warning")
        follow_log_level(logging.ERROR, explicit=True)
        logging.getLogger("liger_patch_kd.x").warning("quietened")
        print(logging.getLogger("liger_patch_kd").level)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "a warning\n"  # Python's last-resort handler: no format, as before any trainer
    assert done.stdout.strip() == str(40)


def test_kdtrainer_with_log_level_info_shows_how_the_first_on_policy_step_generates():
    """The way a user meets it: KDTrainingArguments(log_level="info") and train(), no logging set up."""
    done = _run("""
        import tempfile
        import torch
        from transformers import PreTrainedTokenizerFast
        from liger_patch_kd import KDTrainer, KDTrainingArguments
        from liger_patch_kd.demo.cross_tokenizer import train_bpe_tokenizer
        from tests.tiny_models import tiny_model

        text = "the cat sat on the mat. a dog ran to the park. the sun is warm today. " * 20
        tok = PreTrainedTokenizerFast(tokenizer_object=train_bpe_tokenizer(text, 200), pad_token="<pad>",
                                      bos_token="<s>", eos_token="</s>")
        args = KDTrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2, max_steps=1,
                                   report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
                                   dataloader_num_workers=0, use_kd_patch=True, kd_lmbda=1.0, kd_max_new_tokens=3,
                                   remove_unused_columns=False, log_level="info", logging_steps=1)
        trainer = KDTrainer(model=tiny_model("llama", dtype=torch.float32, seed=1),
                            teacher_model=tiny_model("llama", dtype=torch.float32, seed=2), processing_class=tok,
                            args=args, train_dataset=[{"prompt": "the cat"}, {"prompt": "a dog ran"}])
        trainer.train()
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("[liger_patch_kd] on-policy step 0: ")]
    assert len(said) == 1, done.stderr[-3000:]
    assert "the student samples 2 completions (2 prompts x 1) of up to 3 new tokens" in said[0]
