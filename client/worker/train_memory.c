/* A training rank's memory, predicted (train_memory.h). */
#include "train_memory.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cast/cast_cuda.h"
#include "gpt2_acts.h"
#include "mlp.h"
#include "train_model.h"

static const char *const k_names[SP_ACT_N_CATS] = {"activations", "recompute",
                                                   "logits", "scratch"};
static const char *const k_labels[SP_ACT_N_CATS] = {
    "saved activations", "recomputed block", "logits", "activation scratch"};

const char *sp_act_cat_name(sp_act_cat c) {
  return (unsigned)c < SP_ACT_N_CATS ? k_names[c] : "invalid";
}

const char *sp_act_cat_label(sp_act_cat c) {
  return (unsigned)c < SP_ACT_N_CATS ? k_labels[c] : "invalid";
}

bool sp_train_mem_f32_views(const sp_plan *plan) {
  for (size_t u = 0; u < plan->n_units; u++)
    if (plan->units[u].n_params > 0 && plan->units[u].param_dtype != SP_FLOAT32)
      return false;
  return true;
}

/* The sequences (samples) of one micro-batch on one rank:
 * global_batch / grad_accum / world; SP_EINVAL naming the flags when it
 * does not divide. */
static int micro_batch(const sp_plan *plan, const sp_train_shape *shape,
                       uint64_t *out, sp_diag *d) {
  uint32_t W = plan->world_size, k = shape->grad_accum;
  if (k == 0) return sp_diag_set(d, SP_EINVAL, "--grad-accum 0: at least 1");
  uint64_t per_step = (uint64_t)k * W;
  if (shape->global_batch == 0 || shape->global_batch % per_step != 0)
    return sp_diag_set(d, SP_EINVAL,
                       "--global-batch %u: not a multiple of --grad-accum %u "
                       "x %u ranks (each rank takes an equal share of each "
                       "micro-batch)",
                       shape->global_batch, k, W);
  *out = shape->global_batch / per_step;
  return 0;
}

/* The trainer's arrays for the family of the spec. */
static int count_acts(const sp_plan *plan, const sp_train_shape *shape,
                      sp_train_mem *out, sp_diag *d) {
  sp_train_model tm = {0};
  sp_diag quiet = {0};
  /* a spec of no family the trainer runs is no error here: the runtime's
   * table stands alone, saying activations are not counted */
  if (sp_train_model_pick(plan->model, false, &tm, &quiet) != 0) {
    out->not_counted = "the reference trainer runs GPT-2 and MLP specs only";
    return 0;
  }
  int rc = 0;
  if (tm.gpt) {
    const sp_gpt2 *g = tm.gpt;
    uint32_t T = shape->seq_len ? shape->seq_len : (uint32_t)g->ctx;
    if ((int64_t)T > g->ctx) {
      rc = sp_diag_set(d, SP_EINVAL,
                       "--seq-len %u: at most the model's "
                       "context, %lld",
                       T, (long long)g->ctx);
    } else {
      sp_gpt2_shape sh = {out->micro_batch, T, shape->checkpointing,
                          sp_train_mem_f32_views(plan)};
      rc = sp_gpt2_acts_count(
          shape->device ? &sp_gpt2_cuda_layout : &sp_gpt2_cpu_layout, g, &sh,
          &out->act, d);
      out->seq_len = T;
      out->family = "gpt2";
    }
  } else if (tm.mlp) {
    if (shape->checkpointing)
      rc = sp_diag_set(d, SP_EINVAL,
                       "--activation-checkpointing: the MLP trainer keeps "
                       "every layer's input (only GPT-2 recomputes its "
                       "blocks)");
    else if ((rc = sp_mlp_acts_count(tm.mlp, out->micro_batch, &out->act)) != 0)
      sp_diag_set(d, rc, "MLP activations of %llu samples: %s",
                  (unsigned long long)out->micro_batch, sp_strerror(rc));
    out->family = "mlp";
  }
  sp_train_model_clear(&tm);
  return rc;
}

int sp_train_mem_predict(const sp_plan *plan, const sp_mem_opts *opts,
                         const sp_train_shape *shape, sp_train_mem *out,
                         sp_diag *d) {
  memset(out, 0, sizeof *out);
  if (plan == NULL || shape == NULL)
    return sp_diag_set(d, SP_EINVAL, "sp_train_mem_predict: NULL argument");
  int rc = sp_mem_estimate_plan(plan, opts, &out->runtime, d);
  if (rc == 0) rc = micro_batch(plan, shape, &out->micro_batch, d);
  if (rc == 0) rc = count_acts(plan, shape, out, d);
  if (rc != 0) return rc;
  out->footprint = SP_TRAIN_PROCESS_FOOTPRINT;
  out->peak = out->runtime.acct.reserved.peak + out->act.total + out->footprint;
  return 0;
}

long long sp_proc_bytes(const char *path, const char *key) {
  FILE *fp = fopen(path, "r");
  if (!fp) return -1;
  char line[256];
  long long kb = -1;
  size_t kl = strlen(key);
  while (fgets(line, sizeof line, fp))
    if (strncmp(line, key, kl) == 0) {
      kb = strtoll(line + kl, NULL, 10);
      break;
    }
  fclose(fp);
  return kb < 0 ? -1 : kb * 1024;
}

