/* The reference MLP (client/worker/mlp.h): spec reading, deterministic data and
 * init, a finite-difference check of backward, batch-split invariance with
 * emulated ranks, low-precision rounding, buffer updates and the unsharded
 * reference run. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <math.h>
#include <pthread.h>

#include "cast/cast.h"
#include "cast/cast_scalar.h"
#include "plan/job.h"
#include "worker/mlp.h"
#include "plan/model.h"
#include "plan/plan.h"
#include "support/mlp_reference.h"
#include "support/testutil.h"

#define MLP_JSON SP_EXAMPLES "/mlp.json"
#define MLP_BUFFERS_JSON SP_TEST_DATA "/mlp_buffers.json"
#define RESNET_JSON SP_EXAMPLES "/models/resnet50.json"

static sp_model *load(const char *path) {
  sp_model *m = NULL;
  sp_diag d = {""};
  if (sp_model_load_file(path, &m, &d) != 0) fail_msg("%s: %s", path, d.msg);
  return m;
}

static sp_model *load_str(const char *json) {
  sp_model *m = NULL;
  sp_diag d = {""};
  if (sp_model_load_string(json, strlen(json), "test.json", &m, &d) != 0)
    fail_msg("spec rejected: %s", d.msg);
  return m;
}

static sp_mlp *mlp_of(const sp_model *m) {
  sp_mlp *mlp = NULL;
  sp_diag d = {""};
  if (sp_mlp_new(m, &mlp, &d) != 0) fail_msg("sp_mlp_new: %s", d.msg);
  return mlp;
}

static uint32_t fbits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

/* ------------------------------------------------------------------ */
/* a plain-array trainer, one per emulated rank                        */
/* ------------------------------------------------------------------ */

#define MAX_RANKS 8
#define MAX_NORM_CALLS 8

typedef struct tgroup {
  int size;
  pthread_barrier_t bar;
  float *slots[MAX_RANKS];
} tgroup;

typedef struct tnet {
  const sp_model *m;
  sp_mlp *mlp;
  sp_dtype pd;
  unsigned char **view, **grad, **buf;
  sp_dtype *bdt;
  sp_mlp_io io;
  tgroup *grp;
  int rank;
  /* gradcheck: 1 records every all-reduce result, 2 replays them, so the
   * running mean stays what backward assumes it is (a constant) */
  int freeze;
  size_t ncall;
  float frozen[MAX_NORM_CALLS][64];
} tnet;

static void *t_param(void *u, int32_t p) { return ((tnet *)u)->view[p]; }
static void *t_grad(void *u, int32_t p) { return ((tnet *)u)->grad[p]; }
static sp_dtype t_param_dtype(void *u, int32_t p) {
  (void)p;
  return ((tnet *)u)->pd;
}
static void *t_buffer(void *u, int32_t b) { return ((tnet *)u)->buf[b]; }
static sp_dtype t_buffer_dtype(void *u, int32_t b) {
  return ((tnet *)u)->bdt[b];
}

static int t_all_reduce(void *user, float *buf, size_t n, sp_diag *d) {
  tnet *t = user;
  (void)d;
  if (t->freeze) {
    assert_true(t->ncall < MAX_NORM_CALLS && n <= 64);
    if (t->freeze == 1)
      memcpy(t->frozen[t->ncall], buf, n * sizeof *buf);
    else
      memcpy(buf, t->frozen[t->ncall], n * sizeof *buf);
    t->ncall++;
    return 0;
  }
  tgroup *g = t->grp;
  if (g == NULL) return 0;
  float *sum = calloc(n ? n : 1, sizeof *sum);
  if (sum == NULL) return SP_ENOMEM;
  g->slots[t->rank] = buf;
  pthread_barrier_wait(&g->bar);
  for (size_t i = 0; i < n; i++) {
    float acc = 0.0f;
    for (int r = 0; r < g->size; r++) acc += g->slots[r][i];
    sum[i] = acc;
  }
  /* nobody may overwrite its slot before every rank has read all of them */
  pthread_barrier_wait(&g->bar);
  memcpy(buf, sum, n * sizeof *buf);
  free(sum);
  return 0;
}

/* Params initialised by sp_mlp_init_param and cast to pd; buffers
 * initialised and cast to buffer_dtype (INVALID: keep) when floating. */
static void tnet_init(tnet *t, const sp_model *m, sp_dtype pd,
                      sp_dtype buffer_dtype) {
  memset(t, 0, sizeof *t);
  t->m = m;
  t->mlp = mlp_of(m);
  t->pd = pd;
  t->view = calloc(m->n_params + 1, sizeof *t->view);
  t->grad = calloc(m->n_params + 1, sizeof *t->grad);
  t->buf = calloc(m->n_buffers + 1, sizeof *t->buf);
  t->bdt = calloc(m->n_buffers + 1, sizeof *t->bdt);
  assert_true(t->view && t->grad && t->buf && t->bdt);
  for (size_t p = 0; p < m->n_params; p++) {
    const sp_tensor_spec *s = &m->params[p];
    void *master = malloc((size_t)s->numel * sp_dtype_size(s->dtype));
    t->view[p] = malloc((size_t)s->numel * sp_dtype_size(pd));
    t->grad[p] = calloc((size_t)s->numel, sp_dtype_size(pd));
    assert_true(master && t->view[p] && t->grad[p]);
    sp_mlp_init_param(NULL, m, (int32_t)p, 0, s->numel, master);
    assert_int_equal(
        sp_cast(t->view[p], pd, master, s->dtype, (size_t)s->numel), 0);
    free(master);
  }
  for (size_t b = 0; b < m->n_buffers; b++) {
    const sp_tensor_spec *s = &m->buffers[b];
    t->bdt[b] =
        sp_dtype_is_floating(s->dtype) && buffer_dtype != SP_DTYPE_INVALID
            ? buffer_dtype
            : s->dtype;
    void *orig = malloc((size_t)s->numel * sp_dtype_size(s->dtype));
    t->buf[b] = malloc((size_t)s->numel * sp_dtype_size(t->bdt[b]));
    assert_true(orig && t->buf[b]);
    sp_mlp_init_buffer(NULL, m, (int32_t)b, orig);
    if (t->bdt[b] == s->dtype)
      memcpy(t->buf[b], orig, (size_t)s->numel * sp_dtype_size(s->dtype));
    else
      assert_int_equal(
          sp_cast(t->buf[b], t->bdt[b], orig, s->dtype, (size_t)s->numel), 0);
    free(orig);
  }
  t->io = (sp_mlp_io){.param = t_param,
                      .grad = t_grad,
                      .param_dtype = t_param_dtype,
                      .buffer = t_buffer,
                      .buffer_dtype = t_buffer_dtype,
                      .all_reduce_sum = t_all_reduce,
                      .user = t};
}

