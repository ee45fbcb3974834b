/*
 * waits.c: waiting for kernel launches' events, the way applications do — a loop keeping a
 * few launches queued and waiting for the oldest, one wait for many events, a kernel longer
 * than hira's wait on its event board (2 ms), launches gated by a user event that fails,
 * events of launches made by another thread, launches without events by another thread
 * followed by clFinish and a read here (20 rounds, the other thread's commands flushed and
 * not), and waits mixing a launch's event with a transfer's. Prints only what must be the
 * same natively and under hira.
 *
 * Build: cc -O2 waits.c -lOpenCL -lpthread
 */
#define CL_TARGET_OPENCL_VERSION 300
#include <CL/cl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define CHECK(x)                                                                  \
    do {                                                                          \
        cl_int e_ = (x);                                                          \
        if (e_ != CL_SUCCESS) {                                                   \
            printf("FAIL %s:%d %s = %d\n", __FILE__, __LINE__, #x, e_);           \
            exit(1);                                                              \
        }                                                                         \
    } while (0)
#define CHECKE(e) CHECK(e)

#define N 1024

static const char *SRC =
    "__kernel void advance(__global uint *x, uint k) {\n"
    "    size_t i = get_global_id(0);\n"
    "    x[i] = x[i] * 3u + k;\n"
    "}\n"
    "__kernel void spin(__global uint *x, uint iters) {\n"
    "    size_t i = get_global_id(0);\n"
    "    uint v = x[i];\n"
    "    for (uint j = 0; j < iters; j++) v = v * 1664525u + 1013904223u;\n"
    "    x[i] = v;\n"
    "}\n";

static cl_context ctx;
static cl_device_id dev;
static cl_program prog;

/* Resident set size in KiB. */
static long rss_kib(void) {
    long pages = 0, resident = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (f) {
        if (fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
        fclose(f);
    }
    return resident * 4;
}

static uint64_t fnv1a(const void *p, size_t n) {
    const unsigned char *b = p;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

static uint64_t checksum(cl_command_queue q, cl_mem m) {
    uint32_t *h = malloc(N * 4);
    CHECK(clEnqueueReadBuffer(q, m, CL_TRUE, 0, N * 4, h, 0, NULL, NULL));
    uint64_t s = fnv1a(h, N * 4);
    free(h);
    return s;
}

static cl_mem zeroed(cl_command_queue q) {
    cl_int err;
    cl_mem m = clCreateBuffer(ctx, CL_MEM_READ_WRITE, N * 4, NULL, &err); CHECKE(err);
    cl_uint zero = 0;
    CHECK(clEnqueueFillBuffer(q, m, &zero, 4, 0, N * 4, 0, NULL, NULL));
    CHECK(clFinish(q));
    return m;
}

static cl_event step(cl_command_queue q, cl_kernel k, cl_mem m, cl_uint v, cl_uint nwait,
                     const cl_event *wait) {
    size_t g = N;
    cl_event ev;
    CHECK(clSetKernelArg(k, 0, sizeof m, &m));
    CHECK(clSetKernelArg(k, 1, sizeof v, &v));
    CHECK(clEnqueueNDRangeKernel(q, k, 1, NULL, &g, NULL, nwait, wait, &ev));
    return ev;
}

struct launcher {
    cl_command_queue q;
    cl_mem m;
    cl_event evs[16];
};

/* A thread that launches without flushing and stays until told: its launches are in its
 * batch under hira, and a wait in another thread must send them. */
struct holder {
    cl_command_queue q;
    cl_mem m;
    cl_event evs[4];
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stage;
};

/* The holder's side: it has launched; it stays until let go. */
static void hold(struct holder *h) {
    pthread_mutex_lock(&h->mu);
    h->stage = 1;
    pthread_cond_broadcast(&h->cv);
    while (h->stage != 2) pthread_cond_wait(&h->cv, &h->mu);
    pthread_mutex_unlock(&h->mu);
}

/* The other side: until the holder has launched, then after it is let go. */
static void until_held(struct holder *h) {
    pthread_mutex_lock(&h->mu);
    while (h->stage != 1) pthread_cond_wait(&h->cv, &h->mu);
    pthread_mutex_unlock(&h->mu);
}

static void let_go(struct holder *h) {
    pthread_mutex_lock(&h->mu);
    h->stage = 2;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
}

static void *launch_and_hold(void *arg) {
    struct holder *h = arg;
    cl_int err;
    cl_kernel k = clCreateKernel(prog, "advance", &err); CHECKE(err);
    for (int i = 0; i < 4; i++) h->evs[i] = step(h->q, k, h->m, (cl_uint)(i + 7), 0, NULL);
    hold(h);
    clReleaseKernel(k);
    return NULL;
}

/* Launches without events, then stays until told: another thread's clFinish on the queue
 * must find them there (under hira they travel on this thread's connection). */
static void *launch_quietly_and_hold(void *arg) {
    struct holder *h = arg;
    cl_int err;
    cl_kernel k = clCreateKernel(prog, "advance", &err); CHECKE(err);
    size_t g = N;
    for (cl_uint i = 0; i < 8; i++) {
        cl_uint v = i + 3;
        CHECK(clSetKernelArg(k, 0, sizeof h->m, &h->m));
        CHECK(clSetKernelArg(k, 1, sizeof v, &v));
        CHECK(clEnqueueNDRangeKernel(h->q, k, 1, NULL, &g, NULL, 0, NULL, NULL));
    }
    if (h->stage == -1) CHECK(clFlush(h->q));
    hold(h);
    clReleaseKernel(k);
    return NULL;
}

static void *launch_from_thread(void *arg) {
    struct launcher *l = arg;
    cl_int err;
    cl_kernel k = clCreateKernel(prog, "advance", &err); CHECKE(err);
    for (int i = 0; i < 16; i++) l->evs[i] = step(l->q, k, l->m, (cl_uint)i, 0, NULL);
    CHECK(clFlush(l->q));
    clReleaseKernel(k);
    return NULL;
}

int main(void) {
    cl_platform_id plat;
    cl_int err;
    CHECK(clGetPlatformIDs(1, &plat, NULL));
    CHECK(clGetDeviceIDs(plat, CL_DEVICE_TYPE_ALL, 1, &dev, NULL));
    ctx = clCreateContext(NULL, 1, &dev, NULL, NULL, &err); CHECKE(err);
    cl_command_queue q = clCreateCommandQueueWithProperties(ctx, dev, NULL, &err); CHECKE(err);
    prog = clCreateProgramWithSource(ctx, 1, &SRC, NULL, &err); CHECKE(err);
    CHECK(clBuildProgram(prog, 1, &dev, NULL, NULL, NULL));
    cl_kernel k = clCreateKernel(prog, "advance", &err); CHECKE(err);
    cl_int st;

    /* ---- a loop keeping three launches queued, waiting for the oldest */
    {
        cl_mem m = zeroed(q);
        cl_event out[3];
        int n = 0, waited = 0;
        for (cl_uint i = 0; i < 200; i++) {
            out[n++] = step(q, k, m, i, 0, NULL);
            if (n == 3) {
                CHECK(clWaitForEvents(1, &out[0]));
                CHECK(clGetEventInfo(out[0], CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st,
                                     NULL));
                waited += st == CL_COMPLETE;
                clReleaseEvent(out[0]);
                out[0] = out[1];
                out[1] = out[2];
                n = 2;
            }
        }
        CHECK(clWaitForEvents(n, out));
        for (int i = 0; i < n; i++) clReleaseEvent(out[i]);
        printf("queued loop: %d waits saw CL_COMPLETE, checksum %016llx\n", waited,
               (unsigned long long)checksum(q, m));
        clReleaseMemObject(m);
    }

    /* ---- one wait for many launches, in and out of order of enqueue */
    {
        cl_mem m = zeroed(q);
        cl_event evs[8], rev[8];
        for (cl_uint i = 0; i < 8; i++) evs[i] = step(q, k, m, i + 1, 0, NULL);
        for (int i = 0; i < 8; i++) rev[i] = evs[7 - i];
        CHECK(clWaitForEvents(8, rev));
        CHECK(clWaitForEvents(8, evs));
        int complete = 0;
        for (int i = 0; i < 8; i++) {
            CHECK(clGetEventInfo(evs[i], CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st,
                                 NULL));
            complete += st == CL_COMPLETE;
            clReleaseEvent(evs[i]);
        }
        printf("eight launches, one wait: %d complete, checksum %016llx\n", complete,
               (unsigned long long)checksum(q, m));
        clReleaseMemObject(m);
    }

    /* ---- a kernel longer than hira's wait on its board */
    {
        cl_mem m = zeroed(q);
        cl_kernel ks = clCreateKernel(prog, "spin", &err); CHECKE(err);
        cl_uint iters = 2000000;
        size_t g = N;
        cl_event ev;
        CHECK(clSetKernelArg(ks, 0, sizeof m, &m));
        CHECK(clSetKernelArg(ks, 1, sizeof iters, &iters));
        CHECK(clEnqueueNDRangeKernel(q, ks, 1, NULL, &g, NULL, 0, NULL, &ev));
        CHECK(clWaitForEvents(1, &ev));
        CHECK(clGetEventInfo(ev, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st, NULL));
        printf("long kernel: wait ok, status %d, checksum %016llx\n", st,
               (unsigned long long)checksum(q, m));
        clReleaseEvent(ev);
        clReleaseKernel(ks);
        clReleaseMemObject(m);
    }

    /* ---- launches behind a user event that fails */
    {
        cl_mem m = zeroed(q);
        cl_command_queue q2 = clCreateCommandQueueWithProperties(ctx, dev, NULL, &err);
        CHECKE(err);
        cl_event ue = clCreateUserEvent(ctx, &err); CHECKE(err);
        cl_event gated = step(q2, k, m, 9, 1, &ue);
        cl_event ok = step(q, k, m, 1, 0, NULL);
        CHECK(clWaitForEvents(1, &ok));
        CHECK(clSetUserEventStatus(ue, -77));
        cl_int w = clWaitForEvents(1, &gated);
        CHECK(clGetEventInfo(gated, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st, NULL));
        printf("gated by a failed user event: wait=%d (expect %d), status negative=%d\n", w,
               CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST, st < 0);
        cl_event both[2] = {ok, gated};
        printf("wait for it with a completed one: %d\n", clWaitForEvents(2, both));
        clReleaseEvent(gated);
        clReleaseEvent(ok);
        clReleaseEvent(ue);
        clReleaseCommandQueue(q2);
        clReleaseMemObject(m);
    }

    /* ---- events of launches another thread made */
    {
        struct launcher l;
        l.q = clCreateCommandQueueWithProperties(ctx, dev, NULL, &err); CHECKE(err);
        l.m = zeroed(l.q);
        pthread_t th;
        pthread_create(&th, NULL, launch_from_thread, &l);
        pthread_join(th, NULL);
        CHECK(clWaitForEvents(16, l.evs));
        int complete = 0;
        for (int i = 0; i < 16; i++) {
            CHECK(clGetEventInfo(l.evs[i], CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st,
                                 NULL));
            complete += st == CL_COMPLETE;
            clReleaseEvent(l.evs[i]);
        }
        printf("another thread's launches: %d complete, checksum %016llx\n", complete,
               (unsigned long long)checksum(l.q, l.m));
        clReleaseMemObject(l.m);
        clReleaseCommandQueue(l.q);
    }

    /* ---- events of launches another thread made and has not flushed */
    {
        struct holder h;
        h.q = clCreateCommandQueueWithProperties(ctx, dev, NULL, &err); CHECKE(err);
        h.m = zeroed(h.q);
        pthread_mutex_init(&h.mu, NULL);
        pthread_cond_init(&h.cv, NULL);
        h.stage = 0;
        pthread_t th;
        pthread_create(&th, NULL, launch_and_hold, &h);
        until_held(&h);
        cl_int w = clWaitForEvents(4, h.evs);
        CHECK(clGetEventInfo(h.evs[3], CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st, NULL));
        printf("unflushed launches of a live thread: wait=%d status=%d\n", w, st);
        let_go(&h);
        pthread_join(th, NULL);
        printf("their checksum %016llx\n", (unsigned long long)checksum(h.q, h.m));
        for (int i = 0; i < 4; i++) clReleaseEvent(h.evs[i]);
        clReleaseMemObject(h.m);
        clReleaseCommandQueue(h.q);
    }

    /* ---- launches without events by a live thread, then clFinish and a read here: the
     * queue holds them for every thread (flushed by their thread, and not) */
    for (int flushed = 0; flushed < 2; flushed++) {
        uint64_t sums[20];
        for (int round = 0; round < 20; round++) {
            struct holder h;
            h.q = clCreateCommandQueueWithProperties(ctx, dev, NULL, &err); CHECKE(err);
            h.m = zeroed(h.q);
            pthread_mutex_init(&h.mu, NULL);
            pthread_cond_init(&h.cv, NULL);
            h.stage = flushed ? -1 : 0;
            pthread_t th;
            pthread_create(&th, NULL, launch_quietly_and_hold, &h);
            until_held(&h);
            CHECK(clFinish(h.q));
            sums[round] = checksum(h.q, h.m);
            let_go(&h);
            pthread_join(th, NULL);
            clReleaseMemObject(h.m);
            clReleaseCommandQueue(h.q);
        }
        int same = 0;
        for (int round = 0; round < 20; round++) same += sums[round] == sums[0];
        printf("another thread's launches without events (%s), clFinish here: checksum %016llx "
               "in %d of 20 rounds\n",
               flushed ? "flushed" : "not flushed", (unsigned long long)sums[0], same);
    }

    /* ---- a launch's event with a transfer's, and a launch waiting for a transfer */
    {
        cl_mem m = zeroed(q);
        uint32_t *h = malloc(N * 4);
        for (int i = 0; i < N; i++) h[i] = (uint32_t)i;
        cl_event wr;
        CHECK(clEnqueueWriteBuffer(q, m, CL_FALSE, 0, N * 4, h, 0, NULL, &wr));
        cl_event ev = step(q, k, m, 5, 1, &wr);
        cl_event both[2] = {ev, wr};
        CHECK(clWaitForEvents(2, both));
        printf("launch after a transfer: checksum %016llx\n",
               (unsigned long long)checksum(q, m));
        clReleaseEvent(ev);
        clReleaseEvent(wr);
        free(h);
        clReleaseMemObject(m);
    }

    /* ---- many events made and released: nothing may pile up */
    {
        cl_mem m = zeroed(q);
        long before = 0;
        for (cl_uint i = 0; i < 120000; i++) {
            cl_event ev = step(q, k, m, i, 0, NULL);
            if (i == 20000) {
                CHECK(clFinish(q));
                before = rss_kib();
            }
            clReleaseEvent(ev);
            if (i % 1000 == 999) CHECK(clFinish(q));
        }
        CHECK(clFinish(q));
        long grew = rss_kib() - before;
        printf("100000 more events made and released: memory grew under 8 MiB: %s\n",
               grew < 8192 ? "yes" : "no");
        if (grew >= 8192) fprintf(stderr, "grew by %ld KiB\n", grew);
        clReleaseMemObject(m);
    }

    clReleaseKernel(k);
    clReleaseProgram(prog);
    clReleaseCommandQueue(q);
    clReleaseContext(ctx);
    printf("done\n");
    return 0;
}
