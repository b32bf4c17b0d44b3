#!/usr/bin/env python3
"""Headless Chromium (Debian's chromium) loads the coordinator's dashboard
during a real 2-rank job whose rank 1 stalls (--inject stall:rank=1,...):
the rendered DOM must show rank 1 as the culprit and the verdict's words,
and a PNG screenshot is written to the build folder. A second load without
a token must be refused (the page asks for a login and shows no job data).

Without chromium the test fails (scripts/deps.sh installs it); it never
skips."""

import html
import json
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import interop_util as iu  # noqa: E402
from run_job import (  # noqa: E402
    metric_values, run_gpt2_tiny, start, wait_for)


def chromium(binary, profile, url, extra, timeout=60):
    argv = [binary, "--headless=new", "--no-sandbox", "--disable-gpu",
            "--disable-dev-shm-usage", "--no-first-run",
            "--user-data-dir=" + profile, "--window-size=1400,2000",
            "--virtual-time-budget=15000"] + extra + [url]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                       start_new_session=True)
    return r


def element_text(dom, ident):
    """The text inside the element with id ident (tags stripped), or
    None."""
    m = re.search(r'<(\w+)[^>]*\bid="%s"[^>]*>' % re.escape(ident), dom)
    if m is None:
        return None
    tag, depth, i = m.group(1), 1, m.end()
    opener = re.compile(r"<%s\b|</%s>" % (tag, tag))
    while depth and i < len(dom):
        n = opener.search(dom, i)
        if n is None:
            break
        depth += -1 if n.group(0).startswith("</") else 1
        i = n.end()
    inner = dom[m.end():i]
    return html.unescape(re.sub(r"<[^>]+>", " ", inner))


def main():
    a, runner = start("the screenshot's folder")
    browser = shutil.which("chromium")
    if browser is None:
        runner.fail("peers", "chromium is needed (Debian package chromium; "
                    "scripts/deps.sh installs it)")
        return runner.summary()
    def cases(job):
        tmp = job.cwd

        def stalled():
            st, body = job.get("/metrics")
            v = metric_values(body.decode(), "shardplane_alerts_open")
            return st == 200 and v.get('{kind="stall"}', 0) >= 1
        wait_for(stalled, 90, "the coordinator's stall verdict", every=0.5)
        st, body = job.get("/api/v1/job")
        iu.check_eq(st, 200, "GET /api/v1/job")
        why = json.loads(body)["why"]
        print("shardplane why (the API): %s" % why["headline"], flush=True)

        def with_token():
            shot = os.path.join(a.out, "dashboard-stall.png")
            if os.path.exists(shot):
                os.unlink(shot)
            url = "http://%s/#token=%s" % (job.http, job.token)
            r = chromium(browser, os.path.join(tmp, "p1"), url,
                         ["--dump-dom"])
            iu.check(r.returncode == 0, "chromium: %s" % r.stderr[-2000:])
            dom = r.stdout
            with open(os.path.join(a.out, "dashboard-stall.html"), "w") as f:
                f.write(dom)
            culprits = element_text(dom, "culprits")
            verdict = element_text(dom, "verdict")
            iu.check(culprits is not None and verdict is not None,
                     "no #culprits or #verdict in the DOM")
            print("#verdict: %s" % " ".join(verdict.split())[:400])
            print("#culprits: %s" % " ".join(culprits.split()))
            iu.check(re.search(r"\brank 1\b", culprits),
                     "#culprits does not name rank 1: %r" % culprits)
            iu.check(re.search(r"\brank 0\b", culprits) is None,
                     "#culprits names rank 0: %r" % culprits)
            # the coordinator's own words: the stall alert's line names
            # rank 1 as the one not issuing the collective rank 0 waits in
            words = " ".join(verdict.split())
            line = next(x for x in why["lines"] if "has not issued" in x)
            core = line.split(": ", 1)[-1].split(";", 1)[0]
            iu.check(core in words, "the verdict's words %r not in %r"
                     % (core, words))
            iu.check(words.startswith("rank 1 has not issued") or
                     "rank 1 has not issued" in words,
                     "rank 1 named as the one not arriving: %r" % words)
            iu.check(job.token not in dom, "the token stayed in the page")
            r = chromium(browser, os.path.join(tmp, "p2"), url,
                         ["--screenshot=" + shot])
            iu.check(r.returncode == 0 and os.path.getsize(shot) > 10000,
                     "screenshot: %s" % r.stderr[-2000:])
            with open(shot, "rb") as f:
                iu.check(f.read(8) == b"\x89PNG\r\n\x1a\n", "a PNG file")
            print("screenshot: %s (%d bytes)" % (shot, os.path.getsize(shot)),
                  flush=True)
        runner.case("culprit_and_verdict_rendered", with_token)

        def without_token():
            url = "http://%s/" % job.http
            r = chromium(browser, os.path.join(tmp, "p3"), url,
                         ["--dump-dom"])
            iu.check(r.returncode == 0, "chromium: %s" % r.stderr[-2000:])
            dom = r.stdout
            login = element_text(dom, "login")
            iu.check(login is not None, "no login form without a token")
            verdict = element_text(dom, "verdict") or ""
            culprits = element_text(dom, "culprits") or ""
            iu.check("rank 1" not in verdict + culprits and
                     "gpt2-tiny" not in dom,
                     "job data shown without a token")
            st, _ = job.get("/api/v1/job", token=False)
            iu.check_eq(st, 401, "the API without a token")
            st, _ = job.get("/", token=False)
            iu.check_eq(st, 401, "the page without a token")
        runner.case("refused_without_token", without_token)
    run_gpt2_tiny(runner, a.shardplane, a.examples, "shardplane-dash-", cases,
                  ["--inject", "stall:rank=1,step=20",
                   "--stall-timeout-ms", "2000"])
    return runner.summary()


if __name__ == "__main__":
    sys.exit(main())
