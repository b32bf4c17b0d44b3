#!/usr/bin/env python3
"""shardplane.testing.Echo served by grpcio (Debian's python3-grpcio), for
testing the engine's client against a server nobody here wrote.

    grpcio_server.py --gen DIR_WITH_PB2 [--port N] [--tls-dir D [--mtls]]

With --tls-dir (certificates made by tests/support/make_test_certs.sh) it
serves TLS with server.pem; --mtls also requires a client certificate
signed by ca.pem.

Prints "PORT <n>" once listening. Stops (grace 1 s) on SIGTERM/SIGINT or when
stdin reaches EOF, so it never outlives the driver that started it.

Semantics follow tests/support/echo_service.c: text/payload echo, index, repeat,
delay_ms, fail_code/fail_message, x-echo and x-echo-bin copied into the
response headers. Also:
  - trailing metadata "x-trailer: done" on every OK call;
  - Unary text "__stats__" -> "cancelled=N active=M" (handlers ended by
    cancel/deadline, handlers still running);
  - Unary text "__md__" -> text = the x-echo value, payload = the decoded
    x-echo-bin value (shows what the client sent);
  - Unary text "__big__" -> a reply whose payload has `repeat` bytes;
  - Unary text "__gzip__" -> the echo, with gzip asked for the response
    (grpcio must not use it: the engine accepts only identity)."""

import argparse
import os
import signal
import sys
import threading
from concurrent import futures

sys.dont_write_bytecode = True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gen", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--tls-dir")
    ap.add_argument("--mtls", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, args.gen)
    import grpc
    import echo_pb2 as pb

    codes = {sc.value[0]: sc for sc in grpc.StatusCode}
    lock = threading.Lock()
    stats = {"cancelled": 0, "active": 0}

    class Track:
        """Counts a handler as active while it runs and as cancelled when
        the RPC ends (client cancel, deadline) before the handler did."""

        def __init__(self, ctx):
            self.ctx = ctx
            self.finished = False
            self.ended = threading.Event()
            ctx.add_callback(self._on_end)
            with lock:
                stats["active"] += 1

        def _on_end(self):
            self.ended.set()
            with lock:
                if not self.finished:
                    self.finished = True
                    stats["cancelled"] += 1

        def done(self):
            with lock:
                self.finished = True

        def leave(self):
            with lock:
                stats["active"] -= 1

        def sleep(self, ms):
            """False when the call ended during the wait."""
            if ms:
                self.ended.wait(ms / 1000.0)
            return self.ctx.is_active()

    def echo_md(ctx):
        md = [(k, v) for k, v in ctx.invocation_metadata()
              if k in ("x-echo", "x-echo-bin")]
        if md:
            ctx.send_initial_metadata(md)

    def fail(ctx, tr, req):
        tr.done()
        ctx.abort(codes.get(req.fail_code, grpc.StatusCode.UNKNOWN),
                  req.fail_message)

    def ok(ctx, tr):
        tr.done()
        ctx.set_trailing_metadata((("x-trailer", "done"),))

    def unary(req, ctx):
        if req.text == "__stats__":
            with lock:
                text = "cancelled=%d active=%d" % (stats["cancelled"],
                                                   stats["active"])
            return pb.EchoReply(text=text)
        if req.text == "__md__":
            md = dict(ctx.invocation_metadata())
            return pb.EchoReply(text=md.get("x-echo", ""),
                                payload=md.get("x-echo-bin", b""))
        if req.text == "__gzip__":
            # grpcio may compress only with codecs the client accepts
            ctx.set_compression(grpc.Compression.Gzip)
            return pb.EchoReply(text=req.text, payload=req.payload)
        tr = Track(ctx)
        try:
            if not tr.sleep(req.delay_ms):
                return pb.EchoReply()  # ignored: the call is over
            if req.fail_code:
                fail(ctx, tr, req)
            echo_md(ctx)
            ok(ctx, tr)
            if req.text == "__big__":
                return pb.EchoReply(text=req.text, payload=b"B" * req.repeat)
            return pb.EchoReply(text=req.text, payload=req.payload)
        finally:
            tr.leave()

    def server_stream(req, ctx):
        tr = Track(ctx)
        try:
            if req.fail_code:
                fail(ctx, tr, req)
            echo_md(ctx)
            if not tr.sleep(req.delay_ms):
                return
            for i in range(req.repeat):
                if not ctx.is_active():
                    return
                yield pb.EchoReply(text=req.text, payload=req.payload,
                                   index=i)
            ok(ctx, tr)
        finally:
            tr.leave()

    def client_stream(reqs, ctx):
        tr = Track(ctx)
        try:
            text = []
            for r in reqs:
                if r.fail_code:
                    fail(ctx, tr, r)
                text.append(r.text)
            echo_md(ctx)
            ok(ctx, tr)
            return pb.EchoReply(text="".join(text))
        finally:
            tr.leave()

    def bidi(reqs, ctx):
        tr = Track(ctx)
        try:
            echo_md(ctx)
            for i, r in enumerate(reqs):
                if r.fail_code:
                    fail(ctx, tr, r)
                yield pb.EchoReply(text=r.text, payload=r.payload, index=i)
            ok(ctx, tr)
        finally:
            tr.leave()

    de, ser = pb.EchoRequest.FromString, pb.EchoReply.SerializeToString
    handler = grpc.method_handlers_generic_handler("shardplane.testing.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary, de, ser),
        "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream,
                                                             de, ser),
        "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream,
                                                             de, ser),
        "Bidi": grpc.stream_stream_rpc_method_handler(bidi, de, ser),
    })
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64),
                         handlers=(handler,),
                         options=(("grpc.so_reuseport", 0),))
    addr = "127.0.0.1:%d" % args.port
    if args.tls_dir:
        def rd(name):
            with open(os.path.join(args.tls_dir, name), "rb") as f:
                return f.read()
        creds = grpc.ssl_server_credentials(
            [(rd("server.key"), rd("server.pem"))],
            root_certificates=rd("ca.pem") if args.mtls else None,
            require_client_auth=args.mtls)
        port = server.add_secure_port(addr, creds)
    else:
        port = server.add_insecure_port(addr)
    if port == 0:
        print("grpcio_server: cannot bind", file=sys.stderr, flush=True)
        return 1
    server.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    signal.signal(signal.SIGINT, lambda *a: stop.set())

    def watch_stdin():
        try:
            while sys.stdin.buffer.read(4096):
                pass
        except OSError:
            pass
        stop.set()
    threading.Thread(target=watch_stdin, daemon=True).start()
    print("PORT %d" % port, flush=True)
    while not stop.wait(0.1):
        pass
    server.stop(grace=1).wait(timeout=3)
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    os._exit(rc)
