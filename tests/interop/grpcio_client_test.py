#!/usr/bin/env python3
"""grpcio (Debian's python3-grpcio, a client nobody here wrote) against the
engine's server: tests/echo_server serving shardplane.testing.Echo and
grpc.health.v1.Health.

    grpcio_client_test.py --server PATH/echo_server --gen DIR_WITH_PB2
                          [--tls none|tls|mtls]

With --tls, echo_server serves TLS (mtls: and requires client certificates)
with certificates made for the run, and every channel is a secure one.

Prints one line per case and ends with "N passed, M failed"; exits non-zero
on any failure, 77 when grpcio is missing."""

import argparse
import os
import queue
import signal
import sys
import threading
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
import interop_util as iu  # noqa: E402
from interop_util import check, check_eq

ECHO = "/shardplane.testing.Echo/"
HEALTH = "/grpc.health.v1.Health/"
MIB = 1 << 20
# Every wait below is bounded: no call without a deadline, no join without a
# timeout, and the watchdog ends the script well before ctest's limit.
T = 10

# Set by main for --tls: the credentials of every channel and the
# echo_server flags that go with them.
SEC = None
SERVER_TLS_ARGS = []


def channel(grpc, target, options=()):
    """An insecure channel, or with --tls a secure one that checks the
    server's certificate against the test CA under the name localhost."""
    if SEC is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(
        target, SEC, options=tuple(options) + (
            ("grpc.ssl_target_name_override", "localhost"),))


def server_argv(args):
    return [args.server] + SERVER_TLS_ARGS


class Client:
    """Plain multicallables on one channel (protoc --python_out makes no
    stubs; grpcio-tools is not packaged)."""

    def __init__(self, grpc, pb, hpb, port):
        self.grpc, self.pb, self.hpb = grpc, pb, hpb
        self.target = "127.0.0.1:%d" % port
        self.channel = channel(grpc, self.target)
        grpc.channel_ready_future(self.channel).result(timeout=T)
        ser = pb.EchoRequest.SerializeToString
        de = pb.EchoReply.FromString
        c = self.channel
        self.unary = c.unary_unary(ECHO + "Unary", ser, de)
        self.server_stream = c.unary_stream(ECHO + "ServerStream", ser, de)
        self.client_stream = c.stream_unary(ECHO + "ClientStream", ser, de)
        self.bidi = c.stream_stream(ECHO + "Bidi", ser, de)
        self.raw_unary = c.unary_unary(ECHO + "Unary", None, de)
        self.check = c.unary_unary(
            HEALTH + "Check", hpb.HealthCheckRequest.SerializeToString,
            hpb.HealthCheckResponse.FromString)
        self.watch = c.unary_stream(
            HEALTH + "Watch", hpb.HealthCheckRequest.SerializeToString,
            hpb.HealthCheckResponse.FromString)
        # __stats__ goes over a connection of its own, so it never queues
        # behind the calls under test (the server allows 100 streams per
        # connection; grpcio shares connections between channels unless
        # told otherwise)
        self.stats_channel = channel(
            grpc, self.target,
            options=(("grpc.use_local_subchannel_pool", 1),))
        self.stats_unary = self.stats_channel.unary_unary(ECHO + "Unary", ser,
                                                          de)

    def req(self, **kw):
        return self.pb.EchoRequest(**kw)

    def stats(self):
        r = self.stats_unary(self.req(text="__stats__"), timeout=T)
        f = dict(kv.split("=") for kv in r.text.split())
        return int(f["cancelled"]), int(f["active"])

    def wait_stats(self, cancelled, active, timeout=5.0):
        """Polls __stats__ until cancelled >= the given count and active
        equals the given value."""
        end = time.monotonic() + timeout
        while True:
            c, a = self.stats()
            if c >= cancelled and a == active:
                return c, a
            if time.monotonic() > end:
                raise AssertionError(
                    "server stats cancelled=%d active=%d, want cancelled>=%d "
                    "active=%d" % (c, a, cancelled, active))
            time.sleep(0.02)

    def close(self):
        self.channel.close()
        self.stats_channel.close()


def expect_error(grpc, code, fn, what):
    """Runs fn, which must raise RpcError with this code; returns it."""
    try:
        fn()
    except grpc.RpcError as e:
        check_eq(e.code(), code, what + " status (details %r)" % e.details())
        return e
    raise AssertionError(what + ": succeeded, want " + str(code))


