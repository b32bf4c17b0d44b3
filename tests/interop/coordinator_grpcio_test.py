#!/usr/bin/env python3
"""Debian's grpcio against the real shardplane-coordinator: plans, buffer
dtypes by FQN, attach rules, transitions, the store with waits released by
a later set, deadlines, Watch, health, bad input, and bearer tokens sent
as grpcio metadata to a coordinator with a token file.

    coordinator_grpcio_test.py --coordinator PATH --gen DIR --data DIR
                               --examples DIR

Prints one line per case and "N passed, M failed"; exits non-zero on any
failure, 77 when grpcio is missing."""

import argparse
import base64
import hashlib
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import interop_util as iu  # noqa: E402
from interop_util import check, check_eq  # noqa: E402

SVC = "/shardplane.v1.Coordinator/"
T = 10


class Coordinator:
    """Cleartext; without token_file, serving anyone (--no-auth)."""

    def __init__(self, grpc, pb, binary, model, *flags, timeout_ms=None,
                 token_file=None):
        argv = [binary, "--listen", "127.0.0.1:0", "--model", model, "--quiet",
                "--insecure"]
        argv += ["--token-file", token_file] if token_file else ["--no-auth"]
        argv += list(flags)
        if timeout_ms:
            argv += ["--heartbeat-timeout-ms", str(timeout_ms)]
        self.child = iu.Child(argv, "shardplane-coordinator")
        addr = self.child.wait_line("listening on ", T).split()[-1]
        self.grpc, self.pb, self.addr = grpc, pb, addr
        self.channel = grpc.insecure_channel(addr)
        grpc.channel_ready_future(self.channel).result(timeout=T)

    def unary(self, method, req, resp_cls, timeout=T, **kw):
        fn = self.channel.unary_unary(SVC + method,
                                      type(req).SerializeToString,
                                      resp_cls.FromString)
        return fn(req, timeout=timeout, **kw)

    def stop(self):
        self.channel.close()
        self.child.proc.send_signal(2)  # SIGINT: graceful
        try:
            rc = self.child.proc.wait(timeout=T)
        finally:
            self.child.kill()
        check_eq(rc, 0, "coordinator exit status after SIGINT")


