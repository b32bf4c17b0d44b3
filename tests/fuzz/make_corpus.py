#!/usr/bin/env python3
"""Writes the seed corpus for the fuzz harnesses (formats in fuzz_targets.h).

corpus/server/<name>[.s<N>]: a mode byte, then what a client sends; ".s<N>"
means stream 1 must end with grpc-status N (checked by test_rpc_fuzz_replay).
The harness server has max_message 64 KiB and max_metadata 4 KiB.
corpus/wire/<name>: two selector bytes, then bytes for the wire helpers.

Run from anywhere; it rewrites both directories. Header blocks use HPACK
literals without indexing and protobuf is encoded by hand, so it needs
nothing beyond the standard library.
"""
import os
import random
import shutil
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
P, S = 0x01, 0x02  # mode bits: prepend preface, prepend empty SETTINGS

DATA, HEADERS, PRIORITY, RST, SETTINGS, PING, GOAWAY, WINUP, CONT = (
    0, 1, 2, 3, 4, 6, 7, 8, 9)
ES, EH, PADDED, PRIO = 0x1, 0x4, 0x8, 0x20

ECHO = "/shardplane.testing.Echo/"


def frame(ftype, flags, sid, payload=b""):
    n = len(payload)
    return struct.pack(">BHBBI", n >> 16, n & 0xFFFF, ftype, flags,
                       sid & 0x7FFFFFFF) + payload


def hint(v, nbits, first=0):
    mx = (1 << nbits) - 1
    if v < mx:
        return bytes([first | v])
    out = [first | mx]
    v -= mx
    while v >= 128:
        out.append(0x80 | (v & 0x7F))
        v >>= 7
    out.append(v)
    return bytes(out)


def lit(name, value):
    if isinstance(name, str):
        name = name.encode()
    if isinstance(value, str):
        value = value.encode()
    return b"\x00" + hint(len(name), 7) + name + hint(len(value), 7) + value


def grpc_block(path, method="POST", ctype="application/grpc", extra=()):
    blk = lit(":method", method) + lit(":scheme", "http") + lit(":path", path)
    blk += lit(":authority", "localhost") + lit("te", "trailers")
    if ctype is not None:
        blk += lit("content-type", ctype)
    for k, v in extra:
        blk += lit(k, v)
    return blk


def headers(sid, blk, end=False, max_frame=16384):
    out, first = b"", True
    while True:
        part, blk = blk[:max_frame], blk[max_frame:]
        flags = (EH if not blk else 0) | (ES if first and end else 0)
        out += frame(HEADERS if first else CONT, flags, sid, part)
        first = False
        if not blk:
            return out


def varint(v):
    out = b""
    while v >= 0x80:
        out += bytes([0x80 | (v & 0x7F)])
        v >>= 7
    return out + bytes([v])


def echo_req(text="", payload=b"", repeat=0, delay_ms=0, fail_code=0,
             fail_message=""):
    m = b""
    if text:
        t = text.encode()
        m += b"\x0a" + varint(len(t)) + t
    if payload:
        m += b"\x12" + varint(len(payload)) + payload
    if repeat:
        m += b"\x18" + varint(repeat)
    if delay_ms:
        m += b"\x20" + varint(delay_ms)
    if fail_code:
        m += b"\x28" + varint(fail_code)
    if fail_message:
        f = fail_message.encode()
        m += b"\x32" + varint(len(f)) + f
    return m


def msg(body, flag=0):
    return bytes([flag]) + struct.pack(">I", len(body)) + body


def data(sid, payload, end=False):
    return frame(DATA, ES if end else 0, sid, payload)


def call(sid, method, req=None, end=True, **kw):
    out = headers(sid, grpc_block(ECHO + method, **kw), end and req is None)
    if req is not None:
        out += data(sid, msg(req), end)
    return out


def settings(pairs=()):
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", i, v)
                                          for i, v in pairs))


def winup(sid, inc):
    return frame(WINUP, 0, sid, struct.pack(">I", inc))


def rst(sid, code=8):
    return frame(RST, 0, sid, struct.pack(">I", code))


