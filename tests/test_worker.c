/* End to end: a real coordinator and real shardplane-worker processes over
 * Gloo on loopback.
 *  - parity: every strategy, mixed precision off and on, N = 1..4 ranks,
 *    against the unsharded single-process run of the same global batch
 *    (sp_mlp_reference_run): loss curve and final parameters;
 *  - checkpoints: FULL, SHARDED and LOCAL written, read back by the
 *    project's reader and by an independent Python reader, loaded into a
 *    different world size;
 *  - the buffer test: same local name, different original dtypes;
 *  - a worker killed mid-step ends the others within the heartbeat timeout.
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include <jansson.h>

#include "clock.h"
#include "cast.h"
#include "mlp.h"
#include "plan.h"
#include "proc.h"
#include "safetensors.h"
#include "shardplane.h"
#include "testutil.h"

extern char **environ;

#define MLP SP_EXAMPLES "/mlp.json"
#define MLP_BUFFERS SP_TEST_DATA "/mlp_buffers.json"
#define ST_READER SP_TEST_DATA "/../interop/st_reader.py"
#define STEPS 6
#define BATCH 24
#define LR "0.05"

/* ---- a job: one coordinator and n workers ---- */

typedef struct test_job {
  sp_proc coord;
  pid_t w[8];
  int status[8];
  int n;
  char addr[64];
} test_job;

#define MAXARGS 64

/* errdir: when given, worker r's stderr goes to errdir/rank-r.err. */
static void job_start(test_job *j, const char *model, const char *const *cflags,
                      int n, const char *const *wflags, const char *errdir) {
  memset(j, 0, sizeof *j);
  j->n = n;
  char *ca[MAXARGS];
  size_t k = 0;
  char ws[16];
  snprintf(ws, sizeof ws, "%d", n);
  ca[k++] = SP_BIN_DIR "/shardplane-coordinator";
  ca[k++] = "--listen";
  ca[k++] = "127.0.0.1:0";
  ca[k++] = "--model";
  ca[k++] = (char *)model;
  ca[k++] = "--world-size";
  ca[k++] = ws;
  ca[k++] = "--quiet";
  for (size_t i = 0; cflags && cflags[i]; i++) ca[k++] = (char *)cflags[i];
  ca[k] = NULL;
  sp_diag d = {{0}};
  if (sp_proc_spawn(&j->coord, ca, false, false, "listening on 127.0.0.1:%d",
                    &d) < 0)
    fail_msg("coordinator: %s", d.msg);
  snprintf(j->addr, sizeof j->addr, "127.0.0.1:%d", j->coord.port);
  for (int r = 0; r < n; r++) {
    char *wa[MAXARGS];
    char rs[16];
    snprintf(rs, sizeof rs, "%d", r);
    size_t m = 0;
    wa[m++] = SP_BIN_DIR "/shardplane-worker";
    wa[m++] = "--coordinator";
    wa[m++] = j->addr;
    wa[m++] = "--rank";
    wa[m++] = rs;
    wa[m++] = "--log-every";
    wa[m++] = "0";
    for (size_t i = 0; wflags && wflags[i]; i++) wa[m++] = (char *)wflags[i];
    wa[m] = NULL;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    char errpath[4096];
    if (errdir) {
      snprintf(errpath, sizeof errpath, "%s/rank-%d.err", errdir, r);
      posix_spawn_file_actions_addopen(&fa, 2, errpath,
                                       O_WRONLY | O_CREAT | O_TRUNC, 0644);
    }
    int rc = posix_spawn(&j->w[r], wa[0], &fa, NULL, wa, environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) fail_msg("cannot start a worker: %s", strerror(rc));
  }
}

/* Waits up to timeout_s for every worker; returns how many exited 0. A
 * worker still running at the deadline is killed (status -1). */
