"""Teacher data in other tools' formats, into a store and out of one: axolotl, Hugging Face `datasets`,
DistillKit, and the dumps of inference engines (vLLM, SGLang). `CONVERTERS` (converters.py) is the one table
`liger-kd convert` is built from; common.py holds what the converters share."""

from .axolotl import axolotl_to_store, store_to_axolotl
from .converters import CONVERTERS, Converter, ConvertOptions, convert
from .distillkit import distillkit_to_store, store_to_distillkit
from .engines import import_sglang_logprobs, import_vllm_logprobs
from .hf_datasets import dataset_to_store, load_table, store_to_dataset

__all__ = [
    "CONVERTERS",
    "ConvertOptions",
    "Converter",
    "axolotl_to_store",
    "convert",
    "dataset_to_store",
    "distillkit_to_store",
    "import_sglang_logprobs",
    "import_vllm_logprobs",
    "load_table",
    "store_to_axolotl",
    "store_to_dataset",
    "store_to_distillkit",
]
