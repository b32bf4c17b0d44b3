#!/usr/bin/env python3
"""The soak (./dev soak, not in the CI suite): losses that are real under
pressure, for at least 10 minutes.

Several jobs train at once on this machine, each a coordinator with a
state dir and two agents of two workers (HYBRID_SHARD, two replica groups
that continue through faults), beside CPU hogs (more busy processes than
CPUs), a memory hog (a quarter of what is available, touched over and
over) and an I/O hog (64 MiB written and fsynced in a loop). Through the
run the soak kills a worker now and then (SIGKILL) and kills and starts
again a coordinator on its state dir. At the end it reads every
coordinator's log:
  - a false loss fails the soak: a rank declared lost, or a replica group
    dropped, that no deliberate kill explains (the killed rank's group, in
    the BOUND_S after the kill);
  - every kill must be named: its group dropped, naming a rank of it,
    within BOUND_S of the kill;
  - every job must still be training when the soak ends (no job failed).
It prints the figures (kills, how long each took to be named, coordinator
restarts, losses, the load average it ran under) and exits 1 on a breach.
"""

import argparse
import os
import re
import shutil
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "support"))
import procs  # noqa: E402

# A kill is named within this long (the rank's stream breaks at once; the
# agent reaps it within its poll): the bound the soak holds the
# coordinator to.
BOUND_S = 5.0


def fail(msg):
    print("FAIL: " + msg, flush=True)


class Procs:
    """Every process the soak starts, ended together."""

    def __init__(self, root):
        self.root = root
        self.all = []

    def start(self, argv, log):
        p = procs.spawn(argv, log, env=dict(os.environ, TMPDIR=self.root))
        self.all.append(p)
        return p

    def stop_all(self):
        procs.stop(self.all, term_s=15)


