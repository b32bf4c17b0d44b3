#!/usr/bin/env python3
"""What a lost rank costs: replica groups that continue against the restart
of the whole job, measured in the same run on the same machine.

Two hosts' agents of two workers each (HYBRID_SHARD, shard groups of 2:
two replica groups, one per host) train a model; rank 3 dies mid-training,
by SIGKILL or by --inject exit. Each case runs twice:
  continue  the coordinator's --on-group-failure continue: group 1 is
            dropped, group 0 trains on, group 1 rejoins with its live state;
  restart   the baseline: --max-restarts 1, every worker stopped and the
            job restarted from its last checkpoint (--checkpoint-every).
Per run: the survivors' committed steps lost (steps trained again after
the fault that had been completed before it), the steps run again, the
time from the fault to the survivors' next completed step, the time until
the dead rank's group trains again, and (continue) whether every rank's
shard, buffers and optimizer state equal its replica's bit for bit at the
end (their LOCAL checkpoints). Then the ratios continue / restart.

A run that does not complete, or a missing program, fails the benchmark
(exit 1): nothing is skipped."""

import argparse
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "tests", "support"))
import procs  # noqa: E402

LINE_TIME = re.compile(r"^(\d\d):(\d\d):(\d\d\.\d+) ")


def fail(msg):
    print("FAIL: " + msg, flush=True)
    sys.exit(1)


def tod(t):
    """Seconds of the local day of a time.time(), as the workers' line
    times count them."""
    lt = time.localtime(t)
    return lt.tm_hour * 3600 + lt.tm_min * 60 + lt.tm_sec + (t % 1)


def lines_with_time(path):
    out = []
    try:
        with open(path, errors="replace") as f:
            for line in f:
                m = LINE_TIME.match(line)
                if m:
                    t = int(m.group(1)) * 3600 + int(m.group(2)) * 60 + \
                        float(m.group(3))
                    out.append((t, line.rstrip("\n")))
    except OSError:
        pass
    return out


def tensor_bytes(path):
    with open(path, "rb") as f:
        b = f.read()
    n = struct.unpack("<Q", b[:8])[0]
    return b[8 + n:]


