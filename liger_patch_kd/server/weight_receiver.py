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
vllm installed in the trainer).

An update's metadata is checked whole (weight_updates.py: every entry well formed, every name the model's, its
shape and kind of dtype) before any weight changes. Malformed metadata, or a refused update larger than the model,
is not received at all (nothing the client chose is allocated; the group is retired: init again); a refused update
of the model's size is drained, one tensor at a time, so the group stays in step with the trainer, and changes no
weight. `names` empty reuses the previous update's metadata, as vLLM allows. A broadcast that breaks midway (the
trainer died, or the group timed out) changes no weight either: the reply is one 500 line that says where it
broke, and the group is closed.

The calls never hold the server: they run one at a time on a thread of their own (a second call while one runs is
a 409), never on the workers that score and generate; an init reaches the trainer's store within CONNECT_TIMEOUT
or answers 504 naming the address (a join still stuck in the connect is left to its daemon thread; past
MAX_STUCK_JOINS of them an init is a 429); SIGTERM stops the server while one is pending (the thread is a daemon).
"""

from __future__ import annotations

import asyncio
import datetime
import math
import threading
from typing import Any

import torch

from ..utils.errors import reason_of
from ..wire.conventions import JOINED_KEY
from .validation import RequestError
from .weight_updates import tensor_specs

GROUP_TIMEOUT = datetime.timedelta(minutes=10)  # a trainer that dies mid-broadcast frees the server after this
# the trainer's store listens before (or as) it posts the init: a reachable one answers in milliseconds, and an
# address where nothing answers must not hold the call (and its client) for GROUP_TIMEOUT
CONNECT_TIMEOUT = datetime.timedelta(seconds=20)
JOIN_THREAD = "liger-kd serve store connect"
MAX_STUCK_JOINS = 4  # joins still blocked in a connect that outlived its init (a peer that accepts, never answers)
MAX_RANK = 65535  # this server's rank in the trainer's group (the trainer's ranks before it): past any real job


def _int_field(info: dict, name: str, low: int, high: int | None = None) -> int:
    value = info.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        within = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise RequestError(400, f"init_info.{name} must be an integer {within}; got {value!r:.40}")
    return value


class OneAtATime:
    """Runs the weight-transfer calls one at a time, each on a daemon thread of its own: never on the worker
    threads that score and generate (a call may wait CONNECT_TIMEOUT, a broadcast GROUP_TIMEOUT), never two
    groups made at once, and nothing that keeps the process alive after SIGTERM."""

    def __init__(self) -> None:
        self.busy = threading.Lock()
        self.running: str | None = None

    async def __call__(self, path: str, method: Any, body: Any) -> Any:
        if not self.busy.acquire(blocking=False):
            raise RequestError(409, f"{path}: the weight-transfer call {self.running} is still running (one at a "
                                    f"time; an init gives up after {CONNECT_TIMEOUT.seconds} s); send this one after "
                                    f"it answers")  # fmt: skip
        self.running = path
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def settle(outcome: Any, failed: bool) -> None:
            if not future.done():  # the request may have been cancelled (the client hung up, or shutdown)
                (future.set_exception if failed else future.set_result)(outcome)

        def work() -> None:
            try:
                outcome, failed = method(body), False
            except BaseException as e:  # handed to the request, in the event loop
                outcome, failed = e, True
            finally:
                self.running = None
                self.busy.release()
            try:
                loop.call_soon_threadsafe(settle, outcome, failed)
            except RuntimeError:  # the event loop is gone: the server is shutting down
                pass

        threading.Thread(target=work, daemon=True, name=f"liger-kd serve {path}").start()
        return await future


class WeightReceiver:
    """The server's side of the broadcast: one process group per init, tensors received on the model's device
    (NCCL) or the CPU (gloo), applied through `engine.apply_state` (checked, all or nothing, weight_version)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.group = None
        self.retired = None  # a group left out of step by an update refused before receipt (see _retired)
        self.metadata: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        self.version: str | None = None

    def init(self, body: Any) -> dict[str, Any]:
        info = body.get("init_info") if isinstance(body, dict) else None
        if not isinstance(info, dict) or not isinstance(info.get("master_address"), str) or not info["master_address"]:
            raise RequestError(400, 'the body must be {"init_info": {"master_address": str, "master_port": int, '
                                    '"rank_offset": int, "world_size": int}}')  # fmt: skip
        port = _int_field(info, "master_port", 1, 65535)
        rank = _int_field(info, "rank_offset", 1, MAX_RANK)  # rank 0 is the trainer
        world = _int_field(info, "world_size", rank + 1)
        if world != rank + 1:
            raise RequestError(400, f"world_size {world} with rank_offset {rank}: this server is one worker, so "
                                    f"world_size must be rank_offset + 1")  # fmt: skip
        import torch.distributed as dist

        self.shutdown(None)
        address, made = f"{info['master_address']}:{port}", {}

        def join() -> None:  # on a thread of its own: a peer that accepts and never answers holds TCPStore's
            try:  # connect past its timeout, and this call must answer anyway
                store = dist.TCPStore(info["master_address"], port, world, is_master=False, timeout=CONNECT_TIMEOUT)
                store = dist.PrefixStore("liger-kd-weight-transfer", store)
                store.set(JOINED_KEY, "1")
                if self.engine.device.type == "cuda":
                    made["group"] = dist.ProcessGroupNCCL(store, rank, world)
                else:
                    made["group"] = dist.ProcessGroupGloo(store, rank, world, GROUP_TIMEOUT)
            except BaseException as e:  # DistStoreError / DistNetworkError: no trainer there
                made["error"] = e

        stuck = sum(t.name == JOIN_THREAD and t.is_alive() for t in threading.enumerate())
        if stuck >= MAX_STUCK_JOINS:  # each holds a thread and a socket: not one more
            raise RequestError(429, f"{stuck} earlier inits are still stuck connecting to stores that never answered; "
                                    f"init again once they gave up, or restart the server")  # fmt: skip
        joining = threading.Thread(target=join, daemon=True, name=JOIN_THREAD)
        joining.start()
        joining.join(CONNECT_TIMEOUT.total_seconds() + 2)
        if "group" not in made:  # a thread still stuck in the connect is a daemon: it holds nothing of ours
            e = made.get("error")
            text = reason_of(e, 160) if e is not None else "no answer"
            raise RequestError(504, f"init_info.master_address:master_port {address}: no trainer's store answered "
                                    f"within {CONNECT_TIMEOUT.seconds} s ({text}); give the trainer's address as "
                                    f"this server reaches it, with the trainer listening")  # fmt: skip
        self.group = made["group"]
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
        try:  # malformed metadata: refused before a byte is received
            if names or dtypes or shapes:
                specs = tensor_specs(names, dtypes, shapes)
                self.metadata = [(name, dtype, shape) for name, (shape, dtype) in specs.items()]
            elif not self.metadata:
                raise RequestError(400, "update_info.names is empty and no earlier update gave the tensors' metadata")
        except RequestError as e:
            raise self._retired(e) from None
        refusal = None
        try:
            self.engine.check_state({name: (shape, dtype) for name, dtype, shape in self.metadata})
        except RequestError as e:
            refusal = e
        sizes = [math.prod(shape) for _, _, shape in self.metadata]
        own = [t.numel() for t in self.engine.model.state_dict().values()]
        if refusal is not None and (sum(sizes) > sum(own) or max(sizes, default=0) > max(own, default=0)):
            raise self._retired(refusal)  # more than the model holds: not received at all
        device = self.engine.device if self.engine.device.type == "cuda" else torch.device("cpu")
        state = {}
        for index, (name, dtype, shape) in enumerate(self.metadata):  # a refused update is drained, one at a time
            tensor = torch.empty(shape, dtype=dtype, device=device)
            try:
                self.group.broadcast(tensor, 0).wait()
            except RuntimeError as e:  # the trainer died or timed out mid-broadcast: this group is unusable now
                total = len(self.metadata)
                self.shutdown(None)
                raise RequestError(
                    500, f"the weight broadcast broke at tensor {index + 1} of {total} ({name}): "
                         f"{reason_of(e, 200)}. No weight changed; the "
                         f"group is closed: POST /init_weight_transfer_engine again"
                ) from e  # fmt: skip
            if refusal is None:
                state[name] = tensor
        if refusal is not None:  # drained: the group stays in step with the trainer
            raise refusal
        count, weights_id = self.engine.apply_state(state)
        return {"success": True, "num_tensors": count, **self.engine.weights_fields(weights_id)}

    def finish(self, body: Any) -> dict[str, Any]:
        self._require_group()
        version = body.get("weight_version") if isinstance(body, dict) else None
        self.version = None if version is None else str(version)
        return {"success": True, **self.engine.weights_fields(), "trainer_version": self.version}

    def shutdown(self, body: Any) -> dict[str, Any]:
        groups, self.group, self.retired, self.metadata = (self.group, self.retired), None, None, []
        for group in groups:
            if group is not None and hasattr(group, "shutdown"):
                group.shutdown()
        return {"success": True}

    def _retired(self, refusal: RequestError) -> RequestError:
        """`refusal`, for an update not received: the group is out of step with the trainer now and is not used
        again; it is shut down at the next init or shutdown (not now: the trainer's broadcast would fail on the
        closed connection before it reads this reply, and report that instead)."""
        self.retired, self.group, self.metadata = self.group, None, []
        return RequestError(refusal.status, f"{refusal.message} (nothing was received: POST "
                                            f"/init_weight_transfer_engine again)")  # fmt: skip

    def _require_group(self) -> None:
        if self.group is None:
            raise RequestError(400, "no weight-transfer group: POST /init_weight_transfer_engine first")


def add_weight_transfer_routes(route: Any, receiver: WeightReceiver, reply: Any) -> None:
    """The five routes, through the generation routes' `route(path, method, reply, run)` helper, run OneAtATime."""
    run = OneAtATime()
    route("/init_weight_transfer_engine", receiver.init, reply, run)
    route("/start_weight_update", receiver.start, reply, run)
    route("/update_weights", receiver.update, reply, run)
    route("/finish_weight_update", receiver.finish, reply, run)
    route("/shutdown_weight_transfer_engine", receiver.shutdown, reply, run)
