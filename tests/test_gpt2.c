/* The GPT-2 model of shardplane-worker (client/worker/gpt2.h): its spec
 * reader, initialisation and data rule, and its loss and every parameter
 * gradient against PyTorch (tests/support/gpt2_torch.py, a
 * GPT2LMHeadModel with Hugging Face's names) on one batch of gpt2-tiny.
 *
 * The bound: float32 on both sides, the same operations in other orders
 * (BLAS blocking, torch's reductions), so the differences are float32
 * rounding, amplified a little by LayerNorm's 1/std and the softmax: the
 * loss within 1e-5 relative and each gradient tensor within 1e-4 of its
 * largest element (max |c - torch| / max |torch|). What the test measures
 * is printed; on gpt2-tiny both are around 1e-7 and 1e-6. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <math.h>
#include <sys/wait.h>
#include <unistd.h>

#include "plan/model.h"
#include "safetensors/safetensors.h"
#include "support/testutil.h"
#include "worker/gpt2.h"
#include "worker/gpt2_data.h"
#include "worker/gpt2_cpu.h"

#define PYTHON "/usr/bin/python3"
#define TORCH_SCRIPT SP_TEST_DATA "/../support/gpt2_torch.py"

static sp_model *load_spec(const char *name) {
  char path[512];
  snprintf(path, sizeof path, "%s/models/%s.json", SP_EXAMPLES, name);
  sp_model *m = NULL;
  sp_diag d = {""};
  if (sp_model_load_file(path, &m, &d) != 0) fail_msg("%s", d.msg);
  return m;
}

/* ---- a single process's io: every tensor in a plain array ---- */

typedef struct plain {
  const sp_model *m;
  float **p, **g;
  void **b;
} plain;

static void *pl_param(void *u, int32_t i) { return ((plain *)u)->p[i]; }
static void *pl_grad(void *u, int32_t i) { return ((plain *)u)->g[i]; }
static sp_dtype pl_dtype(void *u, int32_t i) {
  (void)u;
  (void)i;
  return SP_FLOAT32;
}
static void *pl_buffer(void *u, int32_t i) { return ((plain *)u)->b[i]; }
static sp_dtype pl_bdtype(void *u, int32_t i) {
  return ((plain *)u)->m->buffers[i].dtype;
}

static void plain_init(plain *pl, const sp_model *m) {
  pl->m = m;
  pl->p = calloc(m->n_params, sizeof *pl->p);
  pl->g = calloc(m->n_params, sizeof *pl->g);
  pl->b = calloc(m->n_buffers + 1, sizeof *pl->b);
  assert_non_null(pl->p);
  assert_non_null(pl->g);
  assert_non_null(pl->b);
  for (size_t i = 0; i < m->n_params; i++) {
    size_t n = (size_t)m->params[i].numel;
    pl->p[i] = malloc(n * sizeof(float));
    pl->g[i] = calloc(n, sizeof(float));
    assert_non_null(pl->p[i]);
    assert_non_null(pl->g[i]);
    sp_gpt2_init_param(NULL, m, (int32_t)i, 0, (int64_t)n, pl->p[i]);
  }
  for (size_t i = 0; i < m->n_buffers; i++) {
    const sp_tensor_spec *t = &m->buffers[i];
    pl->b[i] = malloc((size_t)t->numel * sp_dtype_size(t->dtype) + 1);
    assert_non_null(pl->b[i]);
    sp_gpt2_init_buffer(NULL, m, (int32_t)i, pl->b[i]);
  }
}

static void plain_free(plain *pl) {
  for (size_t i = 0; i < pl->m->n_params; i++) {
    free(pl->p[i]);
    free(pl->g[i]);
  }
  for (size_t i = 0; i < pl->m->n_buffers; i++) free(pl->b[i]);
  free(pl->p);
  free(pl->g);
  free(pl->b);
}

