/* Driver-call costs of one post on this host, measured in C (bench/driver_costs.py drives it).
 *
 * Why: a lone request's latency is host work plus the copy, and on the lent H200 hosts the driver calls of one
 * post (id copy, stream ordering, events, launch) take ~20 us. This times each call alone, the compiled post as
 * it is, and the alternatives (one CUDA graph launch; fewer calls) as "post -> copy's event seen" on an idle GPU,
 * next to a contiguous cuMemcpyDtoDAsync of the same bytes. Medians in ns. */
#include "../transports/cuda_ipc/_native_post.c"
#include <stdlib.h>

typedef void *CUgraph;
typedef void *CUgraphExec;
typedef void *CUgraphNode;
typedef struct {
    CUfunction func;
    unsigned int gx, gy, gz, bx, by, bz, shared;
    void **params;
    void **extra;
} kvl_kernel_node_params; /* CUDA_KERNEL_NODE_PARAMS (v1) */

static CUresult (*p_sync)(CUstream);
static CUresult (*p_event_query)(CUevent);
static CUresult (*p_stream_query)(CUstream);
static CUresult (*p_begin)(CUstream, int);
static CUresult (*p_end)(CUstream, CUgraph *);
static CUresult (*p_inst)(CUgraphExec *, CUgraph, unsigned long long);
static CUresult (*p_glaunch)(CUgraphExec, CUstream);
static CUresult (*p_record_flags)(CUevent, CUstream, unsigned int);
static CUresult (*p_nodes)(CUgraph, CUgraphNode *, size_t *);
static CUresult (*p_node_type)(CUgraphNode, int *);
static CUresult (*p_kset)(CUgraphExec, CUgraphNode, const kvl_kernel_node_params *);
static CUresult (*p_dtod)(CUdeviceptr, CUdeviceptr, size_t, CUstream);

int kvl_bench_init(void) {
    if (kvl_init() != 0) return -1;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    p_sync = dlsym(lib, "cuStreamSynchronize");
    p_event_query = dlsym(lib, "cuEventQuery");
    p_stream_query = dlsym(lib, "cuStreamQuery");
    p_begin = dlsym(lib, "cuStreamBeginCapture_v2");
    p_end = dlsym(lib, "cuStreamEndCapture");
    p_inst = dlsym(lib, "cuGraphInstantiateWithFlags");
    p_glaunch = dlsym(lib, "cuGraphLaunch");
    p_record_flags = dlsym(lib, "cuEventRecordWithFlags");
    p_nodes = dlsym(lib, "cuGraphGetNodes");
    p_node_type = dlsym(lib, "cuGraphNodeGetType");
    p_kset = dlsym(lib, "cuGraphExecKernelNodeSetParams");
    p_dtod = dlsym(lib, "cuMemcpyDtoDAsync_v2");
    if (!p_sync || !p_event_query || !p_stream_query || !p_begin || !p_end || !p_inst || !p_glaunch ||
        !p_record_flags || !p_nodes || !p_node_type || !p_kset || !p_dtod)
        return -2;
    return 0;
}

static int cmp64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static double median(int64_t *v, int n) {
    qsort(v, n, sizeof(int64_t), cmp64);
    return (double)v[n / 2];
}

static int spin(CUevent ev) {
    for (long i = 0; i < 2000000000L; i++) {
        CUresult rc = p_event_query(ev);
        if (rc == 0) return 0;
        if (rc != 600) return rc; /* CUDA_ERROR_NOT_READY */
    }
    return -9;
}

#define CK(x)                    \
    do {                         \
        CUresult rc_ = (x);      \
        if (rc_ != 0) return rc_; \
    } while (0)
#define NMETRICS 16