class Feeder:
    """A request iterator the test feeds one message at a time, for
    lock-step streams. close() half-closes."""

    _END = object()

    def __init__(self):
        self.q = queue.Queue()

    def send(self, m):
        self.q.put(m)

    def close(self):
        self.q.put(self._END)

    def __iter__(self):
        return self

    def __next__(self):
        # bounded, so a test bug cannot park grpcio's sender thread forever
        m = self.q.get(timeout=2 * T)
        if m is self._END:
            raise StopIteration
        return m


def next_with_timeout(it, timeout):
    """next(it) on a response stream, failing after timeout instead of
    relying only on the call deadline."""
    box = []
    done = threading.Event()

    def run():
        try:
            box.append(("ok", next(it)))
        except BaseException as e:  # noqa: BLE001
            box.append(("err", e))
        done.set()

    threading.Thread(target=run, daemon=True).start()
    if not done.wait(timeout):
        raise TimeoutError("no response message within %.1f s" % timeout)
    kind, v = box[0]
    if kind == "err":
        raise v
    return v


# ---------------------------------------------------------------- cases


def t_unary(c):
    payload = bytes(range(256)) * 4
    r, call = c.unary.with_call(c.req(text="hello", payload=payload),
                                timeout=T)
    check_eq(call.code(), c.grpc.StatusCode.OK, "status")
    check_eq(r.text, "hello", "text")
    check_eq(r.payload, payload, "payload")
    check_eq(r.index, 0, "index")
    # an empty request (zero-length message) is a valid EchoRequest
    r = c.unary(c.req(), timeout=T)
    check_eq((r.text, r.payload), ("", b""), "empty echo")
    r = c.unary(c.req(text="naïve ☃ 日本語"), timeout=T)
    check_eq(r.text, "naïve ☃ 日本語", "utf-8 text")


def t_server_stream_1000(c):
    it = c.server_stream(c.req(text="s", payload=b"p" * 100, repeat=1000),
                         timeout=T)
    got = list(it)
    check_eq(it.code(), c.grpc.StatusCode.OK, "status")
    check_eq(len(got), 1000, "reply count")
    check_eq([r.index for r in got], list(range(1000)), "indices in order")
    check(all(r.text == "s" and r.payload == b"p" * 100 for r in got),
          "every reply echoes the request")


def t_server_stream_large(c):
    # 48 x 512 KiB = 24 MiB: over the engine's 8 MiB per-call queue and the
    # HTTP/2 windows, so the server must wait for the reader (on_writable).
    p = bytes(range(256)) * 2048
    n = 0
    for r in c.server_stream(c.req(payload=p, repeat=48), timeout=T):
        check_eq(r.index, n, "index")
        check(r.payload == p, "payload %d intact" % n)
        n += 1
    check_eq(n, 48, "reply count")


def t_server_stream_empty(c):
    it = c.server_stream(c.req(text="none", repeat=0), timeout=T)
    check_eq(list(it), [], "no replies")
    check_eq(it.code(), c.grpc.StatusCode.OK, "status")


def t_client_stream(c):
    reqs = [c.req(text="%d," % i) for i in range(100)]
    r, call = c.client_stream.with_call(iter(reqs), timeout=T)
    check_eq(call.code(), c.grpc.StatusCode.OK, "status")
    check_eq(r.text, "".join("%d," % i for i in range(100)), "concatenation")
    r = c.client_stream(iter([]), timeout=T)
    check_eq(r.text, "", "no requests")


def t_bidi_lockstep(c):
    f = Feeder()
    it = c.bidi(f, timeout=T)
    for i in range(20):
        f.send(c.req(text="m%d" % i))
        # the reply must come while the request side is still open
        r = next_with_timeout(it, 5)
        check_eq((r.text, r.index), ("m%d" % i, i), "reply %d" % i)
    f.close()
    rest = list(it)
    check_eq(rest, [], "nothing after half-close")
    check_eq(it.code(), c.grpc.StatusCode.OK, "status")


def t_bidi_bulk(c):
    reqs = [c.req(text="b%d" % i, payload=b"x" * 1000) for i in range(500)]
    got = list(c.bidi(iter(reqs), timeout=T))
    check_eq([r.index for r in got], list(range(500)), "indices")
    check(all(r.text == "b%d" % r.index for r in got), "texts")


