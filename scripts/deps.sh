#!/usr/bin/env bash
# Installs the Debian 12 packages shardplane builds and tests with.
# Idempotent: packages already installed are skipped, so a second run does
# not touch apt at all.
set -euo pipefail

PACKAGES=(
  gcc g++ make cmake ninja-build pkg-config
  libjansson-dev libprotobuf-c-dev protobuf-c-compiler libcmocka-dev
  libuv1-dev libnghttp2-dev
  # the control plane: TLS and token hashes (OpenSSL 3), durable state
  # (SQLite); the openssl command makes the tests' certificates
  libssl-dev openssl libsqlite3-dev
  # network namespaces as test hosts
  iproute2
  # CPU collectives of the worker runtime
  libgloo-dev
  # interop tests: a real gRPC implementation nobody here wrote
  python3 python3-grpcio python3-protobuf protobuf-compiler
  # the independent safetensors reader of the checkpoint tests
  python3-numpy
  # the worker's CPU matrix products (GPT-2, MLP): CBLAS from a well-kept,
  # threaded BLAS instead of hand-written GEMM loops
  libopenblas-dev
  # the numerical oracle of the GPT-2 gradient and training-parity tests
  # and the peer of bench/train (Debian 12 has PyTorch 1.13.1)
  python3-torch
  # the coordinator's HTTP listener (/metrics and the dashboard): a
  # maintained HTTP/1.1 server library driven from the libuv loop
  libmicrohttpd-dev
  # interop peers of the observability tests: a real Prometheus (and
  # promtool for the example alert rules) and a real headless browser
  prometheus chromium
  # interop peer of the Slurm test: a real one-node Slurm cluster
  # (controller and node daemon started by the test) and its munge auth
  slurm-wlm munge
)
# `./dev bench` also needs the reference gRPC C++ server of bench/rpc; what
# bench/CMakeLists.txt looks for, and the package that has it:
#   pkg-config grpc++ (libgrpc++-dev), pkg-config protobuf (libprotobuf-dev:
#   libgrpc++-dev does not pull it in), protoc (protobuf-compiler),
#   grpc_cpp_plugin (protobuf-compiler-grpc)
if [ "${SHARDPLANE_DEPS_BENCH:-0}" = 1 ]; then
  PACKAGES+=(libgrpc++-dev libprotobuf-dev protobuf-compiler
             protobuf-compiler-grpc)
fi
# `./dev format` needs the formatter the committed .clang-format is
# written for (Debian 12's clang-format is version 14)
if [ "${SHARDPLANE_DEPS_FORMAT:-0}" = 1 ]; then
  PACKAGES+=(clang-format-14)
fi

# --list: print the packages a run makes sure of, one a line, and stop
if [ "${1:-}" = --list ]; then
  printf '%s\n' "${PACKAGES[@]}"
  exit 0
fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "deps: installing ${missing[*]}" >&2
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "deps: need root or sudo to install ${missing[*]}" >&2; exit 1; }
  SUDO=sudo
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
