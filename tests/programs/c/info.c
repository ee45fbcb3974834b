/* info.c - print platform/device info that must be identical natively and
 * through hira. Only stable, deterministic properties are printed. */
#define CL_TARGET_OPENCL_VERSION 300
#include <CL/cl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(x) do { cl_int _e = (x); if (_e != CL_SUCCESS) { \
    printf("ERROR %s -> %d (line %d)\n", #x, _e, __LINE__); exit(1); } } while (0)

static void plat_str(cl_platform_id p, cl_platform_info what, const char *label) {
    size_t sz = 0;
    CHECK(clGetPlatformInfo(p, what, 0, NULL, &sz));
    char *buf = malloc(sz + 1);
    CHECK(clGetPlatformInfo(p, what, sz, buf, NULL));
    buf[sz] = 0;
    printf("  %s: %s\n", label, buf);
    free(buf);
}

static void dev_str(cl_device_id d, cl_device_info what, const char *label) {
    size_t sz = 0;
    CHECK(clGetDeviceInfo(d, what, 0, NULL, &sz));
    char *buf = malloc(sz + 1);
    CHECK(clGetDeviceInfo(d, what, sz, buf, NULL));
    buf[sz] = 0;
    printf("    %s: %s\n", label, buf);
    free(buf);
}

static void dev_extensions(cl_device_id d) {
    size_t sz = 0;
    CHECK(clGetDeviceInfo(d, CL_DEVICE_EXTENSIONS, 0, NULL, &sz));
    char *buf = malloc(sz + 1);
    CHECK(clGetDeviceInfo(d, CL_DEVICE_EXTENSIONS, sz, buf, NULL));
    buf[sz] = 0;
    /* one extension per line so diffs are readable */
    printf("    extensions:\n");
    char *save = NULL;
    for (char *tok = strtok_r(buf, " ", &save); tok; tok = strtok_r(NULL, " ", &save))
        printf("      %s\n", tok);
    free(buf);
}

#define DEV_SCALAR(d, what, type, fmt, label) do { type _v; \
    CHECK(clGetDeviceInfo(d, what, sizeof(_v), &_v, NULL)); \
    printf("    %s: " fmt "\n", label, (unsigned long long)_v); } while (0)

static const char *type_name(cl_device_type t) {
    switch (t) {
    case CL_DEVICE_TYPE_CPU: return "CPU";
    case CL_DEVICE_TYPE_GPU: return "GPU";
    case CL_DEVICE_TYPE_ACCELERATOR: return "ACCELERATOR";
    case CL_DEVICE_TYPE_CUSTOM: return "CUSTOM";
    case CL_DEVICE_TYPE_DEFAULT: return "DEFAULT";
    default: return "OTHER";
    }
}

int main(void) {
    cl_uint np = 0;
    CHECK(clGetPlatformIDs(0, NULL, &np));
    printf("platforms: %u\n", np);
    cl_platform_id *plats = calloc(np, sizeof *plats);
    CHECK(clGetPlatformIDs(np, plats, NULL));
    for (cl_uint i = 0; i < np; i++) {
        printf("platform %u:\n", i);
        plat_str(plats[i], CL_PLATFORM_NAME, "name");
        plat_str(plats[i], CL_PLATFORM_VENDOR, "vendor");
        plat_str(plats[i], CL_PLATFORM_VERSION, "version");
        plat_str(plats[i], CL_PLATFORM_PROFILE, "profile");
        cl_uint nd = 0;
        cl_int err = clGetDeviceIDs(plats[i], CL_DEVICE_TYPE_ALL, 0, NULL, &nd);
        if (err == CL_DEVICE_NOT_FOUND) nd = 0; else CHECK(err);
        printf("  devices: %u\n", nd);
        if (nd == 0) continue;
        cl_device_id *devs = calloc(nd, sizeof *devs);
        CHECK(clGetDeviceIDs(plats[i], CL_DEVICE_TYPE_ALL, nd, devs, NULL));
        for (cl_uint j = 0; j < nd; j++) {
            cl_device_id d = devs[j];
            printf("  device %u:\n", j);
            dev_str(d, CL_DEVICE_NAME, "name");
            dev_str(d, CL_DEVICE_VENDOR, "vendor");
            dev_str(d, CL_DEVICE_VERSION, "version");
            dev_str(d, CL_DRIVER_VERSION, "driver version");
            dev_str(d, CL_DEVICE_OPENCL_C_VERSION, "opencl c version");
            dev_str(d, CL_DEVICE_PROFILE, "profile");
            cl_device_type t;
            CHECK(clGetDeviceInfo(d, CL_DEVICE_TYPE, sizeof t, &t, NULL));
            printf("    type: %s\n", type_name(t));
            DEV_SCALAR(d, CL_DEVICE_VENDOR_ID, cl_uint, "0x%llx", "vendor id");
            DEV_SCALAR(d, CL_DEVICE_MAX_COMPUTE_UNITS, cl_uint, "%llu", "max compute units");
            DEV_SCALAR(d, CL_DEVICE_MAX_WORK_ITEM_DIMENSIONS, cl_uint, "%llu", "max work item dims");
            DEV_SCALAR(d, CL_DEVICE_MAX_WORK_GROUP_SIZE, size_t, "%llu", "max work group size");
            DEV_SCALAR(d, CL_DEVICE_GLOBAL_MEM_SIZE, cl_ulong, "%llu", "global mem size");
            DEV_SCALAR(d, CL_DEVICE_MAX_MEM_ALLOC_SIZE, cl_ulong, "%llu", "max mem alloc size");
            DEV_SCALAR(d, CL_DEVICE_LOCAL_MEM_SIZE, cl_ulong, "%llu", "local mem size");
            DEV_SCALAR(d, CL_DEVICE_MEM_BASE_ADDR_ALIGN, cl_uint, "%llu", "mem base addr align (bits)");
            DEV_SCALAR(d, CL_DEVICE_ADDRESS_BITS, cl_uint, "%llu", "address bits");
            DEV_SCALAR(d, CL_DEVICE_IMAGE_SUPPORT, cl_bool, "%llu", "image support");
            DEV_SCALAR(d, CL_DEVICE_ENDIAN_LITTLE, cl_bool, "%llu", "endian little");
            DEV_SCALAR(d, CL_DEVICE_AVAILABLE, cl_bool, "%llu", "available");
            DEV_SCALAR(d, CL_DEVICE_COMPILER_AVAILABLE, cl_bool, "%llu", "compiler available");
            cl_command_queue_properties qp;
            CHECK(clGetDeviceInfo(d, CL_DEVICE_QUEUE_PROPERTIES, sizeof qp, &qp, NULL));
            printf("    queue properties: 0x%llx\n", (unsigned long long)qp);
            dev_extensions(d);
        }
        free(devs);
    }
    free(plats);
    return 0;
}
