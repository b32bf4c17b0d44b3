#!/usr/bin/python3
"""An independent safetensors reader: the Python standard library and numpy
only, written from the format description (huggingface/safetensors), not
from shardplane's C reader, so the two can check each other.

    u64 little-endian N | N bytes of JSON header | data section

The header maps each tensor name to {"dtype", "shape", "data_offsets":
[begin, end]} (relative to the data section, end exclusive), plus an optional
"__metadata__" object of strings. Checked here: the header length, UTF-8 and
JSON (duplicate names rejected), every entry's dtype, shape and offsets, and
that the tensors tile the data section exactly (from 0, no gaps or overlaps,
ending at the end of the file).

As a library: load(path) -> (tensors, metadata), tensors a dict name ->
numpy array (0-d for a scalar). BF16 becomes float32 (the 16 bits shifted to
the top of a float32, which is exact); BOOL bytes must be 0 or 1.

As a command: st_reader.py FILE [--hex-limit N] prints one JSON object:
    {"header_len": N, "data_len": D, "metadata": {...},
     "order": [names in data order],
     "tensors": {name: {"dtype": "F32", "shape": [..], "data_offsets": [b, e],
                        "sha256": hex of the raw bytes,
                        "hex": the raw bytes (only up to --hex-limit bytes),
                        "values": [...]}}}
"values" is the flattened row-major content: floats as Python's repr of
the value widened to float64 ("nan", "inf", "-0.0", "1e-45"), strings so
that JSON can carry non-finite values and C can strtod them back exactly;
integers as JSON integers; bools as JSON booleans.
Exit status 0; 2 for an invalid file (the reason on stderr); 77 when numpy
is missing (reported as skipped by the C test).
"""

import hashlib
import json
import struct
import sys

try:
    import numpy as np
except ImportError as e:  # pragma: no cover
    if __name__ == "__main__":
        print("SKIPPED: numpy is not available: %s" % e, file=sys.stderr)
        sys.exit(77)
    raise

MAX_HEADER = 100_000_000

# safetensors name -> (numpy dtype of the stored bytes, bytes per element)
DTYPES = {
    "F64": ("<f8", 8),
    "F32": ("<f4", 4),
    "F16": ("<f2", 2),
    "BF16": ("<u2", 2),
    "I64": ("<i8", 8),
    "I32": ("<i4", 4),
    "I16": ("<i2", 2),
    "I8": ("i1", 1),
    "U8": ("u1", 1),
    "BOOL": ("u1", 1),
}
FLOATING = {"F64", "F32", "F16", "BF16"}


class SafetensorsError(ValueError):
    pass


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise SafetensorsError("duplicate key %r in the header" % k)
        out[k] = v
    return out


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def parse_header(buf):
    """Validates buf (the whole file) and returns (n, metadata, entries):
    entries a list of (name, dtype, shape, begin, end) in data order."""
    if len(buf) < 8:
        raise SafetensorsError("file of %d bytes: no header length" % len(buf))
    (n,) = struct.unpack("<Q", buf[:8])
    if n > MAX_HEADER:
        raise SafetensorsError("header length %d over %d" % (n, MAX_HEADER))
    if 8 + n > len(buf):
        raise SafetensorsError(
            "header length %d beyond the file (%d bytes)" % (n, len(buf)))
    try:
        text = bytes(buf[8:8 + n]).decode("utf-8")
    except UnicodeDecodeError as e:
        raise SafetensorsError("header is not UTF-8: %s" % e)
    if not text.startswith("{"):
        raise SafetensorsError("header does not start with '{'")
    try:
        header = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise SafetensorsError("header is not JSON: %s" % e)
    if not isinstance(header, dict):
        raise SafetensorsError("header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(
            isinstance(v, str) for v in metadata.values()):
        raise SafetensorsError("__metadata__ must map strings to strings")
    data_len = len(buf) - 8 - n
    entries = []
    for name, e in header.items():
        where = "tensor %r" % name
        if not isinstance(e, dict):
            raise SafetensorsError("%s: entry is not an object" % where)
        extra = set(e) - {"dtype", "shape", "data_offsets"}
        if extra:
            raise SafetensorsError(
                "%s: unknown fields %s" % (where, sorted(extra)))
        dt = e.get("dtype")
        if dt not in DTYPES:
            raise SafetensorsError("%s: unsupported dtype %r" % (where, dt))
        shape = e.get("shape")
        if not isinstance(shape, list) or not all(
                _is_int(d) and d >= 0 for d in shape):
            raise SafetensorsError("%s: bad shape %r" % (where, shape))
        off = e.get("data_offsets")
        if (not isinstance(off, list) or len(off) != 2 or
                not all(_is_int(o) and o >= 0 for o in off)):
            raise SafetensorsError("%s: bad data_offsets %r" % (where, off))
        begin, end = off
        if end < begin:
            raise SafetensorsError("%s: data_offsets end before begin" % where)
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * DTYPES[dt][1]:
            raise SafetensorsError(
                "%s: %d bytes for shape %s of %s"
                % (where, end - begin, shape, dt))
        entries.append((name, dt, shape, begin, end))
    entries.sort(key=lambda t: (t[3], t[4]))
    pos = 0
    for name, _, _, begin, end in entries:
        if begin != pos:
            raise SafetensorsError(
                "tensor %r starts at %d, expected %d (gap or overlap)"
                % (name, begin, pos))
        pos = end
    if pos != data_len:
        raise SafetensorsError(
            "tensors end at %d but the data section has %d bytes"
            % (pos, data_len))
    return n, metadata, entries