def t_deadline_unary(c):
    c0, _ = c.wait_stats(0, 0)
    t0 = time.monotonic()
    expect_error(c.grpc, c.grpc.StatusCode.DEADLINE_EXCEEDED,
                 lambda: c.unary(c.req(text="slow", delay_ms=3000),
                                 timeout=0.3), "delayed unary")
    check(time.monotonic() - t0 < 2.0, "the deadline ended the wait early")
    # the handler was cancelled and let go of its timer
    c.wait_stats(c0 + 1, 0)


def t_deadline_stream(c):
    c0, _ = c.wait_stats(0, 0)
    it = c.server_stream(c.req(repeat=3, delay_ms=3000), timeout=0.3)
    expect_error(c.grpc, c.grpc.StatusCode.DEADLINE_EXCEEDED,
                 lambda: list(it), "delayed stream")
    c.wait_stats(c0 + 1, 0)
    # a deadline long enough is not a problem
    r = c.unary(c.req(text="ok", delay_ms=50), timeout=5)
    check_eq(r.text, "ok", "delayed unary within its deadline")


def t_cancel_unary(c):
    c0, _ = c.wait_stats(0, 0)
    fut = c.unary.future(c.req(text="cancel me", delay_ms=5000), timeout=T)
    c.wait_stats(c0, 1)  # the handler is holding its delay
    check(fut.cancel(), "future.cancel() accepted")
    check(fut.cancelled(), "future reports cancelled")
    c.wait_stats(c0 + 1, 0)


def t_cancel_stream_midflight(c):
    c0, _ = c.wait_stats(0, 0)
    it = c.server_stream(c.req(payload=b"z" * 1024, repeat=1000000),
                         timeout=T)
    for i in range(10):
        check_eq(next_with_timeout(it, 5).index, i, "early reply")
    c.wait_stats(c0, 1)
    it.cancel()
    expect_error(c.grpc, c.grpc.StatusCode.CANCELLED, lambda: list(it),
                 "cancelled stream")
    c.wait_stats(c0 + 1, 0)


def t_cancel_client_and_bidi(c):
    c0, _ = c.wait_stats(0, 0)
    f = Feeder()
    fut = c.client_stream.future(f, timeout=T)
    f.send(c.req(text="a"))
    f.send(c.req(text="b"))
    time.sleep(0.1)
    check(fut.cancel(), "client-stream cancel accepted")
    c.wait_stats(c0 + 1, 0)
    f.close()
    f2 = Feeder()
    it = c.bidi(f2, timeout=T)
    f2.send(c.req(text="x"))
    check_eq(next_with_timeout(it, 5).text, "x", "bidi reply")
    it.cancel()
    c.wait_stats(c0 + 2, 0)
    f2.close()


def t_unknown_method(c):
    g = c.grpc
    for path in (ECHO + "NoSuchMethod", "/no.such.Service/Unary",
                 "/shardplane.testing.echo/unary"):
        m = c.channel.unary_unary(path, None, None)
        e = expect_error(g, g.StatusCode.UNIMPLEMENTED,
                         lambda: m(b"", timeout=T), path)
        check(e.details(), "UNIMPLEMENTED carries a message")
    m = c.channel.stream_stream(ECHO + "Nope", None, None)
    expect_error(g, g.StatusCode.UNIMPLEMENTED,
                 lambda: list(m(iter([b"", b""]), timeout=T)), "stream")


def t_oversize(c):
    g = c.grpc
    # a stream opened before proves the connection survives the rejection
    f = Feeder()
    it = c.bidi(f, timeout=T)
    f.send(c.req(text="before"))
    check_eq(next_with_timeout(it, 5).text, "before", "bidi before")
    big = c.req(payload=b"\x00" * (4 * MIB + 1))
    e = expect_error(g, g.StatusCode.RESOURCE_EXHAUSTED,
                     lambda: c.unary(big, timeout=T), "4 MiB + 1 request")
    check("limit" in e.details(), "message names the limit: %r" % e.details())
    # bigger still, on a streaming method
    expect_error(g, g.StatusCode.RESOURCE_EXHAUSTED,
                 lambda: c.client_stream(
                     iter([c.req(text="x"),
                           c.req(payload=b"y" * (6 * MIB))]), timeout=T),
                 "6 MiB client-stream message")
    f.send(c.req(text="after"))
    check_eq(next_with_timeout(it, 5).text, "after", "bidi after")
    f.close()
    check_eq(list(it), [], "bidi end")
    check_eq(it.code(), g.StatusCode.OK, "bidi status")
    # just under the limit (4 MiB framed message) goes through both ways
    p = b"\x5a" * (4 * MIB - 8)
    r = c.unary(c.req(payload=p), timeout=T)
    check(r.payload == p, "payload at the limit echoed")


