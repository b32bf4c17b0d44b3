/* The benchmarks' peers: `./dev bench` installs everything bench/rpc's gRPC
 * C++ comparison needs, and bench/rpc never leaves that comparison out
 * quietly.
 *  - scripts/deps.sh's bench packages (SHARDPLANE_DEPS_BENCH=1, --list)
 *    own every file bench/CMakeLists.txt looks for: the pkg-config modules
 *    grpc++ and protobuf, the programs protoc and grpc_cpp_plugin (dpkg
 *    says who owns those installed here);
 *  - bench/rpc built without its gRPC C++ server exits non-zero naming
 *    what to install; built with it, prints the gRPC C++ row; told
 *    --no-grpcpp, says the comparison was left out, never "skipped". */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "support/testutil.h"

#define DEPS SP_EXAMPLES "/../scripts/deps.sh"
#define BENCH_RPC SP_BIN_DIR "/../bench/rpc"
#define GRPCPP_SERVER SP_BIN_DIR "/../bench/grpcpp_echo_server"

/* The package dpkg says owns path (malloc'd), or NULL. */
static char *owner_of(const char *path) {
  char cmd[4200];
  snprintf(cmd, sizeof cmd, "dpkg -S '%s' 2>/dev/null", path);
  char *out;
  int st = sp_test_shell(cmd, &out);
  char *colon = strchr(out, ':');
  if (st != 0 || colon == NULL || strncmp(out, "diversion", 9) == 0) {
    free(out);
    return NULL;
  }
  *colon = '\0';
  return out;
}

/* The file behind a bench requirement, when installed here (malloc'd), or
 * NULL: a pkg-config module's .pc file, or a program on PATH. */
static char *requirement_path(const char *what, bool module) {
  char cmd[256];
  if (module)
    snprintf(cmd, sizeof cmd,
             "pkg-config --variable=pcfiledir '%s' 2>/dev/null", what);
  else
    snprintf(cmd, sizeof cmd, "command -v '%s' 2>/dev/null", what);
  char *out;
  int st = sp_test_shell(cmd, &out);
  out[strcspn(out, "\n")] = '\0';
  if (st != 0 || out[0] == '\0') {
    free(out);
    return NULL;
  }
  if (!module) return out;
  size_t n = strlen(out) + strlen(what) + 8;
  char *pc = malloc(n);
  assert_non_null(pc);
  snprintf(pc, n, "%s/%s.pc", out, what);
  free(out);
  return pc;
}

static bool listed(const char *list, const char *pkg) {
  size_t n = strlen(pkg);
  for (const char *l = list; *l;) {
    size_t len = strcspn(l, "\n");
    if (len == n && strncmp(l, pkg, n) == 0) return true;
    l += len;
    if (*l == '\n') l++;
  }
  return false;
}

static void test_deps_cover_bench(void **state) {
  (void)state;
  char *list;
  int st = sp_test_shell("SHARDPLANE_DEPS_BENCH=1 '" DEPS "' --list", &list);
  assert_int_equal(st, 0);
  if (!listed(list, "libgrpc++-dev"))
    fail_msg(
        "scripts/deps.sh --list with SHARDPLANE_DEPS_BENCH=1 does not "
        "list libgrpc++-dev; it printed:\n%s",
        list);
  static const struct {
    const char *what;
    bool module;
  } reqs[] = {{"grpc++", true},
              {"protobuf", true},
              {"protoc", false},
              {"grpc_cpp_plugin", false}};
  int checked = 0;
  for (size_t i = 0; i < sizeof reqs / sizeof reqs[0]; i++) {
    char *path = requirement_path(reqs[i].what, reqs[i].module);
    char *pkg = path != NULL ? owner_of(path) : NULL;
    if (pkg == NULL) {
      printf("  %s %s: not installed here (or no dpkg), not checked\n",
             reqs[i].module ? "pkg-config module" : "program", reqs[i].what);
    } else {
      printf("  %s %s: %s, from %s\n",
             reqs[i].module ? "pkg-config module" : "program", reqs[i].what,
             path, pkg);
      if (!listed(list, pkg))
        fail_msg(
            "bench/CMakeLists.txt needs %s (%s, in package %s), which "
            "scripts/deps.sh does not install for ./dev bench",
            reqs[i].what, path, pkg);
      checked++;
    }
    free(pkg);
    free(path);
  }
  free(list);
  if (checked == 0) skip();
}

/* Fails unless out has a line that begins with prefix and does not
 * mention `bad`. */
static void expect_row(const char *out, const char *prefix, const char *bad) {
  for (const char *l = out; *l;) {
    size_t len = strcspn(l, "\n");
    if (strncmp(l, prefix, strlen(prefix)) == 0) {
      char *row = strndup(l, len);
      bool ok = strstr(row, bad) == NULL;
      free(row);
      if (ok) return;
    }
    l += len;
    if (*l == '\n') l++;
  }
  fail_msg("no \"%s\" row without \"%s\" in:\n%s", prefix, bad, out);
}

static void test_rpc_bench_peer(void **state) {
  (void)state;
  if (access(BENCH_RPC, X_OK) != 0) fail_msg("%s was not built", BENCH_RPC);
  char *out;
  int st = sp_test_shell("'" BENCH_RPC "' --seconds 0.01 --runs 1 2>&1", &out);
  if (access(GRPCPP_SERVER, X_OK) == 0) {
    if (st != 0) fail_msg("bench/rpc exited %d:\n%s", st, out);
    expect_row(out, "gRPC C++ server", "failed");
  } else {
    /* built without the peer: an error that says what to install */
    printf("  without gRPC C++: %s", out);
    if (st == 0 || strstr(out, "install") == NULL ||
        strstr(out, "skipped") != NULL)
      fail_msg("bench/rpc without its gRPC C++ server exited %d:\n%s", st, out);
  }
  free(out);
  st = sp_test_shell("'" BENCH_RPC "' --no-grpcpp --seconds 0.01 --runs 1 2>&1",
                     &out);
  if (st != 0) fail_msg("bench/rpc --no-grpcpp exited %d:\n%s", st, out);
  if (strstr(out, "skipped") != NULL || strstr(out, "SKIPPED") != NULL)
    fail_msg("bench/rpc --no-grpcpp reports a skip:\n%s", out);
  if (strstr(out, "left out (--no-grpcpp)") == NULL)
    fail_msg("bench/rpc --no-grpcpp does not say gRPC C++ was left out:\n%s",
             out);
  free(out);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_deps_cover_bench),
      cmocka_unit_test(test_rpc_bench_peer),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
