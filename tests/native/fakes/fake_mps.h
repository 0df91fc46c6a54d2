/* fake_mps.h — the fake driver as an MPS client (fake_mps.c). */
#ifndef FAKE_MPS_H
#define FAKE_MPS_H

#include <cuda.h>
#include <stdint.h>

#include "fake_state.h"

CUresult fk_mps_attach(void);             /* at cuInit: connect when a daemon answers */
int fk_mps_take(int dev, uint64_t bytes); /* 0, or -1: past the client's server-side limit */
void fk_mps_give(int dev, uint64_t bytes);
int fk_mps_threads(void);                 /* the active thread % in force (100 without MPS) */

#endif
