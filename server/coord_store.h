/* The store service (coord_store.c): StoreSet, StoreGet, StoreAdd,
 * StoreCompareSet, StoreDelete, StoreWait over the key-value store
 * (kvstore.h). The module owns the calls that wait on keys. Threads: the
 * loop thread only. */
#ifndef SP_COORD_STORE_H
#define SP_COORD_STORE_H

#include "coordinator.h"

int sp_coord_store_register(sp_coord *c);
/* Finishes every waiting call: UNAVAILABLE. */
void sp_coord_store_shutdown(sp_coord *c);

#endif
