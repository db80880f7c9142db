"""lmq's C kernels built from edited sources, for fault tests: a test injects a known fault into a copy of
kernels/cpu/*.c, runs the engine on that library (`cpu.use`) and checks that its comparison fails.

    lib = faulty_kernels(tmp_path, TRIPLE_SCORES_PAST_1024)
    with cpu.use(lib): ...

`QUANTIZED_FAULTS` are four faults of the quantized kernels (qgemm.c) in one build, each switched on at run time
(`switch(lib, fault)`), so that one compile serves them all.

The copy is built by `lmq_kernels.cpu.toolchain` (the engine's flags and target) into a folder of its own, so it
never replaces the engine's library. An edit whose text does not occur exactly once in its file fails the test
(a kernel that changed under the fault must not turn it into a no-op)."""
from __future__ import annotations

import ctypes
import importlib
import shutil
from pathlib import Path

import pytest

from lmq_kernels import cpu

Edits = dict[str, list[tuple[str, str]]]  # file name -> (text, replacement), each text found exactly once

# the C decode attention (attention.c, which the per-op call and the fused C step both run): the scores of a
# row's columns from 1,024 on (its chunks of CH columns counted from the row's first column) tripled
TRIPLE_SCORES_PAST_1024: Edits = {"attention.c": [(
    "chunk(qp, pp, P, kb, sks, vb, svs, tb, cn, scale, sc, u, DV); break;",
    "chunk(qp, pp, P, kb, sks, vb, svs, tb, cn, gr->i * CH >= 1024 ? 3.0f * scale : scale, sc, u, DV); break;")]}


def faulty_kernels(directory: Path, edits: Edits) -> ctypes.CDLL:
    """The kernels built from a copy of their sources with `edits` applied, under `directory`."""
    build_module = importlib.import_module("lmq_kernels.cpu.toolchain")
    src = Path(directory) / "src"
    shutil.copytree(build_module.HERE, src, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    for name, pairs in edits.items():
        text = (src / name).read_text()
        for old, new in pairs:
            assert text.count(old) == 1, f"{name}: the fault's text is not there once: {old!r}"
            text = text.replace(old, new)
        (src / name).write_text(text)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(build_module, "HERE", src)
        lib = cpu.build("native", Path(directory) / "lib")
        assert lib is not None, cpu.build_error("native", Path(directory) / "lib")
    return lib


# the quantized kernels (qgemm.c): in the 8-row blocks of the GEMM (a decode step of 8 rows or more) and in the
# de-quantization into panels (a prefill of more than 64 rows multiplies in the float32 GEMM over them), a
# swapped nibble (int4: the first byte of each group read high nibble first) or the scales one ulp up (int8's
# scale, int4's d). `lmq_fault` (a global of the library) picks one: 0 none.
QUANTIZED_FAULTS = {"8-row nibble": 1, "8-row scale ulp": 2, "panels nibble": 3, "panels scale ulp": 4}
QUANTIZED_FAULT_EDITS: Edits = {"qgemm.c": [
    ("/* Rows [0, M) (M <= MR) x outputs",
     "int lmq_fault = 0;\n"
     "static inline float ulp_up(float x) { union { float f; unsigned u; } v = {x}; v.u += 1; return v.f; }\n\n"
     "/* Rows [0, M) (M <= MR) x outputs"),
    ("* scale[(n + j) * groups + g];",
     "* (M == 8 && lmq_fault == 2 ? ulp_up(scale[(n + j) * groups + g]) : scale[(n + j) * groups + g]);"),
    ("const vf dv = (vf){0} + d[(n + j) * groups + g], mv",
     "const vf dv = (vf){0} + (M == 8 && lmq_fault == 2 ? ulp_up(d[(n + j) * groups + g]) : d[(n + j) * groups + g]), mv"),
    ("lo[j] = __builtin_convertvector(b & 15, vf) * dv + mv;\n"
     "                hi[j] = __builtin_convertvector(b >> 4, vf) * dv + mv;",
     "const int swap = M == 8 && lmq_fault == 1 && p == 0;\n"
     "                lo[j] = __builtin_convertvector(swap ? b >> 4 : b & 15, vf) * dv + mv;\n"
     "                hi[j] = __builtin_convertvector(swap ? b & 15 : b >> 4, vf) * dv + mv;"),
    ("        return;\n    }\n    #pragma omp parallel for schedule(static) num_threads(threads)\n",
     "        return;\n    }\n"
     "    if (lmq_fault == 4) {\n"
     "        float *up = malloc(sizeof(float) * N * (K / GROUP));\n"
     "        for (long i = 0; i < N * (K / GROUP); i++) up[i] = ulp_up(scale[i]);\n"
     "        scale = up;\n"
     "    }\n"
     "    #pragma omp parallel for schedule(static) num_threads(threads)\n"),
    ("            for (int j = 0; j < P; j++) GROUP_TO(tile + j * GROUP, p * P + j, g);\n",
     "            for (int j = 0; j < P; j++) GROUP_TO(tile + j * GROUP, p * P + j, g);\n"
     "            if (lmq_fault == 3 && q4)\n"
     "                for (int j = 0; j < P; j++) {\n"
     "                    const float t = tile[j * GROUP]; tile[j * GROUP] = tile[j * GROUP + 16]; tile[j * GROUP + 16] = t;\n"
     "                }\n"),
    ("#include <omp.h>\n", "#include <omp.h>\n#include <stdlib.h>\n"),
]}


def switch(lib: ctypes.CDLL, fault: int) -> None:
    """Switch a `QUANTIZED_FAULT_EDITS` library's fault on (its number in QUANTIZED_FAULTS) or off (0)."""
    ctypes.c_int.in_dll(lib, "lmq_fault").value = fault
