/* --losses and --stats (worker_stats.h). */
#include "worker_stats.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "train_memory.h"

/* A JSON array of doubles, exact (%.17g). */
static void put_doubles(FILE *fp, const double *l, uint32_t n) {
  fputc('[', fp);
  for (uint32_t i = 0; i < n; i++) fprintf(fp, "%s%.17g", i ? ", " : "", l[i]);
  fputc(']', fp);
}

int sp_worker_write_losses(const char *path, const double *l, uint32_t n) {
  FILE *fp = fopen(path, "w");
  if (!fp) return SP_EIO;
  put_doubles(fp, l, n);
  fputc('\n', fp);
  return fclose(fp) == 0 ? 0 : SP_EIO;
}

long long sp_worker_proc_bytes(const char *key) {
  return sp_proc_bytes("/proc/self/status", key);
}

bool sp_worker_reset_rss_peak(void) {
  FILE *fp = fopen("/proc/self/clear_refs", "w");
  if (!fp) return false;
  bool ok = fputs("5", fp) >= 0;
  return fclose(fp) == 0 && ok;
}

static void put_account(FILE *fp, const sp_mem_account *a) {
  fputc('{', fp);
  for (int c = 0; c < SP_MEM_N_CATS; c++)
    fprintf(fp, "\"%s\": {\"current\": %llu, \"peak\": %llu}, ",
            sp_mem_cat_name((sp_mem_cat)c),
            (unsigned long long)a->cat[c].current,
            (unsigned long long)a->cat[c].peak);
  fprintf(fp,
          "\"total\": {\"current\": %llu, \"peak\": %llu}, "
          "\"reserved\": {\"current\": %llu, \"peak\": %llu}, "
          "\"allocs\": %llu}",
          (unsigned long long)a->total.current,
          (unsigned long long)a->total.peak,
          (unsigned long long)a->reserved.current,
          (unsigned long long)a->reserved.peak, (unsigned long long)a->allocs);
}

static void put_phase(FILE *fp, const char *name,
                      const sp_worker_mem_phase *p) {
  fprintf(fp,
          ", \"%s\": {\"rss_start\": %lld, \"rss_hwm\": %lld, "
          "\"counted\": ",
          name, p->rss_start, p->rss_hwm);
  put_account(fp, &p->counted);
  fputc('}', fp);
}

int sp_worker_write_stats(const char *path, const double *step_s,
                          const sp_gpt2_times *gt, uint32_t first, uint32_t n,
                          uint32_t report_toggle, bool no_report,
                          const sp_worker_mem *m) {
  FILE *fp = fopen(path, "w");
  if (!fp) return SP_EIO;
  fputs("{\"step_seconds\": ", fp);
  put_doubles(fp, step_s, n);
  static const char *const parts[] = {"compute_seconds", "wait_seconds",
                                      "optim_seconds", "comm_seconds"};
  for (int k = 0; gt && k < 4; k++) {
    fprintf(fp, ", \"%s\": [", parts[k]);
    for (uint32_t i = 0; i < n; i++) {
      double v = k == 0   ? gt[i].compute_s
                 : k == 1 ? gt[i].wait_s
                 : k == 2 ? gt[i].optim_s
                          : gt[i].comm_s;
      fprintf(fp, "%s%.9g", i ? ", " : "", v);
    }
    fputc(']', fp);
  }
  fputs(", \"reported\": [", fp);
  for (uint32_t k = 0; k < n; k++) {
    uint32_t i = first + k;
    bool on = report_toggle ? (i / report_toggle) % 2 == 0 : !no_report;
    fprintf(fp, "%s%s", k ? ", " : "", on ? "true" : "false");
  }
  fprintf(fp,
          "], \"memory\": {\"rss_before\": %lld, "
          "\"allocs_after_first_step\": %llu, \"activations\": %llu, "
          "\"activations_by_category\": {",
          m->rss_before, (unsigned long long)m->allocs_after_first_step,
          (unsigned long long)m->activations.total);
  for (int c = 0; c < SP_ACT_N_CATS; c++)
    fprintf(fp, "%s\"%s\": %llu", c ? ", " : "", sp_act_cat_name((sp_act_cat)c),
            (unsigned long long)m->activations.cat[c]);
  fputc('}', fp);
  if (m->train.have) put_phase(fp, "train", &m->train);
  if (m->ckpt.have) put_phase(fp, "checkpoint", &m->ckpt);
  fputs("}}\n", fp);
  return fclose(fp) == 0 ? 0 : SP_EIO;
}
