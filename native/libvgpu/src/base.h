/* base.h — what every layer uses: visibility, branch hints, clocks, the log. No state. */
#ifndef TV_BASE_H
#define TV_BASE_H

#include <stdint.h>
#include <time.h>

#define TV_HIDDEN __attribute__((visibility("hidden")))
#define tv_likely(x) __builtin_expect(!!(x), 1)
#define tv_unlikely(x) __builtin_expect(!!(x), 0)

/* ---- log.c ---- */
enum { TV_LOG_ERROR = 0, TV_LOG_WARN = 1, TV_LOG_INFO = 2, TV_LOG_DEBUG = 4 };
extern int tv_log_level;
void tv_log_init(void) TV_HIDDEN;
void tv_log(int level, const char *fmt, ...) TV_HIDDEN __attribute__((format(printf, 2, 3)));
#define TV_LOG(lvl, ...)                                                                   \
    do {                                                                                   \
        if (tv_unlikely((lvl) <= tv_log_level)) tv_log((lvl), __VA_ARGS__);               \
    } while (0)

static inline uint64_t tv_mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* vDSO: no system call */
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
static inline uint64_t tv_real_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
void tv_sleep_ns(uint64_t ns) TV_HIDDEN;

#endif
