/* vecadd.c - exercises a broad slice of the OpenCL host API with fully
 * deterministic output, so that its stdout natively and under `hira run --`
 * can be diffed byte for byte.
 *
 * Covered: program build from source (with notify callback and a deliberately
 * broken program), program/kernel queries, vector add (uint + float), a
 * reduction with a __local argument, Write/Read buffer, Read/Write rect,
 * map/unmap, sub-buffers, FillBuffer, CopyBuffer, markers/barriers, profiling
 * events (only monotonicity is printed), user events, event callbacks, mem
 * object destructor callbacks, error paths, and two pthreads each with its
 * own command queue.
 *
 * Build: cc -O2 vecadd.c -lOpenCL -lpthread
 */
#define CL_TARGET_OPENCL_VERSION 300
#define CL_USE_DEPRECATED_OPENCL_1_2_APIS
#include <CL/cl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHECK(x) do { cl_int _e = (x); if (_e != CL_SUCCESS) { \
    printf("ERROR %s -> %d (line %d)\n", #x, _e, __LINE__); exit(1); } } while (0)
#define CHECKE(err) do { if ((err) != CL_SUCCESS) { \
    printf("ERROR code %d (line %d)\n", (err), __LINE__); exit(1); } } while (0)

#define N (1u << 16)
#define LOCAL 64u

static const char *SRC =
    "__kernel void vadd(__global const uint *a, __global const uint *b,\n"
    "                   __global uint *c) {\n"
    "    size_t i = get_global_id(0);\n"
    "    c[i] = a[i] + b[i];\n"
    "}\n"
    "__kernel void saxpy(__global const float *x, __global const float *y,\n"
    "                    __global float *out, float alpha) {\n"
    "    size_t i = get_global_id(0);\n"
    "    out[i] = alpha * x[i] + y[i];\n"
    "}\n"
    "__kernel void reduce(__global const uint *in, __global uint *partial,\n"
    "                     __local uint *scratch) {\n"
    "    size_t lid = get_local_id(0);\n"
    "    size_t ls = get_local_size(0);\n"
    "    scratch[lid] = in[get_global_id(0)];\n"
    "    barrier(CLK_LOCAL_MEM_FENCE);\n"
    "    for (size_t s = ls / 2; s > 0; s >>= 1) {\n"
    "        if (lid < s) scratch[lid] += scratch[lid + s];\n"
    "        barrier(CLK_LOCAL_MEM_FENCE);\n"
    "    }\n"
    "    if (lid == 0) partial[get_group_id(0)] = scratch[0];\n"
    "}\n"
    "__kernel void scale(__global uint *x, uint k) {\n"
    "    size_t i = get_global_id(0);\n"
    "    x[i] = x[i] * k + (uint)i;\n"
    "}\n";

static const char *BROKEN_SRC =
    "__kernel void broken(__global int *x) {\n"
    "    x[0] = this_symbol_does_not_exist + ;\n"
    "}\n";

/* ------------------------------------------------------------------ utils */

static uint64_t fnv1a(const void *data, size_t len) {
    const unsigned char *p = data;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < len; i++) { h ^= p[i]; h *= 1099511628211ull; }
    return h;
}

static pthread_mutex_t cb_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cb_cv = PTHREAD_COND_INITIALIZER;

typedef struct { int ran; cl_int status; } cb_flag;

static void flag_set(cb_flag *f, cl_int status) {
    pthread_mutex_lock(&cb_mu);
    f->ran++;
    f->status = status;
    pthread_cond_broadcast(&cb_cv);
    pthread_mutex_unlock(&cb_mu);
}

/* Callbacks are asynchronous per the spec: wait (bounded) for them. */
static int flag_wait(cb_flag *f, int seconds) {
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += seconds;
    pthread_mutex_lock(&cb_mu);
    while (!f->ran) {
        if (pthread_cond_timedwait(&cb_cv, &cb_mu, &deadline) != 0) break;
    }
    int ran = f->ran;
    pthread_mutex_unlock(&cb_mu);
    return ran;
}

static void CL_CALLBACK build_notify(cl_program prog, void *user) {
    (void)prog;
    flag_set((cb_flag *)user, 0);
}

