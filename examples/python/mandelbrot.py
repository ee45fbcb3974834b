"""An unmodified pyopencl program: a Mandelbrot set on the first OpenCL device, with a
checksum so runs can be compared. It knows nothing of hira."""
import hashlib
import sys

import numpy as np
import pyopencl as cl

W, H, ITERS = int(sys.argv[1]) if len(sys.argv) > 1 else 1024, 768, 255
SRC = """
__kernel void mandel(__global uchar *out, int w, int h, int iters) {
    int x = get_global_id(0), y = get_global_id(1);
    float cr = -2.0f + 3.0f * x / w, ci = -1.2f + 2.4f * y / h, zr = 0, zi = 0;
    int i = 0;
    for (; i < iters && zr * zr + zi * zi < 4.0f; i++) {
        float t = zr * zr - zi * zi + cr; zi = 2 * zr * zi + ci; zr = t;
    }
    out[y * w + x] = (uchar)i;
}
"""

platform = cl.get_platforms()[0]
ctx = cl.Context(platform.get_devices())
queue = cl.CommandQueue(ctx)
mandel = cl.Kernel(cl.Program(ctx, SRC).build(), "mandel")
out = cl.Buffer(ctx, cl.mem_flags.WRITE_ONLY, W * H)
for _ in range(8):
    mandel(queue, (W, H), None, out, np.int32(W), np.int32(H), np.int32(ITERS))
img = np.empty(W * H, dtype=np.uint8)
cl.enqueue_copy(queue, img, out)
print(f"mandelbrot {W}x{H}: inside={int((img == ITERS).sum())} sha1={hashlib.sha1(img.tobytes()).hexdigest()[:16]}")
