#!/usr/bin/env python3
"""A real Slurm (Debian's slurm-wlm, authenticated by munge) runs the
cluster user's batch file, examples/slurm/train.sbatch: the test makes a
one-node cluster in a temporary folder (a munge key and munged, a
slurm.conf naming this machine, slurmctld and slurmd on free ports, all
started here and stopped at the end), submits the file with
`sbatch --wait` as two agents ("nodes" of the shardplane job, one Slurm
step each) and checks:

  1. the job trains to the end and exits 0;
  2. `scancel --signal=KILL JOBID.STEPID` of one node's step while the job
     trains is a lost node: the coordinator names the node and its ranks
     as lost, and the job ends as its policy (--max-restarts) says.

Without slurm-wlm or munge the test fails (scripts/deps.sh installs them);
it never skips. It needs root (munged and slurmd as root, as the packages'
services run them)."""

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "support"))
import procs  # noqa: E402
from procs import free_port  # noqa: E402

PROGRAMS = ["munged", "mungekey", "slurmctld", "slurmd", "sbatch", "sinfo",
            "squeue", "scancel", "scontrol", "srun"]


def fail(msg):
    print("FAIL: " + msg, flush=True)
    raise SystemExit(1)


def tail(path, n=40):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError as e:
        return "(%s)" % e


class Cluster:
    """munged, slurmctld and slurmd, each in a process group of its own,
    with every file in one temporary folder."""

    def __init__(self, root):
        self.root = root
        self.procs = []
        self.node = socket.gethostname().split(".")[0]
        self.cpus = os.cpu_count() or 1
        self.sock = os.path.join(root, "munge", "munge.socket.2")
        self.conf = os.path.join(root, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        for v in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_NODELIST"):
            self.env.pop(v, None)

    def spawn(self, name, argv):
        log = open(os.path.join(self.root, name + ".out"), "w")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, env=self.env,
                             start_new_session=True)
        log.close()
        self.procs.append((name, p))
        print("started %s (pid %d): %s" % (name, p.pid, " ".join(argv)),
              flush=True)
        return p

    def start(self):
        m = os.path.join(self.root, "munge")
        os.makedirs(m)
        os.chmod(m, 0o755)
        key = os.path.join(m, "munge.key")
        subprocess.run(["mungekey", "--create", "--keyfile", key, "--force"],
                       check=True, timeout=30)
        os.chmod(key, 0o600)
        self.spawn("munged", [
            "munged", "--foreground", "--force", "--socket", self.sock,
            "--key-file", key, "--pid-file", os.path.join(m, "munged.pid"),
            "--log-file", os.path.join(m, "munged.log"),
            "--seed-file", os.path.join(m, "munged.seed")])
        self.wait_for(lambda: os.path.exists(self.sock), 20,
                      "munged's socket", "munged")
        ctld_port, d_port = free_port(), free_port()
        spool = os.path.join(self.root, "spool")
        state = os.path.join(self.root, "state")
        os.makedirs(spool)
        os.makedirs(state)
        r = self.root
        conf = """\
# a one-node cluster of the shardplane Slurm test
ClusterName=shardplane-test
SlurmctldHost={node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
StateSaveLocation={state}
SlurmdSpoolDir={spool}
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdParameters=config_overrides
MailProg=/bin/true
InactiveLimit=0
KillWait=5
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""".format(node=self.node, ctld_port=ctld_port, d_port=d_port,
           sock=self.sock, state=state, spool=spool, r=r, cpus=self.cpus)
        with open(self.conf, "w") as f:
            f.write(conf)
        self.spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", self.conf])
        self.spawn("slurmd", ["slurmd", "-D", "-N", self.node, "-f",
                              self.conf])

        def idle():
            r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"],
                               env=self.env, capture_output=True, text=True,
                               timeout=10)
            self.last_sinfo = (r.stdout + r.stderr).strip()
            return r.returncode == 0 and re.search(
                r"^%s idle" % re.escape(self.node), r.stdout, re.M)
        self.last_sinfo = ""
        self.wait_for(idle, 60, "the node idle in sinfo", "sinfo")
        print("sinfo: %s" % self.last_sinfo, flush=True)

    def wait_for(self, cond, seconds, what, who):
        end = time.time() + seconds
        while time.time() < end:
            for name, p in self.procs:
                if p.poll() is not None:
                    self.explain()
                    fail("%s exited with status %d before %s" %
                         (name, p.returncode, what))
            if cond():
                return
            time.sleep(0.5)
        self.explain()
        fail("no %s after %d s (%s)" % (what, seconds, who))

    def explain(self):
        for f in ("munged.out", "munge/munged.log", "slurmctld.out",
                  "slurmctld.log", "slurmd.out", "slurmd.log"):
            p = os.path.join(self.root, f)
            if os.path.exists(p):
                print("---- %s (last lines)\n%s" % (f, tail(p)), flush=True)
        if getattr(self, "last_sinfo", ""):
            print("---- sinfo: %s" % self.last_sinfo, flush=True)

    def stop(self):
        procs.stop([p for _, p in self.procs])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shardplane", required=True)
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--worker", required=True)
    ap.add_argument("--examples", required=True)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--only", default="")
    args = ap.parse_args()

    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        fail("not installed: %s (the Debian packages slurm-wlm and munge; "
             "scripts/deps.sh installs them)" % " ".join(missing))
    if os.geteuid() != 0:
        fail("needs root: munged, slurmctld and slurmd run as root here")
    root = tempfile.mkdtemp(prefix="shardplane-slurm-")
    os.chmod(root, 0o755)
    # the batch file takes one folder of the three programs
    args.bin_dir = os.path.join(root, "bin")
    os.makedirs(args.bin_dir)
    for name, path in (("shardplane", args.shardplane),
                       ("shardplane-coordinator", args.coordinator),
                       ("shardplane-worker", args.worker)):
        os.symlink(os.path.abspath(path), os.path.join(args.bin_dir, name))
    args.examples = os.path.abspath(args.examples)
    cluster = Cluster(root)
    ok = False
    try:
        cluster.start()
        ok = run_cases(cluster, args)
    finally:
        cluster.stop()
        if ok and not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print("files kept in %s" % root, flush=True)
    print("interop_slurm: %s" % ("passed" if ok else "FAILED"), flush=True)
    return 0 if ok else 1


