/* The GPU paths against the CPU, on one GPU (cuda:0):
 *  - layers: every layer of the reference MLP on the GPU (client/worker/
 *    mlp_cuda.cu) fed the CPU's exact inputs (client/worker/mlp.c), layer by
 *    layer, forward, loss and backward: the elementwise kernels, column
 *    sums, norm updates and counters must give the CPU's bits; GEMM
 *    results (cuBLAS's summation order) must be within a stated bound;
 *  - parity: shardplane-worker --device cuda:0 (the FSDP runtime in device
 *    memory, NCCL with one rank, the MLP on cuBLAS) for every strategy
 *    (at W = 1 each runs as NO_SHARD), mixed precision off and on, against
 *    the CPU's unsharded reference run (sp_mlp_reference_run): loss curve
 *    and the final parameters of the FULL checkpoint;
 *  - checkpoints: the buffer test model trained on the GPU, its FULL,
 *    SHARDED and LOCAL checkpoints read back on the host with every buffer
 *    in its original dtype (LOCAL: compute dtype), and reloaded across
 *    devices (GPU checkpoint into a CPU rank and back) with every tensor
 *    byte-equal.
 * Skips (exit 77, with the reason) when libshardplane was built without
 * CUDA or NCCL, or no CUDA device is present. */
#include <math.h>
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

#include "cast/cast.h"
#include "support/job_fixture.h"
#include "support/mlp_reference.h"
#include "worker/mlp.h"
#include "worker/mlp_cuda.h"
#include "plan/plan.h"
#include "safetensors/safetensors.h"
#include "lib/shardplane.h"
#include "support/testutil.h"

/* everything below needs both; without them main only skips */
#if SHARDPLANE_HAVE_CUDA && SHARDPLANE_HAVE_NCCL
#define SP_GPU_TESTS 1
#include <cuda_runtime_api.h>
#endif

#define MLP SP_EXAMPLES "/mlp.json"
#define MLP_BUFFERS SP_TEST_DATA "/mlp_buffers.json"
#define STEPS 6
#define BATCH 24
#define LR "0.05"

#ifdef SP_GPU_TESTS

