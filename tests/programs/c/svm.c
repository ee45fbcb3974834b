/* svm.c - shared virtual memory, with deterministic output so that its
 * stdout natively and under `hira run --` can be diffed byte for byte.
 * Only results are printed, never pointers.
 *
 * Fine-grained buffer SVM (when the device offers it): the host builds a
 * linked list in SVM memory without map/unmap, a kernel follows the pointers
 * stored in it and updates it, the host reads the results straight from
 * memory; atomics from a kernel; a copy and a map of fine-grained memory;
 * clSVMFree and clEnqueueSVMFree of fine-grained allocations.
 *
 * Covered: clSVMAlloc/clSVMFree, clEnqueueSVMMemFill, blocking and
 * non-blocking clEnqueueSVMMap (READ, WRITE, WRITE_INVALIDATE_REGION) and
 * clEnqueueSVMUnmap with events (also of a map never waited for), kernels on SVM through
 * clSetKernelArgSVMPointer (base and offset pointers), clSetKernelExecInfo
 * (SVM_PTRS), clEnqueueSVMMemcpy host->SVM, SVM->host (blocking and not) and
 * SVM->SVM, clEnqueueSVMMigrateMem, a buffer created with CL_MEM_USE_HOST_PTR
 * on SVM memory (it aliases the allocation), clEnqueueSVMFree with and
 * without a free callback.
 *
 * Build: cc -O2 svm.c -lOpenCL
 */
#define CL_TARGET_OPENCL_VERSION 300
#include <CL/cl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHECK(x) do { cl_int _e = (x); if (_e != CL_SUCCESS) { \
    printf("ERROR %s -> %d (line %d)\n", #x, _e, __LINE__); exit(1); } } while (0)
#define CHECKE(err) do { if ((err) != CL_SUCCESS) { \
    printf("ERROR code %d (line %d)\n", (err), __LINE__); exit(1); } } while (0)

#define N 4096u
#define OFF 1000u

static const char *SRC =
    "__kernel void twice(__global float *a) {\n"
    "    a[get_global_id(0)] *= 2.0f;\n"
    "}\n"
    "__kernel void add(__global int *out, __global const int *in, int k) {\n"
    "    size_t i = get_global_id(0);\n"
    "    out[i] = in[i] + k;\n"
    "}\n"
    "typedef struct { __global int *data; int n; } node;\n"
    "__kernel void chase(__global node *nodes, __global int *sum) {\n"
    "    int s = 0;\n"
    "    for (int j = 0; j < nodes[0].n; j++) s += nodes[0].data[j];\n"
    "    sum[0] = s;\n"
    "}\n"
    "typedef struct lnode { __global struct lnode *next; int v; int pad; } lnode;\n"
    "__kernel void walk(__global lnode *head, __global int *res) {\n"
    "    int s = 0, n = 0;\n"
    "    for (__global lnode *p = head; p; p = p->next) { s += p->v; n++; p->v += 1; }\n"
    "    res[0] = s; res[1] = n;\n"
    "}\n"
    "__kernel void count(__global volatile int *res) { atomic_inc(&res[2]); }\n";

static uint64_t fnv1a(const void *data, size_t len) {
    const unsigned char *p = data;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < len; i++) { h ^= p[i]; h *= 1099511628211ull; }
    return h;
}

static int freed_calls;
static cl_uint freed_count;
static cl_context free_ctx;

static void CL_CALLBACK free_cb(cl_command_queue q, cl_uint n, void *ptrs[], void *ud) {
    (void)q;
    freed_calls++;
    freed_count += n;
    for (cl_uint i = 0; i < n; i++) clSVMFree(free_ctx, ptrs[i]);
    *(int *)ud = 1;
}