def _array(dt, shape, raw):
    np_dt, _ = DTYPES[dt]
    a = np.frombuffer(raw, dtype=np.dtype(np_dt))
    if dt == "BF16":
        a = (a.astype("<u4") << 16).view("<f4")
    elif dt == "BOOL":
        if a.size and int(a.max()) > 1:
            raise SafetensorsError("BOOL tensor holds a byte other than 0/1")
        a = a.astype(np.bool_)
    return a.reshape(tuple(shape))


def load_bytes(buf):
    """(tensors, metadata) from a whole file image."""
    n, metadata, entries = parse_header(buf)
    base = 8 + n
    tensors = {}
    for name, dt, shape, begin, end in entries:
        tensors[name] = _array(dt, shape, bytes(buf[base + begin:base + end]))
    return tensors, metadata


def load(path):
    with open(path, "rb") as f:
        return load_bytes(f.read())


def _values(dt, arr):
    flat = arr.reshape(-1)
    if dt in FLOATING:
        return [repr(float(v)) for v in flat]
    if dt == "BOOL":
        return [bool(v) for v in flat]
    return [int(v) for v in flat]


def summary(buf, hex_limit=4096):
    n, metadata, entries = parse_header(buf)
    base = 8 + n
    out = {"header_len": n, "data_len": len(buf) - base, "metadata": metadata,
           "order": [e[0] for e in entries], "tensors": {}}
    for name, dt, shape, begin, end in entries:
        raw = bytes(buf[base + begin:base + end])
        arr = _array(dt, shape, raw)
        t = {"dtype": dt, "shape": list(arr.shape),
             "data_offsets": [begin, end],
             "sha256": hashlib.sha256(raw).hexdigest(),
             "values": _values(dt, arr)}
        if len(raw) <= hex_limit:
            t["hex"] = raw.hex()
        out["tensors"][name] = t
    return out


def main(argv):
    args = argv[1:]
    hex_limit = 4096
    if "--hex-limit" in args:
        i = args.index("--hex-limit")
        try:
            hex_limit = int(args[i + 1])
        except (IndexError, ValueError):
            print("usage: st_reader.py FILE [--hex-limit N]", file=sys.stderr)
            return 2
        del args[i:i + 2]
    if len(args) != 1:
        print("usage: st_reader.py FILE [--hex-limit N]", file=sys.stderr)
        return 2
    try:
        with open(args[0], "rb") as f:
            buf = f.read()
        s = summary(buf, hex_limit)
    except (OSError, SafetensorsError) as e:
        print("st_reader: %s: %s" % (args[0], e), file=sys.stderr)
        return 2
    json.dump(s, sys.stdout, allow_nan=False)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