static int job_wait(test_job *j, double timeout_s) {
  double end = sp_clock_s() + timeout_s;
  int ok = 0, left = j->n;
  for (int r = 0; r < j->n; r++) j->status[r] = -2;
  while (left > 0 && sp_clock_s() < end) {
    for (int r = 0; r < j->n; r++) {
      if (j->status[r] != -2) continue;
      int st;
      if (waitpid(j->w[r], &st, WNOHANG) == j->w[r]) {
        j->status[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        ok += j->status[r] == 0;
        left--;
      }
    }
    usleep(5000);
  }
  for (int r = 0; r < j->n; r++)
    if (j->status[r] == -2) {
      kill(j->w[r], SIGKILL);
      waitpid(j->w[r], NULL, 0);
      j->status[r] = -1;
    }
  sp_proc_stop(&j->coord, 5000);
  return ok;
}

/* Runs a job to completion; fails the test unless every worker exits 0. */
static void run_job(const char *model, const char *const *cflags, int n,
                    const char *const *wflags) {
  test_job j;
  job_start(&j, model, cflags, n, wflags, NULL);
  int ok = job_wait(&j, 120);
  if (ok != n) {
    for (int r = 0; r < n; r++)
      fprintf(stderr, "rank %d: status %d\n", r, j.status[r]);
    fail_msg("%d of %d workers succeeded", ok, n);
  }
}

/* ---- reading results ---- */

static double *read_losses(const char *path, size_t *n) {
  char *s = sp_test_read_file(path);
  double *v = calloc(1024, sizeof *v);
  size_t k = 0;
  char *p = s + 1;
  while (*p && *p != ']' && k < 1024) {
    char *end;
    v[k++] = strtod(p, &end);
    assert_true(end != p);
    p = end;
    while (*p == ',' || *p == ' ') p++;
  }
  free(s);
  *n = k;
  return v;
}

/* Every param of the FULL checkpoint in dir, in float64, model order. */
static double *read_full_params(const sp_model *m, const char *dir) {
  char *path = sp_test_path(dir, "full/model.safetensors");
  sp_st_file *st;
  sp_diag d = {{0}};
  if (sp_st_open(path, &st, &d) < 0) fail_msg("%s", d.msg);
  size_t total = 0;
  for (size_t p = 0; p < m->n_params; p++) total += (size_t)m->params[p].numel;
  double *out = calloc(total, sizeof *out);
  size_t off = 0;
  for (size_t p = 0; p < m->n_params; p++) {
    const sp_st_tensor *t = sp_st_find(st, m->params[p].fqn);
    if (!t) fail_msg("%s: no %s", path, m->params[p].fqn);
    assert_int_equal(t->numel, m->params[p].numel);
    void *tmp = malloc(t->nbytes + 1);
    memcpy(tmp, t->data, t->nbytes);
    assert_int_equal(sp_cast(out + off, SP_FLOAT64, tmp, t->dtype, t->numel),
                     0);
    free(tmp);
    off += (size_t)t->numel;
  }
  sp_st_free(st);
  free(path);
  return out;
}

/* The reference params (model order, each in its dtype) in float64. */
static double *ref_params_f64(const sp_model *m, const void *params) {
  size_t total = 0;
  for (size_t p = 0; p < m->n_params; p++) total += (size_t)m->params[p].numel;
  double *out = calloc(total, sizeof *out);
  const uint8_t *src = params;
  size_t off = 0;
  for (size_t p = 0; p < m->n_params; p++) {
    size_t n = (size_t)m->params[p].numel;
    assert_int_equal(sp_cast(out + off, SP_FLOAT64, src, m->params[p].dtype, n),
                     0);
    src += n * sp_dtype_size(m->params[p].dtype);
    off += n;
  }
  return out;
}

typedef struct parity_case {
  const char *strategy;
  bool mp;
  int n;
} parity_case;

static const char *const k_strategies[] = {"FULL_SHARD", "SHARD_GRAD_OP",
                                           "NO_SHARD", "HYBRID_SHARD"};

/* HYBRID_SHARD's shard group: 2 of 4 (two replicas), 1 of 2 (pure
 * replication), else all ranks. */
static int hybrid_group(int n) { return n == 4 ? 2 : n == 2 ? 1 : n; }

/* Largest relative error: max |a - b| / max |b| per run, so tiny values
 * near zero do not dominate. */
static double rel_err(const double *a, const double *b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; i++) {
    double e = fabs(a[i] - b[i]);
    if (e > num) num = e;
    if (fabs(b[i]) > den) den = fabs(b[i]);
  }
  return den > 0 ? num / den : num;
}

