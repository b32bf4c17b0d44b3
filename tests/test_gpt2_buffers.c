/* Buffer dtypes keyed by FQN on a transformer: a GPT-2 whose blocks carry
 * same-named buffers of different dtypes (tests/data/gpt2_buffers.json:
 * attn.bias bool in block 0 and float32 in block 1, attn.masked_bias
 * float32 and float16, a float64 ln_2.running_mean, a non-persistent
 * float32 attn.scratch) trained by a 2-rank job with param and buffer
 * dtype bfloat16 (the floating buffers computed in bfloat16, the masks
 * read from them). Its FULL and SHARDED checkpoints, read back by the
 * independent safetensors reader (tests/interop/st_reader.py, numpy),
 * hold every persistent buffer in its original dtype, with the values the
 * bfloat16 computation left (the mask 1 and 0, -1e4 as bfloat16 rounds it,
 * -9984), and the non-persistent one nowhere: a registry keyed by local
 * name ("bias", "masked_bias") would give one block the other's dtype. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <jansson.h>
#include <unistd.h>

#include "plan/model.h"
#include "support/job_fixture.h"
#include "support/testutil.h"

#define PYTHON "/usr/bin/python3"
#define ST_READER SP_TEST_DATA "/../interop/st_reader.py"
#define MODEL SP_TEST_DATA "/gpt2_buffers.json"

/* The reader's view of a file: {"tensors": {name: {"dtype", "values"}}} */
static json_t *read_back(const char *path) {
  char cmd[8192];
  snprintf(cmd, sizeof cmd, "'%s' '%s' '%s' --hex-limit 0", PYTHON, ST_READER,
           path);
  char *buf;
  int st = sp_test_shell(cmd, &buf);
  if (st != 0) fail_msg("%s: the reader failed (status %d)", path, st);
  json_error_t je;
  json_t *j = json_loads(buf, 0, &je);
  if (j == NULL) fail_msg("%s: reader output: %s", path, je.text);
  free(buf);
  json_t *t = json_object_get(j, "tensors");
  assert_non_null(t);
  json_incref(t);
  json_decref(j);
  return t;
}

static const char *st_dtype(sp_dtype dt) {
  switch (dt) {
    case SP_BOOL: return "BOOL";
    case SP_FLOAT32: return "F32";
    case SP_FLOAT16: return "F16";
    case SP_FLOAT64: return "F64";
    default: return "?";
  }
}

/* Element i of a reader value list as a double (floats come as strings). */
static double value(json_t *values, size_t i) {
  json_t *v = json_array_get(values, i);
  if (json_is_boolean(v)) return json_is_true(v) ? 1 : 0;
  if (json_is_string(v)) return strtod(json_string_value(v), NULL);
  return json_number_value(v);
}

/* The values this buffer must hold after the bfloat16 computation. */
static double expected(const sp_tensor_spec *b, size_t i) {
  if (strcmp(b->local_name, "bias") == 0) {
    size_t T = (size_t)b->shape[b->ndim - 1];
    return i % T <= (i / T) % T ? 1 : 0; /* on or below the diagonal */
  }
  if (strcmp(b->local_name, "masked_bias") == 0) return -9984; /* bf16(-1e4) */
  return 0;
}

static void check_file(const sp_model *m, json_t *t, bool sharded,
                       const char *what) {
  for (size_t k = 0; k < m->n_buffers; k++) {
    const sp_tensor_spec *b = &m->buffers[k];
    json_t *e = json_object_get(t, b->fqn);
    if (!b->flag) {
      if (e) fail_msg("%s: non-persistent %s is there", what, b->fqn);
      continue;
    }
    if (e == NULL && sharded) continue; /* in another rank's file */
    if (e == NULL) fail_msg("%s: %s missing", what, b->fqn);
    const char *dt = json_string_value(json_object_get(e, "dtype"));
    if (strcmp(dt, st_dtype(b->dtype)) != 0)
      fail_msg("%s: %s is %s, its original dtype is %s", what, b->fqn, dt,
               sp_dtype_name(b->dtype));
    json_t *vals = json_object_get(e, "values");
    assert_int_equal(json_array_size(vals), (size_t)b->numel);
    for (size_t i = 0; i < (size_t)b->numel; i++)
      if (value(vals, i) != expected(b, i))
        fail_msg("%s: %s[%zu] = %g, expected %g", what, b->fqn, i,
                 value(vals, i), expected(b, i));
    printf("%-8s %-36s %-4s ok\n", what, b->fqn, dt);
  }
}

static void test_buffers(void **state) {
  (void)state;
  sp_model *m = NULL;
  sp_diag d = {""};
  assert_int_equal(sp_model_load_file(MODEL, &m, &d), 0);
  char *dir = sp_test_path(sp_test_dir, "ck");
  /* a corpus of its own: the test does not depend on the system's texts */
  char *corpus = sp_test_path(sp_test_dir, "corpus.txt");
  static char text[20000];
  for (size_t i = 0; i < sizeof text; i++)
    text[i] = "the unit gathers its shards\n"[i % 28];
  sp_test_write_file(corpus, text, sizeof text);
  const char *cf[] = {"--wrap-type",    "GPT2Block",      "--param-dtype",
                      "bfloat16",       "--reduce-dtype", "float32",
                      "--buffer-dtype", "bfloat16",       NULL};
  const char *wf[] = {"--steps",
                      "3",
                      "--global-batch",
                      "4",
                      "--optimizer",
                      "adamw",
                      "--lr",
                      "1e-3",
                      "--eval-every",
                      "0",
                      "--checkpoint",
                      "full",
                      "--checkpoint",
                      "sharded",
                      "--checkpoint-dir",
                      dir,
                      "--data",
                      corpus,
                      NULL};
  sp_tjob_run(MODEL, cf, 2, wf, 120);
  char path[4096];
  snprintf(path, sizeof path, "%s/full/model.safetensors", dir);
  json_t *full = read_back(path);
  check_file(m, full, false, "FULL");
  /* SHARDED: every persistent buffer in some rank's file */
  json_t *sh[2];
  for (int r = 0; r < 2; r++) {
    snprintf(path, sizeof path, "%s/sharded/rank-%d-of-2.safetensors", dir, r);
    sh[r] = read_back(path);
    check_file(m, sh[r], true, r ? "SHARDED1" : "SHARDED0");
  }
  for (size_t k = 0; k < m->n_buffers; k++)
    if (m->buffers[k].flag && !json_object_get(sh[0], m->buffers[k].fqn) &&
        !json_object_get(sh[1], m->buffers[k].fqn))
      fail_msg("SHARDED: %s in no rank's file", m->buffers[k].fqn);
  json_decref(sh[0]);
  json_decref(sh[1]);
  json_decref(full);
  free(corpus);
  free(dir);
  sp_model_free(m);
}

int main(void) {
  if (access(PYTHON, X_OK) != 0 ||
      system("'" PYTHON "' -c 'import numpy' >/dev/null 2>&1") != 0)
    return sp_test_skip("numpy is not available to " PYTHON
                        " (Debian: python3-numpy)");
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_buffers),
  };
  return cmocka_run_group_tests(tests, sp_test_dir_setup, sp_test_dir_teardown);
}
