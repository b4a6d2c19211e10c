"""Worker for test_distributed: one process of an FSDP2 (fully_shard) run on CPU with gloo.

Each rank takes its half of the global batch; the loss is normalised by the global token count and scaled by
the world size (FSDP averages gradients over ranks), so the gathered gradients must equal a single process
on the whole batch. Run by torch.multiprocessing.spawn from the test.
"""

import copy
import os

import torch
import torch.distributed as dist

import liger_patch_kd.models as M
from liger_patch_kd import KDLossConfig

from .tiny_models import VOCAB, tiny_model


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (4, 12), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    labels[3, 8:] = -100
    k = 16
    teacher_logits = torch.randn(4, 12, VOCAB, generator=g, dtype=torch.float64) * 2
    lp, tid = torch.log_softmax(teacher_logits, -1).topk(k, -1)
    return ids, labels, tid, lp


def shard_fsdp2(model, device_type: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (dist.get_world_size(),))  # "cpu" for gloo, also on a machine with a GPU
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # root unit: embeddings, final norm and lm_head are gathered during its forward
    return model


def _wrap_fsdp1(model, device: torch.device):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    # decoder layers as units, lm_head in the root unit; original parameters visible (for the gradient checks)
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({type(model.model.layers[0])}), device_id=device,
                use_orig_params=True)  # fmt: skip


def _gathered(model, wrapper: str, what: str) -> dict[str, torch.Tensor]:
    """name -> the whole gradient (what="grad") or parameter (what="param"), gathered from the shards, under the
    original names (FSDP1's wrapper prefix removed)."""
    if wrapper == "fsdp2":
        return {n: (p.grad if what == "grad" else p).full_tensor().detach() for n, p in model.named_parameters()}
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model, with_grads=what == "grad"):
        return {
            n.replace("_fsdp_wrapped_module.", ""): (p.grad if what == "grad" else p).detach().clone()
            for n, p in model.named_parameters()
        }


def relative_error(got: torch.Tensor, want: torch.Tensor, exact: bool) -> float:
    """exact (float64): largest difference relative to the largest entry. bf16: relative norm of the difference
    (single entries carry bf16 rounding; a sharding bug moves the whole tensor, e.g. by half)."""
    got, want = got.double(), want.double()
    if exact:
        return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))
    return float((got - want).norm() / want.norm().clamp(min=1e-30))


def run(
    rank: int, world: int, init_file: str, mode: str, result_path: str, backend: str = "gloo",
    wrapper: str = "fsdp2", dtype: str = "float64",
) -> None:  # fmt: skip
    """backend "gloo": CPU tensors; "nccl": one GPU per process (the multi-GPU run of the same check). wrapper
    "fsdp2" (fully_shard) or "fsdp1" (FullyShardedDataParallel, GPU only); dtype of both models "float64" or
    "bfloat16". Rendezvous through a file, not a TCP port another test could grab in between."""
    os.environ.update(NCCL_NVLS_ENABLE="0")
    device = torch.device("cpu") if backend == "gloo" else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model_dtype = getattr(torch, dtype)
    exact = model_dtype == torch.float64
    student = tiny_model("llama", seed=1, dtype=model_dtype).to(device)
    teacher = tiny_model("llama", seed=2, hidden=96, dtype=model_dtype).to(device)
    cfg = KDLossConfig(beta=0.3, hard_weight=0.2)
    ids, labels, tid, lp = (t.to(device) for t in _batch())
    lp = lp.to(model_dtype)
    n_items = (labels[:, 1:] != -100).sum()
    mine = slice(rank * len(ids) // world, (rank + 1) * len(ids) // world)

    def loss_of(model, rows, teacher_model):
        kwargs = dict(labels=labels[rows], num_items_in_batch=n_items)
        if mode == "offline":
            kwargs.update(teacher_token_ids=tid[rows], teacher_logprobs=lp[rows])
        else:
            kwargs.update(teacher_model=teacher_model)
        return model(input_ids=ids[rows], **kwargs).loss

    def wrap(model):
        return shard_fsdp2(model, device.type) if wrapper == "fsdp2" else _wrap_fsdp1(model, device)

    reference = M.apply_kd_patch_to_llama(model=copy.deepcopy(student), kd_config=cfg)
    ref_teacher = copy.deepcopy(teacher)
    sharded = wrap(M.apply_kd_patch_to_llama(model=copy.deepcopy(student), kd_config=cfg))
    sharded_teacher = wrap(copy.deepcopy(teacher).eval().requires_grad_(False))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    opt = torch.optim.SGD(sharded.parameters(), lr=0.5)
    ref_named = dict(reference.named_parameters())
    errors: dict[str, float] = {}  # check -> error, so a failure names what differs
    for step in range(3):
        ref_loss = loss_of(reference, slice(None), ref_teacher)
        ref_loss.backward()
        loss = loss_of(sharded, mine, sharded_teacher)
        (loss * world).backward()  # FSDP averages gradients over ranks
        total = loss.detach().double()  # summed in float64 (a bf16 all-reduce would round the sum)
        dist.all_reduce(total)
        scale = 1.0 if exact else abs(ref_loss.item())
        errors[f"step {step} loss"] = abs(total.item() - ref_loss.item()) / scale
        for name, grad in _gathered(sharded, wrapper, "grad").items():
            errors[f"step {step} grad {name}"] = relative_error(grad, ref_named[name].grad, exact)
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    for name, param in _gathered(sharded, wrapper, "param").items():
        want = ref_named[name].detach()
        difference = float((param - want).abs().max()) if exact else relative_error(param, want, exact)
        errors[f"after 3 steps {name}"] = difference
    if rank == 0:
        torch.save(errors, result_path)
    dist.barrier()
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: gloo's background threads, destroyed at exit while still joinable,
    # abort the process now and then on a loaded machine ("terminate called without an active exception"),
    # failing a run whose result is already written. Exit code 0 is what mp.spawn checks.
    os._exit(0)