/* Float32: the runs differ only in summation order (per-rank partial sums,
 * the pre/post divide factors), so 1e-5 relative, as the issue asks.
 * bfloat16 parameters: each rank rounds its partial-batch gradient to bf16
 * (8 significant bits, relative spacing 2^-8 = 3.9e-3) where the single
 * process rounds the whole-batch gradient once, so the runs drift apart by
 * a fraction of one bf16 rounding step of lr * gradient per step. The bound
 * is a quarter of bf16's relative spacing, 1e-3, for the loss curve and the
 * float32 master parameters: far tighter than a bf16 ulp, so a real error
 * (a wrong cast, a missed rounding, a wrong divide factor) cannot hide in
 * it. Measured: at most 1.0e-4 (loss) and 1.6e-4 (params). */
#define TOL_F32 1e-5
#define TOL_BF16 1e-3

static void parity(const parity_case *pc) {
  char *dir = sp_test_mkdtemp();
  char *losses = sp_test_path(dir, "losses.json");
  char steps[16], group[16];
  snprintf(steps, sizeof steps, "%d", STEPS);
  snprintf(group, sizeof group, "%d", hybrid_group(pc->n));
  const char *cflags[16];
  size_t k = 0;
  cflags[k++] = "--wrap-type";
  cflags[k++] = "Linear";
  cflags[k++] = "--strategy";
  cflags[k++] = pc->strategy;
  if (strcmp(pc->strategy, "HYBRID_SHARD") == 0) {
    cflags[k++] = "--shard-group-size";
    cflags[k++] = group;
  }
  if (pc->mp) {
    cflags[k++] = "--param-dtype";
    cflags[k++] = "bfloat16";
    cflags[k++] = "--reduce-dtype";
    cflags[k++] = "float32";
  }
  cflags[k] = NULL;
  const char *wflags[] = {"--steps", steps, "--global-batch", "24", "--lr", LR,
                          "--losses", losses, "--checkpoint-dir", dir,
                          NULL};
  run_job(MLP, cflags, pc->n, wflags);

  /* the unsharded single-process run of the same global batch */
  sp_model *m;
  sp_diag d = {{0}};
  assert_int_equal(sp_model_load_file(MLP, &m, &d), 0);
  sp_job ref_job;
  sp_job_init(&ref_job);
  sp_strlist_add(&ref_job.wrap_types, "Linear");
  if (pc->mp) {
    ref_job.mp.enabled = true;
    ref_job.mp.param_dtype = SP_BFLOAT16;
    ref_job.mp.reduce_dtype = SP_FLOAT32;
  }
  double ref_losses[STEPS];
  void *ref_params = NULL;
  if (sp_mlp_reference_run(m, &ref_job, STEPS, BATCH, atof(LR), ref_losses,
                           &ref_params, NULL, &d) < 0)
    fail_msg("reference: %s", d.msg);
  size_t nl;
  double *got = read_losses(losses, &nl);
  assert_int_equal(nl, STEPS);
  double loss_err = rel_err(got, ref_losses, STEPS);
  size_t total = 0;
  for (size_t p = 0; p < m->n_params; p++) total += (size_t)m->params[p].numel;
  double *gp = read_full_params(m, dir);
  double *rp = ref_params_f64(m, ref_params);
  double param_err = rel_err(gp, rp, total);
  printf("  %-13s %-4s N=%d: loss %.6f -> %.6f, rel. error loss %.2e params "
         "%.2e\n", pc->strategy, pc->mp ? "bf16" : "f32", pc->n, got[0],
         got[STEPS - 1], loss_err, param_err);
  assert_true(got[STEPS - 1] < got[0]);
  assert_true(loss_err <= (pc->mp ? TOL_BF16 : TOL_F32));
  assert_true(param_err <= (pc->mp ? TOL_BF16 : TOL_F32));
  free(gp);
  free(rp);
  free(got);
  free(ref_params);
  sp_job_clear(&ref_job);
  sp_model_free(m);
  free(losses);
  sp_test_rmtree(dir);
  free(dir);
}

static void test_parity(void **state) {
  (void)state;
  for (size_t s = 0; s < 4; s++)
    for (int mp = 0; mp <= 1; mp++)
      for (int n = 1; n <= 4; n++) {
        parity_case pc = {k_strategies[s], mp, n};
        parity(&pc);
      }
}


/* ---- checkpoints ---- */

static sp_st_file *open_st(const char *dir, const char *name) {
  char *path = sp_test_path(dir, name);
  sp_st_file *st;
  sp_diag d = {{0}};
  if (sp_st_open(path, &st, &d) < 0) fail_msg("%s", d.msg);
  free(path);
  return st;
}