def job_env(cluster, args, name, **kw):
    d = os.path.join(cluster.root, name)
    os.makedirs(d)
    env = dict(cluster.env,
               SP_BIN=args.bin_dir,
               SP_MODEL=os.path.join(args.examples, "mlp.json"),
               SP_NPROC_PER_NODE="1",
               SP_COORD_HOST="127.0.0.1",
               SP_PORT=str(free_port()),
               SP_DIR=os.path.join(d, "job"))
    env.update({k: str(v) for k, v in kw.items()})
    return d, env


def sbatch(cluster, args, d, env, wait=True):
    """sbatch of the example on one node as two agents (two Slurm tasks,
    one step each); returns the Popen of `sbatch --wait`."""
    out = os.path.join(d, "slurm-%j.out")
    argv = ["sbatch", "--wait", "--parsable", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2",
            "--cpus-per-task=1", "--chdir=" + d, "--output=" + out,
            "--time=5", os.path.join(args.examples, "slurm",
                                     "train.sbatch")]
    print("$ " + " ".join(argv), flush=True)
    return subprocess.Popen(argv, env=env, cwd=d, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def job_output(d):
    outs = [f for f in os.listdir(d) if f.startswith("slurm-")]
    if not outs:
        return ""
    with open(os.path.join(d, outs[0]), errors="replace") as f:
        return f.read()


def sbatch_done(p, d):
    """Waits up to 150 s for `sbatch --wait` p (killed past it, the test
    failing), prints what it and the job printed; the job's output."""
    try:
        so, _ = p.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        so, _ = p.communicate()
        print(job_output(d))
        fail("sbatch --wait did not return in 150 s")
    out = job_output(d)
    print("sbatch printed: %s (exit %d)" % (so.strip(), p.returncode))
    print("---- the job's output\n" + out, flush=True)
    return out


def case_trains(cluster, args):
    d, env = job_env(cluster, args, "trains", SP_STEPS=8,
                     SP_CHECKPOINT_EVERY=4, SP_MAX_RESTARTS=0)
    p = sbatch(cluster, args, d, env)
    out = sbatch_done(p, d)
    if p.returncode != 0:
        cluster.explain()
        fail("sbatch --wait ended %d, not 0" % p.returncode)
    if not re.search(r"\[rank0\]: step 8/8 ", out):
        fail("no 'step 8/8' of rank 0 in the job's output")
    if "completed: all 2 ranks finished at step 8" not in out:
        fail("shardplane incarnations did not say the job completed")
    if "the job ends with status 0" not in out:
        fail("the job did not say it ends with status 0")


def wait_output(d, pattern, seconds, p):
    end = time.time() + seconds
    while time.time() < end:
        if re.search(pattern, job_output(d), re.M):
            return
        if p.poll() is not None:
            break
        time.sleep(0.2)
    print(job_output(d))
    fail("no line matching %r in the job's output" % pattern)


def kill_node_step(cluster, job, node):
    """scancel --signal=KILL of node's agent step: Slurm SIGKILLs every
    process of that step (the agent and its workers), as when the node
    dies."""
    r = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i %j"],
                       env=cluster.env, capture_output=True, text=True,
                       timeout=10)
    print("$ squeue -s -j %s -o '%%i %%j'\n%s" % (job, r.stdout), end="")
    step = None
    for line in r.stdout.splitlines():
        f = line.split()
        if len(f) == 2 and f[1] == "shardplane-node%d" % node:
            step = f[0]
    if step is None:
        fail("no step shardplane-node%d in squeue -s" % node)
    argv = ["scancel", "--signal=KILL", step]
    print("$ " + " ".join(argv), flush=True)
    r = subprocess.run(argv, env=cluster.env, capture_output=True,
                       text=True, timeout=10)
    if r.returncode != 0:
        fail("scancel ended %d: %s" % (r.returncode, r.stderr))
    return step