/* forward and backward of the batch in a->tok / a->tgt; the mean loss */
static double fwd_bwd(const sp_gpt2 *g, plain *pl, sp_gpt2_acts *a) {
  sp_gpt2_io io = {pl_param, pl_grad, pl_dtype, pl_buffer, pl_bdtype, pl};
  sp_diag d = {""};
  double loss = 0, denom = (double)(a->B * a->T);
  int rc = sp_gpt2_embed_forward(g, &io, a, &d);
  for (int64_t l = 0; rc == 0 && l < g->n_layer; l++)
    rc = sp_gpt2_block_forward(g, (size_t)l, &io, a, &d);
  if (rc == 0) rc = sp_gpt2_head_forward(g, &io, a, denom, &loss, &d);
  if (rc == 0) rc = sp_gpt2_head_backward(g, &io, a, denom, &d);
  for (int64_t l = g->n_layer; rc == 0 && l-- > 0;)
    rc = sp_gpt2_block_backward(g, (size_t)l, &io, a, &d);
  if (rc == 0) rc = sp_gpt2_embed_backward(g, &io, a, &d);
  if (rc != 0) fail_msg("%s", d.msg);
  return loss;
}

/* ---- tests without PyTorch ---- */

/* Activation checkpointing (each block recomputed from its kept input in
 * backward) gives the gradients of the run without it, bit for bit, step
 * after step: the same kernels on the same inputs in the same order. The
 * float32-only layout (no V x C scratch) is the trainer's; the plain run
 * is the full one. Three SGD steps on gpt2-tiny and gpt2-mini, also with
 * two micro-batches accumulating into the gradients. */
static void ckpt_steps(const char *name, size_t B, size_t T) {
  sp_model *m = load_spec(name);
  sp_gpt2 *g = NULL;
  sp_diag d = {""};
  if (sp_gpt2_new(m, &g, &d) != 0) fail_msg("%s", d.msg);
  plain full, ck;
  plain_init(&full, m);
  plain_init(&ck, m);
  sp_gpt2_acts *af = NULL, *ac = NULL;
  assert_int_equal(sp_gpt2_acts_new(g, B, T, &af), 0);
  if (sp_gpt2_acts_new_with(g, B, T, true, true, &ac, &d) != 0)
    fail_msg("%s", d.msg);
  /* only the blocks' inputs and one block's set are kept */
  assert_true(ac->mem.cat[SP_ACT_SAVED] < af->mem.cat[SP_ACT_SAVED]);
  assert_true(ac->mem.cat[SP_ACT_RECOMPUTE] > 0);
  assert_int_equal(af->mem.cat[SP_ACT_RECOMPUTE], 0);
  assert_true(ac->mem.total < af->mem.total);
  for (int step = 0; step < 3; step++) {
    for (size_t i = 0; i < m->n_params; i++) {
      size_t n = (size_t)m->params[i].numel;
      memset(full.g[i], 0, n * sizeof(float));
      memset(ck.g[i], 0, n * sizeof(float));
    }
    for (int micro = 0; micro < 2; micro++) {
      for (size_t i = 0; i < B * T; i++) {
        uint64_t h = (uint64_t)(step * 7919 + micro * 104729) + i * 2654435761u;
        af->tok[i] = ac->tok[i] = (int32_t)(h % (uint64_t)g->V);
        af->tgt[i] = ac->tgt[i] = (int32_t)((h >> 7) % (uint64_t)g->V);
      }
      double lf = fwd_bwd(g, &full, af), lc = fwd_bwd(g, &ck, ac);
      assert_memory_equal(&lf, &lc, sizeof lf);
    }
    for (size_t i = 0; i < m->n_params; i++) {
      size_t n = (size_t)m->params[i].numel;
      if (memcmp(full.g[i], ck.g[i], n * sizeof(float)) != 0)
        fail_msg("%s step %d: %s's gradient differs with checkpointing", name,
                 step, m->params[i].fqn);
      for (size_t k = 0; k < n; k++) {
        full.p[i][k] -= 0.1f * full.g[i][k];
        ck.p[i][k] -= 0.1f * ck.g[i][k];
      }
    }
  }
  sp_gpt2_acts_free(af);
  sp_gpt2_acts_free(ac);
  plain_free(&full);
  plain_free(&ck);
  sp_gpt2_free(g);
  sp_model_free(m);
}

static void test_checkpointing_bit_identical(void **state) {
  (void)state;
  ckpt_steps("gpt2-tiny", 2, 16);
  ckpt_steps("gpt2-mini", 2, 32);
}

