"""Probe (not the product): registers, spills and shared memory of the JSD segment walk's compiled kernel, on any
machine (benchmarks/common/kernel_resources.py compiles it for sm_90 with the ptxas Triton ships; no GPU).

The segment walk (ops/fused_linear_jsd.py `_jsd_segment_kernel`) holds a segment of both logit rows in registers
across its barriers, so its speed turns on what the compiler keeps there: a variant that spills, or loads scalars
where it could load 16 bytes, shows here before any device call. Each row: a JSDLaunch-like setting (segment
columns, warps), the loss mode, and whether the vocabulary (and so the row strides and segment length) is a multiple
of 16, which lets Triton vectorise the loads (V = 128256 is; 50257 is not).

    python -m benchmarks.loss.probe_jsd_resources --out runs/probe_jsd_resources.json

Found on 2026-12-07 (Triton 3.9, `--launches 16384x16 8192x16`, benchmarks/results/probe_jsd_resources.json):
the default (16384 columns, 16 warps) uses 128 registers a thread and spills nothing at V = 128256, every mode;
with a vocabulary not a multiple of 16 its loads are scalar and it spills up to 360 bytes a thread (beta 0.5).
8192 columns at 16 warps use about 77 registers: room for a second item in flight.
"""

from __future__ import annotations

import argparse

from ..common import environment, print_table, write_json
from ..common.kernel_resources import compiled_resources, tools_available

KERNEL = "liger_patch_kd.ops.fused_linear_jsd:_jsd_segment_kernel"
POINTERS = {"zs_ptr": "*fp32", "zt_ptr": "*fp32", "grad_ptr": "*bf16", "labels_ptr": "*i64", "w_soft_ptr": "*fp32",
            "w_hard_ptr": "*fp32", "part_ptr": "*fp32", "hard_ptr": "*fp32", "count_ptr": "*i32"}  # fmt: skip
INTS = ["stride_zs", "stride_zt", "stride_g", "rows", "V", "seg_len", "ignore_index"]
FLOATS = ["inv_hi", "inv_lo", "b_hi", "b_lo", "omb_hi", "omb_lo", "cap_s", "cap_t"]


def spec(segment: int, warps: int, mode: int, aligned_vocab: bool, vocab: int = 128256) -> dict:
    segments = -(-vocab // segment)
    constexprs = dict(MODE=mode, HAS_HARD=False, UNIT_TEMP=True, CAP_S=False, CAP_T=False, COMPUTE_GRAD=True,
                      PAIR=False, SEGMENTS=segments, SEGMENTS_P2=max(2, 1 << (segments - 1).bit_length()),
                      SEG=segment, PHASE=0)  # fmt: skip
    aligned = list(POINTERS) + (["stride_zs", "stride_zt", "stride_g", "V", "seg_len"] if aligned_vocab else [])
    types = {**POINTERS, **dict.fromkeys(INTS, "i32"), **dict.fromkeys(FLOATS, "fp32")}
    return dict(kernel=KERNEL, types=types, constexprs=constexprs, num_warps=warps, arch=90, aligned=aligned)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="runs/probe_jsd_resources.json")
    parser.add_argument("--launches", nargs="+", default=["16384x16", "8192x16", "8192x8", "16384x32"],
                        help="segment columns x warps")  # fmt: skip
    args = parser.parse_args()
    if not tools_available():
        raise SystemExit("this Triton ships no NVIDIA ptxas / cuobjdump: nothing to compile with")
    cases = [(launch, mode, aligned) for launch in args.launches for mode in (2, 0, 1) for aligned in (True, False)]
    specs = [spec(*map(int, launch.split("x")), mode, aligned) for launch, mode, aligned in cases]
    rows = [dict(launch=launch, beta={2: 0.5, 0: 0.0, 1: 1.0}[mode], vocab_multiple_of_16=aligned, **found)
            for (launch, mode, aligned), found in zip(cases, compiled_resources(specs))]  # fmt: skip
    print_table(rows, ["launch", "beta", "vocab_multiple_of_16", "registers", "spill_bytes", "shared_bytes"])
    write_json(args.out, {"environment": environment(), "rows": rows})


if __name__ == "__main__":
    main()
