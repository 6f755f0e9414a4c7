/* The CUDA IPC transport's post, compiled: check the block ids, stage them, order the streams, launch.
 *
 * Why C: on one request's latency path the Python version of these steps cost 50-70 us of host time (id checks,
 * five ctypes driver calls, Triton's launcher parsing 19 arguments) in front of a 16-block copy that takes 20 us
 * on an H200. Here they are one call: the block ids were already written (widened to int64) into a staging array
 * by numpy, this checks them against both layouts, narrows them into a pinned ring slot (or, for a request of at
 * most 16 blocks, straight into the launch parameters of the inline-ids kernel), and issues the driver calls back
 * to back. Built at first use with the system C compiler (no CUDA headers: the few driver types are
 * declared below and the functions resolved from libcuda.so.1 at init), loaded with ctypes.
 *
 * The kernel is Triton's compiled block-copy kernel, launched with cuLaunchKernel and the same parameter array
 * Triton's own launcher builds (one pointer per non-constexpr argument, then the global and profile scratch
 * pointers); transports/native_post.py derives that array from the compiled kernel's signature and refuses
 * kernels it does not understand (those keep Triton's launcher).
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime under -std=c11 */
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

typedef int CUresult;
typedef void *CUstream;
typedef void *CUevent;
typedef void *CUfunction;
typedef uint64_t CUdeviceptr;

#define KVL_MAX_PARAMS 48
#define KVL_MAX_KERNELS 8

/* Error codes below zero are ours; above zero a CUresult, with the failing step in kvl_poster.error_step. */
#define KVL_ERR_SRC_RANGE (-1)
#define KVL_ERR_DST_RANGE (-2)
#define KVL_ERR_ARGS (-3)

typedef struct {
    CUfunction function;
    uint32_t chunks;   /* programs per block id along the grid's x axis */
    uint32_t grid_y;   /* region programs */
    uint32_t block_x;  /* threads per program: 32 x num_warps */
    uint32_t shared;   /* dynamic shared memory */
    int32_t src_ids_param, dst_ids_param;
    int32_t nparams;
    int32_t inline_param; /* >= 0: an inline-ids kernel, its ids are parameters inline_param.. (int32 each) */
    int32_t inline_count; /* source ids, then as many destination ids */
    uint64_t slots[KVL_MAX_PARAMS];
    void *params[KVL_MAX_PARAMS];
} kvl_kernel;

typedef struct {
    CUstream stream;      /* the transport's transfer stream */
    CUstream copy_stream; /* where the ids go while other copies are in flight */
    CUevent order_event;  /* recorded on the caller's stream: the copy starts after the caller's earlier work */
    CUevent ids_event;    /* recorded after an id copy on copy_stream */
    int64_t *staging;     /* host, pageable: ids as the caller gave them, widened to int64 by numpy */
    int32_t *ring_host;   /* pinned */
    CUdeviceptr ring_dev;
    int32_t error_step;   /* which driver call failed (1..8), for the error message */
    int32_t trace;        /* non-zero: stamp each step into trace_ns (KVL_CUDA_IPC_TRACE=1) */
    int64_t trace_ns[8];  /* checked, ids copied, ordered, started, launched, ended (monotonic ns) */
    /* One post's arguments, written by Python into this struct before kvl_post_call (one ctypes argument
     * instead of twelve: each converted argument costs host time on the latency path). */
    kvl_kernel **kernels;
    int64_t nkernels, slot, n, pad, src_limit, dst_limit;
    CUstream caller;
    CUevent start, end;
    int64_t on_copy_stream;
} kvl_poster;

static inline int64_t kvl_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

#define KVL_MARK(i) \
    if (p->trace) p->trace_ns[(i)] = kvl_now_ns()

static CUresult (*p_memcpy_htod_async)(CUdeviceptr, const void *, size_t, CUstream);
static CUresult (*p_event_record)(CUevent, CUstream);
static CUresult (*p_stream_wait_event)(CUstream, CUevent, unsigned int);
static CUresult (*p_launch_kernel)(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
                                   unsigned int, unsigned int, CUstream, void **, void **);

