"""Full weights to the rollout engine by broadcast: the trainer's side of vLLM's weight-transfer protocol.

Control plane (vLLM's RLHF HTTP routes, which `liger-kd serve` answers too; server/weight_receiver.py):
once, POST /init_weight_transfer_engine with the rendezvous (this trainer is rank 0 and hosts the TCPStore); per
sync, /start_weight_update, /update_weights with every tensor's name, dtype and shape (sent while this side
broadcasts them, in that order: the server's call returns when it has them all), /finish_weight_update with the
step as weight_version; at close, /shutdown_weight_transfer_engine. Data plane, by `transport`:

  "broadcast"  a torch.distributed group from that TCPStore: gloo for a student on the CPU, NCCL on a GPU; what
               `liger-kd serve` joins (tested in CI)
  "vllm-nccl"  vLLM's own communicator (vllm's stateless_init_process_group + PyNcclCommunicator), which a vLLM
               server started with --weight-transfer-config '{"backend": "nccl"}' joins; needs vllm importable
               here and the student on a GPU. It cannot run in CI (no vLLM, no GPU), so it is kept to vLLM's
               documented one-tensor-at-a-time broadcast.

Each tensor goes once (tied embeddings share one storage, `unique_tensors`), in the model's dtype. A broadcast the
server refuses (a name it lacks, another shape) is still received whole there and applied nowhere; the refusal
comes back as the update's HTTP error.
"""

from __future__ import annotations

import datetime
import socket
import threading
from typing import Any

import torch
from torch import nn

from ...teacher.client.transport import HttpEndpoint, TeacherServerError
from ...wire.conventions import JOINED_KEY
from .weight_sync import unique_tensors, weights_id_in

TRANSPORTS = ("disk", "broadcast", "vllm-nccl")
GROUP_TIMEOUT = datetime.timedelta(minutes=10)


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


