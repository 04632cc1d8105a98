// throw_error, and the GPU device of a build without the CUDA toolkit (nvcc absent or MEGADECODE_CUDA=OFF): the
// CUDA executors still run on the simulation; asking for the GPU is a clear error.
#include "device.h"
#include "megadecode/base/error.h"

namespace md::cuda {
void throw_error(const std::string& what) {
  throw Error(what);
}
}  // namespace md::cuda

#if !defined(MD_HAVE_CUDA)
namespace md::cuda {
std::unique_ptr<Device> make_gpu_device() {
  fail("no CUDA device: this megadecode was built without the CUDA toolkit (use --device cuda-sim)");
}
}  // namespace md::cuda
#endif