class Job:
    def __init__(self, group, args, n):
        self.n = n
        self.dir = os.path.join(group.root, "job%d" % n)
        os.makedirs(self.dir)
        self.port = procs.free_port()
        self.group = group
        self.args = args
        self.log = os.path.join(self.dir, "coordinator.log")
        self.start_coordinator()
        trainer = [os.path.join(args.bin, "shardplane-worker"), "--insecure",
                   "--steps", "2000000", "--log-every", "500",
                   "--checkpoint", "none"]
        self.agents = []
        for node in (0, 1):
            argv = [os.path.join(args.bin, "shardplane"), "agent",
                    "--coordinator", "127.0.0.1:%d" % self.port,
                    "--insecure", "--nproc-per-node", "2", "--node-rank",
                    str(node), "--"] + trainer
            self.agents.append(group.start(
                argv, os.path.join(self.dir, "agent%d.log" % node)))

    def start_coordinator(self):
        argv = [os.path.join(self.args.bin, "shardplane-coordinator"),
                "--listen", "127.0.0.1:%d" % self.port, "--model",
                os.path.join(self.args.examples, "mlp.json"), "--world-size",
                "4", "--strategy", "HYBRID_SHARD", "--shard-group-size", "2",
                "--on-group-failure", "continue", "--insecure", "--no-auth",
                "--state-dir", os.path.join(self.dir, "state")]
        self.coord = self.group.start(argv, self.log)
        end = time.time() + 30
        while time.time() < end:
            with open(self.log, errors="replace") as f:
                if "listening on 127.0.0.1:%d" % self.port in f.read():
                    return
            time.sleep(0.1)
        raise RuntimeError("job %d: the coordinator did not listen" % self.n)

    def restart_coordinator(self):
        os.killpg(self.coord.pid, signal.SIGKILL)
        self.coord.wait()
        self.start_coordinator()

    def worker(self, rank):
        return procs.worker_of(self.agents[rank // 2].pid, rank)


def start_pressure(group, root):
    cpus = os.cpu_count() or 2
    hog = "while True: pass\n"
    for i in range(4 * cpus):
        group.start([sys.executable, "-c", hog],
                    os.path.join(root, "cpu%d.log" % i))
    with open("/proc/meminfo") as f:
        avail = int(re.search(r"MemAvailable:\s+(\d+)", f.read()).group(1))
    mem = ("import time\n"
           "b = bytearray(%d)\n"
           "while True:\n"
           "    for i in range(0, len(b), 4096): b[i] = (b[i] + 1) %% 256\n"
           "    time.sleep(0.5)\n" % (avail * 1024 // 4))
    group.start([sys.executable, "-c", mem], os.path.join(root, "mem.log"))
    io = ("import os\n"
          "p = os.path.join(%r, 'io.bin')\n"
          "buf = os.urandom(1 << 20)\n"
          "while True:\n"
          "    with open(p, 'wb') as f:\n"
          "        for _ in range(64): f.write(buf)\n"
          "        f.flush(); os.fsync(f.fileno())\n" % root)
    group.start([sys.executable, "-c", io], os.path.join(root, "io.log"))


class Watch:
    """The coordinators' log lines that declare a loss or a drop, stamped
    with the time they were first seen (the log has no times of its own);
    read every POLL_S, so a stamp is at most that late."""

    POLL_S = 0.2

    def __init__(self, jobs):
        self.jobs = jobs
        self.pos = {j.n: 0 for j in jobs}
        self.events = []  # (time, job, line)

    def poll(self):
        now = time.time()
        for job in self.jobs:
            try:
                with open(job.log, errors="replace") as f:
                    f.seek(self.pos[job.n])
                    text = f.read()
                    self.pos[job.n] = f.tell()
            except OSError:
                continue
            for line in text.splitlines():
                if " lost: " in line or " dropped at step " in line:
                    self.events.append((now, job.n, line.strip()))

    def sleep(self, seconds, loads):
        end = time.time() + seconds
        while time.time() < end:
            self.poll()
            time.sleep(self.POLL_S)
        loads.append(os.getloadavg()[0])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", required=True)
    ap.add_argument("--examples", required=True)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--jobs", type=int, default=3)
    args = ap.parse_args()
    # a soak stopped by a signal still ends everything it started
    def stop(sig, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, stop)
    root = tempfile.mkdtemp(prefix="shardplane-soak-")
    group = Procs(root)
    kills, restarts, loads = [], [], []
    ok = True
    try:
        start_pressure(group, root)
        jobs = [Job(group, args, n) for n in range(args.jobs)]
        watch = Watch(jobs)
        t0 = time.time()
        end = t0 + args.minutes * 60
        # the faults, spread over the run: kills of a worker, round-robin
        # over jobs and ranks, and a coordinator restart in between
        plan, k, nk, nr = [], 0, 0, 0
        at = 45.0
        while at < args.minutes * 60 - 30:
            if k % 3 == 2:  # every job's coordinator in turn
                plan.append((at, "restart", (nr + 2) % args.jobs, None))
                nr += 1
            else:  # every job and every rank in turn
                plan.append((at, "kill", nk % args.jobs, (nk * 3 + 1) % 4))
                nk += 1
            k += 1
            at += 50.0
        for at, what, j, rank in plan:
            while time.time() < t0 + at:
                watch.sleep(1, loads)
            job = jobs[j]
            if what == "kill":
                pid = job.worker(rank)
                if pid is None:
                    print("job %d: rank %d has no process to kill (skipped)" %
                          (j, rank), flush=True)
                    continue
                os.kill(pid, signal.SIGKILL)
                kills.append((time.time(), j, rank))
                print("%6.1f s: job %d: killed rank %d" %
                      (time.time() - t0, j, rank), flush=True)
            else:
                job.restart_coordinator()
                restarts.append((time.time(), j))
                print("%6.1f s: job %d: coordinator killed and started again"
                      % (time.time() - t0, j), flush=True)
        while time.time() < end:
            watch.sleep(1, loads)
        # every job still training
        for job in jobs:
            for i, a in enumerate(job.agents):
                if a.poll() is not None:
                    fail("job %d: node %d's agent ended (%d) before the soak "
                         "did" % (job.n, i, a.returncode))
                    ok = False
        watch.poll()
        group.stop_all()
        # every loss explained, every kill named in time
        named = []
        for job in jobs:
            evs = [(t, line) for t, n, line in watch.events if n == job.n]
            mine = [(t, r) for t, jj, r in kills if jj == job.n]
            for t, line in evs:
                m = re.search(r"rank (\d+)", line)
                rank = int(m.group(1)) if m else -1
                why = [(kt, kr) for kt, kr in mine
                       if kr // 2 == rank // 2 and kt <= t <= kt + BOUND_S +
                       Watch.POLL_S]
                if not why:
                    fail("job %d: a false loss: %s" % (job.n, line))
                    ok = False
            for kt, kr in mine:
                hit = [t for t, line in evs if " dropped at step " in line and
                       re.search(r"ranks %d-%d\)" % (kr // 2 * 2,
                                                     kr // 2 * 2 + 1), line)
                       and kt <= t <= kt + BOUND_S + Watch.POLL_S]
                if not hit:
                    fail("job %d: the kill of rank %d was not named within "
                         "%.0f s" % (job.n, kr, BOUND_S))
                    ok = False
                else:
                    named.append(max(0.0, hit[0] - kt))
        print("soak: %.1f min, %d jobs of 4 ranks, load average %.1f "
              "(max %.1f) on %d CPUs; %d kills, each named within %.2f s "
              "(mean %.2f s, bound %.0f s); %d coordinator restarts; false "
              "losses: %s" %
              (args.minutes, args.jobs,
               sum(loads) / max(1, len(loads)), max(loads or [0]),
               os.cpu_count() or 0, len(kills), max(named or [0]),
               sum(named) / max(1, len(named)), BOUND_S, len(restarts),
               "none" if ok else "see above"), flush=True)
    finally:
        group.stop_all()
    if ok:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print("files kept in %s" % root)
    print("soak: %s" % ("passed" if ok else "FAILED"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
