// libFuzzer harness for the safetensors parser. Any input must either parse into tensors that lie
// inside the input and agree with their shapes, or be rejected with md::Error; anything else
// (another exception, a sanitizer report, a broken invariant) is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "megadecode/base/error.h"
#include "megadecode/model/safetensors.h"

namespace {
volatile unsigned g_sink;  // keeps the reads of tensor data from being optimized away
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const md::SafetensorsContents c = md::parse_safetensors_buffer(data, size, "fuzz-input");
    unsigned sum = 0;
    for (const auto& [name, t] : c.tensors) {
      const auto* p = static_cast<const uint8_t*>(t.data);
      if (p < data || p > data + size || t.nbytes > static_cast<size_t>(data + size - p)) abort();
      if (t.nbytes != static_cast<size_t>(t.numel()) * md::dtype_size(t.dtype)) abort();
      // libFuzzer hands over an exactly sized heap copy, so ASan flags any byte outside it.
      for (size_t i = 0; i < t.nbytes; ++i) sum += p[i];
    }
    g_sink = sum;
  } catch (const md::Error&) {
  }
  return 0;
}
