/*
 * liveness.c — is the process a region slot names alive (region.h)? From /proc: a pid that
 * exists, whose start time is the slot's (else the pid was reused), and that is not ending: its
 * thread group leader has not ended, or ended alone (the main thread's pthread_exit) while
 * another of its threads goes on.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "region.h"

#define TV_PF_EXITING 0x4u /* linux/sched.h: the task is exiting (robust futexes released) */

/* state (an exiting task reads 'X'), starttime and, where exit_code is not NULL, the exit code
 * (0 where the kernel does not show it) from /proc/<what>/stat (what: "<pid>" or
 * "<pid>/task/<tid>"); 0 ok, -1 unreadable */
static int proc_stat_at(const char *what, char *state, uint64_t *start, int *exit_code)
{
    char path[96], buf[1024];
    snprintf(path, sizeof path, "/proc/%s/stat", what);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p || p[1] != ' ') return -1;
    p += 2;
    *state = *p;
    /* p points at field 3 (state); flags is field 9, starttime field 22, exit_code field 52 */
    for (int field = 3; field < 22 && p; field++) {
        p = strchr(p, ' ');
        if (p) p++;
        if (p && field + 1 == 9 && (strtoul(p, NULL, 10) & TV_PF_EXITING)) *state = 'X';
    }
    if (!p) return -1;
    *start = strtoull(p, NULL, 10);
    if (exit_code) {
        *exit_code = 0;
        for (int field = 22; field < 52 && p; field++) {
            p = strchr(p, ' ');
            if (p) p++;
        }
        if (p) *exit_code = (int)strtol(p, NULL, 10);
    }
    return 0;
}

static int proc_stat(pid_t pid, char *state, uint64_t *start, int *exit_code)
{
    char what[16];
    snprintf(what, sizeof what, "%d", (int)pid);
    return proc_stat_at(what, state, start, exit_code);
}

uint64_t tv_self_start_time(void)
{
    char st;
    uint64_t t = 0;
    if (proc_stat(getpid(), &st, &t, NULL) != 0) return 0;
    return t;
}

/* The leader of pid's thread group has ended or is ending: does another of its threads live
 * on? A program may end its main thread (pthread_exit) and go on in others; its leader then
 * reads as a zombie, exiting, until the last thread ends, while the process holds its memory. */
static int other_thread_alive(pid_t pid)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
    DIR *dir = opendir(path);
    if (!dir) return 0;
    int alive = 0;
    for (struct dirent *e; !alive && (e = readdir(dir));) {
        pid_t tid = (pid_t)strtol(e->d_name, NULL, 10);
        if (tid <= 0 || tid == pid) continue;
        char state;
        uint64_t st;
        snprintf(path, sizeof path, "%d/task/%d", (int)pid, (int)tid);
        alive = proc_stat_at(path, &state, &st, NULL) == 0 && state != 'Z' && state != 'X' &&
                state != 'x';
    }
    closedir(dir);
    return alive;
}

int tv_proc_alive(pid_t self, pid_t pid, uint64_t start)
{
    if (pid <= 0) return 0;
    if (pid == self) return 1;
    if (kill(pid, 0) != 0 && errno == ESRCH) return 0;
    char state;
    uint64_t st;
    int code;
    if (proc_stat(pid, &state, &st, &code) != 0) return kill(pid, 0) == 0 || errno != ESRCH;
    if (start && st != start) return 0; /* the pid was reused */
    if (state != 'Z' && state != 'X' && state != 'x') return 1;
    /* The leader ended or is ending. Killed, or the process exited with a code (exit_group
     * sets the leader's code before its robust futexes are released): dying, whatever its
     * other threads are doing this instant. Code 0: its main thread may have ended alone. */
    return code == 0 && other_thread_alive(pid);
}
