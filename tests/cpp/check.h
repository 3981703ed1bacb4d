// CHECK and the case runner shared by the C++ unit tests under tests/cpp.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>

// On failure, says where and exits 1.
#define CHECK(cond)                                                                 \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

// `binary <case>` runs one case, then `after` (a check every case must pass), and prints
// "ok <case>"; `binary` alone lists the cases.
inline int run_case_main(int argc, char** argv, const std::map<std::string, std::function<void()>>& cases,
                         const std::function<void()>& after = {}) {
  if (argc != 2 || cases.count(argv[1]) == 0) {
    for (const auto& [name, fn] : cases) std::printf("%s\n", name.c_str());
    return argc == 1 ? 0 : 2;
  }
  cases.at(argv[1])();
  if (after) after();
  std::printf("ok %s\n", argv[1]);
  return 0;
}