int sp_host_mem_available(uint64_t *out, sp_diag *d) {
  long long b = sp_proc_bytes("/proc/meminfo", "MemAvailable:");
  *out = b < 0 ? 0 : (uint64_t)b;
  if (b < 0)
    return sp_diag_set(d, SP_EIO,
                       "/proc/meminfo: cannot read its MemAvailable line");
  return 0;
}

/* bytes for people: "1.23 GiB", "512 MiB" */
static const char *human(uint64_t b, char *buf, size_t cap) {
  if (b >= (UINT64_C(1) << 30))
    snprintf(buf, cap, "%.2f GiB", (double)b / (double)(UINT64_C(1) << 30));
  else
    snprintf(buf, cap, "%.0f MiB", (double)b / (double)(UINT64_C(1) << 20));
  return buf;
}

int sp_train_mem_fit(const sp_train_mem *m, uint32_t ranks, uint64_t available,
                     const char *where, bool device, sp_diag *d) {
  /* on a GPU the device holds the runtime and the activations; the
   * process's own footprint is host memory */
  uint64_t per = device ? m->peak - m->footprint : m->peak;
  if (ranks == 0 || per <= available / ranks) return 0;
  char need[32], one[32], rt[32], av[32], fp[32];
  char acts[256] = "";
  size_t o = 0;
  for (int c = 0; c < SP_ACT_N_CATS && o < sizeof acts; c++) {
    char b[32];
    if (m->act.cat[c] == 0) continue;
    o += (size_t)snprintf(acts + o, sizeof acts - o, ", %s %s",
                          sp_act_cat_label((sp_act_cat)c),
                          human(m->act.cat[c], b, sizeof b));
  }
  char shape[96] = "";
  if (m->family && m->seq_len)
    snprintf(shape, sizeof shape, " for a micro-batch of %llu x %u tokens",
             (unsigned long long)m->micro_batch, m->seq_len);
  else if (m->family)
    snprintf(shape, sizeof shape, " for a micro-batch of %llu samples",
             (unsigned long long)m->micro_batch);
  return sp_diag_set(
      d, SP_ENOMEM,
      "the job needs about %s on %s: %u rank%s x %s (runtime %s%s%s%s)%s, "
      "but %s is available. Lower it with --grad-accum K (activations / K), "
      "--seq-len T, --activation-checkpointing, --param-dtype bfloat16 or "
      "fewer ranks (--nproc); --no-memory-check starts anyway",
      human(per * ranks, need, sizeof need), where, ranks,
      ranks == 1 ? "" : "s", human(per, one, sizeof one),
      human(m->runtime.acct.reserved.peak, rt, sizeof rt), acts,
      device ? "" : ", process ",
      device ? "" : human(m->footprint, fp, sizeof fp), shape,
      human(available, av, sizeof av));
}

void sp_train_mem_job(const sp_mlp_train_cfg *cfg, const sp_train_flags *t,
                      bool device, sp_mem_opts *opts, sp_train_shape *shape) {
  sp_mem_opts_default(opts);
  opts->optimizer = cfg->optim.kind == SP_OPTIM_ADAMW ? SP_MEM_OPT_ADAMW
                    : cfg->optim.momentum > 0         ? SP_MEM_OPT_SGD_MOMENTUM
                                                      : SP_MEM_OPT_SGD;
  opts->no_sync = cfg->no_sync;
  *shape = (sp_train_shape){.global_batch = cfg->global_batch,
                            .grad_accum = cfg->grad_accum,
                            .seq_len = t->seq_len,
                            .checkpointing = t->checkpointing,
                            .device = device};
}

int sp_train_mem_check(const sp_plan *plan, const sp_mlp_train_cfg *cfg,
                       const sp_train_flags *t, uint32_t host_ranks,
                       const char *host, int first_gpu, uint32_t n_gpus,
                       sp_train_mem *pred, sp_diag *d) {
  sp_mem_opts mo;
  sp_train_shape sh;
  sp_train_mem m;
  sp_train_mem_job(cfg, t, n_gpus > 0, &mo, &sh);
  int rc = sp_train_mem_predict(plan, &mo, &sh, &m, d);
  if (rc == 0 && pred != NULL) *pred = m;
  uint64_t avail = 0, total = 0;
  if (rc == 0 && host_ranks > 0) {
    rc = sp_host_mem_available(&avail, d);
    /* on GPUs the host keeps each rank's process; the device the rest */
    sp_train_mem on_host = m;
    if (n_gpus > 0) on_host.peak = m.footprint;
    if (rc == 0)
      rc = sp_train_mem_fit(&on_host, host_ranks, avail, host, false, d);
  }
  for (uint32_t i = 0; rc == 0 && i < n_gpus; i++) {
    int gpu = first_gpu + (int)i;
    char where[24];
    snprintf(where, sizeof where, "cuda:%d", gpu);
    rc = sp_cuda_device_memory(gpu, &avail, &total, d);
    if (rc == 0) rc = sp_train_mem_fit(&m, 1, avail, where, true, d);
  }
  return rc;
}
