/* GPT-2 runs compared (gpt2_fixture.h). */
#include "gpt2_fixture.h"

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "testutil.h"

void sp_tgpt2_write_corpus(const char *path) {
  size_t n = 1 << 16, len = 0;
  char *buf = malloc(n);
  assert_non_null(buf);
  static const char *const words[] = {
      "shard",     "plane",   "the",     "gradient", "of",       "a",
      "rank",      "gathers", "every",   "unit",     "before",   "its",
      "forward",   "and",     "reduces", "after",    "backward", "while",
      "optimizer", "steps",   "on",      "master",   "copies"};
  sp_test_rng rng = {2024};
  while (len + 16 < n) {
    const char *w = words[sp_test_rng_below(&rng, 23)];
    size_t k = strlen(w);
    memcpy(buf + len, w, k);
    len += k;
    buf[len++] = sp_test_rng_below(&rng, 9) == 0 ? '\n' : ' ';
  }
  sp_test_write_file(path, buf, len);
  free(buf);
}

double sp_tgpt2_lr_sum(int steps, double lr, int warmup, double min_lr) {
  double s = 0;
  for (int t = 0; t < steps; t++)
    s += t < warmup
             ? lr * (t + 1) / warmup
             : min_lr + 0.5 * (lr - min_lr) *
                            (1 + cos(M_PI * (t - warmup) / (steps - warmup)));
  return s;
}

static void read_f32(const sp_safetensors_file *f, const char *name, float *dst,
                     size_t n) {
  const sp_safetensors_tensor *t = sp_safetensors_find(f, name);
  if (t == NULL) fail_msg("%s: not in the file", name);
  assert_int_equal(t->dtype, SP_FLOAT32);
  assert_int_equal(sp_safetensors_tensor_read(t, dst, n * sizeof *dst), 0);
}

void sp_tgpt2_compare(const sp_model *m, const double *loss, const double *ref,
                      size_t steps, const sp_safetensors_file *a,
                      const sp_safetensors_file *b, sp_tgpt2_errors *e) {
  memset(e, 0, sizeof *e);
  e->worst = "";
  for (size_t s = 0; s < steps; s++) {
    double x = fabs(loss[s] - ref[s]) / fabs(ref[s]);
    if (!(x <= e->loss)) { /* a NaN sticks */
      e->loss = x;
      e->loss_at = s;
    }
  }
  if (steps) e->first = fabs(loss[0] - ref[0]) / fabs(ref[0]);
  int32_t wpe = sp_model_find_param(m, "transformer.wpe.weight");
  assert_true(wpe >= 0);
  int64_t C = m->params[wpe].shape[1];
  double d2 = 0, r2 = 0;
  for (size_t p = 0; p < m->n_params; p++) {
    const sp_tensor_spec *t = &m->params[p];
    size_t n = (size_t)t->numel;
    float *x = malloc(n * sizeof *x + 1), *y = malloc(n * sizeof *y + 1);
    assert_non_null(x);
    assert_non_null(y);
    read_f32(a, t->fqn, x, n);
    read_f32(b, t->fqn, y, n);
    bool kbias = strstr(t->fqn, ".attn.c_attn.bias") != NULL;
    double big = 0, err = 0;
    for (size_t i = 0; i < n; i++) {
      bool key = kbias && (int64_t)i >= C && (int64_t)i < 2 * C;
      double v = fabs((double)x[i] - y[i]);
      if (key) {
        if (!(v <= e->key_bias)) e->key_bias = v;
        continue;
      }
      if (fabs(y[i]) > big) big = fabs(y[i]);
      if (!(v <= err)) err = v;
      d2 += v * v;
      r2 += (double)y[i] * y[i];
    }
    if (!(err / big <= e->params)) {
      e->params = err / big;
      e->worst = t->fqn;
    }
    if (!(err <= e->abs)) e->abs = err;
    free(x);
    free(y);
  }
  e->rms = sqrt(d2 / r2);
}
