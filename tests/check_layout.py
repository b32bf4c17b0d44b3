#!/usr/bin/env python3
"""The rules of the source layout, checked on the tree as it is:

1. an internal header (*_internal.h) is included only from its own folder
   (tests/ may include one: a white-box test of that folder's internals);
2. no include cycle between folders: the folders' include graph, taken over
   every product source file, has no circle through two folders;
3. no source file name (.c .cc .cu .h) is used twice in the tree;
4. no comment of a source file, and no doc, names a source file or doc
   (x.c, x.h, x.cu, x.cc, x.md, with or without a folder) that the tree
   does not have;
5. with --binary B: `readelf -d B` names no cuBLAS and no OpenBLAS (the
   shardplane command links neither the models nor their BLAS);
6. with --worker W: neither `readelf -d W` nor `ldd W` (what it needs, and
   what that needs in turn) names cuBLAS: shardplane-worker loads its GPU
   models, and with them cuBLAS, as a module only to train on a GPU (its
   CPU kernels' OpenBLAS is fine).

Usage: check_layout.py REPO [--binary PATH] [--worker PATH]. Exit 0 when
every rule holds;
exit 1 with one line per breach, naming the file and line, otherwise; exit
2 on a usage error.
"""
import os
import re
import subprocess
import sys

SRC_EXT = (".c", ".cc", ".cu", ".h")
SKIP_DIRS = {".git", "build", "corpus", "__pycache__"}
# Where a folder-qualified include ("lib/shardplane.h", "base/json.h",
# "support/testutil.h") is looked up, as the build's include paths have it.
INCLUDE_ROOTS = ("client", "common", "tests", ".")
# Names of files of other projects that comments cite on purpose (the
# upstream code a line follows), and names generated at build time.
FOREIGN = re.compile(
    r"(^|/)(nghttp2_\w+\.[ch]|llm\.c|train_gpt2\.cu|\w+\.pb-c\.[ch]|"
    r"config\.h|cuda_\w+\.h|shardplane/shardplane\.h|doc/statuscodes\.md|"
    r"app\.c)$")


def tracked(repo):
    """The tree's files: git's (tracked and not ignored) in a checkout,
    else every file below repo but the build folders."""
    git = subprocess.run(["git", "-C", repo, "ls-files", "-co",
                          "--exclude-standard"], capture_output=True,
                         text=True)
    if git.returncode == 0:
        out = git.stdout.split("\n")
    else:
        out = [os.path.relpath(os.path.join(d, f), repo)
               for d, dirs, fs in os.walk(repo) for f in fs]
    return sorted(p for p in out if p and os.path.exists(
        os.path.join(repo, p)) and not set(p.split("/")) & SKIP_DIRS and
        not p.startswith("build"))


def resolve(repo, files, src, inc):
    here = os.path.normpath(os.path.join(os.path.dirname(src), inc))
    if here in files:
        return here
    for root in INCLUDE_ROOTS:
        p = os.path.normpath(os.path.join(root, inc))
        if p in files:
            return p
    return None


def includes(repo, files):
    """(file, line number, included file) for every quoted include that
    names a file of the tree."""
    rx = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
    for f in files:
        if not f.endswith(SRC_EXT):
            continue
        with open(os.path.join(repo, f), errors="replace") as fh:
            for n, line in enumerate(fh, 1):
                m = rx.match(line)
                if m:
                    t = resolve(repo, files, f, m.group(1))
                    if t:
                        yield f, n, t


def folder_cycles(edges):
    """Strongly connected sets of two or more folders (Tarjan)."""
    graph = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def comments(text):
    """(line number, text) of each comment of a C-family source."""
    for m in re.finditer(r"/\*.*?\*/|//[^\n]*", text, re.S):
        yield text.count("\n", 0, m.start()) + 1, m.group(0)


# A file name, not a module path such as "transformer.h.0.attn" (GPT-2's
# FQNs) nor a call such as "f.c(x)".
NAME = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.(?:c|cc|cu|h|md))\b"
                  r"(?![\w(-]|\.\w)")


def named_files(repo, files):
    base = {os.path.basename(f) for f in files}
    for f in files:
        path = os.path.join(repo, f)
        if f.endswith(SRC_EXT):
            with open(path, errors="replace") as fh:
                chunks = list(comments(fh.read()))
        elif f.endswith(".md"):
            with open(path, errors="replace") as fh:
                chunks = [(1, fh.read())]
        else:
            continue
        for first, text in chunks:
            for m in NAME.finditer(text):
                name = m.group(1)
                if FOREIGN.search(name) or name.startswith(("http", "www.")):
                    continue
                if "/" in name:
                    rel = os.path.normpath(os.path.join(os.path.dirname(f),
                                                        name))
                    ok = any(p.endswith(name) for p in files) or \
                        rel in files or os.path.isdir(os.path.join(repo, rel))
                else:
                    ok = name in base
                if not ok:
                    yield f, first + text.count("\n", 0, m.start()), name


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if len(argv) >= 2 else 2
    repo = argv[1]
    opts = {"--binary": None, "--worker": None}
    rest = argv[2:]
    while len(rest) >= 2 and rest[0] in opts:
        opts[rest[0]] = rest[1]
        rest = rest[2:]
    if rest:
        print("check_layout.py: usage: check_layout.py REPO [--binary PATH] "
              "[--worker PATH]", file=sys.stderr)
        return 2
    binary, worker = opts["--binary"], opts["--worker"]
    files = tracked(repo)
    fileset = set(files)
    bad = []

    edges = []
    for src, n, inc in includes(repo, fileset):
        sdir, idir = os.path.dirname(src), os.path.dirname(inc)
        if inc.endswith("_internal.h") and sdir != idir and \
                not src.startswith("tests/"):
            bad.append(f"{src}:{n}: includes {inc}, internal to {idir}/")
        if sdir != idir and not src.startswith(("tests/", "bench/")):
            edges.append((sdir, idir))
    for comp in folder_cycles(edges):
        bad.append("include cycle between folders: " + " -> ".join(comp))

    seen = {}
    for f in files:
        if f.endswith(SRC_EXT):
            seen.setdefault(os.path.basename(f), []).append(f)
    for name, where in sorted(seen.items()):
        if len(where) > 1:
            bad.append(f"file name {name} is used {len(where)} times: " +
                       ", ".join(where))

    for f, n, name in named_files(repo, files):
        bad.append(f"{f}:{n}: names {name}, which the tree does not have")

    if binary:
        dyn = subprocess.run(["readelf", "-d", binary], capture_output=True,
                             text=True)
        if dyn.returncode != 0:
            bad.append(f"{binary}: readelf -d failed: {dyn.stderr.strip()}")
        for lib in re.findall(r"\[(lib[^\]]+)\]", dyn.stdout):
            if re.match(r"lib(cublas|openblas|blas)", lib):
                bad.append(f"{binary} links {lib}")

    if worker:
        for cmd in (["readelf", "-d", worker], ["ldd", worker]):
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                bad.append(f"{worker}: {' '.join(cmd[:-1])} failed: "
                           f"{out.stderr.strip()}")
            for lib in sorted(set(re.findall(r"\blibcublas\w*\.so[.\d]*",
                                             out.stdout))):
                bad.append(f"{worker} needs {lib} ({cmd[0]}): its GPU "
                           "models belong in its CUDA module")

    for line in bad:
        print(line)
    print(f"check_layout: {len(files)} files, {len(bad)} breaches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
