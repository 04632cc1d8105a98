// Errors: everything from outside (files, configs, CLI, requests) is validated at the boundary and
// reported as md::Error with a one-line message naming what is wrong.
#pragma once
#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace md {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace md

// Checks a condition on outside input; on failure throws md::Error with the formatted message.
#define MD_CHECK(cond, ...)                  \
  do {                                       \
    if (!(cond)) ::md::fail(__VA_ARGS__);    \
  } while (0)
