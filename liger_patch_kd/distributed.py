"""Getting the full lm_head weight to the fused loss under FSDP2, FSDP1 and DeepSpeed ZeRO-3.

The fused loss reads `lm_head.weight` directly (it never calls lm_head), so it must run where the weight is
whole. The patched forward arranges that:

* FSDP2 (`fully_shard`) and FSDP1 (`FullyShardedDataParallel`, `use_orig_params` True or False): parameters
  of a unit are gathered for the duration of that unit's forward. The KD forward *is* the root unit's
  forward (and the teacher's hidden states and weight are handed over inside the teacher's own forward,
  see `models.kd_forward.call_teacher`; a loss computed outside the KD forward, across tokenizers, runs inside
  the student's forward through `call_student`), so `lm_head.weight` is whole there and its gradient flows back to
  the sharded parameter through FSDP's own hooks. This holds as long as lm_head stays in the root unit —
  the default when you wrap the decoder layers and then the model. A separately wrapped lm_head is caught
  by `check_full_weight` with an explanation instead of a size mismatch or a silently wrong loss.
* DeepSpeed ZeRO-3 partitions every parameter and gathers it only inside its own module's forward;
  `gathered_weights` gathers lm_head's for the loss (deepspeed is an optional extra, imported lazily).

Nothing here imports transformers or the models: the patched forward and the trainer use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn


def is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def check_full_weight(weight: torch.Tensor, expected_shape: tuple[int, int] | None, role: str) -> None:
    """Raise a clear ValueError when `weight` is a shard rather than the whole lm_head weight."""
    if is_dtensor(weight):
        raise ValueError(
            f"the {role}'s lm_head.weight is a sharded DTensor (placements {weight.placements}) at loss time: "
            f"lm_head was given its own fully_shard unit. Keep it in the root unit (fully_shard the decoder "
            f"layers, then the whole model), so it is gathered during the model's forward"
        )
    if expected_shape is not None and tuple(weight.shape) != tuple(expected_shape):
        raise ValueError(
            f"the {role}'s lm_head.weight has shape {tuple(weight.shape)} at loss time, expected {expected_shape}: "
            f"it is sharded or flattened (FSDP1 with lm_head in its own unit?). Keep lm_head in the root FSDP unit, "
            f"e.g. an auto-wrap policy on the decoder layer class only"
        )


def spread_as(model: nn.Module) -> str | None:
    """How `model` is spread over processes: "DDP", "FSDP1", "FSDP2" or "ZeRO-3" (the wrapper itself, or a module
    or parameter inside it, says so), else None."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if isinstance(model, nn.parallel.DistributedDataParallel):
        return "DDP"
    modules = list(model.modules())
    if any(isinstance(m, FullyShardedDataParallel) for m in modules):
        return "FSDP1"
    if any(isinstance(m, FSDPModule) for m in modules):
        return "FSDP2"
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return "ZeRO-3"
    return None


