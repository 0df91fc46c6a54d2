/* log.c — diagnostics on stderr, never on the hot path. LIBCUDA_LOG_LEVEL: 0 errors … 4 debug. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base.h"

int tv_log_level = TV_LOG_WARN;

void tv_log_init(void)
{
    const char *s = getenv("LIBCUDA_LOG_LEVEL");
    if (s && *s >= '0' && *s <= '9') tv_log_level = atoi(s);
}

void tv_log(int level, const char *fmt, ...)
{
    static const char *names[] = {"ERROR", "WARN", "INFO", "INFO", "DEBUG"};
    char buf[512];
    int saved = errno;
    int n = snprintf(buf, sizeof buf, "[libvgpu %d %s] ", (int)getpid(),
                     names[level < 0 ? 0 : level > 4 ? 4 : level]);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && n < (int)sizeof buf) n += vsnprintf(buf + n, sizeof buf - (size_t)n, fmt, ap);
    va_end(ap);
    if (n > (int)sizeof buf - 2) n = (int)sizeof buf - 2;
    if (n > 0) {
        buf[n++] = '\n';
        ssize_t w = write(2, buf, (size_t)n);
        (void)w;
    }
    errno = saved;
}

void tv_sleep_ns(uint64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}
