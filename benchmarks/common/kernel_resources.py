"""What a Triton kernel compiled for an NVIDIA GPU asks of it, read on any machine, GPU or not.

Triton's wheel carries NVIDIA's ptxas and cuobjdump, so a kernel compiles for a given architecture without a
device: its shared memory (what a launch requests; more than the multiprocessor holds and the launch fails with
OutOfResources), and from the cubin its registers a thread and the stack it spills to. A kernel is named
"package.module:function"; its signature by parameter name; `aligned` names the integer and pointer parameters a
launch would see divisible by 16 (Triton specialises on that, and it decides whether loads vectorise); a
meta-parameter given as "tl.float32" is that Triton dtype. Under TRITON_INTERPRET=1 (the CPU test suite) kernels
are interpreted in this process, so the compiles run in a child process without it.

    python -m benchmarks.common.kernel_resources '[{"kernel": "...", "types": {...}, "constexprs": {...},
        "num_warps": 4}]'
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# dynamic shared memory a block may request: the smallest NVIDIA multiprocessor since Ampere (consumer Ampere and Ada:
# 99 KiB); A100 163 KiB, H100 / H200 227 KiB
SHARED_LIMITS = {"sm_86": 99 << 10, "sm_80": 163 << 10, "sm_90": 227 << 10}
ROOT = Path(__file__).resolve().parents[2]


def _cuobjdump() -> str | None:
    """The NVIDIA backend's cuobjdump shipped with Triton, or None (another install, an older Triton)."""
    try:
        from triton import knobs

        tools = [knobs.nvidia.ptxas, knobs.nvidia.cuobjdump]
    except (ImportError, AttributeError, RuntimeError):
        return None
    if any(t is None or not os.path.exists(t.path) for t in tools):
        return None
    return tools[1].path


def tools_available() -> bool:
    """Whether this Triton carries the NVIDIA backend's ptxas and cuobjdump (it compiles for a GPU here)."""
    return _cuobjdump() is not None


def compiled_resources(specs: list[dict[str, Any]]) -> list[dict[str, int]]:
    """{"shared_bytes", "registers", "spill_bytes"} for each spec: {"kernel", "types" (Triton type strings by
    parameter: "*fp32", "i32", "fp32"), "constexprs", "num_warps", optional "num_stages" (3), "arch" (90),
    "aligned" ([])}."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        done = subprocess.run([sys.executable, "-m", "benchmarks.common.kernel_resources", json.dumps(specs)],
                              capture_output=True, text=True, env=env, cwd=ROOT)  # fmt: skip
        if done.returncode:
            raise RuntimeError(f"compiling in a child process failed: {done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])
    return [_compiled(**spec) for spec in specs]


def _compiled(kernel: str, types: dict[str, str], constexprs: dict[str, Any], num_warps: int, num_stages: int = 3,
              arch: int = 90, aligned: tuple[str, ...] | list[str] = ()) -> dict[str, int]:  # fmt: skip
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name = kernel.split(":")
    fn = getattr(importlib.import_module(module), name)
    params = list(inspect.signature(fn.fn).parameters)
    values = {p: getattr(tl, v[3:]) if isinstance(v, str) and v.startswith("tl.") else v for p, v in constexprs.items()}
    signature = {p: "constexpr" if p in values else types[p] for p in params}
    attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in aligned}
    source = ASTSource(fn=fn, signature=signature, attrs=attrs,
                       constexprs={(params.index(p),): v for p, v in values.items()})  # fmt: skip
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))  # fmt: skip
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([_cuobjdump(), "--dump-resource-usage", cubin.name], capture_output=True, text=True,
                               check=True).stdout  # fmt: skip
    found = dict(re.findall(r"(REG|STACK):(\d+)", usage))
    return {"shared_bytes": int(compiled.metadata.shared), "registers": int(found.get("REG", 0)),
            "spill_bytes": int(found.get("STACK", 0))}  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(compiled_resources(json.loads(sys.argv[1]))))
