/* The optimizer, clipping and gradient accumulation of the FSDP runtime
 * (client/lib/fsdp/optim.c, fsdp_schedule.c), in isolation:
 *  - AdamW and SGD with momentum on hand-computed values (weight decay on
 *    2-D parameters only, bias correction, float32 moments);
 *  - the learning-rate schedule and the weight-decay mask;
 *  - clipping by the global norm over every shard, at W = 1..4 for every
 *    strategy (a HYBRID_SHARD replica counted once, padding counting for
 *    nothing), equal to the unsharded norm;
 *  - gradient accumulation with sync (each micro-batch reduced and added)
 *    and without (no_sync: one reduction of the local sum), equal to one
 *    batch of all the micro-batches; the memory model's prediction of what
 *    AdamW and no_sync hold;
 *  - two bugs: the forward after a trainer wrote the master shards itself
 *    (NO_SHARD served the old unsharded copy), and use_orig_params units
 *    whose first parameter is frozen (their trainable parameters were
 *    never reduced nor stepped);
 *  - with a GPU: every optimizer kernel against its CPU reference, bit for
 *    bit.
 * Ranks are threads of this process against one in-process coordinator
 * (support/rank_threads.h), as in test_fsdp.c. */
#include <math.h>
#include <setjmp.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "cast/cast.h"
#include "plan/memory.h"
#include "lib/fsdp/fsdp_internal.h"
#include "lib/shardplane.h"
#include "support/coord_fixture.h"
#include "support/rank_threads.h"
#include "support/testutil.h"

#define MAX_W 4

static char *g_dir;
static char *g_tiny;   /* one unit: w [2, 2], b [2] */
static char *g_layers; /* three Linear units and a root parameter */
static char *g_frozen; /* a unit whose first parameter is frozen */

/* ---- a job of W rank threads ---- */

typedef struct job_cfg {
  const char *model;
  uint32_t world;
  sp_strategy strategy;
  uint32_t group; /* HYBRID_SHARD shard-group size */
  bool use_orig_params;
  bool init_zero; /* master shards start at zero */
} job_cfg;

static bool is_tiny(const job_cfg *cfg) { return cfg->model == g_tiny; }

typedef struct harness harness;

typedef struct rank_ctx {
  sp_test_rank t; /* first: the harness's callbacks cast back */
  harness *h;
  sp_session *s;
  sp_fsdp *f;
  const sp_plan *plan;
  const sp_model *model;
} rank_ctx;

typedef int (*rank_body)(rank_ctx *c, void *arg);

struct harness {
  job_cfg cfg;
  sp_coord_fixture fx;
  rank_body body;
  void *arg;
  rank_ctx ranks[MAX_W];
  sp_test_ranks job;
};

#define FAIL(c, ...) sp_test_rank_fail(&(c)->t, __FILE__, __LINE__, __VA_ARGS__)
#define CHECK(c, ...) SP_RANK_CHECK(&(c)->t, __VA_ARGS__)
#define CALL(c, expr) SP_RANK_CALL(&(c)->t, expr)
#define TRY(expr) SP_RANK_TRY(expr)