static bool have_numpy(void) {
  return access("/usr/bin/python3", X_OK) == 0 &&
         system("/usr/bin/python3 -c 'import numpy' 2>/dev/null") == 0;
}

/* The independent Python reader must load the file and see every tensor
 * with the dtype, shape and bytes our reader sees. */
static void check_with_python(const char *path) {
  char cmd[4096];
  snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s '%s' --hex-limit 100000000",
           ST_READER, path);
  FILE *p = popen(cmd, "r");
  assert_non_null(p);
  size_t cap = 1 << 20, len = 0;
  char *out = malloc(cap);
  size_t n;
  while ((n = fread(out + len, 1, cap - len - 1, p)) > 0) {
    len += n;
    if (len + 1 == cap) out = realloc(out, cap *= 2);
  }
  out[len] = '\0';
  int st = pclose(p);
  if (st != 0) fail_msg("st_reader.py %s: status %d", path, st);
  json_error_t err;
  json_t *root = json_loads(out, 0, &err);
  if (!root) fail_msg("st_reader.py output: %s", err.text);
  json_t *tensors = json_object_get(root, "tensors");
  sp_st_file *f;
  sp_diag d = {{0}};
  assert_int_equal(sp_st_open(path, &f, &d), 0);
  assert_int_equal(json_object_size(tensors), sp_st_tensor_count(f));
  for (size_t i = 0; i < sp_st_tensor_count(f); i++) {
    const sp_st_tensor *t = sp_st_tensor_at(f, i);
    json_t *pt = json_object_get(tensors, t->name);
    if (!pt) fail_msg("%s: Python did not see %s", path, t->name);
    assert_string_equal(json_string_value(json_object_get(pt, "dtype")),
                        sp_dtype_st_name(t->dtype));
    json_t *shape = json_object_get(pt, "shape");
    assert_int_equal(json_array_size(shape), t->ndim);
    for (size_t k = 0; k < t->ndim; k++)
      assert_int_equal(json_integer_value(json_array_get(shape, k)),
                       t->shape[k]);
    const char *hex = json_string_value(json_object_get(pt, "hex"));
    assert_non_null(hex);
    assert_int_equal(strlen(hex), 2 * t->nbytes);
    for (size_t k = 0; k < t->nbytes; k++) {
      unsigned v;
      sscanf(hex + 2 * k, "%2x", &v);
      if (v != t->data[k]) fail_msg("%s: %s byte %zu differs", path, t->name, k);
    }
  }
  sp_st_free(f);
  json_decref(root);
  free(out);
}

static const char *const k_buffer_job[] = {
    "--wrap-type", "Linear", "--param-dtype", "bfloat16", "--reduce-dtype",
    "float32", "--buffer-dtype", "bfloat16", NULL};

/* Element i of a tensor as a double. */
static double elem(const sp_st_tensor *t, size_t i) {
  double v;
  uint8_t tmp[8];
  size_t es = sp_dtype_size(t->dtype);
  memcpy(tmp, t->data + i * es, es);
  if (sp_dtype_is_floating(t->dtype)) {
    assert_int_equal(sp_cast(&v, SP_FLOAT64, tmp, t->dtype, 1), 0);
    return v;
  }
  int64_t x = 0;
  if (t->dtype == SP_INT64) memcpy(&x, tmp, 8);
  else if (t->dtype == SP_INT32) { int32_t y; memcpy(&y, tmp, 4); x = y; }
  else x = tmp[0];
  return (double)x;
}

/* The buffer test of the seed: buffers named running_mean in float64,
 * float16 and bfloat16 submodules, counters in int64 and int32, bools;
 * trained with buffer_dtype bfloat16. */