def server_inputs():
    ok = echo_req(text="hello")
    c = {}
    c["unary_ok.s0"] = (P | S, call(1, "Unary", ok))
    c["unary_ok_chunk4.s0"] = (P | S | 1 << 4, call(1, "Unary", ok))
    c["unary_ok_chunk16.s0"] = (P | S | 3 << 4, call(1, "Unary", ok))
    c["unary_preface_in_data.s0"] = (0, PREFACE + settings() + call(1, "Unary", ok))
    c["unary_fail_code.s5"] = (P | S, call(1, "Unary", echo_req(
        fail_code=5, fail_message="no such thing \u00fc%")))
    c["unary_stats.s0"] = (P | S, call(1, "Unary", echo_req(text="__stats__")))
    c["unary_metadata.s0"] = (P | S, call(1, "Unary", ok, extra=[
        ("x-echo", "value"), ("x-echo-bin", "AAEC"), ("x-other", "1")]))
    c["unary_bad_b64_metadata.s0"] = (P | S, call(1, "Unary", ok, extra=[
        ("x-echo-bin", "!!!notbase64"), ("x-echo-bin", "AAE,A")]))
    c["unary_timeout_garbage.s0"] = (P | S, call(1, "Unary", ok, extra=[
        ("grpc-timeout", "12x")]))
    c["unary_timeout_delay"] = (P | S, call(1, "Unary", echo_req(
        text="slow", delay_ms=1000), extra=[("grpc-timeout", "1n")]))
    c["unary_two_messages.s12"] = (P | S, headers(
        1, grpc_block(ECHO + "Unary")) + data(1, msg(ok) + msg(ok), True))
    c["unary_no_message.s12"] = (P | S, call(1, "Unary", None, True))
    c["unary_empty_data_eos.s12"] = (P | S, call(1, "Unary", None, False)
                                     + data(1, b"", True))
    c["unary_zero_length_message.s0"] = (P | S, call(1, "Unary", b""))
    c["unary_gzip.s12"] = (P | S, call(1, "Unary", ok, extra=[
        ("grpc-encoding", "gzip")]))
    c["unary_compressed_flag.s13"] = (P | S, headers(
        1, grpc_block(ECHO + "Unary")) + data(1, msg(ok, flag=1), True))
    c["unary_bad_flag.s13"] = (P | S, headers(
        1, grpc_block(ECHO + "Unary")) + data(1, msg(ok, flag=2), True))
    c["unary_undecodable.s3"] = (P | S, headers(
        1, grpc_block(ECHO + "Unary")) + data(1, msg(b"\xff\xff\xff"), True))
    # unknown fields (7, 8 varint; 9 bytes) are dropped before decoding
    c["unary_unknown_fields.s0"] = (P | S, headers(
        1, grpc_block(ECHO + "Unary")) + data(1, msg(
            b"\x38\x00" * 64 + b"\x40\x01\x4a\x02zz" + ok), True))
    c["unary_nul_string.s3"] = (P | S, headers(
        1, grpc_block(ECHO + "Unary")) + data(1, msg(b"\x0a\x03a\x00b"), True))
    c["unary_bad_utf8.s3"] = (P | S, headers(
        1, grpc_block(ECHO + "Unary")) + data(1, msg(b"\x0a\x02\xc3\x28"), True))
    c["unary_wrong_wire_type.s3"] = (P | S, headers(
        1, grpc_block(ECHO + "Unary")) + data(1, msg(b"\x0d\x00\x00\x00\x00"), True))
    c["prefix_4gib.s8"] = (P | S, headers(1, grpc_block(ECHO + "Unary"))
                           + data(1, b"\x00\xff\xff\xff\xff"))
    c["prefix_over_limit.s8"] = (P | S, headers(1, grpc_block(ECHO + "Bidi"))
                                 + data(1, b"\x00\x00\x01\x00\x01"))
    c["prefix_then_eos.s13"] = (P | S, headers(1, grpc_block(ECHO + "Unary"))
                                + data(1, b"\x00\x00\x00\x03\xe8\x01\x02\x03\x04\x05", True))
    c["prefix_split.s0"] = (P | S, headers(1, grpc_block(ECHO + "Unary"))
                            + data(1, msg(ok)[:2]) + data(1, msg(ok)[2:4])
                            + data(1, msg(ok)[4:], True))
    c["unknown_method.s12"] = (P | S, call(1, "Nope", ok))
    c["long_path.s12"] = (P | S, headers(1, grpc_block("/" + "x" * 300), True))
    c["get.s12"] = (P | S, headers(1, grpc_block(ECHO + "Unary", method="GET"), True))
    c["text_plain.s13"] = (P | S, call(1, "Unary", ok, ctype="text/plain"))
    c["no_content_type.s13"] = (P | S, call(1, "Unary", ok, ctype=None))
    c["grpc_proto_ctype.s0"] = (P | S, call(1, "Unary", ok,
                                            ctype="application/grpc+proto"))
    c["metadata_over_limit.s8"] = (P | S, call(1, "Unary", ok, extra=[
        ("x-pad-%d" % i, "a" * 1000) for i in range(6)]))
    c["metadata_continuation.s0"] = (P | S, headers(1, grpc_block(
        ECHO + "Unary", extra=[("x-a", "b" * 100)]), max_frame=64)
        + data(1, msg(ok), True))
    # more CONTINUATION frames than nghttp2 accepts for one block
    c["continuation_flood"] = (P | S, headers(1, grpc_block(
        ECHO + "Unary", extra=[("x-a", "b" * 100)]), max_frame=4))
    c["server_stream.s0"] = (P | S, call(1, "ServerStream", echo_req(
        text="s", repeat=3)))
    c["server_stream_fail.s9"] = (P | S, call(1, "ServerStream", echo_req(
        fail_code=9)))
    c["server_stream_blocked"] = (P | S, call(1, "ServerStream", echo_req(
        text="blocked", payload=b"p" * 1000, repeat=100000)))
    c["server_stream_flood"] = (P, settings([(4, 0x7FFFFFFF)])
                                + winup(0, 0x7FFFFFFF - 65535)
                                + call(1, "ServerStream", echo_req(
                                    text="flood", payload=b"f" * 1000,
                                    repeat=1000000)))
    c["server_stream_window_updates"] = (P | S | 5 << 4, call(
        1, "ServerStream", echo_req(text="w", payload=b"w" * 500, repeat=400))
        + b"".join(winup(0, 8192) + winup(1, 8192) for _ in range(40)))
    c["server_stream_then_rst"] = (P | S, call(1, "ServerStream", echo_req(
        text="r", repeat=50)) + rst(1))
    c["client_stream.s0"] = (P | S, call(1, "ClientStream", None, False)
                             + data(1, msg(echo_req(text="a")))
                             + data(1, msg(echo_req(text="b")))
                             + data(1, msg(echo_req(text="c")), True))
    c["client_stream_trailers.s0"] = (P | S, call(1, "ClientStream", None, False)
                                      + data(1, msg(echo_req(text="a")))
                                      + headers(1, lit("x-trailer", "1"), True))
    c["bidi.s0"] = (P | S, call(1, "Bidi", None, False)
                    + data(1, msg(echo_req(text="1")) + msg(echo_req(text="2")))
                    + data(1, b"", True))
    c["bidi_fail.s7"] = (P | S, call(1, "Bidi", None, False)
                         + data(1, msg(echo_req(fail_code=7))))
    c["bidi_open"] = (P | S, call(1, "Bidi", None, False)
                      + data(1, msg(echo_req(text="1"))))
    c["health_check.s0"] = (P | S, headers(1, grpc_block(
        "/grpc.health.v1.Health/Check")) + data(1, msg(b""), True))
    c["health_check_unknown.s5"] = (P | S, headers(1, grpc_block(
        "/grpc.health.v1.Health/Check")) + data(1, msg(b"\x0a\x03foo"), True))
    c["health_watch"] = (P | S, headers(1, grpc_block(
        "/grpc.health.v1.Health/Watch")) + data(1, msg(b""), True))
    c["many_streams"] = (P | S, b"".join(call(s, "Unary", echo_req(text=str(s)))
                                         for s in range(1, 60, 2)))
    c["rapid_reset"] = (P | S, b"".join(call(s, "Unary", None, False) + rst(s)
                                        for s in range(1, 400, 2)))
    c["padded_and_priority.s0"] = (P | S, frame(
        HEADERS, EH | PADDED | PRIO, 1,
        b"\x03" + b"\x00\x00\x00\x00\x10" + grpc_block(ECHO + "Unary") + b"\0" * 3)
        + frame(DATA, ES | PADDED, 1, b"\x02" + msg(ok) + b"\0\0"))
    c["priority_ping_settings.s0"] = (P, settings([(1, 0), (2, 0), (3, 10),
                                                    (4, 1 << 20), (5, 1 << 20),
                                                    (6, 1 << 16)])
                                      + frame(PRIORITY, 0, 1, b"\0\0\0\0\x20")
                                      + frame(PING, 0, 0, b"12345678")
                                      + call(1, "Unary", ok))
    c["client_goaway"] = (P | S, call(1, "Unary", ok)
                          + frame(GOAWAY, 0, 0, struct.pack(">II", 1, 0)))
    c["even_stream_id"] = (P | S, call(2, "Unary", ok))
    c["data_on_stream_0"] = (P | S, data(0, b"hello"))
    c["stream_id_reuse"] = (P | S, call(1, "Unary", ok) + call(1, "Unary", ok))
    c["headers_no_end_headers"] = (P | S, frame(HEADERS, 0, 1, grpc_block(
        ECHO + "Unary")) + call(3, "Unary", ok))
    c["truncated_frame"] = (P | S, frame(HEADERS, EH, 1, b"\x00" * 100)[:19])
    c["truncated_message"] = (P | S, headers(1, grpc_block(ECHO + "Unary"))
                              + frame(DATA, 0, 1, msg(ok))[:20])
    c["bad_hpack"] = (P | S, frame(HEADERS, EH | ES, 1, b"\xff\xff\xff\xff\xff"))
    c["window_overflow"] = (P | S, winup(0, 0x7FFFFFFF) + winup(0, 0x7FFFFFFF))
    c["http1_get"] = (0, b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
    rnd = random.Random(1234)
    for i in range(4):
        junk = bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 300)))
        c["random_%d" % i] = (0, junk)
        c["random_after_preface_%d" % i] = (P | S, junk)
    return c


