/* Replays the fuzz corpus (tests/fuzz/corpus) through the same harness code
 * as the libFuzzer targets, so every build exercises the in-memory server
 * connection and the wire helpers, with or without clang. Server inputs
 * named "<name>.s<N>" must end stream 1 with grpc-status N, which shows the
 * harness really drives calls through the engine. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <dirent.h>

#include "fuzz/fuzz_targets.h"
#include "support/h2_raw.h"
#include "rpc/rpc.h"
#include "support/testutil.h"

static uint8_t *read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  uint8_t *buf = NULL;
  size_t n = 0, cap = 0;
  for (;;) {
    if (n == cap) {
      cap = cap ? cap * 2 : 4096;
      buf = realloc(buf, cap);
      assert_non_null(buf);
    }
    size_t got = fread(buf + n, 1, cap - n, f);
    n += got;
    if (got == 0) break;
  }
  fclose(f);
  *len = n;
  return buf;
}

static int by_name(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The regular files of dir, sorted so runs are reproducible. */
static char **list_dir(const char *dir, size_t *n_out) {
  DIR *d = opendir(dir);
  if (d == NULL) fail_msg("cannot open the corpus directory %s", dir);
  char **names = NULL;
  size_t n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.') continue;
    names = realloc(names, (n + 1) * sizeof *names);
    assert_non_null(names);
    names[n++] = sp_test_path(dir, e->d_name);
  }
  closedir(d);
  qsort(names, n, sizeof *names, by_name);
  *n_out = n;
  return names;
}

static void free_list(char **names, size_t n) {
  for (size_t i = 0; i < n; i++) free(names[i]);
  free(names);
}

static int collect(void *arg, const uint8_t *out, size_t n) {
  sp_h2_reader_feed(arg, out, n);
  return 0;
}

static void test_server_corpus(void **state) {
  (void)state;
  size_t n;
  char **files = list_dir(SP_FUZZ_CORPUS "/server", &n);
  assert_true(n >= 30);
  size_t checked = 0;
  for (size_t i = 0; i < n; i++) {
    size_t len;
    uint8_t *data = read_file(files[i], &len);
    sp_h2_reader r;
    sp_h2_reader_init(&r);
    /* aborts on a leak or invalid output; see fuzz_targets.h */
    assert_int_equal(sp_fuzz_rpc_server_run(data, len, collect, &r), 0);
    assert_false(r.error);
    const char *dot = strrchr(files[i], '.');
    if (dot != NULL && dot[1] == 's') {
      int want = atoi(dot + 2);
      const sp_h2_stream *s = sp_h2_reader_stream(&r, 1);
      if (s == NULL || s->grpc_status != want)
        fail_msg("%s: stream 1 ended with grpc-status %d, expected %d",
                 files[i], s ? s->grpc_status : -1, want);
      checked++;
    }
    sp_h2_reader_free(&r);
    free(data);
  }
  print_message("%zu server inputs, %zu with a checked status\n", n, checked);
  assert_true(checked >= 15);
  free_list(files, n);
}

static void test_wire_corpus(void **state) {
  (void)state;
  size_t n;
  char **files = list_dir(SP_FUZZ_CORPUS "/wire", &n);
  assert_true(n >= 10);
  for (size_t i = 0; i < n; i++) {
    size_t len;
    uint8_t *data = read_file(files[i], &len);
    sp_fuzz_rpc_wire_one(data, len);
    free(data);
  }
  free_list(files, n);
}

/* The harness itself on inputs the corpus cannot hold: empty, random, every
 * chunk size over one valid request. */
