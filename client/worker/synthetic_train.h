/* shardplane-worker --synthetic: the runtime's unshard / reduce / cast
 * cycle on any spec, with gradients made up from the parameters instead
 * of a model's (the runtime's memory and collectives without a model:
 * bench/memory). Plain SGD at lr * 0.01. */
#ifndef SP_SYNTHETIC_TRAIN_H
#define SP_SYNTHETIC_TRAIN_H

#include <stdint.h>

#include "lib/shardplane.h"

/* One step (index step, 0-based): every unit's forward and backward
 * schedule, each gradient 0.01 times its parameter (deterministic and
 * the same on every rank), the optimizer, and the device's work waited
 * for. A collective: every rank calls it. */
int sp_synthetic_step(sp_fsdp *f, sp_session *s, uint64_t step, double lr,
                      sp_diag *d);

#endif
