/* The core of `shardplane analyze`: a coordinator's dump (JSON, format
 * "shardplane.dump/v1") in, the first divergence of every communicator and
 * each rank's last event out, as PyTorch's flight-recorder analyzer reads
 * NCCL's dumps. No I/O beyond what the caller hands in, so tests feed it
 * dumps made by hand. */
#ifndef SP_CLI_ANALYZE_H
#define SP_CLI_ANALYZE_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "base/sp_error.h"

/* A dump is untrusted input: these bound what is read. */
#define SP_DUMP_MAX_BYTES ((size_t)512 << 20)
#define SP_DUMP_MAX_RANKS 65536
#define SP_DUMP_MAX_EVENTS 1000000 /* per rank */
#define SP_DUMP_MAX_ALERTS 10000
/* A collective issued less than this long before the dump was taken is in
 * flight, not stuck: a live job's dump always catches some. */
#define SP_ANALYZE_SETTLE_US 1000000

typedef enum sp_finding_kind {
  SP_FINDING_DESYNC,  /* every member issued seq, not the same collective */
  SP_FINDING_MISSING, /* some members issued seq, others did not */
  SP_FINDING_STUCK,   /* every member issued seq, not every one finished */
} sp_finding_kind;

/* The first divergence on one communicator. */
typedef struct sp_finding {
  sp_finding_kind kind;
  char comm[16];
  uint32_t comm_index;
  uint64_t seq;
  /* the ranks at fault: DESYNC the minority fingerprint's, MISSING those
   * that did not issue, STUCK those that did not complete */
  uint32_t *culprits;
  size_t n_culprits;
  char *text; /* the finding in plain words, one or more lines */
} sp_finding;

typedef struct sp_rank_last {
  uint32_t rank;
  bool answered; /* its flight recorder is in the dump */
  char *text;    /* "step 3 FORWARD ..." or why it did not answer */
} sp_rank_last;

typedef struct sp_analysis {
  char *header; /* what the dump is: when, why, the job */
  char *alerts; /* the coordinator's alerts, one per line ("" none) */
  sp_finding *findings;
  size_t n_findings;
  sp_rank_last *ranks;
  size_t n_ranks;
  size_t n_comms;         /* communicators seen */
  uint64_t n_collectives; /* collective events read */
} sp_analysis;

/* Reads the dump in buf (origin names it in errors: the file, or the
 * coordinator) into *out. unit_fqns[u] (n_units of them; NULL, 0: none)
 * names unit u's module where an event has no "fqn" of its own (a live
 * dump: the coordinator's plan). SP_EFORMAT (or SP_ETOOBIG, SP_ENOMEM)
 * with a message in d naming origin, the JSON path and what is wrong. */
int sp_analyze(const char *buf, size_t len, const char *origin,
               const char *const *unit_fqns, size_t n_units, sp_analysis *out,
               sp_diag *d);
void sp_analysis_free(sp_analysis *a);

/* The report, for a person. */
void sp_analysis_print(const sp_analysis *a, FILE *f);
/* The same as JSON; NULL when out of memory. */
json_t *sp_analysis_json(const sp_analysis *a);

#endif