static void tnet_free(tnet *t) {
  for (size_t p = 0; p < t->m->n_params; p++) {
    free(t->view[p]);
    free(t->grad[p]);
  }
  for (size_t b = 0; b < t->m->n_buffers; b++) free(t->buf[b]);
  free(t->view);
  free(t->grad);
  free(t->buf);
  free(t->bdt);
  sp_mlp_free(t->mlp);
}

static int tnet_forward(tnet *t, sp_mlp_acts *a, uint64_t global_n,
                        sp_diag *d) {
  t->ncall = 0;
  for (size_t l = 0; l < t->mlp->n_layers; l++) {
    int rc = sp_mlp_forward(t->mlp, l, &t->io, a, global_n, d);
    if (rc != 0) return rc;
  }
  return 0;
}

static int tnet_backward(tnet *t, sp_mlp_acts *a, sp_diag *d) {
  for (size_t l = t->mlp->n_layers; l-- > 0;) {
    int rc = sp_mlp_backward(t->mlp, l, &t->io, a, d);
    if (rc != 0) return rc;
  }
  return 0;
}

/* ------------------------------------------------------------------ */
/* spec reading                                                        */
/* ------------------------------------------------------------------ */

static void expect_unsupported(const char *json) {
  sp_model *m = load_str(json);
  sp_mlp *mlp = (sp_mlp *)1;
  sp_diag d = {""};
  assert_int_equal(sp_mlp_new(m, &mlp, &d), SP_EUNSUPPORTED);
  assert_null(mlp);
  assert_true(strlen(d.msg) > 0);
  sp_model_free(m);
}

static void test_new_specs(void **state) {
  (void)state;
  sp_model *m = load(MLP_JSON);
  sp_mlp *mlp = mlp_of(m);
  assert_int_equal(mlp->n_layers, 7);
  assert_int_equal(mlp->in_dim, 32);
  assert_int_equal(mlp->out_dim, 16);
  assert_int_equal(mlp->max_dim, 64);
  assert_int_equal(mlp->step_buffer, sp_model_find_buffer(m, "step"));
  assert_true(mlp->step_buffer >= 0);
  const sp_mlp_kind kinds[7] = {SP_MLP_LINEAR, SP_MLP_NORM, SP_MLP_RELU,
                                SP_MLP_LINEAR, SP_MLP_NORM, SP_MLP_RELU,
                                SP_MLP_LINEAR};
  for (size_t l = 0; l < 7; l++)
    assert_int_equal(mlp->layers[l].kind, kinds[l]);
  assert_int_equal(mlp->layers[0].weight,
                   sp_model_find_param(m, "layers.0.weight"));
  assert_int_equal(mlp->layers[6].bias,
                   sp_model_find_param(m, "layers.6.bias"));
  assert_int_equal(mlp->layers[1].running_mean,
                   sp_model_find_buffer(m, "layers.1.running_mean"));
  assert_int_equal(mlp->layers[4].num_batches_tracked,
                   sp_model_find_buffer(m, "layers.4.num_batches_tracked"));
  assert_int_equal(mlp->layers[1].seen, -1);
  /* scalar buffers load with shape [] */
  const sp_tensor_spec *step = &m->buffers[mlp->step_buffer];
  assert_int_equal(step->ndim, 0);
  assert_int_equal(step->numel, 1);
  assert_int_equal(step->dtype, SP_INT64);
  sp_mlp_free(mlp);
  sp_model_free(m);

  m = load(MLP_BUFFERS_JSON);
  mlp = mlp_of(m);
  assert_int_equal(mlp->n_layers, 8);
  assert_int_equal(mlp->out_dim, 16);
  assert_int_equal(mlp->layers[7].kind, SP_MLP_NORM);
  const char *rm[3] = {"layers.1.running_mean", "layers.4.running_mean",
                       "layers.7.running_mean"};
  const sp_dtype rmt[3] = {SP_FLOAT64, SP_FLOAT16, SP_BFLOAT16};
  const size_t norms[3] = {1, 4, 7};
  for (int i = 0; i < 3; i++) {
    const sp_mlp_layer *L = &mlp->layers[norms[i]];
    assert_int_equal(L->running_mean, sp_model_find_buffer(m, rm[i]));
    assert_int_equal(m->buffers[L->running_mean].dtype, rmt[i]);
    assert_true(L->seen >= 0);
    assert_int_equal(m->buffers[L->seen].dtype, SP_BOOL);
  }
  assert_int_equal(m->buffers[mlp->layers[4].num_batches_tracked].dtype,
                   SP_INT32);
  assert_false(m->buffers[mlp->layers[4].seen].flag); /* non-persistent */
  sp_mlp_free(mlp);
  sp_model_free(m);

  m = load(RESNET_JSON);
  sp_diag d = {""};
  mlp = (sp_mlp *)1;
  assert_int_equal(sp_mlp_new(m, &mlp, &d), SP_EUNSUPPORTED);
  assert_null(mlp);
  assert_non_null(strstr(d.msg, "conv1")); /* names the module */
  sp_model_free(m);

  assert_int_equal(sp_mlp_new(NULL, &mlp, NULL), SP_EINVAL);

#define HEAD                                                         \
  "{\"format\":\"shardplane.model/v1\",\"name\":\"t\",\"modules\":[" \
  "{\"fqn\":\"\",\"type\":\"MLP\"},{\"fqn\":\"layers\",\"type\":"    \
  "\"Sequential\"},"
  /* feature counts that do not chain */
  expect_unsupported(
      HEAD
      "{\"fqn\":\"layers.0\",\"type\":\"Linear\"},{\"fqn\":\"layers.1\","
      "\"type\":\"Linear\"}],\"params\":[{\"fqn\":\"layers.0.weight\","
      "\"shape\":[4,3],\"dtype\":\"float32\"},{\"fqn\":\"layers.1.weight\","
      "\"shape\":[2,5],\"dtype\":\"float32\"}],\"buffers\":[]}");
  /* an unknown layer type */
  expect_unsupported(
      HEAD
      "{\"fqn\":\"layers.0\",\"type\":\"Conv2d\"}],\"params\":[],"
      "\"buffers\":[]}");
  /* a norm without running_mean */
  expect_unsupported(
      HEAD
      "{\"fqn\":\"layers.0\",\"type\":\"RunningNorm\"}],\"params\":["
      "{\"fqn\":\"layers.0.weight\",\"shape\":[4],\"dtype\":\"float32\"},"
      "{\"fqn\":\"layers.0.bias\",\"shape\":[4],\"dtype\":\"float32\"}],"
      "\"buffers\":[]}");
  /* a floating step counter */
  expect_unsupported(
      HEAD
      "{\"fqn\":\"layers.0\",\"type\":\"Linear\"}],\"params\":["
      "{\"fqn\":\"layers.0.weight\",\"shape\":[4,3],\"dtype\":"
      "\"float32\"}],\"buffers\":[{\"fqn\":\"step\",\"shape\":[],"
      "\"dtype\":\"float32\"}]}");
  /* ReLU first: no input width */
  expect_unsupported(HEAD
                     "{\"fqn\":\"layers.0\",\"type\":\"ReLU\"}],\"params\":[],"
                     "\"buffers\":[]}");
}