static void test_spec_reader(void **state) {
  (void)state;
  sp_model *m = load_spec("gpt2-tiny");
  sp_gpt2 *g = NULL;
  sp_diag d = {""};
  if (sp_gpt2_new(m, &g, &d) != 0) fail_msg("%s", d.msg);
  assert_int_equal(g->n_layer, 2);
  assert_int_equal(g->C, 64);
  assert_int_equal(g->n_head, 4);
  assert_int_equal(g->ctx, 64);
  assert_int_equal(g->V, 256);
  assert_true(g->blocks[1].mask >= 0);
  sp_gpt2_free(g);
  sp_model_free(m);
  /* GPT-2 small: no config, heads of 64 */
  m = load_spec("gpt2");
  assert_int_equal(sp_gpt2_new(m, &g, &d), 0);
  assert_int_equal(g->n_head, 12);
  assert_int_equal(g->n_layer, 12);
  sp_gpt2_free(g);
  sp_model_free(m);
  /* the MLP is no GPT-2, and the message says what is missing */
  char path[512];
  snprintf(path, sizeof path, "%s/mlp.json", SP_EXAMPLES);
  assert_int_equal(sp_model_load_file(path, &m, &d), 0);
  assert_int_equal(sp_gpt2_new(m, &g, &d), SP_EUNSUPPORTED);
  assert_non_null(strstr(d.msg, "transformer.wte.weight"));
  assert_null(g);
  sp_model_free(m);
}

static void test_init(void **state) {
  (void)state;
  sp_model *m = load_spec("gpt2-tiny");
  plain pl;
  plain_init(&pl, m);
  /* the matrices are normal(0, 0.02); the residual projections
   * normal(0, 0.02 / sqrt(2 L)) */
  static const struct {
    const char *fqn;
    double std;
  } k[] = {{"transformer.wte.weight", 0.02},
           {"transformer.h.0.attn.c_attn.weight", 0.02},
           {"transformer.h.1.mlp.c_proj.weight", 0.01}};
  for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
    int32_t p = sp_model_find_param(m, k[i].fqn);
    size_t n = (size_t)m->params[p].numel;
    double s = 0, s2 = 0;
    for (size_t j = 0; j < n; j++) {
      s += pl.p[p][j];
      s2 += (double)pl.p[p][j] * pl.p[p][j];
    }
    double mean = s / (double)n, std = sqrt(s2 / (double)n - mean * mean);
    assert_true(fabs(mean) < 4 * k[i].std / sqrt((double)n));
    assert_true(fabs(std / k[i].std - 1) < 0.05);
  }
  /* and another slice of a parameter is the same values (ranks init their
   * shards on their own) */
  int32_t p = sp_model_find_param(m, "transformer.wte.weight");
  float part[10];
  sp_gpt2_init_param(NULL, m, p, 1000, 10, part);
  assert_memory_equal(part, pl.p[p] + 1000, sizeof part);
  p = sp_model_find_param(m, "transformer.h.0.ln_1.weight");
  assert_true(pl.p[p][5] == 1.0f);
  p = sp_model_find_param(m, "transformer.h.0.ln_1.bias");
  assert_true(pl.p[p][5] == 0.0f);
  int32_t b = sp_model_find_buffer(m, "transformer.h.0.attn.bias");
  const uint8_t *mask = pl.b[b];
  assert_int_equal(mask[0], 1);
  assert_int_equal(mask[1], 0);
  assert_int_equal(mask[64 * 10 + 10], 1);
  assert_int_equal(mask[64 * 10 + 11], 0);
  b = sp_model_find_buffer(m, "transformer.h.0.attn.masked_bias");
  assert_true(*(float *)pl.b[b] == -1e4f);
  plain_free(&pl);
  sp_model_free(m);
}