static void test_harness_edges(void **state) {
  (void)state;
  assert_int_equal(sp_fuzz_rpc_server_run(NULL, 0, NULL, NULL), 0);
  static const uint8_t mode_only[1] = {SP_FUZZ_PREFACE | SP_FUZZ_SETTINGS};
  assert_int_equal(sp_fuzz_rpc_server_run(mode_only, 1, NULL, NULL), 0);
  sp_test_rng rng = {7};
  uint8_t buf[2048];
  for (int i = 0; i < 200; i++) {
    size_t len = 1 + (size_t)sp_test_rng_below(&rng, sizeof buf);
    for (size_t k = 0; k < len; k++) buf[k] = (uint8_t)sp_test_rng_next(&rng);
    sp_fuzz_rpc_server_one(buf, len);
    sp_fuzz_rpc_wire_one(buf, len);
  }
  /* one valid Unary request fed 2^(k+1) bytes at a time, for every k */
  size_t len;
  uint8_t *req = read_file(SP_FUZZ_CORPUS "/server/unary_ok.s0", &len);
  for (unsigned k = 0; k < 16; k++) {
    req[0] = (uint8_t)((req[0] & 0x0f) | SP_FUZZ_CHUNK(k));
    sp_h2_reader r;
    sp_h2_reader_init(&r);
    assert_int_equal(sp_fuzz_rpc_server_run(req, len, collect, &r), 0);
    const sp_h2_stream *s = sp_h2_reader_stream(&r, 1);
    assert_non_null(s);
    assert_int_equal(s->grpc_status, SP_RPC_OK);
    sp_h2_reader_free(&r);
  }
  free(req);
}

/* Records each piece of the server's output as it is written. */
typedef struct pieces {
  sp_h2_reader r;
  /* after the piece that ended stream 1: whether another stream had an
   * answer by then */
  bool first_done, others_before_first;
} pieces;

static int on_piece(void *arg, const uint8_t *out, size_t n) {
  pieces *p = arg;
  sp_h2_reader_feed(&p->r, out, n);
  const sp_h2_stream *s1 = sp_h2_reader_stream(&p->r, 1);
  if (!p->first_done && s1 != NULL && sp_h2_stream_done(s1)) {
    p->first_done = true;
    for (uint32_t sid = 3; sid <= 15; sid += 2)
      if (sp_h2_reader_stream(&p->r, sid) != NULL)
        p->others_before_first = true;
  }
  return 0;
}

/* Eight Unary calls in one read, laid out as client libraries send them
 * (every HEADERS, then every DATA): the answer to the first leaves on its
 * own, before the server parses the other requests (see sp_h2conn_recv),
 * and every call still ends OK however the input is cut, including cuts
 * inside frame headers and the preface. */
static void test_first_answer_leaves_early(void **state) {
  (void)state;
  sp_h2buf in = {0};
  uint8_t mode = SP_FUZZ_PREFACE | SP_FUZZ_SETTINGS;
  sp_h2buf_put(&in, &mode, 1);
  sp_h2buf blk = {0};
  sp_h2_grpc_request_block(&blk, "/shardplane.testing.Echo/Unary");
  for (uint32_t sid = 1; sid <= 15; sid += 2)
    sp_h2_headers(&in, sid, &blk, false, 0);
  static const uint8_t empty[1]; /* an EchoRequest with no fields */
  for (uint32_t sid = 1; sid <= 15; sid += 2)
    sp_h2_grpc_message(&in, sid, empty, 0, true);
  sp_h2buf_free(&blk);
  for (unsigned k = 0; k < 8; k++) {
    in.p[0] = (uint8_t)(mode | SP_FUZZ_CHUNK(k));
    pieces p = {0};
    sp_h2_reader_init(&p.r);
    assert_int_equal(sp_fuzz_rpc_server_run(in.p, in.len, on_piece, &p), 0);
    assert_false(p.r.error);
    for (uint32_t sid = 1; sid <= 15; sid += 2) {
      const sp_h2_stream *s = sp_h2_reader_stream(&p.r, sid);
      assert_non_null(s);
      assert_true(s->ended);
      assert_int_equal(s->grpc_status, SP_RPC_OK);
    }
    if (k == 0) assert_false(p.others_before_first); /* all in one read */
    sp_h2_reader_free(&p.r);
  }
  sp_h2buf_free(&in);
}

static int teardown(void **state) {
  (void)state;
  sp_fuzz_rpc_server_teardown();
  return 0;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_server_corpus),
      cmocka_unit_test(test_wire_corpus),
      cmocka_unit_test(test_harness_edges),
      cmocka_unit_test(test_first_answer_leaves_early),
  };
  return cmocka_run_group_tests(tests, NULL, teardown);
}