/* ------------------------------------------------------------------ */
/* determinism of data and init                                        */
/* ------------------------------------------------------------------ */

static void test_data_and_init_determinism(void **state) {
  (void)state;
  sp_model *m = load(MLP_JSON);
  sp_mlp *mlp = mlp_of(m);
  enum { N = 10 };
  float x[N * 32], t[N * 16], x2[N * 32], t2[N * 16];
  sp_mlp_batch(mlp, 7, 100, N, x, t);
  /* any split of the batch sees the same samples */
  sp_mlp_batch(mlp, 7, 100, 3, x2, t2);
  sp_mlp_batch(mlp, 7, 103, N - 3, x2 + 3 * 32, t2 + 3 * 16);
  assert_memory_equal(x, x2, sizeof x);
  assert_memory_equal(t, t2, sizeof t);
  float lo = 1, hi = -1;
  for (size_t i = 0; i < N * 32; i++) {
    assert_true(x[i] >= -1.0f && x[i] < 1.0f);
    lo = fminf(lo, x[i]);
    hi = fmaxf(hi, x[i]);
  }
  assert_true(lo < -0.8f && hi > 0.8f);
  double tvar = 0;
  for (size_t i = 0; i < N * 16; i++) {
    assert_true(t[i] >= -1.75f && t[i] <= 1.75f);
    tvar += (double)t[i] * t[i];
  }
  assert_true(tvar / (N * 16) > 0.05); /* a target worth learning */
  /* another step gives other samples */
  sp_mlp_batch(mlp, 8, 100, N, x2, t2);
  assert_memory_not_equal(x, x2, sizeof x);

  /* init of any sub-range equals that range of the whole tensor, which is
   * what a rank initialising only its shard relies on */
  for (size_t p = 0; p < m->n_params; p++) {
    const sp_tensor_spec *s = &m->params[p];
    size_t n = (size_t)s->numel;
    float *whole = malloc(n * 4), *part = malloc(n * 4);
    assert_true(whole && part);
    sp_mlp_init_param(NULL, m, (int32_t)p, 0, s->numel, whole);
    for (size_t start = 0; start < n;) {
      size_t len = 1 + (start * 7 + p) % 37;
      if (len > n - start) len = n - start;
      sp_mlp_init_param(NULL, m, (int32_t)p, (int64_t)start, (int64_t)len,
                        part + start);
      start += len;
    }
    assert_memory_equal(whole, part, n * 4);
    /* value ranges of the documented scheme */
    bool distinct = false;
    for (size_t i = 0; i < n; i++) {
      if (s->ndim == 2)
        assert_true(fabsf(whole[i]) <= 1.0f / sqrtf((float)s->shape[1]));
      else if (strcmp(s->local_name, "weight") == 0)
        assert_true(fabsf(whole[i] - 1.0f) <= 0.011f);
      else
        assert_true(fabsf(whole[i]) <= 0.011f);
      if (i > 0 && whole[i] != whole[0]) distinct = true;
    }
    assert_true(distinct);
    free(whole);
    free(part);
  }
  sp_mlp_free(mlp);
  sp_model_free(m);

  /* a bfloat16 parameter is written in bfloat16, rounded from the same
   * value: its bits are the float32 init's rounded */
  sp_model *mb = load_str(
      "{\"format\":\"shardplane.model/v1\",\"name\":\"t\",\"modules\":["
      "{\"fqn\":\"\",\"type\":\"M\"},{\"fqn\":\"a\",\"type\":\"Linear\"}],"
      "\"params\":[{\"fqn\":\"a.weight\",\"shape\":[8,16],\"dtype\":"
      "\"bfloat16\"}],\"buffers\":[{\"fqn\":\"a.s\",\"shape\":[3],\"dtype\":"
      "\"float64\"}]}");
  uint16_t wb[128], wb2[128];
  sp_mlp_init_param(NULL, mb, 0, 0, 128, wb);
  sp_mlp_init_param(NULL, mb, 0, 50, 78, wb2 + 50);
  sp_mlp_init_param(NULL, mb, 0, 0, 50, wb2);
  assert_memory_equal(wb, wb2, sizeof wb);
  int nonzero = 0;
  for (int i = 0; i < 128; i++) nonzero += (wb[i] & 0x7FFF) != 0;
  assert_true(nonzero > 120);
  double sb[3] = {1, 2, 3};
  sp_mlp_init_buffer(NULL, mb, 0, sb);
  for (int i = 0; i < 3; i++) assert_true(sb[i] == 0.0);
  sp_model_free(mb);
}

