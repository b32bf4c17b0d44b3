"""A real `shardplane run` job for the observability tests: started in a
session of its own, its dashboard address and reader token read from its
output, and stopped with every process it started (the coordinator runs in
a process group of its own, so the whole tree is collected first)."""

import argparse
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request

import interop_util as iu


def _children(pid):
    try:
        with open("/proc/%d/task/%d/children" % (pid, pid)) as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def descendants(pid):
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in _children(p):
            out.append(c)
            todo.append(c)
    return out


class Job:
    """shardplane run ARGS in cwd; .http is "127.0.0.1:PORT", .token the
    reader token, .output the lines it printed so far."""

    def __init__(self, shardplane, args, cwd, timeout=60):
        self.cwd = cwd
        self.proc = subprocess.Popen(
            [shardplane, "run"] + args, cwd=cwd, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, bufsize=1,
            start_new_session=True)
        self.output = []
        self._seen = threading.Event()
        self.http = None
        self.token = None
        self._peers = []
        threading.Thread(target=self._read, daemon=True).start()
        if not self._seen.wait(timeout):
            self.stop()
            raise RuntimeError("shardplane run printed no dashboard address "
                               "within %d s:\n%s" % (timeout,
                                                     "".join(self.output)))
        if self.http is None:
            raise RuntimeError("shardplane run ended early:\n%s"
                               % "".join(self.output))

    def _read(self):
        for line in self.proc.stdout:
            self.output.append(line)
            if "dashboard http://" in line and self.http is None:
                # "... dashboard http://127.0.0.1:P/ and ... (reader token in F)"
                self.http = line.split("dashboard http://", 1)[1].split("/")[0]
                path = line.rsplit("reader token in ", 1)[1].rstrip(")\n")
                with open(os.path.join(self.cwd, path)) as f:
                    self.token = f.read().strip()
                self._seen.set()
        self._seen.set()

    def get(self, path, token=True, timeout=5):
        """(status, body bytes) of GET path on the job's HTTP listener."""
        req = urllib.request.Request("http://%s%s" % (self.http, path))
        if token:
            req.add_header("Authorization", "Bearer " + self.token)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def kill_with(self, proc):
        """proc (a Popen started for the job, e.g. its scraper) is killed
        and reaped first when the job stops: it may still be talking to
        the job's coordinator."""
        self._peers.append(proc)

    def stop(self):
        """Kills what kill_with was given, then Ctrl-C to run (it stops
        its coordinator and workers), then SIGKILL to whatever of its tree
        is left."""
        for p in self._peers:
            p.kill()
            p.wait(timeout=10)
        tree = descendants(self.proc.pid)
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        for p in [self.proc.pid] + tree:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def start(out_help):
    """The arguments CMake gives each observability test (--shardplane,
    --examples, --out, described as out_help), parsed, and the Runner for
    its cases; a watchdog kills the script's children and ends it after
    240 s, so that a peer that hangs cannot hold ctest."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--shardplane", required=True)
    ap.add_argument("--examples", required=True)
    ap.add_argument("--out", required=True, help=out_help)
    a = ap.parse_args()
    iu.start_watchdog(240)
    return a, iu.Runner()


def run_gpt2_tiny(runner, shardplane, examples, prefix, cases, extra=()):
    """Runs cases(job) against a 2-rank gpt2-tiny job that trains until
    stopped, started by `shardplane run` with extra arguments in a fresh
    folder (job.cwd, named with prefix). The runner's cases report their
    own failures; anything else raised, starting the job included, is
    reported as the failure "setup" with the job's last lines, and not
    raised further (the runner's summary tells). Then the job and every
    process interop_util started are stopped and the folder removed."""
    tmp = tempfile.mkdtemp(prefix=prefix)
    job = None
    try:
        job = Job(shardplane, [
            "--nproc", "2", "--model",
            os.path.join(examples, "models", "gpt2-tiny.json"),
            "--global-batch", "8", "--seq-len", "32", "--steps", "100000",
            "--eval-every", "0", "--checkpoint", "none", "--log-every",
            "1000"] + list(extra), cwd=tmp)
        cases(job)
    except Exception as e:  # noqa: BLE001 - reported, then cleaned up
        runner.fail("setup", "%s: %s" % (type(e).__name__, e))
        if job is not None:
            print("".join(job.output[-20:]))
    finally:
        if job is not None:
            job.stop()
        iu.kill_all()
        shutil.rmtree(tmp, ignore_errors=True)


def wait_for(fn, timeout, what, every=0.25):
    """fn()'s first true value within timeout seconds, or raises."""
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        last = fn()
        if last:
            return last
        time.sleep(every)
    raise AssertionError("%s: not within %.0f s (last: %r)"
                         % (what, timeout, last))


def metric_values(text, name):
    """{label string: value} of the samples of one metric in an
    exposition ("" for a sample without labels)."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        key, _, value = line.rpartition(" ")
        if key == name:
            out[""] = float(value)
        elif key.startswith(name + "{"):
            out[key[len(name):]] = float(value)
    return out


def metric_names(text):
    """The names of every sample in an exposition."""
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(line.split("{", 1)[0].split(" ", 1)[0])
    return names