static void CL_CALLBACK event_cb(cl_event ev, cl_int status, void *user) {
    (void)ev;
    flag_set((cb_flag *)user, status);
}

static void CL_CALLBACK mem_destructor_cb(cl_mem m, void *user) {
    (void)m;
    flag_set((cb_flag *)user, 0);
}

/* The error of a call that may run asynchronously, or else of the clFinish after it
 * (evaluated in that order). */
#define ERR_OR_FINISH(call, queue) ({ cl_int e1_ = (call); cl_int e2_ = clFinish(queue); e1_ != CL_SUCCESS ? e1_ : e2_; })

static const char *status_name(cl_int s) {
    switch (s) {
    case CL_COMPLETE: return "CL_COMPLETE";
    case CL_RUNNING: return "CL_RUNNING";
    case CL_SUBMITTED: return "CL_SUBMITTED";
    case CL_QUEUED: return "CL_QUEUED";
    default: return s < 0 ? "ERROR" : "UNKNOWN";
    }
}

/* --------------------------------------------------------- global state */

static cl_platform_id plat;
static cl_device_id dev;
static cl_context ctx;
static cl_program prog;

/* ---------------------------------------------------------------- threads */

typedef struct {
    int id;
    uint64_t checksum;
    cl_int err;
} thread_arg;

static void *worker(void *p) {
    thread_arg *t = p;
    cl_int err;
    const size_t n = 4096;
    const int iters = 25;
    cl_command_queue q = clCreateCommandQueue(ctx, dev, 0, &err);
    if (err) { t->err = err; return NULL; }
    cl_kernel k = clCreateKernel(prog, "scale", &err);
    if (err) { t->err = err; return NULL; }
    uint32_t *host = malloc(n * sizeof *host);
    for (size_t i = 0; i < n; i++) host[i] = (uint32_t)(i * (t->id + 3) + 7);
    cl_mem buf = clCreateBuffer(ctx, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR,
                                n * sizeof *host, host, &err);
    if (err) { t->err = err; return NULL; }
    cl_uint kk = (cl_uint)(t->id + 2);
    err = clSetKernelArg(k, 0, sizeof buf, &buf);
    err |= clSetKernelArg(k, 1, sizeof kk, &kk);
    if (err) { t->err = err; return NULL; }
    for (int it = 0; it < iters; it++) {
        err = clEnqueueNDRangeKernel(q, k, 1, NULL, &n, NULL, 0, NULL, NULL);
        if (err) { t->err = err; return NULL; }
        if (it % 5 == 4) {
            /* interleave blocking reads with kernels */
            err = clEnqueueReadBuffer(q, buf, CL_TRUE, 0, n * sizeof *host, host, 0, NULL, NULL);
            if (err) { t->err = err; return NULL; }
        }
    }
    err = clFinish(q);
    if (!err) err = clEnqueueReadBuffer(q, buf, CL_TRUE, 0, n * sizeof *host, host, 0, NULL, NULL);
    t->err = err;
    t->checksum = fnv1a(host, n * sizeof *host);
    free(host);
    clReleaseMemObject(buf);
    clReleaseKernel(k);
    clReleaseCommandQueue(q);
    return NULL;
}

/* ------------------------------------------------------------------- main */