def t_metadata_too_large(c):
    g = c.grpc
    # 9000 bytes of request metadata: over the server's 8 KiB budget
    e = expect_error(g, g.StatusCode.RESOURCE_EXHAUSTED, lambda: c.unary(
        c.req(text="md"), metadata=(("x-echo", "v" * 9000),), timeout=T),
        "9000-byte header")
    check("metadata" in e.details(), "details %r" % e.details())
    r = c.unary(c.req(text="after"), metadata=(("x-echo", "v" * 4000),),
                timeout=T)
    check_eq(r.text, "after", "a call with 4000 bytes of metadata")


def t_compressed_request(c):
    g = c.grpc
    # the engine speaks identity only: a gzip request is UNIMPLEMENTED
    e = expect_error(g, g.StatusCode.UNIMPLEMENTED, lambda: c.unary(
        c.req(text="gz", payload=b"a" * 1000), timeout=T,
        compression=g.Compression.Gzip), "gzip request")
    check("identity" in e.details(), "details %r" % e.details())
    r = c.unary(c.req(text="plain", payload=b"a" * 1000), timeout=T)
    check_eq(r.text, "plain", "uncompressed call after")


def t_deadline_while_blocked(c):
    # the client reads nothing: the server fills the HTTP/2 windows and its
    # send queue, then the deadline must still cancel the handler
    c0, _ = c.wait_stats(0, 0)
    it = c.server_stream(c.req(payload=b"x" * 65536, repeat=100000),
                         timeout=1.0)
    c.wait_stats(c0, 1)
    time.sleep(1.3)
    expect_error(c.grpc, c.grpc.StatusCode.DEADLINE_EXCEEDED,
                 lambda: list(it), "blocked stream")
    c.wait_stats(c0 + 1, 0)


def t_cancel_many(c):
    # 300 delayed calls (3 x the server's stream limit), all cancelled
    c0, _ = c.wait_stats(0, 0)
    futs = [c.unary.future(c.req(delay_ms=5000), timeout=T)
            for _ in range(300)]
    c.wait_stats(c0, 100)
    for f in futs:
        f.cancel()
    check(all(f.cancelled() for f in futs), "every future cancelled")
    c.wait_stats(c0 + 100, 0)
    check_eq(c.unary(c.req(text="alive"), timeout=T).text, "alive",
             "a call after the cancels")


