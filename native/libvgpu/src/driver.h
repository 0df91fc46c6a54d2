/*
 * driver.h — the bottom layer's driver table: the real libcuda.so.1 / libnvidia-ml.so.1 and
 * glibc's own symbol lookup. Knows nothing of limits, regions or accounting.
 *
 * Every slot of tv_real[] is callable once its library is loaded: an entry point the installed
 * driver lacks is filled with a stub that returns an error (CUDA_ERROR_NOT_FOUND,
 * NVML_ERROR_FUNCTION_NOT_FOUND), so no call through REAL() can ever jump to NULL. Whether the
 * driver really has it is TV_HAS(name) (for optional steps that have an alternative).
 */
#ifndef TV_DRIVER_H
#define TV_DRIVER_H

#include "base.h"
#include "symbols.h"

/* glibc's dlsym / dlvsym / dlmopen, found by reading libc's own symbol table (never through a
 * symbol lookup, which our exported hooks would answer). */
struct tv_libc {
    void *(*dlsym)(void *, const char *);
    void *(*dlvsym)(void *, const char *, const char *);
    void *(*dlmopen)(long, const char *, int);
};
extern struct tv_libc tv_libc TV_HIDDEN;
void tv_libc_resolve(void) TV_HIDDEN;          /* idempotent; safe before constructors */
void *tv_real_dlsym(void *handle, const char *name) TV_HIDDEN;

enum tv_lib { TV_LIB_CUDA = 0, TV_LIB_NVML = 1 };
/* Open the real library (our own dlopen) and fill its part of tv_real[]; NULL if absent. */
void *tv_driver_open(enum tv_lib which) TV_HIDDEN;

extern unsigned char tv_present[TV_SYM_COUNT] TV_HIDDEN; /* the driver exports it */
#define TV_HAS(name) (tv_present[TV_SYM_##name] != 0)

/* A table index of the real address p of a hooked or denied CUDA entry point, -1 if none. */
int tv_driver_sym_of(const void *p) TV_HIDDEN;

#endif
