"""A real `shardplane run` job for the observability tests: started in a
session of its own, its dashboard address and reader token read from its
output, and stopped with every process it started (the coordinator runs in
a process group of its own, so the whole tree is collected first)."""

import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request


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

    def stop(self):
        """Ctrl-C to run (it stops its coordinator and workers), then
        SIGKILL to whatever of its tree is left."""
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