def t_malformed(c):
    g = c.grpc
    # the engine's check before decoding: INVALID_ARGUMENT naming the message
    for raw in (b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x12\x80"):
        e = expect_error(g, g.StatusCode.INVALID_ARGUMENT,
                         lambda: c.raw_unary(raw, timeout=T), repr(raw))
        check("EchoRequest" in e.details(), "the message names the type")
    expect_error(g, g.StatusCode.INVALID_ARGUMENT,
                 lambda: c.raw_unary(b"\x0b", timeout=T), "end-group tag")
    # a string with a NUL byte, and one that is not UTF-8
    e = expect_error(g, g.StatusCode.INVALID_ARGUMENT,
                     lambda: c.raw_unary(b"\x0a\x03a\x00b", timeout=T),
                     "NUL in text")
    check("EchoRequest.text: contains a NUL byte at offset 1" in e.details(),
          "the message names the field: %r" % e.details())
    expect_error(g, g.StatusCode.INVALID_ARGUMENT,
                 lambda: c.raw_unary(b"\x0a\x02\xc3\x28", timeout=T),
                 "invalid UTF-8 in text")
    # unknown fields are dropped: the known ones still arrive
    r = c.raw_unary(b"\x78\x01" * 100 + b"\x0a\x02ok", timeout=T)
    check_eq(r.text, "ok", "unknown fields dropped")
    r = c.unary(c.req(text="still fine"), timeout=T)
    check_eq(r.text, "still fine", "channel works after")


def t_metadata(c):
    binv = bytes([0, 1, 0x7f, 0x80, 0xfe, 0xff]) + "é☃".encode() + bytes(
        range(256))
    md = (("x-echo", "hello, world; 100%"), ("x-echo-bin", binv),
          ("x-ignored", "not echoed"))
    r, call = c.unary.with_call(c.req(text="md"), metadata=md, timeout=T)
    got = dict(call.initial_metadata())
    check_eq(got.get("x-echo"), "hello, world; 100%", "x-echo")
    check_eq(got.get("x-echo-bin"), binv, "x-echo-bin")
    check("x-ignored" not in got, "only x-echo keys come back")
    it = c.server_stream(c.req(repeat=2), metadata=md, timeout=T)
    got = dict(it.initial_metadata())
    check_eq(got.get("x-echo-bin"), binv, "server-stream x-echo-bin")
    check_eq(len(list(it)), 2, "stream replies")
    # one-byte and empty binary values
    for v in (b"\xff", b""):
        _, call = c.unary.with_call(c.req(), metadata=(("x-echo-bin", v),),
                                    timeout=T)
        check_eq(dict(call.initial_metadata()).get("x-echo-bin"), v,
                 "x-echo-bin %r" % v)


STATUS_MESSAGES = [
    "plain message",
    "100% done",
    "%41 is not A, %zz is not hex, trailing %",
    "%%25%",
    "naïve café ☃ 日本語 🚀",
    "tab\there, newline\nthere, cr\r, del\x7f, nul-free",
    "",
]


def t_status_messages(c):
    g = c.grpc
    for msg in STATUS_MESSAGES:
        e = expect_error(g, g.StatusCode.FAILED_PRECONDITION,
                         lambda: c.unary(c.req(fail_code=9, fail_message=msg),
                                         timeout=T), "unary %r" % msg)
        check_eq(e.details(), msg, "unary details")
    for code in (g.StatusCode.NOT_FOUND, g.StatusCode.UNAUTHENTICATED,
                 g.StatusCode.DATA_LOSS, g.StatusCode.UNKNOWN):
        e = expect_error(g, code, lambda: c.unary(
            c.req(fail_code=code.value[0], fail_message="code"), timeout=T),
            "code %s" % code)
    msg = STATUS_MESSAGES[4] + " " + STATUS_MESSAGES[2]
    e = expect_error(g, g.StatusCode.ABORTED, lambda: list(c.server_stream(
        c.req(fail_code=10, fail_message=msg), timeout=T)), "server stream")
    check_eq(e.details(), msg, "server-stream details")
    e = expect_error(g, g.StatusCode.OUT_OF_RANGE, lambda: list(c.bidi(
        iter([c.req(text="ok"), c.req(fail_code=11, fail_message=msg)]),
        timeout=T)), "bidi")
    check_eq(e.details(), msg, "bidi details")


def t_health(c):
    g, h = c.grpc, c.hpb
    SERVING = h.HealthCheckResponse.SERVING
    r = c.check(h.HealthCheckRequest(service=""), timeout=T)
    check_eq(r.status, SERVING, "Check(\"\")")
    e = expect_error(g, g.StatusCode.NOT_FOUND, lambda: c.check(
        h.HealthCheckRequest(service="no.such.Service"), timeout=T),
        "Check(unknown)")
    check("no.such.Service" in e.details(), "details name the service")
    it = c.watch(h.HealthCheckRequest(service=""), timeout=T)
    check_eq(next_with_timeout(it, 5).status, SERVING, "Watch first message")
    it.cancel()
    it = c.watch(h.HealthCheckRequest(service="no.such.Service"), timeout=T)
    check_eq(next_with_timeout(it, 5).status,
             h.HealthCheckResponse.SERVICE_UNKNOWN, "Watch(unknown)")
    it.cancel()


def t_concurrent(c):
    futs = [c.unary.future(c.req(text="c%d" % i, payload=bytes([i % 256]) * i,
                                 delay_ms=(i % 4) * 10), timeout=T)
            for i in range(200)]
    for i, f in enumerate(futs):
        r = f.result(timeout=T)
        check_eq(r.text, "c%d" % i, "reply %d text" % i)
        check_eq(r.payload, bytes([i % 256]) * i, "reply %d payload" % i)
    c.wait_stats(0, 0)


def t_concurrent_streams(c):
    # more streams than the server's MAX_CONCURRENT_STREAMS (100)
    its = [c.server_stream(c.req(text="s%d" % i, repeat=20), timeout=T)
           for i in range(150)]
    out = [None] * len(its)

    def drain(i):
        out[i] = [r.index for r in its[i] if r.text == "s%d" % i]

    ths = [threading.Thread(target=drain, args=(i,), daemon=True)
           for i in range(len(its))]
    for t in ths:
        t.start()
    for t in ths:
        t.join(timeout=T)
        check(not t.is_alive(), "stream reader finished")
    check(all(o == list(range(20)) for o in out), "all 150 streams complete")


def t_tls_refusals(grpc, pb, c, certs, mtls):
    """Channels the TLS server must refuse: one that does not trust its CA
    and, with mTLS, one without a client certificate and one whose
    certificate comes from another CA. The server keeps serving."""
    rd = iu.read_bytes
    bad = [("untrusted server CA", grpc.ssl_channel_credentials(
        root_certificates=rd(certs["other_ca"])))]
    if mtls:
        bad.append(("no client certificate", grpc.ssl_channel_credentials(
            root_certificates=rd(certs["ca"]))))
        bad.append(("client certificate from another CA",
                    grpc.ssl_channel_credentials(
                        root_certificates=rd(certs["ca"]),
                        private_key=rd(certs["other_key"]),
                        certificate_chain=rd(certs["other_cert"]))))
    for what, creds in bad:
        ch = grpc.secure_channel(c.target, creds, options=(
            ("grpc.ssl_target_name_override", "localhost"),
            ("grpc.use_local_subchannel_pool", 1)))
        m = ch.unary_unary(ECHO + "Unary", pb.EchoRequest.SerializeToString,
                           pb.EchoReply.FromString)
        expect_error(grpc, grpc.StatusCode.UNAVAILABLE,
                     lambda: m(pb.EchoRequest(text="x"), timeout=3), what)
        ch.close()
    check_eq(c.unary(c.req(text="after"), timeout=T).text, "after",
             "a good channel still works")


def graceful_shutdown(args, grpc, pb, hpb):
    srv = iu.Child(server_argv(args), "echo_server (shutdown)")
    try:
        c = Client(grpc, pb, hpb, srv.port())
        fut = c.unary.future(c.req(text="late", delay_ms=800), timeout=T)
        it = c.server_stream(c.req(text="st", repeat=200, delay_ms=800),
                             timeout=T)
        got = []
        reader = threading.Thread(
            target=lambda: got.extend(r.index for r in it), daemon=True)
        reader.start()
        c.wait_stats(0, 2)  # both handlers are in their delay
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        # new calls are refused once shutdown started
        c2 = channel(grpc, c.target)
        m = c2.unary_unary(ECHO + "Unary", pb.EchoRequest.SerializeToString,
                           pb.EchoReply.FromString)
        expect_error(grpc, grpc.StatusCode.UNAVAILABLE,
                     lambda: m(pb.EchoRequest(text="new"), timeout=2),
                     "call after SIGTERM")
        c2.close()
        # the calls in flight still complete
        check_eq(fut.result(timeout=5).text, "late", "in-flight unary")
        reader.join(timeout=5)
        check(not reader.is_alive(), "stream finished")
        check_eq(it.code(), grpc.StatusCode.OK, "in-flight stream status")
        check_eq(got, list(range(200)), "in-flight stream replies")
        rc = srv.proc.wait(timeout=5)
        took = time.monotonic() - t0
        check_eq(rc, 0, "exit status")
        check(took < 2.0 + 1.0, "exited %.2f s after SIGTERM" % took)
        c.close()
    finally:
        srv.kill()


def shutdown_grace_expires(args, grpc, pb, hpb):
    srv = iu.Child(server_argv(args), "echo_server (grace)")
    try:
        c = Client(grpc, pb, hpb, srv.port())
        fut = c.unary.future(c.req(text="too late", delay_ms=8000), timeout=T)
        c.wait_stats(0, 1)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        e = fut.exception(timeout=6)
        check(e is not None, "a handler past the grace period fails")
        check_eq(e.code(), grpc.StatusCode.UNAVAILABLE, "status")
        rc = srv.proc.wait(timeout=5)
        took = time.monotonic() - t0
        check_eq(rc, 0, "exit status")
        check(1.5 < took < 2.0 + 1.5, "exited %.2f s after SIGTERM "
              "(grace is 2 s)" % took)
        c.close()
    finally:
        srv.kill()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True, help="echo_server binary")
    ap.add_argument("--gen", required=True, help="dir with echo_pb2.py")
    ap.add_argument("--tls", choices=("none", "tls", "mtls"), default="none")
    args = ap.parse_args()
    grpc, pb, hpb = iu.import_generated(args.gen)
    iu.start_watchdog(50)
    run = iu.Runner()
    global SEC
    certs = None
    if args.tls != "none":
        certs = iu.make_certs()
        rd = iu.read_bytes
        SERVER_TLS_ARGS.extend(["--tls-cert", certs["server_cert"],
                                "--tls-key", certs["server_key"]])
        if args.tls == "mtls":
            SERVER_TLS_ARGS.extend(["--tls-client-ca", certs["ca"]])
            SEC = grpc.ssl_channel_credentials(
                root_certificates=rd(certs["ca"]),
                private_key=rd(certs["client_key"]),
                certificate_chain=rd(certs["client_cert"]))
        else:
            SEC = grpc.ssl_channel_credentials(
                root_certificates=rd(certs["ca"]))
    srv = iu.Child(server_argv(args), "echo_server")
    try:
        c = Client(grpc, pb, hpb, srv.port())
        cases = [
            ("unary", t_unary),
            ("server_stream_1000", t_server_stream_1000),
            ("server_stream_24MiB_flow_control", t_server_stream_large),
            ("server_stream_empty", t_server_stream_empty),
            ("client_stream", t_client_stream),
            ("bidi_lockstep", t_bidi_lockstep),
            ("bidi_bulk", t_bidi_bulk),
            ("deadline_unary", t_deadline_unary),
            ("deadline_server_stream", t_deadline_stream),
            ("cancel_unary_future", t_cancel_unary),
            ("cancel_server_stream_midflight", t_cancel_stream_midflight),
            ("cancel_client_stream_and_bidi", t_cancel_client_and_bidi),
            ("unknown_method", t_unknown_method),
            ("oversize_request", t_oversize),
            ("request_metadata_too_large", t_metadata_too_large),
            ("compressed_request_unimplemented", t_compressed_request),
            ("deadline_while_flow_control_blocked", t_deadline_while_blocked),
            ("cancel_300_calls", t_cancel_many),
            ("malformed_payload", t_malformed),
            ("metadata_round_trip", t_metadata),
            ("status_message_percent_encoding", t_status_messages),
            ("health_check_and_watch", t_health),
            ("concurrent_200_unary", t_concurrent),
            ("concurrent_150_streams", t_concurrent_streams),
        ]
        for name, fn in cases:
            if srv.proc.poll() is not None:
                run.fail(name, "echo_server died (rc=%s)" % srv.proc.poll())
                continue
            run.case(name, fn, c)

        def clean_exit():
            # the channel is still open (idle): shutdown must not wait for
            # the grace period
            check_eq(c.unary(c.req(text="x"), timeout=T).text, "x", "call")
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            check_eq(srv.proc.wait(timeout=10), 0, "echo_server exit status")
            took = time.monotonic() - t0
            # well short of the 2 s grace; under ASan the exit itself (the
            # leak check) takes most of a second on a busy machine
            check(took < 1.5, "idle server exited %.2f s after SIGTERM" % took)
        if args.tls != "none":
            run.case("tls_refusals", t_tls_refusals, grpc, pb, c, certs,
                     args.tls == "mtls")
        run.case("server_exit_clean_idle_channel", clean_exit)
        c.close()
    except Exception as e:  # noqa: BLE001
        run.fail("setup", "%s: %s" % (type(e).__name__, e))
    finally:
        srv.kill()
    run.case("graceful_shutdown", graceful_shutdown, args, grpc, pb, hpb)
    run.case("shutdown_grace_expires", shutdown_grace_expires, args, grpc, pb,
             hpb)
    iu.kill_all()
    rc = run.summary()
    sys.stdout.flush()
    os._exit(rc)  # grpcio's threads must not keep the process alive


if __name__ == "__main__":
    main()