int main(void) {
    cl_int err;
    cl_platform_id platform;
    CHECK(clGetPlatformIDs(1, &platform, NULL));
    cl_device_id dev;
    CHECK(clGetDeviceIDs(platform, CL_DEVICE_TYPE_ALL, 1, &dev, NULL));
    cl_device_svm_capabilities caps = 0;
    CHECK(clGetDeviceInfo(dev, CL_DEVICE_SVM_CAPABILITIES, sizeof caps, &caps, NULL));
    printf("coarse-grain buffer SVM: %s\n",
           (caps & CL_DEVICE_SVM_COARSE_GRAIN_BUFFER) ? "yes" : "no");
    if (!(caps & CL_DEVICE_SVM_COARSE_GRAIN_BUFFER)) return 0;

    cl_context ctx = clCreateContext(NULL, 1, &dev, NULL, NULL, &err);
    CHECKE(err);
    free_ctx = ctx;
    cl_command_queue q = clCreateCommandQueueWithProperties(ctx, dev, NULL, &err);
    CHECKE(err);
    cl_program prog = clCreateProgramWithSource(ctx, 1, &SRC, NULL, &err);
    CHECKE(err);
    CHECK(clBuildProgram(prog, 1, &dev, "", NULL, NULL));
    cl_kernel twice = clCreateKernel(prog, "twice", &err);
    CHECKE(err);
    cl_kernel add = clCreateKernel(prog, "add", &err);
    CHECKE(err);
    cl_kernel chase = clCreateKernel(prog, "chase", &err);
    CHECKE(err);

    /* ---- allocate, fill, map/write/unmap */
    float *a = clSVMAlloc(ctx, CL_MEM_READ_WRITE, N * sizeof(float), 64);
    printf("alloc: %s, 64-byte aligned: %s\n", a ? "ok" : "NULL",
           ((uintptr_t)a % 64) == 0 ? "yes" : "no");
    void *none = clSVMAlloc(ctx, CL_MEM_READ_WRITE, 0, 0);
    void *odd = clSVMAlloc(ctx, CL_MEM_READ_WRITE, 256, 3);
    printf("size 0: %s, alignment 3: %s\n", none ? "ok" : "NULL", odd ? "ok" : "NULL");
    float fill = 1.5f;
    CHECK(clEnqueueSVMMemFill(q, a, &fill, sizeof fill, N * sizeof(float), 0, NULL, NULL));
    CHECK(clEnqueueSVMMap(q, CL_TRUE, CL_MAP_READ, a, N * sizeof(float), 0, NULL, NULL));
    printf("after fill: a[0]=%.2f a[%u]=%.2f\n", a[0], N - 1, a[N - 1]);
    CHECK(clEnqueueSVMUnmap(q, a, 0, NULL, NULL));

    cl_event mapped, unmapped;
    CHECK(clEnqueueSVMMap(q, CL_TRUE, CL_MAP_WRITE, a, N * sizeof(float), 0, NULL, &mapped));
    for (unsigned i = 0; i < N; i++) a[i] = (float)i;
    CHECK(clEnqueueSVMUnmap(q, a, 0, NULL, &unmapped));
    CHECK(clWaitForEvents(1, &unmapped));
    cl_int st;
    CHECK(clGetEventInfo(mapped, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st, NULL));
    printf("map event complete: %s\n", st == CL_COMPLETE ? "yes" : "no");
    CHECK(clReleaseEvent(mapped));
    CHECK(clReleaseEvent(unmapped));

    /* ---- kernels: the whole allocation, then from an offset pointer */
    size_t gws = N;
    CHECK(clSetKernelArgSVMPointer(twice, 0, a));
    CHECK(clEnqueueNDRangeKernel(q, twice, 1, NULL, &gws, NULL, 0, NULL, NULL));
    gws = N - OFF;
    CHECK(clSetKernelArgSVMPointer(twice, 0, a + OFF));
    CHECK(clEnqueueNDRangeKernel(q, twice, 1, NULL, &gws, NULL, 0, NULL, NULL));
    CHECK(clEnqueueSVMMap(q, CL_TRUE, CL_MAP_READ, a, N * sizeof(float), 0, NULL, NULL));
    int ok = 1;
    for (unsigned i = 0; i < N; i++) ok &= a[i] == (float)i * (i < OFF ? 2.0f : 4.0f);
    printf("twice (base and offset pointer): a[1]=%.1f a[%u]=%.1f a[%u]=%.1f %s\n", a[1],
           OFF - 1, a[OFF - 1], N - 1, a[N - 1], ok ? "ok" : "WRONG");
    CHECK(clEnqueueSVMUnmap(q, a, 0, NULL, NULL));

    /* ---- memcpy: host -> SVM, SVM -> SVM, SVM -> host (blocking and not) */
    int *in = clSVMAlloc(ctx, CL_MEM_READ_ONLY, N * sizeof(int), 0);
    int *out = clSVMAlloc(ctx, CL_MEM_READ_WRITE, N * sizeof(int), 0);
    int *big = clSVMAlloc(ctx, CL_MEM_READ_WRITE, 64 * N * sizeof(int), 128);
    printf("three more allocations: %s\n", in && out && big ? "ok" : "NULL");
    int *host = malloc(64 * N * sizeof(int));
    for (unsigned i = 0; i < 64 * N; i++) host[i] = (int)(i * 7 + 3);
    CHECK(clEnqueueSVMMemcpy(q, CL_TRUE, in, host, N * sizeof(int), 0, NULL, NULL));
    CHECK(clEnqueueSVMMemcpy(q, CL_FALSE, big, host, 64 * N * sizeof(int), 0, NULL, NULL));
    int k = 100;
    gws = N;
    CHECK(clSetKernelArgSVMPointer(add, 0, out));
    CHECK(clSetKernelArgSVMPointer(add, 1, in));
    CHECK(clSetKernelArg(add, 2, sizeof k, &k));
    CHECK(clEnqueueNDRangeKernel(q, add, 1, NULL, &gws, NULL, 0, NULL, NULL));
    int *back = calloc(N, sizeof(int));
    CHECK(clEnqueueSVMMemcpy(q, CL_TRUE, back, out, N * sizeof(int), 0, NULL, NULL));
    ok = 1;
    for (unsigned i = 0; i < N; i++) ok &= back[i] == (int)(i * 7 + 3) + 100;
    printf("add via SVM: back[0]=%d back[%u]=%d %s\n", back[0], N - 1, back[N - 1],
           ok ? "ok" : "WRONG");
    /* SVM -> SVM, into the middle of the large allocation */
    CHECK(clEnqueueSVMMemcpy(q, CL_FALSE, big + 5 * N, out, N * sizeof(int), 0, NULL, NULL));
    int *bigback = calloc(64 * N, sizeof(int));
    cl_event got;
    CHECK(clEnqueueSVMMemcpy(q, CL_FALSE, bigback, big, 64 * N * sizeof(int), 0, NULL, &got));
    CHECK(clWaitForEvents(1, &got));
    CHECK(clReleaseEvent(got));
    ok = 1;
    for (unsigned i = 0; i < 64 * N; i++) {
        int want = (i >= 5 * N && i < 6 * N) ? (int)((i - 5 * N) * 7 + 3) + 100
                                             : (int)(i * 7 + 3);
        ok &= bigback[i] == want;
    }
    printf("SVM->SVM and non-blocking SVM->host (%u KiB): fnv %016llx %s\n",
           (unsigned)(64 * N * sizeof(int) / 1024),
           (unsigned long long)fnv1a(bigback, 64 * N * sizeof(int)), ok ? "ok" : "WRONG");

    /* ---- non-blocking map, write-invalidate map */
    cl_event ev;
    CHECK(clEnqueueSVMMap(q, CL_FALSE, CL_MAP_READ | CL_MAP_WRITE, out, N * sizeof(int), 0,
                          NULL, &ev));
    CHECK(clWaitForEvents(1, &ev));
    CHECK(clReleaseEvent(ev));
    printf("non-blocking map: out[2]=%d\n", out[2]);
    out[2] = -1;
    CHECK(clEnqueueSVMUnmap(q, out, 0, NULL, NULL));
    CHECK(clEnqueueSVMMap(q, CL_TRUE, CL_MAP_WRITE_INVALIDATE_REGION, in + 8, 8 * sizeof(int),
                          0, NULL, NULL));
    for (int i = 0; i < 8; i++) in[8 + i] = 1000 + i;
    CHECK(clEnqueueSVMUnmap(q, in + 8, 0, NULL, NULL));
    CHECK(clEnqueueSVMMemcpy(q, CL_TRUE, back, in, 20 * sizeof(int), 0, NULL, NULL));
    printf("write-invalidate map of in[8..16): in[7]=%d in[8]=%d in[15]=%d in[16]=%d\n",
           back[7], back[8], back[15], back[16]);
    CHECK(clEnqueueSVMMemcpy(q, CL_TRUE, back, out, 4 * sizeof(int), 0, NULL, NULL));
    printf("written through a map: out[2]=%d\n", back[2]);
    /* a non-blocking map released without waiting for it changes nothing */
    k = 200;
    CHECK(clSetKernelArg(add, 2, sizeof k, &k));
    CHECK(clEnqueueNDRangeKernel(q, add, 1, NULL, &gws, NULL, 0, NULL, NULL));
    CHECK(clEnqueueSVMMap(q, CL_FALSE, CL_MAP_READ | CL_MAP_WRITE, out, N * sizeof(int), 0,
                          NULL, NULL));
    CHECK(clEnqueueSVMUnmap(q, out, 0, NULL, NULL));
    CHECK(clEnqueueSVMMemcpy(q, CL_TRUE, back, out, 4 * sizeof(int), 0, NULL, NULL));
    printf("map released unread, after add 200: out[2]=%d out[3]=%d\n", back[2], back[3]);

    /* ---- SVM_PTRS exec info, and a kernel following a pointer stored in SVM memory. The
     * kernel runs only where the device offers fine-grained SVM: there hira serves every
     * SVM allocation from memory shared at the same address; elsewhere a coarse-grained
     * allocation is a mirror whose stored pointers the server cannot follow. */
    struct { int *data; int n; int pad; } *nodes =
        clSVMAlloc(ctx, CL_MEM_READ_WRITE, 64, 0);
    int *sum = clSVMAlloc(ctx, CL_MEM_READ_WRITE, sizeof(int), 0);
    CHECK(clEnqueueSVMMap(q, CL_TRUE, CL_MAP_WRITE, nodes, 64, 0, NULL, NULL));
    memset(nodes, 0, 64);
    nodes[0].n = 10;
    CHECK(clEnqueueSVMUnmap(q, nodes, 0, NULL, NULL));
    void *used[] = {in};
    CHECK(clSetKernelExecInfo(chase, CL_KERNEL_EXEC_INFO_SVM_PTRS, sizeof used, used));
    printf("exec info SVM_PTRS: ok\n");
    if (caps & CL_DEVICE_SVM_FINE_GRAIN_BUFFER) {
        CHECK(clEnqueueSVMMap(q, CL_TRUE, CL_MAP_WRITE, nodes, 64, 0, NULL, NULL));
        nodes[0].data = in;
        CHECK(clEnqueueSVMUnmap(q, nodes, 0, NULL, NULL));
        CHECK(clSetKernelArgSVMPointer(chase, 0, nodes));
        CHECK(clSetKernelArgSVMPointer(chase, 1, sum));
        size_t one = 1;
        CHECK(clEnqueueNDRangeKernel(q, chase, 1, NULL, &one, NULL, 0, NULL, NULL));
        CHECK(clEnqueueSVMMap(q, CL_TRUE, CL_MAP_READ, sum, sizeof(int), 0, NULL, NULL));
        printf("kernel followed a pointer stored in coarse-grain SVM: sum %d\n", *sum);
        CHECK(clEnqueueSVMUnmap(q, sum, 0, NULL, NULL));
    }

    /* ---- a buffer on SVM memory (CL_MEM_USE_HOST_PTR) aliases the allocation */
    cl_mem view = clCreateBuffer(ctx, CL_MEM_READ_WRITE | CL_MEM_USE_HOST_PTR,
                                 (N - OFF) * sizeof(float), a + OFF, &err);
    CHECKE(err);
    cl_bool uses_svm = CL_FALSE;
    CHECK(clGetMemObjectInfo(view, CL_MEM_USES_SVM_POINTER, sizeof uses_svm, &uses_svm, NULL));
    void *hp = NULL;
    CHECK(clGetMemObjectInfo(view, CL_MEM_HOST_PTR, sizeof hp, &hp, NULL));
    printf("buffer on SVM: uses SVM pointer %s, host pointer is the SVM pointer: %s\n",
           uses_svm ? "yes" : "no", hp == (void *)(a + OFF) ? "yes" : "no");
    gws = N - OFF;
    CHECK(clSetKernelArg(twice, 0, sizeof view, &view));
    CHECK(clEnqueueNDRangeKernel(q, twice, 1, NULL, &gws, NULL, 0, NULL, NULL));
    CHECK(clFinish(q));
    CHECK(clReleaseMemObject(view));
    CHECK(clEnqueueSVMMap(q, CL_TRUE, CL_MAP_READ, a, N * sizeof(float), 0, NULL, NULL));
    ok = 1;
    for (unsigned i = 0; i < N; i++) ok &= a[i] == (float)i * (i < OFF ? 2.0f : 8.0f);
    printf("kernel on the buffer, seen in SVM: a[%u]=%.1f a[%u]=%.1f %s\n", OFF - 1, a[OFF - 1],
           N - 1, a[N - 1], ok ? "ok" : "WRONG");
    CHECK(clEnqueueSVMUnmap(q, a, 0, NULL, NULL));

    /* ---- migrate, free */
    const void *mig[] = {a, out + 16};
    size_t mig_sizes[] = {0, 64};
    CHECK(clEnqueueSVMMigrateMem(q, 2, mig, mig_sizes, 0, 0, NULL, NULL));
    CHECK(clFinish(q));
    printf("migrate: ok\n");

    /* ---- fine-grained buffer SVM: one memory for host and kernels, no map */
    printf("fine-grain buffer SVM: %s, atomics: %s\n",
           (caps & CL_DEVICE_SVM_FINE_GRAIN_BUFFER) ? "yes" : "no",
           (caps & CL_DEVICE_SVM_ATOMICS) ? "yes" : "no");
    if (caps & CL_DEVICE_SVM_FINE_GRAIN_BUFFER) {
        typedef struct lnode { struct lnode *next; int v; int pad; } lnode;
        enum { LN = 1000 };
        cl_svm_mem_flags fg = CL_MEM_READ_WRITE | CL_MEM_SVM_FINE_GRAIN_BUFFER;
        lnode *ln = clSVMAlloc(ctx, fg, LN * sizeof(lnode), 0);
        int *res = clSVMAlloc(ctx, fg | ((caps & CL_DEVICE_SVM_ATOMICS) ? CL_MEM_SVM_ATOMICS : 0),
                              4 * sizeof(int), 0);
        printf("fine-grain alloc: %s\n", ln && res ? "ok" : "NULL");
        if (!ln || !res) return 1;
        /* The list visits the nodes in the order 0, 7, 14, ... (mod LN). */
        for (int i = 0; i < LN; i++) {
            int at = (i * 7) % LN;
            ln[at].v = i * 3 + 1;
            ln[at].next = i + 1 < LN ? &ln[((i + 1) * 7) % LN] : NULL;
        }
        memset(res, 0, 4 * sizeof(int));
        cl_kernel walk = clCreateKernel(prog, "walk", &err);
        CHECKE(err);
        CHECK(clSetKernelArgSVMPointer(walk, 0, ln));
        CHECK(clSetKernelArgSVMPointer(walk, 1, res));
        size_t one = 1;
        CHECK(clEnqueueNDRangeKernel(q, walk, 1, NULL, &one, NULL, 0, NULL, NULL));
        CHECK(clFinish(q));
        printf("kernel walked the host's list: sum %d over %d nodes; node 7 now %d\n",
               res[0], res[1], ln[7].v);
        cl_kernel count = clCreateKernel(prog, "count", &err);
        CHECKE(err);
        CHECK(clSetKernelArgSVMPointer(count, 0, res));
        size_t many = N;
        CHECK(clEnqueueNDRangeKernel(q, count, 1, NULL, &many, NULL, 0, NULL, NULL));
        CHECK(clFinish(q));
        printf("atomic increments seen by the host: %d\n", res[2]);
        int head[2];
        CHECK(clEnqueueSVMMemcpy(q, CL_TRUE, head, &ln[0].v, sizeof(int), 0, NULL, NULL));
        CHECK(clEnqueueSVMMemcpy(q, CL_TRUE, &head[1], &ln[LN - 1].v, sizeof(int), 0, NULL,
                                 NULL));
        CHECK(clEnqueueSVMMap(q, CL_TRUE, CL_MAP_WRITE, res, 4 * sizeof(int), 0, NULL, NULL));
        res[3] = head[0] + head[1];
        CHECK(clEnqueueSVMUnmap(q, res, 0, NULL, NULL));
        CHECK(clFinish(q));
        printf("copied out of fine-grain SVM: %d %d, written through a map: %d\n", head[0],
               head[1], res[3]);
        void *fine_free[] = {ln};
        cl_event fe;
        CHECK(clEnqueueSVMFree(q, 1, fine_free, NULL, NULL, 0, NULL, &fe));
        CHECK(clWaitForEvents(1, &fe));
        CHECK(clReleaseEvent(fe));
        clSVMFree(ctx, res);
        clReleaseKernel(walk);
        clReleaseKernel(count);
        printf("fine-grain freed\n");
    }

    void *to_free[] = {in, out};
    cl_event freed;
    CHECK(clEnqueueSVMFree(q, 2, to_free, NULL, NULL, 0, NULL, &freed));
    CHECK(clWaitForEvents(1, &freed));
    CHECK(clReleaseEvent(freed));
    int cb_ran = 0;
    void *cb_free[] = {nodes, sum};
    CHECK(clEnqueueSVMFree(q, 2, cb_free, free_cb, &cb_ran, 0, NULL, NULL));
    CHECK(clFinish(q));
    for (int i = 0; i < 200 && !cb_ran; i++) {
        struct timespec t = {0, 5000000};
        nanosleep(&t, NULL);
    }
    printf("enqueued frees: callback ran %d time(s) for %u pointer(s)\n", freed_calls,
           freed_count);
    clSVMFree(ctx, a);
    clSVMFree(ctx, big);
    clSVMFree(ctx, NULL);
    CHECK(clFinish(q));
    printf("freed\n");

    free(host);
    free(back);
    free(bigback);
    clReleaseKernel(twice);
    clReleaseKernel(add);
    clReleaseKernel(chase);
    clReleaseProgram(prog);
    clReleaseCommandQueue(q);
    clReleaseContext(ctx);
    printf("done\n");
    return 0;
}
