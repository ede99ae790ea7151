/*
 * cuda backend registration. The kernels arrive with the CUDA issue; until
 * then the backend is registered, its probe answers SKV_ERR_NO_DEVICE with a
 * clear message, and every op slot is NULL (reported as SKV_ERR_UNSUPPORTED).
 */
#include <stdio.h>
#include <string.h>

#include "skv_backend.h"

static skv_status skv_cuda_probe(char *msg, size_t cap)
{
    snprintf(msg, cap, "this build of libshadowkv has no CUDA support compiled in");
    return SKV_ERR_NO_DEVICE;
}

void skv_cuda_fill_ops(struct skv_backend_ops *ops)
{
    memset(ops, 0, sizeof *ops);
    ops->name = "cuda";
    ops->probe = skv_cuda_probe;
}