static void test_buffers_and_checkpoints(void **state) {
  (void)state;
  if (!have_numpy()) {
    printf("  (the Python reader part needs /usr/bin/python3 with numpy)\n");
  }
  char *dir = sp_test_mkdtemp();
  const char *wflags[] = {"--steps", "4", "--global-batch", "24",
                          "--checkpoint-dir", dir, "--checkpoint", "full",
                          "--checkpoint", "sharded", "--checkpoint", "local",
                          NULL};
  run_job(MLP_BUFFERS, k_buffer_job, 3, wflags);

  sp_model *m;
  sp_diag d = {{0}};
  assert_int_equal(sp_model_load_file(MLP_BUFFERS, &m, &d), 0);
  sp_job job;
  sp_job_init(&job);
  sp_strlist_add(&job.wrap_types, "Linear");
  job.mp.enabled = true;
  job.mp.param_dtype = SP_BFLOAT16;
  job.mp.reduce_dtype = SP_FLOAT32;
  job.mp.buffer_dtype = SP_BFLOAT16;
  void *ref_bufs = NULL;
  assert_int_equal(sp_mlp_reference_run(m, &job, 4, 24, 0.05, NULL, NULL,
                                        &ref_bufs, &d), 0);
  sp_plan *plan;
  job.world_size = 3;
  assert_int_equal(sp_plan_build(m, &job, &plan, &d), 0);

  sp_st_file *full = open_st(dir, "full/model.safetensors");
  sp_st_file *rank0 = open_st(dir, "sharded/rank-0-of-3.safetensors");
  sp_st_file *local = open_st(dir, "local/local-1-of-3.safetensors");
  const uint8_t *ref = ref_bufs;
  double worst = 0;
  for (size_t b = 0; b < m->n_buffers; b++) {
    const sp_tensor_spec *bs = &m->buffers[b];
    sp_dtype compute = plan->buffers[b].compute_dtype;
    const sp_st_tensor *tf = sp_st_find(full, bs->fqn);
    const sp_st_tensor *ts = sp_st_find(rank0, bs->fqn);
    const sp_st_tensor *tl = sp_st_find(local, bs->fqn);
    printf("  %-30s original %-8s compute %-8s FULL %-8s SHARDED %-8s "
           "LOCAL %s\n", bs->fqn, sp_dtype_name(bs->dtype),
           sp_dtype_name(compute), tf ? sp_dtype_name(tf->dtype) : "-",
           ts ? sp_dtype_name(ts->dtype) : "-",
           tl ? sp_dtype_name(tl->dtype) : "-");
    size_t n = (size_t)bs->numel;
    const uint8_t *rb = ref;
    ref += n * sp_dtype_size(compute);
    if (!bs->flag) {
      /* non-persistent: in no state dict */
      assert_null(tf);
      assert_null(ts);
      assert_null(tl);
      continue;
    }
    assert_non_null(tf);
    assert_non_null(ts);
    assert_non_null(tl);
    /* FULL and SHARDED restore the original dtype; LOCAL keeps the compute
     * dtype; integer and bool buffers never change */
    assert_int_equal(tf->dtype, bs->dtype);
    assert_int_equal(ts->dtype, bs->dtype);
    assert_int_equal(tl->dtype, compute);
    if (!sp_dtype_is_floating(bs->dtype)) {
      assert_int_equal(compute, bs->dtype);
      double want = strstr(bs->fqn, "seen") ? 1 : 4;
      for (size_t i = 0; i < n; i++) {
        assert_true(elem(tf, i) == want);
        assert_true(elem(tl, i) == want);
      }
      continue;
    }
    assert_int_equal(compute, SP_BFLOAT16);
    double diff = 0, scale = 0;
    for (size_t i = 0; i < n; i++) {
      double v = elem(tf, i), r;
      assert_int_equal(sp_cast(&r, SP_FLOAT64, rb + 2 * i, SP_BFLOAT16, 1), 0);
      /* computed in bfloat16: the restored value is a bf16 value */
      uint16_t h;
      double back;
      sp_cast(&h, SP_BFLOAT16, &v, SP_FLOAT64, 1);
      sp_cast(&back, SP_FLOAT64, &h, SP_BFLOAT16, 1);
      assert_true(back == v);
      assert_true(elem(ts, i) == v);
      assert_true(elem(tl, i) == v);
      if (fabs(v - r) > diff) diff = fabs(v - r);
      if (fabs(r) > scale) scale = fabs(r);
    }
    /* against the single process: the batch means come from activations
     * that differ at the parity bound (bf16 gradients rounded per rank)
     * and are summed in another order, then rounded to bf16: within one
     * bf16 step (2^-8 relative) of the tensor's largest value, twice */
    printf("  %-30s max |sharded - single process| = %.3g (%.2g of its "
           "largest value)\n", bs->fqn, diff, scale > 0 ? diff / scale : 0);
    if (scale > 0 && diff / scale > worst) worst = diff / scale;
    assert_true(diff <= 0x1p-7 * scale);
  }
  /* SHARDED: rank 0 holds the buffers, the others only parameter chunks */
  sp_st_file *rank2 = open_st(dir, "sharded/rank-2-of-3.safetensors");
  for (size_t b = 0; b < m->n_buffers; b++)
    assert_null(sp_st_find(rank2, m->buffers[b].fqn));
  sp_st_free(rank2);
  sp_st_free(full);
  sp_st_free(rank0);
  sp_st_free(local);

  if (have_numpy()) {
    const char *files[] = {"full/model.safetensors",
                           "sharded/rank-0-of-3.safetensors",
                           "sharded/rank-1-of-3.safetensors",
                           "sharded/rank-2-of-3.safetensors",
                           "local/local-0-of-3.safetensors",
                           "local/local-1-of-3.safetensors",
                           "local/local-2-of-3.safetensors"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
      char *path = sp_test_path(dir, files[i]);
      check_with_python(path);
      free(path);
    }
  }
  free(ref_bufs);
  sp_plan_free(plan);
  sp_job_clear(&job);
  sp_model_free(m);
  sp_test_rmtree(dir);
  free(dir);
}