def lost_node(cluster, args, name, restarts):
    d, env = job_env(cluster, args, name, SP_STEPS=3000,
                     SP_CHECKPOINT_EVERY=100, SP_MAX_RESTARTS=restarts)
    p = sbatch(cluster, args, d, env)
    wait_output(d, r"\[rank0\]: step 300/", 120, p)
    job = re.search(r"JOB (\d+)", "JOB " + job_id(d)).group(1)
    kill_node_step(cluster, job, 1)
    out = sbatch_done(p, d)
    print("---- coordinator.log\n" + tail(os.path.join(d, "job",
                                                       "coordinator.log"),
                                          60), flush=True)
    return p.returncode, out


def job_id(d):
    outs = [f for f in os.listdir(d) if f.startswith("slurm-")]
    return outs[0][len("slurm-"):-len(".out")]


def case_lost_node(cluster, args):
    """Without restarts (--max-restarts 0) a lost node ends the job: the
    coordinator names node 1 and its rank as lost, the surviving agent
    stops, and the batch job fails."""
    rc, out = lost_node(cluster, args, "lost", 0)
    with open(os.path.join(cluster.root, "lost", "job",
                           "coordinator.log")) as f:
        log = f.read()
    if rc == 0:
        fail("the job ended 0 after a node was lost")
    for want in ("rank 1 lost: session stream broken",
                 "node 1 lost: its agent"):
        if want not in log:
            fail("the coordinator's log does not say %r" % want)
    if "[alert]: LOST: rank 1 was lost" not in out:
        fail("the surviving agent did not print the LOST alert")
    if "Segmentation fault" in out:
        fail("something crashed")


