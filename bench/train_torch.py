#!/usr/bin/env python3
"""bench/train's peer: PyTorch training the same GPT-2 (the model of
tests/support/gpt2_torch.py, Hugging Face's GPT2LMHeadModel layout) on
the same batch shape with torch.optim.AdamW and the same threads.

  train_torch.py SPEC STEPS BATCH SEQ THREADS [ckpt]

(ckpt: each block under torch.utils.checkpoint, recomputed in backward)

prints {"step_seconds": [...], "busy_threads": N}: each step is zero_grad,
forward, backward and the optimizer step; busy_threads counts this
process's threads that ran for more than 5 % of the steps' time (the
check that it computed on THREADS cores, not more). Exit 3 when torch is
missing (bench/train then fails: a benchmark without its peer measures
nothing).

Debian's torch does its float32 products in the system BLAS, OpenBLAS's
pthreads build, whose own thread pool torch.set_num_threads does not
size: unset, it computed on every core (2 busy threads on a 2-core
machine at THREADS = 1). OPENBLAS_NUM_THREADS, read when OpenBLAS loads,
holds it to THREADS, as the worker's --threads does.
"""
import importlib.util
import json
import os
import sys
import time

if len(sys.argv) in (6, 7):
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        os.environ[var] = sys.argv[5]

try:
    import torch
except ImportError as e:
    sys.stderr.write("train_torch.py: %s (Debian: python3-torch)\n" % e)
    sys.exit(3)


def main():
    spec_path, steps, batch, seq, threads = sys.argv[1], *map(int, sys.argv[2:6])
    here = os.path.dirname(os.path.abspath(__file__))
    mod = importlib.util.spec_from_file_location(
        "gpt2_torch", os.path.join(here, "..", "tests", "support", "gpt2_torch.py"))
    g = importlib.util.module_from_spec(mod)
    mod.loader.exec_module(g)
    with open(spec_path) as f:
        spec = json.load(f)
    shapes = {p["fqn"]: p["shape"] for p in spec["params"]}
    V, C = shapes["transformer.wte.weight"]
    ctx = shapes["transformer.wpe.weight"][0]
    L = sum(1 for k in shapes if k.endswith(".ln_1.weight"))
    heads = spec.get("config", {}).get("n_head", C // 64)
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    m = g.GPT2LMHeadModel(V, C, ctx, L, heads,
                          checkpointing=len(sys.argv) > 6 and sys.argv[6] == "ckpt")
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.02)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    tok = torch.randint(0, V, (batch, seq))
    tgt = torch.randint(0, V, (batch, seq))
    secs = []
    cpu0 = thread_cpu()
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        m(tok, tgt).backward()
        opt.step()
        secs.append(time.perf_counter() - t0)
    cpu1 = thread_cpu()
    busy = sum(1 for t, c in cpu1.items() if c - cpu0.get(t, 0) > 0.05 * sum(secs))
    print(json.dumps({"step_seconds": secs, "busy_threads": busy}))


def thread_cpu():
    """CPU seconds (user + system) of each thread of this process."""
    out, tick = {}, os.sysconf("SC_CLK_TCK")
    for t in os.listdir("/proc/self/task"):
        try:
            with open("/proc/self/task/%s/stat" % t) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[t] = (int(fields[11]) + int(fields[12])) / tick
        except OSError:  # the thread ended meanwhile
            pass
    return out


if __name__ == "__main__":
    main()