int kvl_init(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == NULL) return -1;
    p_memcpy_htod_async = (CUresult(*)(CUdeviceptr, const void *, size_t, CUstream))dlsym(lib, "cuMemcpyHtoDAsync_v2");
    p_event_record = (CUresult(*)(CUevent, CUstream))dlsym(lib, "cuEventRecord");
    p_stream_wait_event = (CUresult(*)(CUstream, CUevent, unsigned int))dlsym(lib, "cuStreamWaitEvent");
    p_launch_kernel = (CUresult(*)(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
                                   unsigned int, unsigned int, CUstream, void **, void **))dlsym(lib, "cuLaunchKernel");
    if (!p_memcpy_htod_async || !p_event_record || !p_stream_wait_event || !p_launch_kernel) return -2;
    return 0;
}

/* Point every parameter at its slot (once, after Python filled the slots; the struct never moves). */
void kvl_kernel_bind(kvl_kernel *k) {
    for (int i = 0; i < k->nparams && i < KVL_MAX_PARAMS; i++) k->params[i] = &k->slots[i];
}

/* Check ids [0, n) of the staging array against src_limit and [pad, pad + n) against dst_limit (viewed as
 * unsigned, a negative id is out of range too), narrowed into the ring at slot and slot + pad. */
int kvl_check_and_narrow(const int64_t *staging, int32_t *ring_slot, int32_t n, int32_t pad, int64_t src_limit,
                         int64_t dst_limit) {
    uint64_t src_bad = 0, dst_bad = 0;
    for (int32_t i = 0; i < n; i++) {
        uint64_t s = (uint64_t)staging[i], d = (uint64_t)staging[pad + i];
        src_bad |= (uint64_t)(s >= (uint64_t)src_limit);
        dst_bad |= (uint64_t)(d >= (uint64_t)dst_limit);
        ring_slot[i] = (int32_t)s;
        ring_slot[pad + i] = (int32_t)d;
    }
    if (src_bad) return KVL_ERR_SRC_RANGE;
    if (dst_bad) return KVL_ERR_DST_RANGE;
    return 0;
}

#define KVL_STEP(step, call)          \
    do {                              \
        CUresult rc_ = (call);        \
        if (rc_ != 0) {               \
            p->error_step = (step);   \
            return rc_;               \
        }                             \
    } while (0)

/* The inline-ids kernels' ids: checked like kvl_check_and_narrow, written straight into every kernel's parameter
 * slots (cuLaunchKernel copies them at the launch, so the next post may overwrite them at once). */
int kvl_check_inline(const int64_t *staging, kvl_kernel **kernels, int32_t nkernels, int32_t n, int32_t pad,
                     int64_t src_limit, int64_t dst_limit) {
    uint64_t src_bad = 0, dst_bad = 0;
    for (int32_t i = 0; i < n; i++) {
        uint64_t s = (uint64_t)staging[i], d = (uint64_t)staging[pad + i];
        src_bad |= (uint64_t)(s >= (uint64_t)src_limit);
        dst_bad |= (uint64_t)(d >= (uint64_t)dst_limit);
    }
    if (src_bad) return KVL_ERR_SRC_RANGE;
    if (dst_bad) return KVL_ERR_DST_RANGE;
    for (int32_t k = 0; k < nkernels; k++) {
        const kvl_kernel *kern = kernels[k];
        if (kern->inline_param < 0 || n > kern->inline_count ||
            kern->inline_param + 2 * kern->inline_count > kern->nparams)
            return KVL_ERR_ARGS;
    }
    for (int32_t k = 0; k < nkernels; k++) {
        kvl_kernel *kern = kernels[k];
        uint64_t *src = kern->slots + kern->inline_param, *dst = src + kern->inline_count;
        for (int32_t i = 0; i < n; i++) {
            src[i] = (uint32_t)staging[i];
            dst[i] = (uint32_t)staging[pad + i];
        }
    }
    return 0;
}

