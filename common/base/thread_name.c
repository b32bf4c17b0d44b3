#include "base/thread_name.h"

#include <pthread.h>
#include <string.h>

void sp_thread_name(const char *name) {
  char buf[16];
  size_t n = strlen(name);
  if (n > sizeof buf - 1) n = sizeof buf - 1;
  memcpy(buf, name, n);
  buf[n] = '\0';
  (void)pthread_setname_np(pthread_self(), buf);
}
