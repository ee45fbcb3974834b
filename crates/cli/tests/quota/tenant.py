import os, sys
import numpy as np
import pyopencl as cl

RW = cl.mem_flags.READ_WRITE

def code(f):
    try:
        f()
        return 0
    except cl.Error as e:
        return e.code

def say(*a):
    print(*a, flush=True)

limit, wait = int(sys.argv[1]), sys.argv[2] == "wait"
dev = cl.get_platforms()[0].get_devices()[0]
ctx = cl.Context([dev])
q = cl.CommandQueue(ctx)
say("pid", os.getpid())
say("global", dev.global_mem_size)
say("maxalloc", dev.max_mem_alloc_size)
say("over", code(lambda: cl.Buffer(ctx, RW, limit + 1)))
data = np.arange((limit - 4096) // 4, dtype=np.uint32)
a = cl.Buffer(ctx, RW, data.nbytes)
cl.enqueue_copy(q, a, data).wait()
say("under", 0)
b = cl.Buffer(ctx, RW, 4096)
say("exact", 0)
say("one_more", code(lambda: cl.Buffer(ctx, RW, 1)))
b.release()
say("after_release", code(lambda: cl.Buffer(ctx, RW, 4096)))
if wait:
    say("ready")
    sys.stdin.readline()
    say("lowered", code(lambda: cl.Buffer(ctx, RW, 4096)))
    back = np.empty_like(data)
    cl.enqueue_copy(q, back, a).wait()
    say("intact", int(np.array_equal(back, data)))
    say("global_after", dev.global_mem_size)
    say("maxalloc_after", dev.max_mem_alloc_size)
    a.release()
    say("small", code(lambda: cl.Buffer(ctx, RW, 1 << 20)))
say("done")