def release_root_parameters(model: nn.Module) -> None:
    """Reshard an FSDP2 root after a forward that has no backward (the teacher's). FSDP2 keeps a root's
    parameters gathered after its forward, expecting the backward to need them at once; for a frozen teacher
    that would hold its embeddings and lm_head whole (4 GiB for a 70B) for the rest of the run."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reshard()


@contextlib.contextmanager
def gathered_weights(module: nn.Module, owner: nn.Module | None = None) -> Iterator[None]:
    """Have a ZeRO-3 partitioned module's own parameters whole for the duration of the block (no-op otherwise).

    The KD forward reads lm_head's weight inside `owner`'s forward without calling lm_head, so ZeRO-3's module
    hooks never fetch it. Gathering it here on every step collides with ZeRO's prefetcher, which learns the
    order of fetches from the first step and then has the weight in flight when this block starts (partitioning
    it at the end fails: "Cannot partition a param in flight"). So the weight is registered as an external
    parameter of `owner`: from the next forward on ZeRO fetches, prefetches and releases it with `owner`, and
    this block only gathers what is still partitioned (the first forward's)."""
    params = [p for p in module.parameters() if hasattr(p, "ds_id")]  # an adapter's too
    if not params:
        yield
        return
    import deepspeed  # optional extra: only reached when the parameters are ZeRO-3 partitioned
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if owner is not None:
        for param in params:
            deepspeed.zero.register_external_parameter(owner, param)  # a no-op when already registered
    partitioned = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    if not partitioned:
        yield
        return
    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield


# --------------------------------------------------------------------------------------------------------------
# Sharding both models the way the KD forward needs them (used by KDTrainer under accelerate)
#
# accelerate leaves a model prepared with `evaluation_mode=True` unsharded, so the teacher is sharded here. Under
# FSDP2 the student is sharded here too: accelerate >= 1.12 gives lm_head (with the final norm) an FSDP2 group of
# its own, and since the KD forward reads lm_head.weight without calling lm_head, torch < 2.13 never completes
# that group's forward and leaves its parameters sharded from the second step on. Decoder layers, then the
# whole model, is the layout that keeps lm_head in the root unit.


def decoder_layer_types(model: nn.Module, names: Iterable[str] | None = None) -> tuple[type, ...]:
    """Classes of the modules to shard one by one: those named in `names` (an accelerate plugin's
    transformer_cls_names_to_wrap) and the model's own `_no_split_modules` (its decoder layer)."""
    wanted = set(names or ()) | set(getattr(model, "_no_split_modules", None) or ())
    # by the names along the class hierarchy: FSDP2 gives a sharded module a subclass named FSDP<name>
    found = tuple({type(m) for m in model.modules() if wanted & {c.__name__ for c in type(m).__mro__}})
    if not found:
        raise ValueError(
            f"none of the layer classes {sorted(wanted)} is in {type(model).__name__}: set "
            f"fsdp_transformer_layer_cls_to_wrap to its decoder layer class (e.g. LlamaDecoderLayer)"
        )
    return found


def fsdp2_shard(model: nn.Module, layer_types: tuple[type, ...], **fully_shard_kwargs) -> nn.Module:
    """`fully_shard` each module of `layer_types`, then the model: embeddings, final norm and lm_head stay in
    the root unit, gathered for the whole forward. A model that is already FSDP2 is returned as it is."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if isinstance(model, FSDPModule):
        return model
    for module in list(model.modules()):
        if isinstance(module, layer_types) and not isinstance(module, FSDPModule):
            fully_shard(module, **fully_shard_kwargs)
    fully_shard(model, **fully_shard_kwargs)
    return model


def fsdp2_prepare(model: nn.Module, accelerator, *, trainable: bool) -> nn.Module:
    """Shard `model` with FSDP2 as accelerate's plugin asks (mixed precision, resharding, offload, loading from
    rank 0), in the layout above. Trainable parameters are upcast to fp32 under mixed precision, as accelerate
    does (FSDP2 keeps fp32 master weights and computes in the policy's dtype)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    plugin = accelerator.state.fsdp_plugin
    layer_types = decoder_layer_types(model, plugin.transformer_cls_names_to_wrap)
    _resolve_wrap_policy(plugin, layer_types)
    if isinstance(model, FSDPModule):
        return model
    kwargs = dict(
        mp_policy=plugin.mixed_precision_policy or MixedPrecisionPolicy(),
        reshard_after_forward=plugin.reshard_after_forward,
    )
    if plugin.cpu_offload is not None:
        kwargs["offload_policy"] = plugin.cpu_offload
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is not None:
        kwargs["mesh"] = mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)]
    if trainable and accelerator.mixed_precision != "no":
        for p in model.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.float()
    if not plugin.cpu_ram_efficient_loading:
        return fsdp2_shard(model, layer_types, **kwargs)
    # only rank 0 holds the weights (transformers loads the others on the meta device): shard on meta, then
    # broadcast rank 0's state dict, as accelerate does; non-persistent buffers (rotary tables) are kept aside
    from accelerate.utils.fsdp_utils import fsdp2_load_full_state_dict

    full_state = model.state_dict()
    persistent = set(full_state)
    buffers = {n: b.clone() for n, b in model.named_buffers() if n not in persistent}
    model = model.to(torch.device("meta"))
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    fsdp2_shard(model, layer_types, **kwargs)
    fsdp2_load_full_state_dict(accelerator, model, full_state)
    for name, buffer in buffers.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner).register_buffer(leaf, buffer.to(accelerator.device), persistent=False)
    return model


