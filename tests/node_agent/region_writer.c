/* Writes a usage region the way libvgpu lays it out (tessera_region.h), for the agent's tests:
 *   region_writer <path> <uuid> <used bytes> <oom count> <last kernel ns>
 * The magic is stored last, as libvgpu does once the region is ready. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "tessera_region.h"

int main(int argc, char **argv)
{
    struct tsr_region *r;
    int fd;
    if (argc != 6) {
        fprintf(stderr, "usage: %s path uuid used oom last_kernel_ns\n", argv[0]);
        return 2;
    }
    fd = open(argv[1], O_RDWR | O_CREAT, 0666);
    if (fd < 0 || ftruncate(fd, sizeof *r) != 0) {
        perror(argv[1]);
        return 1;
    }
    r = mmap(NULL, sizeof *r, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (r == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    r->major = TSR_VERSION_MAJOR;
    r->minor = TSR_VERSION_MINOR;
    r->size = sizeof *r;
    r->num_devices = 1;
    r->max_procs = TSR_MAX_PROCS;
    snprintf(r->dev[0].uuid, TSR_UUID_LEN, "%s", argv[2]);
    r->dev[0].used_bytes = strtoull(argv[3], NULL, 10);
    r->dev[0].peak_bytes = r->dev[0].used_bytes;
    r->dev[0].oom_count = strtoull(argv[4], NULL, 10);
    r->dev[0].last_kernel_ns = strtoull(argv[5], NULL, 10);
    r->dev[0].achieved_sm_x100 = 2550;
    r->procs[0].pid = 42;
    r->procs[0].used[0] = r->dev[0].used_bytes;
    __atomic_store_n(&r->magic, TSR_REGION_MAGIC, __ATOMIC_RELEASE);
    munmap(r, sizeof *r);
    close(fd);
    return 0;
}