#define OK(call)                                     \
  do {                                               \
    sp_diag d_ = {{0}};                              \
    (void)d_;                                        \
    int rc_ = (call);                                \
    if (rc_ != 0) fail_msg("%s: %s", #call, d_.msg); \
  } while (0)

/* ================================================================== */
/* layers: the GPU MLP on the CPU's inputs                            */
/* ================================================================== */

/* Every param (in pd), gradient and buffer (in its compute dtype) laid end
 * to end, once on the host and once on the device. Params are packed as
 * the runtime's flat views are (element-aligned only); buffers, of mixed
 * dtypes, start at 16-byte boundaries, as the runtime's separately
 * allocated buffers do (a device load needs element alignment). */
typedef struct tensors {
  const sp_model *m;
  sp_dtype pd;
  sp_dtype *bdt;
  size_t *poff, *boff; /* bytes */
  size_t pbytes, bbytes;
  uint8_t *hp, *hg, *hb; /* host params, grads, buffers */
  uint8_t *dp, *dg, *db; /* device */
} tensors;

typedef struct io_ctx {
  tensors *t;
  bool device;
} io_ctx;

static void *io_param(void *u, int32_t p) {
  io_ctx *c = u;
  return (c->device ? c->t->dp : c->t->hp) + c->t->poff[p];
}
static void *io_grad(void *u, int32_t p) {
  io_ctx *c = u;
  return (c->device ? c->t->dg : c->t->hg) + c->t->poff[p];
}
static sp_dtype io_param_dtype(void *u, int32_t p) {
  (void)p;
  return ((io_ctx *)u)->t->pd;
}
static void *io_buffer(void *u, int32_t b) {
  io_ctx *c = u;
  return (c->device ? c->t->db : c->t->hb) + c->t->boff[b];
}
static sp_dtype io_buffer_dtype(void *u, int32_t b) {
  return ((io_ctx *)u)->t->bdt[b];
}

static void tensors_init(tensors *t, const sp_model *m, sp_dtype pd,
                         sp_dtype buffer_dtype) {
  memset(t, 0, sizeof *t);
  t->m = m;
  t->pd = pd;
  t->bdt = calloc(m->n_buffers + 1, sizeof *t->bdt);
  t->poff = calloc(m->n_params + 1, sizeof *t->poff);
  t->boff = calloc(m->n_buffers + 1, sizeof *t->boff);
  for (size_t p = 0; p < m->n_params; p++) {
    t->poff[p] = t->pbytes;
    t->pbytes += (size_t)m->params[p].numel * sp_dtype_size(pd);
  }
  for (size_t b = 0; b < m->n_buffers; b++) {
    const sp_tensor_spec *bs = &m->buffers[b];
    t->bdt[b] =
        sp_dtype_is_floating(bs->dtype) && buffer_dtype != SP_DTYPE_INVALID
            ? buffer_dtype
            : bs->dtype;
    t->bbytes = (t->bbytes + 15) & ~(size_t)15;
    t->boff[b] = t->bbytes;
    t->bbytes += (size_t)bs->numel * sp_dtype_size(t->bdt[b]);
  }
  t->hp = calloc(t->pbytes + 1, 1);
  t->hg = calloc(t->pbytes + 1, 1);
  t->hb = calloc(t->bbytes + 1, 1);
  assert_non_null(t->hp);
  assert_non_null(t->hg);
  assert_non_null(t->hb);
  /* the reference initialisation in the master dtype, then pd */
  for (size_t p = 0; p < m->n_params; p++) {
    const sp_tensor_spec *ps = &m->params[p];
    uint8_t *master = calloc((size_t)ps->numel, sp_dtype_size(ps->dtype));
    sp_mlp_init_param(NULL, m, (int32_t)p, 0, ps->numel, master);
    assert_int_equal(
        sp_cast(t->hp + t->poff[p], pd, master, ps->dtype, (size_t)ps->numel),
        0);
    free(master);
  }
  for (size_t b = 0; b < m->n_buffers; b++) {
    const sp_tensor_spec *bs = &m->buffers[b];
    uint8_t *orig = calloc((size_t)bs->numel + 1, sp_dtype_size(bs->dtype));
    sp_mlp_init_buffer(NULL, m, (int32_t)b, orig);
    if (t->bdt[b] == bs->dtype)
      memcpy(t->hb + t->boff[b], orig,
             (size_t)bs->numel * sp_dtype_size(bs->dtype));
    else
      assert_int_equal(sp_cast(t->hb + t->boff[b], t->bdt[b], orig, bs->dtype,
                               (size_t)bs->numel),
                       0);
    free(orig);
  }
  SP_TEST_CU(cudaMalloc((void **)&t->dp, t->pbytes + 1));
  SP_TEST_CU(cudaMalloc((void **)&t->dg, t->pbytes + 1));
  SP_TEST_CU(cudaMalloc((void **)&t->db, t->bbytes + 1));
  SP_TEST_CU(cudaMemcpy(t->dp, t->hp, t->pbytes, cudaMemcpyHostToDevice));
  SP_TEST_CU(cudaMemset(t->dg, 0, t->pbytes));
  SP_TEST_CU(cudaMemcpy(t->db, t->hb, t->bbytes, cudaMemcpyHostToDevice));
}

static void tensors_free(tensors *t) {
  SP_TEST_CU(cudaFree(t->dp));
  SP_TEST_CU(cudaFree(t->dg));
  SP_TEST_CU(cudaFree(t->db));
  free(t->hp);
  free(t->hg);
  free(t->hb);
  free(t->bdt);
  free(t->poff);
  free(t->boff);
}

static void *download(const void *dev, size_t bytes) {
  void *h = malloc(bytes + 1);
  assert_non_null(h);
  SP_TEST_CU(cudaDeviceSynchronize());
  if (bytes) SP_TEST_CU(cudaMemcpy(h, dev, bytes, cudaMemcpyDeviceToHost));
  return h;
}

/* A GEMM result against the CPU's sequential float32 sums: per element
 * |got - want| <= rel * |want| + abs_frac * max|want|. rel covers one
 * rounding of the output to a 16-bit dtype landing on the neighbour
 * (one ulp, at most 2^-7 relative); abs_frac the float32 accumulation in
 * another order (a few float32 ulps of the terms' magnitude). Returns how
 * many elements differ at all. */
static size_t near(const char *what, const float *got, const float *want,
                   size_t n, double rel, double abs_frac) {
  double scale = 0;
  for (size_t i = 0; i < n; i++)
    if (fabs((double)want[i]) > scale) scale = fabs((double)want[i]);
  size_t differ = 0;
  for (size_t i = 0; i < n; i++) {
    double e = fabs((double)got[i] - (double)want[i]);
    if (e > 0) differ++;
    if (!(e <= rel * fabs((double)want[i]) + abs_frac * scale))
      fail_msg(
          "%s: element %zu of %zu: GPU %.9g, CPU %.9g (bound %.3g "
          "relative + %.3g of the largest %.3g)",
          what, i, n, (double)got[i], (double)want[i], rel, abs_frac, scale);
  }
  return differ;
}

/* A tensor of dtype dt as float32 (host). */
static float *as_f32(const void *p, sp_dtype dt, size_t n) {
  float *f = calloc(n + 1, sizeof *f);
  assert_int_equal(sp_cast(f, SP_FLOAT32, p, dt, n), 0);
  return f;
}

typedef struct layer_case {
  const char *model;
  sp_dtype pd;
  sp_dtype buffer_dtype; /* SP_DTYPE_INVALID: buffers keep their dtype */
  size_t n;
} layer_case;

/* The bounds for GEMM results: float32 accumulates up to 64 terms in
 * another order (float32 eps 6e-8: 1e-5 of the tensor's largest value is
 * two orders above what that can move); 16-bit outputs may in addition
 * round to the neighbouring value (one ulp, <= 2^-7 relative). */
static double gemm_rel(sp_dtype pd) { return pd == SP_FLOAT32 ? 0 : 0x1p-7; }
#define GEMM_ABS 1e-5

static void compare_buffers(const tensors *t, const char *after) {
  uint8_t *db = download(t->db, t->bbytes);
  for (size_t b = 0; b < t->m->n_buffers; b++) {
    size_t bytes = (size_t)t->m->buffers[b].numel * sp_dtype_size(t->bdt[b]);
    if (memcmp(db + t->boff[b], t->hb + t->boff[b], bytes) != 0)
      fail_msg("%s: buffer %s (%s) differs from the CPU's", after,
               t->m->buffers[b].fqn, sp_dtype_name(t->bdt[b]));
  }
  free(db);
}

static void compare_grad(const tensors *t, int32_t p, bool exact,
                         size_t *differ, size_t *total) {
  if (p < 0) return;
  const sp_tensor_spec *ps = &t->m->params[p];
  size_t n = (size_t)ps->numel, bytes = n * sp_dtype_size(t->pd);
  uint8_t *dg = download(t->dg + t->poff[p], bytes);
  float *got = as_f32(dg, t->pd, n),
        *want = as_f32(t->hg + t->poff[p], t->pd, n);
  char what[160];
  snprintf(what, sizeof what, "gradient of %s (%s)", ps->fqn,
           sp_dtype_name(t->pd));
  if (exact)
    sp_test_same_f32(what, got, want, n);
  else
    *differ += near(what, got, want, n, gemm_rel(t->pd), GEMM_ABS);
  if (!exact) *total += n;
  free(got);
  free(want);
  free(dg);
}

static void layer_case_run(const layer_case *lc) {
  sp_model *m;
  sp_diag d = {{0}};
  if (sp_model_load_file(lc->model, &m, &d) < 0) fail_msg("%s", d.msg);
  sp_mlp *mlp;
  if (sp_mlp_new(m, &mlp, &d) < 0) fail_msg("%s", d.msg);
  tensors t;
  tensors_init(&t, m, lc->pd, lc->buffer_dtype);
  io_ctx hc = {&t, false}, dc = {&t, true};
  sp_mlp_io hio = {
      io_param, io_grad, io_param_dtype, io_buffer, io_buffer_dtype, NULL, &hc};
  sp_mlp_io dio = {
      io_param, io_grad, io_param_dtype, io_buffer, io_buffer_dtype, NULL, &dc};
  size_t n = lc->n;
  sp_mlp_acts *acts;
  assert_int_equal(sp_mlp_acts_new(mlp, n, &acts), 0);
  sp_mlp_cuda *g;
  if (sp_mlp_cuda_new(mlp, n, NULL, &g, &d) < 0) fail_msg("%s", d.msg);
  float *target = calloc(n * (size_t)mlp->out_dim + 1, sizeof *target);
  float *dev = calloc(n * (size_t)mlp->max_dim + 1, sizeof *dev);
  sp_dtype out_dt = sp_mlp_out_dtype(mlp, &hio);
  size_t gemm_differ = 0, gemm_total = 0;
  /* two steps: the second sees non-zero running means */
  for (uint64_t step = 0; step < 2; step++) {
    sp_mlp_batch(mlp, step, 0, n, acts->x[0], target);
    OK(sp_mlp_cuda_set_batch(g, acts->x[0], target, &d_));
    for (size_t l = 0; l < mlp->n_layers; l++) {
      const sp_mlp_layer *L = &mlp->layers[l];
      const char *fqn = m->modules[L->module].fqn;
      size_t in = (size_t)L->in, out = (size_t)L->out;
      OK(sp_mlp_cuda_write_act(g, l, acts->x[l], &d_));
      if (sp_mlp_forward(mlp, l, &hio, acts, BATCH, &d) < 0)
        fail_msg("CPU %s: %s", fqn, d.msg);
      if (sp_mlp_cuda_forward(g, l, &dio, BATCH, &d) < 0)
        fail_msg("GPU %s: %s", fqn, d.msg);
      char what[160];
      /* the input as the layer rounded it */
      OK(sp_mlp_cuda_read_act(g, l, dev, &d_));
      snprintf(what, sizeof what, "step %llu %s forward: rounded input",
               (unsigned long long)step, fqn);
      sp_test_same_f32(what, dev, acts->x[l], n * in);
      OK(sp_mlp_cuda_read_act(g, l + 1, dev, &d_));
      snprintf(what, sizeof what, "step %llu %s forward: output",
               (unsigned long long)step, fqn);
      if (L->kind == SP_MLP_LINEAR) {
        gemm_differ += near(what, dev, acts->x[l + 1], n * out,
                            gemm_rel(lc->pd), GEMM_ABS);
        gemm_total += n * out;
      } else {
        sp_test_same_f32(what, dev, acts->x[l + 1], n * out);
      }
      compare_buffers(&t, what);
    }
    /* the loss on the CPU's output */
    OK(sp_mlp_cuda_write_act(g, mlp->n_layers, acts->x[mlp->n_layers], &d_));
    double loss = sp_mlp_loss(mlp, acts, target, out_dt), gl = 0;
    OK(sp_mlp_cuda_loss(g, out_dt, &d_));
    OK(sp_mlp_cuda_read_loss(g, &gl, &d_));
    if (!(fabs(gl - loss) <= 1e-12 * fabs(loss)))
      fail_msg("step %llu loss: GPU %.17g, CPU %.17g", (unsigned long long)step,
               gl, loss);
    size_t count = n * (size_t)mlp->out_dim;
    OK(sp_mlp_cuda_read_dy(g, dev, count, &d_));
    sp_test_same_f32("loss gradient", dev, acts->dy, count);
    sp_dtype dy_dt = out_dt;
    memset(t.hg, 0, t.pbytes);
    SP_TEST_CU(cudaMemset(t.dg, 0, t.pbytes));
    for (size_t l = mlp->n_layers; l-- > 0;) {
      const sp_mlp_layer *L = &mlp->layers[l];
      const char *fqn = m->modules[L->module].fqn;
      size_t in = (size_t)L->in, out = (size_t)L->out;
      OK(sp_mlp_cuda_write_dy(g, acts->dy, n * out, dy_dt, &d_));
      if (sp_mlp_backward(mlp, l, &hio, acts, &d) < 0)
        fail_msg("CPU %s: %s", fqn, d.msg);
      if (sp_mlp_cuda_backward(g, l, &dio, &d) < 0)
        fail_msg("GPU %s: %s", fqn, d.msg);
      bool linear = L->kind == SP_MLP_LINEAR;
      compare_grad(&t, L->weight, !linear, &gemm_differ, &gemm_total);
      /* bias gradients are ordered column sums: exact */
      compare_grad(&t, L->bias, true, &gemm_differ, &gemm_total);
      if (l == 0) continue;
      char what[160];
      snprintf(what, sizeof what, "step %llu %s backward: input gradient",
               (unsigned long long)step, fqn);
      OK(sp_mlp_cuda_read_dy(g, dev, n * in, &d_));
      if (linear) {
        gemm_differ +=
            near(what, dev, acts->dy, n * in, gemm_rel(lc->pd), GEMM_ABS);
        gemm_total += n * in;
      } else {
        sp_test_same_f32(what, dev, acts->dy, n * in);
      }
      if (L->kind != SP_MLP_RELU) dy_dt = lc->pd;
    }
    OK(sp_mlp_cuda_count_step(g, &dio, &d_));
    sp_mlp_count_step(mlp, &hio);
    compare_buffers(&t, "count_step");
  }
  printf(
      "  %-40s %-8s batch %2zu: elementwise bit-exact; GEMM outputs "
      "differing from the CPU's sums in %zu of %zu elements (in bound)\n",
      strrchr(lc->model, '/') + 1, sp_dtype_name(lc->pd), n, gemm_differ,
      gemm_total);
  free(target);
  free(dev);
  sp_mlp_cuda_free(g);
  sp_mlp_acts_free(acts);
  tensors_free(&t);
  sp_mlp_free(mlp);
  sp_model_free(m);
}

static void test_layers(void **state) {
  (void)state;
  const layer_case cases[] = {
      {MLP, SP_FLOAT32, SP_DTYPE_INVALID, BATCH},
      {MLP, SP_FLOAT32, SP_DTYPE_INVALID, 5},
      {MLP, SP_BFLOAT16, SP_DTYPE_INVALID, BATCH},
      {MLP, SP_FLOAT16, SP_DTYPE_INVALID, 7},
      /* running means of float64, float16, bfloat16; int64/int32
       * counters; bools */
      {MLP_BUFFERS, SP_FLOAT32, SP_DTYPE_INVALID, BATCH},
      {MLP_BUFFERS, SP_BFLOAT16, SP_BFLOAT16, BATCH},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    layer_case_run(&cases[i]);
}

/* ================================================================== */
/* whole runs: coordinator + shardplane-worker --device cuda:0        */
/* ================================================================== */

/* a job's workers must all be done within this */
#define JOB_TIMEOUT_S 180

/* Bounds of the GPU run against the CPU's single-process reference.
 * float32: the runs differ only where cuBLAS sums a GEMM in another order
 * than the CPU's sequential loop (a few float32 ulps per GEMM output, eps
 * 6e-8), which six SGD steps at lr 0.05 carry into the loss and the
 * parameters; 1e-4 relative is two orders of magnitude above that and
 * still far below any real error (a transposed operand, a missing bias, a
 * wrong rounding or divide factor moves them by 1e-2 or more). It is ten
 * times the CPU parity bound (1e-5), which compares runs that differ in
 * summation order across ranks only, not inside every GEMM.
 * bfloat16: a GEMM output whose float32 sum differs in its last bits
 * rounds, now and then, to the neighbouring bfloat16 value (2^-8
 * relative), and the layer test above shows it happens; that is the same
 * size of perturbation the CPU parity test bounds with 1e-3 (a quarter of
 * bfloat16's relative spacing) for ranks rounding partial gradients, so
 * the same bound holds here.
 * Measured on the CPU by emulation (mlp.c with every Linear sum in reverse
 * order and accumulated with fused multiply-adds, as a GPU GEMM may):
 * float32 1e-8 (loss) and 6e-8 (params) after these 6 steps; bfloat16
 * identical results. */
#define TOL_F32 1e-4
#define TOL_BF16 1e-3

static const char *const k_strategies[] = {"FULL_SHARD", "SHARD_GRAD_OP",
                                           "NO_SHARD", "HYBRID_SHARD"};

static void parity(const char *strategy, bool mp) {
  static const char *const cflags[] = {"--backend", "nccl", NULL};
  static const char *const wflags[] = {"--device", "cuda:0", NULL};
  char label[64];
  snprintf(label, sizeof label, "%-13s %-4s cuda:0 N=1 vs CPU", strategy,
           mp ? "bf16" : "f32");
  /* at W = 1 HYBRID_SHARD's shard group is the one rank */
  sp_tjob_parity_cfg c = {.model = MLP,
                          .strategy = strategy,
                          .group = 1,
                          .mp = mp,
                          .n = 1,
                          .steps = STEPS,
                          .batch = BATCH,
                          .lr = LR,
                          .cflags = cflags,
                          .wflags = wflags,
                          .tol = mp ? TOL_BF16 : TOL_F32,
                          .timeout_s = JOB_TIMEOUT_S};
  sp_tjob_parity(label, &c);
}

static void test_parity(void **state) {
  (void)state;
  for (size_t s = 0; s < 4; s++)
    for (int mp = 0; mp <= 1; mp++) parity(k_strategies[s], mp);
}

/* ---- checkpoints ---- */

static const char *const k_buffer_job[] = {"--wrap-type",
                                           "Linear",
                                           "--param-dtype",
                                           "bfloat16",
                                           "--reduce-dtype",
                                           "float32",
                                           "--buffer-dtype",
                                           "bfloat16",
                                           "--backend",
                                           "nccl",
                                           NULL};

static void test_checkpoints(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *src = sp_test_path(dir, "gpu");
  const char *wflags[] = {"--device",
                          "cuda:0",
                          "--steps",
                          "4",
                          "--global-batch",
                          "24",
                          "--checkpoint-dir",
                          src,
                          "--checkpoint",
                          "full",
                          "--checkpoint",
                          "sharded",
                          "--checkpoint",
                          "local",
                          NULL};
  sp_tjob_run(MLP_BUFFERS, k_buffer_job, 1, wflags, JOB_TIMEOUT_S);

  sp_tjob_check_buffers(MLP_BUFFERS, 1, 4, 24, 0.05, src,
                        "sharded/rank-0-of-1.safetensors",
                        "local/local-0-of-1.safetensors", "GPU - CPU");

  /* across devices: the GPU's FULL checkpoint loaded by a CPU rank and
   * written again, and that loaded by a GPU rank; LOCAL (compute-dtype
   * buffers, flat shards) into the GPU again: each saved as FULL without
   * training, every tensor equal to the GPU's FULL checkpoint */
  static const char *const cpu_job[] = {
      "--wrap-type",    "Linear",         "--param-dtype",
      "bfloat16",       "--reduce-dtype", "float32",
      "--buffer-dtype", "bfloat16",       NULL};
  const struct {
    const char *from, *kind; /* under dir */
    const char *device;
    const char *const *job;
    const char *dst; /* under dir */
  } loads[] = {{"gpu/full", "full", "cpu", cpu_job, "cpu"},
               {"cpu/full", "full", "cuda:0", k_buffer_job, "back"},
               {"gpu/local", "local", "cuda:0", k_buffer_job, "local"}};
  for (size_t i = 0; i < sizeof loads / sizeof loads[0]; i++) {
    char *from = sp_test_path(dir, loads[i].from);
    char *dst = sp_test_path(dir, loads[i].dst);
    const char *lf[] = {"--device",    loads[i].device, "--steps",
                        "0",           "--load",        from,
                        "--load-kind", loads[i].kind,   "--checkpoint-dir",
                        dst,           "--checkpoint",  "full",
                        NULL};
    sp_tjob_run(MLP_BUFFERS, loads[i].job, 1, lf, JOB_TIMEOUT_S);
    sp_tjob_same_tensors(src, "full/model.safetensors", dst,
                         "full/model.safetensors");
    free(from);
    free(dst);
  }
  printf(
      "  GPU FULL -> CPU -> GPU and GPU LOCAL -> GPU: every tensor "
      "equal\n");
  free(src);
  sp_test_rmtree(dir);
  free(dir);
}

/* Whether this library's NCCL backend works here: a communicator of one
 * member on cuda:0 (no store needed). */
static int nccl_probe(char *why, size_t cap) {
  sp_comm_opts o = {.backend = SP_BACKEND_NCCL,
                    .prefix = "probe",
                    .rank = 0,
                    .size = 1,
                    .timeout_ms = 30000,
                    .device = "cuda:0"};
  sp_comm *c = NULL;
  sp_diag d = {{0}};
  int rc = sp_comm_new(&o, &c, &d);
  if (rc < 0) snprintf(why, cap, "NCCL backend unavailable: %s", d.msg);
  sp_comm_free(c);
  return rc;
}

#endif /* SP_GPU_TESTS */

int main(void) {
#if !SHARDPLANE_HAVE_CUDA
  return sp_test_skip("libshardplane was built without CUDA");
#elif !SHARDPLANE_HAVE_NCCL
  return sp_test_skip("libshardplane was built without NCCL");
#else
  int ordinal;
  sp_diag d = {{0}};
  int rc = sp_device_parse("cuda:0", &ordinal, &d);
  if (rc < 0) {
    char why[SP_DIAG_MAX + 32];
    snprintf(why, sizeof why, "%s", d.msg);
    return sp_test_skip(why);
  }
  char why[SP_DIAG_MAX + 64];
  if (nccl_probe(why, sizeof why) < 0) return sp_test_skip(why);
  if (cudaSetDevice(0) != cudaSuccess) {
    fprintf(stderr, "cudaSetDevice(0) failed\n");
    return 1;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_layers),
      cmocka_unit_test(test_parity),
      cmocka_unit_test(test_checkpoints),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
#endif
}