def case_continues(cluster, args):
    """HYBRID_SHARD (one replica group per node) with --on-group-failure
    continue: scancel of node 1's step drops its replica group, node 0
    trains on to the last step and writes the checkpoint, the job is
    COMPLETED and the batch job ends 0."""
    d, env = job_env(cluster, args, "continues", SP_STEPS=3000,
                     SP_CHECKPOINT_EVERY=1000, SP_MAX_RESTARTS=0,
                     SP_STRATEGY="HYBRID_SHARD",
                     SP_ON_GROUP_FAILURE="continue")
    p = sbatch(cluster, args, d, env)
    wait_output(d, r"\[rank0\]: step 300/", 120, p)
    job = job_id(d)
    kill_node_step(cluster, job, 1)
    out = sbatch_done(p, d)
    log = tail(os.path.join(d, "job", "coordinator.log"), 60)
    print("---- coordinator.log\n" + log, flush=True)
    if p.returncode != 0:
        fail("sbatch --wait ended %d, not 0" % p.returncode)
    for want in (r"\[rank0\]: step 3000/3000 ",
                 r"checkpoint \(FULL\) of step 3000",
                 r"replica group 1 \(ranks 1-1\): dropped",
                 r"the job COMPLETED without the nodes that failed",
                 r"the job ends with status 0"):
        if not re.search(want, out):
            fail("no %r in the job's output" % want)
    if "replica group 1 (ranks 1-1) dropped at step" not in log:
        fail("the coordinator's log does not name node 1's replica group")
    if not re.search(r"replica group 1 \(ranks 1-1\): dropped at .*: "
                     r"node 1 \(.*\) was lost: its agent went away", out):
        fail("shardplane incarnations does not say node 1 was lost")


def case_elastic(cluster, args):
    """Elastic nodes (SP_MIN_NODES=1, agents with --nnodes 1:2) and one
    restart: scancel of node 1's step restarts the job on node 0 alone (1
    rank), from the last checkpoint resharded, which trains to the end;
    the job is COMPLETED and the batch job ends 0."""
    d, env = job_env(cluster, args, "elastic", SP_STEPS=3000,
                     SP_CHECKPOINT_EVERY=100, SP_MAX_RESTARTS=1,
                     SP_MIN_NODES=1)
    p = sbatch(cluster, args, d, env)
    wait_output(d, r"\[rank0\]: step 300/", 120, p)
    kill_node_step(cluster, job_id(d), 1)
    out = sbatch_done(p, d)
    print("---- coordinator.log\n" + tail(os.path.join(d, "job",
                                                       "coordinator.log"),
                                          60), flush=True)
    if p.returncode != 0:
        fail("sbatch --wait ended %d, not 0" % p.returncode)
    for want in (r"node 0 of 2, ranks 0-0 of 2",
                 r"incarnation 1 loads .*\(FULL, after step \d+\)",
                 r"\[rank0\]: step 3000/3000 ",
                 # the coordinator numbers the nodes as their agents come
                 r"^shardplane: 0 .* 2 +node \d \(ranks (\d)-\1 on .*\) was "
                 r"lost",
                 r"^shardplane: 1 .* 1 +completed: all 1 ranks finished at "
                 r"step 3000",
                 r"the job COMPLETED without the nodes that failed",
                 r"the job ends with status 0"):
        if not re.search(want, out, re.M):
            fail("no %r in the job's output" % want)


def run_cases(cluster, args):
    cases = [("trains", case_trains),
             ("lost-node", case_lost_node),
             ("continues", case_continues),
             ("elastic", case_elastic)]
    for name, fn in cases:
        if args.only and name != args.only:
            continue
        print("==== case %s" % name, flush=True)
        fn(cluster, args)
        print("ok %s" % name, flush=True)
    return True


if __name__ == "__main__":
    sys.exit(main())
