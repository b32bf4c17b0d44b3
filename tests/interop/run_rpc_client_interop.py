#!/usr/bin/env python3
"""Runs the engine's client (rpc_client_interop, C) against a grpcio server
(grpcio_server.py, Debian's python3-grpcio).

    run_rpc_client_interop.py --client PATH/rpc_client_interop --gen DIR
                              [--tls none|tls|mtls]

With --tls the grpcio server serves TLS (mtls: and requires a client
certificate) and the C client verifies it against the test CA.

Prints the C program's per-case lines, then its own checks, and ends with
"N passed, M failed"; exits non-zero on any failure, 77 without grpcio."""

import argparse
import os
import re
import signal
import subprocess
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
import interop_util as iu  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--client", required=True, help="rpc_client_interop")
    ap.add_argument("--gen", required=True, help="dir with echo_pb2.py")
    ap.add_argument("--tls", choices=("none", "tls", "mtls"), default="none")
    args = ap.parse_args()
    iu.import_generated(args.gen)  # exits 77 without grpcio
    iu.start_watchdog(55)
    run = iu.Runner()
    server_argv = [sys.executable, os.path.join(HERE, "grpcio_server.py"),
                   "--gen", args.gen]
    client_tls = []
    if args.tls != "none":
        certs = iu.make_certs()
        server_argv += ["--tls-dir", certs["dir"]]
        client_tls = ["--tls-ca", certs["ca"]]
        if args.tls == "mtls":
            server_argv.append("--mtls")
            client_tls += ["--tls-cert", certs["client_cert"],
                           "--tls-key", certs["client_key"]]
    srv = iu.Child(server_argv, "grpcio_server")
    try:
        port = srv.port(timeout=15)
        try:
            p = subprocess.run([args.client, "127.0.0.1:%d" % port]
                               + client_tls,
                               stdout=subprocess.PIPE, text=True, timeout=45)
            out, rc = p.stdout, p.returncode
        except subprocess.TimeoutExpired as e:
            out = e.stdout or ""
            if isinstance(out, bytes):
                out = out.decode(errors="replace")
            rc = "timeout"
        sys.stdout.write(out)
        sys.stdout.flush()
        m = re.search(r"^rpc_client_interop: (\d+) passed, (\d+) failed$",
                      out, re.M)
        if m is None:
            run.fail("rpc_client_interop", "no summary line (exit %s)" % rc)
        else:
            run.passed += int(m.group(1))
            run.failed += int(m.group(2))
            if rc != 0 and int(m.group(2)) == 0:
                # e.g. LeakSanitizer at exit, after every case passed
                run.fail("rpc_client_interop_exit", "exit status %s" % rc)

        def server_alive_and_clean():
            iu.check(srv.proc.poll() is None,
                     "grpcio server died (rc=%s)" % srv.proc.poll())
            srv.proc.send_signal(signal.SIGTERM)
            iu.check_eq(srv.proc.wait(timeout=10), 0, "grpcio server exit")
        run.case("grpcio_server_survived", server_alive_and_clean)
    except Exception as e:  # noqa: BLE001
        run.fail("setup", "%s: %s" % (type(e).__name__, e))
    finally:
        srv.kill()
    iu.kill_all()
    rc = run.summary()
    os._exit(rc)


if __name__ == "__main__":
    main()
