/* The installed library as another project sees it: `cmake --install` of
 * this build into a fresh prefix, then tests/install/consumer.c built
 * outside the tree against that prefix four ways (pkg-config and
 * find_package(shardplane), each with the shared and the static library),
 * and each program run against a coordinator: it opens a session, reads
 * the plan and closes. Then the same program in a project that adds this
 * source tree with add_subdirectory. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "support/coord_fixture.h"
#include "support/testutil.h"

static char *g_dir;    /* scratch: prefix, builds, logs */
static char *g_prefix; /* the install prefix */
static sp_coord_fixture g_fx;
static char g_version[17]; /* the coordinator's plan version */

/* Runs a shell command with its output in g_dir/log; on failure prints
 * the command and the log and fails the test. */
static void run(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void run(const char *fmt, ...) {
  char cmd[8192];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(cmd, sizeof cmd - 64, fmt, ap);
  va_end(ap);
  assert_true(n > 0 && (size_t)n < sizeof cmd - 64);
  char *log = sp_test_path(g_dir, "log");
  char full[8400];
  snprintf(full, sizeof full, "( %s ) >%s 2>&1", cmd, log);
  int rc = system(full);
  if (rc != 0) {
    /* cmocka's messages are short: the log goes to stderr itself */
    char *text = sp_test_read_file(log);
    fprintf(stderr, "command failed (%d): %s\n%s\n", rc, cmd, text);
    free(text);
    fail_msg("command failed, its output above");
  }
  free(log);
}

/* Output of a built consumer, run as `rank`, read from g_dir/out. */
static char *run_consumer(const char *exe, int rank) {
  char *out = sp_test_path(g_dir, "out");
  run("%s %s %d >%s", exe, g_fx.addr, rank, out);
  char *text = sp_test_read_file(out);
  print_message("%s: %s", exe, text);
  free(out);
  return text;
}

static void expect_session(const char *text, int rank) {
  char want[128];
  snprintf(want, sizeof want, "shardplane %s cuda %d nccl %d: rank %d of 4",
           SHARDPLANE_VERSION, SHARDPLANE_HAVE_CUDA, SHARDPLANE_HAVE_NCCL,
           rank);
  if (strstr(text, want) == NULL) fail_msg("want \"%s\" in: %s", want, text);
  char plan[64];
  snprintf(plan, sizeof plan, ", plan %s,", g_version);
  if (strstr(text, plan) == NULL) fail_msg("want \"%s\" in: %s", plan, text);
}

/* Whether the program's dynamic section needs libshardplane.so. */
static int needs_shared_lib(const char *exe) {
  char cmd[4096];
  snprintf(cmd, sizeof cmd,
           "readelf -d %s | grep -q 'NEEDED.*libshardplane\\.so'", exe);
  return system(cmd) == 0;
}

static int setup(void **state) {
  (void)state;
  g_dir = sp_test_mkdtemp();
  g_prefix = sp_test_path(g_dir, "prefix");
  run("%s --install %s --prefix %s", SP_CMAKE, SP_BUILD_DIR, g_prefix);
  static const char *const flags[] = {"world-size", "4", NULL};
  sp_coord_fixture_start(&g_fx, SP_EXAMPLES "/mlp.json", flags, 0);
  Shardplane__V1__GetJobResponse *job = sp_coord_fixture_get_job(&g_fx);
  snprintf(g_version, sizeof g_version, "%s", job->plan_version);
  sp_test_free_msg(job);
  return 0;
}

static int teardown(void **state) {
  (void)state;
  sp_coord_fixture_stop(&g_fx);
  sp_test_rmtree(g_dir);
  free(g_prefix);
  free(g_dir);
  return 0;
}

/* Only installed files: the headers under include/shardplane/, nothing
 * that names a bare "plan.h" an include path would have to supply. */
static void test_installed_files(void **state) {
  (void)state;
  run("cd %s && test -f include/shardplane/shardplane.h && "
      "test -f include/shardplane/config.h && "
      "test -f lib/libshardplane.a && test -f lib/pkgconfig/shardplane.pc && "
      "test -f lib/cmake/shardplane/shardplaneConfig.cmake && "
      "test -x bin/shardplane && test -x bin/shardplane-worker && "
      "test -x bin/shardplane-coordinator && "
      "readelf -d lib/libshardplane.so | "
      "grep -q 'SONAME.*libshardplane\\.so\\.%d\\.%d'",
      g_prefix, SHARDPLANE_VERSION_MAJOR, SHARDPLANE_VERSION_MINOR);
#if SHARDPLANE_HAVE_CUDA
  /* the worker's GPU models, where the installed worker looks for them
   * (client/worker/worker_cuda.h), and cuBLAS in them, not in the worker */
  run("cd %s && f=lib/shardplane/libshardplane-worker-cuda.so && test -f $f "
      "&& readelf -d $f | grep -q 'NEEDED.*libcublas' && "
      "! ldd bin/shardplane-worker | grep -q libcublas",
      g_prefix);
#endif
  /* every quoted include in an installed header names a file beside it */
  run("cd %s/include/shardplane && for h in $(find . -name '*.h'); do "
      "d=$(dirname $h); for i in $(sed -n 's/^#include \"\\(.*\\)\"/\\1/p' $h); "
      "do test -f $d/$i || { echo \"$h includes missing $i\"; exit 1; }; "
      "done; done",
      g_prefix);
}

static void test_pkg_config(void **state) {
  (void)state;
  const char *pc = "PKG_CONFIG_PATH=%s/lib/pkgconfig pkg-config";
  char pcmd[4096];
  snprintf(pcmd, sizeof pcmd, pc, g_prefix);
  char *shared = sp_test_path(g_dir, "pc_shared");
  char *stat = sp_test_path(g_dir, "pc_static");
  /* compiled from its own directory, so no in-tree include can help */
  run("cd %s && %s %s -o %s consumer.c $(%s --cflags --libs shardplane) "
      "-Wl,-rpath,%s/lib",
      SP_CONSUMER_DIR, SP_CC, SP_SAN_FLAGS, shared, pcmd, g_prefix);
  run("cd %s && %s %s -o %s consumer.c $(%s --cflags shardplane) "
      "%s/lib/libshardplane.a "
      "$(%s --static --libs shardplane | sed 's/-lshardplane//')",
      SP_CONSUMER_DIR, SP_CC, SP_SAN_FLAGS, stat, pcmd, g_prefix, pcmd);
  assert_true(needs_shared_lib(shared));
  assert_false(needs_shared_lib(stat));
  char *t = run_consumer(shared, 0);
  expect_session(t, 0);
  free(t);
  t = run_consumer(stat, 1);
  expect_session(t, 1);
  free(t);
  free(shared);
  free(stat);
}

static void test_find_package(void **state) {
  (void)state;
  const char *kinds[] = {"OFF", "ON"};
  for (int k = 0; k < 2; k++) {
    char name[32];
    snprintf(name, sizeof name, "cmake_%s", k ? "static" : "shared");
    char *bdir = sp_test_path(g_dir, name);
    run("%s -S %s -B %s -DCMAKE_PREFIX_PATH=%s -DCONSUMER_STATIC=%s "
        "-DCMAKE_C_FLAGS='%s' -DCMAKE_CXX_FLAGS='%s' && %s --build %s",
        SP_CMAKE, SP_CONSUMER_DIR, bdir, g_prefix, kinds[k], SP_SAN_FLAGS,
        SP_SAN_FLAGS, SP_CMAKE, bdir);
    char *exe = sp_test_path(bdir, "consumer");
    assert_int_equal(needs_shared_lib(exe), k == 0);
    char *t = run_consumer(exe, 2 + k);
    expect_session(t, 2 + k);
    free(t);
    free(exe);
    free(bdir);
  }
}

/* add_subdirectory(shardplane) in another project: it must configure
 * without cmocka or the test and benchmark targets, and the program it
 * builds against the in-tree targets must work as the installed one does.
 * CUDA is left out so this build stays quick. */
static void test_subproject(void **state) {
  (void)state;
  char *bdir = sp_test_path(g_dir, "subproject");
  run("%s -S %s/subproject -B %s -G Ninja -DSHARDPLANE_SOURCE_DIR=%s "
      "-DSHARDPLANE_CUDA=OFF -DCMAKE_C_FLAGS='%s' -DCMAKE_CXX_FLAGS='%s' && "
      "! grep -q '^CMOCKA_FOUND' %s/CMakeCache.txt && "
      "%s --build %s --target help > %s/targets && "
      "! grep -q 'test_\\|bench_' %s/targets && "
      "grep -q shardplane_static %s/targets && "
      "%s --build %s --target consumer",
      SP_CMAKE, SP_CONSUMER_DIR, bdir, SP_SOURCE_DIR, SP_SAN_FLAGS,
      SP_SAN_FLAGS, bdir, SP_CMAKE, bdir, bdir, bdir, bdir, SP_CMAKE, bdir);
  char *exe = sp_test_path(bdir, "consumer");
  char *t = run_consumer(exe, 0);
  /* the subproject was built without CUDA, whatever this build has */
  char want[128];
  snprintf(want, sizeof want, "shardplane %s cuda 0 nccl 0: rank 0 of 4",
           SHARDPLANE_VERSION);
  if (strstr(t, want) == NULL) fail_msg("want \"%s\" in: %s", want, t);
  free(t);
  free(exe);
  free(bdir);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_installed_files),
      cmocka_unit_test(test_pkg_config),
      cmocka_unit_test(test_find_package),
      cmocka_unit_test(test_subproject),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