/* Every tensor of two safetensors files byte-equal. */
static void same_tensors(const char *a_dir, const char *a, const char *b_dir,
                         const char *b) {
  sp_st_file *fa = open_st(a_dir, a), *fb = open_st(b_dir, b);
  assert_int_equal(sp_st_tensor_count(fa), sp_st_tensor_count(fb));
  for (size_t i = 0; i < sp_st_tensor_count(fa); i++) {
    const sp_st_tensor *ta = sp_st_tensor_at(fa, i);
    const sp_st_tensor *tb = sp_st_find(fb, ta->name);
    if (!tb) fail_msg("%s/%s: no %s", b_dir, b, ta->name);
    assert_int_equal(ta->dtype, tb->dtype);
    assert_int_equal(ta->nbytes, tb->nbytes);
    if (memcmp(ta->data, tb->data, ta->nbytes) != 0)
      fail_msg("%s differs between %s/%s and %s/%s", ta->name, a_dir, a,
               b_dir, b);
  }
  sp_st_free(fa);
  sp_st_free(fb);
}

/* FULL and SHARDED load into another world size, LOCAL into the same plan
 * only: load, save FULL without training, compare with the original. */
static void test_checkpoint_reload(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *src = sp_test_path(dir, "src");
  const char *wflags[] = {"--steps", "3", "--checkpoint-dir", src,
                          "--checkpoint", "full", "--checkpoint", "sharded",
                          "--checkpoint", "local", NULL};
  run_job(MLP_BUFFERS, k_buffer_job, 2, wflags);
  struct {
    const char *kind;
    int n;
  } cases[] = {{"full", 3}, {"sharded", 3}, {"sharded", 4}, {"local", 2}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char name[64];
    snprintf(name, sizeof name, "%s-%d", cases[i].kind, cases[i].n);
    char *dst = sp_test_path(dir, name);
    char *from = sp_test_path(src, cases[i].kind);
    const char *lf[] = {"--steps", "0", "--load", from, "--load-kind",
                        cases[i].kind, "--checkpoint-dir", dst,
                        "--checkpoint", "full", NULL};
    run_job(MLP_BUFFERS, k_buffer_job, cases[i].n, lf);
    same_tensors(src, "full/model.safetensors", dst, "full/model.safetensors");
    printf("  %s checkpoint of 2 ranks loaded into %d ranks: every tensor "
           "equal\n", cases[i].kind, cases[i].n);
    free(from);
    free(dst);
  }
  /* LOCAL into another world size: refused, naming the plan */
  {
    test_job j;
    char *from = sp_test_path(src, "local");
    const char *lf[] = {"--steps", "0", "--load", from, "--load-kind",
                        "local", "--checkpoint", "none", NULL};
    job_start(&j, MLP_BUFFERS, k_buffer_job, 3, lf, NULL);
    assert_int_equal(job_wait(&j, 60), 0);
    for (int r = 0; r < 3; r++) assert_int_equal(j.status[r], 1);
    free(from);
  }
  free(src);
  sp_test_rmtree(dir);
  free(dir);
}

