/* Names the calling thread (as top -H, gdb and /proc/PID/task/TID/comm
 * show it), so a hung process's stacks say which thread is which. */
#ifndef SP_THREAD_NAME_H
#define SP_THREAD_NAME_H

/* The first 15 bytes of name (the kernel's limit). Best effort: a failure
 * changes nothing else. Any thread, for itself. */
void sp_thread_name(const char *name);

#endif
