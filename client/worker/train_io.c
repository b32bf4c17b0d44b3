/* The runtime's views as a model's io (train_io.h). */
#include "train_io.h"

#include "lib/shardplane.h"

void *sp_train_io_param(void *f, int32_t p) { return sp_fsdp_param(f, p); }

void *sp_train_io_grad(void *f, int32_t p) { return sp_fsdp_param_grad(f, p); }

sp_dtype sp_train_io_param_dtype(void *f, int32_t p) {
  return sp_fsdp_param_dtype(f, p);
}

void *sp_train_io_buffer(void *f, int32_t b) { return sp_fsdp_buffer(f, b); }

sp_dtype sp_train_io_buffer_dtype(void *f, int32_t b) {
  return sp_fsdp_buffer_dtype(f, b);
}
