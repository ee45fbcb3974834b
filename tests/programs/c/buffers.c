/* Buffer transfers and maps, every way an application does them: blocking and not, with
 * and without events and wait lists, at offsets, through sub-buffers, mapped twice, and the
 * errors of bad regions and host-access flags. Prints checksums, flags and error codes, so
 * the output is the same natively and under hira (where buffers may live in the tenant's
 * arena and blocking transfers and maps touch them in place). */
#define CL_TARGET_OPENCL_VERSION 300
#include <CL/cl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(x)                                                                  \
    do {                                                                          \
        cl_int e_ = (x);                                                          \
        if (e_ != CL_SUCCESS) {                                                   \
            fprintf(stderr, "%s:%d: %s = %d\n", __FILE__, __LINE__, #x, e_);       \
            exit(1);                                                              \
        }                                                                         \
    } while (0)

static uint64_t sum(const unsigned char *p, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

static void fill(unsigned char *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)(i * 31 + seed + (i >> 12));
}

/* One thread's share of the concurrent part: its own queue and buffer, blocking writes
 * and reads and maps of its own pattern, checked every time. */
struct worker {
    cl_context ctx;
    cl_device_id dev;
    unsigned seed;
    int ok;
};

static void *work(void *arg) {
    struct worker *w = arg;
    cl_int err;
    size_t n = 256 << 10;
    cl_command_queue q = clCreateCommandQueueWithProperties(w->ctx, w->dev, NULL, &err);
    cl_mem b = clCreateBuffer(w->ctx, CL_MEM_READ_WRITE, n, NULL, &err);
    unsigned char *src = malloc(n), *dst = malloc(n);
    w->ok = err == CL_SUCCESS;
    for (int i = 0; i < 100 && w->ok; i++) {
        fill(src, n, w->seed + i);
        w->ok &= clEnqueueWriteBuffer(q, b, CL_TRUE, 0, n, src, 0, NULL, NULL) == CL_SUCCESS;
        w->ok &= clEnqueueReadBuffer(q, b, CL_TRUE, 0, n, dst, 0, NULL, NULL) == CL_SUCCESS;
        w->ok &= memcmp(src, dst, n) == 0;
        unsigned char *m = clEnqueueMapBuffer(q, b, CL_TRUE, CL_MAP_READ, 4096, 4096, 0, NULL,
                                              NULL, &err);
        w->ok &= err == CL_SUCCESS && memcmp(m, src + 4096, 4096) == 0;
        w->ok &= clEnqueueUnmapMemObject(q, b, m, 0, NULL, NULL) == CL_SUCCESS;
    }
    clFinish(q);
    clReleaseMemObject(b);
    clReleaseCommandQueue(q);
    free(src);
    free(dst);
    return NULL;
}

static const char *SRC =
    "kernel void inc(global uint *a) { a[get_global_id(0)] += 1; }\n";

int main(void) {
    cl_platform_id platform;
    cl_device_id dev;
    cl_int err;
    CHECK(clGetPlatformIDs(1, &platform, NULL));
    CHECK(clGetDeviceIDs(platform, CL_DEVICE_TYPE_ALL, 1, &dev, NULL));
    cl_context ctx = clCreateContext(NULL, 1, &dev, NULL, NULL, &err);
    CHECK(err);
    cl_command_queue q = clCreateCommandQueueWithProperties(ctx, dev, NULL, &err);
    CHECK(err);
    cl_program prog = clCreateProgramWithSource(ctx, 1, &SRC, NULL, &err);
    CHECK(err);
    CHECK(clBuildProgram(prog, 1, &dev, "", NULL, NULL));
    cl_kernel inc = clCreateKernel(prog, "inc", &err);
    CHECK(err);

    const size_t sizes[] = {4096, 64 << 10, 1 << 20, 3 << 20};
    const size_t big = 4 << 20;
    unsigned char *src = malloc(big), *dst = malloc(big);
    fill(src, big, 7);

    /* Flags as the application asked, and no host pointer of ours. */
    cl_mem_flags kinds[] = {CL_MEM_READ_WRITE, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR,
                            CL_MEM_READ_ONLY | CL_MEM_ALLOC_HOST_PTR | CL_MEM_COPY_HOST_PTR,
                            CL_MEM_WRITE_ONLY | CL_MEM_HOST_READ_ONLY};
    for (int k = 0; k < 4; k++) {
        void *host = (kinds[k] & CL_MEM_COPY_HOST_PTR) ? src : NULL;
        cl_mem b = clCreateBuffer(ctx, kinds[k], 1 << 20, host, &err);
        CHECK(err);
        cl_mem_flags f;
        void *hp = (void *)1;
        CHECK(clGetMemObjectInfo(b, CL_MEM_FLAGS, sizeof f, &f, NULL));
        CHECK(clGetMemObjectInfo(b, CL_MEM_HOST_PTR, sizeof hp, &hp, NULL));
        if (host) {
            CHECK(clEnqueueReadBuffer(q, b, CL_TRUE, 0, 1 << 20, dst, 0, NULL, NULL));
            printf("flags %#llx host_ptr %s initial %016llx\n", (unsigned long long)f,
                   hp ? "set" : "NULL", (unsigned long long)sum(dst, 1 << 20));
        } else {
            printf("flags %#llx host_ptr %s\n", (unsigned long long)f, hp ? "set" : "NULL");
        }
        clReleaseMemObject(b);
    }

    /* Blocking round trips at offsets, without and with events and wait lists. */
    cl_mem buf = clCreateBuffer(ctx, CL_MEM_READ_WRITE, big, NULL, &err);
    CHECK(err);
    for (int i = 0; i < 4; i++) {
        size_t n = sizes[i], off = (size_t)i * 4096;
        memset(dst, 0, n);
        CHECK(clEnqueueWriteBuffer(q, buf, CL_TRUE, off, n, src, 0, NULL, NULL));
        CHECK(clEnqueueReadBuffer(q, buf, CL_TRUE, off, n, dst, 0, NULL, NULL));
        uint64_t plain = sum(dst, n);
        cl_event we, re;
        memset(dst, 0, n);
        CHECK(clEnqueueWriteBuffer(q, buf, CL_TRUE, off, n, src + 1, 0, NULL, &we));
        CHECK(clEnqueueReadBuffer(q, buf, CL_TRUE, off, n, dst, 1, &we, &re));
        cl_command_type t;
        CHECK(clGetEventInfo(re, CL_EVENT_COMMAND_TYPE, sizeof t, &t, NULL));
        printf("%zu bytes at %zu: %s %s type %#x\n", n, off,
               plain == sum(src, n) ? "same" : "DIFFERENT",
               sum(dst, n) == sum(src + 1, n) ? "same" : "DIFFERENT", t);
        clReleaseEvent(we);
        clReleaseEvent(re);
    }

    /* Events of blocking transfers on a profiling queue: their type, and times in order. */
    cl_queue_properties pp[] = {CL_QUEUE_PROPERTIES, CL_QUEUE_PROFILING_ENABLE, 0};
    cl_command_queue pq = clCreateCommandQueueWithProperties(ctx, dev, pp, &err);
    CHECK(err);
    for (int w = 1; w >= 0; w--) {
        cl_event pe;
        if (w)
            CHECK(clEnqueueWriteBuffer(pq, buf, CL_TRUE, 0, 1 << 20, src, 0, NULL, &pe));
        else
            CHECK(clEnqueueReadBuffer(pq, buf, CL_TRUE, 0, 1 << 20, dst, 0, NULL, &pe));
        CHECK(clWaitForEvents(1, &pe));
        cl_ulong t[4];
        for (int i = 0; i < 4; i++)
            CHECK(clGetEventProfilingInfo(pe, CL_PROFILING_COMMAND_QUEUED + i, sizeof t[i], &t[i],
                                          NULL));
        cl_command_type pt;
        CHECK(clGetEventInfo(pe, CL_EVENT_COMMAND_TYPE, sizeof pt, &pt, NULL));
        printf("profiled %s: type %#x, times in order %s, data %s\n", w ? "write" : "read", pt,
               t[0] <= t[1] && t[1] <= t[2] && t[2] <= t[3] && t[0] > 0 ? "yes" : "NO",
               w || sum(dst, 1 << 20) == sum(src, 1 << 20) ? "same" : "DIFFERENT");
        clReleaseEvent(pe);
    }
    clReleaseCommandQueue(pq);
    /* ... and on a queue made without profiling, which the application is told. */
    cl_event ne;
    CHECK(clEnqueueWriteBuffer(q, buf, CL_TRUE, 0, 1 << 20, src, 0, NULL, &ne));
    cl_ulong nt;
    cl_command_queue_properties qp;
    CHECK(clGetCommandQueueInfo(q, CL_QUEUE_PROPERTIES, sizeof qp, &qp, NULL));
    printf("queue without profiling: properties %#llx, profiling info %d\n",
           (unsigned long long)qp,
           clGetEventProfilingInfo(ne, CL_PROFILING_COMMAND_START, sizeof nt, &nt, NULL));
    clReleaseEvent(ne);

    /* A write gated on a user event, a kernel, then a blocking read. */
    cl_event gate = clCreateUserEvent(ctx, &err);
    CHECK(err);
    CHECK(clEnqueueWriteBuffer(q, buf, CL_FALSE, 0, 1 << 20, src, 1, &gate, NULL));
    CHECK(clSetUserEventStatus(gate, CL_COMPLETE));
    CHECK(clSetKernelArg(inc, 0, sizeof buf, &buf));
    size_t items = (1 << 20) / 4;
    CHECK(clEnqueueNDRangeKernel(q, inc, 1, NULL, &items, NULL, 0, NULL, NULL));
    CHECK(clEnqueueReadBuffer(q, buf, CL_TRUE, 0, 1 << 20, dst, 0, NULL, NULL));
    int ok = 1;
    for (size_t i = 0; i < items; i++) {
        uint32_t a, b;
        memcpy(&a, src + 4 * i, 4);
        memcpy(&b, dst + 4 * i, 4);
        ok &= b == a + 1;
    }
    printf("kernel after gated write: %s\n", ok ? "incremented" : "WRONG");
    clReleaseEvent(gate);

    /* Bad regions and host access. */
    printf("write past the end: %d\n",
           clEnqueueWriteBuffer(q, buf, CL_TRUE, big - 4096, 1 << 20, src, 0, NULL, NULL));
    printf("read past the end: %d\n",
           clEnqueueReadBuffer(q, buf, CL_TRUE, big, 1 << 20, dst, 0, NULL, NULL));
    cl_mem ro = clCreateBuffer(ctx, CL_MEM_READ_WRITE | CL_MEM_HOST_READ_ONLY, 1 << 20, NULL, &err);
    CHECK(err);
    printf("write to host-read-only: %d\n",
           clEnqueueWriteBuffer(q, ro, CL_TRUE, 0, 1 << 20, src, 0, NULL, NULL));
    cl_mem wo = clCreateBuffer(ctx, CL_MEM_READ_WRITE | CL_MEM_HOST_WRITE_ONLY, 1 << 20, NULL, &err);
    CHECK(err);
    printf("read from host-write-only: %d\n",
           clEnqueueReadBuffer(q, wo, CL_TRUE, 0, 1 << 20, dst, 0, NULL, NULL));
    clReleaseMemObject(ro);
    clReleaseMemObject(wo);

    /* Maps: the same region twice, write-invalidate then a kernel, non-blocking with an event. */
    CHECK(clEnqueueWriteBuffer(q, buf, CL_TRUE, 0, big, src, 0, NULL, NULL));
    unsigned char *m1 = clEnqueueMapBuffer(q, buf, CL_TRUE, CL_MAP_READ, 8192, 65536, 0, NULL,
                                           NULL, &err);
    CHECK(err);
    unsigned char *m2 = clEnqueueMapBuffer(q, buf, CL_TRUE, CL_MAP_READ, 8192, 65536, 0, NULL,
                                           NULL, &err);
    CHECK(err);
    printf("mapped twice: %s %s\n", sum(m1, 65536) == sum(src + 8192, 65536) ? "same" : "DIFFERENT",
           sum(m2, 65536) == sum(src + 8192, 65536) ? "same" : "DIFFERENT");
    CHECK(clEnqueueUnmapMemObject(q, buf, m1, 0, NULL, NULL));
    CHECK(clEnqueueUnmapMemObject(q, buf, m2, 0, NULL, NULL));
    unsigned char *mw = clEnqueueMapBuffer(q, buf, CL_TRUE, CL_MAP_WRITE_INVALIDATE_REGION, 0,
                                           1 << 20, 0, NULL, NULL, &err);
    CHECK(err);
    memset(mw, 0, 1 << 20);
    CHECK(clEnqueueUnmapMemObject(q, buf, mw, 0, NULL, NULL));
    CHECK(clEnqueueNDRangeKernel(q, inc, 1, NULL, &items, NULL, 0, NULL, NULL));
    cl_event me;
    uint32_t *mr = clEnqueueMapBuffer(q, buf, CL_FALSE, CL_MAP_READ, 0, 1 << 20, 0, NULL, &me,
                                      &err);
    CHECK(err);
    CHECK(clWaitForEvents(1, &me));
    ok = 1;
    for (size_t i = 0; i < items; i++) ok &= mr[i] == 1;
    cl_command_type mt;
    CHECK(clGetEventInfo(me, CL_EVENT_COMMAND_TYPE, sizeof mt, &mt, NULL));
    cl_event ue;
    CHECK(clEnqueueUnmapMemObject(q, buf, mr, 0, NULL, &ue));
    cl_command_type ut;
    CHECK(clGetEventInfo(ue, CL_EVENT_COMMAND_TYPE, sizeof ut, &ut, NULL));
    CHECK(clWaitForEvents(1, &ue));
    printf("map after kernel: %s, type %#x, unmap type %#x\n", ok ? "all ones" : "WRONG", mt, ut);
    clReleaseEvent(me);
    clReleaseEvent(ue);
    printf("unmap of a pointer never mapped: %d\n",
           clEnqueueUnmapMemObject(q, buf, src, 0, NULL, NULL));
    printf("unmap of a pointer mapped and unmapped: %d\n",
           clEnqueueUnmapMemObject(q, buf, mr, 0, NULL, NULL));
    CHECK(clFinish(q));

    /* A sub-buffer: transfers and maps through it land in the parent. */
    cl_buffer_region reg = {1 << 20, 1 << 20};
    cl_mem sub = clCreateSubBuffer(buf, CL_MEM_READ_WRITE, CL_BUFFER_CREATE_TYPE_REGION, &reg, &err);
    CHECK(err);
    CHECK(clEnqueueWriteBuffer(q, sub, CL_TRUE, 0, 1 << 20, src + 5, 0, NULL, NULL));
    CHECK(clEnqueueReadBuffer(q, buf, CL_TRUE, 1 << 20, 1 << 20, dst, 0, NULL, NULL));
    unsigned char *ms = clEnqueueMapBuffer(q, sub, CL_TRUE, CL_MAP_READ, 4096, 4096, 0, NULL,
                                           NULL, &err);
    CHECK(err);
    cl_mem_flags sf;
    CHECK(clGetMemObjectInfo(sub, CL_MEM_FLAGS, sizeof sf, &sf, NULL));
    printf("sub-buffer: %s %s flags %#llx\n",
           sum(dst, 1 << 20) == sum(src + 5, 1 << 20) ? "same" : "DIFFERENT",
           sum(ms, 4096) == sum(src + 5 + 4096, 4096) ? "same" : "DIFFERENT",
           (unsigned long long)sf);
    CHECK(clEnqueueUnmapMemObject(q, sub, ms, 0, NULL, NULL));
    CHECK(clFinish(q));
    clReleaseMemObject(sub);

    /* Four threads at once, each on its own queue and buffer. */
    struct worker ws[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        ws[i] = (struct worker){ctx, dev, 11u * (unsigned)i, 0};
        pthread_create(&th[i], NULL, work, &ws[i]);
    }
    int all = 1;
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        all &= ws[i].ok;
    }
    printf("four threads, 100 rounds each: %s\n", all ? "ok" : "WRONG");

    /* Many buffers made and released: their memory comes back. */
    for (int i = 0; i < 64; i++) {
        cl_mem t = clCreateBuffer(ctx, CL_MEM_READ_WRITE, 16 << 20, NULL, &err);
        CHECK(err);
        CHECK(clEnqueueWriteBuffer(q, t, CL_TRUE, (12 << 20) + i * 4096, big - i * 4096, src,
                                   0, NULL, NULL));
        clReleaseMemObject(t);
    }
    printf("64 buffers of 16 MiB made, written and released\n");

    clReleaseMemObject(buf);
    clReleaseKernel(inc);
    clReleaseProgram(prog);
    clReleaseCommandQueue(q);
    clReleaseContext(ctx);
    free(src);
    free(dst);
    printf("done\n");
    return 0;
}
