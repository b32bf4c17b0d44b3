#include "job_fixture.h"

#include <fcntl.h>
#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include <cmocka.h>

#include "cast/cast.h"
#include "base/clock.h"
#include "plan/job.h"
#include "worker/mlp.h"
#include "mlp_reference.h"
#include "worker/train_flags.h"
#include "plan/plan.h"
#include "testutil.h"

extern char **environ;

/* ---- a job: one coordinator and n workers ---- */

#define MAXARGS 64

/* Appends the NULL-terminated flags (or none: NULL) to argv, which holds k
 * entries, and ends it with NULL. */
static void add_flags(const char **argv, size_t k, const char *const *flags) {
  for (size_t i = 0; flags && flags[i]; i++) {
    if (k + 1 >= MAXARGS) fail_msg("more than %d arguments", MAXARGS - 1);
    argv[k++] = flags[i];
  }
  argv[k] = NULL;
}

/* The job's coordinator on `listen`, its port into j. */
static void spawn_coord(sp_tjob *j, const char *model,
                        const char *const *cflags, const char *listen) {
  char ws[16];
  snprintf(ws, sizeof ws, "%d", j->n);
  const char *ca[MAXARGS] = {SP_BIN_DIR "/shardplane-coordinator",
                             "--listen",
                             listen,
                             "--model",
                             model,
                             "--world-size",
                             ws,
                             "--quiet",
                             "--insecure",
                             "--token-file",
                             j->auth.token_file};
  add_flags(ca, 11, cflags);
  sp_diag d = {{0}};
  if (sp_proc_spawn(&j->coord, (char *const *)ca, false, false,
                    "listening on 127.0.0.1:%d", &d) < 0)
    fail_msg("coordinator: %s", d.msg);
  snprintf(j->addr, sizeof j->addr, "127.0.0.1:%d", j->coord.port);
}

void sp_tjob_restart_coord(sp_tjob *j, const char *model,
                           const char *const *cflags) {
  if (j->coord.pid > 0) {
    kill(j->coord.pid, SIGKILL);
    waitpid(j->coord.pid, NULL, 0);
    j->coord.pid = 0;
  }
  char listen[64];
  snprintf(listen, sizeof listen, "127.0.0.1:%d", j->coord.port);
  int port = j->coord.port;
  spawn_coord(j, model, cflags, listen);
  assert_int_equal(j->coord.port, port);
}

void sp_tjob_start(sp_tjob *j, const char *model, const char *const *cflags,
                   int n, const char *const *wflags, const char *errdir) {
  if (n < 1 || n > SP_TJOB_MAX_RANKS)
    fail_msg("%d workers: 1 to %d", n, SP_TJOB_MAX_RANKS);
  memset(j, 0, sizeof *j);
  j->n = n;
  sp_tauth_make(&j->auth);
  spawn_coord(j, model, cflags, "127.0.0.1:0");
  for (int r = 0; r < n; r++) {
    char rs[16];
    snprintf(rs, sizeof rs, "%d", r);
    const char *wa[MAXARGS] = {SP_BIN_DIR "/shardplane-worker",
                               "--coordinator",
                               j->addr,
                               "--rank",
                               rs,
                               "--log-every",
                               "0",
                               "--insecure",
                               "--token-file",
                               j->auth.file[SP_ROLE_WORKER]};
    add_flags(wa, 10, wflags);
    /* "cuda:%r": each rank its own GPU (NCCL refuses two on one) */
    char dev[24];
    snprintf(dev, sizeof dev, "cuda:%d", r);
    for (size_t i = 10; wa[i]; i++)
      if (strcmp(wa[i], SP_TJOB_RANK_GPU) == 0) wa[i] = dev;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    char errpath[4096];
    if (errdir) {
      snprintf(errpath, sizeof errpath, "%s/rank-%d.err", errdir, r);
      posix_spawn_file_actions_addopen(&fa, 2, errpath,
                                       O_WRONLY | O_CREAT | O_TRUNC, 0644);
    }
    int rc =
        posix_spawn(&j->w[r], wa[0], &fa, NULL, (char *const *)wa, environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) fail_msg("cannot start a worker: %s", strerror(rc));
  }
}