/* ------------------------------------------------------------------ */
/* finite differences                                                  */
/* ------------------------------------------------------------------ */

static const char *SMALL_NET =
    "{\"format\":\"shardplane.model/v1\",\"name\":\"small\",\"modules\":["
    "{\"fqn\":\"\",\"type\":\"MLP\"},{\"fqn\":\"layers\",\"type\":"
    "\"Sequential\"},{\"fqn\":\"layers.0\",\"type\":\"Linear\"},"
    "{\"fqn\":\"layers.1\",\"type\":\"RunningNorm\"},{\"fqn\":\"layers.2\","
    "\"type\":\"ReLU\"},{\"fqn\":\"layers.3\",\"type\":\"Linear\"},"
    "{\"fqn\":\"layers.4\",\"type\":\"RunningNorm\"}],"
    "\"params\":["
    "{\"fqn\":\"layers.0.weight\",\"shape\":[7,5],\"dtype\":\"float32\"},"
    "{\"fqn\":\"layers.0.bias\",\"shape\":[7],\"dtype\":\"float32\"},"
    "{\"fqn\":\"layers.1.weight\",\"shape\":[7],\"dtype\":\"float32\"},"
    "{\"fqn\":\"layers.1.bias\",\"shape\":[7],\"dtype\":\"float32\"},"
    "{\"fqn\":\"layers.3.weight\",\"shape\":[3,7],\"dtype\":\"float32\"},"
    "{\"fqn\":\"layers.3.bias\",\"shape\":[3],\"dtype\":\"float32\"},"
    "{\"fqn\":\"layers.4.weight\",\"shape\":[3],\"dtype\":\"float32\"},"
    "{\"fqn\":\"layers.4.bias\",\"shape\":[3],\"dtype\":\"float32\"}],"
    "\"buffers\":[{\"fqn\":\"step\",\"shape\":[],\"dtype\":\"int64\"},"
    "{\"fqn\":\"layers.1.running_mean\",\"shape\":[7],\"dtype\":\"float32\"},"
    "{\"fqn\":\"layers.4.running_mean\",\"shape\":[3],\"dtype\":\"float64\"}]}";

/* Loss of the small net at its current params, with the running means
 * reset before the forward (and the batch sums replayed), plus the ReLU
 * pattern so a kink crossed by the perturbation can be told apart. */
static double gc_loss(tnet *t, sp_mlp_acts *a, const float *x, const float *tg,
                      uint8_t *mask) {
  const sp_model *m = t->m;
  for (size_t b = 0; b < m->n_buffers; b++)
    memset(t->buf[b], 0,
           (size_t)m->buffers[b].numel * sp_dtype_size(t->bdt[b]));
  memcpy(a->x[0], x, a->n * 5 * sizeof(float));
  sp_diag d = {""};
  if (tnet_forward(t, a, a->n, &d) != 0) fail_msg("forward: %s", d.msg);
  for (size_t i = 0; i < a->n * 7; i++) mask[i] = a->x[2][i] > 0.0f;
  return sp_mlp_loss(t->mlp, a, tg, SP_FLOAT32);
}

static void test_gradcheck(void **state) {
  (void)state;
  sp_model *m = load_str(SMALL_NET);
  tnet t;
  tnet_init(&t, m, SP_FLOAT32, SP_DTYPE_INVALID);
  enum { N = 6 };
  sp_mlp_acts *a = NULL;
  assert_int_equal(sp_mlp_acts_new(t.mlp, N, &a), 0);
  float x[N * 5], tg[N * 3];
  sp_mlp_batch(t.mlp, 3, 0, N, x, tg);
  /* spread the targets so the gradient is not dominated by one sign */
  for (size_t i = 0; i < N * 3; i++) tg[i] = 2.0f * tg[i] - 0.3f;
  uint8_t mask0[N * 7], mask[N * 7];

  t.freeze = 1;
  double l0 = gc_loss(&t, a, x, tg, mask0);
  sp_diag d = {""};
  if (tnet_backward(&t, a, &d) != 0) fail_msg("backward: %s", d.msg);
  assert_true(l0 > 0.01);
  t.freeze = 2;

  size_t checked = 0, skipped = 0;
  double worst = 0;
  const float eps = 1e-2f;
  for (size_t p = 0; p < m->n_params; p++) {
    float *w = (float *)t.view[p];
    const float *g = (const float *)t.grad[p];
    for (int64_t i = 0; i < m->params[p].numel; i++) {
      float keep = w[i];
      float up = keep + eps, dn = keep - eps;
      w[i] = up;
      double lu = gc_loss(&t, a, x, tg, mask);
      bool kink = memcmp(mask, mask0, sizeof mask) != 0;
      w[i] = dn;
      double ld = gc_loss(&t, a, x, tg, mask);
      kink = kink || memcmp(mask, mask0, sizeof mask) != 0;
      w[i] = keep;
      if (kink) {
        skipped++;
        continue;
      }
      double fd = (lu - ld) / ((double)up - (double)dn);
      double an = g[i];
      double err = fabs(fd - an);
      double tol = 1e-3 * fmax(fabs(an), fabs(fd)) + 2e-5;
      if (err > tol)
        fail_msg("%s[%lld]: analytic %.9g, finite difference %.9g",
                 m->params[p].fqn, (long long)i, an, fd);
      if (err / (fabs(an) + 1e-3) > worst) worst = err / (fabs(an) + 1e-3);
      checked++;
    }
  }
  printf(
      "gradcheck: %zu elements checked, %zu skipped at ReLU kinks, "
      "worst relative error %.2e\n",
      checked, skipped, worst);
  assert_true(checked >= 70);
  sp_mlp_acts_free(a);
  tnet_free(&t);
  sp_model_free(m);
}