/* The window rule of gpt2_data.h, and the errors that name --data. */
static void test_data(void **state) {
  (void)state;
  enum { N = 1000, T = 16 };
  uint8_t bytes[N];
  for (int i = 0; i < N; i++) bytes[i] = (uint8_t)(i * 7 + i / 3);
  char *path = sp_test_path(sp_test_dir, "corpus.txt");
  sp_test_write_file(path, bytes, N);
  sp_gpt2_data *data = NULL;
  sp_diag d = {""};
  if (sp_gpt2_data_open(path, T, &data, &d) != 0) fail_msg("%s", d.msg);
  assert_int_equal(data->n_val, N / 10);
  assert_int_equal(data->n_train, N - N / 10);
  int32_t tok[3 * T], tgt[3 * T];
  sp_gpt2_data_train(data, 5, 7, 3, T, tok, tgt);
  for (int k = 0; k < 3; k++) {
    size_t start = (size_t)(sp_gpt2_window(5, 7 + (uint64_t)k) %
                            (uint64_t)(N - N / 10 - T));
    for (int t = 0; t < T; t++) {
      assert_int_equal(tok[k * T + t], bytes[start + (size_t)t]);
      assert_int_equal(tgt[k * T + t], bytes[start + (size_t)t + 1]);
    }
  }
  /* windows differ between steps and samples */
  assert_true(sp_gpt2_window(5, 7) != sp_gpt2_window(6, 7));
  assert_true(sp_gpt2_window(5, 7) != sp_gpt2_window(5, 8));
  assert_int_equal(sp_gpt2_data_val_count(data, T), (N / 10 - 1) / T);
  sp_gpt2_data_val(data, 1, T, tok, tgt);
  assert_int_equal(tok[0], bytes[N - N / 10 + T]);
  assert_int_equal(tgt[T - 1], bytes[N - N / 10 + 2 * T]);
  sp_gpt2_data_free(data);
  /* too short for windows of 200 */
  assert_int_equal(sp_gpt2_data_open(path, 200, &data, &d), SP_EINVAL);
  assert_non_null(strstr(d.msg, "--data"));
  assert_non_null(strstr(d.msg, "corpus.txt"));
  char *missing = sp_test_path(sp_test_dir, "missing.txt");
  assert_int_equal(sp_gpt2_data_open(missing, T, &data, &d), SP_EIO);
  assert_non_null(strstr(d.msg, "missing.txt"));
  free(missing);
  free(path);
  /* the default corpus, where the system has it */
  if (access(SP_GPT2_DEFAULT_CORPUS, R_OK) == 0) {
    if (sp_gpt2_data_open(NULL, 64, &data, &d) != 0) fail_msg("%s", d.msg);
    assert_true(data->n > 100000);
    sp_gpt2_data_free(data);
  }
}

/* GELU (tanh approximation) with gpt2_cpu.c's float exp against the
 * formula in double, on a fine grid of [-30, 30]: within 2e-7 of
 * max(1, |x|) (measured 1.1e-7), its derivative within 1e-6 (measured
 * 4e-7: its second term multiplies tanh's error by x (1 + 0.134 x^2)
 * sech^2, up to about 3 near |x| = 1.5); and NaN and the infinities pass
 * as the formula says (NaN stays NaN, +inf, -inf gives -0 or NaN). */
static void test_gelu(void **state) {
  (void)state;
  enum { N = 600001 };
  float *x = malloc(N * sizeof *x), *y = malloc(N * sizeof *y);
  float *one = malloc(N * sizeof *one), *g = malloc(N * sizeof *g);
  assert_non_null(x);
  assert_non_null(y);
  assert_non_null(one);
  assert_non_null(g);
  for (int i = 0; i < N; i++) {
    x[i] = -30.0f + 60.0f * (float)i / (N - 1);
    one[i] = 1.0f;
  }
  sp_gpt2_cpu_gelu_fwd(y, x, N);
  sp_gpt2_cpu_gelu_bwd(g, x, one, N);
  double worst = 0, worst_g = 0;
  for (int i = 0; i < N; i++) {
    double v = x[i], s = 0.7978845608028654;
    double th = tanh(s * (v + 0.044715 * v * v * v));
    double ref = 0.5 * v * (1 + th);
    double dref = 0.5 * (1 + th) +
                  0.5 * v * (1 - th * th) * s * (1 + 3 * 0.044715 * v * v);
    double scale = fabs(v) > 1 ? fabs(v) : 1;
    if (fabs(y[i] - ref) / scale > worst) worst = fabs(y[i] - ref) / scale;
    if (fabs(g[i] - dref) / scale > worst_g)
      worst_g = fabs(g[i] - dref) / scale;
  }
  printf("gelu: largest error %.3g, derivative %.3g (of max(1, |x|))\n", worst,
         worst_g);
  assert_true(worst <= 2e-7);
  assert_true(worst_g <= 1e-6);
  float sp[3] = {NAN, INFINITY, -INFINITY}, so[3];
  sp_gpt2_cpu_gelu_fwd(so, sp, 3);
  assert_true(isnan(so[0]));
  assert_true(so[1] == INFINITY);
  assert_true(so[2] == 0.0f || isnan(so[2])); /* -inf * 0 in the formula */
  free(x);
  free(y);
  free(one);
  free(g);
}