/* Storage handled as a device's ("cpu-staged": host memory, but every
 * host access staged as on a GPU): training, checkpoints and loads must
 * give exactly the plain CPU run's files, so the staging paths a GPU
 * takes (initialisation, FULL/SHARDED/LOCAL writes, loads) are checked
 * on a machine without one. */
static void test_staged_storage(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *plain = sp_test_path(dir, "plain"), *staged = sp_test_path(dir,
                                                                   "staged");
  const char *wp[] = {"--steps", "3", "--checkpoint-dir", plain,
                      "--checkpoint", "full", "--checkpoint", "sharded",
                      "--checkpoint", "local", NULL};
  run_job(MLP_BUFFERS, k_buffer_job, 2, wp);
  const char *ws[] = {"--device", "cpu-staged", "--steps", "3",
                      "--checkpoint-dir", staged, "--checkpoint", "full",
                      "--checkpoint", "sharded", "--checkpoint", "local",
                      NULL};
  run_job(MLP_BUFFERS, k_buffer_job, 2, ws);
  const char *files[] = {"full/model.safetensors",
                         "sharded/rank-0-of-2.safetensors",
                         "sharded/rank-1-of-2.safetensors",
                         "local/local-0-of-2.safetensors",
                         "local/local-1-of-2.safetensors"};
  for (size_t i = 0; i < sizeof files / sizeof files[0]; i++)
    same_tensors(plain, files[i], staged, files[i]);
  /* loads into staged storage: FULL into 3 ranks, LOCAL into 2 */
  struct {
    const char *kind;
    const char *n;
    int ranks;
  } cases[] = {{"full", "full-3", 3}, {"sharded", "sharded-3", 3},
               {"local", "local-2", 2}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char *from = sp_test_path(plain, cases[i].kind);
    char *dst = sp_test_path(dir, cases[i].n);
    const char *lf[] = {"--device", "cpu-staged", "--steps", "0", "--load",
                        from, "--load-kind", cases[i].kind,
                        "--checkpoint-dir", dst, "--checkpoint", "full",
                        NULL};
    run_job(MLP_BUFFERS, k_buffer_job, cases[i].ranks, lf);
    same_tensors(plain, "full/model.safetensors", dst,
                 "full/model.safetensors");
    free(from);
    free(dst);
  }
  printf("  cpu-staged storage: checkpoints byte-equal to the plain CPU "
         "run's; FULL, SHARDED and LOCAL loads round-trip\n");
  free(plain);
  free(staged);
  sp_test_rmtree(dir);
  free(dir);
}

