#include "megadecode/base/util.h"

#include <fmt/format.h>

namespace md {

std::string human_bytes(double b) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  int u = 0;
  while (b >= 1000.0 && u < 4) {
    b /= 1000.0;
    ++u;
  }
  return fmt::format("{:.2f} {}", b, units[u]);
}

}  // namespace md
