"""Helpers shared by the grpcio interop scripts: child processes that are
always killed, a port read with a timeout, a watchdog, and a tiny case
runner that prints one line per case and the "N passed, M failed" summary."""

import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

SKIP_RC = 77
_children = []
_dirs = []
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "support"))
from procs import free_port  # noqa: E402,F401 (the interop tests' port)
CERTS_SCRIPT = os.path.join(HERE, "..", "support", "make_test_certs.sh")


def make_certs():
    """Fresh test certificates (tests/support/make_test_certs.sh, as the C
    tests make them) in a temporary directory that kill_all() removes:
    {"dir", "ca", "server_cert", "server_key", "client_cert", "client_key",
    "other_ca", "other_cert", "other_key"}. Exits 77 without openssl."""
    if shutil.which("openssl") is None:
        print("SKIPPED: no openssl command to make the test certificates",
              flush=True)
        sys.exit(SKIP_RC)
    d = tempfile.mkdtemp(prefix="shardplane-certs-")
    _dirs.append(d)
    subprocess.run(["sh", CERTS_SCRIPT, d], check=True, timeout=30)
    names = {"ca": "ca.pem", "server_cert": "server.pem",
             "server_key": "server.key", "client_cert": "client.pem",
             "client_key": "client.key", "other_ca": "other-ca.pem",
             "other_cert": "other.pem", "other_key": "other.key"}
    out = {k: os.path.join(d, v) for k, v in names.items()}
    out["dir"] = d
    return out


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def import_generated(gen_dir):
    """Makes echo_pb2/health_pb2 (generated into the build tree) importable
    and returns (grpc, echo_pb2, health_pb2); exits 77 without grpcio."""
    sys.path.insert(0, gen_dir)
    try:
        import grpc  # noqa: F401
    except ImportError as e:
        print("SKIPPED: grpcio is not available: %s" % e, flush=True)
        sys.exit(SKIP_RC)
    import grpc
    import echo_pb2
    import health_pb2
    return grpc, echo_pb2, health_pb2


class Child:
    """A subprocess whose stdout lines are read by a thread, so waits can
    time out and the pipe never fills."""

    def __init__(self, argv, name):
        self.name = name
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True,
                                     bufsize=1)
        _children.append(self)
        self.lines = queue.Queue()
        self.output = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def wait_line(self, prefix, timeout):
        """The first stdout line starting with prefix, or raises."""
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError("%s: no %r line within %.0f s"
                                   % (self.name, prefix, timeout))
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError("%s exited (rc=%s) before printing %r"
                                   % (self.name, self.proc.poll(), prefix))
            if line.startswith(prefix):
                return line.strip()

    def port(self, timeout=10):
        return int(self.wait_line("PORT ", timeout).split()[1])

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if self.proc.stdin:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        if self in _children:
            _children.remove(self)


def kill_all():
    for c in list(_children):
        c.kill()
    for d in _dirs:
        shutil.rmtree(d, ignore_errors=True)
    del _dirs[:]


def start_watchdog(seconds):
    """Kills every child and exits 1 if the script runs longer than this."""
    def fire():
        print("FAIL watchdog: still running after %d s, giving up" % seconds,
              flush=True)
        for c in list(_children):
            if c.proc.poll() is None:
                c.proc.kill()
        os._exit(1)
    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()
    signal.signal(signal.SIGTERM, lambda *a: (kill_all(), os._exit(1)))
    return t


class Runner:
    def __init__(self):
        self.passed = 0
        self.failed = 0

    def case(self, name, fn, *args):
        t0 = time.monotonic()
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - every failure is reported
            self.failed += 1
            print("FAIL %s: %s: %s" % (name, type(e).__name__, e), flush=True)
            traceback.print_exc(file=sys.stdout)
            sys.stdout.flush()
            return False
        self.passed += 1
        print("PASS %s (%.0f ms)" % (name, (time.monotonic() - t0) * 1000),
              flush=True)
        return True

    def fail(self, name, why):
        self.failed += 1
        print("FAIL %s: %s" % (name, why), flush=True)

    def summary(self):
        print("%d passed, %d failed" % (self.passed, self.failed), flush=True)
        return 0 if self.failed == 0 and self.passed > 0 else 1


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def check_eq(got, want, what):
    if got != want:
        raise AssertionError("%s: got %r, want %r" % (what, got, want))