class BroadcastSender:
    """Rank 0 of a two-member group with the engine at `http` (one worker: world size 2)."""

    def __init__(self, http: HttpEndpoint, transport: str, address: str = "127.0.0.1") -> None:
        if transport not in TRANSPORTS[1:]:
            raise ValueError(f"kd_sync_transport={transport!r}: a broadcast transport is one of {TRANSPORTS[1:]}")
        # the collective calls block on the other side: a retried init or update would join a second broadcast
        self.http = HttpEndpoint(http.url, timeout=http.timeout, retries=0, api_key=http.api_key, what=http.what,
                                 needed="the student's weights")  # fmt: skip
        self.transport, self.address = transport, address
        self.group: Any = None
        self.device: torch.device | None = None

    def snapshot(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The weights `model` holds now, each storage once, copied where they are (a GPU copy on a GPU): what a
        later `send` broadcasts, whatever the optimizer does in between (asynchronous rollouts)."""
        return unique_tensors(model.state_dict(), device=None)

    def push(self, model: nn.Module, step: int) -> int | None:
        return self.send(self.snapshot(model), step)

    def send(self, tensors: dict[str, torch.Tensor], step: int) -> int | None:
        """Broadcast `tensors`; the weights_id the engine's /update_weights reply names (None: it names none)."""
        device = next(iter(tensors.values())).device
        joined = self.group is not None
        if not joined:
            self._connect(device)
        elif device != self.device:
            raise RuntimeError(f"the student moved from {self.device} to {device} after the weight-transfer group "
                               f"was made; the group's transport is fixed by the first push")  # fmt: skip
        info = {
            "names": list(tensors),
            "dtype_names": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()],
        }
        try:
            self.http.post_json("/start_weight_update", {})
        except TeacherServerError:
            if not joined:
                raise
            # the engine holds no group (restarted since the last push): every tensor goes anyway, so join afresh
            self._shutdown_group()
            self._connect(device)
            self.http.post_json("/start_weight_update", {})
        broadcast = lambda: self._broadcast(tensors.values())  # noqa: E731
        updated = self._while_posting("/update_weights", {"update_info": info}, broadcast)
        self.http.post_json("/finish_weight_update", {"weight_version": str(step)})
        # the update's own reply: /finish's (or /health's) could name another process's update landed since
        return weights_id_in(updated)

    def close(self) -> None:
        if self.group is None:
            return
        try:
            self.http.post_json("/shutdown_weight_transfer_engine", {})
        finally:
            self._shutdown_group()

    # ------------------------------------------------------------------------------------------- internals
    def _shutdown_group(self) -> None:
        group, self.group = self.group, None
        if self.transport == "broadcast" and hasattr(group, "shutdown"):
            group.shutdown()

    def _connect(self, device: torch.device) -> None:
        if self.transport == "vllm-nccl" and device.type != "cuda":
            raise ValueError(f"kd_sync_transport='vllm-nccl' broadcasts over NCCL from a GPU; the student is on "
                             f"{device}. Use kd_sync_transport='broadcast' with liger-kd serve, or 'disk'")  # fmt: skip
        port = free_port(self.address)
        info = {"master_address": self.address, "master_port": port, "rank_offset": 1, "world_size": 2}
        self.device = device
        abandoned = threading.Event()  # set when the init fails: the worker waiting for the engine gives up
        self._while_posting(
            "/init_weight_transfer_engine", {"init_info": info}, lambda: self._make_group(port, abandoned), abandoned
        )

    def _make_group(self, port: int, abandoned: threading.Event) -> None:
        if self.transport == "vllm-nccl":
            from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

            self.group = stateless_init_process_group(self.address, port, 0, 2, self.device)
            return
        import torch.distributed as dist

        store = dist.TCPStore(self.address, port, 2, is_master=True, timeout=GROUP_TIMEOUT, wait_for_workers=False)
        store = dist.PrefixStore("liger-kd-weight-transfer", store)
        while True:  # until the engine reached the store; after a refused init this thread ends and the port closes
            if abandoned.is_set():
                return
            try:
                store.wait([JOINED_KEY], datetime.timedelta(milliseconds=100))
                break
            except RuntimeError:  # DistStoreError: not yet
                continue
        if self.device.type == "cuda":
            self.group = dist.ProcessGroupNCCL(store, 0, 2)
        else:
            self.group = dist.ProcessGroupGloo(store, 0, 2, GROUP_TIMEOUT)

    def _broadcast(self, tensors) -> None:
        for tensor in tensors:
            if self.transport == "vllm-nccl":
                self.group.broadcast(tensor, src=0, stream=torch.cuda.current_stream())
            else:
                self.group.broadcast(tensor, 0).wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _while_posting(self, path: str, body: dict, work, abandoned: threading.Event | None = None) -> bytes:
        """POST `path` while `work` (this side of the collective) runs: the server's side is inside that request.
        Both run in threads watched from here, so a refusal (the server never joins) raises at once instead of
        waiting out the group's timeout; after one the group is dropped (the next push makes a new one). Returns the
        POST's reply body."""
        outcome: dict[str, BaseException | None] = {}
        replies: dict[str, Any] = {}

        def run(key: str, fn) -> None:
            try:
                replies[key] = fn()
                outcome[key] = None
            except BaseException as e:  # re-raised below, in the trainer's thread
                outcome[key] = e

        post = threading.Thread(target=run, args=("post", lambda: self.http.post_json(path, body)), daemon=True)
        worker = threading.Thread(target=run, args=("work", work), daemon=True, name=f"liger-kd {path}")
        post.start()
        worker.start()
        while "post" not in outcome and outcome.get("work") is None:
            post.join(0.02)
        if outcome.get("post") is None and "post" in outcome:
            worker.join()
        error = outcome.get("post") or outcome.get("work")
        if error is not None:
            if abandoned is not None:
                abandoned.set()  # a worker still waiting for the engine to join gives up
            self.group = None  # its members disagree now: never reused
            raise error
        return replies["post"][0]