def _resolve_wrap_policy(plugin, layer_types: tuple[type, ...]) -> None:
    """accelerate resolves a transformer wrap policy by exact class name when it prepares the model, which fails
    on a model that is already sharded (FSDP2 renames the classes FSDPLlamaDecoderLayer): resolve it here, from
    the classes found (accelerate keeps a policy that is already resolved)."""
    import functools

    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    if plugin.auto_wrap_policy is transformer_auto_wrap_policy:
        plugin.auto_wrap_policy = functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls=set(layer_types)
        )


def fsdp1_prepare_teacher(teacher: nn.Module, accelerator) -> nn.Module:
    """Wrap a frozen teacher in FSDP1 with the student's plugin settings (decoder layers as units, lm_head in
    the root unit)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if isinstance(teacher, FSDP):
        return teacher
    plugin = accelerator.state.fsdp_plugin
    return FSDP(
        teacher,
        auto_wrap_policy=ModuleWrapPolicy(set(decoder_layer_types(teacher, plugin.transformer_cls_names_to_wrap))),
        sharding_strategy=plugin.sharding_strategy,
        cpu_offload=plugin.cpu_offload,
        mixed_precision=plugin.mixed_precision_policy,
        sync_module_states=plugin.sync_module_states,
        param_init_fn=plugin.param_init_fn,
        use_orig_params=plugin.use_orig_params,
        limit_all_gathers=plugin.limit_all_gathers,
        forward_prefetch=plugin.forward_prefetch,
        device_id=accelerator.device,
    )


def zero3_teacher_config(
    train_config: dict, *, hidden_size: int, micro_batch: int, accumulation: int, world: int
) -> dict:
    """A DeepSpeed config for a frozen teacher next to a ZeRO-3 student: the student's ZeRO settings without
    optimizer or scheduler, batch sizes and bucket sizes resolved (the student's "auto" values are only filled
    in when the Trainer initialises its own engine)."""
    config = {k: v for k, v in train_config.items() if k not in ("optimizer", "scheduler")}
    zero = dict(config.get("zero_optimization", {}))
    if zero.get("stage") != 3:
        raise ValueError(f"a sharded teacher needs ZeRO stage 3; the DeepSpeed config has stage {zero.get('stage')}")
    resolved = {
        "reduce_bucket_size": hidden_size * hidden_size,
        "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "stage3_param_persistence_threshold": 10 * hidden_size,
    }
    zero = {k: resolved.get(k, v) for k, v in zero.items() if v != "auto" or k in resolved}
    config.update(
        zero_optimization=zero,
        train_micro_batch_size_per_gpu=micro_batch,
        gradient_accumulation_steps=accumulation,
        train_batch_size=micro_batch * accumulation * world,
    )
    return {k: v for k, v in config.items() if v != "auto"}


def zero3_prepare_teacher(teacher: nn.Module, config: dict) -> nn.Module:
    """A DeepSpeed ZeRO-3 inference engine for the frozen teacher (partitioned like the student)."""
    import deepspeed  # optional extra

    engine, *_ = deepspeed.initialize(model=teacher, config=config)
    engine.eval()  # DeepSpeedEngine.eval() returns None, not the engine
    return engine
