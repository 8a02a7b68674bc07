"""Instructions per weight byte of the one-row GGUF kernel's main loop, from its SASS, without a GPU.

At batch 1 :func:`backplane.kernels.qgemv.quantized_gemv` should take the
time its blocks take to stream from memory. Whether it can is decided mostly
by how many instructions its main loop issues per byte of weight it reads,
which can be counted on any machine: this script compiles ``_qgemv_kernel``
for sm_90 (Triton's bundled ``ptxas``, no device needed) at the launch the
package picks for a projection (the same compile-time arguments, integer
specialisations and warps as a real call), disassembles it with
``cuobjdump -sass``, finds the main loop (the backward branch whose body holds
the most global loads) and prints:

- warp-instructions per loop iteration, per 32 weight bytes and per weight byte;
- the body's instructions by class: global loads by width (are the quant bytes
  read 128 bits at a time?), conversions (``I2F``/``F2I``/``F2F``: a quarter of
  the FMA rate), shuffles (``SHFL``: cross-lane reductions inside the loop),
  integer (``LOP3``/``SHF``/``IMAD``/``IADD3``/``PRMT``/...), float
  (``FFMA``/``FADD``/``FMUL``/...), shared-memory traffic and barriers (layout
  conversions between tiles: each a round trip and a stall) and the rest.

The budget. An H200 streams about 4.8 TB/s; its 132 multiprocessors have four
schedulers each, each issuing at most one warp-instruction a cycle at up to
1.98 GHz: 132 * 4 * 1.98e9 = 1.045e12 warp-instructions a second, so
1.045e12 / 4.8e12 = 0.218 warp-instructions per weight byte (7.0 per 32
bytes) is the most a kernel can issue and still keep up with the bytes, with
every scheduler issuing every cycle (an H100: 132 * 4 * 1.755e9 / 3.35e12 =
0.277). Real issue rates are lower (dependencies, load latency, the
conversions' and shuffles' own narrower pipes), so a kernel meant to be
bound by bandwidth wants about half of that: **about 0.1 per weight byte
(3.5 per 32)**. The count is a proxy, not a timing: it ignores latency
hiding, occupancy and the pipes' different rates, and counts the loop body
only (the prologue and the split-K epilogue run once per program).

Read it beside a timing (``benchmarks/qgemv.py``). A rewrite of the loop that
cut the count 2.1-3.2x (three instructions a weight, word loads, one warp per
program holding its rows in registers, no shuffles or barriers) ran slower on
an H200: Q4_K q/k/v 17.0 -> 24.5 us, the Q6_K LM head 363 -> 2,008 us, the 8B
model in Q4_K 5.0 -> 8.0 ms per token; fewer, fatter programs kept fewer bytes
in flight than the loads' latency needs.

``--packed`` counts the one-row kernel over repacked Q4_K
(:func:`backplane.kernels.qgemv_packed.packed_gemv`) instead, at its planned
launch, per byte of the Q4_K weight it stands for (its layout is 2.8%
larger); its main loop is the one with the most multiply-adds.
``--packed-q6k`` does the same for the one-row kernel over repacked Q6_K
(:func:`backplane.kernels.qgemv_packed_q6k.packed_gemv`), per byte of Q6_K (its
layout is Q6_K's own size).

Run here (CPU only)::

    python benchmarks/qgemv_sass.py [--types Q4_K,Q8_0] [--shape 6144x4096] [--json out.json]
    python benchmarks/qgemv_sass.py --packed [--shape 4096x14336]
    python benchmarks/qgemv_sass.py --packed-q6k [--shape 128256x4096]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource

from backplane.kernels import qgemv, qgemv_packed, qgemv_packed_q6k

logger = logging.getLogger("qgemv_sass")

#: ggml type ids by name
TYPES: dict[str, int] = {"Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}

#: the kernel's pointer and integer parameters, in order
_POINTERS = ("x_ptr", "w_ptr", "y_ptr", "part_ptr", "count_ptr")
_INTS = ("N", "row_bytes", "n_units", "units_per_split", "split_k")

#: the packed kernel's pointer and integer parameters, in order, with their dtypes
_PACKED_POINTERS = (
    ("x_ptr", None),
    ("qs_ptr", torch.int32),
    ("sm_ptr", torch.int16),
    ("dm_ptr", torch.int32),
    ("y_ptr", None),
    ("part_ptr", torch.float32),
    ("count_ptr", torch.int32),
)
_PACKED_INTS = ("N", "rows_per_program", "split_k")
#: the packed Q6_K kernel's pointer parameters, in order, with their dtypes
_PACKED_Q6K_POINTERS = (
    ("x_ptr", None),
    ("ql_ptr", torch.int32),
    ("qh_ptr", torch.int32),
    ("sc_ptr", torch.int32),
    ("d_ptr", torch.float16),
    ("y_ptr", None),
    ("part_ptr", torch.float32),
    ("count_ptr", torch.int32),
)

#: passes of the loop nested in each type's main loop (the Q6_K step runs its block's
#: four (half, scale group) quarters as a loop: unrolled, it takes minutes to compile)
INNER_TRIPS: dict[int, int] = {14: 4}

#: warp-instructions per weight byte the H200 issues at most while streaming (see above)
BUDGET = 132 * 4 * 1.98e9 / 4.8e12

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")


def compile_sass(ggml_type: int, n: int, k: int, sms: int, dtype: torch.dtype) -> tuple[str, dict]:
    """Compile the one-row kernel for sm_90 at the package's launch and disassemble it.

    :param ggml_type: the weight's ggml type id.
    :param n: output rows.
    :param k: values per row.
    :param sms: the multiprocessor count the launch is planned for.
    :param dtype: the input's dtype.
    :return: the SASS text and the launch: compile-time arguments (``num_warps`` included),
        grid and registers per thread.
    """
    grid, ints, constexprs = qgemv._launch(n, k, ggml_type, sms)
    # Specialise as a real call would: 16-byte aligned tensors, integers by divisibility.
    args = [torch.empty(1, dtype=dtype)] + [torch.empty(1, dtype=torch.uint8)]
    args += [torch.empty(1, dtype=dtype), torch.empty(1), torch.empty(1, dtype=torch.int32)]
    names = _POINTERS + _INTS
    return _compile(qgemv._qgemv_kernel, names, args + list(ints), constexprs, grid)


def compile_packed_sass(
    n: int, k: int, sms: int, dtype: torch.dtype, launch: qgemv_packed.Launch | None = None
) -> tuple[str, dict]:
    """Compile the packed Q4_K one-row kernel for sm_90 at a launch and disassemble it.

    :param n: output rows.
    :param k: values per row.
    :param sms: the multiprocessor count the launch is planned for.
    :param dtype: the input's dtype.
    :param launch: instead of the package's plan.
    :return: as :func:`compile_sass`.
    """
    grid, ints, constexprs = qgemv_packed._launch(n, k, sms, launch)
    args = [torch.empty(1, dtype=t or dtype) for _, t in _PACKED_POINTERS]
    names = tuple(name for name, _ in _PACKED_POINTERS) + _PACKED_INTS
    return _compile(qgemv_packed._packed_gemv_kernel, names, args + list(ints), constexprs, grid)


def compile_packed_q6k_sass(
    n: int, k: int, sms: int, dtype: torch.dtype, launch: qgemv_packed.Launch | None = None
) -> tuple[str, dict]:
    """Compile the packed Q6_K one-row kernel for sm_90 at a launch and disassemble it.

    :param n: output rows.
    :param k: values per row.
    :param sms: the multiprocessor count the launch is planned for.
    :param dtype: the input's dtype.
    :param launch: instead of the package's plan.
    :return: as :func:`compile_sass`.
    """
    grid, ints, constexprs = qgemv_packed_q6k._launch(n, k, sms, launch)
    args = [torch.empty(1, dtype=t or dtype) for _, t in _PACKED_Q6K_POINTERS]
    names = tuple(name for name, _ in _PACKED_Q6K_POINTERS) + _PACKED_INTS
    kernel = qgemv_packed_q6k._packed_q6k_gemv_kernel
    return _compile(kernel, names, args + list(ints), constexprs, grid)


def _compile(
    kernel, names: tuple[str, ...], args: list, constexprs: dict, grid
) -> tuple[str, dict]:
    """Compile ``kernel`` for sm_90 with ``args`` specialised as a real call would; return its
    SASS and the launch (compile-time arguments, grid, registers per thread)."""
    signature, attrs, consts = {}, {}, {}
    for i, (name, value) in enumerate(zip(names, args, strict=True)):
        kind, key = native_specialize_impl(BaseBackend, value, False, True, True)
        if kind == "constexpr":
            signature[name] = "constexpr"
            consts[name] = key
            continue
        signature[name] = kind
        if key:
            attrs[(i,)] = BaseBackend.parse_attr(key)
    options = dict(constexprs)
    num_warps = options.pop("num_warps")
    for name in options:
        signature[name] = "constexpr"
    src = ASTSource(fn=kernel, signature=signature, constexprs={**options, **consts})
    src.attrs = attrs
    compiled = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}
    )
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass, usage = (
            subprocess.run(
                [os.path.join(bindir, "cuobjdump"), flag, f.name],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            for flag in ("-sass", "-res-usage")
        )
    regs = re.search(r"REG:(\d+)", usage)
    return sass, {**constexprs, "grid": list(grid), "registers": int(regs[1]) if regs else None}


def parse(sass: str) -> list[tuple[int, str, str]]:
    """``(address, opcode, operands)`` of each instruction in ``sass``."""
    return [(int(m[1], 16), m[2], m[3].strip()) for m in _LINE.finditer(sass)]


def loops(instrs: list[tuple[int, str, str]]) -> list[list[tuple[int, str, str]]]:
    """The body of each loop (from a backward branch's target to the branch)."""
    out = []
    for addr, op, operands in instrs:
        if not op.startswith("BRA"):
            continue
        target = int(operands.split()[0].rstrip(";"), 16)
        if target <= addr:
            out.append([i for i in instrs if target <= i[0] <= addr])
    return out


def main_loop(
    instrs: list[tuple[int, str, str]], inner_trips: int = 1
) -> list[tuple[int, str, str]]:
    """The instructions one pass of the main loop issues: the body of the loop whose
    backward branch encloses the most global loads, with each loop nested in it
    counted ``inner_trips`` times.

    :raises ValueError: when the code has no backward branch.
    """
    bodies = loops(instrs)
    if not bodies:
        raise ValueError("no loop in the kernel's SASS")
    best = max(bodies, key=lambda b: (sum(i[1].startswith("LDG") for i in b), len(b)))
    start, end = best[0][0], best[-1][0]
    inner = [b for b in bodies if b is not best and start <= b[0][0] and b[-1][0] <= end]
    return best + [i for b in inner for i in b] * (inner_trips - 1)


def classify(op: str) -> str:
    """The class of one opcode (global loads by their width in bits)."""
    base = op.split(".")[0]
    if base == "LDG":
        parts = op.split(".")
        for width in ("128", "64", "U16", "S16", "U8", "S8"):
            if width in parts:
                return "LDG." + width.lstrip("US")
        return "LDG.32"
    if base in ("I2F", "F2I", "F2F", "I2FP", "F2FP", "I2I"):
        return "convert"
    if base == "SHFL":
        return "SHFL"
    if base in ("BAR", "MEMBAR", "DEPBAR"):
        return "BAR"
    if base in ("LDS", "STS", "LDSM", "STSM"):
        return "shared"
    if base in ("FFMA", "FADD", "FMUL", "FSEL", "FSETP", "FMNMX", "HFMA2", "HADD2", "HMUL2"):
        return "float"
    if base in ("LOP3", "SHF", "IMAD", "IADD3", "LEA", "PRMT", "SEL", "ISETP", "IABS", "BMSK"):
        return "integer"
    if base in ("MOV", "UMOV", "S2R", "S2UR", "CS2R"):
        return "move"
    if base.startswith("U"):
        return "uniform"
    return "other"


def measure_packed(n: int, k: int, sms: int, dtype: torch.dtype, q6k: bool = False) -> dict:
    """Loop statistics of a packed kernel at one shape, as :func:`measure` gives them
    (bytes: of the Q4_K, or Q6_K, weight the iteration's rows and inputs stand for).

    :param q6k: the Q6_K kernel instead of the Q4_K one.
    """
    compile_fn = compile_packed_q6k_sass if q6k else compile_packed_sass
    sass, launch = compile_fn(n, k, sms, dtype)
    bodies = loops(parse(sass))
    if not bodies:
        raise ValueError("no loop in the kernel's SASS")
    body = max(bodies, key=lambda b: sum(i[1].startswith("FFMA") for i in b))
    block_bytes = 210 if q6k else 144
    per_iter = launch["BLOCK_N"] * launch["BLOCK_K"] // 256 * block_bytes
    return _loop_stats(launch, body, launch["num_warps"], per_iter)


def _loop_stats(launch: dict, body: list, warps: int, per_iter: int) -> dict:
    """The statistics :func:`measure` returns, of a loop ``body`` reading ``per_iter`` bytes."""
    total = len(body) * warps
    return {
        "launch": launch,
        "instructions": len(body),
        "warp_instructions": total,
        "weight_bytes": per_iter,
        "per_byte": total / per_iter,
        "per_32_bytes": 32 * total / per_iter,
        "classes": dict(Counter(classify(op) for _, op, _ in body).most_common()),
        "opcodes": dict(Counter(op.split(".")[0] for _, op, _ in body).most_common()),
    }


def measure(ggml_type: int, n: int, k: int, sms: int, dtype: torch.dtype) -> dict:
    """Loop statistics of one type at one shape.

    :return: the launch, instructions per iteration (per warp and for all warps), weight
        bytes per iteration, warp-instructions per weight byte and per 32, and the body's
        instruction classes and opcodes.
    """
    sass, launch = compile_sass(ggml_type, n, k, sms, dtype)
    body = main_loop(parse(sass), INNER_TRIPS.get(ggml_type, 1))
    _, type_size = qgemv.LAYOUTS[ggml_type]
    per_iter = launch["BLOCK_N"] * launch["UNITS"] * type_size
    return _loop_stats(launch, body, launch["num_warps"], per_iter)


def main(argv: list[str] | None = None) -> int:
    """Print the loop statistics of each type.

    :param argv: command-line arguments (default ``sys.argv[1:]``).
    :return: the exit status.
    """
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--types", default=",".join(TYPES), help="types, comma-separated")
    p.add_argument("--shape", default="6144x4096", help="rows x values per row (q/k/v of 8B)")
    p.add_argument("--sms", type=int, default=132, help="multiprocessors to plan for")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--packed", action="store_true", help="the packed Q4_K kernel instead")
    p.add_argument("--packed-q6k", action="store_true", help="the packed Q6_K kernel instead")
    p.add_argument("--json", help="write the results to this file")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    n, k = (int(v) for v in args.shape.split("x"))
    dtype = getattr(torch, args.dtype)
    results = {}
    if args.packed_q6k:
        names = ["Q6_K packed"]
    else:
        names = ["Q4_K packed"] if args.packed else args.types.split(",")
    for name in names:
        packed = name.endswith("packed")
        if name not in TYPES and not packed:
            p.error(f"unknown type {name!r}; choose from {', '.join(TYPES)}")
        if packed:
            r = results[name] = measure_packed(n, k, args.sms, dtype, q6k=args.packed_q6k)
        else:
            r = results[name] = measure(TYPES[name], n, k, args.sms, dtype)
        launch = {key: v for key, v in r["launch"].items() if key != "GGML_TYPE"}
        logger.info(
            "%-5s %5d instr x %d warps / %5d B = %.3f per byte (%.1f per 32 B, %.1fx the "
            "%.3f budget)  %s",
            name, r["instructions"], launch["num_warps"], r["weight_bytes"], r["per_byte"],
            r["per_32_bytes"], r["per_byte"] / BUDGET, BUDGET, launch,
        )  # fmt: skip
        logger.info("      classes: %s", r["classes"])
        logger.info("      opcodes: %s", r["opcodes"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": [n, k], "dtype": args.dtype, "budget": BUDGET, **results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
