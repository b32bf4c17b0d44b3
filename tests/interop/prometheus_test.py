#!/usr/bin/env python3
"""A real Prometheus (Debian's prometheus) scrapes the coordinator of a real
2-rank job (shardplane run, gpt2-tiny) with the job's reader token; the test
asks Prometheus's query API for the job's step series and its rank counts
and finds them rising and right. The examples' alert rules are validated by
promtool and loaded by that Prometheus, and every metric name they and the
Grafana board use is checked against a live scrape.

Without prometheus or promtool the test fails (scripts/deps.sh installs
them); it never skips."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import interop_util as iu  # noqa: E402
from run_job import (  # noqa: E402
    metric_names, metric_values, run_gpt2_tiny, start, wait_for)


def prom_query(base, q):
    url = "%s/api/v1/query?%s" % (base, urllib.parse.urlencode({"query": q}))
    with urllib.request.urlopen(url, timeout=5) as r:
        doc = json.load(r)
    iu.check_eq(doc.get("status"), "success", "query %s" % q)
    return doc["data"]["result"]


def prom_range(base, q, seconds):
    now = time.time()
    url = "%s/api/v1/query_range?%s" % (base, urllib.parse.urlencode(
        {"query": q, "start": now - seconds, "end": now, "step": 1}))
    with urllib.request.urlopen(url, timeout=5) as r:
        doc = json.load(r)
    iu.check_eq(doc.get("status"), "success", "query_range %s" % q)
    return doc["data"]["result"]


NAME = re.compile(r"\bshardplane_[a-z0-9_]+\b")


def names_used(examples):
    """{file: set of metric names} of the alert rules and the Grafana
    board."""
    out = {}
    for rel in ("prometheus/shardplane-alerts.yml",
                "grafana/shardplane-dashboard.json"):
        with open(os.path.join(examples, rel)) as f:
            text = f.read()
        if rel.endswith(".json"):
            board = json.load(open(os.path.join(examples, rel)))
            exprs = [t.get("expr", "") for p in board["panels"]
                     for t in p.get("targets", [])]
            iu.check(exprs, "%s: no panel queries" % rel)
            text = "\n".join(exprs)
        out[rel] = set(NAME.findall(text))
    return out


def main():
    a, runner = start("where the answer is kept")
    prom_bin, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if prom_bin is None or promtool is None:
        runner.fail("peers", "prometheus and promtool are needed (Debian "
                    "package prometheus; scripts/deps.sh installs it)")
        return runner.summary()
    rules = os.path.join(a.examples, "prometheus", "shardplane-alerts.yml")

    def check_rules():
        r = subprocess.run([promtool, "check", "rules", rules],
                           capture_output=True, text=True, timeout=30)
        iu.check(r.returncode == 0, "promtool check rules: %s%s"
                 % (r.stdout, r.stderr))
        iu.check("3 rules found" in r.stdout, r.stdout)
    runner.case("promtool_check_rules", check_rules)

    def cases(job):
        tmp = job.cwd
        with open(os.path.join(tmp, "reader.token"), "w") as f:
            f.write(job.token)
        os.chmod(os.path.join(tmp, "reader.token"), 0o600)
        port = iu.free_port()
        base = "http://127.0.0.1:%d" % port
        with open(os.path.join(tmp, "prometheus.yml"), "w") as f:
            f.write("""global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: [%s]
scrape_configs:
  - job_name: shardplane
    authorization:
      type: Bearer
      credentials_file: %s
    static_configs:
      - targets: ["%s"]
""" % (json.dumps(rules), json.dumps(os.path.join(tmp, "reader.token")),
                job.http))
        prom = subprocess.Popen(
            [prom_bin, "--config.file", os.path.join(tmp, "prometheus.yml"),
             "--storage.tsdb.path", os.path.join(tmp, "data"),
             "--web.listen-address", "127.0.0.1:%d" % port],
            stdout=subprocess.DEVNULL, stderr=open(
                os.path.join(tmp, "prometheus.log"), "w"),
            start_new_session=True)
        job.kill_with(prom)

        def up():
            try:
                r = prom_query(base, 'up{job="shardplane"}')
            except OSError:
                return None
            return r and r[0]["value"][1] == "1"

        def scraped():
            wait_for(up, 60, "Prometheus scrapes the coordinator")
            steps = wait_for(
                lambda: prom_range(base, "shardplane_job_step", 60), 30,
                "a step series")
            vals = [float(v) for _, v in steps[0]["values"]]
            iu.check(vals == sorted(vals), "the step never goes back: %r"
                     % vals)
            # rising: wait until the series has grown by several steps
            def grown():
                s = prom_range(base, "shardplane_job_step", 120)
                v = [float(x) for _, x in s[0]["values"]]
                return v if v[-1] >= v[0] + 5 and len(set(v)) >= 3 else None
            vals = wait_for(grown, 60, "the step series rising", every=1)
            print("shardplane_job_step over the last samples: %s"
                  % vals[-8:], flush=True)
        runner.case("step_series_rising", scraped)

        def rank_counts():
            att = prom_query(base, 'shardplane_ranks{status="attached"}')
            iu.check_eq(att[0]["value"][1], "2", "attached ranks")
            lost = prom_query(base, 'shardplane_ranks{status="lost"}')
            iu.check_eq(lost[0]["value"][1], "0", "lost ranks")
            by_state = prom_query(base, "sum(shardplane_ranks_by_state)")
            iu.check_eq(by_state[0]["value"][1], "2",
                        "attached ranks by training state")
            tps = prom_query(base, "shardplane_job_tokens_per_second")
            iu.check(float(tps[0]["value"][1]) > 0, "tokens/s: %r" % tps)
            calls = prom_query(
                base, 'sum(shardplane_rpc_calls_total{method="Attach",'
                'code="OK"})')
            iu.check(float(calls[0]["value"][1]) >= 2, "Attach calls: %r"
                     % calls)
            # the answer kept for the record
            ans = prom_query(base, "shardplane_ranks")
            with open(os.path.join(a.out, "prometheus-answer.json"),
                      "w") as f:
                json.dump(ans, f, indent=1)
            print("Prometheus: shardplane_ranks = %s" % json.dumps(
                {r["metric"]["status"]: r["value"][1] for r in ans}),
                flush=True)
        runner.case("rank_counts", rank_counts)

        def rules_loaded():
            with urllib.request.urlopen(base + "/api/v1/rules",
                                        timeout=5) as r:
                doc = json.load(r)
            got = {(r["name"], r["health"]) for g in doc["data"]["groups"]
                   for r in g["rules"]}
            for name in ("ShardplaneStalled", "ShardplaneNoProgress",
                         "ShardplaneStraggler"):
                iu.check((name, "ok") in got, "rule %s: %r" % (name, got))
        runner.case("rules_loaded_and_healthy", rules_loaded)

        def names_exported():
            st, body = job.get("/metrics")
            iu.check_eq(st, 200, "GET /metrics")
            live = metric_names(body.decode())
            for rel, used in names_used(a.examples).items():
                iu.check(used, "%s uses no shardplane metric" % rel)
                missing = sorted(n for n in used if n not in live)
                iu.check(not missing, "%s uses names the coordinator does "
                         "not export: %s" % (rel, missing))
            v = metric_values(body.decode(), "shardplane_job_world_size")
            iu.check_eq(v.get(""), 2.0, "world size")
        runner.case("example_names_exported", names_exported)
    run_gpt2_tiny(runner, a.shardplane, a.examples, "shardplane-prom-", cases)
    return runner.summary()


if __name__ == "__main__":
    sys.exit(main())