/* out[i] = median ns of metric i (names in driver_costs.py). */
int kvl_bench(kvl_poster *p, kvl_kernel **ks, int32_t nk, int32_t slot, int32_t n, int32_t pad, int64_t src_limit,
              int64_t dst_limit, CUstream caller, CUevent start, CUevent end, CUevent plain,
              CUdeviceptr ceil_dst, CUdeviceptr ceil_src, uint64_t ceil_bytes, int32_t reps, double *out,
              int64_t *scratch) {
    CUstream s = p->stream;
    CUdeviceptr ids = p->ring_dev + 4 * (CUdeviceptr)slot;
    const void *hids = p->ring_host + slot;
    kvl_kernel *k = ks[0];
    int64_t t0, t1;
    /* stage valid ids once (the later launches reuse them) */
    CK(kvl_post(p, ks, nk, slot, n, pad, src_limit, dst_limit, caller, start, end, 0));
    CK(p_sync(s));
#define TIME_ALONE(idx, call)                                        \
    for (int r = 0; r < reps; r++) {                                 \
        t0 = kvl_now_ns();                                           \
        CK(call);                                                    \
        t1 = kvl_now_ns();                                           \
        scratch[r] = t1 - t0;                                        \
        CK(p_sync(s));                                               \
        CK(p_sync(caller));                                          \
    }                                                                \
    out[idx] = median(scratch, reps);
/* post -> the event ``ev`` seen complete: the statements, then a spin on ``ev`` */
#define TIME_TO_SEEN(idx, ev, ...)                                   \
    for (int r = 0; r < reps; r++) {                                 \
        t0 = kvl_now_ns();                                           \
        __VA_ARGS__                                                  \
        CK(spin(ev));                                                \
        scratch[r] = kvl_now_ns() - t0;                              \
    }                                                                \
    out[idx] = median(scratch, reps);
#define LAUNCH_K \
    p_launch_kernel(k->function, (unsigned)n * k->chunks, k->grid_y, 1, k->block_x, 1, 1, k->shared, s, k->params, NULL)
    TIME_ALONE(0, p_event_record(start, s));
    TIME_ALONE(1, p_event_record(plain, s));
    CK(p_event_record(p->order_event, caller));
    TIME_ALONE(2, p_stream_wait_event(s, p->order_event, 0));
    TIME_ALONE(3, p_memcpy_htod_async(ids, hids, 8 * (size_t)pad, s));
    k->slots[k->src_ids_param] = ids;
    k->slots[k->dst_ids_param] = ids + 4 * (CUdeviceptr)pad;
    TIME_ALONE(4, LAUNCH_K);
    TIME_ALONE(5, p_stream_query(caller));
    TIME_ALONE(6, kvl_post(p, ks, nk, slot, n, pad, src_limit, dst_limit, caller, start, end, 0));
    /* 7: the compiled post as it is */
    TIME_TO_SEEN(7, end, CK(kvl_post(p, ks, nk, slot, n, pad, src_limit, dst_limit, caller, start, end, 0));)
    /* a graph of the same steps: id copy, start event, kernels, end event (captured on the transfer stream) */
    CUgraph graph = NULL;
    CUgraphExec exec = NULL;
    CK(p_begin(s, 2 /* relaxed */));
    CK(p_memcpy_htod_async(ids, hids, 8 * (size_t)pad, s));
    CK(p_record_flags(start, s, 1 /* external */));
    for (int i = 0; i < nk; i++)
        CK(p_launch_kernel(ks[i]->function, (unsigned)n * ks[i]->chunks, ks[i]->grid_y, 1, ks[i]->block_x, 1, 1,
                           ks[i]->shared, s, ks[i]->params, NULL));
    CK(p_record_flags(end, s, 1));
    CK(p_end(s, &graph));
    CK(p_inst(&exec, graph, 0));
    CUgraphNode nodes[32];
    size_t count = 32;
    CK(p_nodes(graph, nodes, &count));
    CUgraphNode knode = NULL;
    for (size_t i = 0; i < count; i++) {
        int type = -1;
        CK(p_node_type(nodes[i], &type));
        if (type == 0 && knode == NULL) knode = nodes[i];
    }
    out[15] = (double)count;
    TIME_ALONE(8, p_glaunch(exec, s));
    /* 9: order + graph */
    TIME_TO_SEEN(9, end, CK(p_event_record(p->order_event, caller)); CK(p_stream_wait_event(s, p->order_event, 0));
                 CK(p_glaunch(exec, s));)
    kvl_kernel_node_params kp = {k->function, (unsigned)n * k->chunks, k->grid_y, 1, k->block_x, 1, 1, k->shared,
                                 k->params, NULL};
    if (knode != NULL) {
        for (int r = 0; r < reps; r++) { /* 10: set the kernel node's params (a new n), then launch */
            t0 = kvl_now_ns();
            CK(p_kset(exec, knode, &kp));
            CK(p_glaunch(exec, s));
            t1 = kvl_now_ns();
            scratch[r] = t1 - t0;
            CK(p_sync(s));
        }
        out[10] = median(scratch, reps);
    }
    /* 11: the ceiling, a contiguous device copy of the same bytes */
    TIME_TO_SEEN(11, plain, CK(p_dtod(ceil_dst, ceil_src, ceil_bytes, s)); CK(p_event_record(plain, s));)
    /* 12: the kernel alone (ids already on the device) */
    TIME_TO_SEEN(12, plain, CK(LAUNCH_K); CK(p_event_record(plain, s));)
    /* 13: id copy + launch + end event only (no ordering, no start event) */
    TIME_TO_SEEN(13, end, CK(p_memcpy_htod_async(ids, hids, 8 * (size_t)pad, s)); CK(LAUNCH_K);
                 CK(p_event_record(end, s));)
    /* 14: the graph alone (no ordering) */
    TIME_TO_SEEN(14, end, CK(p_glaunch(exec, s));)
    return 0;
}
