/*
 * liveness.c — is the process a region slot names alive (region.h)? First the kernel's word:
 * the open-file-description lock its process holds on the slot (below); else from /proc: a
 * pid that exists, whose start time is the slot's (else the pid was reused), and that is not
 * ending: its thread group leader has not ended, or ended alone (the main thread's
 * pthread_exit) while another of its threads goes on.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <stddef.h>
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

/* ---- the kernel's word on who holds a slot ---------------------------------------------------
 * A process that registers in procs[i] takes an open-file-description lock (F_OFD_SETLK) on the
 * slot's first byte of the file, through its own description of it, and holds it for as long as
 * it lives: the kernel drops it when the last reference to that description closes (the
 * process's exit, however it ends). Every byte of the region is the tenant's to write (pid,
 * start time, counters); this lock is not: no other description can take it or drop it. So a
 * slot whose lock is held belongs to a live process whatever the slot says (its start time
 * rewritten, its pid zeroed or made another's): it is never reclaimed and never handed to
 * another process. A fork's child opens a description of its own (tv_region_after_fork_child):
 * sharing its parent's, it would keep the parent's slot held after the parent died. A slot
 * nobody holds (filled in by hand, or its process closed our descriptor) is judged by /proc. */

static off_t slot_off(int i)
{
    return (off_t)(offsetof(struct tsr_region, procs) + (size_t)i * sizeof(struct tsr_proc_slot));
}

/* Slots are held by kernel locks: a shared file whose file system has them (probed at attach;
 * without them, as before: the slot's pid and start time). */
int tv_slot_locking(const struct tv_region *rg)
{
    return rg->fd >= 0 && !rg->no_locks;
}

/* 0: slot i's lock is this process's (taken now or before); -1: another's, or no file */
int tv_slot_lock(struct tv_region *rg, int i)
{
    if (!tv_slot_locking(rg) || i < 0) return -1;
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = slot_off(i), .l_len = 1};
    return fcntl(rg->fd, F_OFD_SETLK, &fl) == 0 ? 0 : -1;
}

void tv_slot_unlock(struct tv_region *rg, int i)
{
    if (rg->fd < 0 || i < 0) return;
    struct flock fl = {.l_type = F_UNLCK, .l_whence = SEEK_SET, .l_start = slot_off(i), .l_len = 1};
    fcntl(rg->fd, F_OFD_SETLK, &fl);
}

/* Does another description (a live process) hold slot i's lock? */
int tv_slot_held(struct tv_region *rg, int i)
{
    if (!tv_slot_locking(rg)) return 0;
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = slot_off(i), .l_len = 1};
    return fcntl(rg->fd, F_OFD_GETLK, &fl) == 0 && fl.l_type != F_UNLCK;
}

/* Is the process of slot i gone? Never while it holds the slot's lock; else as /proc says. A
 * process being killed still holds its lock a moment after the kernel released the region's
 * mutex for it (robust mutexes go before files close): where /proc says the slot's process is
 * ending, the lock is waited for until `deadline` (tv_mono_ns; 0 = not at all). The pid and
 * start time are the tenant's to write: a slot made to look ending whose lock stays held is a
 * live process's, and the wait is bounded. */
int tv_slot_dead(struct tv_region *rg, int i, pid_t pid, uint64_t start, uint64_t deadline)
{
    int proc_alive = tv_proc_alive(rg->pid, pid, start);
    if (!tv_slot_held(rg, i)) return !proc_alive;
    if (proc_alive) return 0;
    while (tv_mono_ns() < deadline) {
        tv_sleep_ns(1000000ull);
        if (!tv_slot_held(rg, i)) return 1;
    }
    return 0;
}
