/* fkstat STATE DEV T0 T1 WINDOW_NS [PID...]: GPU busy fraction of each window of [T0, T1) on a
 * fake device (all kernels, or only those of the given pids), one number per line. */
#include <stdio.h>
#include <stdlib.h>

#include "fake_state.h"

int main(int argc, char **argv)
{
    if (argc < 6) {
        fprintf(stderr, "usage: fkstat STATE DEV T0 T1 WINDOW_NS [PID...]\n");
        return 2;
    }
    struct fk_state *s = fk_state_at(argv[1]);
    int dev = atoi(argv[2]);
    long long t0 = atoll(argv[3]), t1 = atoll(argv[4]), w = atoll(argv[5]);
    fk_lock(s);
    for (long long a = t0; a + w <= t1; a += w) {
        long long busy = 0;
        if (argc == 6) busy = fk_busy(s, dev, a, a + w, 0);
        for (int i = 6; i < argc; i++) busy += fk_busy(s, dev, a, a + w, atoi(argv[i]));
        printf("%.4f\n", (double)busy / (double)w);
    }
    fk_unlock(s);
    return 0;
}