/* ------------------------------------------------------------------ */
/* batch split over emulated ranks                                     */
/* ------------------------------------------------------------------ */

typedef struct rank_job {
  tnet *t;
  sp_mlp_acts *a;
  const float *x, *tg;
  uint64_t global_n;
  double loss;
  int rc;
  sp_diag d;
} rank_job;

static void *rank_main(void *arg) {
  rank_job *j = arg;
  tnet *t = j->t;
  memcpy(j->a->x[0], j->x, j->a->n * (size_t)t->mlp->in_dim * sizeof(float));
  j->rc = tnet_forward(t, j->a, j->global_n, &j->d);
  if (j->rc == 0) {
    j->loss = sp_mlp_loss(t->mlp, j->a, j->tg, t->pd);
    j->rc = tnet_backward(t, j->a, &j->d);
  }
  return NULL;
}

static void test_batch_split(void **state) {
  (void)state;
  sp_model *m = load(MLP_JSON);
  enum { N = 12, K = 4 };
  const size_t parts[K] = {5, 4, 0, 3}; /* one rank with no samples */
  float x[N * 32], tg[N * 16];

  tnet full;
  tnet_init(&full, m, SP_FLOAT32, SP_DTYPE_INVALID);
  sp_mlp *mlp = full.mlp;
  sp_mlp_batch(mlp, 11, 0, N, x, tg);
  sp_mlp_acts *fa = NULL;
  assert_int_equal(sp_mlp_acts_new(mlp, N, &fa), 0);
  rank_job fj = {.t = &full, .a = fa, .x = x, .tg = tg, .global_n = N};
  rank_main(&fj);
  assert_int_equal(fj.rc, 0);

  tgroup g = {.size = K};
  assert_int_equal(pthread_barrier_init(&g.bar, NULL, K), 0);
  tnet rk[K];
  rank_job jobs[K];
  pthread_t th[K];
  size_t first = 0;
  for (int r = 0; r < K; r++) {
    tnet_init(&rk[r], m, SP_FLOAT32, SP_DTYPE_INVALID);
    rk[r].grp = &g;
    rk[r].rank = r;
    sp_mlp_acts *a = NULL;
    assert_int_equal(sp_mlp_acts_new(rk[r].mlp, parts[r], &a), 0);
    jobs[r] = (rank_job){.t = &rk[r],
                         .a = a,
                         .x = x + first * 32,
                         .tg = tg + first * 16,
                         .global_n = N};
    first += parts[r];
  }
  assert_int_equal(first, N);
  for (int r = 0; r < K; r++)
    assert_int_equal(pthread_create(&th[r], NULL, rank_main, &jobs[r]), 0);
  for (int r = 0; r < K; r++) pthread_join(th[r], NULL);
  pthread_barrier_destroy(&g.bar);
  for (int r = 0; r < K; r++)
    if (jobs[r].rc != 0) fail_msg("rank %d: %s", r, jobs[r].d.msg);

  /* loss: the size-weighted mean of the parts */
  double wl = 0;
  for (int r = 0; r < K; r++) wl += jobs[r].loss * (double)parts[r] / N;
  assert_true(fabs(wl - fj.loss) <= 1e-5 * fj.loss);

  /* every rank's outputs equal the full run's rows */
  first = 0;
  for (int r = 0; r < K; r++) {
    const float *y = jobs[r].a->x[mlp->n_layers];
    for (size_t i = 0; i < parts[r] * 16; i++)
      assert_true(fabsf(y[i] - fa->x[mlp->n_layers][first * 16 + i]) <= 1e-5f);
    first += parts[r];
  }

  /* gradients: sum_k (n_k / N) g_k == g_full */
  double worst = 0;
  for (size_t p = 0; p < m->n_params; p++) {
    size_t n = (size_t)m->params[p].numel;
    const float *gf = (const float *)full.grad[p];
    float scale = 0;
    for (size_t i = 0; i < n; i++) scale = fmaxf(scale, fabsf(gf[i]));
    assert_true(scale > 0);
    for (size_t i = 0; i < n; i++) {
      double s = 0;
      for (int r = 0; r < K; r++)
        s += (double)((const float *)rk[r].grad[p])[i] * parts[r] / N;
      double err = fabs(s - gf[i]) / scale;
      if (err > worst) worst = err;
      if (err > 1e-5)
        fail_msg("%s[%zu]: split %.9g, full %.9g", m->params[p].fqn, i, s,
                 (double)gf[i]);
    }
  }
  printf("batch split: worst gradient difference %.2e of the tensor's max\n",
         worst);

  /* running means: the same bits on every rank, close to the full run */
  for (size_t l = 0; l < mlp->n_layers; l++) {
    int32_t b = mlp->layers[l].running_mean;
    if (b < 0) continue;
    for (int r = 1; r < K; r++)
      assert_memory_equal(rk[r].buf[b], rk[0].buf[b], 64 * 4);
    const float *rf = (const float *)full.buf[b];
    const float *r0 = (const float *)rk[0].buf[b];
    for (size_t i = 0; i < 64; i++)
      assert_true(fabsf(rf[i] - r0[i]) <= 1e-6f + 1e-5f * fabsf(rf[i]));
  }

  for (int r = 0; r < K; r++) {
    sp_mlp_acts_free(jobs[r].a);
    tnet_free(&rk[r]);
  }
  sp_mlp_acts_free(fa);
  tnet_free(&full);
  sp_model_free(m);
}