int main(void) {
    cl_int err;
    CHECK(clGetPlatformIDs(1, &plat, NULL));
    CHECK(clGetDeviceIDs(plat, CL_DEVICE_TYPE_ALL, 1, &dev, NULL));
    cl_context_properties props[] = {CL_CONTEXT_PLATFORM, (cl_context_properties)plat, 0};
    ctx = clCreateContext(props, 1, &dev, NULL, NULL, &err);
    CHECKE(err);
    cl_uint ndev = 0;
    CHECK(clGetContextInfo(ctx, CL_CONTEXT_NUM_DEVICES, sizeof ndev, &ndev, NULL));
    printf("context devices: %u\n", ndev);

    cl_queue_properties qprops[] = {CL_QUEUE_PROPERTIES, CL_QUEUE_PROFILING_ENABLE, 0};
    cl_command_queue q = clCreateCommandQueueWithProperties(ctx, dev, qprops, &err);
    CHECKE(err);

    /* ---- build with notify callback */
    prog = clCreateProgramWithSource(ctx, 1, &SRC, NULL, &err);
    CHECKE(err);
    cb_flag build_flag = {0, 0};
    CHECK(clBuildProgram(prog, 1, &dev, "-cl-kernel-arg-info", build_notify, &build_flag));
    printf("build notify ran: %s\n", flag_wait(&build_flag, 60) ? "yes" : "no");
    cl_build_status bs;
    CHECK(clGetProgramBuildInfo(prog, dev, CL_PROGRAM_BUILD_STATUS, sizeof bs, &bs, NULL));
    printf("build status: %d\n", bs);
    size_t nk = 0;
    CHECK(clGetProgramInfo(prog, CL_PROGRAM_NUM_KERNELS, sizeof nk, &nk, NULL));
    printf("num kernels: %zu\n", nk);
    {
        char names[256] = {0};
        CHECK(clGetProgramInfo(prog, CL_PROGRAM_KERNEL_NAMES, sizeof names - 1, names, NULL));
        /* sort-insensitive print: names in source order are expected */
        printf("kernel names: %s\n", names);
    }

    cl_kernel k_vadd = clCreateKernel(prog, "vadd", &err); CHECKE(err);
    cl_kernel k_saxpy = clCreateKernel(prog, "saxpy", &err); CHECKE(err);
    cl_kernel k_reduce = clCreateKernel(prog, "reduce", &err); CHECKE(err);
    cl_kernel k_scale = clCreateKernel(prog, "scale", &err); CHECKE(err);
    {
        char fname[64]; cl_uint nargs;
        CHECK(clGetKernelInfo(k_reduce, CL_KERNEL_FUNCTION_NAME, sizeof fname, fname, NULL));
        CHECK(clGetKernelInfo(k_reduce, CL_KERNEL_NUM_ARGS, sizeof nargs, &nargs, NULL));
        printf("kernel %s: %u args:", fname, nargs);
        for (cl_uint i = 0; i < nargs; i++) {
            char an[64]; cl_kernel_arg_address_qualifier aq;
            CHECK(clGetKernelArgInfo(k_reduce, i, CL_KERNEL_ARG_NAME, sizeof an, an, NULL));
            CHECK(clGetKernelArgInfo(k_reduce, i, CL_KERNEL_ARG_ADDRESS_QUALIFIER, sizeof aq, &aq, NULL));
            printf(" %s(%s)", an, aq == CL_KERNEL_ARG_ADDRESS_GLOBAL ? "global"
                                : aq == CL_KERNEL_ARG_ADDRESS_LOCAL ? "local" : "other");
        }
        printf("\n");
    }

    /* ---- vector add with Write/Read buffer */
    uint32_t *a = malloc(N * 4), *b = malloc(N * 4), *c = malloc(N * 4);
    for (uint32_t i = 0; i < N; i++) { a[i] = i * 3u + 1u; b[i] = (N - i) * 5u; }
    cl_mem da = clCreateBuffer(ctx, CL_MEM_READ_ONLY, N * 4, NULL, &err); CHECKE(err);
    cl_mem db = clCreateBuffer(ctx, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR, N * 4, b, &err); CHECKE(err);
    cl_mem dc = clCreateBuffer(ctx, CL_MEM_READ_WRITE, N * 4, NULL, &err); CHECKE(err);
    cl_event ev_write, ev_kernel, ev_read;
    CHECK(clEnqueueWriteBuffer(q, da, CL_FALSE, 0, N * 4, a, 0, NULL, &ev_write));
    CHECK(clSetKernelArg(k_vadd, 0, sizeof da, &da));
    CHECK(clSetKernelArg(k_vadd, 1, sizeof db, &db));
    CHECK(clSetKernelArg(k_vadd, 2, sizeof dc, &dc));
    size_t gsz = N, lsz = LOCAL;
    CHECK(clEnqueueNDRangeKernel(q, k_vadd, 1, NULL, &gsz, &lsz, 1, &ev_write, &ev_kernel));
    cb_flag ev_flag = {0, 99};
    CHECK(clSetEventCallback(ev_kernel, CL_COMPLETE, event_cb, &ev_flag));
    CHECK(clEnqueueReadBuffer(q, dc, CL_FALSE, 0, N * 4, c, 1, &ev_kernel, &ev_read));
    CHECK(clFinish(q));
    int ok = 1;
    for (uint32_t i = 0; i < N; i++) ok &= c[i] == a[i] + b[i];
    printf("vadd: correct=%d checksum=%016llx\n", ok, (unsigned long long)fnv1a(c, N * 4));
    int ran = flag_wait(&ev_flag, 10);
    printf("event callback after clFinish: ran=%s status=%s\n", ran ? "yes" : "no",
           ran ? status_name(ev_flag.status) : "-");
    /* callback registered on an already-complete event must still fire */
    cb_flag late_flag = {0, 99};
    CHECK(clSetEventCallback(ev_read, CL_COMPLETE, event_cb, &late_flag));
    ran = flag_wait(&late_flag, 10);
    printf("late event callback: ran=%s status=%s\n", ran ? "yes" : "no",
           ran ? status_name(late_flag.status) : "-");

    /* ---- profiling: only monotonicity */
    {
        cl_event evs[3] = {ev_write, ev_kernel, ev_read};
        const char *nm[3] = {"write", "kernel", "read"};
        cl_ulong prev_end = 0;
        int chain_ok = 1;
        for (int i = 0; i < 3; i++) {
            cl_ulong tq, ts, tb, te;
            CHECK(clGetEventProfilingInfo(evs[i], CL_PROFILING_COMMAND_QUEUED, sizeof tq, &tq, NULL));
            CHECK(clGetEventProfilingInfo(evs[i], CL_PROFILING_COMMAND_SUBMIT, sizeof ts, &ts, NULL));
            CHECK(clGetEventProfilingInfo(evs[i], CL_PROFILING_COMMAND_START, sizeof tb, &tb, NULL));
            CHECK(clGetEventProfilingInfo(evs[i], CL_PROFILING_COMMAND_END, sizeof te, &te, NULL));
            printf("profiling %s: monotone=%d\n", nm[i], tq <= ts && ts <= tb && tb <= te);
            if (i > 0 && tb < prev_end) chain_ok = 0;
            prev_end = te;
        }
        printf("profiling dependent chain ordered: %d\n", chain_ok);
        cl_int st; cl_command_type ct;
        CHECK(clGetEventInfo(ev_kernel, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st, NULL));
        CHECK(clGetEventInfo(ev_kernel, CL_EVENT_COMMAND_TYPE, sizeof ct, &ct, NULL));
        printf("kernel event: status=%s type=0x%x\n", status_name(st), ct);
        cl_command_queue eq;
        CHECK(clGetEventInfo(ev_kernel, CL_EVENT_COMMAND_QUEUE, sizeof eq, &eq, NULL));
        printf("kernel event queue matches: %d\n", eq == q);
        clReleaseEvent(ev_write); clReleaseEvent(ev_kernel); clReleaseEvent(ev_read);
    }

    /* ---- float saxpy with scalar arg */
    {
        float *x = malloc(N * 4), *y = malloc(N * 4), *o = malloc(N * 4);
        for (uint32_t i = 0; i < N; i++) { x[i] = (float)(i % 1000); y[i] = (float)(i % 77) * 0.5f; }
        cl_mem dx = clCreateBuffer(ctx, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR, N * 4, x, &err); CHECKE(err);
        cl_mem dy = clCreateBuffer(ctx, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR, N * 4, y, &err); CHECKE(err);
        cl_mem dout = clCreateBuffer(ctx, CL_MEM_WRITE_ONLY, N * 4, NULL, &err); CHECKE(err);
        float alpha = 2.5f;
        CHECK(clSetKernelArg(k_saxpy, 0, sizeof dx, &dx));
        CHECK(clSetKernelArg(k_saxpy, 1, sizeof dy, &dy));
        CHECK(clSetKernelArg(k_saxpy, 2, sizeof dout, &dout));
        CHECK(clSetKernelArg(k_saxpy, 3, sizeof alpha, &alpha));
        CHECK(clEnqueueNDRangeKernel(q, k_saxpy, 1, NULL, &gsz, NULL, 0, NULL, NULL));
        CHECK(clEnqueueReadBuffer(q, dout, CL_TRUE, 0, N * 4, o, 0, NULL, NULL));
        int sok = 1;
        for (uint32_t i = 0; i < N; i++) sok &= o[i] == alpha * x[i] + y[i];
        printf("saxpy: correct=%d checksum=%016llx\n", sok, (unsigned long long)fnv1a(o, N * 4));
        clReleaseMemObject(dx); clReleaseMemObject(dy); clReleaseMemObject(dout);
        free(x); free(y); free(o);
    }

    /* ---- reduction with a __local argument */
    {
        size_t groups = N / LOCAL;
        cl_mem dpart = clCreateBuffer(ctx, CL_MEM_READ_WRITE, groups * 4, NULL, &err); CHECKE(err);
        CHECK(clSetKernelArg(k_reduce, 0, sizeof dc, &dc));
        CHECK(clSetKernelArg(k_reduce, 1, sizeof dpart, &dpart));
        CHECK(clSetKernelArg(k_reduce, 2, LOCAL * sizeof(cl_uint), NULL));
        CHECK(clEnqueueNDRangeKernel(q, k_reduce, 1, NULL, &gsz, &lsz, 0, NULL, NULL));
        uint32_t *part = malloc(groups * 4);
        CHECK(clEnqueueReadBuffer(q, dpart, CL_TRUE, 0, groups * 4, part, 0, NULL, NULL));
        uint32_t dev_sum = 0, host_sum = 0;
        for (size_t i = 0; i < groups; i++) dev_sum += part[i];
        for (uint32_t i = 0; i < N; i++) host_sum += a[i] + b[i];
        printf("reduce: groups=%zu device_sum=%u host_sum=%u match=%d\n", groups, dev_sum,
               host_sum, dev_sum == host_sum);
        free(part);
        clReleaseMemObject(dpart);
    }

    /* ---- map / unmap */
    {
        cl_mem dm = clCreateBuffer(ctx, CL_MEM_READ_WRITE | CL_MEM_ALLOC_HOST_PTR, N * 4, NULL, &err); CHECKE(err);
        uint32_t *p = clEnqueueMapBuffer(q, dm, CL_TRUE, CL_MAP_WRITE_INVALIDATE_REGION, 0, N * 4, 0, NULL, NULL, &err);
        CHECKE(err);
        for (uint32_t i = 0; i < N; i++) p[i] = i ^ 0x5a5a5a5au;
        CHECK(clEnqueueUnmapMemObject(q, dm, p, 0, NULL, NULL));
        cl_uint kk = 3;
        CHECK(clSetKernelArg(k_scale, 0, sizeof dm, &dm));
        CHECK(clSetKernelArg(k_scale, 1, sizeof kk, &kk));
        CHECK(clEnqueueNDRangeKernel(q, k_scale, 1, NULL, &gsz, NULL, 0, NULL, NULL));
        p = clEnqueueMapBuffer(q, dm, CL_TRUE, CL_MAP_READ, 0, N * 4, 0, NULL, NULL, &err);
        CHECKE(err);
        int mok = 1;
        for (uint32_t i = 0; i < N; i++) mok &= p[i] == (i ^ 0x5a5a5a5au) * 3u + i;
        printf("map/unmap: correct=%d checksum=%016llx\n", mok, (unsigned long long)fnv1a(p, N * 4));
        CHECK(clEnqueueUnmapMemObject(q, dm, p, 0, NULL, NULL));
        /* partial map at an offset */
        p = clEnqueueMapBuffer(q, dm, CL_TRUE, CL_MAP_READ, 4096, 16, 0, NULL, NULL, &err);
        CHECKE(err);
        printf("partial map: %u %u %u %u\n", p[0], p[1], p[2], p[3]);
        CHECK(clEnqueueUnmapMemObject(q, dm, p, 0, NULL, NULL));
        CHECK(clFinish(q));
        clReleaseMemObject(dm);
    }

    /* ---- fill / copy / sub-buffers / rect */
    {
        cl_uint align_bits;
        CHECK(clGetDeviceInfo(dev, CL_DEVICE_MEM_BASE_ADDR_ALIGN, sizeof align_bits, &align_bits, NULL));
        size_t align = align_bits / 8;
        size_t total = align * 8; /* bytes */
        cl_mem big = clCreateBuffer(ctx, CL_MEM_READ_WRITE, total, NULL, &err); CHECKE(err);
        cl_uint pattern = 0xdeadbeefu;
        CHECK(clEnqueueFillBuffer(q, big, &pattern, sizeof pattern, 0, total, 0, NULL, NULL));
        cl_ushort pat2 = 0x1234;
        CHECK(clEnqueueFillBuffer(q, big, &pat2, sizeof pat2, align, align, 0, NULL, NULL));
        cl_buffer_region reg = {align * 2, align * 2};
        cl_mem sub = clCreateSubBuffer(big, CL_MEM_READ_WRITE, CL_BUFFER_CREATE_TYPE_REGION, &reg, &err);
        CHECKE(err);
        size_t sub_size, sub_off; cl_mem parent;
        CHECK(clGetMemObjectInfo(sub, CL_MEM_SIZE, sizeof sub_size, &sub_size, NULL));
        CHECK(clGetMemObjectInfo(sub, CL_MEM_OFFSET, sizeof sub_off, &sub_off, NULL));
        CHECK(clGetMemObjectInfo(sub, CL_MEM_ASSOCIATED_MEMOBJECT, sizeof parent, &parent, NULL));
        printf("sub-buffer: size=%zu offset=%zu (in aligns: %zu,%zu) parent matches=%d\n",
               sub_size, sub_off, sub_size / align, sub_off / align, parent == big);
        /* run scale on the sub-buffer only */
        cl_uint kk = 2;
        size_t subn = sub_size / 4;
        CHECK(clSetKernelArg(k_scale, 0, sizeof sub, &sub));
        CHECK(clSetKernelArg(k_scale, 1, sizeof kk, &kk));
        CHECK(clEnqueueNDRangeKernel(q, k_scale, 1, NULL, &subn, NULL, 0, NULL, NULL));
        /* copy first align bytes of the sub-buffer to the last align of big */
        CHECK(clEnqueueCopyBuffer(q, sub, big, 0, total - align, align, 0, NULL, NULL));
        uint8_t *hb = malloc(total);
        CHECK(clEnqueueReadBuffer(q, big, CL_TRUE, 0, total, hb, 0, NULL, NULL));
        printf("fill/sub/copy: checksum=%016llx first=%08x second=%08x sub0=%08x last=%08x\n",
               (unsigned long long)fnv1a(hb, total), ((uint32_t *)hb)[0],
               ((uint32_t *)hb)[align / 4], ((uint32_t *)hb)[2 * align / 4],
               ((uint32_t *)hb)[(total - 4) / 4]);
        /* write into the sub-buffer, read through the parent */
        uint32_t marker[4] = {1, 2, 3, 4};
        CHECK(clEnqueueWriteBuffer(q, sub, CL_TRUE, 8, sizeof marker, marker, 0, NULL, NULL));
        uint32_t back[4];
        CHECK(clEnqueueReadBuffer(q, big, CL_TRUE, reg.origin + 8, sizeof back, back, 0, NULL, NULL));
        printf("sub-buffer write visible in parent: %u %u %u %u\n", back[0], back[1], back[2], back[3]);
        /* rect read: 4x4 block of uint32 from a 16-wide 2D view of big */
        uint32_t rect[16];
        size_t borg[3] = {8, 2, 0}, horg[3] = {0, 0, 0}, region[3] = {16, 4, 1};
        CHECK(clEnqueueReadBufferRect(q, big, CL_TRUE, borg, horg, region, 64, 0, 16, 0, rect, 0, NULL, NULL));
        printf("read rect checksum=%016llx\n", (unsigned long long)fnv1a(rect, sizeof rect));
        /* copy rect inside big, then read everything */
        size_t sorg[3] = {0, 0, 0}, dorg[3] = {32, 8, 0}, creg[3] = {32, 3, 1};
        CHECK(clEnqueueCopyBufferRect(q, big, big, sorg, dorg, creg, 64, 0, 64, 0, 0, NULL, NULL));
        CHECK(clEnqueueReadBuffer(q, big, CL_TRUE, 0, total, hb, 0, NULL, NULL));
        printf("copy rect checksum=%016llx\n", (unsigned long long)fnv1a(hb, total));
        free(hb);
        clReleaseMemObject(sub);
        clReleaseMemObject(big);
    }

    /* ---- user events, markers, barriers */
    {
        cl_event ue = clCreateUserEvent(ctx, &err); CHECKE(err);
        cl_int st;
        CHECK(clGetEventInfo(ue, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st, NULL));
        printf("user event initial status: %s\n", status_name(st));
        uint32_t *h = malloc(N * 4);
        for (uint32_t i = 0; i < N; i++) h[i] = 7 * i;
        cl_mem du = clCreateBuffer(ctx, CL_MEM_READ_WRITE, N * 4, NULL, &err); CHECKE(err);
        cl_event ew, ek, em;
        CHECK(clEnqueueWriteBuffer(q, du, CL_FALSE, 0, N * 4, h, 1, &ue, &ew));
        cl_uint kk = 5;
        CHECK(clSetKernelArg(k_scale, 0, sizeof du, &du));
        CHECK(clSetKernelArg(k_scale, 1, sizeof kk, &kk));
        CHECK(clEnqueueNDRangeKernel(q, k_scale, 1, NULL, &gsz, NULL, 1, &ew, &ek));
        CHECK(clEnqueueMarkerWithWaitList(q, 1, &ek, &em));
        CHECK(clFlush(q));
        CHECK(clGetEventInfo(ek, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st, NULL));
        printf("kernel blocked on user event: %s\n", st > CL_COMPLETE ? "yes" : "no");
        CHECK(clSetUserEventStatus(ue, CL_COMPLETE));
        CHECK(clWaitForEvents(1, &em));
        CHECK(clGetEventInfo(ek, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st, NULL));
        printf("after user event complete, kernel status: %s\n", status_name(st));
        CHECK(clEnqueueBarrierWithWaitList(q, 0, NULL, NULL));
        uint32_t *r = malloc(N * 4);
        CHECK(clEnqueueReadBuffer(q, du, CL_TRUE, 0, N * 4, r, 0, NULL, NULL));
        int uok = 1;
        for (uint32_t i = 0; i < N; i++) uok &= r[i] == 7 * i * 5 + i;
        printf("user-event gated result: correct=%d checksum=%016llx\n", uok,
               (unsigned long long)fnv1a(r, N * 4));
        /* a user event set to an error status: dependent command must fail */
        cl_event ue2 = clCreateUserEvent(ctx, &err); CHECKE(err);
        cl_command_queue q2 = clCreateCommandQueue(ctx, dev, 0, &err); CHECKE(err);
        cl_event ew2;
        CHECK(clEnqueueWriteBuffer(q2, du, CL_FALSE, 0, 16, h, 1, &ue2, &ew2));
        CHECK(clSetUserEventStatus(ue2, -1234));
        cl_int werr = clWaitForEvents(1, &ew2);
        CHECK(clGetEventInfo(ew2, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st, NULL));
        printf("user event failed: wait=%d (expect %d) dependent status negative=%d\n", werr,
               CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST, st < 0);
        clReleaseEvent(ew2); clReleaseEvent(ue2);
        clReleaseCommandQueue(q2);
        free(h); free(r);
        clReleaseEvent(ue); clReleaseEvent(ew); clReleaseEvent(ek); clReleaseEvent(em);
        clReleaseMemObject(du);
    }

    /* ---- mem object destructor callback */
    {
        cl_mem tmp = clCreateBuffer(ctx, CL_MEM_READ_WRITE, 1024, NULL, &err); CHECKE(err);
        cb_flag dflag = {0, 0};
        CHECK(clSetMemObjectDestructorCallback(tmp, mem_destructor_cb, &dflag));
        CHECK(clReleaseMemObject(tmp));
        printf("mem destructor callback ran: %s\n", flag_wait(&dflag, 10) ? "yes" : "no");
    }

    /* ---- broken program */
    {
        cl_program bad = clCreateProgramWithSource(ctx, 1, &BROKEN_SRC, NULL, &err); CHECKE(err);
        cl_int berr = clBuildProgram(bad, 1, &dev, "", NULL, NULL);
        printf("broken build: err=%d (CL_BUILD_PROGRAM_FAILURE=%d)\n", berr, CL_BUILD_PROGRAM_FAILURE);
        cl_build_status bst;
        CHECK(clGetProgramBuildInfo(bad, dev, CL_PROGRAM_BUILD_STATUS, sizeof bst, &bst, NULL));
        printf("broken build status: %d (CL_BUILD_ERROR=%d)\n", bst, CL_BUILD_ERROR);
        size_t loglen = 0;
        CHECK(clGetProgramBuildInfo(bad, dev, CL_PROGRAM_BUILD_LOG, 0, NULL, &loglen));
        char *log = malloc(loglen + 1);
        CHECK(clGetProgramBuildInfo(bad, dev, CL_PROGRAM_BUILD_LOG, loglen, log, NULL));
        log[loglen] = 0;
        printf("broken build log non-empty: %d, mentions symbol: %d\n", loglen > 1,
               strstr(log, "this_symbol_does_not_exist") != NULL);
        free(log);
        cl_kernel bk = clCreateKernel(bad, "broken", &err);
        printf("create kernel from failed program: err=%d kernel null=%d\n", err, bk == NULL);
        clReleaseProgram(bad);
    }

    /* ---- error paths */
    {
        static struct { void *dispatch; char pad[256]; } fake_obj; /* zeroed, never a real cl_mem */
        cl_mem fake = (cl_mem)&fake_obj;
        char buf[16];
        printf("err read NULL buffer: %d\n",
               clEnqueueReadBuffer(q, NULL, CL_TRUE, 0, 16, buf, 0, NULL, NULL));
        /* A bogus non-NULL handle is undefined behaviour per the spec and the
         * exact code is implementation-specific (PoCL says CL_INVALID_CONTEXT,
         * a handle-translating ICD would say CL_INVALID_MEM_OBJECT), so only
         * print that it failed. */
        cl_int bogus = clEnqueueReadBuffer(q, fake, CL_TRUE, 0, 16, buf, 0, NULL, NULL);
        printf("err read bogus buffer: failed=%d\n", bogus != CL_SUCCESS);
        printf("err read out of range: %d\n",
               clEnqueueReadBuffer(q, dc, CL_TRUE, N * 4 - 8, 16, buf, 0, NULL, NULL));
        /* Errors of calls that may run asynchronously (kernel arguments, enqueues) are
         * reported by the call or, under API remoting, by the next synchronizing call:
         * print the first error of the two. */
        printf("err kernel arg index: %d\n", ERR_OR_FINISH(clSetKernelArg(k_vadd, 7, sizeof dc, &dc), q));
        printf("err kernel arg size: %d\n", ERR_OR_FINISH(clSetKernelArg(k_saxpy, 3, 2, buf), q));
        cl_mem z = clCreateBuffer(ctx, CL_MEM_READ_WRITE, 0, NULL, &err);
        printf("err zero-size buffer: %d null=%d\n", err, z == NULL);
        cl_kernel nk2 = clCreateKernel(prog, "no_such_kernel", &err);
        printf("err bad kernel name: %d null=%d\n", err, nk2 == NULL);
        cl_event ev_null = NULL;
        printf("err wait for NULL event list: %d\n", clWaitForEvents(0, &ev_null));
        size_t bad_local = 3; /* does not divide N */
        printf("err bad local size: %d\n",
               ERR_OR_FINISH(clEnqueueNDRangeKernel(q, k_vadd, 1, NULL, &gsz, &bad_local, 0, NULL, NULL), q));
        CHECK(clFinish(q));
    }

    /* ---- two threads, each with its own queue */
    {
        pthread_t th[2];
        thread_arg ta[2] = {{0, 0, 0}, {1, 0, 0}};
        for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, worker, &ta[i]);
        for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
        for (int i = 0; i < 2; i++)
            printf("thread %d: err=%d checksum=%016llx\n", i, ta[i].err,
                   (unsigned long long)ta[i].checksum);
    }

    clReleaseMemObject(da); clReleaseMemObject(db); clReleaseMemObject(dc);
    clReleaseKernel(k_vadd); clReleaseKernel(k_saxpy); clReleaseKernel(k_reduce); clReleaseKernel(k_scale);
    clReleaseProgram(prog);
    clReleaseCommandQueue(q);
    clReleaseContext(ctx);
    free(a); free(b); free(c);
    printf("done\n");
    return 0;
}