def expect(grpc, code, fn, substr=None):
    try:
        fn()
    except grpc.RpcError as e:
        check_eq(e.code(), code, "status")
        if substr:
            check(substr in e.details(), "%r in %r" % (substr, e.details()))
        return e
    raise AssertionError("expected %s" % code)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--gen", required=True)
    ap.add_argument("--data", required=True, help="tests/data")
    ap.add_argument("--examples", required=True, help="examples/")
    args = ap.parse_args()
    iu.start_watchdog(90)
    grpc, _, hpb = iu.import_generated(args.gen)
    import coordinator_pb2 as pb
    S = grpc.StatusCode
    models = os.path.join(args.examples, "models")
    gpt2 = os.path.join(models, "gpt2.json")
    same = os.path.join(args.data, "same_name_buffers.json")
    run = iu.Runner()

    def plan_and_queries():
        c = Coordinator(grpc, pb, args.coordinator, gpt2, "--world-size", "8",
                        "--wrap-type", "GPT2Block", "--param-dtype",
                        "bfloat16")
        try:
            job = c.unary("GetJob", pb.GetJobRequest(), pb.GetJobResponse)
            check_eq(job.model_name, "gpt2", "model")
            check_eq(len(job.plan_version), 16, "version length")
            check_eq(job.n_units, 13, "units")
            check_eq(job.ranks.never_attached, 8, "ranks")
            plan = c.unary("GetPlan", pb.GetPlanRequest(), pb.Plan)
            check_eq(len(plan.units), 13, "plan units")
            check_eq(plan.units[1].module_fqn, "transformer.h.0", "unit 1")
            check_eq(plan.units[1].param_dtype, pb.BFLOAT16, "param dtype")
            check_eq(plan.units[1].reduce_dtype, pb.BFLOAT16,
                     "reduce follows param (FSDP1)")
            shard = c.unary("GetPlan", pb.GetPlanRequest(by_rank=True, rank=7),
                            pb.Plan)
            check_eq(len(shard.shards), 13, "shards of rank 7")
            loc = c.unary("LocateParam",
                          pb.LocateParamRequest(fqn="lm_head.weight"),
                          pb.ParamLocation)
            check(loc.is_alias, "tied alias")
            check_eq(loc.flattened_as, "transformer.wte.weight", "alias of")
            check_eq(sum(s.numel for s in loc.slices), 50257 * 768,
                     "slices cover the parameter")
            expect(grpc, S.NOT_FOUND, lambda: c.unary(
                "LocateParam", pb.LocateParamRequest(fqn="nope"),
                pb.ParamLocation), "nope")
            expect(grpc, S.INVALID_ARGUMENT, lambda: c.unary(
                "GetPlan", pb.GetPlanRequest(by_rank=True, rank=8), pb.Plan),
                "ranks 0-7")
            h = c.channel.unary_unary(
                "/grpc.health.v1.Health/Check",
                hpb.HealthCheckRequest.SerializeToString,
                hpb.HealthCheckResponse.FromString)
            check_eq(h(hpb.HealthCheckRequest(service="shardplane.v1.Coordinator"),
                       timeout=T).status, 1, "health SERVING")
        finally:
            c.stop()

    def buffers_by_fqn():
        want = {"block0": pb.FLOAT64, "block1": pb.FLOAT16,
                "block2": pb.BFLOAT16, "block3": pb.INT64, "block4": pb.BOOL}
        for flags, low in (([], None), (["--buffer-dtype", "float16"],
                                        pb.FLOAT16)):
            c = Coordinator(grpc, pb, args.coordinator, same, "--world-size",
                            "2", "--wrap-type", "Block", *flags)
            try:
                r = c.unary("ListBuffers", pb.ListBuffersRequest(),
                            pb.ListBuffersResponse)
                check_eq(len(r.buffers), 10, "buffers")
                floating = (pb.FLOAT64, pb.FLOAT16, pb.BFLOAT16, pb.FLOAT32)
                for b in r.buffers:
                    block = b.fqn.split(".")[0]
                    orig = pb.INT64 if "num_batches" in b.fqn else want[block]
                    check_eq(b.original_dtype, orig, b.fqn + " original")
                    comp = low if low and orig in floating else orig
                    check_eq(b.compute_dtype, comp, b.fqn + " compute")
            finally:
                c.stop()

    def ranks_and_transitions():
        c = Coordinator(grpc, pb, args.coordinator, same, "--world-size", "2",
                        "--wrap-type", "Block")
        try:
            v = c.unary("GetJob", pb.GetJobRequest(),
                        pb.GetJobResponse).plan_version
            att = c.unary("Attach", pb.AttachRequest(
                rank=0, world_size=2, host="py", pid=os.getpid(),
                device="cpu", plan_version=v), pb.AttachResponse)
            check_eq(len(att.session_id), 32, "session id")
            expect(grpc, S.ALREADY_EXISTS, lambda: c.unary(
                "Attach", pb.AttachRequest(rank=0, world_size=2,
                                           plan_version=v),
                pb.AttachResponse))
            expect(grpc, S.INVALID_ARGUMENT, lambda: c.unary(
                "Attach", pb.AttachRequest(rank=5, world_size=2,
                                           plan_version=v),
                pb.AttachResponse))

            def rep(machine, unit, state):
                return c.unary("ReportTransition", pb.ReportTransitionRequest(
                    rank=0, session_id=att.session_id,
                    transition=pb.Transition(machine=machine, unit=unit,
                                             state=state, step=1)),
                    pb.ReportTransitionResponse)
            rep(pb.MACHINE_ROOT, 0, 2)
            rep(pb.MACHINE_HANDLE, 1, 2)
            rep(pb.MACHINE_HANDLE, 1, 1)
            e = expect(grpc, S.FAILED_PRECONDITION,
                       lambda: rep(pb.MACHINE_HANDLE, 1, 4))
            check("legal from IDLE" in e.details(), e.details())
            ranks = c.unary("ListRanks", pb.ListRanksRequest(),
                            pb.ListRanksResponse)
            check_eq(ranks.ranks[0].status, pb.ATTACHED, "attached")
            check_eq(ranks.ranks[0].alerts, 1, "alert recorded")
            check_eq(ranks.ranks[0].transitions, 3, "transitions")
        finally:
            c.stop()

    def store():
        c = Coordinator(grpc, pb, args.coordinator, gpt2)
        try:
            got = {}

            def waiter():
                got["r"] = c.unary("StoreGet", pb.StoreGetRequest(
                    key="nccl/unique_id", wait=True), pb.StoreGetResponse)
            t = threading.Thread(target=waiter)
            t.start()
            time.sleep(0.2)
            check("r" not in got, "the get waits for the key")
            c.unary("StoreSet", pb.StoreSetRequest(key="nccl/unique_id",
                                                   value=b"\x00" * 128),
                    pb.StoreSetResponse)
            t.join(T)
            check_eq(got["r"].value, b"\x00" * 128, "released by the set")
            check_eq(c.unary("StoreAdd", pb.StoreAddRequest(key="n", delta=3),
                             pb.StoreAddResponse).value, 3, "add")
            cas = c.unary("StoreCompareSet", pb.StoreCompareSetRequest(
                key="n", expected=b"3", desired=b"10"),
                pb.StoreCompareSetResponse)
            check(cas.swapped, "compare-set swapped")
            expect(grpc, S.DEADLINE_EXCEEDED, lambda: c.unary(
                "StoreGet", pb.StoreGetRequest(key="never", wait=True),
                pb.StoreGetResponse, timeout=0.3))
            expect(grpc, S.RESOURCE_EXHAUSTED, lambda: c.unary(
                "StoreSet", pb.StoreSetRequest(key="k" * 9000, value=b"v"),
                pb.StoreSetResponse))
            raw = c.channel.unary_unary(SVC + "StoreSet")
            expect(grpc, S.INVALID_ARGUMENT,
                   lambda: raw(b"\xff\xff\xff", timeout=T))
            expect(grpc, S.INVALID_ARGUMENT,
                   lambda: raw(b"\x0a\x03a\x00b\x12\x01v", timeout=T))
            check_eq(c.unary("GetJob", pb.GetJobRequest(),
                             pb.GetJobResponse).model_name, "gpt2",
                     "still answers after bad input")
        finally:
            c.stop()

    def watch_lost_rank():
        c = Coordinator(grpc, pb, args.coordinator, gpt2, "--world-size", "2",
                        timeout_ms=300)
        try:
            v = c.unary("GetJob", pb.GetJobRequest(),
                        pb.GetJobResponse).plan_version
            w = c.channel.unary_stream(SVC + "Watch",
                                       pb.WatchRequest.SerializeToString,
                                       pb.Event.FromString)
            stream = w(pb.WatchRequest(), timeout=T)
            time.sleep(0.1)
            c.unary("Attach", pb.AttachRequest(rank=1, world_size=2,
                                               plan_version=v),
                    pb.AttachResponse)
            kinds = []
            for ev in stream:
                kinds.append((ev.kind, ev.rank))
                if ev.kind == pb.RANK_LOST:
                    break
            stream.cancel()
            check_eq(kinds, [(pb.RANK_ATTACHED, 1), (pb.RANK_LOST, 1)],
                     "events")
        finally:
            c.stop()

    def refuses_to_start():
        import subprocess

        def start(*argv):
            p = subprocess.run([args.coordinator, "--listen", "127.0.0.1:0",
                                *argv], capture_output=True, text=True,
                               timeout=T)
            return p.returncode, p.stderr
        rc, err = start("--model", os.path.join(args.data, "nope.json"))
        check_eq(rc, 1, "missing spec exit")
        check("nope.json" in err, err)
        rc, err = start("--model", gpt2, "--world-size", "0")
        check_eq(rc, 2, "world size 0 is bad usage")
        check("--world-size" in err, err)
        # flag errors are bad usage
        rc, err = start("--model", gpt2, "--wrap-type", "NoSuchBlock")
        check_eq(rc, 2, "unknown wrap target exit")
        check("--wrap-type \"NoSuchBlock\"" in err, err)
        rc, err = start("--model", gpt2, "--world-size", "6", "--strategy",
                        "HYBRID_SHARD", "--shard-group-size", "4")
        check_eq(rc, 2, "impossible hybrid job exit")
        check("shard_group_size" in err, err)
        rc, err = start()
        check_eq(rc, 2, "no model is bad usage")
        # a port in use
        c = Coordinator(grpc, pb, args.coordinator, gpt2)
        try:
            port = c.addr.rsplit(":", 1)[1]
            p = subprocess.run([args.coordinator, "--listen",
                                "127.0.0.1:" + port, "--model", gpt2,
                                "--insecure", "--no-auth"],
                               capture_output=True, text=True, timeout=T)
            check_eq(p.returncode, 1, "port in use exit")
            check("address already in use" in p.stderr, p.stderr)
        finally:
            c.stop()

    def new_token(path, role, name):
        """A token and its line, made here as the format says (an
        implementation independent of server/coord_auth.c)."""
        tok = "spt_" + base64.urlsafe_b64encode(os.urandom(32)).decode() \
            .rstrip("=")
        with open(path, "a") as f:
            f.write("sha256:%s %s %s\n" % (
                hashlib.sha256(tok.encode()).hexdigest(), role, name))
        os.chmod(path, 0o600)
        return tok

    def tokens():
        import tempfile
        d = tempfile.mkdtemp()
        path = os.path.join(d, "tokens")
        reader = new_token(path, "reader", "py-reader")
        admin = new_token(path, "admin", "py-admin")
        c = Coordinator(grpc, pb, args.coordinator, gpt2, token_file=path)
        try:
            def bearer(t):
                return [("authorization", "Bearer " + t)]
            expect(grpc, S.UNAUTHENTICATED,
                   lambda: c.unary("GetJob", pb.GetJobRequest(),
                                   pb.GetJobResponse),
                   "missing or invalid bearer token")
            expect(grpc, S.UNAUTHENTICATED,
                   lambda: c.unary("GetJob", pb.GetJobRequest(),
                                   pb.GetJobResponse,
                                   metadata=bearer(reader + "x")))
            job = c.unary("GetJob", pb.GetJobRequest(), pb.GetJobResponse,
                          metadata=bearer(reader))
            check_eq(job.model_name, "gpt2", "model, as a reader")
            setq = pb.StoreSetRequest(key="k", value=b"v")
            expect(grpc, S.PERMISSION_DENIED,
                   lambda: c.unary("StoreSet", setq, pb.StoreSetResponse,
                                   metadata=bearer(reader)),
                   "role reader, which may not call StoreSet")
            c.unary("StoreSet", setq, pb.StoreSetResponse,
                    metadata=bearer(admin))
            got = c.unary("StoreGet", pb.StoreGetRequest(key="k"),
                          pb.StoreGetResponse, metadata=bearer(reader))
            check_eq(got.value, b"v", "a reader reads what an admin wrote")
            # health needs no token
            h = c.channel.unary_unary(
                "/grpc.health.v1.Health/Check",
                hpb.HealthCheckRequest.SerializeToString,
                hpb.HealthCheckResponse.FromString)
            check_eq(h(hpb.HealthCheckRequest(service=""), timeout=T).status,
                     1, "health SERVING without a token")
        finally:
            c.stop()
            for f in os.listdir(d):
                os.unlink(os.path.join(d, f))
            os.rmdir(d)

    run.case("refuses to start: bad spec, bad job, port in use",
             refuses_to_start)
    run.case("plan and model queries", plan_and_queries)
    run.case("buffer dtypes keyed by FQN", buffers_by_fqn)
    run.case("attach rules and transitions", ranks_and_transitions)
    run.case("store, waits, deadlines, bad input", store)
    run.case("watch a rank get lost", watch_lost_rank)
    run.case("bearer tokens as grpcio metadata", tokens)
    iu.kill_all()
    sys.exit(run.summary())


if __name__ == "__main__":
    main()