/* ------------------------------------------------------------------ */
/* low-precision rounding                                              */
/* ------------------------------------------------------------------ */

static bool representable(float v, sp_dtype dt) {
  uint32_t u = fbits(v);
  if (dt == SP_BFLOAT16)
    return sp_bf16_to_f32_bits(sp_f32_to_bf16_bits(u)) == u;
  return sp_f16_to_f32_bits(sp_f32_to_f16_bits(u)) == u;
}

static void check_rounding(sp_dtype dt) {
  sp_model *m = load(MLP_JSON);
  tnet t;
  tnet_init(&t, m, dt, SP_DTYPE_INVALID);
  enum { N = 9 };
  sp_mlp_acts *a = NULL;
  assert_int_equal(sp_mlp_acts_new(t.mlp, N, &a), 0);
  float *tg = malloc(N * 16 * sizeof *tg);
  assert_non_null(tg);
  sp_mlp_batch(t.mlp, 0, 0, N, a->x[0], tg);
  bool any_inexact = false;
  for (size_t i = 0; i < N * 32; i++)
    any_inexact |= !representable(a->x[0][i], dt);
  assert_true(any_inexact); /* the raw data is finer than dt */
  sp_diag d = {""};
  if (tnet_forward(&t, a, N, &d) != 0) fail_msg("%s", d.msg);
  /* every activation, the (cast) input included */
  for (size_t l = 0; l <= t.mlp->n_layers; l++) {
    size_t dim = l == 0 ? 32 : (size_t)t.mlp->layers[l - 1].out;
    for (size_t i = 0; i < N * dim; i++)
      if (!representable(a->x[l][i], dt))
        fail_msg("x[%zu][%zu] = %.9g not a %s value", l, i, (double)a->x[l][i],
                 sp_dtype_name(dt));
  }
  assert_int_equal(sp_mlp_out_dtype(t.mlp, &t.io), dt);
  sp_mlp_loss(t.mlp, a, tg, dt);
  /* and every gradient that flows between layers */
  for (size_t l = t.mlp->n_layers; l-- > 0;) {
    size_t dim = (size_t)t.mlp->layers[l].out;
    for (size_t i = 0; i < N * dim; i++)
      assert_true(representable(a->dy[i], dt));
    assert_int_equal(sp_mlp_backward(t.mlp, l, &t.io, a, &d), 0);
  }
  free(tg);
  sp_mlp_acts_free(a);
  tnet_free(&t);
  sp_model_free(m);
}

static void test_low_precision_rounding(void **state) {
  (void)state;
  check_rounding(SP_BFLOAT16);
  check_rounding(SP_FLOAT16);
}

/* ------------------------------------------------------------------ */
/* buffers                                                             */
/* ------------------------------------------------------------------ */

static int64_t read_int(const void *p, sp_dtype dt) {
  if (dt == SP_INT64) {
    int64_t v;
    memcpy(&v, p, 8);
    return v;
  }
  int32_t v;
  memcpy(&v, p, 4);
  return v;
}