/* Runs argv with stderr into a string; returns the exit status. */
static int run_capture(char *const argv[], char **err) {
  char *dir = sp_test_mkdtemp();
  char *path = sp_test_path(dir, "stderr");
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 2, path, O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  pid_t pid;
  int rc = posix_spawn(&pid, argv[0], &fa, NULL, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) fail_msg("cannot start %s: %s", argv[0], strerror(rc));
  int st;
  waitpid(pid, &st, 0);
  *err = sp_test_read_file(path);
  free(path);
  sp_test_rmtree(dir);
  free(dir);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* --device errors are messages and exit codes, never crashes: a malformed
 * name is bad usage (2); a GPU that is not there (or a build without
 * CUDA) fails the rank (1) before it attaches. */
static void test_device_errors(void **state) {
  (void)state;
  char *err;
  char *bad[] = {SP_BIN_DIR "/shardplane-worker", "--coordinator",
                 "127.0.0.1:1", "--rank", "0", "--device", "gpu0", NULL};
  assert_int_equal(run_capture(bad, &err), 2);
  assert_non_null(strstr(err, "--device gpu0: expected cpu or cuda:N"));
  free(err);
  int n = 0;
  sp_diag d = {{0}};
  assert_int_equal(sp_device_cuda_count(&n, &d), 0);
  if (n > 0) {
    printf("  (a CUDA device is present: the no-device messages are not "
           "checked)\n");
    return;
  }
  char *nodev[] = {SP_BIN_DIR "/shardplane-worker", "--coordinator",
                   "127.0.0.1:1", "--rank", "0", "--device", "cuda:0", NULL};
  assert_int_equal(run_capture(nodev, &err), 1);
  printf("  %s", err);
  assert_true(strstr(err, "--device cuda:0: no CUDA device") ||
              strstr(err, "built without CUDA"));
  free(err);
  char *run[] = {SP_BIN_DIR "/shardplane", "run", "--nproc", "1", "--model",
                 MLP, "--device", "cuda", NULL};
  assert_int_equal(run_capture(run, &err), 1);
  printf("  %s", err);
  assert_non_null(strstr(err, "--device cuda: no CUDA device"));
  free(err);
}

/* A worker killed mid-step: the others must fail within the heartbeat
 * timeout with a message naming what happened, and nothing may hang. */
static void test_killed_worker(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  const char *cflags[] = {"--wrap-type", "Linear", "--heartbeat-timeout-ms",
                          "1000", NULL};
  const char *wflags[] = {"--steps", "100000000", "--checkpoint", "none",
                          "--comm-timeout-ms", "30000", NULL};
  test_job j;
  job_start(&j, MLP, cflags, 3, wflags, dir);
  /* let them attach and train a while */
  usleep(1500 * 1000);
  for (int r = 0; r < 3; r++) {
    int st;
    if (waitpid(j.w[r], &st, WNOHANG) == j.w[r])
      fail_msg("rank %d ended before the kill", r);
  }
  double t0 = sp_clock_s();
  kill(j.w[1], SIGKILL);
  int ok = job_wait(&j, 10);
  double took = sp_clock_s() - t0;
  printf("  rank 1 killed: the other ranks ended after %.0f ms (heartbeat "
         "timeout 1000 ms)\n", took * 1000);
  assert_int_equal(ok, 0);
  assert_int_equal(j.status[1], 128 + SIGKILL);
  for (int r = 0; r < 3; r += 2) {
    assert_int_equal(j.status[r], 1);
    char name[32];
    snprintf(name, sizeof name, "rank-%d.err", r);
    char *path = sp_test_path(dir, name);
    char *err = sp_test_read_file(path);
    printf("  rank %d: %s", r, err);
    char want[32];
    snprintf(want, sizeof want, "rank %d", r);
    assert_non_null(strstr(err, want));
    free(err);
    free(path);
  }
  assert_true(took < 1.0 + 1.0);
  sp_test_rmtree(dir);
  free(dir);
}

/* A spec the worker cannot compute (ResNet-50: convolutions, BatchNorm
 * kept in full precision under bf16 mixed precision) runs the synthetic-
 * gradient cycle: the same unshard / reduce / cast schedule, and a FULL
 * checkpoint with every FQN in its original dtype. */
static void test_synthetic_resnet50(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  const char *cflags[] = {"--wrap-type", "Bottleneck", "--param-dtype",
                          "bfloat16", NULL};
  const char *wflags[] = {"--steps", "2", "--checkpoint-dir", dir, NULL};
  run_job(SP_EXAMPLES "/models/resnet50.json", cflags, 2, wflags);
  sp_model *m;
  sp_diag d = {{0}};
  assert_int_equal(
      sp_model_load_file(SP_EXAMPLES "/models/resnet50.json", &m, &d), 0);
  sp_st_file *full = open_st(dir, "full/model.safetensors");
  size_t want = m->n_params;
  for (size_t b = 0; b < m->n_buffers; b++) want += m->buffers[b].flag;
  assert_int_equal(sp_st_tensor_count(full), want);
  for (size_t p = 0; p < m->n_params; p++) {
    const sp_st_tensor *t = sp_st_find(full, m->params[p].fqn);
    assert_non_null(t);
    assert_int_equal(t->dtype, m->params[p].dtype);
    assert_int_equal(t->numel, m->params[p].numel);
  }
  for (size_t b = 0; b < m->n_buffers; b++) {
    const sp_st_tensor *t = sp_st_find(full, m->buffers[b].fqn);
    if (!m->buffers[b].flag) {
      assert_null(t);
      continue;
    }
    assert_non_null(t);
    assert_int_equal(t->dtype, m->buffers[b].dtype);
  }
  printf("  resnet50, 2 ranks, synthetic gradients: %zu tensors in the FULL "
         "checkpoint, each in its original dtype\n", want);
  sp_st_free(full);
  sp_model_free(m);
  sp_test_rmtree(dir);
  free(dir);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_parity),
      cmocka_unit_test(test_buffers_and_checkpoints),
      cmocka_unit_test(test_checkpoint_reload),
      cmocka_unit_test(test_staged_storage),
      cmocka_unit_test(test_device_errors),
      cmocka_unit_test(test_killed_worker),
      cmocka_unit_test(test_synthetic_resnet50),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
