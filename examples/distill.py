"""`liger-kd train` as a script, for launchers that take a file (`accelerate launch FILE`, `torchrun FILE`): the
same options, the same run. `liger-kd train --help` (or `python examples/distill.py --help`) lists them.

    accelerate launch --config_file examples/accelerate_fsdp2.yaml examples/distill.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --teacher_model_name_or_path Qwen/Qwen2.5-1.5B-Instruct \\
        --dataset_name trl-lib/Capybara --output_dir out --use_kd_patch --bf16 --max_steps 100

Offline (the teacher's top-k precomputed into a store first): `liger-kd precompute --teacher T --data rows.jsonl
--out kd_store`, then `--dataset_name kd_store` without a teacher. On-policy: `--kd_lmbda 0.5`.
"""

import sys

from liger_patch_kd.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