static void test_buffers(void **state) {
  (void)state;
  sp_model *m = load(MLP_BUFFERS_JSON);
  const sp_dtype computes[2] = {SP_DTYPE_INVALID, SP_BFLOAT16};
  for (int c = 0; c < 2; c++) {
    tnet t;
    tnet_init(&t, m, SP_FLOAT32, computes[c]);
    sp_mlp *mlp = t.mlp;
    enum { N = 8, STEPS = 3 };
    sp_mlp_acts *a = NULL;
    assert_int_equal(sp_mlp_acts_new(mlp, N, &a), 0);
    float tg[N * 16];
    sp_diag d = {""};
    for (int s = 0; s < STEPS; s++) {
      sp_mlp_batch(mlp, (uint64_t)s, 0, N, a->x[0], tg);
      /* the first norm's update, predicted from its input */
      const sp_mlp_layer *L1 = &mlp->layers[1];
      float before[64];
      for (int k = 0; k < 64; k++) {
        float v = 0;
        if (t.bdt[L1->running_mean] == SP_FLOAT64) {
          double dv;
          memcpy(&dv, t.buf[L1->running_mean] + 8 * (size_t)k, 8);
          v = (float)dv; /* exact: it was computed in float32 */
        } else {
          uint16_t h;
          memcpy(&h, t.buf[L1->running_mean] + 2 * (size_t)k, 2);
          uint32_t u = sp_bf16_to_f32_bits(h);
          memcpy(&v, &u, 4);
        }
        before[k] = v;
      }
      for (size_t l = 0; l < mlp->n_layers; l++) {
        assert_int_equal(sp_mlp_forward(mlp, l, &t.io, a, N, &d), 0);
        if (l != 1) continue;
        for (int k = 0; k < 64; k++) {
          float sum = 0;
          for (int i = 0; i < N; i++) sum += a->x[1][i * 64 + k];
          float want = 0.9f * before[k] + 0.1f * (sum / (float)N);
          if (t.bdt[L1->running_mean] == SP_FLOAT64) {
            double got;
            memcpy(&got, t.buf[L1->running_mean] + 8 * (size_t)k, 8);
            assert_true(got == (double)want);
          } else {
            uint16_t got;
            memcpy(&got, t.buf[L1->running_mean] + 2 * (size_t)k, 2);
            assert_int_equal(got, sp_f32_to_bf16_bits(fbits(want)));
          }
        }
      }
      sp_mlp_loss(mlp, a, tg, SP_FLOAT32);
      assert_int_equal(tnet_backward(&t, a, &d), 0);
      sp_mlp_count_step(mlp, &t.io);
    }
    for (size_t l = 0; l < mlp->n_layers; l++) {
      const sp_mlp_layer *L = &mlp->layers[l];
      if (L->kind != SP_MLP_NORM) continue;
      const sp_tensor_spec *rs = &m->buffers[L->running_mean];
      /* dtype kept (c == 0) or the compute dtype (c == 1) */
      sp_dtype want = c == 0 ? rs->dtype : SP_BFLOAT16;
      assert_int_equal(t.bdt[L->running_mean], want);
      size_t es = sp_dtype_size(want);
      size_t nonzero = 0;
      for (int64_t k = 0; k < rs->numel; k++) {
        bool z = true;
        for (size_t b = 0; b < es; b++)
          z = z && t.buf[L->running_mean][(size_t)k * es + b] == 0;
        nonzero += !z;
      }
      assert_true(nonzero > (size_t)rs->numel / 2);
      int32_t nb = L->num_batches_tracked;
      assert_int_equal(read_int(t.buf[nb], t.bdt[nb]), STEPS);
      assert_int_equal(t.bdt[nb], m->buffers[nb].dtype);
      assert_int_equal(t.buf[L->seen][0], 1);
    }
    assert_int_equal(read_int(t.buf[mlp->step_buffer], SP_INT64), STEPS);

    /* an integer buffer cannot change dtype */
    t.bdt[mlp->layers[4].num_batches_tracked] = SP_INT64;
    assert_int_equal(sp_mlp_forward(mlp, 0, &t.io, a, N, &d), 0);
    assert_int_equal(sp_mlp_forward(mlp, 1, &t.io, a, N, &d), 0);
    assert_int_equal(sp_mlp_forward(mlp, 2, &t.io, a, N, &d), 0);
    assert_int_equal(sp_mlp_forward(mlp, 3, &t.io, a, N, &d), 0);
    assert_int_equal(sp_mlp_forward(mlp, 4, &t.io, a, N, &d), SP_EINVAL);
    assert_non_null(strstr(d.msg, "layers.4.num_batches_tracked"));
    t.bdt[mlp->layers[4].num_batches_tracked] = SP_INT32;
    /* a bad global batch */
    assert_int_equal(sp_mlp_forward(mlp, 1, &t.io, a, N - 1, &d), SP_EINVAL);
    assert_int_equal(sp_mlp_forward(mlp, 99, &t.io, a, N, &d), SP_ERANGE);

    sp_mlp_acts_free(a);
    tnet_free(&t);
  }
  sp_model_free(m);
}

/* ------------------------------------------------------------------ */
/* the reference run                                                   */
/* ------------------------------------------------------------------ */

enum { REF_STEPS = 20, REF_BATCH = 32 };
#define REF_LR 0.2

static void run_ref(const sp_model *m, const sp_job *j, double *losses,
                    void **params, void **buffers) {
  sp_diag d = {""};
  int rc = sp_mlp_reference_run(m, j, REF_STEPS, REF_BATCH, REF_LR, losses,
                                params, buffers, &d);
  if (rc != 0) fail_msg("reference run: %s (%s)", d.msg, sp_err_name(rc));
}

static void expect_decrease(const char *what, const double *l) {
  printf("%-28s loss %.5f -> %.5f -> %.5f\n", what, l[0], l[REF_STEPS / 2],
         l[REF_STEPS - 1]);
  for (int s = 0; s < REF_STEPS; s++) assert_true(isfinite(l[s]));
  double head = (l[0] + l[1] + l[2]) / 3;
  double tail = (l[REF_STEPS - 1] + l[REF_STEPS - 2] + l[REF_STEPS - 3]) / 3;
  assert_true(tail < 0.8 * head);
}

static sp_job linear_job(uint32_t world) {
  sp_job j;
  sp_job_init(&j);
  j.world_size = world;
  assert_int_equal(sp_strlist_add(&j.wrap_types, "Linear"), 0);
  return j;
}