#define REFUSED(c, code, what, expr)                                           \
  do {                                                                         \
    sp_diag D = {""};                                                          \
    int rc_ = (expr);                                                          \
    if (rc_ != (code) || strstr(D.msg, (what)) == NULL)                        \
      return sp_test_rank_fail(                                                \
          &(c)->t, __FILE__, __LINE__, "%s: %s \"%s\", want %s saying \"%s\"", \
          #expr, sp_err_name(rc_), D.msg, sp_err_name(code), (what));          \
  } while (0)

/* Master values: a hash of (param, element) on a 2^-10 grid in [-1, 1),
 * or zero (cfg.init_zero). */
static double init_value(int32_t p, int64_t i) {
  uint64_t z = (uint64_t)(p + 1) * 0x9E3779B97F4A7C15ull + (uint64_t)i * 31;
  z ^= z >> 29;
  z *= 0xBF58476D1CE4E5B9ull;
  z ^= z >> 32;
  return (double)((int64_t)(z % 2048) - 1024) / 1024.0;
}

static void init_param(void *user, const sp_model *m, int32_t param,
                       int64_t start, int64_t n, void *dst) {
  const harness *h = user;
  float *out = dst;
  (void)m;
  for (int64_t k = 0; k < n; k++)
    out[k] = h->cfg.init_zero ? 0.0f : (float)init_value(param, start + k);
}

static int rank_run(sp_test_rank *t) {
  rank_ctx *c = (rank_ctx *)t;
  harness *h = c->h;
  TRY(sp_test_rank_attach(&c->t, h->fx.addr, &c->s));
  c->plan = sp_session_plan(c->s);
  c->model = sp_session_model(c->s);
  sp_fsdp_opts fo = {.session = c->s,
                     .world = c->t.comm[0],
                     .shard_group = c->t.comm[1],
                     .replica_group = c->t.comm[2],
                     .backward_prefetch = true,
                     .init_param = init_param,
                     .user = h};
  CALL(c, sp_fsdp_new(&fo, &c->f, &D));
  TRY(h->body(c, h->arg));
  CALL(c, sp_session_flush(c->s, 10000, &D));
  return 0;
}

static void rank_finish(sp_test_rank *t) {
  rank_ctx *c = (rank_ctx *)t;
  sp_fsdp_free(c->f);
  sp_test_rank_detach(&c->t, c->s);
}

static void run_job(const job_cfg *cfg, rank_body body, void *arg) {
  harness *h = calloc(1, sizeof *h);
  assert_non_null(h);
  assert_true(cfg->world >= 1 && cfg->world <= MAX_W);
  h->cfg = *cfg;
  h->body = body;
  h->arg = arg;
  char ws[16], gs[16];
  snprintf(ws, sizeof ws, "%u", cfg->world);
  snprintf(gs, sizeof gs, "%u", cfg->group);
  const char *flags[16];
  size_t k = 0;
  flags[k++] = "world-size";
  flags[k++] = ws;
  if (!is_tiny(cfg)) { /* one unit, the root */
    flags[k++] = "wrap-type";
    flags[k++] = "Linear";
  }
  flags[k++] = "strategy";
  flags[k++] = sp_strategy_name(cfg->strategy);
  if (cfg->strategy == SP_HYBRID_SHARD) {
    flags[k++] = "shard-group-size";
    flags[k++] = gs;
  }
  if (cfg->use_orig_params) {
    flags[k++] = "use-orig-params";
    flags[k++] = "1";
  }
  flags[k] = NULL;
  sp_coord_fixture_start(&h->fx, cfg->model, flags, 0);
  h->job.world = cfg->world;
  h->job.run = rank_run;
  h->job.finish = rank_finish;
  for (uint32_t r = 0; r < cfg->world; r++) {
    h->ranks[r].h = h;
    h->job.rank[r] = &h->ranks[r].t;
  }
  sp_test_ranks_start(&h->job);
  char first[1024];
  sp_test_ranks_join(&h->job, first, sizeof first);
  sp_coord_fixture_stop(&h->fx);
  free(h);
  if (first[0]) fail_msg("%s", first);
}

/* ---- the schedule with synthetic gradients ---- */

/* The gradient rank r adds at element i of parameter p in micro-batch j. */
typedef double (*grad_fn)(uint32_t r, uint32_t j, int32_t p, int64_t i);

/* Adds g to every parameter gradient of unit u (the trainer's side of the
 * contract: gradients accumulate into the buffer, frozen parameters have
 * none). */
static int add_grads(rank_ctx *c, uint32_t u, uint32_t j, grad_fn g) {
  const sp_model *m = c->model;
  for (size_t p = 0; p < m->n_params; p++) {
    if (c->plan->param_unit[p] != (int32_t)u) continue;
    float *buf = sp_fsdp_param_grad(c->f, (int32_t)p);
    if (!m->params[p].flag) {
      CHECK(c, buf == NULL, "frozen %s has a gradient buffer",
            m->params[p].fqn);
      continue;
    }
    CHECK(c, buf != NULL, "%s has no gradient buffer", m->params[p].fqn);
    for (int64_t i = 0; i < m->params[p].numel; i++)
      buf[i] = (float)((double)buf[i] + g(c->t.rank, j, (int32_t)p, i));
  }
  return 0;
}

/* One forward and backward in the worker's order, micro-batch j. */
static int fwd_bwd(rank_ctx *c, uint32_t j, grad_fn g) {
  sp_fsdp *f = c->f;
  uint32_t n = (uint32_t)c->plan->n_units;
  CALL(c, sp_fsdp_root_pre_forward(f, &D));
  for (uint32_t u = 1; u < n; u++) {
    CALL(c, sp_fsdp_pre_forward(f, u, &D));
    CALL(c, sp_fsdp_post_forward(f, u, &D));
  }
  CALL(c, sp_fsdp_root_post_forward(f, &D));
  CALL(c, sp_fsdp_root_pre_backward(f, &D));
  TRY(add_grads(c, 0, j, g));
  for (uint32_t u = n; u-- > 1;) {
    CALL(c, sp_fsdp_pre_backward(f, u, &D));
    TRY(add_grads(c, u, j, g));
    CALL(c, sp_fsdp_post_backward(f, u, &D));
  }
  CALL(c, sp_fsdp_post_backward(f, 0, &D));
  CALL(c, sp_fsdp_finish_backward(f, &D));
  return 0;
}

/* Element i of parameter p in this rank's shard: a pointer to it in the
 * unit's shard (or shard gradient) when this rank holds it, else NULL. */
static float *shard_elem(rank_ctx *c, bool grad, int32_t p, int64_t i) {
  uint32_t u = (uint32_t)c->plan->param_unit[p];
  int64_t start, end, pad, c_n;
  float *base = sp_fsdp_shard(c->f, u, &c_n);
  if (grad) base = sp_fsdp_shard_grad(c->f, u);
  if (!base || sp_plan_rank_range(c->plan, u, c->t.rank, &start, &end, &pad))
    return NULL;
  int64_t flat = c->plan->entries[c->plan->param_entry[p]].offset + i;
  return flat >= start && flat < end ? base + (flat - start) : NULL;
}

/* ---- AdamW and SGD by hand ---- */

/* tiny.json: w = [0.5, -0.25, 1, 2], b = [0.125, -1]; gradients of two
 * steps; lr 0.1, betas (0.9, 0.999), eps 1e-8, weight decay 0.1 on w
 * only (2-D). The expected values were computed by hand from
 * torch.optim.AdamW's formulas (decay, m, v, bias correction, update in
 * double, m, v and p rounded to float32), and the SGD ones from
 * torch.optim.SGD's (momentum 0.9, weight decay 0.1 as L2). */
static const float k_tiny_init[6] = {0.5f, -0.25f, 1.0f, 2.0f, 0.125f, -1.0f};
static const double k_tiny_grads[2][6] = {{0.1, -0.2, 0.3, 0.0, 1.0, -0.5},
                                          {0.05, 0.1, -0.3, 0.2, 0.5, 0.25}};
static const float k_adamw_want[2][6] = {
    {0.395000011f, -0.147500008f, 0.889999986f, 1.98000002f, 0.0250000022f,
     -0.899999976f},
    {0.297832072f, -0.119391307f, 0.886363149f, 1.88578629f, -0.0682179555f,
     -0.873366296f}};
static const float k_adamw_m[2][6] = {
    {0.00999999978f, -0.0199999996f, 0.0300000012f, 0.0f, 0.100000001f,
     -0.0500000007f},
    {0.0139999995f, -0.00799999945f, -0.00300000003f, 0.0199999996f,
     0.140000001f, -0.0200000014f}};
static const float k_sgd_want[2][6] = {
    {0.485000014f, -0.227499992f, 0.959999979f, 1.98000002f, 0.0250000004f,
     -0.949999988f},
    {0.461650014f, -0.214974985f, 0.944399953f, 1.92219996f, -0.114999995f,
     -0.930000007f}};

static double tiny_grad(uint32_t r, uint32_t j, int32_t p, int64_t i) {
  (void)r;
  /* w is parameter 0 (4 elements), b parameter 1 */
  return (double)(float)k_tiny_grads[j][p == 0 ? i : 4 + i];
}

static int set_tiny(rank_ctx *c) {
  int64_t n;
  float *sh = sp_fsdp_shard(c->f, 0, &n);
  CHECK(c, sh && n == 6, "tiny: shard of %lld elements", (long long)n);
  memcpy(sh, k_tiny_init, sizeof k_tiny_init);
  CALL(c, sp_fsdp_shards_changed(c->f, &D));
  return 0;
}

static int body_adamw_hand(rank_ctx *c, void *arg) {
  (void)arg;
  TRY(set_tiny(c));
  sp_optim_opts o;
  sp_optim_opts_init(&o, SP_OPTIM_ADAMW);
  o.lr = 0.1;
  o.weight_decay = 0.1;
  CALL(c, sp_fsdp_optim_init(c->f, &o, &D));
  REFUSED(c, SP_EEXIST, "already", sp_fsdp_optim_init(c->f, &o, &D));
  for (uint32_t step = 0; step < 2; step++) {
    TRY(fwd_bwd(c, step, tiny_grad));
    double lr = 0;
    CALL(c, sp_fsdp_optim_step(c->f, &lr, &D));
    CHECK(c, lr == 0.1, "lr %g", lr);
    const float *sh = sp_fsdp_shard(c->f, 0, NULL);
    const float *m = (const float *)c->f->states[0].per_unit[0];
    CHECK(c,
          strcmp(c->f->states[0].name, "exp_avg") == 0 &&
              strcmp(c->f->states[1].name, "exp_avg_sq") == 0,
          "states %s, %s", c->f->states[0].name, c->f->states[1].name);
    for (int i = 0; i < 6; i++) {
      CHECK(c, sh[i] == k_adamw_want[step][i],
            "AdamW step %u element %d: %.9g, want %.9g", step + 1, i,
            (double)sh[i], (double)k_adamw_want[step][i]);
      CHECK(c, m[i] == k_adamw_m[step][i],
            "exp_avg step %u [%d]: %.9g, "
            "want %.9g",
            step + 1, i, (double)m[i], (double)k_adamw_m[step][i]);
    }
    const float *g = sp_fsdp_shard_grad(c->f, 0);
    for (int i = 0; i < 6; i++)
      CHECK(c, g[i] == 0, "the step left gradient %d at %g", i, (double)g[i]);
  }
  CHECK(c, sp_fsdp_optim_steps(c->f) == 2, "steps %llu",
        (unsigned long long)sp_fsdp_optim_steps(c->f));
  /* the next forward sees the stepped master */
  CALL(c, sp_fsdp_root_pre_forward(c->f, &D));
  const float *view = sp_fsdp_param(c->f, 0);
  CHECK(c, view && view[0] == k_adamw_want[1][0],
        "view after the step: "
        "%.9g, want %.9g",
        view ? (double)view[0] : -1.0, (double)k_adamw_want[1][0]);
  CALL(c, sp_fsdp_root_post_forward(c->f, &D));
  return 0;
}

static int body_sgd_hand(rank_ctx *c, void *arg) {
  (void)arg;
  TRY(set_tiny(c));
  sp_optim_opts o;
  sp_optim_opts_init(&o, SP_OPTIM_SGD);
  o.lr = 0.1;
  o.momentum = 0.9;
  o.weight_decay = 0.1;
  CALL(c, sp_fsdp_optim_init(c->f, &o, &D));
  CHECK(c,
        c->f->n_states == 1 &&
            strcmp(c->f->states[0].name, "momentum_buffer") == 0,
        "SGD with momentum registers momentum_buffer");
  for (uint32_t step = 0; step < 2; step++) {
    TRY(fwd_bwd(c, step, tiny_grad));
    CALL(c, sp_fsdp_optim_step(c->f, NULL, &D));
    const float *sh = sp_fsdp_shard(c->f, 0, NULL);
    for (int i = 0; i < 6; i++)
      CHECK(c, sh[i] == k_sgd_want[step][i],
            "SGD step %u element %d: %.9g, want %.9g", step + 1, i,
            (double)sh[i], (double)k_sgd_want[step][i]);
  }
  return 0;
}

static void test_adamw_by_hand(void **state) {
  (void)state;
  job_cfg cfg = {.model = g_tiny, .world = 1, .strategy = SP_FULL_SHARD};
  run_job(&cfg, body_adamw_hand, NULL);
  printf(
      "  AdamW: two steps equal the hand-computed parameters and "
      "exp_avg\n");
}

static void test_sgd_momentum_by_hand(void **state) {
  (void)state;
  job_cfg cfg = {.model = g_tiny, .world = 1, .strategy = SP_FULL_SHARD};
  run_job(&cfg, body_sgd_hand, NULL);
  printf(
      "  SGD (momentum 0.9, weight decay 0.1): two steps equal the "
      "hand-computed parameters\n");
}

/* ---- schedule, mask, options ---- */

static void test_lr_schedule(void **state) {
  (void)state;
  sp_optim_opts o;
  sp_optim_opts_init(&o, SP_OPTIM_ADAMW);
  o.lr = 1.0;
  assert_true(sp_optim_lr(&o, 0) == 1.0 && sp_optim_lr(&o, 1000) == 1.0);
  o.schedule = SP_LR_COSINE;
  o.warmup_steps = 4;
  o.total_steps = 12;
  o.min_lr = 0.1;
  /* warmup: lr * (t + 1) / 4 */
  assert_true(sp_optim_lr(&o, 0) == 0.25);
  assert_true(sp_optim_lr(&o, 1) == 0.5);
  assert_true(sp_optim_lr(&o, 3) == 1.0);
  /* decay: 0.1 + 0.45 (1 + cos(pi (t - 4) / 8)) */
  assert_true(sp_optim_lr(&o, 4) == 1.0);
  assert_true(fabs(sp_optim_lr(&o, 8) - 0.55) < 1e-15); /* cos(pi/2) */
  assert_true(fabs(sp_optim_lr(&o, 6) - (0.1 + 0.45 * (1 + sqrt(0.5)))) <
              1e-15);
  assert_true(fabs(sp_optim_lr(&o, 11) -
                   (0.1 + 0.45 * (1 + cos(3.14159265358979323846 * 7 / 8)))) <
              1e-15);
  assert_true(sp_optim_lr(&o, 12) == 0.1 && sp_optim_lr(&o, 99) == 0.1);
  /* no warmup */
  o.warmup_steps = 0;
  assert_true(sp_optim_lr(&o, 0) == 1.0);
  printf(
      "  lr schedule: constant; warmup 0.25, 0.5, .., 1; cosine 1 -> "
      "0.55 -> 0.1; min_lr after total_steps\n");
}

static void test_decay_mask(void **state) {
  (void)state;
  sp_model *m;
  sp_diag d = {""};
  assert_int_equal(sp_model_load_file(g_layers, &m, &d), 0);
  sp_optim_opts o;
  sp_optim_opts_init(&o, SP_OPTIM_ADAMW);
  int32_t w0 = -1, b0 = -1, nw = -1;
  for (size_t p = 0; p < m->n_params; p++) {
    if (strcmp(m->params[p].fqn, "layers.0.weight") == 0) w0 = (int32_t)p;
    if (strcmp(m->params[p].fqn, "layers.0.bias") == 0) b0 = (int32_t)p;
    if (strcmp(m->params[p].fqn, "norm.weight") == 0) nw = (int32_t)p;
  }
  assert_true(w0 >= 0 && b0 >= 0 && nw >= 0);
  /* default: 2-D decays, 1-D does not */
  assert_true(sp_optim_decays(&o, m, w0));
  assert_false(sp_optim_decays(&o, m, b0));
  assert_false(sp_optim_decays(&o, m, nw));
  /* patterns: decay the norm, not layer 0's weight; no_decay wins */
  const char *dec[] = {"norm.*", "layers.0.*"};
  const char *nodec[] = {"layers.0.weight"};
  o.decay = dec;
  o.n_decay = 2;
  o.no_decay = nodec;
  o.n_no_decay = 1;
  assert_false(sp_optim_decays(&o, m, w0));
  assert_true(sp_optim_decays(&o, m, b0));
  assert_true(sp_optim_decays(&o, m, nw));
  sp_model_free(m);
  printf(
      "  decay mask: weights decay, biases and norms do not; FQN globs "
      "override, no_decay first\n");
}

static void expect_bad(const sp_optim_opts *o, const char *what) {
  sp_diag d = {""};
  assert_int_equal(sp_optim_opts_check(o, &d), SP_EINVAL);
  if (!strstr(d.msg, what)) fail_msg("\"%s\" does not say \"%s\"", d.msg, what);
  printf("  refused: %s\n", d.msg);
}

static void test_options(void **state) {
  (void)state;
  sp_optim_opts o;
  sp_optim_opts_init(&o, SP_OPTIM_ADAMW);
  assert_true(o.beta1 == 0.9 && o.beta2 == 0.999 && o.eps == 1e-8 &&
              o.weight_decay == 1e-2 && o.lr == 1e-3);
  assert_int_equal(sp_optim_opts_check(&o, NULL), 0);
  o.beta2 = 1.0;
  expect_bad(&o, "betas 0.9,1");
  sp_optim_opts_init(&o, SP_OPTIM_ADAMW);
  o.eps = 0;
  expect_bad(&o, "eps 0");
  sp_optim_opts_init(&o, SP_OPTIM_SGD);
  o.momentum = -1;
  expect_bad(&o, "momentum -1");
  sp_optim_opts_init(&o, SP_OPTIM_SGD);
  o.schedule = SP_LR_COSINE;
  expect_bad(&o, "total steps 0");
  o.total_steps = 10;
  o.warmup_steps = 11;
  expect_bad(&o, "warmup steps 11");
  o.warmup_steps = 2;
  o.min_lr = 1;
  expect_bad(&o, "min lr 1");
}

/* ---- clipping ---- */

static double layer_grad(uint32_t r, uint32_t j, int32_t p, int64_t i) {
  /* on a 2^-6 grid, rank- and micro-batch-dependent */
  return (double)(((int64_t)p * 13 + i * 7 + (int64_t)r * 5 + (int64_t)j * 3) %
                      23 -
                  11) /
         64.0;
}

/* The reduced gradient: the mean over ranks, summed over micro-batches. */
static double want_grad(uint32_t world, uint32_t k, int32_t p, int64_t i) {
  double s = 0;
  for (uint32_t j = 0; j < k; j++) {
    double m = 0;
    for (uint32_t r = 0; r < world; r++) m += layer_grad(r, j, p, i);
    s += m / world;
  }
  return s;
}

/* The unsharded norm of the reduced float32 gradient. */
static double want_norm(const sp_model *m, uint32_t world, uint32_t k) {
  double sq = 0;
  for (size_t p = 0; p < m->n_params; p++)
    for (int64_t i = 0; i < m->params[p].numel; i++) {
      double g = (float)want_grad(world, k, (int32_t)p, i);
      sq += g * g;
    }
  return sqrt(sq);
}

static int body_clip(rank_ctx *c, void *arg) {
  (void)arg;
  uint32_t world = c->h->cfg.world;
  TRY(fwd_bwd(c, 0, layer_grad));
  double want = want_norm(c->model, world, 1);
  double got = 0;
  sp_fsdp_stats before, after;
  sp_fsdp_get_stats(c->f, &before);
  /* +inf: the norm only */
  CALL(c, sp_fsdp_clip_grad_norm(c->f, INFINITY, &got, &D));
  CHECK(c, fabs(got - want) <= 1e-12 * want, "norm %.17g, unsharded %.17g", got,
        want);
  sp_fsdp_get_stats(c->f, &after);
  /* none when nothing is sharded (NO_SHARD, shard groups of one rank) */
  uint64_t colls = c->plan->shard_world == 1 ? 0 : 1;
  CHECK(c, after.all_reduces - before.all_reduces == colls,
        "%llu all-reduces for the norm, want %llu",
        (unsigned long long)(after.all_reduces - before.all_reduces),
        (unsigned long long)colls);
  /* clip to a quarter: every element becomes rne(g * coef) */
  double max = want / 4, total = 0;
  CALL(c, sp_fsdp_clip_grad_norm(c->f, max, &total, &D));
  CHECK(c, total == got,
        "the second norm %.17g differs from the first "
        "%.17g",
        total, got);
  double coef = max / (total + 1e-6);
  for (size_t p = 0; p < c->model->n_params; p++)
    for (int64_t i = 0; i < c->model->params[p].numel; i++) {
      float *g = shard_elem(c, true, (int32_t)p, i);
      if (!g) continue;
      float w =
          (float)((double)(float)want_grad(world, 1, (int32_t)p, i) * coef);
      CHECK(c, *g == w, "%s[%lld] clipped to %.9g, want %.9g",
            c->model->params[p].fqn, (long long)i, (double)*g, (double)w);
    }
  /* padding stayed zero */
  for (uint32_t u = 0; u < c->plan->n_units; u++) {
    int64_t start, end, pad, n;
    const float *g = sp_fsdp_shard_grad(c->f, u);
    if (!sp_fsdp_shard(c->f, u, &n)) continue;
    CHECK(c, sp_plan_rank_range(c->plan, u, c->t.rank, &start, &end, &pad) == 0,
          "range");
    for (int64_t k = end - start; k < n; k++)
      CHECK(c, g[k] == 0, "unit %u padding gradient %g", u, (double)g[k]);
  }
  /* the clipped norm: max_norm * total / (total + 1e-6), the 1e-6 being
   * FSDP's guard against a zero norm; float32 rounding of the scaled
   * gradients adds at most 2^-24 relative */
  double clipped = max * total / (total + 1e-6);
  CALL(c, sp_fsdp_clip_grad_norm(c->f, max, &total, &D));
  CHECK(c, fabs(total - clipped) <= 1e-7 * clipped,
        "after clipping the "
        "norm is %.9g, want %.9g",
        total, clipped);
  /* refused outside a step's end, and for a bad bound */
  REFUSED(c, SP_EINVAL, "max norm 0",
          sp_fsdp_clip_grad_norm(c->f, 0, NULL, &D));
  CALL(c, sp_fsdp_root_pre_forward(c->f, &D));
  REFUSED(c, SP_ESTATE, "between steps",
          sp_fsdp_clip_grad_norm(c->f, 1, NULL, &D));
  CALL(c, sp_fsdp_root_post_forward(c->f, &D));
  if (c->t.rank == 0)
    printf("    norm %.12g = unsharded %.12g (rel. %.1e)\n", got, want,
           fabs(got - want) / want);
  return 0;
}

static void test_clip_grad_norm(void **state) {
  (void)state;
  struct {
    uint32_t w;
    sp_strategy s;
    uint32_t g;
  } cases[] = {{1, SP_FULL_SHARD, 0},    {2, SP_FULL_SHARD, 0},
               {3, SP_FULL_SHARD, 0},    {4, SP_FULL_SHARD, 0},
               {3, SP_SHARD_GRAD_OP, 0}, {2, SP_NO_SHARD, 0},
               {4, SP_NO_SHARD, 0},      {4, SP_HYBRID_SHARD, 2},
               {2, SP_HYBRID_SHARD, 1},  {4, SP_HYBRID_SHARD, 4}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    printf("  W=%u %s%s\n", cases[i].w, sp_strategy_name(cases[i].s),
           cases[i].g ? (cases[i].g == 1   ? " (group 1)"
                         : cases[i].g == 2 ? " (group 2)"
                                           : " (group 4)")
                      : "");
    job_cfg cfg = {.model = g_layers,
                   .world = cases[i].w,
                   .strategy = cases[i].s,
                   .group = cases[i].g};
    run_job(&cfg, body_clip, NULL);
  }
}

/* ---- accumulation ---- */

typedef struct accum_arg {
  uint32_t k;
  bool no_sync;
} accum_arg;

static int body_accum(rank_ctx *c, void *arg) {
  const accum_arg *a = arg;
  uint32_t world = c->h->cfg.world, n = (uint32_t)c->plan->n_units;
  for (uint32_t step = 0; step < 2; step++) {
    sp_fsdp_stats before, after;
    sp_fsdp_get_stats(c->f, &before);
    for (uint32_t j = 0; j < a->k; j++) {
      if (a->no_sync)
        CALL(c, sp_fsdp_set_requires_gradient_sync(c->f, j + 1 == a->k, &D));
      TRY(fwd_bwd(c, j, layer_grad));
    }
    CHECK(c, sp_fsdp_requires_gradient_sync(c->f), "sync is on again");
    sp_fsdp_get_stats(c->f, &after);
    /* no_sync: one reduction per unit per step, else one per micro-batch */
    uint64_t reductions =
        (after.reduce_scatters - before.reduce_scatters) +
        (c->plan->shard_world == 1 ? after.all_reduces - before.all_reduces
                                   : 0);
    uint64_t want_red = (uint64_t)n * (a->no_sync ? 1 : a->k);
    CHECK(c, reductions == want_red, "%llu reductions, want %llu",
          (unsigned long long)reductions, (unsigned long long)want_red);
    double err = 0, scale = 0;
    for (size_t p = 0; p < c->model->n_params; p++)
      for (int64_t i = 0; i < c->model->params[p].numel; i++) {
        float *g = shard_elem(c, true, (int32_t)p, i);
        if (!g) continue;
        double w = want_grad(world, a->k, (int32_t)p, i);
        if (fabs(*g - w) > err) err = fabs(*g - w);
        if (fabs(w) > scale) scale = fabs(w);
      }
    CHECK(c, err <= 1e-6 * scale,
          "accumulated gradient off by %.3g (max "
          "%.3g)",
          err, scale);
    if (c->t.rank == 0 && step == 0)
      printf("    %u micro-batches%s: max rel. error vs one batch %.1e\n", a->k,
             a->no_sync ? " (no_sync)" : "", err / scale);
    CALL(c, sp_fsdp_zero_grad(c->f, &D));
  }
  /* the switch is refused during a step */
  CALL(c, sp_fsdp_root_pre_forward(c->f, &D));
  REFUSED(c, SP_ESTATE, "between steps",
          sp_fsdp_set_requires_gradient_sync(c->f, false, &D));
  CALL(c, sp_fsdp_root_post_forward(c->f, &D));
  return 0;
}

static void test_grad_accumulation(void **state) {
  (void)state;
  sp_strategy ss[] = {SP_FULL_SHARD, SP_SHARD_GRAD_OP, SP_NO_SHARD,
                      SP_HYBRID_SHARD};
  for (int ns = 0; ns <= 1; ns++)
    for (size_t s = 0; s < 4; s++)
      for (uint32_t w = 1; w <= 4; w++) {
        printf("  W=%u %s\n", w, sp_strategy_name(ss[s]));
        accum_arg a = {3, ns == 1};
        job_cfg cfg = {.model = g_layers,
                       .world = w,
                       .strategy = ss[s],
                       .group = w == 4 ? 2 : w};
        run_job(&cfg, body_accum, &a);
      }
}

/* ---- the memory model: AdamW's moments and no_sync's held gradients ----
 * Two steps of two micro-batches without sync for the first, AdamW: every
 * counter of sp_fsdp_stats.mem equals what sp_mem_estimate_plan predicts
 * with optimizer adamw and no_sync (common/plan/memory.c), category by
 * category, peak and current, in use and reserved, and the allocations. */
static int body_memory(rank_ctx *c, void *arg) {
  (void)arg;
  sp_optim_opts o;
  sp_optim_opts_init(&o, SP_OPTIM_ADAMW);
  CALL(c, sp_fsdp_optim_init(c->f, &o, &D));
  for (uint32_t step = 0; step < 2; step++) {
    for (uint32_t j = 0; j < 2; j++) {
      CALL(c, sp_fsdp_set_requires_gradient_sync(c->f, j == 1, &D));
      TRY(fwd_bwd(c, j, layer_grad));
    }
    CALL(c, sp_fsdp_optim_step(c->f, NULL, &D));
  }
  sp_fsdp_stats st;
  sp_fsdp_get_stats(c->f, &st);
  sp_mem_opts mo;
  sp_mem_opts_default(&mo);
  mo.optimizer = SP_MEM_OPT_ADAMW;
  mo.no_sync = true;
  sp_mem_estimate e;
  CALL(c, sp_mem_estimate_plan(c->plan, &mo, &e, &D));
  const sp_mem_account *got = &st.mem, *want = &e.acct;
  for (int k = 0; k < SP_MEM_N_CATS; k++)
    CHECK(c,
          got->cat[k].peak == want->cat[k].peak &&
              got->cat[k].current == want->cat[k].current,
          "%s: peak %llu, now %llu bytes; the model says %llu, %llu",
          sp_mem_cat_label((sp_mem_cat)k), (unsigned long long)got->cat[k].peak,
          (unsigned long long)got->cat[k].current,
          (unsigned long long)want->cat[k].peak,
          (unsigned long long)want->cat[k].current);
  CHECK(c,
        got->total.peak == want->total.peak &&
            got->reserved.peak == want->reserved.peak &&
            got->allocs == want->allocs,
        "total peak %llu, reserved %llu, %llu allocations; the model says "
        "%llu, %llu, %llu",
        (unsigned long long)got->total.peak,
        (unsigned long long)got->reserved.peak, (unsigned long long)got->allocs,
        (unsigned long long)want->total.peak,
        (unsigned long long)want->reserved.peak,
        (unsigned long long)want->allocs);
  if (c->t.rank == 0)
    printf(
        "    counted = predicted: optimizer state %llu bytes, unsharded "
        "gradients' peak %llu\n",
        (unsigned long long)got->cat[SP_MEM_OPTIMIZER].peak,
        (unsigned long long)got->cat[SP_MEM_GRADS].peak);
  return 0;
}

static void test_memory_model(void **state) {
  (void)state;
  sp_strategy ss[] = {SP_FULL_SHARD, SP_SHARD_GRAD_OP, SP_NO_SHARD,
                      SP_HYBRID_SHARD};
  for (size_t s = 0; s < 4; s++)
    for (uint32_t w = 1; w <= 4; w += 3) {
      printf("  W=%u %s, AdamW, no_sync\n", w, sp_strategy_name(ss[s]));
      job_cfg cfg = {.model = g_layers,
                     .world = w,
                     .strategy = ss[s],
                     .group = w == 4 ? 2 : w};
      run_job(&cfg, body_memory, NULL);
    }
}

/* ---- bug: an update outside the runtime's optimizer was not seen ---- */

/* Every rank's master shard of the one unit goes to 100, 200, ... (flat
 * index + 1 times 100); the next forward must see it. With W = 1 every
 * strategy is NO_SHARD, which keeps the unsharded parameters across steps:
 * before sp_fsdp_shards_changed it kept serving them (0, 0, 0 here). */
static int body_own_update(rank_ctx *c, void *arg) {
  (void)arg;
  TRY(fwd_bwd(c, 0, tiny_grad));
  int64_t n, start, end, pad;
  float *sh = sp_fsdp_shard(c->f, 0, &n);
  CHECK(c, sp_plan_rank_range(c->plan, 0, c->t.rank, &start, &end, &pad) == 0,
        "range");
  for (int64_t k = 0; k < end - start; k++) sh[k] = 100.0f * (start + k + 1);
  CALL(c, sp_fsdp_shards_changed(c->f, &D));
  CALL(c, sp_fsdp_root_pre_forward(c->f, &D));
  const float *w = sp_fsdp_param(c->f, 0), *b = sp_fsdp_param(c->f, 1);
  CHECK(c, w && b, "no views");
  float got[6] = {w[0], w[1], w[2], w[3], b[0], b[1]};
  for (int i = 0; i < 6; i++)
    CHECK(c, got[i] == 100.0f * (i + 1),
          "forward after the trainer's own "
          "update reads %g %g %g %g %g %g, the master holds 100 .. 600",
          (double)got[0], (double)got[1], (double)got[2], (double)got[3],
          (double)got[4], (double)got[5]);
  /* during a step the shards are in use: refused */
  REFUSED(c, SP_ESTATE, "between steps", sp_fsdp_shards_changed(c->f, &D));
  CALL(c, sp_fsdp_root_post_forward(c->f, &D));
  return 0;
}

static void test_bug_own_update_seen(void **state) {
  (void)state;
  job_cfg w1 = {.model = g_tiny,
                .world = 1,
                .strategy = SP_FULL_SHARD,
                .init_zero = true};
  run_job(&w1, body_own_update, NULL);
  job_cfg w2 = {
      .model = g_tiny, .world = 2, .strategy = SP_NO_SHARD, .init_zero = true};
  run_job(&w2, body_own_update, NULL);
  job_cfg w2f = {.model = g_tiny,
                 .world = 2,
                 .strategy = SP_SHARD_GRAD_OP,
                 .init_zero = true};
  run_job(&w2f, body_own_update, NULL);
  printf(
      "  a trainer's own update of the master shards is what the next "
      "forward reads (W=1, NO_SHARD, SHARD_GRAD_OP)\n");
}

/* ---- bug: use_orig_params unit whose first parameter is frozen ---- */

static double frozen_grad(uint32_t r, uint32_t j, int32_t p, int64_t i) {
  (void)j;
  return (double)((int64_t)(r + 1) * (p + 1) + i) / 8.0;
}

typedef struct frozen_arg {
  bool adamw;
} frozen_arg;

static int body_frozen(rank_ctx *c, void *arg) {
  const frozen_arg *a = arg;
  const sp_model *m = c->model;
  uint32_t u = (uint32_t)c->plan->param_unit[0];
  CHECK(c, c->plan->units[u].requires_grad,
        "unit %u: requires_grad false "
        "although %s requires grad",
        u, m->params[1].fqn);
  sp_optim_opts o;
  sp_optim_opts_init(&o, a->adamw ? SP_OPTIM_ADAMW : SP_OPTIM_SGD);
  o.lr = 0.5;
  o.weight_decay = 0.25; /* frozen elements must not decay either */
  CALL(c, sp_fsdp_optim_init(c->f, &o, &D));
  float *before[3];
  for (int p = 0; p < 3; p++) {
    before[p] = calloc((size_t)m->params[p].numel, sizeof(float));
    CHECK(c, before[p], "no memory");
    CALL(c, sp_fsdp_gather_param(c->f, p, before[p], &D));
  }
  TRY(fwd_bwd(c, 0, frozen_grad));
  CALL(c, sp_fsdp_optim_step(c->f, NULL, &D));
  int rc = 0;
  for (int p = 0; p < 3 && rc == 0; p++) {
    size_t n = (size_t)m->params[p].numel;
    float *after = calloc(n, sizeof(float));
    CHECK(c, after, "no memory");
    sp_diag d = {""};
    rc = sp_fsdp_gather_param(c->f, p, after, &d);
    if (rc) rc = FAIL(c, "gather: %s", d.msg);
    size_t changed = 0;
    for (size_t i = 0; rc == 0 && i < n; i++)
      changed += after[i] != before[p][i];
    if (rc == 0 && !m->params[p].flag && changed)
      rc = FAIL(c, "frozen %s changed in %zu of %zu elements", m->params[p].fqn,
                changed, n);
    if (rc == 0 && m->params[p].flag && changed != n)
      rc = FAIL(c, "trainable %s after frozen %s: %zu of %zu elements stepped",
                m->params[p].fqn, m->params[0].fqn, changed, n);
    free(after);
  }
  for (int p = 0; p < 3; p++) free(before[p]);
  return rc;
}

static void test_bug_mixed_requires_grad(void **state) {
  (void)state;
  for (int adamw = 0; adamw <= 1; adamw++)
    for (uint32_t w = 1; w <= 2; w++) {
      frozen_arg a = {adamw == 1};
      job_cfg cfg = {.model = g_frozen,
                     .world = w,
                     .strategy = SP_FULL_SHARD,
                     .use_orig_params = true};
      run_job(&cfg, body_frozen, &a);
    }
  printf(
      "  use_orig_params, a frozen parameter first in its unit: the "
      "trainable ones after it are reduced and stepped, it is not "
      "(SGD and AdamW with weight decay, W = 1, 2)\n");
}

/* ---- the kernels against their CPU references ---- */

/* n values of dt: magnitudes from 1e-6 to 1e2, both signs, some zeros */
static void *random_values(sp_test_rng *r, sp_dtype dt, size_t n) {
  double *v = calloc(n + 1, sizeof *v);
  void *out = calloc(n + 1, sp_dtype_size(dt));
  assert_true(v && out);
  for (size_t i = 0; i < n; i++) {
    uint64_t x = sp_test_rng_next(r);
    double mag = pow(10.0, (double)(x % 8000) / 1000.0 - 6.0);
    v[i] = (x >> 20) % 17 == 0 ? 0.0 : ((x >> 40) & 1 ? -mag : mag);
  }
  assert_int_equal(sp_cast(out, dt, v, SP_FLOAT64, n), 0);
  free(v);
  return out;
}

/* The host AdamW and gradient accumulation have a loop of their own for
 * float32 (fsdp_mem_host.c, vectorized); it must give the bits of the
 * general loop, which the same values take when one dtype is float64
 * (exact for float32 values): float64 gradients for AdamW, a float64
 * source for the accumulation. */
static void test_host_float32_paths(void **state) {
  (void)state;
  enum { N = 70001 };
  sp_test_rng rng = {9};
  struct sp_fsdp fake = {.mem = &sp_fsdp_host_ops};
  const sp_fsdp_mem_ops *h = &sp_fsdp_host_ops;
  sp_diag d = {""};
  float *p = random_values(&rng, SP_FLOAT32, N);
  float *g = random_values(&rng, SP_FLOAT32, N);
  float *m = random_values(&rng, SP_FLOAT32, N);
  float *v = random_values(&rng, SP_FLOAT32, N);
  float *src = random_values(&rng, SP_FLOAT32, N);
  for (size_t i = 0; i < N; i++) v[i] = fabsf(v[i]);
  float *p2 = malloc(N * 4), *m2 = malloc(N * 4), *v2 = malloc(N * 4);
  double *g64 = malloc(N * 8), *src64 = malloc(N * 8);
  assert_true(p2 && m2 && v2 && g64 && src64);
  memcpy(p2, p, N * 4), memcpy(m2, m, N * 4), memcpy(v2, v, N * 4);
  assert_int_equal(sp_cast(g64, SP_FLOAT64, g, SP_FLOAT32, N), 0);
  sp_fsdp_adamw_args aa = {.lr = 1e-3,
                           .lrwd = 1e-5,
                           .beta1 = 0.9,
                           .omb1 = 0.1,
                           .beta2 = 0.999,
                           .omb2 = 1e-3,
                           .bc1 = 1 - pow(0.9, 3),
                           .bc2 = 1 - pow(0.999, 3),
                           .eps = 1e-8};
  assert_int_equal(
      h->adamw(&fake, p, SP_FLOAT32, g, SP_FLOAT32, m, v, N, &aa, &d), 0);
  assert_int_equal(
      h->adamw(&fake, p2, SP_FLOAT32, g64, SP_FLOAT64, m2, v2, N, &aa, &d), 0);
  assert_memory_equal(p, p2, N * 4);
  assert_memory_equal(m, m2, N * 4);
  assert_memory_equal(v, v2, N * 4);
  for (int k = 0; k < 2; k++) {
    double div = k ? 1.5 : 1.0; /* 1: the divide is skipped */
    assert_int_equal(sp_cast(src64, SP_FLOAT64, src, SP_FLOAT32, N), 0);
    assert_int_equal(h->acc_div(&fake, SP_LANE_COMM, p, SP_FLOAT32, src,
                                SP_FLOAT32, N, div, &d),
                     0);
    assert_int_equal(h->acc_div(&fake, SP_LANE_COMM, p2, SP_FLOAT32, src64,
                                SP_FLOAT64, N, div, &d),
                     0);
    assert_memory_equal(p, p2, N * 4);
  }
  printf(
      "  host AdamW and accumulation: the float32 loops give the general "
      "loop's bits (%d elements)\n",
      N);
  free(p), free(g), free(m), free(v), free(src), free(p2), free(m2), free(v2);
  free(g64), free(src64);
}

#if SHARDPLANE_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "cast/cast_cuda.h"
#include "lib/fsdp/cuda_internal.h"

static void *dev_copy(const void *h, size_t bytes) {
  void *p = NULL;
  SP_TEST_CU(cudaMalloc(&p, bytes ? bytes : 1));
  SP_TEST_CU(cudaMemcpy(p, h, bytes, cudaMemcpyHostToDevice));
  return p;
}

static void same_bits(const void *dev, const void *host, size_t bytes,
                      const char *what) {
  unsigned char *back = malloc(bytes ? bytes : 1);
  assert_non_null(back);
  SP_TEST_CU(cudaMemcpy(back, dev, bytes, cudaMemcpyDeviceToHost));
  if (memcmp(back, host, bytes) != 0) {
    size_t i = 0;
    while (((const unsigned char *)host)[i] == back[i]) i++;
    fail_msg("%s: GPU and CPU differ at byte %zu", what, i);
  }
  free(back);
}

static void test_kernels_match_cpu(void **state) {
  (void)state;
  int nd = 0;
  if (sp_cuda_device_count(&nd) != 0 || nd == 0) {
    /* bench/gpu_check.sh runs this on a GPU machine, where a missing
     * device is a failure, not a reason to pass */
    const char *req = getenv("SHARDPLANE_REQUIRE_GPU");
    if (req && strcmp(req, "1") == 0)
      fail_msg("SHARDPLANE_REQUIRE_GPU=1 but no CUDA device is usable");
    printf("  (no CUDA device: the kernels are not compared)\n");
    return;
  }
  const sp_dtype pdts[] = {SP_FLOAT32, SP_BFLOAT16};
  const size_t sizes[] = {1, 255, 4096, 4097, 70001};
  sp_test_rng rng = {42};
  /* the host ops read nothing of the runtime */
  struct sp_fsdp fake = {.mem = &sp_fsdp_host_ops};
  const sp_fsdp_mem_ops *h = &sp_fsdp_host_ops;
  sp_diag d = {""};
  for (size_t a = 0; a < 2; a++)
    for (size_t b = 0; b < sizeof sizes / sizeof sizes[0]; b++) {
      sp_dtype pdt = pdts[a], gdt = pdts[a];
      size_t n = sizes[b], ps = sp_dtype_size(pdt);
      void *p = random_values(&rng, pdt, n), *g = random_values(&rng, gdt, n);
      float *m = random_values(&rng, SP_FLOAT32, n);
      float *v = random_values(&rng, SP_FLOAT32, n);
      for (size_t i = 0; i < n; i++) v[i] = fabsf(v[i]);
      void *dp = dev_copy(p, n * ps), *dg = dev_copy(g, n * ps);
      void *dm = dev_copy(m, n * 4), *dv = dev_copy(v, n * 4);
      sp_fsdp_adamw_args aa = {.lr = 1e-3,
                               .lrwd = 1e-5,
                               .beta1 = 0.9,
                               .omb1 = 0.1,
                               .beta2 = 0.999,
                               .omb2 = 1e-3,
                               .bc1 = 1 - pow(0.9, 3),
                               .bc2 = 1 - pow(0.999, 3),
                               .eps = 1e-8};
      assert_int_equal(h->adamw(&fake, p, pdt, g, gdt, m, v, n, &aa, &d), 0);
      assert_int_equal(
          sp_fsdp_cuda_adamw(dp, pdt, dg, gdt, dm, dv, n, &aa, NULL, &d), 0);
      same_bits(dp, p, n * ps, "adamw p");
      same_bits(dm, m, n * 4, "adamw m");
      same_bits(dv, v, n * 4, "adamw v");
      assert_int_equal(h->sgd(&fake, p, pdt, g, gdt, m, n, 0.01, 0.9, 0.1, &d),
                       0);
      assert_int_equal(
          sp_fsdp_cuda_sgd(dp, pdt, dg, gdt, dm, n, 0.01, 0.9, 0.1, NULL, &d),
          0);
      same_bits(dp, p, n * ps, "sgd p");
      same_bits(dm, m, n * 4, "sgd momentum");
      assert_int_equal(h->scale(&fake, SP_LANE_COMPUTE, g, gdt, n, 0.3, &d), 0);
      assert_int_equal(sp_fsdp_cuda_scale(dg, gdt, n, 0.3, NULL, &d), 0);
      same_bits(dg, g, n * ps, "scale");
      double want = 0, *dpart = NULL, *dout = NULL, got = -1;
      assert_int_equal(h->sqsum(&fake, g, gdt, n, NULL, &want, &d), 0);
      SP_TEST_CU(cudaMalloc((void **)&dpart, sp_fsdp_sqsum_chunks(n) * 8 + 8));
      SP_TEST_CU(cudaMalloc((void **)&dout, 8));
      assert_int_equal(sp_fsdp_cuda_sqsum(dg, gdt, n, dpart, dout, NULL, &d),
                       0);
      SP_TEST_CU(cudaMemcpy(&got, dout, 8, cudaMemcpyDeviceToHost));
      if (memcmp(&got, &want, 8) != 0)
        fail_msg("sqsum n=%zu: GPU %.17g, CPU %.17g", n, got, want);
      /* the reduction's accumulation: float32 source into pdt */
      float *src = random_values(&rng, SP_FLOAT32, n);
      void *dsrc = dev_copy(src, n * 4);
      assert_int_equal(
          h->acc_div(&fake, SP_LANE_COMM, p, pdt, src, SP_FLOAT32, n, 1.5, &d),
          0);
      assert_int_equal(
          sp_fsdp_cuda_scale_div(dsrc, SP_FLOAT32, n, 1.5, NULL, &d), 0);
      assert_int_equal(sp_fsdp_cuda_acc(dp, pdt, dsrc, SP_FLOAT32, n, NULL, &d),
                       0);
      SP_TEST_CU(cudaDeviceSynchronize());
      same_bits(dp, p, n * ps, "acc_div");
      cudaFree(dp), cudaFree(dg), cudaFree(dm), cudaFree(dv), cudaFree(dsrc);
      cudaFree(dpart), cudaFree(dout);
      free(p), free(g), free(m), free(v), free(src);
    }
  printf(
      "  AdamW, SGD, scale, sum of squares and accumulation: GPU bits "
      "equal the CPU's (float32, bfloat16; 1 .. 70001 elements)\n");
}
#else
static void test_kernels_match_cpu(void **state) {
  (void)state;
  printf("  (built without CUDA: the kernels are not compared)\n");
}
#endif

/* ---- specs ---- */

static char *write_spec(const char *name, const char *text) {
  char *path = sp_test_path(g_dir, name);
  sp_test_write_file(path, text, strlen(text));
  return path;
}

static int setup(void **state) {
  (void)state;
  g_dir = sp_test_mkdtemp();
  g_tiny = write_spec(
      "tiny.json",
      "{\"format\": \"shardplane.model/v1\", \"name\": \"tiny\", \"modules\": "
      "[{\"fqn\": \"\", \"type\": \"Net\"}], \"params\": ["
      "{\"fqn\": \"w\", \"shape\": [2, 2], \"dtype\": \"float32\", "
      "\"requires_grad\": true}, {\"fqn\": \"b\", \"shape\": [2], "
      "\"dtype\": \"float32\", \"requires_grad\": true}], \"buffers\": []}\n");
  /* layers.i Linear [3 + 2i, 5] with bias: N = 18, 28, 38, padding for
   * W = 3, 4; a root norm of 7 */
  char spec[4096];
  int k = snprintf(spec, sizeof spec,
                   "{\"format\": \"shardplane.model/v1\", \"name\": "
                   "\"layers\", \"modules\": [{\"fqn\": \"\", \"type\": "
                   "\"Net\"}, {\"fqn\": \"layers\", \"type\": "
                   "\"Sequential\"}, {\"fqn\": \"layers.0\", \"type\": "
                   "\"Linear\"}, {\"fqn\": \"layers.1\", \"type\": "
                   "\"Linear\"}, {\"fqn\": \"layers.2\", \"type\": "
                   "\"Linear\"}, {\"fqn\": \"norm\", \"type\": \"Norm\"}], "
                   "\"params\": [");
  for (int i = 0; i < 3; i++)
    k += snprintf(spec + k, sizeof spec - (size_t)k,
                  "{\"fqn\": \"layers.%d.weight\", \"shape\": [%d, 5], "
                  "\"dtype\": \"float32\", \"requires_grad\": true}, "
                  "{\"fqn\": \"layers.%d.bias\", \"shape\": [%d], \"dtype\": "
                  "\"float32\", \"requires_grad\": true}, ",
                  i, 3 + 2 * i, i, 3 + 2 * i);
  snprintf(spec + k, sizeof spec - (size_t)k,
           "{\"fqn\": \"norm.weight\", \"shape\": [7], \"dtype\": "
           "\"float32\", \"requires_grad\": true}], \"buffers\": []}\n");
  g_layers = write_spec("layers.json", spec);
  /* the unit layers.0: scale (frozen, first), weight, bias */
  g_frozen = write_spec(
      "frozen.json",
      "{\"format\": \"shardplane.model/v1\", \"name\": \"frozen\", "
      "\"modules\": [{\"fqn\": \"\", \"type\": \"Net\"}, {\"fqn\": "
      "\"layers\", \"type\": \"Sequential\"}, {\"fqn\": \"layers.0\", "
      "\"type\": \"Linear\"}], \"params\": ["
      "{\"fqn\": \"layers.0.scale\", \"shape\": [3], \"dtype\": \"float32\", "
      "\"requires_grad\": false}, {\"fqn\": \"layers.0.weight\", \"shape\": "
      "[2, 3], \"dtype\": \"float32\", \"requires_grad\": true}, {\"fqn\": "
      "\"layers.0.bias\", \"shape\": [2], \"dtype\": \"float32\", "
      "\"requires_grad\": true}], \"buffers\": []}\n");
  return 0;
}

static int teardown(void **state) {
  (void)state;
  sp_test_rmtree(g_dir);
  free(g_dir);
  free(g_tiny);
  free(g_layers);
  free(g_frozen);
  return 0;
}

int main(int argc, char **argv) {
  if (argc > 1) cmocka_set_test_filter(argv[1]);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_adamw_by_hand),
      cmocka_unit_test(test_sgd_momentum_by_hand),
      cmocka_unit_test(test_lr_schedule),
      cmocka_unit_test(test_decay_mask),
      cmocka_unit_test(test_options),
      cmocka_unit_test(test_clip_grad_norm),
      cmocka_unit_test(test_grad_accumulation),
      cmocka_unit_test(test_memory_model),
      cmocka_unit_test(test_bug_own_update_seen),
      cmocka_unit_test(test_bug_mixed_requires_grad),
      cmocka_unit_test(test_host_float32_paths),
      cmocka_unit_test(test_kernels_match_cpu),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
