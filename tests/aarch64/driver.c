/* Runs a TVM-compiled `main` (packed-call ABI) from an object file, without a TVM runtime.
 *
 * Used by tests/qemu_aarch64.py to execute aarch64 kernels under qemu-user.  Each argument
 * describes one tensor of the call, in order:
 *
 *     CODE,BITS,PATH,D0,D1,...
 *
 * CODE/BITS form the DLPack dtype (0 int, 1 uint, 2 float, 4 bfloat), PATH holds the tensor's
 * bytes (row-major), D0.. its shape.  After the call every tensor is written back to PATH.out.
 * Exit status: 0 on success, 2 on bad arguments or I/O, 3 when the kernel reports an error.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <dlpack/dlpack.h>
#include <tvm/ffi/c_api.h>

#define MAX_TENSORS 16
#define MAX_DIMS 8

int __tvm_ffi_main(void* self, const TVMFFIAny* args, int32_t num_args, TVMFFIAny* result);

/* The object calls these through slots a TVM module loader normally fills in. */
extern void* (*__TVMBackendAllocWorkspace)(int, int, uint64_t, int, int);
extern int (*__TVMBackendFreeWorkspace)(int, int, void*);

static void* alloc_workspace(int device_type, int device_id, uint64_t size, int code, int bits) {
  (void)device_type; (void)device_id; (void)code; (void)bits;
  return aligned_alloc(64, (size + 63) / 64 * 64);
}

static int free_workspace(int device_type, int device_id, void* ptr) {
  (void)device_type; (void)device_id;
  free(ptr);
  return 0;
}

void TVMFFIErrorSetRaisedFromCStrParts(const char* kind, const char** parts, int32_t n) {
  fprintf(stderr, "%s: ", kind);
  for (int32_t i = 0; i < n; ++i) fputs(parts[i], stderr);
  fputc('\n', stderr);
}

int main(int argc, char** argv) {
  static DLTensor tensors[MAX_TENSORS];
  static int64_t shapes[MAX_TENSORS][MAX_DIMS];
  static char paths[MAX_TENSORS][4096];
  static size_t sizes[MAX_TENSORS];
  TVMFFIAny args[MAX_TENSORS];
  int n = argc - 1;
  if (n < 1 || n > MAX_TENSORS) {
    fprintf(stderr, "usage: %s CODE,BITS,PATH,D0,D1,... (1 to %d tensors)\n", argv[0], MAX_TENSORS);
    return 2;
  }
  for (int t = 0; t < n; ++t) {
    char* spec = argv[t + 1];
    char* code = strtok(spec, ",");
    char* bits = strtok(NULL, ",");
    char* path = strtok(NULL, ",");
    if (!code || !bits || !path || strlen(path) >= sizeof(paths[t]) - 5) {
      fprintf(stderr, "bad tensor spec %d\n", t);
      return 2;
    }
    strcpy(paths[t], path);
    int ndim = 0;
    size_t count = 1;
    for (char* d = strtok(NULL, ","); d; d = strtok(NULL, ",")) {
      if (ndim == MAX_DIMS) return 2;
      shapes[t][ndim] = atoll(d);
      count *= (size_t)shapes[t][ndim++];
    }
    DLTensor* x = &tensors[t];
    x->device.device_type = kDLCPU;
    x->device.device_id = 0;
    x->ndim = ndim;
    x->dtype.code = (uint8_t)atoi(code);
    x->dtype.bits = (uint8_t)atoi(bits);
    x->dtype.lanes = 1;
    x->shape = shapes[t];
    x->strides = NULL;
    x->byte_offset = 0;
    sizes[t] = count * x->dtype.bits / 8;
    x->data = aligned_alloc(64, (sizes[t] + 63) / 64 * 64);
    FILE* f = fopen(path, "rb");
    if (!x->data || !f || fread(x->data, 1, sizes[t], f) != sizes[t]) {
      fprintf(stderr, "cannot read %zu bytes from %s\n", sizes[t], path);
      return 2;
    }
    fclose(f);
    memset(&args[t], 0, sizeof(args[t]));
    args[t].type_index = kTVMFFIDLTensorPtr;
    args[t].v_ptr = x;
  }
  __TVMBackendAllocWorkspace = alloc_workspace;
  __TVMBackendFreeWorkspace = free_workspace;
  TVMFFIAny result;
  memset(&result, 0, sizeof(result));
  if (__tvm_ffi_main(NULL, args, n, &result) != 0) return 3;
  for (int t = 0; t < n; ++t) {
    strcat(paths[t], ".out");
    FILE* f = fopen(paths[t], "wb");
    if (!f || fwrite(tensors[t].data, 1, sizes[t], f) != sizes[t]) return 2;
    fclose(f);
  }
  return 0;
}