/* Causal attention in the kernels' query tiles (a sequence of 150: two
 * whole tiles and a partial one), with and without a mask that also drops
 * some keys below the diagonal, against the formula in double: the
 * probabilities, the output and dq, dk, dv. The kernels only leave out
 * masked terms, so the differences are float32 rounding (about 1e-7 of
 * each tensor's largest element; the bound is 1e-5). */
static double att_err(const float *got, const double *want, size_t n) {
  double worst = 0, top = 0;
  for (size_t i = 0; i < n; i++) {
    if (fabs(want[i]) > top) top = fabs(want[i]);
    if (fabs(got[i] - want[i]) > worst) worst = fabs(got[i] - want[i]);
  }
  return worst / (top > 0 ? top : 1);
}

static void test_attention(void **state) {
  (void)state;
  enum { B = 2, T = 150, C = 32, NH = 2, HS = C / NH, C3 = 3 * C };
  size_t nqkv = (size_t)B * T * C3, ny = (size_t)B * T * C;
  size_t natt = (size_t)B * NH * T * T;
  float *qkv = malloc(nqkv * 4), *dy = malloc(ny * 4), *y = malloc(ny * 4);
  /* not zeroed: the kernel writes every probability, the masked 0s too */
  float *att = malloc(natt * 4), *datt = malloc((size_t)T * T * 4);
  float *dqkv = malloc(nqkv * 4);
  double *ry = malloc(ny * 8), *ratt = malloc(natt * 8);
  double *rd = malloc(nqkv * 8), *dp = malloc((size_t)T * 8);
  uint8_t *allow = malloc((size_t)T * T);
  assert_true(qkv && dy && y && att && datt && dqkv && ry && ratt && rd && dp &&
              allow);
  sp_test_rng rng = {7};
  for (size_t i = 0; i < nqkv; i++)
    qkv[i] = (float)((double)sp_test_rng_below(&rng, 2001) / 1000.0 - 1.0);
  for (size_t i = 0; i < ny; i++)
    dy[i] = (float)((double)sp_test_rng_below(&rng, 2001) / 1000.0 - 1.0);
  for (size_t i = 0; i < (size_t)T * T; i++)
    allow[i] = sp_test_rng_below(&rng, 5) != 0 || i % (T + 1) == 0;
  double scale = 1.0 / sqrt((double)HS);
  for (int masked = 0; masked < 2; masked++) {
    const uint8_t *al = masked ? allow : NULL;
    memset(rd, 0, nqkv * 8);
    for (int b = 0; b < B; b++)
      for (int h = 0; h < NH; h++)
        for (int t = 0; t < T; t++) {
          const float *base = qkv + (size_t)b * T * C3 + (size_t)h * HS;
          const float *q = base + (size_t)t * C3;
          double *p = ratt + (((size_t)b * NH + h) * T + t) * T, mx = -1e300;
          for (int u = 0; u < T; u++) {
            bool on = u <= t && (!al || al[(size_t)t * T + u]);
            double sc = 0;
            for (int c = 0; on && c < HS; c++)
              sc += (double)q[c] * base[(size_t)u * C3 + C + c];
            p[u] = on ? sc * scale : -INFINITY;
            if (on && p[u] > mx) mx = p[u];
          }
          double sum = 0;
          for (int u = 0; u < T; u++) sum += p[u] = exp(p[u] - mx);
          for (int u = 0; u < T; u++) p[u] /= sum;
          const float *g = dy + ((size_t)b * T + t) * C + (size_t)h * HS;
          double *o = ry + ((size_t)b * T + t) * C + (size_t)h * HS, dot = 0;
          for (int c = 0; c < HS; c++) o[c] = 0;
          for (int u = 0; u < T; u++) {
            const float *v = base + (size_t)u * C3 + 2 * C;
            dp[u] = 0;
            for (int c = 0; c < HS; c++) {
              o[c] += p[u] * v[c];
              dp[u] += (double)g[c] * v[c];
            }
            dot += p[u] * dp[u];
          }
          double *dq = rd + (size_t)b * T * C3 + (size_t)h * HS;
          for (int u = 0; u < T; u++) {
            double ds = p[u] * (dp[u] - dot) * scale;
            for (int c = 0; c < HS; c++) {
              dq[(size_t)t * C3 + c] += ds * base[(size_t)u * C3 + C + c];
              dq[(size_t)u * C3 + C + c] += ds * q[c];
              dq[(size_t)u * C3 + 2 * C + c] += p[u] * g[c];
            }
          }
        }
    sp_gpt2_cpu_attention_fwd(y, att, qkv, al, B, T, C, NH);
    sp_gpt2_cpu_attention_bwd(dqkv, datt, dy, qkv, att, B, T, C, NH);
    double e_att = att_err(att, ratt, natt), e_y = att_err(y, ry, ny);
    double e_d = att_err(dqkv, rd, nqkv);
    printf(
        "attention (T %d, %s): probabilities %.3g, output %.3g, "
        "dqkv %.3g of the largest\n",
        T, masked ? "mask" : "causal", e_att, e_y, e_d);
    assert_true(e_att <= 1e-5 && e_y <= 1e-5 && e_d <= 1e-5);
  }
  free(qkv), free(dy), free(y), free(att), free(datt), free(dqkv);
  free(ry), free(ratt), free(rd), free(dp), free(allow);
}

