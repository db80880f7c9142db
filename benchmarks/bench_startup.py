"""Start-up times, each in a fresh interpreter, the default model already converted:

  import       `python -c "import lmq_backend"`
  plugin       `python -c "import lmq_backend.lmql.plugin"`
  lmq run      `lmq run examples/number.lmq` (the first run of a CLI user: load the default model, one query)
  backend      `HFBackend("default")` alone, split by phase (model files, engine set-up with the fused layout
               built and taken from disk, vocabulary index)
  lmql call    the plugin's first call: `lmql.model("local:lmq:default")` + one query, LMQL's subprocess mode

    python benchmarks/bench_startup.py [--repeat 3] [--only import,plugin,run,backend,lmql] [--env K=V ...]

Medians over --repeat runs of wall-clock seconds and of CPU seconds (user + system, the command and the
processes it waited for: LMQL's model process too). On a shared machine under load, wall-clock time
grows with the load; CPU time much less, so compare CPU seconds there. `--env` sets variables for every
command (e.g. `--env OMP_NUM_THREADS=1`: a busy machine's OpenMP threads spin-wait for a core).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BACKEND_PHASES = r'''
import json, time
phases = {}
t, c = time.perf_counter(), time.process_time()
def phase(name):
    global t, c
    now, cpu = time.perf_counter(), time.process_time()
    phases[name] = (now - t, cpu - c)
    t, c = now, cpu
import torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
phase("import torch, transformers")
from lmq_backend.backend.default_model import default_model_dir
path = default_model_dir()
tok = AutoTokenizer.from_pretrained(str(path))
phase("AutoTokenizer.from_pretrained")
model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, use_kernels=False)
phase("AutoModelForCausalLM.from_pretrained")
from lmq_backend.backend.hf import HFBackend
from lmq_backend.engine.runner import ModelRunner
phase("import lmq_backend.backend.hf")
ModelRunner(model, max_batch=256)
phase("ModelRunner(model): the fused layout built")
try:
    from lmq_backend.engine.fused.weight_cache import laid_out
    laid_out(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, use_kernels=False), path)  # (writes it once)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, use_kernels=False)
    t, c = time.perf_counter(), time.process_time()
    ModelRunner(model, max_batch=256, weights_folder=path)
    phase("ModelRunner(model, weights_folder=): from disk")
except ImportError:
    pass
from lmq_backend.text.vocab import VocabIndex
VocabIndex(tok, model.config.vocab_size)
phase("VocabIndex built")
try:
    from lmq_backend.text.vocab_cache import vocab_index
    vocab_index(AutoTokenizer.from_pretrained(str(path)), model.config.vocab_size)  # (writes it once)
    fresh = AutoTokenizer.from_pretrained(str(path))
    t, c = time.perf_counter(), time.process_time()
    vocab_index(fresh, model.config.vocab_size)
    phase("VocabIndex from disk")
except ImportError:
    pass
HFBackend("default")
phase("HFBackend('default') after the above")
print(json.dumps(phases))
'''

LMQL_CALL = r'''
import asyncio, time
t0 = time.perf_counter()
import lmql
PLUGIN
q = lmql.query('"Q: 2+2=?\\nA:[X]" where len(TOKENS(X)) < 3\nreturn X', model=lmql.model(MODEL))
print(repr(asyncio.run(q())))
print("SECONDS", time.perf_counter() - t0)
'''


def cpu_of_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


ENV = dict(os.environ)


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, float, str]:
    """Wall-clock seconds, CPU seconds (the command and the children it waited for) and its output."""
    t, c = time.perf_counter(), cpu_of_children()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env or ENV, timeout=600)
    seconds, cpu = time.perf_counter() - t, cpu_of_children() - c
    if done.returncode != 0:
        raise RuntimeError(f"{cmd} failed:\n{done.stderr[-3000:]}")
    return seconds, cpu, done.stdout


def median_of(label: str, cmd: list[str], repeat: int) -> None:
    runs = [timed(cmd)[:2] for _ in range(repeat)]
    wall, cpu = statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)
    print(f"{label:<46} {wall:7.2f} s wall {cpu:7.2f} s CPU   (wall: {', '.join(f'{w:.2f}' for w, _ in runs)})",
          flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--only", default="import,plugin,run,backend,lmql")
    p.add_argument("--env", nargs="*", default=[], help="K=V set for every command")
    a = p.parse_args()
    ENV.update(kv.split("=", 1) for kv in a.env)
    parts = set(a.only.split(","))
    py = sys.executable
    lmq = str(Path(py).with_name("lmq"))
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}; medians of {a.repeat}{'; ' + ' '.join(a.env) if a.env else ''}", flush=True)
    if "import" in parts:
        median_of('python -c "import lmq_backend"', [py, "-c", "import lmq_backend"], a.repeat)
    if "plugin" in parts:
        median_of('python -c "import lmq_backend.lmql.plugin"', [py, "-c", "import lmq_backend.lmql.plugin"],
                  a.repeat)
    if "run" in parts:
        median_of("lmq run examples/number.lmq", [lmq, "run", "examples/number.lmq"], a.repeat)
    if "backend" in parts:
        phases = [json.loads(timed([py, "-c", BACKEND_PHASES])[2]) for _ in range(a.repeat)]
        for k in phases[0]:
            wall, cpu = (statistics.median(ph[k][i] for ph in phases) for i in (0, 1))
            print(f"  {k:<44} {wall:7.2f} s wall {cpu:7.2f} s CPU", flush=True)
    if "lmql" in parts:
        for label, plugin, model in [
            ("lmql: plugin import + tokenizer=, 1st query", "import lmq_backend.lmql.plugin as p",
             "'local:lmq:default', tokenizer=p.model('default').configuration['tokenizer']"),
            ("lmql: lmql.model('local:lmq:default') alone", "", "'local:lmq:default'"),
        ]:
            src = LMQL_CALL.replace("PLUGIN", plugin).replace("MODEL", model)
            try:
                median_of(label, [py, "-c", src], a.repeat)
            except RuntimeError as e:
                print(f"{label:<44} fails: {str(e).strip().splitlines()[-1][:100]}", flush=True)


if __name__ == "__main__":
    main()
