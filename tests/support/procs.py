"""Processes of the Python tests and benchmarks that run whole programs
(the interop tests, the soak, bench/faults.py): each started in a process
group of its own so that stopping it ends everything it started, ports
for programs that take theirs on the command line, and an agent's worker
of a given rank."""

import os
import random
import signal
import socket
import subprocess


def free_port():
    """A TCP port for a program that takes its port on the command line or
    in a file (Prometheus, slurmctld, slurmd, a coordinator restarted on
    its address). It is drawn from below the kernel's ephemeral range: a
    port from that range, free when probed, can be handed to another
    test's outgoing connection before the program binds it (slurmd failed
    so in CI), while one below it is only ever taken by an explicit
    bind."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    low = max(low, 2048)
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 20000), low)
        s = socket.socket()
        try:
            s.bind(("0.0.0.0", port))
            return port
        except OSError:
            continue
        finally:
            s.close()
    raise RuntimeError("no free TCP port below %d after 200 draws" % low)


def spawn(argv, out, err=None, env=None):
    """argv in a new session (its own process group), its output appended
    to the file out (and err, or out too)."""
    fo = open(out, "a")
    fe = open(err, "a") if err and err != out else fo
    try:
        return subprocess.Popen(argv, stdout=fo, stderr=fe,
                                stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    finally:
        fo.close()
        if fe is not fo:
            fe.close()


def stop(procs, term_s=10):
    """SIGTERM to each process group of procs (Popen objects, newest
    first), then SIGKILL to those still there after term_s."""
    for p in reversed(procs):
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for p in reversed(procs):
        try:
            p.wait(timeout=term_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def worker_of(agent_pid, rank):
    """The pid of agent_pid's child whose environment holds RANK=rank (a
    `shardplane agent`'s worker), or None."""
    want = ("RANK=%d" % rank).encode()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % d) as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != agent_pid:
                continue
            with open("/proc/%s/environ" % d, "rb") as f:
                if want in f.read().split(b"\0"):
                    return int(d)
        except (OSError, ValueError, IndexError):
            continue
    return None