/* ---- against PyTorch ---- */

static bool have_torch(void) {
  return access(PYTHON, X_OK) == 0 &&
         system("'" PYTHON "' -c 'import torch, numpy' >/dev/null 2>&1") == 0;
}

static double max_abs(const float *v, size_t n) {
  double m = 0;
  for (size_t i = 0; i < n; i++)
    if (fabs(v[i]) > m) m = fabs(v[i]);
  return m;
}

/* Tensor `name` of f, which must be of dtype dt and `bytes` long. */
static void read_tensor(const sp_safetensors_file *f, const char *name,
                        sp_dtype dt, void *dst, size_t bytes) {
  const sp_safetensors_tensor *t = NULL;
  sp_diag d = {""};
  if (sp_safetensors_get(f, name, &t, &d) != 0) fail_msg("%s", d.msg);
  assert_int_equal(t->dtype, dt);
  if (sp_safetensors_tensor_read(t, dst, bytes) != 0)
    fail_msg("%s: %zu bytes expected", name, bytes);
}

static void test_grad_vs_torch(void **state) {
  (void)state;
  sp_model *m = load_spec("gpt2-tiny");
  sp_gpt2 *g = NULL;
  sp_diag d = {""};
  if (sp_gpt2_new(m, &g, &d) != 0) fail_msg("%s", d.msg);
  plain pl;
  plain_init(&pl, m);
  enum { B = 4, T = 64 };
  sp_gpt2_acts *a = NULL;
  assert_int_equal(sp_gpt2_acts_new(g, B, T, &a), 0);
  /* text-like bytes from a fixed generator */
  sp_test_rng rng = {14};
  for (int i = 0; i < B * T; i++) {
    a->tok[i] = (int32_t)(32 + sp_test_rng_below(&rng, 95));
    a->tgt[i] = (int32_t)(32 + sp_test_rng_below(&rng, 95));
  }
  double loss = fwd_bwd(g, &pl, a);
  /* the model and the batch for torch */
  sp_safetensors_entry *e = calloc(m->n_params + 2, sizeof *e);
  assert_non_null(e);
  size_t n = 0;
  for (size_t i = 0; i < m->n_params; i++) {
    const sp_tensor_spec *t = &m->params[i];
    e[n] = (sp_safetensors_entry){.name = t->fqn,
                                  .dtype = SP_FLOAT32,
                                  .ndim = (size_t)t->ndim,
                                  .data = pl.p[i]};
    for (int k = 0; k < t->ndim; k++) e[n].shape[k] = (uint64_t)t->shape[k];
    n++;
  }
  e[n++] = (sp_safetensors_entry){.name = "tokens",
                                  .dtype = SP_INT32,
                                  .ndim = 2,
                                  .shape = {B, T},
                                  .data = a->tok};
  e[n++] = (sp_safetensors_entry){.name = "targets",
                                  .dtype = SP_INT32,
                                  .ndim = 2,
                                  .shape = {B, T},
                                  .data = a->tgt};
  char *in = sp_test_path(sp_test_dir, "in.safetensors");
  char *out = sp_test_path(sp_test_dir, "out.safetensors");
  if (sp_safetensors_write(in, e, n, NULL, 0, &d) != 0) fail_msg("%s", d.msg);
  char cmd[4096];
  snprintf(cmd, sizeof cmd, "'%s' '%s' grad '%s' '%s' %lld", PYTHON,
           TORCH_SCRIPT, in, out, (long long)g->n_head);
  int st = system(cmd);
  assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  sp_safetensors_file *f = NULL;
  if (sp_safetensors_open(out, &f, &d) != 0) fail_msg("%s", d.msg);
  double tl = 0;
  read_tensor(f, "loss", SP_FLOAT64, &tl, sizeof tl);
  double loss_err = fabs(loss - tl) / fabs(tl);
  printf("loss: shardplane %.9f torch %.9f, relative error %.3g\n", loss, tl,
         loss_err);
  assert_true(loss_err <= 1e-5);
  /* a fresh model's loss is about log(256): the test is not vacuous */
  assert_true(fabs(tl - log(256.0)) < 0.5);
  double worst = 0;
  const char *worst_fqn = "";
  for (size_t i = 0; i < m->n_params; i++) {
    const sp_tensor_spec *t = &m->params[i];
    size_t k = (size_t)t->numel;
    float *tg = malloc(k * sizeof *tg);
    assert_non_null(tg);
    char name[300];
    snprintf(name, sizeof name, "grad.%s", t->fqn);
    read_tensor(f, name, SP_FLOAT32, tg, k * sizeof *tg);
    double ref = max_abs(tg, k), err = 0;
    assert_true(ref > 0); /* every parameter takes a gradient */
    for (size_t j = 0; j < k; j++)
      if (fabs(pl.g[i][j] - tg[j]) > err) err = fabs(pl.g[i][j] - tg[j]);
    if (!(err / ref <= 1e-4))
      fail_msg("%s: max |grad - torch| %.3g, max |torch| %.3g", t->fqn, err,
               ref);
    if (err / ref > worst) {
      worst = err / ref;
      worst_fqn = t->fqn;
    }
    free(tg);
  }
  printf("gradients: largest relative error %.3g (%s)\n", worst, worst_fqn);
  sp_safetensors_close(f);
  free(e);
  free(in);
  free(out);
  sp_gpt2_acts_free(a);
  plain_free(&pl);
  sp_gpt2_free(g);
  sp_model_free(m);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_spec_reader),
      cmocka_unit_test(test_init),
      cmocka_unit_test(test_data),
      cmocka_unit_test(test_gelu),
      cmocka_unit_test(test_attention),
      cmocka_unit_test(test_checkpointing_bit_identical),
  };
  int rc =
      cmocka_run_group_tests(tests, sp_test_dir_setup, sp_test_dir_teardown);
  if (rc != 0) return rc;
  if (!have_torch())
    return sp_test_skip(
        "the comparison with PyTorch: torch is not "
        "available to " PYTHON " (Debian: python3-torch)");
  const struct CMUnitTest torch_tests[] = {
      cmocka_unit_test(test_grad_vs_torch),
  };
  return cmocka_run_group_tests(torch_tests, sp_test_dir_setup,
                                sp_test_dir_teardown);
}