class Job:
    """A coordinator and two agents, each in a process group of its own."""

    def __init__(self, args, root, model, policy, fault, steps, at_step):
        self.root = root
        self.procs = []
        b = args.bin
        job = ["--strategy", "HYBRID_SHARD", "--shard-group-size", "2"]
        if model["wrap"]:
            job += ["--wrap-type", model["wrap"]]
        coord = [os.path.join(b, "shardplane-coordinator"), "--listen",
                 "127.0.0.1:0", "--model", model["spec"], "--world-size", "4",
                 "--insecure", "--no-auth"] + job
        if policy == "continue":
            coord += ["--on-group-failure", "continue"]
        self.coord_out = os.path.join(root, "coord.out")
        self.spawn(coord, self.coord_out, self.coord_out)
        port = None
        end = time.time() + 30
        while port is None and time.time() < end:
            with open(self.coord_out) as f:
                m = re.search(r"listening on 127\.0\.0\.1:(\d+)", f.read())
            port = m.group(1) if m else None
            time.sleep(0.05)
        if port is None:
            fail("the coordinator did not listen:\n" + open(self.coord_out).read())
        self.ck = os.path.join(root, "ck")
        trainer = [os.path.join(b, "shardplane-worker"), "--insecure",
                   "--steps", str(steps), "--log-every", "1",
                   "--checkpoint-dir", self.ck] + model["flags"]
        extra = []
        if policy == "continue":
            trainer += ["--checkpoint", "local"]
        else:
            trainer += ["--checkpoint", "full", "--checkpoint-every",
                        str(model["ckpt_every"])]
            extra = ["--max-restarts", "1", "--load-on-restart", self.ck]
        if fault == "exit":
            trainer += ["--inject", "exit:rank=3,step=%d" % at_step]
        self.agents = []
        for n in (0, 1):
            argv = [os.path.join(b, "shardplane"), "agent", "--coordinator",
                    "127.0.0.1:" + port, "--insecure", "--nproc-per-node", "2",
                    "--node-rank", str(n)] + extra + ["--"] + trainer
            out = os.path.join(root, "agent%d.out" % n)
            err = os.path.join(root, "agent%d.err" % n)
            self.agents.append(self.spawn(argv, out, err))

    def spawn(self, argv, out, err):
        p = procs.spawn(argv, out, err, env=dict(os.environ, TMPDIR=self.root))
        self.procs.append(p)
        return p

    def out(self, n):
        return os.path.join(self.root, "agent%d.out" % n)

    def err(self, n):
        return os.path.join(self.root, "agent%d.err" % n)

    def wait_agents(self, timeout):
        end = time.time() + timeout
        for a in self.agents:
            try:
                a.wait(timeout=max(1.0, end - time.time()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def stop(self):
        procs.stop(self.procs)


STEP = re.compile(r"\[rank0\]: step (\d+)/")


def run_case(args, model, policy, fault):
    root = tempfile.mkdtemp(prefix="shardplane-faults-")
    steps, at = model["steps"], model["at_step"]
    job = Job(args, root, model, policy, fault, steps, at)
    try:
        t_fault = None
        if fault == "kill":
            end = time.time() + 120
            while time.time() < end:
                done = [int(m.group(1)) for _, l in lines_with_time(job.out(0))
                        for m in [STEP.search(l)] if m]
                if done and done[-1] >= at:
                    break
                time.sleep(0.02)
            pid = procs.worker_of(job.agents[1].pid, 3)
            if pid is None:
                fail("%s/%s: no rank 3 to kill" % (model["name"], policy))
            t_fault = tod(time.time())
            os.kill(pid, signal.SIGKILL)
        if not job.wait_agents(args.timeout):
            fail("%s/%s/%s: the job did not end within %d s (files in %s)" %
                 (model["name"], policy, fault, args.timeout, root))
        codes = [a.returncode for a in job.agents]
        if codes != [0, 0]:
            fail("%s/%s/%s: agents exited %s (files in %s)" %
                 (model["name"], policy, fault, codes, root))
        if fault == "exit":
            for t, l in lines_with_time(job.err(1)):
                if "--inject exit: dying" in l:
                    t_fault = t
                    break
            if t_fault is None:
                fail("%s/%s: rank 3 did not die (files in %s)" %
                     (model["name"], policy, root))
        log0 = lines_with_time(job.out(0))
        before = [int(STEP.search(l).group(1)) for t, l in log0
                  if t <= t_fault and STEP.search(l)]
        # the restart's workers trained again once rank 0 resumed: a step
        # a survivor finished before it was stopped is not progress
        since = t_fault
        if policy == "restart":
            since = next((t for t, l in log0
                          if t > t_fault and "resuming after step" in l),
                         t_fault)
        after = [(t, int(STEP.search(l).group(1))) for t, l in log0
                 if t > since and STEP.search(l)]
        if not after:
            fail("%s/%s/%s: no step after the fault (files in %s)" %
                 (model["name"], policy, fault, root))
        last_before = before[-1] if before else 0
        next_s = after[0][0] - t_fault
        lost = max(0, last_before - (after[0][1] - 1))
        redone = sum(1 for _, l in log0 if "again" in l and "running step" in l)
        r = {"model": model["name"], "policy": policy, "fault": fault,
             "next_step_s": next_s, "lost": lost, "redone": redone,
             "last_before": last_before, "first_after": after[0][1]}
        if policy == "continue":
            back = [t for t, l in lines_with_time(job.out(1))
                    if "received the live state" in l]
            r["rejoin_s"] = back[0] - t_fault if back else None
            if r["rejoin_s"] is None:
                fail("%s/continue/%s: group 1 never rejoined (files in %s)" %
                     (model["name"], fault, root))
            local = os.path.join(job.ck, "local")
            r["equal"] = all(
                tensor_bytes(os.path.join(local, "local-%d-of-4.safetensors" % a))
                == tensor_bytes(os.path.join(local, "local-%d-of-4.safetensors" % (a + 2)))
                for a in (0, 1))
            if not r["equal"]:
                fail("%s/continue/%s: replicas differ (files in %s)" %
                     (model["name"], fault, root))
        else:
            r["rejoin_s"] = next_s
            r["equal"] = None
        shutil.rmtree(root, ignore_errors=True)
        return r
    finally:
        job.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", required=True, help="the folder of shardplane, "
                    "shardplane-coordinator and shardplane-worker")
    ap.add_argument("--examples", required=True, help="the examples folder")
    ap.add_argument("--timeout", type=int, default=300,
                    help="seconds a run may take (default 300)")
    ap.add_argument("--json", help="also write the results there")
    args = ap.parse_args()
    for p in ("shardplane", "shardplane-coordinator", "shardplane-worker"):
        if not os.access(os.path.join(args.bin, p), os.X_OK):
            fail("no %s in %s" % (p, args.bin))
    ex = args.examples
    models = [
        {"name": "mlp", "spec": os.path.join(ex, "mlp.json"), "wrap": None,
         "flags": [], "steps": 200, "at_step": 40, "ckpt_every": 25},
        {"name": "gpt2-tiny",
         "spec": os.path.join(ex, "models", "gpt2-tiny.json"),
         "wrap": "GPT2Block", "flags": ["--global-batch", "16"],
         "steps": 80, "at_step": 20, "ckpt_every": 10},
    ]
    results = []
    print("%-10s %-9s %-5s %10s %6s %7s %10s %7s" %
          ("model", "policy", "fault", "next step", "lost", "redone",
           "trains at", "equal"), flush=True)
    for m in models:
        for fault in ("kill", "exit"):
            pair = {}
            for policy in ("continue", "restart"):
                r = run_case(args, m, policy, fault)
                pair[policy] = r
                results.append(r)
                print("%-10s %-9s %-5s %9.3fs %6d %7d %9.3fs %7s" %
                      (m["name"], policy, fault, r["next_step_s"], r["lost"],
                       r["redone"], r["rejoin_s"],
                       "-" if r["equal"] is None else
                       ("yes" if r["equal"] else "NO")), flush=True)
            c, b = pair["continue"], pair["restart"]
            print("  %s/%s: the survivors' next step %.3f s after the fault "
                  "against %.3f s for the restart (ratio %.3f); committed "
                  "steps lost %d against %d" %
                  (m["name"], fault, c["next_step_s"], b["next_step_s"],
                   c["next_step_s"] / b["next_step_s"], c["lost"], b["lost"]),
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
