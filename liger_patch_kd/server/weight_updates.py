"""Full-weight updates of the served model checked whole before any weight changes: an update is all or nothing.

Every tensor must name a parameter or buffer of the model, with its shape and a dtype of the same kind (a float
for a float weight: an int64 tensor cast into float weights would load ids as weights), every storage of the model
be given exactly once (tied embeddings), and every parameter's values be finite. A safetensors file is checked
from its header (names, shapes, dtypes) before its tensors are read, so a truncated file or one of the wrong model
is refused without reading gigabytes. Each refusal is a RequestError(400) whose one line names the tensor (or
field) and the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..utils.errors import reason_of
from ..wire.conventions import is_int
from .validation import RequestError

TensorSpec = tuple[tuple[int, ...], torch.dtype]


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "integer"


def check_update(model: torch.nn.Module, tensors: dict[str, TensorSpec]) -> None:
    """RequestError(400) unless `tensors` (name -> (shape, dtype)) can replace the model's own, as a whole."""
    own = model.state_dict()
    for name, (shape, dtype) in tensors.items():
        if name not in own:
            raise RequestError(400, f"tensor {name!r} is not a parameter or buffer of the served model "
                                    f"({type(model).__name__}); is it another architecture?")  # fmt: skip
        if tuple(shape) != tuple(own[name].shape):
            raise RequestError(400, f"tensor {name!r} has shape {tuple(shape)}, the served model's "
                                    f"{tuple(own[name].shape)}")  # fmt: skip
        if _kind(dtype) != _kind(own[name].dtype):
            want, got = (str(d).removeprefix("torch.") for d in (own[name].dtype, dtype))
            raise RequestError(400, f"tensor {name!r} is {got}, the served model's is {want}: send it as a "
                                    f"{_kind(own[name].dtype)} tensor (e.g. {want})")  # fmt: skip
    # every storage of the served model exactly once: a tied student sends its embedding alone (an untied
    # served lm_head would stay old), an untied one sends both (a tied served model would keep the last)
    storages: dict[Any, list[str]] = {}
    for name, tensor in own.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        storages.setdefault(key if tensor.numel() else name, []).append(name)  # empty tensors share no storage
    for names in storages.values():
        sent = [n for n in names if n in tensors]
        if len(sent) != 1:
            raise RequestError(400, f"the update gives {sent or 'none'} of the served model's {names} (one "
                                    f"storage): serve a model with the student's tie_word_embeddings and send "
                                    f"every tensor")  # fmt: skip


def check_finite(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """RequestError(400) naming the first parameter whose new values hold NaN or an infinity, or would once cast
    to the served dtype (1e300 sent as float64 into float32 weights, 1e5 into float16 ones, are infinities there);
    buffers, such as masks, may hold -inf by design."""
    params = dict(model.named_parameters())
    for name, tensor in state.items():
        if name not in params or not tensor.is_floating_point():
            continue
        if not torch.isfinite(tensor).all():
            raise RequestError(400, f"tensor {name!r} holds NaN or infinite values: the served model would answer "
                                    f"NaN; no weight changed")  # fmt: skip
        served = params[name].dtype
        if served.is_floating_point and not torch.isfinite(tensor.to(served)).all():  # one tensor's copy at a time
            largest = tensor.abs().max().item()
            raise RequestError(400, f"tensor {name!r} holds values up to {largest:.3g}, past the served model's "
                                    f"{str(served).removeprefix('torch.')} range (max {torch.finfo(served).max:.3g}): "
                                    f"they would load as infinities; no weight changed")  # fmt: skip


def tensor_specs(names: Any, dtype_names: Any, shapes: Any) -> dict[str, TensorSpec]:
    """vLLM's update_info lists -> name -> (shape, dtype), or RequestError(400) naming the entry: each shape a list
    of ints >= 0, each dtype a torch dtype's name, each name a string given once."""
    if not all(isinstance(v, list) for v in (names, dtype_names, shapes)):
        raise RequestError(400, "update_info.names, dtype_names and shapes must be lists")
    if not (len(names) == len(dtype_names) == len(shapes)):
        raise RequestError(400, f"update_info: names, dtype_names and shapes differ in length "
                                f"({len(names)}, {len(dtype_names)}, {len(shapes)})")  # fmt: skip
    specs: dict[str, TensorSpec] = {}
    for n, (name, dtype_name, shape) in enumerate(zip(names, dtype_names, shapes)):
        if not isinstance(name, str) or not name or name in specs:
            raise RequestError(400, f"update_info.names[{n}] must be a tensor name given once; got {name!r:.60}")
        if not (isinstance(shape, list) and all(is_int(x) and x >= 0 for x in shape)):
            raise RequestError(400, f"update_info.shapes[{n}] ({name}) must be a list of ints >= 0; got "
                                    f"{shape!r:.60}")  # fmt: skip
        dtype = getattr(torch, str(dtype_name).removeprefix("torch."), None) if isinstance(dtype_name, str) else None
        if not isinstance(dtype, torch.dtype):
            raise RequestError(400, f"update_info.dtype_names[{n}] ({name}): {dtype_name!r:.40} is not a torch dtype "
                                    f"(e.g. 'bfloat16')")  # fmt: skip
        specs[name] = (tuple(shape), dtype)
    return specs


def read_safetensors(path: str, check: Callable[[dict[str, TensorSpec]], None]) -> dict[str, torch.Tensor]:
    """The tensors of a .safetensors file, or of every one in a directory: their headers read first and passed to
    `check` (which raises to refuse), then the tensors; a file that does not read is a RequestError(400)."""
    from safetensors import safe_open

    root = Path(path)
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else [root]
    if not files or not all(f.is_file() and f.suffix == ".safetensors" for f in files):
        raise RequestError(400, f"model_path {path!r} is neither a .safetensors file nor a directory of them")
    try:
        specs, owner = {}, {}
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    if name in owner:
                        raise RequestError(400, f"model_path {path!r}: tensor {name!r} is in both {owner[name].name} "
                                                f"and {f.name}; send each tensor once")  # fmt: skip
                    sliced = handle.get_slice(name)
                    specs[name], owner[name] = (tuple(sliced.get_shape()), _safetensors_dtype(sliced)), f
        check(specs)
        state = {}
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                state.update({name: handle.get_tensor(name) for name in handle.keys()})
        return state
    except RequestError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors' own errors (a truncated header or data): the file's fault
        raise RequestError(400, f"model_path {path!r} does not read as safetensors ({reason_of(e, 200)}); is a file "
                                f"truncated? write it again") from None  # fmt: skip


def _safetensors_dtype(sliced: Any) -> torch.dtype:
    names = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
             "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
             "F8_E5M2": "float8_e5m2", "U16": "uint16", "U32": "uint32", "U64": "uint64"}  # fmt: skip
    code = sliced.get_dtype()
    if code not in names:
        raise ValueError(f"dtype {code} is not one torch loads")
    return getattr(torch, names[code])
