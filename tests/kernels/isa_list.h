// Every ISA level this CPU supports (cpu_features.h), lowest first, for the kernel tests that run
// each path; restores the start-up level when destroyed.
#pragma once
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "megadecode/kernels/cpu/cpu_features.h"

namespace md::cpu::test {

struct IsaList {
  std::vector<std::string> names;
  IsaList() {
    for (int i = 0; i <= static_cast<int>(hardware_isa()); ++i)
      names.emplace_back(isa_name(static_cast<Isa>(i)));
  }
  ~IsaList() { reset_isa(); }
  void use(const std::string& n) const {
    Isa isa;
    ASSERT_TRUE(parse_isa(n, &isa)) << n;
    ASSERT_EQ(set_isa(isa), isa) << n;
  }
};

}  // namespace md::cpu::test