/* Waiting for a job's workers, in steps: wait_begin once, wait_reap until
 * it says none is left (or a deadline passes), then wait_end. */
static void wait_begin(sp_tjob *j) {
  for (int r = 0; r < j->n; r++) j->status[r] = -2; /* still running */
}

/* Reaps the workers that have exited; returns how many are still running. */
static int wait_reap(sp_tjob *j) {
  int left = 0;
  for (int r = 0; r < j->n; r++) {
    if (j->status[r] != -2) continue;
    int st;
    if (waitpid(j->w[r], &st, WNOHANG) == j->w[r])
      j->status[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    else
      left++;
  }
  return left;
}

/* Kills the workers still running, stops the coordinator; returns how many
 * workers exited 0. */
static int wait_end(sp_tjob *j) {
  int ok = 0;
  for (int r = 0; r < j->n; r++) {
    if (j->status[r] == -2) {
      kill(j->w[r], SIGKILL);
      waitpid(j->w[r], NULL, 0);
      j->status[r] = -1;
    }
    ok += j->status[r] == 0;
  }
  sp_proc_stop(&j->coord, 5000);
  sp_tauth_free(&j->auth);
  return ok;
}

int sp_tjob_wait(sp_tjob *j, double timeout_s) {
  double end = sp_clock_s() + timeout_s;
  wait_begin(j);
  while (wait_reap(j) > 0 && sp_clock_s() < end) sp_test_sleep_ms(5);
  return wait_end(j);
}

void sp_tjob_run(const char *model, const char *const *cflags, int n,
                 const char *const *wflags, double timeout_s) {
  sp_tjob j;
  sp_tjob_start(&j, model, cflags, n, wflags, NULL);
  int ok = sp_tjob_wait(&j, timeout_s);
  if (ok != n) {
    for (int r = 0; r < n; r++)
      fprintf(stderr, "rank %d: status %d\n", r, j.status[r]);
    fail_msg("%d of %d workers succeeded", ok, n);
  }
}

/* ---- reading results ---- */

double *sp_tjob_read_losses(const char *path, size_t *n) {
  char *s = sp_test_read_file(path);
  double *v = calloc(1024, sizeof *v);
  assert_non_null(v);
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

sp_safetensors_file *sp_tjob_open_st(const char *dir, const char *name) {
  char *path = sp_test_path(dir, name);
  sp_safetensors_file *st;
  sp_diag d = {{0}};
  if (sp_safetensors_open(path, &st, &d) < 0) fail_msg("%s", d.msg);
  free(path);
  return st;
}

double sp_tjob_elem(const sp_safetensors_tensor *t, size_t i) {
  uint8_t tmp[8];
  size_t es = sp_dtype_size(t->dtype);
  memcpy(tmp, t->data + i * es, es);
  if (sp_dtype_is_floating(t->dtype)) {
    double v;
    assert_int_equal(sp_cast(&v, SP_FLOAT64, tmp, t->dtype, 1), 0);
    return v;
  }
  int64_t x = 0;
  if (t->dtype == SP_INT64) {
    memcpy(&x, tmp, 8);
  } else if (t->dtype == SP_INT32) {
    int32_t y;
    memcpy(&y, tmp, 4);
    x = y;
  } else {
    x = tmp[0];
  }
  return (double)x;
}

void sp_tjob_same_tensors(const char *a_dir, const char *a, const char *b_dir,
                          const char *b) {
  sp_safetensors_file *fa = sp_tjob_open_st(a_dir, a),
                      *fb = sp_tjob_open_st(b_dir, b);
  assert_int_equal(sp_safetensors_tensor_count(fa),
                   sp_safetensors_tensor_count(fb));
  for (size_t i = 0; i < sp_safetensors_tensor_count(fa); i++) {
    const sp_safetensors_tensor *ta = sp_safetensors_tensor_at(fa, i);
    const sp_safetensors_tensor *tb = sp_safetensors_find(fb, ta->name);
    if (!tb) fail_msg("%s/%s: no %s", b_dir, b, ta->name);
    assert_int_equal(ta->dtype, tb->dtype);
    assert_int_equal(ta->nbytes, tb->nbytes);
    if (memcmp(ta->data, tb->data, ta->nbytes) != 0)
      fail_msg("%s differs between %s/%s and %s/%s", ta->name, a_dir, a, b_dir,
               b);
  }
  sp_safetensors_close(fa);
  sp_safetensors_close(fb);
}

/* ---- against the reference run ---- */

sp_tjob_errors *g_parity_worst;

static size_t total_numel(const sp_model *m) {
  size_t total = 0;
  for (size_t p = 0; p < m->n_params; p++) total += (size_t)m->params[p].numel;
  return total;
}

/* Every param of the FULL checkpoint in dir, in float64, model order. */
static double *read_full_params(const sp_model *m, const char *dir) {
  sp_safetensors_file *st = sp_tjob_open_st(dir, "full/model.safetensors");
  double *out = calloc(total_numel(m) + 1, sizeof *out);
  assert_non_null(out);
  size_t off = 0;
  for (size_t p = 0; p < m->n_params; p++) {
    const sp_safetensors_tensor *t = sp_safetensors_find(st, m->params[p].fqn);
    if (!t) fail_msg("FULL checkpoint in %s: no %s", dir, m->params[p].fqn);
    assert_int_equal(t->numel, m->params[p].numel);
    assert_int_equal(t->dtype, m->params[p].dtype);
    void *tmp = malloc(t->nbytes + 1);
    assert_non_null(tmp);
    memcpy(tmp, t->data, t->nbytes);
    assert_int_equal(sp_cast(out + off, SP_FLOAT64, tmp, t->dtype, t->numel),
                     0);
    free(tmp);
    off += (size_t)t->numel;
  }
  sp_safetensors_close(st);
  return out;
}

/* The reference params (model order, each in its dtype) in float64. */
static double *ref_params_f64(const sp_model *m, const void *params) {
  double *out = calloc(total_numel(m) + 1, sizeof *out);
  assert_non_null(out);
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

/* max |a - b| / max |b|, so values near zero do not dominate */
/* ||a - b|| / ||b||: the error of the bulk, where rel_err's largest
 * element may be one outlier */
static double rms_err(const double *a, const double *b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; i++) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

static double rel_err(const double *a, const double *b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; i++) {
    double e = fabs(a[i] - b[i]);
    if (!(e <= num)) num = e; /* a NaN makes the error NaN */
    if (fabs(b[i]) > den) den = fabs(b[i]);
  }
  return den > 0 ? num / den : num;
}

/* The job the reference runs take (sp_job_clear it): wrap type Linear;
 * with mp, param dtype bfloat16, reduce dtype float32 and buffer_dtype
 * (SP_DTYPE_INVALID: unset). */
static void reference_job(sp_job *job, bool mp, sp_dtype buffer_dtype) {
  sp_job_init(job);
  sp_strlist_add(&job->wrap_types, "Linear");
  if (mp) {
    job->mp.enabled = true;
    job->mp.param_dtype = SP_BFLOAT16;
    job->mp.reduce_dtype = SP_FLOAT32;
    job->mp.buffer_dtype = buffer_dtype;
  }
}

/* The reference run's configuration from the workers' flags, read by the
 * parser the worker itself uses (train_flags.h): the training flags among
 * wflags, with steps, batch and lr. */
static void reference_cfg(const char *const *wflags, uint32_t steps,
                          uint32_t batch, double lr, sp_mlp_train_cfg *cfg) {
  struct option opts[64];
  size_t n = sp_train_options(opts, 64);
  sp_train_flags t;
  sp_train_flags_init(&t);
  sp_diag d = {{0}};
  for (size_t i = 0; wflags && wflags[i]; i++) {
    if (strncmp(wflags[i], "--", 2) != 0) continue;
    for (size_t k = 0; k < n; k++) {
      if (strcmp(opts[k].name, wflags[i] + 2) != 0) continue;
      const char *v = opts[k].has_arg ? wflags[i + 1] : NULL;
      if (sp_train_flag(&t, opts[k].val, v, &d) < 0)
        fail_msg("worker flags: %s", d.msg);
    }
  }
  if (sp_train_flags_finish(&t, steps, lr, batch, 0, NULL, cfg, &d) < 0)
    fail_msg("worker flags: %s", d.msg);
  /* the patterns point into wflags, which outlive the reference run */
}

/* The job's results against the reference run (sp_tjob_parity). */
static void check_parity(const char *label, const char *model, bool mp,
                         const sp_mlp_train_cfg *cfg, double tol,
                         double loss_tol, double rms_tol,
                         const char *losses_path, const char *ckpt_dir) {
  uint32_t steps = cfg->steps;
  assert_true(steps > 0);
  sp_model *m;
  sp_diag d = {{0}};
  assert_int_equal(sp_model_load_file(model, &m, &d), 0);
  sp_job ref_job;
  reference_job(&ref_job, mp, SP_DTYPE_INVALID);
  double *ref_losses = calloc(steps + 1, sizeof *ref_losses);
  assert_non_null(ref_losses);
  void *ref_params = NULL;
  if (sp_mlp_reference_train(m, &ref_job, cfg, ref_losses, &ref_params, NULL,
                             &d) < 0)
    fail_msg("reference: %s", d.msg);
  size_t nl;
  double *got = sp_tjob_read_losses(losses_path, &nl);
  assert_int_equal(nl, steps);
  double loss_err = rel_err(got, ref_losses, steps);
  double *gp = read_full_params(m, ckpt_dir);
  double *rp = ref_params_f64(m, ref_params);
  double param_err = rel_err(gp, rp, total_numel(m));
  double param_rms = rms_err(gp, rp, total_numel(m));
  printf(
      "  %s: loss %.6f -> %.6f, rel. error loss %.2e params %.2e "
      "(rms %.2e; bound %.0e)\n",
      label, got[0], got[steps - 1], loss_err, param_err, param_rms, tol);
  if (g_parity_worst) {
    if (loss_err > g_parity_worst->loss) g_parity_worst->loss = loss_err;
    if (param_err > g_parity_worst->params) g_parity_worst->params = param_err;
    if (param_rms > g_parity_worst->rms) g_parity_worst->rms = param_rms;
  }
  assert_true(got[steps - 1] < got[0]);
  assert_true(loss_err <= (loss_tol > 0 ? loss_tol : tol));
  assert_true(param_err <= tol);
  assert_true(rms_tol <= 0 || param_rms <= rms_tol);
  free(gp);
  free(rp);
  free(got);
  free(ref_losses);
  free(ref_params);
  sp_job_clear(&ref_job);
  sp_model_free(m);
}

/* One parity job between its start and its check. */
typedef struct parity_run {
  sp_tjob j;
  double end; /* sp_clock_s deadline of its workers */
  bool done;  /* its processes are gone (wait_end) */
  int ok;     /* workers that exited 0 */
  char *dir, *losses;
  char steps[16], batch[16], group[16];
  const char *cflags[MAXARGS], *wflags[MAXARGS];
} parity_run;

static void parity_start(parity_run *r, const sp_tjob_parity_cfg *c) {
  memset(r, 0, sizeof *r);
  r->dir = sp_test_mkdtemp();
  r->losses = sp_test_path(r->dir, "losses.json");
  snprintf(r->steps, sizeof r->steps, "%u", c->steps);
  snprintf(r->batch, sizeof r->batch, "%u", c->batch);
  snprintf(r->group, sizeof r->group, "%d", c->group);
  size_t k = 0;
  r->cflags[k++] = "--wrap-type";
  r->cflags[k++] = "Linear";
  r->cflags[k++] = "--strategy";
  r->cflags[k++] = c->strategy;
  if (strcmp(c->strategy, "HYBRID_SHARD") == 0) {
    r->cflags[k++] = "--shard-group-size";
    r->cflags[k++] = r->group;
  }
  if (c->mp) {
    r->cflags[k++] = "--param-dtype";
    r->cflags[k++] = "bfloat16";
    r->cflags[k++] = "--reduce-dtype";
    r->cflags[k++] = "float32";
  }
  add_flags(r->cflags, k, c->cflags);
  const char *w[] = {
      "--steps", r->steps,   "--global-batch", r->batch,           "--lr",
      c->lr,     "--losses", r->losses,        "--checkpoint-dir", r->dir};
  memcpy(r->wflags, w, sizeof w);
  add_flags(r->wflags, sizeof w / sizeof w[0], c->wflags);
  sp_tjob_start(&r->j, c->model, r->cflags, c->n, r->wflags, NULL);
}

static void parity_check(parity_run *r, int ok, const char *label,
                         const sp_tjob_parity_cfg *c) {
  if (ok != c->n) {
    for (int k = 0; k < c->n; k++)
      fprintf(stderr, "rank %d: status %d\n", k, r->j.status[k]);
    fail_msg("%s: %d of %d workers succeeded", label, ok, c->n);
  }
  sp_mlp_train_cfg cfg;
  reference_cfg(c->wflags, c->steps, c->batch, atof(c->lr), &cfg);
  check_parity(label, c->model, c->mp, &cfg, c->tol, c->loss_tol, c->rms_tol,
               r->losses, r->dir);
}

static void parity_free(parity_run *r) {
  free(r->losses);
  if (r->dir) sp_test_rmtree(r->dir);
  free(r->dir);
  r->losses = r->dir = NULL;
}

void sp_tjob_parity(const char *label, const sp_tjob_parity_cfg *c) {
  sp_tjob_parity_many(c, &label, 1, 1);
}

/* A pool, not batches: the next job starts as soon as any one ends, so a
 * slow job (4 ranks, or a sanitizer build's start-up) holds up one slot
 * rather than the rest of its batch. Every job's processes are gone before
 * the first check, which may fail the test, so a failure leaves nothing
 * running. */
void sp_tjob_parity_many(const sp_tjob_parity_cfg *cs,
                         const char *const *labels, size_t n, size_t parallel) {
  if (parallel < 1) parallel = 1;
  if (parallel > 8) parallel = 8;
  parity_run *runs = calloc(n ? n : 1, sizeof *runs);
  assert_non_null(runs);
  size_t started = 0, live = 0;
  while (started < n || live > 0) {
    for (; live < parallel && started < n; started++, live++) {
      parity_run *r = &runs[started];
      parity_start(r, &cs[started]);
      wait_begin(&r->j);
      r->end = sp_clock_s() + cs[started].timeout_s;
    }
    bool ended = false;
    for (size_t i = 0; i < started; i++) {
      parity_run *r = &runs[i];
      if (r->done) continue;
      if (wait_reap(&r->j) > 0 && sp_clock_s() < r->end) continue;
      r->ok = wait_end(&r->j);
      r->done = true;
      live--;
      ended = true;
    }
    if (!ended) sp_test_sleep_ms(5);
  }
  for (size_t i = 0; i < n; i++) {
    parity_check(&runs[i], runs[i].ok, labels[i], &cs[i]);
    parity_free(&runs[i]);
  }
  free(runs);
}

void sp_tjob_check_buffers(const char *model, uint32_t world, uint32_t steps,
                           uint32_t batch, double lr, const char *dir,
                           const char *sharded, const char *local,
                           const char *vs) {
  sp_model *m;
  sp_diag d = {{0}};
  assert_int_equal(sp_model_load_file(model, &m, &d), 0);
  sp_job job;
  reference_job(&job, true, SP_BFLOAT16);
  void *ref_bufs = NULL;
  assert_int_equal(sp_mlp_reference_run(m, &job, steps, batch, lr, NULL, NULL,
                                        &ref_bufs, &d),
                   0);
  sp_plan *plan;
  job.world_size = world;
  assert_int_equal(sp_plan_build(m, &job, &plan, &d), 0);

  sp_safetensors_file *full = sp_tjob_open_st(dir, "full/model.safetensors");
  sp_safetensors_file *sh = sp_tjob_open_st(dir, sharded);
  sp_safetensors_file *loc = sp_tjob_open_st(dir, local);
  const uint8_t *ref = ref_bufs;
  for (size_t b = 0; b < m->n_buffers; b++) {
    const sp_tensor_spec *bs = &m->buffers[b];
    sp_dtype compute = plan->buffers[b].compute_dtype;
    const sp_safetensors_tensor *tf = sp_safetensors_find(full, bs->fqn);
    const sp_safetensors_tensor *ts = sp_safetensors_find(sh, bs->fqn);
    const sp_safetensors_tensor *tl = sp_safetensors_find(loc, bs->fqn);
    printf(
        "  %-30s original %-8s compute %-8s FULL %-8s SHARDED %-8s "
        "LOCAL %s\n",
        bs->fqn, sp_dtype_name(bs->dtype), sp_dtype_name(compute),
        tf ? sp_dtype_name(tf->dtype) : "-",
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
    if (!tf || !ts || !tl) fail_msg("%s missing from a checkpoint", bs->fqn);
    /* FULL and SHARDED restore the original dtype; LOCAL keeps the compute
     * dtype; integer and bool buffers never change */
    assert_int_equal(tf->dtype, bs->dtype);
    assert_int_equal(ts->dtype, bs->dtype);
    assert_int_equal(tl->dtype, compute);
    if (!sp_dtype_is_floating(bs->dtype)) {
      assert_int_equal(compute, bs->dtype);
      double want = strstr(bs->fqn, "seen") ? 1 : (double)steps;
      for (size_t i = 0; i < n; i++) {
        assert_true(sp_tjob_elem(tf, i) == want);
        assert_true(sp_tjob_elem(tl, i) == want);
      }
      continue;
    }
    assert_int_equal(compute, SP_BFLOAT16);
    double diff = 0, scale = 0;
    for (size_t i = 0; i < n; i++) {
      double v = sp_tjob_elem(tf, i), r;
      assert_int_equal(sp_cast(&r, SP_FLOAT64, rb + 2 * i, SP_BFLOAT16, 1), 0);
      /* computed in bfloat16: the restored value is a bf16 value */
      uint16_t h;
      double back;
      sp_cast(&h, SP_BFLOAT16, &v, SP_FLOAT64, 1);
      sp_cast(&back, SP_FLOAT64, &h, SP_BFLOAT16, 1);
      assert_true(back == v);
      assert_true(sp_tjob_elem(ts, i) == v);
      assert_true(sp_tjob_elem(tl, i) == v);
      if (fabs(v - r) > diff) diff = fabs(v - r);
      if (fabs(r) > scale) scale = fabs(r);
    }
    /* against the single process: the batch means come from activations
     * that differ at the parity bound (bf16 gradients rounded per rank, or
     * GEMM sums in another order on a GPU), then rounded to bf16: within
     * one bf16 step (2^-8 relative) of the tensor's largest value, twice */
    printf("  %-30s max |%s| = %.3g (%.2g of its largest value)\n", bs->fqn, vs,
           diff, scale > 0 ? diff / scale : 0);
    assert_true(diff <= 0x1p-7 * scale);
  }
  sp_safetensors_close(full);
  sp_safetensors_close(sh);
  sp_safetensors_close(loc);
  free(ref_bufs);
  sp_plan_free(plan);
  sp_job_clear(&job);
  sp_model_free(m);
}