/* One post: ids checked and staged, the transfer stream ordered after the caller's stream (and after the id copy
 * when it ran on the copy stream), start event, one launch per kernel, end event. Nothing is enqueued when an id
 * is out of range. */
int kvl_post(kvl_poster *p, kvl_kernel **kernels, int32_t nkernels, int32_t slot, int32_t n, int32_t pad,
             int64_t src_limit, int64_t dst_limit, CUstream caller, CUevent start, CUevent end, int32_t on_copy_stream) {
    if (n <= 0 || pad < n || nkernels <= 0 || nkernels > KVL_MAX_KERNELS) return KVL_ERR_ARGS;
    KVL_MARK(0);
    /* Inline-ids kernels (a small request): the ids travel as launch parameters, nothing to stage or copy. */
    const int inline_ids = kernels[0]->inline_param >= 0;
    int rc = inline_ids ? kvl_check_inline(p->staging, kernels, nkernels, n, pad, src_limit, dst_limit)
                        : kvl_check_and_narrow(p->staging, p->ring_host + slot, n, pad, src_limit, dst_limit);
    if (rc != 0) return rc;
    KVL_MARK(1);
    CUdeviceptr ids = p->ring_dev + 4 * (CUdeviceptr)slot;
    const void *host_ids = p->ring_host + slot;
    CUstream stream = p->stream;
    if (inline_ids) {
        /* nothing to copy */
    } else if (on_copy_stream) {
        /* Copies in flight: the ids move on the copy stream while an earlier kernel runs (no copy-engine gap). */
        KVL_STEP(1, p_memcpy_htod_async(ids, host_ids, 8 * (size_t)pad, p->copy_stream));
        KVL_STEP(8, p_event_record(p->ids_event, p->copy_stream));
    } else {
        /* A lone request: the ids go on the transfer stream itself (no event, no cross-stream wait). */
        KVL_STEP(1, p_memcpy_htod_async(ids, host_ids, 8 * (size_t)pad, stream));
    }
    KVL_MARK(2);
    if (on_copy_stream) {
        KVL_STEP(2, p_event_record(p->order_event, caller));
        KVL_STEP(3, p_stream_wait_event(stream, p->order_event, 0));
        if (!inline_ids) KVL_STEP(4, p_stream_wait_event(stream, p->ids_event, 0));
        KVL_MARK(3);
        KVL_STEP(5, p_event_record(start, stream));
    } else {
        /* Nothing in flight: the start event, recorded on the caller's stream, is also the ordering event. The
         * transfer stream is idle, so the copy starts when the caller's earlier work is done: exactly when this
         * event fires, so it still times the transfer (one driver call fewer on a lone request's path). */
        KVL_STEP(5, p_event_record(start, caller));
        KVL_STEP(3, p_stream_wait_event(stream, start, 0));
        KVL_MARK(3);
    }
    KVL_MARK(4);
    for (int32_t i = 0; i < nkernels; i++) {
        kvl_kernel *k = kernels[i];
        if (!inline_ids) {
            k->slots[k->src_ids_param] = ids;
            k->slots[k->dst_ids_param] = ids + 4 * (CUdeviceptr)pad;
        }
        KVL_STEP(6, p_launch_kernel(k->function, (unsigned int)n * k->chunks, k->grid_y, 1, k->block_x, 1, 1,
                                    k->shared, stream, k->params, NULL));
    }
    KVL_MARK(5);
    KVL_STEP(7, p_event_record(end, stream));
    KVL_MARK(6);
    return 0;
}

/* kvl_post with the arguments the caller wrote into the poster (see kvl_poster). */
int kvl_post_call(kvl_poster *p) {
    return kvl_post(p, p->kernels, (int32_t)p->nkernels, (int32_t)p->slot, (int32_t)p->n, (int32_t)p->pad,
                    p->src_limit, p->dst_limit, p->caller, p->start, p->end, (int32_t)p->on_copy_stream);
}