def wire_inputs():
    def two(body, sel=10, split=3):
        return bytes([sel, split]) + body
    c = {}
    m = b"\x00\x00\x00\x00\x03abc"
    c["deframe_two"] = two(m + m)
    c["deframe_partial"] = two(m + m[:6], split=1)
    c["deframe_huge_prefix"] = two(b"\x00\xff\xff\xff\xff", sel=4)
    c["deframe_compressed"] = two(b"\x01\x00\x00\x00\x01a")
    c["deframe_bad_flag"] = two(b"\x07\x00\x00\x00\x01a")
    c["deframe_empty_message"] = two(b"\x00\x00\x00\x00\x00" * 3)
    c["deframe_handler_stop"] = two(b"\x00\x00\x00\x00\x0d" + b"x" * 13 + m)
    c["pct"] = two(b"50%25 done %C3%BC%0A", sel=63)
    c["pct_bad"] = two(b"%zz%4%", sel=2)
    c["timeout_ms"] = two(b"2500m")
    c["timeout_hours"] = two(b"99999999H")
    c["timeout_9_digits"] = two(b"123456789S")
    c["timeout_bad_unit"] = two(b"10x")
    c["b64"] = two(b"AAEC")
    c["b64_padded"] = two(b"AAE=")
    c["b64_joined"] = two(b"AAEC, AAEC,QQ")
    c["b64_bad"] = two(b"A!==")
    c["addr_v4"] = two(b"127.0.0.1:7700")
    c["addr_v6"] = two(b"[::1]:0")
    c["addr_bad_port"] = two(b"host:99999")
    c["metadata"] = two(b"\x06x-echovalue")
    # the pre-scan: selector bits 6-7 pick SessionUp, StoreSetRequest,
    # AttachRequest or StoreWaitRequest
    trans = b"\x08\x01\x10\x02\x18\x03"
    c["pb_session_nested_unknown"] = two(
        b"\x08\x07" + b"\x2a" + bytes([len(trans) + 2]) + trans + b"\x78\x01"
        + b"\x2a\x06" + trans, sel=0x00)
    c["pb_store_set_nul_key"] = two(b"\x0a\x03a\x00b\x12\x01v", sel=0x40)
    c["pb_store_set_unknown"] = two(b"\x18\x00" * 32 + b"\x0a\x01k", sel=0x40)
    c["pb_attach_bad_utf8"] = two(b"\x1a\x03\xed\xa0\x80", sel=0x80)
    c["pb_attach_truncated"] = two(b"\x1a\x05ab", sel=0x80)
    c["pb_wait_keys"] = two(b"\x0a\x01a\x0a\x02bc\x10\x05", sel=0xc0)
    # empty nested messages past the harness's 4 KiB decode budget
    c["pb_session_many_empty"] = two(b"\x22\x00" * 100, sel=0x00)
    return c


def main():
    for sub, inputs in (("server", {k: bytes([mode]) + v
                                    for k, (mode, v) in server_inputs().items()}),
                        ("wire", wire_inputs())):
        d = os.path.join(HERE, "corpus", sub)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        for name, body in sorted(inputs.items()):
            with open(os.path.join(d, name), "wb") as f:
                f.write(body)
        print("%s: %d files" % (d, len(inputs)))


if __name__ == "__main__":
    main()
