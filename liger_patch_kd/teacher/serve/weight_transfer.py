"""vLLM's weight-transfer routes, answered by `liger-kd serve`: full weights broadcast from the trainer.

    POST /init_weight_transfer_engine     {"init_info": {"master_address", "master_port", "rank_offset", "world_size"}}
    POST /start_weight_update             (no body)
    POST /update_weights                  {"update_info": {"names", "dtype_names", "shapes"}}: blocks while the
                                          trainer (rank 0) broadcasts those tensors, in that order
    POST /finish_weight_update            {"weight_version": str} (optional)
    POST /shutdown_weight_transfer_engine (no body)

These are vLLM's control-plane routes and request bodies (its RLHF HTTP API; `vllm serve --weight-transfer-config
'{"backend": "nccl"}'`). The data plane here is a torch.distributed process group made from a TCPStore at the
trainer's address (gloo for a model on the CPU, NCCL on a GPU), not vLLM's own StatelessProcessGroup: a trainer
syncing with `liger-kd serve` uses kd_sync_transport="broadcast"; with vLLM, "vllm-nccl" (vLLM's communicator,
vllm installed in the trainer). An update is received whole before anything is applied, so a refused one (a name
the model lacks, a shape that differs, adapters loaded) still drains the trainer's broadcast (no one hangs) and
changes no weight; `names` empty reuses the previous update's metadata, as vLLM allows. A broadcast that breaks
midway (the trainer died, or the group timed out) changes no weight either: the reply is one 500 line that says
where it broke, and the group is closed, so the next push must init again.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

from .validation import RequestError

GROUP_TIMEOUT = datetime.timedelta(minutes=10)  # a trainer that dies mid-broadcast frees the server after this
JOINED_KEY = "joined"  # set by the server once it reached the trainer's store: the trainer then makes its group


def _int_field(info: dict, name: str, low: int) -> int:
    value = info.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise RequestError(400, f"init_info.{name} must be an integer >= {low}; got {value!r}")
    return value


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise RequestError(400, f"update_info.dtype_names: {name!r} is not a torch dtype (e.g. 'bfloat16')")
    return dtype


class WeightReceiver:
    """The server's side of the broadcast: one process group per init, tensors received on the model's device
    (NCCL) or the CPU (gloo), applied through `engine.apply_state` (checked, all or nothing, weight_version)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.group = None
        self.metadata: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        self.version: str | None = None

    def init(self, body: Any) -> dict[str, Any]:
        info = body.get("init_info") if isinstance(body, dict) else None
        if not isinstance(info, dict) or not isinstance(info.get("master_address"), str):
            raise RequestError(400, 'the body must be {"init_info": {"master_address": str, "master_port": int, '
                                    '"rank_offset": int, "world_size": int}}')  # fmt: skip
        port = _int_field(info, "master_port", 1)
        rank = _int_field(info, "rank_offset", 1)  # rank 0 is the trainer
        world = _int_field(info, "world_size", rank + 1)
        if world != rank + 1:
            raise RequestError(400, f"world_size {world} with rank_offset {rank}: this server is one worker, so "
                                    f"world_size must be rank_offset + 1")  # fmt: skip
        import torch.distributed as dist

        self.shutdown(None)
        store = dist.TCPStore(info["master_address"], port, world, is_master=False, timeout=GROUP_TIMEOUT)
        store = dist.PrefixStore("liger-kd-weight-transfer", store)
        store.set(JOINED_KEY, "1")
        if self.engine.device.type == "cuda":
            self.group = dist.ProcessGroupNCCL(store, rank, world)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, world, GROUP_TIMEOUT)
        return {"success": True, "backend": "nccl" if self.engine.device.type == "cuda" else "gloo"}

    def start(self, body: Any) -> dict[str, Any]:
        self._require_group()
        return {"success": True}

    def update(self, body: Any) -> dict[str, Any]:
        self._require_group()
        info = body.get("update_info") if isinstance(body, dict) else None
        if not isinstance(info, dict):
            raise RequestError(400, 'the body must be {"update_info": {"names": [...], "dtype_names": [...], '
                                    '"shapes": [[...], ...]}}')  # fmt: skip
        names, dtypes, shapes = (info.get(k) or [] for k in ("names", "dtype_names", "shapes"))
        if not (len(names) == len(dtypes) == len(shapes)):
            raise RequestError(400, f"update_info: names, dtype_names and shapes differ in length "
                                    f"({len(names)}, {len(dtypes)}, {len(shapes)})")  # fmt: skip
        if names:
            self.metadata = [(str(n), _dtype(d), tuple(int(x) for x in s)) for n, d, s in zip(names, dtypes, shapes)]
        elif not self.metadata:
            raise RequestError(400, "update_info.names is empty and no earlier update gave the tensors' metadata")
        device = self.engine.device if self.engine.device.type == "cuda" else torch.device("cpu")
        state = {}
        for index, (name, dtype, shape) in enumerate(self.metadata):  # all received, even of an update refused below
            tensor = torch.empty(shape, dtype=dtype, device=device)
            try:
                self.group.broadcast(tensor, 0).wait()
            except RuntimeError as e:  # the trainer died or timed out mid-broadcast: this group is unusable now
                total = len(self.metadata)
                self.shutdown(None)
                raise RequestError(
                    500, f"the weight broadcast broke at tensor {index + 1} of {total} ({name}): "
                         f"{str(e).splitlines()[0][:200] if str(e) else type(e).__name__}. No weight changed; the "
                         f"group is closed: POST /init_weight_transfer_engine again"
                ) from e  # fmt: skip
            state[name] = tensor
        count = self.engine.apply_state(state)
        return {"success": True, "num_tensors": count, "weight_version": self.engine.weight_version}

    def finish(self, body: Any) -> dict[str, Any]:
        self._require_group()
        version = body.get("weight_version") if isinstance(body, dict) else None
        self.version = None if version is None else str(version)
        return {"success": True, "weight_version": self.engine.weight_version, "trainer_version": self.version}

    def shutdown(self, body: Any) -> dict[str, Any]:
        group, self.group, self.metadata = self.group, None, []
        if group is not None and hasattr(group, "shutdown"):
            group.shutdown()
        return {"success": True}

    def _require_group(self) -> None:
        if self.group is None:
            raise RequestError(400, "no weight-transfer group: POST /init_weight_transfer_engine first")


def add_weight_transfer_routes(route: Any, receiver: WeightReceiver, reply: Any) -> None:
    """The five routes, through the generation routes' `route(path, method, reply)` helper."""
    route("/init_weight_transfer_engine", receiver.init, reply)
    route("/start_weight_update", receiver.start, reply)
    route("/update_weights", receiver.update, reply)
    route("/finish_weight_update", receiver.finish, reply)
    route("/shutdown_weight_transfer_engine", receiver.shutdown, reply)