static void test_reference_run(void **state) {
  (void)state;
  sp_model *m = load(MLP_JSON);
  size_t np = 0;
  for (size_t p = 0; p < m->n_params; p++) np += (size_t)m->params[p].numel;

  double l32[REF_STEPS], l32b[REF_STEPS];
  void *p32 = NULL, *p32b = NULL, *b32 = NULL;
  sp_job j = linear_job(4);
  run_ref(m, &j, l32, &p32, &b32);
  expect_decrease("float32", l32);
  /* deterministic, and the world size does not matter */
  sp_job j1 = linear_job(1);
  run_ref(m, &j1, l32b, &p32b, NULL);
  assert_memory_equal(l32, l32b, sizeof l32);
  assert_memory_equal(p32, p32b, np * 4);
  free(p32b);
  sp_job_clear(&j1);
  /* HYBRID_SHARD's group size does not have to divide a world of 1 */
  sp_job jh = linear_job(4);
  jh.strategy = SP_HYBRID_SHARD;
  jh.shard_group_size = 2;
  run_ref(m, &jh, l32b, NULL, NULL);
  assert_memory_equal(l32, l32b, sizeof l32);
  sp_job_clear(&jh);

  /* buffers come back in model order: step, then the norms' */
  int64_t step;
  memcpy(&step, b32, 8);
  assert_int_equal(step, REF_STEPS);
  free(b32);

  /* bfloat16 compute */
  double lb[REF_STEPS];
  void *pb = NULL;
  j.mp.enabled = true;
  j.mp.param_dtype = SP_BFLOAT16;
  run_ref(m, &j, lb, &pb, NULL);
  expect_decrease("param_dtype bfloat16", lb);
  assert_memory_not_equal(p32, pb, np * 4);
  double maxdiff = 0;
  for (size_t i = 0; i < np; i++)
    maxdiff = fmax(maxdiff, fabs((double)((float *)p32)[i] - ((float *)pb)[i]));
  assert_true(maxdiff > 0 && maxdiff < 0.05);

  /* keep_low_precision_grads: at world size 1 every cast on the gradient
   * path is a round trip from param_dtype (reduce in param_dtype, then
   * either back to float32, exact, or kept in bfloat16), so the update is
   * the same; it differs once a reduce over ranks leaves values that
   * param_dtype cannot hold (the sharded runtime's tests). */
  double lk[REF_STEPS];
  void *pk = NULL;
  j.mp.keep_low_precision_grads = true;
  run_ref(m, &j, lk, &pk, NULL);
  assert_memory_equal(pb, pk, np * 4);
  free(pk);
  j.mp.keep_low_precision_grads = false;

  /* float32 compute with a bfloat16 reduce: the gradient's round trip
   * through reduce_dtype changes the result, in both keep settings */
  j.mp.param_dtype = SP_FLOAT32;
  j.mp.reduce_dtype = SP_BFLOAT16;
  double lr[REF_STEPS];
  void *pr = NULL, *prk = NULL;
  run_ref(m, &j, lr, &pr, NULL);
  expect_decrease("reduce_dtype bfloat16", lr);
  assert_memory_equal(l32, lr, sizeof(double)); /* same first forward */
  assert_memory_not_equal(p32, pr, np * 4);
  j.mp.keep_low_precision_grads = true;
  run_ref(m, &j, lr, &prk, NULL);
  assert_memory_equal(pr, prk, np * 4);
  free(pr);
  free(prk);

  /* errors */
  sp_diag d = {""};
  assert_int_equal(sp_mlp_reference_run(m, &j, 1, 0, 0.1, NULL, NULL, NULL, &d),
                   SP_EINVAL);
  sp_model *rn = load(RESNET_JSON);
  assert_int_equal(
      sp_mlp_reference_run(rn, &j, 1, 4, 0.1, NULL, NULL, NULL, &d),
      SP_EUNSUPPORTED);
  sp_model_free(rn);

  free(p32);
  free(pb);
  sp_job_clear(&j);
  sp_model_free(m);
}

static void test_reference_run_buffers(void **state) {
  (void)state;
  sp_model *m = load(MLP_BUFFERS_JSON);
  sp_job j = linear_job(2);
  j.mp.enabled = true;
  j.mp.param_dtype = SP_BFLOAT16;
  j.mp.buffer_dtype = SP_FLOAT16;
  double l[REF_STEPS];
  void *bufs = NULL;
  run_ref(m, &j, l, NULL, &bufs);
  expect_decrease("bf16 params, f16 buffers", l);
  /* buffers packed in model order, each in its compute dtype */
  sp_plan *pl = NULL;
  sp_diag d = {""};
  assert_int_equal(sp_plan_build(m, &j, &pl, &d), 0);
  size_t off = 0;
  for (size_t b = 0; b < m->n_buffers; b++) {
    const sp_tensor_spec *s = &m->buffers[b];
    sp_dtype dt = pl->buffers[b].compute_dtype;
    assert_int_equal(pl->buffers[b].buffer, (int32_t)b);
    if (sp_dtype_is_floating(s->dtype)) assert_int_equal(dt, SP_FLOAT16);
    const unsigned char *p = (const unsigned char *)bufs + off;
    if (strcmp(s->local_name, "num_batches_tracked") == 0 ||
        strcmp(s->local_name, "step") == 0)
      assert_int_equal(read_int(p, dt), REF_STEPS);
    if (strcmp(s->local_name, "seen") == 0) assert_int_equal(p[0], 1);
    off += (size_t)s->numel * sp_dtype_size(dt);
  }
  sp_plan_free(pl);
  free(bufs);
  sp_job_clear(&j);
  sp_model_free(m);
}

static int t_all_reduce_fails(void *user, float *buf, size_t n, sp_diag *d) {
  (void)user;
  (void)buf;
  (void)n;
  return sp_diag_set(d, SP_EIO,
                     "comm 'comm/world' rank 0/2 all_reduce: "
                     "peer gone");
}

/* A failed all-reduce of a RunningNorm's batch sum reads as one message:
 * the module, what failed, the cause, with no stray ": :". */
static void test_norm_all_reduce_error(void **state) {
  (void)state;
  sp_model *m = load(MLP_JSON);
  tnet t;
  tnet_init(&t, m, SP_FLOAT32, SP_DTYPE_INVALID);
  t.io.all_reduce_sum = t_all_reduce_fails;
  enum { N = 4 };
  sp_mlp_acts *a = NULL;
  assert_int_equal(sp_mlp_acts_new(t.mlp, N, &a), 0);
  float tg[N * 64];
  sp_mlp_batch(t.mlp, 0, 0, N, a->x[0], tg);
  sp_diag d = {""};
  assert_int_equal(tnet_forward(&t, a, 2 * N, &d), SP_EIO);
  printf("  %s\n", d.msg);
  assert_non_null(strstr(d.msg, "all-reduce of the batch sum: comm "));
  assert_null(strstr(d.msg, ": :"));
  sp_mlp_acts_free(a);
  tnet_free(&t);
  sp_model_free(m);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_new_specs),
      cmocka_unit_test(test_data_and_init_determinism),
      cmocka_unit_test(test_gradcheck),
      cmocka_unit_test(test_batch_split),
      cmocka_unit_test(test_low_precision_rounding),
      cmocka_unit_test(test_buffers),
      cmocka_unit_test(test_reference_run),
      cmocka_unit_test(test_reference_run_buffers),
      cmocka_unit_test(test_norm_all_reduce_error),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
