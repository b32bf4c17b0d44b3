/* What rank 0 of shardplane-worker writes with --losses and --stats (the
 * benchmarks and tests read them), and the process memory --stats
 * reports, read from /proc/self. */
#ifndef SP_WORKER_STATS_H
#define SP_WORKER_STATS_H

#include <stdbool.h>
#include <stdint.h>

#include "gpt2_train.h"
#include "lib/shardplane.h"

/* A "VmRSS:" / "VmHWM:" line of /proc/self/status in bytes; -1 when the
 * file or the line is missing (not Linux). */
long long sp_worker_proc_bytes(const char *key);
/* Sets VmHWM back to VmRSS, to measure the peak of one phase; false when
 * the kernel does not allow it. */
bool sp_worker_reset_rss_peak(void);

/* The memory of one phase (training, the checkpoints). */
typedef struct sp_worker_mem_phase {
  bool have;
  long long rss_start, rss_hwm; /* bytes, -1: unknown */
  sp_mem_account counted;
} sp_worker_mem_phase;

typedef struct sp_worker_mem {
  long long rss_before; /* before sp_fsdp_new */
  uint64_t allocs_after_first_step;
  /* the trainer's activations and scratch by category (0: synthetic) */
  sp_act_bytes activations;
  sp_worker_mem_phase train, ckpt;
} sp_worker_mem;

/* --losses: a JSON array of the n losses, exact (%.17g). 0 or SP_EIO. */
int sp_worker_write_losses(const char *path, const double *l, uint32_t n);

/* --stats: {"step_seconds": [...], "reported": [true, ...], "memory":
 * {...}}: the n steps trained from step index `first` on, which of them
 * reported (every report_toggle steps off and on again, starting on; else
 * all unless no_report); a GPT-2's also where each step's time went (gt:
 * sp_gpt2_times per step, or NULL) as "compute_seconds", "wait_seconds",
 * "optim_seconds" and "comm_seconds". 0 or SP_EIO. */
int sp_worker_write_stats(const char *path, const double *step_s,
                          const sp_gpt2_times *gt, uint32_t first, uint32_t n,
                          uint32_t report_toggle, bool no_report,
                          const sp_worker_mem *m);

#endif
